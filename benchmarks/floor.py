"""The cache-aware floor of a workload (issue 20), measured on this machine in the benchmark's run.

Model: a workload is its segments, the token runs that must be computed at least once: each
distinct prefix once (one device), and every suffix (for `score`: the context's last token and
the continuation but its last; for `probe_gen`: the statement; for `embed`: the text). The floor
is the time those segments take with no padding, at the best rate this machine reaches for their
shapes: dense, unpadded forwards of the model without its head, measured over rows x length.

Two floors, from the same measurements:

* **by shape** (what the tables call "floor"): a segment of L tokens runs at the rate of rows of
  the longest measured length at most L (the measured lengths are quantiles of the workload's
  own segment lengths, so that is the nearest below), or, when L < `PACK_MAX`, at the rate of any
  measured row length from L to `PACK_MAX` if faster, as if packed with other short segments into
  such rows. A suffix's attention to its prefix is not counted, so this stays a lower bound.
* **any shape**: every token at the best rate over all shapes measured. This is what the tables
  before 2026-12-01 16:44 UTC called the floor; it prices a 448-token context at the rate of
  128-token rows, which no forward of that context reaches, so it is a looser bound.
"""

from __future__ import annotations

import time

import numpy as np

GRID_LENGTHS = (64, 128, 256, 512)  # row lengths measured besides the workload's own
GRID_TOKENS = (2048, 8192)  # token slots per forward: a small step, and a Forge batch's budget (lm-eval's 32 x ~450)
PACK_MAX = 128  # segments shorter than this may share rows up to this long (packed rows)
QUANTILES = (0.0, 0.25, 0.5, 0.75, 1.0)


def representatives(lengths) -> list[int]:
    """The segment lengths measured for a workload: quantiles of its distinct lengths."""
    distinct = np.unique(np.asarray(list(lengths), dtype=np.int64))
    if not len(distinct):
        return []
    return sorted({int(distinct[round(q * (len(distinct) - 1))]) for q in QUANTILES})


def shapes(segments) -> set[tuple[int, int]]:
    """(rows, length) of every forward to measure: each representative and grid length, filling
    each of `GRID_TOKENS` slots (one row at least)."""
    lengths = {*representatives(segments), *GRID_LENGTHS}
    return {(max(1, tokens // length), length) for length in lengths for tokens in GRID_TOKENS}


def measure(model_dir: str, todo: set[tuple[int, int]], loader: str, threads: int) -> dict[tuple[int, int], float]:
    """Tokens/s of a dense forward of `rows x length` random tokens, per shape (best of 2, warmed)."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    torch.set_num_threads(threads)
    cls = AutoModelForCausalLM if loader == "causal" else AutoModel
    model = cls.from_pretrained(model_dir, dtype=torch.float32).eval()
    body = getattr(model, "model", model)  # the decoder without its LM head
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    rates = {}
    with torch.inference_mode():
        for rows, length in sorted(todo):
            ids = torch.randint(4, vocab, (rows, length), generator=g)
            body(input_ids=ids)  # warm
            dt = []
            for _ in range(2):
                t0 = time.perf_counter()
                body(input_ids=ids)
                dt.append(time.perf_counter() - t0)
            rates[rows, length] = rows * length / min(dt)
    return rates


def best(*runs: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """Per shape, the best rate of several measurements (the machine's speed drifts)."""
    out: dict[tuple[int, int], float] = {}
    for run in runs:
        for shape, rate in run.items():
            out[shape] = max(out.get(shape, 0.0), rate)
    return out


def rate_for(length: int, by_length: dict[int, float]) -> float:
    """The rate a segment of `length` tokens is priced at (see the module's "by shape")."""
    below = [ell for ell in by_length if ell <= length]
    rate = by_length[max(below)] if below else by_length[min(by_length)]
    if length < PACK_MAX:
        rate = max([rate, *(r for ell, r in by_length.items() if length <= ell <= PACK_MAX)])
    return rate


def floors(segments, rates: dict[tuple[int, int], float]) -> dict[str, float]:
    """Both floors of `segments` (lengths) in seconds, and the rates they used."""
    by_length: dict[int, float] = {}
    for (_, length), rate in rates.items():
        by_length[length] = max(by_length.get(length, 0.0), rate)
    lengths, counts = np.unique(np.asarray(list(segments), dtype=np.int64), return_counts=True)
    tokens = int((lengths * counts).sum())
    by_shape = sum(int(n) * int(ell) / rate_for(int(ell), by_length) for ell, n in zip(lengths, counts))
    top = max(by_length.values())
    return {"tokens": tokens, "by_shape_s": by_shape, "any_shape_s": tokens / top, "best_rate": top}
