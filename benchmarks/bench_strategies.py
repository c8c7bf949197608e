"""Batching strategies side by side on the reference workload, with the embedded model.

    python -m benchmarks.bench_strategies [--rounds 3] [--n 3000] [--only 3] [--executors process,inprocess]

Every strategy runs through the real engine (run loop, scheduler, executor, hooks) on one CPU
(or CUDA) device; with several `--executors`, each strategy runs under each of them (the cost
of process isolation is the ratio of the two). Strategies are interleaved (A B C D E, A B C D E,
...) because this machine's speed drifts by up to 1.4x; the table reports medians and ratios to
the first strategy.

The oracle: zero-padding batches of one uniform length (16,384 tokens), measured per length
every round, the fastest rate kept; each item is costed at the rate of its own length. It is
the lower bound for strategies that compute every token (a prefix cache can beat it by not
computing prefix tokens at all).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from benchmarks.workloads import items as workload_items
from forge.config.schema import Runtime
from forge.core.engine import RunSpec, execute
from forge.core.geometry import Batch, Device, Item, Limits
from forge.function import Function
from forge.pluginmanager import make_plugin_manager
from forge.runtime.causal_lm import CausalLMRunner

LIMITS = Limits(max_batch_tokens=8192, max_rows=256, max_seq_len=2048, pad_multiple=1)
# Item-count baselines as users write them: 32 rows whatever their length, no token cap.
UNCAPPED = Limits(max_batch_tokens=32 * 2048, max_rows=256, max_seq_len=2048, pad_multiple=1)
LAYERS = [1, 2, 4]


@dataclass
class Strategy:
    name: str
    mode: str
    options: dict
    cache_tokens: int = 0
    limits: Limits = LIMITS
    executor: str = "process"
    shared_prefix: bool = True  # False: rows after a cached prefix copy its keys per row (the cache path)


STRATEGIES = [
    Strategy("item 32, arrival order", "item", {"batch_size": 32}, limits=UNCAPPED),
    Strategy("item 32, sorted by length", "item", {"batch_size": 32, "order": "length"}, limits=UNCAPPED),
    Strategy("token, no prefix cache", "token", {"prefix_cache": False}),
    Strategy("token, prefix cache", "token", {}, cache_tokens=32768),
    Strategy("token packed rows <= 256, cache", "token", {"packing": "packed", "packed_row_tokens": 256}, 32768),
    Strategy("token packed rows (default length), cache", "token", {"packing": "packed"}, 32768),
    # the cache path before forge.runtime.shared_prefix (in-process only: it is switched off here)
    Strategy("token, prefix cache, prefix keys copied per row", "token", {}, 32768, shared_prefix=False),
]


class NullSink:
    """Activations are computed and returned to the driver, not saved."""

    def full(self):
        return False

    def write(self, batch, output, keep):
        pass

    def flush(self):
        pass

    def close(self):
        return {}


class BenchWorker:
    def __init__(self, runner):
        self.runner = runner

    def run(self, batch):
        out = self.runner.run(batch)
        # what a real function returns: plain arrays that cross a process boundary
        return type(out)({k: v.numpy() for k, v in out.pooled.items()}, out.prefix_computed_tokens, out.cache_hit)

    def close(self):
        self.runner = None


class BenchFunction(Function):
    """The workload's items through the embedded model; activations are computed, not saved."""

    name = "bench"

    def __init__(self, items: list[Item]):
        self.items = items

    def records(self):
        return iter(self.items)

    def open_worker(self, device: Device, cache_tokens: int):
        model = load_model(device.torch_device)
        return BenchWorker(
            CausalLMRunner(model, layers=LAYERS, pooling="last", cache_tokens=cache_tokens, pad_token_id=3)
        )

    def __getstate__(self):
        return {"items": []}  # workers get batches, not the workload

    def worker_modules(self):
        return ["torch", "transformers", __name__, "transformers.models.llama.modeling_llama"]

    def open_sink(self, store):
        return NullSink()

    def fingerprint(self):
        return {"function": self.name}


def load_model(device: str):
    from transformers import AutoModelForCausalLM

    from forge.functions.assets import embedded_model_source, materialize_model

    path = materialize_model(embedded_model_source())
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()


def run_strategy(s: Strategy, fn: BenchFunction, device: Device, tmp: Path, executor: str) -> dict:
    import shutil

    device = Device(device.name, s.limits, torch_device=device.torch_device)
    run_dir = tmp / f"{s.name}-{executor}".replace(" ", "_").replace(",", "")
    shutil.rmtree(run_dir, ignore_errors=True)
    spec = RunSpec(
        function=fn,
        mode=s.mode,
        mode_options=dict(s.options),
        devices=[device],
        cache_tokens=s.cache_tokens,
        run_dir=run_dir,
        runtime=Runtime(executor=executor),
    )
    if s.shared_prefix:
        report = execute(spec, make_plugin_manager())
    else:
        if executor != "inprocess":
            raise SystemExit(f"{s.name}: needs --executors inprocess (the switch is made in this process)")
        from unittest import mock

        from forge.runtime import shared_prefix

        with mock.patch.object(shared_prefix, "worth_sharing", lambda *a: False):
            report = execute(spec, make_plugin_manager())
    assert report["balanced"] and report["status"] == "finished", report["imbalance"]
    return report


def oracle_rates(model, device: str, lengths=(8, 16, 32, 64, 128, 256, 384, 512, 768)) -> dict[int, float]:
    """Tokens/s of zero-padding batches of one uniform length (rows = 8192 // length)."""
    runner = CausalLMRunner(model, layers=LAYERS, pooling="last", pad_token_id=3)
    rng = np.random.default_rng(0)
    rates = {}
    for n in lengths:
        rows = max(1, min(LIMITS.max_rows, 2 * LIMITS.max_batch_tokens // n))
        batch = Batch(
            rows=[[Item(str(i), n, tokens=rng.integers(4, 2048, n).tolist())] for i in range(rows)], padded_len=n
        )
        runner.run(batch)  # warm
        t0 = time.perf_counter()
        reps = 3
        for _ in range(reps):
            runner.run(batch)
        rates[n] = reps * rows * n / (time.perf_counter() - t0)
    return rates


def oracle_seconds(items: list[Item], rates: dict[int, float]) -> float:
    xs = np.array(sorted(rates))
    ys = np.array([rates[x] for x in xs])
    lens = np.array([it.num_tokens for it in items], dtype=float)
    return float(np.sum(lens / np.interp(lens, xs, ys)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--only", default="", help="comma-separated strategy indexes (0-based) to run")
    ap.add_argument("--out", default="/tmp/forge-bench")
    ap.add_argument("--executors", default="process", help="comma-separated: process, inprocess")
    args = ap.parse_args()

    dev = "cuda:0" if torch.cuda.is_available() else "cpu"
    device = Device(dev, LIMITS, torch_device=dev)
    model = load_model(dev)
    items = workload_items(args.n, 12, vocab=model.config.vocab_size)
    fn = BenchFunction(items)
    chosen = [STRATEGIES[int(i)] for i in args.only.split(",")] if args.only else STRATEGIES
    executors = args.executors.split(",")
    strategies = [
        Strategy(
            f"{s.name} [{ex}]" if len(executors) > 1 else s.name,
            s.mode,
            s.options,
            s.cache_tokens,
            s.limits,
            ex,
            s.shared_prefix,
        )
        for s in chosen
        for ex in executors
    ]
    tmp = Path(args.out)
    results: dict[str, list[dict]] = {s.name: [] for s in strategies}
    oracle: list[float] = []
    rates: dict[int, list[float]] = {}
    print(
        f"device {dev}, torch threads {torch.get_num_threads()}, {len(items):,} items, "
        f"{sum(it.num_tokens for it in items):,} tokens, {args.rounds} rounds"
    )
    for r in range(args.rounds):
        measured = oracle_rates(model, dev)
        for n, v in measured.items():
            rates.setdefault(n, []).append(v)
        # the fastest rate seen per length, so the oracle stays a lower bound as speed drifts
        oracle.append(oracle_seconds(items, {n: max(v) for n, v in rates.items()}))
        for s in strategies if r % 2 == 0 else strategies[::-1]:  # A B, B A, ...: drift cancels
            rep = run_strategy(s, fn, device, tmp, s.executor)
            results[s.name].append(rep)
            print(f"  round {r + 1}: {s.name}: {rep['wall_s']:.2f} s", flush=True)

    base = statistics.median(r["wall_s"] for r in results[strategies[0].name])
    oracle_s = oracle[-1]
    print()
    print(
        "| strategy | wall s (median) | useful tok/s | x first | padding waste | cache hit rate | batches "
        "| oracle / wall | scheduler share |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in strategies:
        reps = results[s.name]
        wall = statistics.median(r["wall_s"] for r in reps)
        rate = statistics.median(r["useful_tokens_per_s"] for r in reps)
        last = reps[-1]
        sched = statistics.median(r["scheduler_s"] / r["wall_s"] for r in reps)
        hit = last["cache_hit_rate"]
        print(
            f"| {s.name} | {wall:.2f} | {rate:,.0f} | {base / wall:.2f} | {100 * last['padding_waste']:.2f}% | "
            f"{'-' if not hit else f'{100 * hit:.2f}%'} | {last['batches']} | {oracle_s / wall:.2f} | "
            f"{100 * sched:.2f}% |"
        )
    print(
        f"\noracle (zero padding, every token computed): {oracle_s:.2f} s; zero-padding tok/s by length: "
        + ", ".join(f"{n}: {max(v):,.0f}" for n, v in sorted(rates.items()))
    )


if __name__ == "__main__":
    main()
