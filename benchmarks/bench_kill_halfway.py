"""What a `kill -9` halfway through a generate run keeps (issue 48): `forge run function=generate`
with the defaults (the embedded 500 prompts), killed when half of an uninterrupted run's wall
time has passed, then resumed.

    python -m benchmarks kill-halfway [--rounds 2] [-- extra overrides...]

Each round runs the command uninterrupted (its wall time T, from spawn to exit), then again,
killed with SIGKILL (its process group: the driver and its workers) at T/2 from its spawn; the
rows that run committed are read from its journal (`commits.jsonl`). It is resumed
(`resume=true`), and the resumed run's rows are compared with the uninterrupted run's, id by
id (the text, the generated ids and the finish reason). Prints each round's T, when the
uninterrupted run's worker was ready and its parts were committed (share of T), the share
committed at the kill, the resume's own wall time and whether the rows are equal. Not a test:
it kills at a wall-clock moment, which a loaded machine moves.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness


def forge_cmd(out: Path, extra: list[str], *more: str) -> list[str]:
    return [sys.executable, "-m", "forge.cli.app", "run", "function=generate", f"output_dir={out}", *extra, *more]


def run(cmd: list[str], kill_at: float | None = None, curve: list | None = None) -> float:
    """Spawn `cmd` in its own process group; kill the group at `kill_at` s. Returns the wall time.
    With `curve`, the run's journal is read every 50 ms and (seconds from spawn, rows committed)
    appended at each change."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=harness.child_env(), start_new_session=True
    )
    out = Path(next(a for a in cmd if a.startswith("output_dir=")).split("=", 1)[1])
    deadline = None if kill_at is None else t0 + kill_at
    while proc.poll() is None and (deadline is None or time.perf_counter() < deadline):
        if curve is not None and (n := committed(out)) != (curve[-1][1] if curve else 0):
            curve.append((time.perf_counter() - t0, n))
        time.sleep(0.05)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if curve is not None and (n := committed(out)) != (curve[-1][1] if curve else 0):
        curve.append((time.perf_counter() - t0, n))
    return time.perf_counter() - t0


def model_ready_s(run_dir: Path) -> float | None:
    """Seconds from the run's start to its first worker ready (report.json's phases): the
    start-up before which no row can be committed, whatever the schedule."""
    try:
        return float(json.loads((run_dir / "report.json").read_text())["phases"]["worker_ready_s"])
    except (OSError, KeyError, TypeError, ValueError):
        return None


def committed(run_dir: Path) -> int:
    """Rows the run's journal holds (a torn last line, as a kill may leave it, counts nothing)."""
    n = 0
    path = run_dir / "commits.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            n += len(json.loads(line).get("index", []))
        except ValueError:
            pass
    return n


def rows(run_dir: Path) -> dict[str, tuple]:
    """id -> (text, generated ids, finish reason) of every row the run committed."""
    import pyarrow.parquet as pq

    got: dict[str, tuple] = {}
    for shard in sorted((run_dir / "generate").glob("shard-*.parquet")):
        table = pq.read_table(shard).to_pylist()
        for r in table:
            got[str(r["id"])] = (r["text"], tuple(r["generated_ids"]), r["finish_reason"])
    return got


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    args = harness.parser(__doc__, rounds=2).parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-kill-halfway-"))
    lines = []
    for r in range(args.rounds):
        clean, killed = work / f"clean-{r}", work / f"killed-{r}"
        curve: list[tuple[float, int]] = []
        wall = run(forge_cmd(clean, extra), curve=curve)
        run(forge_cmd(killed, extra), kill_at=wall / 2)
        kept = committed(killed)
        resume = run(forge_cmd(killed, extra, "resume=true"))
        want, got = rows(clean), rows(killed)
        same = got == want and len(want) > 0
        total = len(want)
        ready = model_ready_s(clean)
        parts = ", ".join(f"{n} at {t / wall:.0%}" for t, n in curve)
        lines.append(
            [
                r + 1,
                f"{wall:.1f}",
                "-" if ready is None else f"{ready:.1f} ({ready / wall:.0%})",
                parts,
                f"{kept} of {total} ({kept / max(total, 1):.0%})",
                f"{resume:.1f}",
                same,
            ]
        )
        harness.note(f"round {r + 1}: T {wall:.1f} s, {kept} of {total} committed at T/2, rows equal: {same}")
    head = ["round", "uninterrupted s (T)", "worker ready s", "its commits (rows at share of T)"]
    print(harness.table([*head, "committed at T/2", "resume s", "resumed = uninterrupted"], lines))


if __name__ == "__main__":
    main()
