"""The built-in functions before and after a change, side by side: one tree against another.

    git archive main | tar -x -C /tmp/forge-main
    python -m benchmarks.bench_functions --trees /tmp/forge-main,. [--rounds 3] [--set functions|strategies|all]
        [--only 1,4] [--cli]

`--set functions` (the default) runs each built-in once; `--set strategies` runs `probe_gen` under
every batching strategy a user picks from the YAML (item in arrival and length order, token with
and without the prefix cache, token packed, memory), each over the same 1,000 embedded rows.

Each tree is first installed (not editable: `pip install --no-deps --target`, so `forge.functions`,
`forge.builtin` and `forge.conf` come from that tree's `functions/`, `plugins/` and `conf/`).
Each workload runs through the engine as `forge run` drives it (compose, `build_spec`,
`execute`; in-process executor, the embedded 4-layer Llama, float32, one torch thread) in a
fresh process whose path starts with that install, so that tree's `forge` is imported. The
clock covers `execute` (input, packing, the model's load, every batch and the commit), with
transformers' Llama modeling code imported before it in every tree. Trees alternate A B B A
A B (this machine's speed drifts); the table reports medians, the ratio of the first tree's
median to each tree's, every run, and each tree's batches and padded slots (the plan; a tree
that completes a different number of items stops the benchmark). With `--cli` each run is
instead that tree's own `forge run` command as a user types it (process executor, `devices=cpu`:
one worker on 2 threads), timed from its start to its exit, start-up included, each tree with a
`FORGE_CACHE` of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKLOADS = {
    "probe_gen, token rows, last": ["function=probe_gen", "input.limit=2500", "batching=token", "layers=[1,2,4]"],
    "probe_gen, token packed, mean": [
        "function=probe_gen",
        "input.limit=2500",
        "batching=token",
        "batching.packing=packed",
        "pooling=mean",
        "layers=[1,2,4]",
    ],
    "embed (decoder), token packed": [
        "function=embed",
        "input.limit=2500",
        "batching=token",
        "batching.packing=packed",
    ],
    "score, 300 questions x 4, 10 shots": ["function=score", "input.path=MC", "batching=token"],
}

_PROBE = ["function=probe_gen", "input.limit=1000", "layers=[1,2,4]", "pooling=last"]
STRATEGIES = {
    "item 32, arrival order": [*_PROBE, "batching=item"],
    "item 32, longest first": [*_PROBE, "batching=item", "batching.order=length"],
    "token, no prefix cache": [*_PROBE, "batching=token", "batching.prefix_cache=false"],
    "token, prefix cache (the default)": [*_PROBE, "batching=token"],
    "token packed rows <= 256, prefix cache": [
        *_PROBE,
        "batching=token",
        "batching.packing=packed",
        "batching.packed_row_tokens=256",
    ],
    "token packed rows, prefix cache": [*_PROBE, "batching=token", "batching.packing=packed"],
    "memory, prefix cache": [*_PROBE, "batching=memory"],
}
SETS = {"functions": WORKLOADS, "strategies": STRATEGIES, "all": {**WORKLOADS, **STRATEGIES}}

CHILD = """
import json, shutil, sys, tempfile, time
from pathlib import Path
import torch
torch.set_num_threads(1)
sys.path.append(sys.argv[2])  # the tree, after its install: benchmarks.bench_score
from forge.cli.compose import compose
from forge.config.build import build_spec
from forge.core.engine import execute
try:
    from forge.pluginmanager import make_plugin_manager
except ImportError:  # a tree from before the plugin manager's rename
    from forge.plugins import make_plugin_manager
over = json.loads(sys.argv[1])
tmp = Path(tempfile.mkdtemp(prefix="bench-functions-"))
if "input.path=MC" in over:
    from benchmarks.bench_score import workload
    workload(tmp / "mc.jsonl", 300, 10)
    over = [o if o != "input.path=MC" else f"input.path={tmp / 'mc.jsonl'}" for o in over]
spec = build_spec(compose([*over, "runtime.executor=inprocess", "devices=auto", "shard_size=100000"]), tmp / "run")
# the embedded model's modeling code is imported before the clock starts, whatever the tree:
# trees differ in which side of execute() imports it (since 2026-12-01 the driver imports none)
import transformers.models.llama.modeling_llama
t0 = time.perf_counter()
report = execute(spec, make_plugin_manager())
wall = time.perf_counter() - t0
shutil.rmtree(tmp, ignore_errors=True)
print(json.dumps({"wall": wall, "items": report["items"], "devices": report["devices"]}))
"""


def install(tree: str, into: Path) -> Path:
    """`tree` installed as a wheel would be, into a folder of its own (no dependencies, offline)."""
    src, target = into / "src", into / "site"  # built from a copy: no build/ reused or left in the tree
    shutil.copytree(tree, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(src),
        ],
        check=True,
        capture_output=True,
        cwd=into,
    )
    return target


def run(tree: str, site: Path, overrides: list[str]) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(overrides), tree],
        cwd=site,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(site)},
        check=True,
    )
    done = json.loads(out.stdout.strip().splitlines()[-1])
    return {"wall": done["wall"], **plan_of(done)}


def plan_of(report: dict) -> dict:
    """What a run's report says of its plan: items completed, batches, padded slots."""
    devices = report["devices"]
    return {
        "completed": report["items"]["completed"],
        "batches": sum(d["batches"] for d in devices),
        "padded_slots": sum(d["padded_slots"] for d in devices),
    }


def run_cli(tree: str, site: Path, overrides: list[str]) -> dict:
    """`forge run OVERRIDES` as a user types it, with that tree's `forge` command (the process
    executor, one CPU device, 2 threads), timed from the command's start to its exit."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-functions-cli-"))
    try:
        if "input.path=MC" in overrides:
            from benchmarks.bench_score import workload

            workload(tmp / "mc.jsonl", 300, 10)
            overrides = [o if o != "input.path=MC" else f"input.path={tmp / 'mc.jsonl'}" for o in overrides]
        env = {**os.environ, "PYTHONPATH": str(site), "FORGE_CACHE": str(site.parent / "cache")}
        cmd = [str(site / "bin" / "forge"), "run", *overrides, "devices=cpu", f"output_dir={tmp / 'run'}"]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, env=env)
        if done.returncode:
            raise SystemExit(f"{' '.join(cmd)}: exit {done.returncode}\n{done.stderr[-3000:]}")
        wall = time.perf_counter() - t0
        return {"wall": wall, **plan_of(json.loads((tmp / "run" / "report.json").read_text()))}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", default=".", help="comma-separated source trees; the first is the base")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--set", choices=tuple(SETS), default="functions", help="which workloads (see above)")
    ap.add_argument(
        "--cli",
        action="store_true",
        help="time each run as `forge run` from the command's start to its exit (process executor, 2 threads)",
    )
    ap.add_argument("--only", default=None, help="comma-separated workload numbers of the set to run (1-based)")
    args = ap.parse_args()
    trees = [str(Path(t).resolve()) for t in args.trees.split(",")]
    todo = list(SETS[args.set].items())
    if args.only:
        todo = [todo[int(i) - 1] for i in args.only.split(",")]
    root = Path(tempfile.mkdtemp(prefix="bench-functions-"))  # the installs (and, with --cli, their caches)
    try:
        sites = {t: install(t, root / str(i)) for i, t in enumerate(trees)}
        compare(trees, sites, todo, args.rounds, run_cli if args.cli else run)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def compare(trees: list[str], sites: dict[str, Path], todo: list, rounds: int, runner) -> None:
    """Each workload of `todo` on every tree, alternating, `rounds` times; one table row each."""
    names = [Path(t).name for t in trees]
    print(
        "| workload | "
        + " | ".join(f"{n} s" for n in names)
        + " | "
        + " | ".join(f"{names[0]} / {n}" for n in names[1:])
        + " | rounds s | "
        + " | ".join(f"{n}: batches, padded slots" for n in names)
        + " |"
    )
    print("| --- |" + " --- |" * (3 * len(trees)))
    for name, overrides in todo:
        walls: dict[str, list[float]] = {t: [] for t in trees}
        shape: dict[str, tuple[int, int, int]] = {}
        for r in range(rounds):
            for tree in trees if r % 2 == 0 else trees[::-1]:
                out = runner(tree, sites[tree], overrides)
                walls[tree].append(out["wall"])
                shape[tree] = (out["completed"], out["batches"], out["padded_slots"])
        if len({s[0] for s in shape.values()}) != 1:
            raise SystemExit(f"{name}: the trees completed different item counts: {shape}")
        med = {t: statistics.median(v) for t, v in walls.items()}
        print(
            f"| {name} | "
            + " | ".join(f"{med[t]:.2f}" for t in trees)
            + " | "
            + " | ".join(f"{med[trees[0]] / med[t]:.2f}" for t in trees[1:])
            + " | "
            + "; ".join(", ".join(f"{w:.1f}" for w in walls[t]) for t in trees)
            + " | "
            + " | ".join(f"{shape[t][1]:,}, {shape[t][2]:,}" for t in trees)
            + " |",
            flush=True,
        )


if __name__ == "__main__":
    main()
