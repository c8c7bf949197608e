"""Batching strategies side by side on the reference workload, with the embedded model.

    python -m benchmarks strategies [--rounds 3] [--rows 3000] [--only 4] [--executors process,inprocess]

Every strategy runs through the real engine (run loop, scheduler, executor, hooks) on one CPU
(or CUDA) device; with several `--executors`, each strategy runs under each of them (the cost
of process isolation is the ratio of the two). Strategies are interleaved (the harness: A B C,
C B A, ...) because this machine's speed drifts; the table reports medians and ratios to the
first strategy. `--only` numbers the strategies from 1, as `STRATEGIES` lists them.

The oracle: zero-padding batches of one uniform length (16,384 tokens), measured per length
every round, the fastest rate kept; each item is costed at the rate of its own length. It is
the lower bound for strategies that compute every token (a prefix cache can beat it by not
computing prefix tokens at all).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from benchmarks import harness
from benchmarks.workloads import items as workload_items
from forge.config.schema import Runtime
from forge.driver.engine import RunSpec, execute
from forge.function import Function
from forge.pluginmanager import make_plugin_manager
from forge.runtime.forward.causal_lm import CausalLMRunner
from forge.vocab.geometry import Batch, Device, Item, Limits

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
    # the cache path before forge.runtime.forward.shared_prefix (in-process only: it is switched off here)
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

        from forge.runtime.forward import shared_prefix

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


def strategies(only: str | None, executors: list[str]) -> list[Strategy]:
    """The chosen strategies (1-based `--only`), each under each executor."""
    chosen = harness.pick({s.name: s for s in STRATEGIES}, only).values()
    return [
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


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__, rounds=3, rows=3000, seed=0, only=None)
    ap.add_argument("--work", default=None, help="the runs' directories (default: a temp dir)")
    ap.add_argument("--executors", default="process", help="comma-separated: process, inprocess")
    args = ap.parse_args(argv)

    dev = "cuda:0" if torch.cuda.is_available() else "cpu"
    device = Device(dev, LIMITS, torch_device=dev)
    model = load_model(dev)
    items = workload_items(args.rows, 12, seed=args.seed, vocab=model.config.vocab_size)
    fn = BenchFunction(items)
    chosen = strategies(args.only, args.executors.split(","))
    tmp = Path(args.work or tempfile.mkdtemp(prefix="bench-strategies-"))
    oracle: list[float] = []
    rates: dict[int, list[float]] = {}
    harness.note(
        f"device {dev}, torch threads {torch.get_num_threads()}, {len(items):,} items, "
        f"{sum(it.num_tokens for it in items):,} tokens, {args.rounds} rounds"
    )

    def measure_oracle(r: int) -> None:
        for n, v in oracle_rates(model, dev).items():
            rates.setdefault(n, []).append(v)
        # the fastest rate seen per length, so the oracle stays a lower bound as speed drifts
        oracle.append(oracle_seconds(items, {n: max(v) for n, v in rates.items()}))

    def variant(s: Strategy):
        return lambda r: run_strategy(s, fn, device, tmp, s.executor)

    trials = harness.interleave({s.name: variant(s) for s in chosen}, args.rounds, before_round=measure_oracle)
    report(args, trials, oracle[-1], rates)


def report(args, trials: harness.Trials, oracle_s: float, rates: dict[int, list[float]]) -> None:
    rep = harness.Report(args)
    lines = []
    first = trials.names[0]
    for name in trials.names:
        reps, wall = trials.samples[name], trials.median(name)
        last = reps[-1]
        sched = statistics.median(r["scheduler_s"] / r["wall_s"] for r in reps)
        hit = last["cache_hit_rate"]
        lines.append(
            [
                name,
                f"{wall:.2f}",
                f"{trials.median(name, 'useful_tokens_per_s'):,.0f}",
                f"{trials.ratio(name, first):.2f}",
            ]
            + [f"{100 * last['padding_waste']:.2f}%", "-" if not hit else f"{100 * hit:.2f}%", last["batches"]]
            + [f"{oracle_s / wall:.2f}", f"{100 * sched:.2f}%"]
        )
    header = ["strategy", "wall s (median)", "useful tok/s", "x first", "padding waste", "cache hit rate", "batches"]
    rep.table([*header, "oracle / wall", "scheduler share"], lines)
    rep.text(
        "",
        f"oracle (zero padding, every token computed): {oracle_s:.2f} s; zero-padding tok/s by length: "
        + ", ".join(f"{n}: {max(v):,.0f}" for n, v in sorted(rates.items())),
    )
    rep.data["oracle_s"] = oracle_s
    rep.trials(trials)
    rep.save()


if __name__ == "__main__":
    main()
