"""What logging to every tracker costs a run: `forge run` with no tracker against the same run with
TensorBoard, MLflow, W&B and trackio on (all offline, their files in the run directory), interleaved.

    python -m benchmarks trackers [--rows 1000] [--rounds 4]

Each variant is a fresh `forge run` process (the embedded model, `probe_gen`, the default token
batching), timed from its spawn to its exit, as a user runs it, so the trackers' imports and
start-up count. Up to 2,500 rows the input is the embedded statements (`input.limit`); more rows
are those statements repeated with unique ids, written once as a JSONL file (a longer run, where
the trackers' fixed start-up is a smaller share). A third variant runs the four trackers'
process at a lower priority (FORGE_TRACKERS_NICE=10; by default the run's own). The
report's own `wall_s` (the run, without the process's imports) and useful tokens per second are
shown beside, with the CPU seconds of the command's processes (what contention on a busy machine
does not change) and how long the run's end waited for the trackers' last writes. Ratios are of
medians over the interleaved rounds, the run without trackers the baseline, and each round's
own ratio of process wall times. Needs the trackers extra (`pip install -e '.[trackers]'`). Not a test.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
from pathlib import Path

from benchmarks import harness

NONE = "no tracker"
ALL = "tensorboard, mlflow, wandb, trackio"
NICE10 = "the same four, their process at niceness 10"
FOUR = ["trackers=[tensorboard,mlflow,wandb,trackio]"]
TRACKERS = {NONE: [], ALL: FOUR, NICE10: FOUR}
ENV = {NICE10: {"FORGE_TRACKERS_NICE": "10"}}
EMBEDDED_ROWS = 2500
STATEMENTS = harness.ROOT / "functions" / "assets" / "statements.jsonl"


def input_args(rows: int, folder: Path) -> list[str]:
    """The run's input: the embedded statements, or (more rows) them repeated with unique ids."""
    if rows <= EMBEDDED_ROWS:
        return [f"input.limit={rows}"]
    base = [json.loads(line) for line in STATEMENTS.read_text().splitlines() if line.strip()]
    path = folder / "rows.jsonl"
    with open(path, "w") as f:
        f.writelines(json.dumps({**base[k % len(base)], "id": f"r{k:07d}"}) + "\n" for k in range(rows))
    return [f"input.path={path}"]


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(args: list[str], out: Path, env: dict[str, str] | None = None) -> dict[str, float]:
    cpu = _children_cpu_s()
    cmd = [sys.executable, "-m", "forge.cli.entry", "run", *args, f"output_dir={out}"]
    child = harness.timed(cmd, {**os.environ, **env} if env else None)
    cpu = _children_cpu_s() - cpu  # the command's processes that were waited for: CPU seconds, contention aside
    report = json.loads((out / "report.json").read_text())
    bad = {k: v for k, v in (report.get("trackers") or {}).items() if v != "logged"}
    if bad or report["status"] != "finished":
        raise SystemExit(f"trackers: a run did not finish with every tracker logged: {report['status']} {bad}")
    figures = {"wall_s": child.wall_s, "run_wall_s": report["wall_s"], "tok_s": report["useful_tokens_per_s"]}
    return {**figures, "cpu_s": cpu, "end_s": report.get("trackers_end_s") or 0.0}


def main(argv: list[str] | None = None) -> None:
    a = harness.parser(__doc__, rounds=4, rows=1000).parse_args(argv)
    harness.need("tensorboard", "mlflow", "wandb", "trackio", extra="trackers")
    with tempfile.TemporaryDirectory() as tmp:
        given = input_args(a.rows, Path(tmp))

        def variant(name: str):
            args, k = [*given, *TRACKERS[name]], list(TRACKERS).index(name)
            return lambda r: run_once(args, Path(tmp) / f"run-{r}-{k}", ENV.get(name))

        trials = harness.interleave({name: variant(name) for name in TRACKERS}, a.rounds)
    rep = harness.Report(a)
    rows = []
    for name in trials.names:
        cells = [name]
        for key in ("wall_s", "run_wall_s", "cpu_s"):
            mine = trials.median(name, key)
            cells += [f"{mine:.2f}", f"{mine / trials.median(NONE, key):.3f}"]
        rows.append([*cells, f"{trials.median(name, 'end_s'):.3f}", f"{trials.median(name, 'tok_s'):,.0f}"])
    header = [f"trackers ({a.rows} rows, {a.rounds} rounds, medians)", "process s", "x none", "run s", "x none"]
    rep.table([*header, "CPU s", "x none", "end wait s", "useful tok/s"], rows)
    for name in (ALL, NICE10):
        ratios = [trials.samples[name][r]["wall_s"] / trials.samples[NONE][r]["wall_s"] for r in range(a.rounds)]
        rep.text("", f"process wall, {name} / none, round by round: {', '.join(f'{x:.3f}' for x in ratios)}")
    rep.text("", f"machine load at the end: {os.getloadavg()[0]:.1f}")
    rep.trials(trials)
    rep.save()


if __name__ == "__main__":
    main()
