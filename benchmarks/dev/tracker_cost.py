"""A developer's check, not a benchmark: what each built-in tracker costs its process, alone.

    python -m benchmarks tracker-cost [--logs 200]

For each tracker, a fresh interpreter (as the trackers' process is) imports the tracker's class,
starts it on a temporary folder with 150 parameters (its library's import and start-up), logs
`--logs` batches of ten figures and finishes; it prints the CPU seconds (`time.process_time`,
every thread's) of each step. The CPU of a service the library starts (wandb's `wandb-core`) is
not counted. Needs the trackers extra.
"""

from __future__ import annotations

import json
import subprocess
import sys

TRACKERS = ("tensorboard", "mlflow", "wandb", "trackio")

CHILD = """
import json, sys, tempfile, time
from pathlib import Path
t0 = time.process_time()
from forge.builtin.trackers import forge_trackers
from forge.config.trackers import SETTINGS
from forge.pluginmanager import load_object
from forge.tracker import TrackerRun
name, n = sys.argv[1], int(sys.argv[2])
tracker = load_object(forge_trackers()[name], name)()
t1 = time.process_time()
folder = Path(tempfile.mkdtemp(prefix="forge-tracker-cost-")) / name
folder.mkdir()
tracker.start(TrackerRun(name, folder, SETTINGS[name](), "cost", {f"key{i}": i for i in range(150)}, None))
t2 = time.process_time()
for step in range(n):
    tracker.log(100 * (step + 1), {f"figure/{i}": float(step) for i in range(10)})
t3 = time.process_time()
tracker.finish(100 * n, {"items/completed": n}, "finished")
t4 = time.process_time()
print(json.dumps({"forge": t1 - t0, "start": t2 - t1, "logs": t3 - t2, "finish": t4 - t3}))
"""


def main(argv: list[str] | None = None) -> None:
    from benchmarks import harness

    ap = harness.parser(__doc__)
    ap.add_argument("--logs", type=int, default=200, help="batches logged (default: 200)")
    a = ap.parse_args(argv)
    harness.need(*TRACKERS, extra="trackers")
    rep = harness.Report(a)
    rows = []
    for name in TRACKERS:
        out = subprocess.run([sys.executable, "-c", CHILD, name, str(a.logs)], capture_output=True, text=True)
        got = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
        cells = [f"{got[k]:.2f}" for k in ("forge", "start", "logs", "finish")]
        rows.append([name, *cells, f"{1000 * got['logs'] / a.logs:.2f}"])
    header = ["tracker", "Forge's modules CPU s", "import + start CPU s", f"{a.logs} logs CPU s", "finish CPU s"]
    rep.table([*header, "ms a log"], rows)
    rep.save()


if __name__ == "__main__":
    main()
