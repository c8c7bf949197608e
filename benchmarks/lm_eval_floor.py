"""The least time any exact `--model` needs on `bench_lm_eval`'s tasks here (issue 45).

Model: every variant is a whole `lm_eval` process. Whatever the model backend, it pays

* lm-eval's own work: its imports, its task index, the datasets, the few-shot contexts, the
  metrics and the results file. That is measured as a variant of its own in the same rounds,
  `--model dummy` (lm-eval's model that computes nothing and answers at once);
* a cold start to a loaded model: torch and the family's `transformers` code imported, the
  weights loaded (`benchmarks/peers/cold_start.py`, measured before the rounds and after, the
  fastest kept phase by phase);
* the compute floor of the requests (`benchmarks/floor.py`, as `bench_peers` counts `score`):
  each token of the contexts' prefix tree (the contexts minus their last token) once: the shots
  once, then each question's own start (before 2026-12-05 17:00 UTC: each distinct context whole),
  every continuation (the context's last
  token and the continuation but its last), no padding, at the best rate measured for the
  shape, plus each suffix token's read of its prefix's keys; for `generate_until`, each prompt
  once and no decode step (a lower bound: a generation may stop at its first token).

`least_s` = lm-eval's own (median) + the cold start + the compute floor. It is a lower bound:
the three are measured apart, at their best.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import floor

FEWSHOT = 5  # bench_lm_eval's num_fewshot (sampler first_n: the first rows of train.jsonl)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def mc_pairs(data: Path) -> list[tuple[str, str]]:
    """(context, continuation) of every `bench_mc` request, as lm-eval builds them from the
    task's YAML (`Question: ...\\nAnswer:`, gold answers after the shots, "\\n\\n" between)."""
    shots = "".join(
        f"Question: {r['question']}\nAnswer: {r['choices'][r['gold']]}\n\n"
        for r in _rows(data / "train.jsonl")[:FEWSHOT]
    )
    return [
        (f"{shots}Question: {r['question']}\nAnswer:", f" {c}") for r in _rows(data / "mc.jsonl") for c in r["choices"]
    ]


def segments(data: Path, model_dir: str) -> tuple[list[int], list[tuple[int, int]], dict]:
    """(segment lengths, (prefix length, tokens) of each suffix, counts) of both tasks."""
    from transformers import AutoTokenizer

    from forge.runtime.tokens.token_rule import PairEncoder

    tok = AutoTokenizer.from_pretrained(model_dir)
    prefixes: dict[tuple, int] = {}
    segs, reads = [], []
    for ctx, cont in PairEncoder(tok, True).pairs(mc_pairs(data)):
        run = (ctx + cont[:-1])[-2048:]
        at = len(run) - len(cont)
        prefixes[tuple(run[:at])] = at
        segs.append(len(cont))
        reads.append((at, len(cont)))
    prompts = [len(tok(r["prompt"])["input_ids"]) for r in _rows(data / "gen.jsonl")]
    counts = {
        "requests": len(segs),
        "prefixes": len(prefixes),
        "prefix_tokens": sum(prefixes.values()),
        "prefix_tree_tokens": sum(trie_segments(prefixes)),
        "suffix_tokens": sum(segs),
        "prompt_tokens": sum(prompts),
    }
    return [*trie_segments(prefixes), *segs, *prompts], reads, counts


def trie_segments(prefixes) -> list[int]:
    """The token runs a set of prefixes needs computed at least once: their prefix tree's, each token
    of it once (a causal model's keys for a start that prefixes share are those of every one of them).
    In sorted order, each prefix adds what follows its common start with the one before."""
    out, last = [], ()
    for prefix in sorted(prefixes):
        common = next((k for k, (a, b) in enumerate(zip(prefix, last)) if a != b), min(len(prefix), len(last)))
        if len(prefix) > common:
            out.append(len(prefix) - common)
        last = prefix
    return out


def compute_floor(data: Path, model_dir: str, threads: int) -> dict:
    """The compute floor's seconds (`floor.floors`) of both tasks, and the counts behind it."""
    segs, reads, counts = segments(data, model_dir)
    dense = floor.Dense(model_dir, "causal", threads)
    rates = floor.measure(dense, floor.shapes(segs))
    read_rates = floor.measure_reads(dense.config, floor.representatives(p for p, _ in reads))
    return {**floor.floors(segs, rates, reads, read_rates), **counts}
