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
  such rows. Each suffix token also reads its prefix's keys and values: one attention per layer
  over the prefix, priced at the time of one large attention of many queries over a prefix of
  that length, every query sharing its keys (`measure_reads`; the cheapest way any exact
  forward reads them), at the longest measured prefix length at most its own. The tables before
  2026-12-02 12:40 UTC left that read out; it is a few percent of the floor on the embedded
  model's few-shot `probe_gen` rows (0.05 of 0.92 s) and grows with attention's share.
* **any shape**: every token at the best rate over all shapes measured, no prefix reads. This is
  what the tables before 2026-12-01 16:44 UTC called the floor; it prices a 448-token context at
  the rate of 128-token rows, which no forward of that context reaches, so it is a looser bound.
"""

from __future__ import annotations

import time

import numpy as np

GRID_LENGTHS = (64, 128, 256, 512)  # row lengths measured besides the workload's own
GRID_TOKENS = (2048, 8192)  # token slots per forward: a small step, and a Forge batch's budget (lm-eval's 32 x ~450)
PACK_MAX = 128  # segments shorter than this may share rows up to this long (packed rows)
QUANTILES = (0.0, 0.25, 0.5, 0.75, 1.0)
READ_QUERIES = 2048  # queries in the timed attention over a prefix's keys (per query flat past a few hundred)
#: a small forward timed next to every Forge round, and among the floor's own shapes: how fast the
#: machine runs at that moment against when the floor was measured (its speed drifts)
PROBE = (8, 128)


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


class Dense:
    """The model without its head, loaded once in this process: the rate of dense forwards of
    random tokens, by shape."""

    def __init__(self, model_dir: str, loader: str, threads: int):
        import torch
        from transformers import AutoModel, AutoModelForCausalLM

        torch.set_num_threads(threads)
        cls = AutoModelForCausalLM if loader == "causal" else AutoModel
        model = cls.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.body = getattr(model, "model", model)  # the decoder without its LM head
        self.config = model.config
        self.vocab = model.config.vocab_size
        self.generator = torch.Generator().manual_seed(0)

    def rate(self, rows: int, length: int, repeats: int = 2) -> float:
        """Tokens/s of a forward of `rows x length` random tokens (best of `repeats`, warmed)."""
        import torch

        with torch.inference_mode():
            ids = torch.randint(4, self.vocab, (rows, length), generator=self.generator)
            self.body(input_ids=ids)  # warm
            dt = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                self.body(input_ids=ids)
                dt.append(time.perf_counter() - t0)
        return rows * length / min(dt)


def measure(dense: Dense, todo: set[tuple[int, int]]) -> dict[tuple[int, int], float]:
    """`Dense.rate` of every shape in `todo`."""
    return {shape: dense.rate(*shape) for shape in sorted(todo)}


def at_speed(floor_s: float, probe_then: float, probe_now: float) -> float:
    """The floor at the machine's speed of another moment: `floor_s` was measured when the
    `PROBE` shape ran at `probe_then` tokens/s; it runs at `probe_now` now."""
    return floor_s * probe_then / probe_now


def measure_reads(cfg, prefix_lengths) -> dict[int, float]:
    """Query tokens per second, all layers, reading a prefix of each length's keys and values:
    one attention of `READ_QUERIES` queries over it per layer, with the model's heads, key-value
    heads and head size, every query sharing the prefix's keys (best of 3, warmed; grouped-query
    models also with each key-value head's query heads folded into its queries, the faster kept).
    `cfg`: the model's config (`Dense.config`); torch's threads as they are set."""
    import torch
    import torch.nn.functional as F

    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, READ_QUERIES, dim, generator=g)
    folded = q.reshape(1, kv_heads, heads // kv_heads * READ_QUERIES, dim)
    rates = {}
    with torch.inference_mode():
        for length in sorted(set(prefix_lengths)):
            k, v = (torch.randn(1, kv_heads, length, dim, generator=g) for _ in range(2))
            forms = [(q, kv_heads != heads)]  # (queries, grouped-query) of each way to compute it
            if kv_heads != heads:
                forms.append((folded, False))
            dt = []
            for queries, gqa in forms:
                F.scaled_dot_product_attention(queries, k, v, enable_gqa=gqa)  # warm
                for _ in range(3):
                    t0 = time.perf_counter()
                    F.scaled_dot_product_attention(queries, k, v, enable_gqa=gqa)
                    dt.append(time.perf_counter() - t0)
            rates[length] = READ_QUERIES / (min(dt) * cfg.num_hidden_layers)
    return rates


def best(*runs: dict) -> dict:
    """Per shape (or prefix length), the best rate of several measurements (the machine's speed drifts)."""
    out: dict = {}
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


def read_s(suffixes, read_rates: dict[int, float]) -> float:
    """Seconds the `suffixes` ((prefix length, tokens) each) take to read their prefixes: each at
    the rate of the longest measured prefix at most its own (the shortest where none is)."""
    measured = sorted(read_rates)
    total = 0.0
    for prefix_len, tokens in suffixes:
        at = [p for p in measured if p <= prefix_len]
        total += tokens / read_rates[at[-1] if at else measured[0]]
    return total


def floors(segments, rates: dict[tuple[int, int], float], suffixes=(), read_rates=None) -> dict[str, float]:
    """Both floors of `segments` (lengths) in seconds, and the rates they used; `suffixes`
    ((prefix length, tokens) of each segment after a prefix) add their prefix reads at
    `read_rates` (`measure_reads`) to the floor by shape."""
    by_length: dict[int, float] = {}
    for (_, length), rate in rates.items():
        by_length[length] = max(by_length.get(length, 0.0), rate)
    lengths, counts = np.unique(np.asarray(list(segments), dtype=np.int64), return_counts=True)
    tokens = int((lengths * counts).sum())
    by_shape = sum(int(n) * int(ell) / rate_for(int(ell), by_length) for ell, n in zip(lengths, counts))
    top = max(by_length.values())
    reads = read_s(suffixes, read_rates) if read_rates else 0.0
    return {
        "tokens": tokens,
        "by_shape_s": by_shape + reads,
        "no_reads_s": by_shape,
        "reads_s": reads,
        "any_shape_s": tokens / top,
        "best_rate": top,
    }
