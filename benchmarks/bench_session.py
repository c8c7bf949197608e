"""A forge.Session's calls on the embedded model: how long from a call to its first batch's
start, the first call (which loads the weights) and the calls after it (which do not).

    python benchmarks/bench_session.py [--calls 6] [--rows 200]

`start_s`: from the call (`forge.Session.run` entered) to the first batch handed to the executor
(the `forge_batch_routed` hook); `first_batch_s`: report.json's phase, to the first batch's result
committed. Prints one JSON object: each call's figures, the median of the warm calls (all but
the first), and the session's weight loads (1: loaded once)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import forge
from forge.hookspecs import hookimpl
from forge.pluginmanager import extra_plugins


class FirstRouted:
    """The time.time() of each run's first batch handed to the executor."""

    __name__ = "bench-first-routed"

    def __init__(self) -> None:
        self.at: list[float] = []

    @hookimpl
    def forge_run_start(self, run) -> None:
        self.at.append(0.0)

    @hookimpl
    def forge_batch_routed(self, run, batch, device) -> None:
        if not self.at[-1]:
            self.at[-1] = time.time()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument("--rows", type=int, default=200)
    args = parser.parse_args()
    rows = [
        {"id": n, "text": f"Statement {n} is {'true' if n % 3 else 'false'}.", "label": n % 2} for n in range(args.rows)
    ]
    first, wall, start, routed = [], [], [], FirstRouted()
    with forge.Session() as session, extra_plugins(routed):
        for _ in range(args.calls):
            t0, w0 = time.time(), time.perf_counter()
            result = session.run("probe_gen", rows)
            wall.append(round(time.perf_counter() - w0, 3))
            start.append(round(routed.at[-1] - t0, 3))
            first.append(result.report["phases"]["first_batch_s"])
        loads = session.models.loads
    print(
        json.dumps(
            {
                "start_s": start,
                "first_batch_s": first,
                "wall_s": wall,
                "warm_start_median_s": statistics.median(start[1:]) if len(start) > 1 else None,
                "warm_first_batch_median_s": statistics.median(first[1:]) if len(first) > 1 else None,
                "weight_loads": loads,
            }
        )
    )


if __name__ == "__main__":
    main()
