"""Start-up as a user pays it: `forge run` with its fork server started at three points, interleaved.

    python -m benchmarks startup [--rows 1000] [--rounds 3]

Each round runs the same command in fresh processes, interleaved (the harness: A B C ..., then
... C B A): `forge run` as it
ships (its entry point, `forge.cli.entry`, starts the process executor's fork server importing
torch and transformers before it imports the CLI: `forge.cli.early.start_workers`; no `forge
server` answers, its socket folder is a fresh one); the CLI module run directly, which makes the
same call once typer has parsed the command (`python -m forge.cli.app`); that call made a no-op
(the fork server starts once the config is composed, while the function is set up); both made
no-ops (the fork server starts when the executor does); and as it ships on a cache that has not
yet kept the model class's facts (`forge.runtime.model.class_facts`: the file is removed before each
such run, so the command's own process imports the modeling code, as a first run does).
It prints the report's phases (seconds from the command's start: `start_s`, `worker_start_s`,
`worker_ready_s`, `first_batch_s`, `total_s`, and `worker_load_s`, the model load alone) and
the wall time of each process, medians per variant. Not a test.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from benchmarks import harness

# The shipped CLI with early starts disabled; the guard keeps the fork server from running it.
NO_WARM_UP = """
import sys
if __name__ == "__main__":
    import forge.cli.app as cli
    cli.start_workers = lambda args: False
    if sys.argv.pop(1) == "late":
        cli._warm_up_workers = lambda cfg: None
    cli._COMMAND = True
    sys.argv = ["forge", *sys.argv[1:]]
    cli.main()
"""
KEYS = ("start_s", "worker_start_s", "worker_load_s", "worker_ready_s", "first_batch_s", "total_s")
SHIPPED = "as shipped: fork server before the CLI's imports"
FRESH = "as shipped, class facts not kept yet"


def run_once(variant: str, args: list[str], out: Path, script: Path) -> dict[str, float]:
    command = {
        SHIPPED: [sys.executable, "-m", "forge.cli.entry"],
        FRESH: [sys.executable, "-m", "forge.cli.entry"],
        "fork server before composing": [sys.executable, "-m", "forge.cli.app"],
        "fork server after composing": [sys.executable, str(script), "composed"],
        "fork server at executor start": [sys.executable, str(script), "late"],
    }[variant]
    if variant == FRESH:
        from forge.runtime.model.class_facts import cache_path

        cache_path().unlink(missing_ok=True)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(out.parent)}  # a folder where no forge server answers
    child = harness.timed([*command, "run", *args, f"output_dir={out}"], env=env)
    phases = json.loads((out / "report.json").read_text())["phases"]
    return {**{k: phases[k] for k in KEYS}, "wall_s": child.wall_s}


def main(argv: list[str] | None = None) -> None:
    a = harness.parser(__doc__, rounds=3, rows=1000).parse_args(argv)
    args = [f"input.limit={a.rows}", "runtime.executor=process"]
    variants = (SHIPPED, FRESH, "fork server before composing", "fork server after composing")
    variants += ("fork server at executor start",)
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "no_warm_up.py"
        script.write_text(NO_WARM_UP)

        def variant(k: int, name: str):
            return lambda r: run_once(name, args, Path(tmp) / f"run-{r}-{k}", script)

        trials = harness.interleave({v: variant(k, v) for k, v in enumerate(variants)}, a.rounds)
    rep = harness.Report(a)
    lines = [[v, *(f"{trials.median(v, k):.2f}" for k in (*KEYS, "wall_s"))] for v in trials.names]
    rep.table([f"variant ({a.rows} rows, {a.rounds} rounds, medians)", *KEYS, "wall_s"], lines)
    rep.trials(trials)
    rep.save()


if __name__ == "__main__":
    main()
