"""Soak the run directory: `kill -9` at random moments, resume, and concurrent resumes.

    python -m benchmarks.soak [--rows 2500] [--cycles 20] [--seed 0] [--executor process]

Each cycle starts `forge run ... resume=true` in its own process group and SIGKILLs the whole
group: in most cycles a random moment after its first new commit (mid-run, often mid-shard),
in the others after a random delay from its start (often in start-up). Every other cycle starts
a second resume at the same moment: the directory's lock must refuse one of them in one line
(or, if the first has already ended, let the second finish). A file that is not Forge's is
planted in the run directory once it holds a run. After the last cycle one resume runs to
the end, and the run must hold every id exactly once, with activations equal to a clean
run's, and the planted file untouched. Not a test: tests/test_rundir.py runs a short soak.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

BUSY = "is in use by another Forge run"
FOREIGN = Path("mine") / "shard-keep.txt"


@dataclass
class SoakResult:
    """What the soak saw."""

    cycles: int
    kills: int = 0  # runs killed with SIGKILL
    refused: int = 0  # concurrent resumes refused by the lock
    finished_early: int = 0  # runs that ended before their kill
    ids: int = 0  # ids in the final run
    unique_ids: int = 0
    max_abs_diff: float = 0.0  # against the clean run, over every layer
    planted: bool = False  # the foreign file was planted (the directory held a run by then)
    foreign_kept: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _forge(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "forge.cli.app", "run", *args],
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _kill(proc: subprocess.Popen) -> str:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return proc.communicate(timeout=60)[0].decode(errors="replace")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def soak(out: Path, clean: Path, base: list[str], cycles: int, seed: int = 0, max_delay_s: float = 8.0) -> SoakResult:
    """Run the soak into `out`; `clean` gets an uninterrupted run of the same `base` overrides."""
    import torch

    from forge import load_activations

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    rng = random.Random(seed)
    result = SoakResult(cycles)
    args = [*base, f"output_dir={out}", "resume=true"]

    def plant() -> None:
        if not result.planted and (out / "run.json").exists():
            (out / FOREIGN).parent.mkdir(parents=True, exist_ok=True)
            (out / FOREIGN).write_text("a user's file, not Forge's\n")
            result.planted = True

    for cycle in range(cycles):
        procs = [_forge(args, env) for _ in range(2 if cycle % 2 else 1)]
        alive = lambda procs=procs: any(p.poll() is None for p in procs)  # noqa: E731
        if cycle and rng.random() < 0.3:  # in start-up (or wherever the run is by then)
            deadline = time.monotonic() + rng.uniform(0.2, max_delay_s)
        else:  # mid-run: a moment after this cycle's first new commit
            journal, size = out / "commits.jsonl", _size(out / "commits.jsonl")
            give_up = time.monotonic() + 300
            while alive() and _size(journal) <= size and time.monotonic() < give_up:
                plant()
                time.sleep(0.02)
            deadline = time.monotonic() + rng.uniform(0.0, 1.5)
        while time.monotonic() < deadline and alive():
            plant()
            time.sleep(0.02)
        for proc in procs:
            ended = proc.poll() is not None
            text = _kill(proc)
            if not ended:
                result.kills += 1
            elif proc.returncode == 2 and BUSY in text:
                result.refused += 1
            elif proc.returncode == 0:
                result.finished_early += 1
            else:
                result.problems.append(f"cycle {cycle}: exit {proc.returncode}: {text.strip()[-300:]}")
    final = subprocess.run(
        [sys.executable, "-m", "forge.cli.app", "run", *args], env=env, capture_output=True, text=True
    )
    if final.returncode != 0:
        result.problems.append(f"final resume: exit {final.returncode}: {final.stderr.strip()[-300:]}")
        return result
    done = subprocess.run(
        [sys.executable, "-m", "forge.cli.app", "run", *base, f"output_dir={clean}"],
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        result.problems.append(f"clean run: exit {done.returncode}: {done.stderr.strip()[-300:]}")
        return result
    ids, _, layers = load_activations(out)
    want_ids, _, want = load_activations(clean)
    result.ids, result.unique_ids = len(ids), len(set(ids))
    if sorted(ids) != sorted(want_ids):
        result.problems.append(f"ids: {len(ids)} ({len(set(ids))} unique), a clean run has {len(want_ids)}")
    else:
        order = {i: k for k, i in enumerate(want_ids)}
        pick = torch.tensor([order[i] for i in ids])
        result.max_abs_diff = max(float((layers[layer] - want[layer][pick]).abs().max()) for layer in want)
        if result.max_abs_diff > 1e-5:
            result.problems.append(f"activations differ from a clean run's by {result.max_abs_diff:.3g}")
    result.foreign_kept = (out / FOREIGN).exists()
    if result.planted and not result.foreign_kept:
        result.problems.append(f"{FOREIGN} was removed")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2500)
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--executor", default="process", choices=["process", "inprocess"])
    ap.add_argument("--max-delay-s", type=float, default=10.0)
    a = ap.parse_args()
    base = [
        f"input.limit={a.rows}",
        "layers=[1,4]",
        "shard_size=64",
        "runtime.commit_interval_s=0.5",
        f"runtime.executor={a.executor}",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        r = soak(Path(tmp) / "run", Path(tmp) / "clean", base, a.cycles, a.seed, a.max_delay_s)
    print(
        f"{a.cycles} cycles, {a.rows} rows, {a.executor} executor, {time.monotonic() - t0:.0f} s: "
        f"{r.kills} kill -9, {r.refused} concurrent resumes refused, {r.finished_early} finished before the kill"
    )
    print(
        f"final run: {r.ids} ids, {r.unique_ids} unique; max |diff| vs a clean run {r.max_abs_diff:.2e}; "
        f"foreign file kept: {r.foreign_kept}"
    )
    for p in r.problems:
        print(f"PROBLEM: {p}")
    sys.exit(0 if r.ok else 1)


if __name__ == "__main__":
    main()
