"""The fault scenarios of tests/test_faults.py, run once each, with their figures as a table.

    python -m benchmarks faults [--rows 48]

Each scenario runs the embedded model on the first `--rows` statements with the test-only fault
plugin (tests/faults.py) and prints what the report says happened: items, retried and
discarded tokens, timeouts, lost workers, out-of-memory splits and restarts. Not a test: the
assertions live in tests/test_faults.py.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from benchmarks import harness

TESTS = harness.ROOT / "tests"


def main(argv: list[str] | None = None) -> None:
    args = harness.parser(__doc__, rows=48).parse_args(argv)
    sys.path.insert(0, str(TESTS))
    from conftest import run_forge

    base = [
        "devices=auto",
        "devices.limits.max_batch_tokens=1024",
        "devices.limits.max_seq_len=512",
        "budget.tokens_per_step=1024",
        "layers=[1,4]",
        f"input.limit={args.rows}",
        "batching.window=16",
        "plugins=[faults]",
    ]
    proc = ["runtime.executor=process", "runtime.max_restarts=8", "runtime.max_in_flight=1"]
    scenarios = [
        ("kill before forward x3", {"kill": {"point": "before_forward", "every": 3, "times": 3}}, proc),
        ("kill during forward x3", {"kill": {"point": "during_forward", "every": 3, "times": 3}}, proc),
        ("kill after forward x3", {"kill": {"point": "after_forward", "every": 3, "times": 3}}, proc),
        (
            "chaos (30% of batches, 4 kills)",
            {"chaos": {"share": 0.3, "times": 4, "seed": 7}},
            [*proc, "runtime.max_in_flight=2"],
        ),
        (
            "hang 300 s (timeout 8 s, grace 1 s)",
            {"hang": {"seconds": 300, "nth": 2}},
            [*proc, "runtime.batch_timeout_s=8", "runtime.kill_grace_s=1"],
        ),
        (
            "slow 16 s (timeout 8 s, grace 60 s)",
            {"hang": {"seconds": 16, "nth": 2}},
            [*proc, "runtime.batch_timeout_s=8", "runtime.kill_grace_s=60"],
        ),
        (
            "out of memory above 400 slots",
            {"oom_above": 400},
            ["runtime.executor=inprocess", "batching.prefix_cache=false"],
        ),
        (
            "out of memory above 300 slots (some items alone)",
            {"oom_above": 300},
            ["runtime.executor=inprocess", "batching.prefix_cache=false", "runtime.failure_window=1000"],
        ),
        (
            "every batch fails (window 10)",
            {"fail": "simulated recurring fault"},
            ["runtime.executor=inprocess", "runtime.failure_window=10"],
        ),
        ("first shard write fails (disk full)", {"fail_write": 1}, ["runtime.executor=inprocess", "shard_size=16"]),
    ]
    rep = harness.Report(args)
    lines = []
    for name, plan, extra in scenarios:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "markers").mkdir()
            os.environ["FORGE_FAULTS"] = json.dumps({"dir": str(Path(tmp) / "markers"), **plan})
            r = run_forge(Path(tmp) / "run", *base, *extra)
            i, t, a = r["items"], r["tokens"], r["attempts"]
            assert r["balanced"], r["imbalance"]
            lines.append(
                [name, r["status"], f"{i['completed']} / {i['failed']} / {i['unfinished']}", f"{t['retried']:,}"]
                + [f"{t['discarded']:,}", a["timeout"], a["lost"], a["oom_splits"], a["late_results"]]
                + [sum(r["restarts"].values())]
            )
            harness.note(f"{name}: {r['status']}")
    header = ["scenario", "status", "items completed / failed / unfinished", "tokens retried", "tokens discarded"]
    rep.table([*header, "timeouts", "lost", "oom splits", "late results", "restarts"], lines)
    rep.save()


if __name__ == "__main__":
    main()
