"""What logging to every tracker costs a run: `forge run` with no tracker against the same run with
TensorBoard, MLflow, W&B and trackio on (all offline, their files in the run directory), interleaved.

    python -m benchmarks trackers [--rows 1000] [--rounds 4]

Each variant is a fresh `forge run` process (the embedded model, `probe_gen`, the default token
batching), timed from its spawn to its exit, so the trackers' imports and start-up count; the
report's own `wall_s` (the run, without the process's imports) and useful tokens per second are
shown beside. Ratios are of medians over the interleaved rounds, the run without trackers the
baseline. Needs the trackers extra (`pip install -e '.[trackers]'`). Not a test.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from benchmarks import harness

NONE = "no tracker"
ALL = "tensorboard, mlflow, wandb, trackio"
TRACKERS = {NONE: [], ALL: ["trackers=[tensorboard,mlflow,wandb,trackio]"]}


def run_once(args: list[str], out: Path) -> dict[str, float]:
    child = harness.timed([sys.executable, "-m", "forge.cli.entry", "run", *args, f"output_dir={out}"])
    report = json.loads((out / "report.json").read_text())
    bad = {k: v for k, v in (report.get("trackers") or {}).items() if v != "logged"}
    if bad or report["status"] != "finished":
        raise SystemExit(f"trackers: a run did not finish with every tracker logged: {report['status']} {bad}")
    return {"wall_s": child.wall_s, "run_wall_s": report["wall_s"], "tok_s": report["useful_tokens_per_s"]}


def main(argv: list[str] | None = None) -> None:
    a = harness.parser(__doc__, rounds=4, rows=1000).parse_args(argv)
    harness.need("tensorboard", "mlflow", "wandb", "trackio", extra="trackers")
    with tempfile.TemporaryDirectory() as tmp:

        def variant(name: str):
            args = [f"input.limit={a.rows}", *TRACKERS[name]]
            return lambda r: run_once(args, Path(tmp) / f"run-{r}-{len(TRACKERS[name])}")

        trials = harness.interleave({name: variant(name) for name in TRACKERS}, a.rounds)
    rep = harness.Report(a)
    rows = []
    for name in trials.names:
        wall, run_wall = trials.median(name), trials.median(name, "run_wall_s")
        ratio = wall / trials.median(NONE)
        run_ratio = run_wall / trials.median(NONE, "run_wall_s")
        tok_s = trials.median(name, "tok_s")
        rows.append([name, f"{wall:.2f}", f"{ratio:.3f}", f"{run_wall:.2f}", f"{run_ratio:.3f}", f"{tok_s:,.0f}"])
    header = [f"trackers ({a.rows} rows, {a.rounds} rounds, medians)", "process s", "x none", "run s", "x none"]
    rep.table([*header, "useful tok/s"], rows)
    rep.trials(trials)
    rep.save()


if __name__ == "__main__":
    main()
