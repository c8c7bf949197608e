"""Forge on Ray against Ray Data `map_batches`, and runtime=ray against the local runtime.

    python -m benchmarks.bench_ray [--n 3000] [--actors 2] [--rounds 1]

Needs Ray Data (`pip install 'ray[data]'`). On a local Ray instance of `--actors` CPUs:

* Forge, runtime=ray: token mode with the prefix cache, one actor per device (`--actors`
  CPU devices of one core each), the driver packing and routing;
* Ray Data: the same items in arrival order through `map_batches` with row batches of 32, on
  an actor pool of the same size, each actor running the same model forward
  (`CausalLMRunner`, no prefix cache, rows padded to the batch's longest) and returning the
  same activations;
* Forge, runtime=local (process executor), the same plan as the first: the cost of Ray.

Every variant runs the workload end to end (actor start and model load included) and only
counts activations, it saves none. Variants are interleaved, A B C then C B A; the table
reports medians. Ray Data is the real library (the `bench` or `ray` extra plus pandas); the
function it maps is Forge's `CausalLMRunner`, so both sides run the same forward.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.bench_strategies import LAYERS, LIMITS, BenchFunction, load_model
from benchmarks.workloads import items as workload_items
from forge.config.schema import RayRuntime, Runtime
from forge.core.engine import RunSpec, execute
from forge.core.geometry import Batch, Device, Item
from forge.pluginmanager import make_plugin_manager


def forge_run(items: list[Item], actors: int, executor: str, out: Path) -> dict:
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    devices = [Device(f"cpu{i}", LIMITS, torch_device="cpu") for i in range(actors)]
    spec = RunSpec(
        function=BenchFunction(items),
        mode="token",
        mode_options={},
        devices=devices,
        cache_tokens=32768,
        run_dir=out,
        runtime=RayRuntime(cpus_per_actor=1) if executor == "ray" else Runtime(executor=executor),
    )
    report = execute(spec, make_plugin_manager())
    assert report["balanced"] and report["status"] == "finished", report["imbalance"]
    return {
        "wall_s": report["wall_s"],
        "useful_tokens_per_s": report["useful_tokens_per_s"],
        "padding_waste": report["padding_waste"],
        "cache_hit_rate": report["cache_hit_rate"],
        "batches": report["batches"],
        "actor_ready_s": max((a["ready_s"] for a in report.get("ray", {}).get("actors", {}).values()), default=None),
    }  # when the last actor had loaded its model


class RowBatchForward:
    """A Ray Data actor: the model loaded once; a batch of rows padded to its longest, forward."""

    def __init__(self):
        import torch

        from forge.runtime.causal_lm import CausalLMRunner

        torch.set_num_threads(1)
        self.runner = CausalLMRunner(load_model("cpu"), layers=LAYERS, pooling="last", pad_token_id=3)

    def __call__(self, rows: dict) -> dict:
        ids = rows["id"]
        tokens = [list(t) for t in rows["tokens"]]
        padded = max(len(t) for t in tokens)
        batch = Batch(rows=[[Item(str(i), len(t), tokens=t)] for i, t in zip(ids, tokens)], padded_len=padded)
        pooled = self.runner.run(batch).pooled
        return {
            "id": ids,
            "tokens_n": np.array([len(t) for t in tokens]),
            "padded": np.full(len(ids), padded),
            **{f"layer{layer}": v.numpy() for layer, v in pooled.items()},
        }


def ray_data_run(items: list[Item], actors: int) -> dict:
    import ray

    t0 = time.perf_counter()
    ds = ray.data.from_items(
        [{"id": int(it.id), "tokens": np.asarray(it.tokens, np.int64)} for it in items], override_num_blocks=actors * 4
    )
    out = ds.map_batches(
        RowBatchForward,
        batch_size=32,
        compute=ray.data.ActorPoolStrategy(size=actors),
        num_cpus=1,
        batch_format="numpy",
    )
    n = tokens = slots = 0
    for rows in out.iter_batches(batch_size=None, batch_format="numpy"):
        n += len(rows["id"])
        tokens += int(rows["tokens_n"].sum())
        slots += int(rows["padded"].sum())
    wall = time.perf_counter() - t0
    assert n == len(items), (n, len(items))
    return {
        "wall_s": wall,
        "useful_tokens_per_s": tokens / wall,
        "padding_waste": 1 - tokens / slots,
        "cache_hit_rate": 0.0,
        "batches": None,
        "actor_ready_s": None,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default="/tmp/forge-bench-ray")
    args = ap.parse_args()

    import ray
    import torch

    vocab = load_model("cpu").config.vocab_size
    items = workload_items(args.n, 12, vocab=vocab)
    path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))  # workers import this checkout
    ray.init(num_cpus=args.actors, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    variants = {
        "Forge, runtime=ray (token, prefix cache)": lambda: forge_run(
            items, args.actors, "ray", Path(args.out) / "ray"
        ),
        "Ray Data map_batches (rows of 32, arrival order)": lambda: ray_data_run(items, args.actors),
        "Forge, runtime=local (token, prefix cache)": lambda: forge_run(
            items, args.actors, "process", Path(args.out) / "local"
        ),
    }
    results: dict[str, list[dict]] = {name: [] for name in variants}
    print(
        f"{len(items):,} items, {sum(it.num_tokens for it in items):,} tokens, {args.actors} actors of 1 CPU, "
        f"torch {torch.__version__}, ray {ray.__version__}, {args.rounds} round(s)",
        flush=True,
    )
    try:
        for r in range(args.rounds):
            order = list(variants.items())
            for name, run in order if r % 2 == 0 else order[::-1]:  # A B C, then C B A
                results[name].append(run())
                print(f"  round {r + 1}: {name}: {results[name][-1]['wall_s']:.2f} s", flush=True)
    finally:
        ray.shutdown()

    med = {
        name: {k: statistics.median(x[k] for x in reps) if reps[0][k] is not None else None for k in reps[0]}
        for name, reps in results.items()
    }
    names = list(variants)
    print(
        "\n| variant | wall s (median) | useful tok/s | padding waste | cache hit rate | batches | actors ready after |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in names:
        m = med[name]
        hit = f"{100 * m['cache_hit_rate']:.2f}%" if m["cache_hit_rate"] else "-"
        batches = "-" if m["batches"] is None else f"{m['batches']:.0f}"
        ready = "-" if m["actor_ready_s"] is None else f"{m['actor_ready_s']:.1f} s"
        print(
            f"| {name} | {m['wall_s']:.2f} | {m['useful_tokens_per_s']:,.0f} | {100 * m['padding_waste']:.2f}% | "
            f"{hit} | {batches} | {ready} |"
        )
    ray_, data, local = (med[n] for n in names)
    print(f"\nForge on Ray / Ray Data, useful tok/s: {ray_['useful_tokens_per_s'] / data['useful_tokens_per_s']:.2f}x")
    print(f"runtime=ray / runtime=local, wall: {ray_['wall_s'] / local['wall_s']:.2f}x")


if __name__ == "__main__":
    main()
