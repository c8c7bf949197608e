"""The benchmarks' workloads, defined in code with fixed seeds; every benchmark that needs one takes it from here.

* `geometry` / `items`: the reference workload (issue: token-aware packing): 3,000 prompts, 12
  prefixes with token lengths spread evenly over 64..384, statement lengths lognormal with
  median 40 tokens clipped to 4..400, arrival shuffled;
* `heavy_tail`: lengths from tens to thousands of tokens behind 5 prefixes, a few past any card
  (`heavy_tail_rows`: a heavy tail as text rows);
* `questions`: ten-shot, four-choice questions built like the embedded multiple-choice set
  (`score`'s input);
* `statements`: the embedded statements (`probe_gen`'s input), repeated under new ids past
  their number, optionally over more few-shot prefixes (`regroup`);
* `texts`: texts of varied length like a retrieval corpus (`embed`'s input);
* `probe_split`: a `probe_gen` row's tokens by Forge's token rule.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

from forge.vocab.geometry import Item


def geometry(n: int = 3000, n_prefixes: int = 12, seed: int = 0):
    """(prefix index per item, prefix lengths, suffix lengths) as numpy arrays."""
    rng = np.random.default_rng(seed)
    prefix_lens = np.linspace(64, 384, n_prefixes).round().astype(np.int64)
    which = rng.integers(0, n_prefixes, n)
    suffix = np.clip(np.round(rng.lognormal(np.log(40), 0.75, n)), 4, 400).astype(np.int64)
    order = rng.permutation(n)  # arrival order: shuffled
    return which[order], prefix_lens, suffix[order]


def items(n: int = 3000, n_prefixes: int = 12, seed: int = 0, vocab: int | None = None, bos: int = 1) -> list[Item]:
    """Items of the workload; with `vocab`, random token ids (prefix ids fixed per prefix)."""
    which, prefix_lens, suffix = geometry(n, n_prefixes, seed)
    rng = np.random.default_rng(seed + 1)
    prefixes = None
    if vocab is not None:
        prefixes = [[bos] + rng.integers(4, vocab, int(p) - 1).tolist() for p in prefix_lens]
    keys = [f"prefix{k}" for k in range(n_prefixes)]  # a producer names each prefix once
    out = []
    for i, (k, s) in enumerate(zip(which.tolist(), suffix.tolist())):
        p = int(prefix_lens[k])
        tokens = prefixes[k] + rng.integers(4, vocab, s).tolist() if prefixes is not None else None
        out.append(Item(str(i), p + s, keys[k], p, tokens, (i, None)))
    return out


def heavy_tail(n: int, seed: int = 5) -> list[Item]:
    """Suffix lengths Pareto-distributed from ~10 to over 5,000 tokens behind 5 prefixes of 23-353 tokens."""
    rng = np.random.default_rng(seed)
    prefix_lens = np.array([23, 80, 150, 240, 353])
    which = rng.integers(0, len(prefix_lens), n)
    suffix = np.minimum((rng.pareto(0.9, n) + 1) * 12, 6000).astype(int)
    return [
        Item(f"t{i}", int(prefix_lens[k] + s), f"p{k}", int(prefix_lens[k]))
        for i, (k, s) in enumerate(zip(which.tolist(), suffix.tolist()))
    ]


def heavy_tail_rows(n: int, seed: int = 5) -> list[dict]:
    """`n` input rows of Pareto-distributed length, 10 to ~1,900 words: a heavy tail as text."""
    rng = random.Random(seed)
    words = "the of and a to in is was he for it with as his on be at by".split()
    sizes = (int(rng.paretovariate(0.9) * 12) % 1900 + 10 for _ in range(n))
    return [{"id": f"r{i}", "text": " ".join(rng.choice(words) for _ in range(k))} for i, k in enumerate(sizes)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def questions(n: int, shots: int = 10, seed: int = 7) -> list[dict]:
    """`n` multiple-choice rows, each `shots` solved questions of its kind before it (10: ~440
    tokens of context with the embedded tokenizer) and 4 choices."""
    from forge.functions.assets.build_multiple_choice import questions as build

    return build(n, shots=shots, seed=seed)


def regroup(rows: list[dict], groups: int) -> list[dict]:
    """The rows with their few-shot prefixes spread over `groups` distinct ones (round robin over
    the rows that have one): each embedded prefix (an instruction line, then example lines) and
    the variants that drop its first 1, 2, ... examples, all real few-shot text."""
    variants = []
    for p in dict.fromkeys(r["prefix"] for r in rows if r.get("prefix")):
        head, *shots = p.splitlines(keepends=True)
        variants += [head + "".join(shots[j:]) for j in range(len(shots))]
    variants = variants[:groups]
    out, k = [], 0
    for r in rows:
        if r.get("prefix"):
            r = {**r, "prefix": variants[k % len(variants)]}
            k += 1
        out.append(r)
    return out


def embedded_statements() -> list[dict]:
    from forge.functions.assets import embedded_dataset_path

    return [json.loads(line) for line in embedded_dataset_path().read_text().splitlines() if line.strip()]


def statements(n: int, groups: int | None = None) -> list[dict]:
    """The first `n` embedded statements; past their number they come round again under new ids
    (with `groups`, each time after another few-shot prefix, so the prompts differ)."""
    base = embedded_statements()
    rows = [
        {**r, "id": f"{r['id']}-{k // len(base)}"} if k >= len(base) else r
        for k, r in ((k, base[k % len(base)]) for k in range(n))
    ]
    return regroup(rows, groups) if groups else rows


def texts(n: int, seed: int = 0) -> list[str]:
    """`n` texts like a retrieval corpus: 55% one statement, 30% a paragraph (a few-shot prefix and
    a statement), 15% a long document (three prefixes end to end, often past MiniLM's 256 tokens)."""
    rows = embedded_statements()
    prefixes = sorted({r["prefix"] for r in rows if r.get("prefix")})
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        row = rng.choice(rows)
        u = rng.random()
        if u < 0.55:
            out.append(row["text"])
        elif u < 0.85:
            out.append((row.get("prefix") or "") + row["text"])
        else:
            out.append(" ".join(rng.sample(prefixes, 3)) + row["text"])
    return out


def probe_split(tok, row: dict) -> tuple[list[int], list[int]]:
    """(prefix tokens, own tokens) of a `probe_gen` row by Forge's token rule
    (forge/runtime/tokens/token_rule.py): the prefix alone with the special tokens, the text after it
    without them; a text without a prefix with them."""
    prefix = list(tok(row["prefix"])["input_ids"]) if row.get("prefix") else []
    return prefix, list(tok(row["text"], add_special_tokens=not prefix)["input_ids"])
