"""The built-in functions before and after a change, side by side: one tree against another.

    git archive main | tar -x -C /tmp/forge-main
    python -m benchmarks.bench_functions --trees /tmp/forge-main,. [--rounds 3]

Each tree is first installed (not editable: `pip install --no-deps --target`, so `forge.functions`,
`forge.builtin` and `forge.conf` come from that tree's `functions/`, `plugins/` and `conf/`).
Each workload runs end to end through `forge run` (in-process executor, the embedded 4-layer
Llama, float32, one torch thread) in a fresh process whose path starts with that install, so
that tree's `forge` is imported; trees alternate A B B A A B (this machine's speed drifts) and
the table reports medians and the ratio of the first tree's median to each tree's.
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

CHILD = """
import json, sys, tempfile, time
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
t0 = time.perf_counter()
report = execute(spec, make_plugin_manager())
print(json.dumps({"wall": time.perf_counter() - t0, "completed": report["items"]["completed"]}))
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
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", default=".", help="comma-separated source trees; the first is the base")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    trees = [str(Path(t).resolve()) for t in args.trees.split(",")]
    sites = {t: install(t, Path(tempfile.mkdtemp(prefix="bench-functions-site-"))) for t in trees}
    print(
        "| workload | "
        + " | ".join(f"{Path(t).name} s" for t in trees)
        + " | "
        + " | ".join(f"{Path(trees[0]).name} / {Path(t).name}" for t in trees[1:])
        + " |"
    )
    print("| --- |" + " --- |" * (2 * len(trees) - 1))
    for name, overrides in WORKLOADS.items():
        walls: dict[str, list[float]] = {t: [] for t in trees}
        for r in range(args.rounds):
            for tree in trees if r % 2 == 0 else trees[::-1]:
                walls[tree].append(run(tree, sites[tree], overrides)["wall"])
        med = {t: statistics.median(v) for t, v in walls.items()}
        print(
            f"| {name} | "
            + " | ".join(f"{med[t]:.2f}" for t in trees)
            + " | "
            + " | ".join(f"{med[trees[0]] / med[t]:.2f}" for t in trees[1:])
            + " |",
            flush=True,
        )


if __name__ == "__main__":
    main()
