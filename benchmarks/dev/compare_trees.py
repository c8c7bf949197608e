"""A developer's check, not a benchmark: the built-ins before and after a change, one source tree against another.

    git archive main | tar -x -C /tmp/forge-main
    python -m benchmarks compare-trees --trees /tmp/forge-main,. [--rounds 3] [--set functions|strategies|all]
        [--only 1,4] [--cli]

It measures Forge against itself at another commit, to review a change; its ratios are not
figures of Forge (docs/benchmarks.md holds those), so it lives in benchmarks/dev/.

`--set functions` (the default) runs each built-in once; `--set strategies` runs `probe_gen` under
every batching strategy a user picks from the YAML (item in arrival and length order, token with
and without the prefix cache, token packed, memory), each over the same 1,000 embedded rows.

Each tree is first installed (not editable: `pip install --no-deps --target`, so `forge.functions`,
`forge.builtin` and `forge.conf` come from that tree's `functions/`, `plugins/` and `conf/`).
Each workload runs through the engine as `forge run` drives it (compose, `build_spec`,
`execute`; in-process executor, the embedded 4-layer Llama, float32, one torch thread) in a
fresh process whose path starts with that install, so that tree's `forge` is imported. The
clock covers `execute` (input, packing, the model's load, every batch and the commit), with
transformers' Llama modeling code imported before it in every tree. Trees are interleaved (the
harness: A B, B A, ...; this machine's speed drifts); `score`'s questions are written once, by
this tree, for every tree. The table reports medians, the ratio of the first tree's
median to each tree's, every run, and each tree's batches and padded slots (the plan; a tree
that completes a different number of items stops the benchmark). With `--cli` each run is
instead that tree's own `forge run` command as a user types it (process executor, `devices=cpu`:
one worker on 2 threads), timed from its start to its exit, start-up included, each tree with a
`FORGE_CACHE` of its own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import harness, workloads

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
from forge.cli.compose import compose
try:
    from forge.cli.build import build_spec
    from forge.driver.engine import execute
except ImportError:  # a tree from before the driver's move out of forge.core and forge.config
    from forge.config.build import build_spec
    from forge.core.engine import execute
try:
    from forge.pluginmanager import make_plugin_manager
except ImportError:  # a tree from before the plugin manager's rename
    from forge.plugins import make_plugin_manager
over = json.loads(sys.argv[1])
tmp = Path(tempfile.mkdtemp(prefix="bench-functions-"))
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


def with_questions(overrides: list[str], questions: Path) -> list[str]:
    return [o if o != "input.path=MC" else f"input.path={questions}" for o in overrides]


def run(tree: str, site: Path, overrides: list[str], questions: Path) -> dict:
    child = harness.timed(
        [sys.executable, "-c", CHILD, json.dumps(with_questions(overrides, questions))],
        cwd=site,
        env={**os.environ, "PYTHONPATH": str(site)},
    )
    done = harness.last_json(child.stdout)
    return {"wall_s": done["wall"], **plan_of(done)}


def plan_of(report: dict) -> dict:
    """What a run's report says of its plan: items completed, batches, padded slots."""
    devices = report["devices"]
    return {
        "completed": report["items"]["completed"],
        "batches": sum(d["batches"] for d in devices),
        "padded_slots": sum(d["padded_slots"] for d in devices),
    }


def run_cli(tree: str, site: Path, overrides: list[str], questions: Path) -> dict:
    """`forge run OVERRIDES` as a user types it, with that tree's `forge` command (the process
    executor, one CPU device, 2 threads), timed from the command's start to its exit."""
    tmp = Path(tempfile.mkdtemp(prefix="bench-functions-cli-"))
    try:
        env = {**os.environ, "PYTHONPATH": str(site), "FORGE_CACHE": str(site.parent / "cache")}
        cmd = [str(site / "bin" / "forge"), "run", *with_questions(overrides, questions), "devices=cpu"]
        child = harness.timed([*cmd, f"output_dir={tmp / 'run'}"], cwd=tmp, env=env)
        return {"wall_s": child.wall_s, **plan_of(json.loads((tmp / "run" / "report.json").read_text()))}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__, rounds=3, only=None)
    ap.add_argument("--trees", default=".", help="comma-separated source trees; the first is the base")
    ap.add_argument("--set", choices=tuple(SETS), default="functions", help="which workloads (see above)")
    ap.add_argument(
        "--cli",
        action="store_true",
        help="time each run as `forge run` from the command's start to its exit (process executor, 2 threads)",
    )
    args = ap.parse_args(argv)
    trees = [str(Path(t).resolve()) for t in args.trees.split(",")]
    todo = list(harness.pick(SETS[args.set], args.only).items())
    root = Path(tempfile.mkdtemp(prefix="bench-functions-"))  # the installs (and, with --cli, their caches)
    try:
        questions = workloads.write_jsonl(root / "mc.jsonl", workloads.questions(300, shots=10))
        sites = {t: install(t, root / str(i)) for i, t in enumerate(trees)}
        runner = run_cli if args.cli else run
        compare(args, trees, todo, lambda tree, overrides: runner(tree, sites[tree], overrides, questions))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def compare(args, trees: list[str], todo: list, runner) -> None:
    """Each workload of `todo` on every tree, interleaved; one table row each."""
    names = [Path(t).name for t in trees]
    rep = harness.Report(args)
    lines = []
    for name, overrides in todo:
        trials = harness.interleave(
            {t: lambda r, t=t, o=overrides: runner(t, o) for t in trees}, args.rounds, label=f"{name}: "
        )
        last = {t: trials.last(t) for t in trees}
        shape = {t: (s["completed"], s["batches"], s["padded_slots"]) for t, s in last.items()}
        if len({s[0] for s in shape.values()}) != 1:
            raise SystemExit(f"{name}: the trees completed different item counts: {shape}")
        lines.append(
            [name, *(f"{trials.median(t):.2f}" for t in trees)]
            + [f"{trials.median(trees[0]) / trials.median(t):.2f}" for t in trees[1:]]
            + ["; ".join(", ".join(f"{w:.1f}" for w in trials.values(t)) for t in trees)]
            + [f"{shape[t][1]:,}, {shape[t][2]:,}" for t in trees]
        )
        rep.data[name] = trials.samples
    header = ["workload", *(f"{n} s" for n in names), *(f"{names[0]} / {n}" for n in names[1:]), "rounds s"]
    rep.table([*header, *(f"{n}: batches, padded slots" for n in names)], lines)
    rep.save()


if __name__ == "__main__":
    main()
