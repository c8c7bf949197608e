"""Soak the run directory: a fault at a random moment of each cycle, resumes, concurrent runs.

    python -m benchmarks.soak [--rows 2500] [--cycles 20] [--seed 0] [--executor process]
                              [--faults kill9,lock_removed,lock_replaced,paused,fork_server,disk_full]

Each cycle starts `forge run ... resume=true` in its own process group and, at a random moment
(mostly a moment after its first new commit, sometimes a random delay from its start), applies
one fault, in turn:
- `kill9`: SIGKILL of the whole group; every other such cycle starts a second resume at the same
  moment, which the directory's lock must refuse in one line (or let finish, once the first ended);
- `lock_removed` / `lock_replaced`: `lock.json` removed, or replaced by a copy, while the run is
  live, then a second resume started: both must end cleanly (one may stop in one line, having lost
  the directory), and nothing committed may be deleted or counted twice;
- `paused`: the run SIGSTOPped, its lock file removed, a second resume run to its end, then the
  first SIGCONTinued: it must stop in one line and delete nothing;
- `fork_server`: SIGKILL of the workers' fork server (process executor): replaced, or a clean stop;
- `disk_full`: the run directory's disk filled to its last byte by another writer (a tmpfs the
  soak mounts; skipped where it cannot): a clean stop in one line, then the room given back.
Any exit other than 0 or a known one-line stop, any traceback, and any process left behind is a
problem. A file that is not Forge's is planted in the run directory once it holds a run. After the
last cycle one resume runs to the end, and the run must hold every id exactly once, with
activations equal to a clean run's, and the planted file untouched. Not a test: tests run a short
soak (tests/test_rundir.py, tests/test_fencing.py).
"""

from __future__ import annotations

import argparse
import json
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
#: the one-line stops a fault may rightly end a run with (exit 2)
CLEAN_STOPS = (BUSY, "while this run held it", "No space left on device", "took output_dir=", "fork server")
FOREIGN = Path("mine") / "shard-keep.txt"
FAULTS = ("kill9", "lock_removed", "lock_replaced", "paused", "fork_server", "disk_full")


@dataclass
class SoakResult:
    """What the soak saw."""

    cycles: int
    kills: int = 0  # runs killed with SIGKILL
    refused: int = 0  # concurrent resumes refused by the lock
    finished_early: int = 0  # runs that ended before their fault
    clean_stops: int = 0  # runs that stopped in one line after their fault (lost lock, full disk, ...)
    faults: dict[str, int] = field(default_factory=dict)  # cycles per fault kind
    runs: int = 1  # run directories the cycles went through (a finished run is followed by a fresh one)
    ids: int = 0  # ids in the run that holds the fewest
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


def _group(pgid: int) -> list[int]:
    """Live processes of a process group (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    found.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return found


def _fork_server(pgid: int) -> int | None:
    for pid in _group(pgid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"multiprocessing.forkserver" in f.read():
                    return pid
        except OSError:
            continue
    return None


class _Disk:
    """A tmpfs under the run directory's parent that the `disk_full` fault fills (root only)."""

    def __init__(self, where: Path, size_mb: int):
        where.mkdir(parents=True, exist_ok=True)
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(where)]
        self.where, self.ok = where, subprocess.run(cmd, capture_output=True).returncode == 0

    def fill(self) -> None:
        with open(self.where / "filler", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
            except OSError:
                pass
            try:
                while True:
                    f.write(b"\0" * 512)
            except OSError:
                pass

    def free(self) -> None:
        (self.where / "filler").unlink(missing_ok=True)

    def close(self) -> None:
        if self.ok:
            subprocess.run(["umount", "-l", str(self.where)], check=False)


@dataclass
class _Cycle:
    """One cycle: the runs it started, and what it did to them."""

    procs: list[subprocess.Popen]
    fault: str
    faulted: set[int] = field(default_factory=set)  # pids the fault hit directly (killed, stopped)


def _wait_commit(out: Path, alive, plant, rng: random.Random, early: bool, max_delay_s: float) -> None:
    """Until the moment of the fault: a random delay from the start, or just after a new commit."""
    if early:
        deadline = time.monotonic() + rng.uniform(0.2, max_delay_s)
    else:
        journal, size = out / "commits.jsonl", _size(out / "commits.jsonl")
        give_up = time.monotonic() + 300
        while alive() and _size(journal) <= size and time.monotonic() < give_up:
            plant()
            time.sleep(0.02)
        deadline = time.monotonic() + rng.uniform(0.0, 1.5)
    while time.monotonic() < deadline and alive():
        plant()
        time.sleep(0.02)


def _apply(cycle: _Cycle, out: Path, args: list[str], env: dict, disk: _Disk | None) -> None:
    first = cycle.procs[0]
    if cycle.fault == "kill9":
        # either of a twin pair may hold the lock and the other be refused: kill whichever lives
        for proc in cycle.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                cycle.faulted.add(proc.pid)
    elif first.poll() is not None:
        return
    elif cycle.fault in ("lock_removed", "lock_replaced", "paused"):
        if cycle.fault == "paused":
            os.killpg(first.pid, signal.SIGSTOP)
        lock = out / "lock.json"
        if cycle.fault == "lock_replaced" and lock.exists():
            (out / "lock.copy").write_bytes(lock.read_bytes())
            os.replace(out / "lock.copy", lock)
        else:
            lock.unlink(missing_ok=True)
        second = _forge(args, env)
        cycle.procs.append(second)
        if cycle.fault == "paused":
            second.wait(600)  # the second resume runs while the first is stopped
            os.killpg(first.pid, signal.SIGCONT)
    elif cycle.fault == "fork_server":
        pid = _fork_server(first.pid)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
    elif cycle.fault == "disk_full" and disk is not None:
        disk.fill()
        first.wait(300)
        disk.free()


def _settle(cycle: _Cycle, result: SoakResult, number: int) -> None:
    """Wait for each run of the cycle (killing what a fault left hanging), and judge its end."""
    for proc in cycle.procs:
        try:
            text = proc.communicate(timeout=600 if cycle.fault != "kill9" else 1)[0].decode(errors="replace")
        except subprocess.TimeoutExpired:
            text = _kill(proc)
            if cycle.fault != "kill9":
                result.problems.append(f"cycle {number} ({cycle.fault}): a run did not end; killed")
        left = _group(proc.pid)
        deadline = time.monotonic() + 15  # a fork server leaves once its command has: give it a moment
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = _group(proc.pid)
        if left:
            _kill(proc)
            result.problems.append(f"cycle {number} ({cycle.fault}): processes left behind: {left}")
        if proc.pid in cycle.faulted and cycle.fault == "kill9":
            result.kills += 1
        elif "Traceback" in text:
            result.problems.append(f"cycle {number} ({cycle.fault}): a traceback: {text.strip()[-400:]}")
        elif proc.returncode == 0:
            result.finished_early += 1
        elif proc.returncode == 2 and BUSY in text:
            result.refused += 1
        elif proc.returncode == 2 and any(s in text for s in CLEAN_STOPS):
            result.clean_stops += 1
        else:
            result.problems.append(f"cycle {number} ({cycle.fault}): exit {proc.returncode}: {text.strip()[-300:]}")


def soak(
    out: Path,
    clean: Path,
    base: list[str],
    cycles: int,
    seed: int = 0,
    max_delay_s: float = 8.0,
    faults: tuple[str, ...] = ("kill9",),
    disk: _Disk | None = None,
) -> SoakResult:
    """Run the soak into `out`; `clean` gets an uninterrupted run of the same `base` overrides.
    A run that a cycle saw finish is checked, and the next cycle starts a fresh one beside it
    (`out-1`, `out-2`, ...), so every fault lands in a run with work left. `disk`: the tmpfs `out`
    lives on, for the `disk_full` fault (skipped without one)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    rng = random.Random(seed)
    result = SoakResult(cycles)
    kinds = [f for f in faults if f != "disk_full" or (disk is not None and disk.ok)]
    runs = [out]

    def plant() -> None:
        if not result.planted and (out / "run.json").exists():
            (out / FOREIGN).parent.mkdir(parents=True, exist_ok=True)
            (out / FOREIGN).write_text("a user's file, not Forge's\n")
            result.planted = True

    for number in range(cycles):
        if _finished(runs[-1]):
            runs.append(out.with_name(f"{out.name}-{len(runs)}"))
        args = [*base, f"output_dir={runs[-1]}", "resume=true"]
        fault = kinds[number % len(kinds)]
        result.faults[fault] = result.faults.get(fault, 0) + 1
        twin = fault == "kill9" and number % 2
        cycle = _Cycle([_forge(args, env) for _ in range(2 if twin else 1)], fault)
        alive = lambda c=cycle: any(p.poll() is None for p in c.procs)  # noqa: E731
        early = bool(number) and rng.random() < 0.3
        _wait_commit(runs[-1], alive, plant, rng, early=early, max_delay_s=max_delay_s)
        _apply(cycle, runs[-1], args, env, disk)
        _settle(cycle, result, number)
    _check_final(runs, clean, base, env, result)
    return result


def _finished(run: Path) -> bool:
    try:
        return json.loads((run / "run.json").read_text()).get("status") == "finished"
    except (OSError, ValueError):
        return False


def _check_final(runs: list[Path], clean: Path, base: list[str], env: dict, result: SoakResult) -> None:
    """Finish the last run, then hold every run to a clean run's ids (each exactly once) and activations."""
    import torch

    from forge import load_activations

    forge = [sys.executable, "-m", "forge.cli.app", "run"]
    final = subprocess.run([*forge, *base, f"output_dir={runs[-1]}", "resume=true"], env=env, capture_output=True)
    if final.returncode != 0:
        result.problems.append(f"final resume: exit {final.returncode}: {final.stderr.decode().strip()[-300:]}")
        return
    done = subprocess.run([*forge, *base, f"output_dir={clean}"], env=env, capture_output=True)
    if done.returncode != 0:
        result.problems.append(f"clean run: exit {done.returncode}: {done.stderr.decode().strip()[-300:]}")
        return
    want_ids, _, want = load_activations(clean)
    order = {i: k for k, i in enumerate(want_ids)}
    result.runs, result.ids, result.unique_ids = len(runs), len(want_ids), len(want_ids)
    for run in runs:
        ids, _, layers = load_activations(run)
        result.ids, result.unique_ids = min(result.ids, len(ids)), min(result.unique_ids, len(set(ids)))
        if sorted(ids) != sorted(want_ids):
            seen = f"{len(ids)} ids ({len(set(ids))} unique)"
            result.problems.append(f"{run.name}: {seen}, a clean run has {len(want_ids)}")
            continue
        pick = torch.tensor([order[i] for i in ids])
        diff = max(float((layers[layer] - want[layer][pick]).abs().max()) for layer in want)
        result.max_abs_diff = max(result.max_abs_diff, diff)
        if diff > 1e-5:
            result.problems.append(f"{run.name}: activations differ from a clean run's by {diff:.3g}")
    result.foreign_kept = (runs[0] / FOREIGN).exists()
    if result.planted and not result.foreign_kept:
        result.problems.append(f"{FOREIGN} was removed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2500)
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--executor", default="process", choices=["process", "inprocess"])
    ap.add_argument("--max-delay-s", type=float, default=10.0)
    ap.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}")
    ap.add_argument("--disk-mb", type=int, default=256, help="the tmpfs for disk_full")
    a = ap.parse_args()
    faults = tuple(f for f in a.faults.split(",") if f)
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        ap.error(f"unknown fault(s) {unknown}; choose from {', '.join(FAULTS)}")
    base = [
        f"input.limit={a.rows}",
        "layers=[1,4]",
        "shard_size=64",
        "runtime.commit_interval_s=0.5",
        f"runtime.executor={a.executor}",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        disk = _Disk(Path(tmp) / "disk", a.disk_mb) if "disk_full" in faults else None
        t0 = time.monotonic()
        try:
            where = disk.where if disk is not None and disk.ok else Path(tmp)
            r = soak(where / "run", Path(tmp) / "clean", base, a.cycles, a.seed, a.max_delay_s, faults, disk)
        finally:
            if disk is not None:
                disk.close()
    print(
        f"{a.cycles} cycles, {a.rows} rows, {a.executor} executor, {time.monotonic() - t0:.0f} s; faults {r.faults}: "
        f"{r.kills} kill -9, {r.refused} concurrent resumes refused, {r.clean_stops} clean stops, "
        f"{r.finished_early} ran to the end (rc 0)"
    )
    print(
        f"{r.runs} runs, each checked: at least {r.ids} ids, {r.unique_ids} unique; "
        f"max |diff| vs a clean run {r.max_abs_diff:.2e}; "
        f"foreign file kept: {r.foreign_kept}"
    )
    for p in r.problems:
        print(f"PROBLEM: {p}")
    sys.exit(0 if r.ok else 1)


if __name__ == "__main__":
    main()
