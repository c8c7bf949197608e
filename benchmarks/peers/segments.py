"""What each `bench_peers` workload asks of any exact tool: its rows written for every variant, and
its tokens as the floor counts them (`benchmarks/floor.py`).

`segments`: the token runs that must be computed at least once (each distinct prefix once, every
suffix); `spans`: (start, end) of each, positions within its sequence (a suffix after a prefix of
p tokens starts at p), for the attention share of the FLOPs; `full_spans`: every sequence whole,
as a tool without a prefix cache computes it.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks import workloads


def _tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def score(path: Path, n: int, model_dir: str) -> dict:
    """`n` ten-shot questions, one request per choice, tokenized as lm-eval's `_encode_pair`."""
    from forge.runtime.tokens.token_rule import PairEncoder

    rows = workloads.questions(n, shots=10, seed=7)
    workloads.write_jsonl(path, rows)
    enc = PairEncoder(_tokenizer(model_dir), True)
    prefixes, suffix, useful, spans, full = {}, 0, 0, [], []
    for r in rows:
        for c in r["choices"]:
            ctx, cont = enc.pair(r["context"], " " + c)
            prefixes[tuple(ctx[:-1])] = len(ctx) - 1
            suffix += len(cont)  # the context's last token and cont[:-1]
            useful += len(ctx) + len(cont) - 1
            spans.append((len(ctx) - 1, len(ctx) + len(cont) - 1))
            full.append((0, len(ctx) + len(cont) - 1))
    spans += [(0, p) for p in prefixes.values()]
    return {
        "rows": len(rows),
        "requests": sum(len(r["choices"]) for r in rows),
        "useful": useful,
        "floor_tokens": sum(prefixes.values()) + suffix,
        "segments": [e - s for s, e in spans],
        "spans": spans,
        "full_spans": full,
        "gold": {str(r["id"]): r["gold"] for r in rows},
        "choices": {str(r["id"]): r["choices"] for r in rows},
    }


def probe_gen(path: Path, n: int, model_dir: str, groups: int | None = None) -> dict:
    """`n` embedded statements (over `groups` few-shot prefixes), by Forge's token rule."""
    rows = workloads.statements(n, groups)
    workloads.write_jsonl(path, rows)
    tok = _tokenizer(model_dir)
    prefixes, suffix, useful, spans, full = {}, 0, 0, [], []
    for r in rows:
        pre, own = workloads.probe_split(tok, r)
        p, s = len(pre), len(own)
        if p:
            prefixes[r["prefix"]] = p
        suffix += s
        useful += p + s
        spans.append((p, p + s))
        full.append((0, p + s))
    spans += [(0, p) for p in prefixes.values()]
    return {
        "rows": len(rows),
        "useful": useful,
        "floor_tokens": sum(prefixes.values()) + suffix,
        "segments": [e - s for s, e in spans],
        "spans": spans,
        "full_spans": full,
    }


def embed(path: Path, n: int, model_dir: str) -> dict:
    """`n` texts like a retrieval corpus, truncated to MiniLM's 256 tokens."""
    texts = workloads.texts(n)
    workloads.write_jsonl(path, [{"id": f"t{i:05d}", "text": t} for i, t in enumerate(texts)])
    lens = [len(x) for x in _tokenizer(model_dir)(texts, truncation=True, max_length=256)["input_ids"]]
    return {"rows": n, "useful": sum(lens), "floor_tokens": sum(lens), "segments": lens, "spans": [], "full_spans": []}
