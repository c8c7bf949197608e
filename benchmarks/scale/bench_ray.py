"""Forge on Ray against Ray Data `map_batches`, and runtime=ray against the local runtime.

    python -m benchmarks ray [--rows 3000] [--actors 2] [--rounds 2]

Needs Ray Data (`pip install -e '.[bench]'`). On a local Ray instance of `--actors` CPUs:

* Forge, runtime=ray: token mode with the prefix cache, one actor per device (`--actors`
  CPU devices of one core each), the driver packing and routing;
* Ray Data: the same items in arrival order through `map_batches` with row batches of 32, on
  an actor pool of the same size, each actor running the same model forward
  (`CausalLMRunner`, no prefix cache, rows padded to the batch's longest) and returning the
  same activations;
* Forge, runtime=local (process executor), the same plan as the first: the cost of Ray.

Every variant runs the workload end to end (actor start and model load included) and only
counts activations, it saves none. Variants are interleaved (the harness), A B C then C B A;
the table reports medians. Ray Data is the real library (the `bench` or `ray` extra plus pandas); the
function it maps is Forge's `CausalLMRunner`, so both sides run the same forward.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import harness
from benchmarks.scale.bench_strategies import LAYERS, LIMITS, BenchFunction, load_model
from benchmarks.workloads import items as workload_items
from forge.config.schema import RayRuntime, Runtime
from forge.driver.engine import RunSpec, execute
from forge.pluginmanager import make_plugin_manager
from forge.vocab.geometry import Batch, Device, Item


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

        from forge.runtime.forward.causal_lm import CausalLMRunner

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


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__, rounds=2, rows=3000, seed=0)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--work", default=None, help="the Forge runs' directories (default: a temp dir)")
    args = ap.parse_args(argv)
    harness.need("ray", "pandas")  # Ray Data's own needs, as the `bench` extra installs them
    import ray
    import torch

    vocab = load_model("cpu").config.vocab_size
    items = workload_items(args.rows, 12, seed=args.seed, vocab=vocab)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-ray-"))
    path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))  # workers import this checkout
    ray.init(num_cpus=args.actors, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    variants = {
        "Forge, runtime=ray (token, prefix cache)": lambda r: forge_run(items, args.actors, "ray", work / "ray"),
        "Ray Data map_batches (rows of 32, arrival order)": lambda r: ray_data_run(items, args.actors),
        "Forge, runtime=local (token, prefix cache)": lambda r: forge_run(
            items, args.actors, "process", work / "local"
        ),
    }
    rep = harness.Report(args)
    rep.text(
        f"{len(items):,} items, {sum(it.num_tokens for it in items):,} tokens, {args.actors} actors of 1 CPU, "
        f"torch {torch.__version__}, ray {ray.__version__}, {args.rounds} round(s)",
        "",
    )
    try:
        trials = harness.interleave(variants, args.rounds)
    finally:
        ray.shutdown()
    report(rep, trials)


def report(rep: harness.Report, trials: harness.Trials) -> None:
    lines = []
    for name in trials.names:
        med = lambda k, name=name: trials.median(name, k)  # noqa: E731
        hit = f"{100 * med('cache_hit_rate'):.2f}%" if med("cache_hit_rate") else "-"
        batches = "-" if med("batches") is None else f"{med('batches'):.0f}"
        ready = "-" if med("actor_ready_s") is None else f"{med('actor_ready_s'):.1f} s"
        lines.append([name, f"{med('wall_s'):.2f}", f"{med('useful_tokens_per_s'):,.0f}"])
        lines[-1] += [f"{100 * med('padding_waste'):.2f}%", hit, batches, ready]
    header = ["variant", "wall s (median)", "useful tok/s", "padding waste", "cache hit rate", "batches"]
    rep.table([*header, "actors ready after"], lines)
    on_ray, data, local = trials.names
    rate = trials.ratio(on_ray, data, "useful_tokens_per_s", higher_is_better=True)
    rep.text("", f"Forge on Ray / Ray Data, useful tok/s: {rate:.2f}x")
    rep.text(f"runtime=ray / runtime=local, wall: {trials.median(on_ray) / trials.median(local):.2f}x")
    rep.trials(trials)
    rep.save()


if __name__ == "__main__":
    main()
