"""`forge plan`: admit, pack and route the whole input without loading any weights.

Model: the run loop of `forge run`, with the simulated executor: batches complete in
virtual time (padded slots + prefix tokens computed + the device's per-step overhead, in
token-equivalents), so the device that would be idle first asks for the next batch. The
figures are those a run reports, with time in token-equivalents.
"""

from __future__ import annotations

import time
from typing import Any

import pluggy

from forge.engine import RunSpec, prepare
from forge.executors import SimExecutor
from forge.geometry import Batch
from forge.loop import Committer, RunLoop, Stop
from forge.report import finish_report


class _Kept:
    """A sink that keeps every batch (`forge plan --plot`)."""

    rows_per_shard = 1 << 62

    def __init__(self):
        self.batches: list[Batch] = []

    def write(self, batch, output, keep) -> None:
        self.batches.append(batch if keep is None else batch.select(keep))

    def flush(self) -> None:
        pass


def plan(spec: RunSpec, pm: pluggy.PluginManager, keep_batches: bool = False) -> dict[str, Any]:
    """The run's geometry: batches, padding, predicted cache hits, per device."""
    started = time.perf_counter()
    run, scheduler = prepare(spec, pm, dry_run=True)
    executor = SimExecutor(scheduler.packer.overhead_tokens)
    executor.start(spec.devices)
    kept = _Kept() if keep_batches else None
    loop = RunLoop(scheduler, executor, Committer(kept, set(), 1 << 62, float("inf")), run=run, hook=pm.hook,
                   policy=spec.runtime.policy)
    status, error = "finished", None
    try:
        loop.run_until_done()
    except Stop as stop:
        status, error = stop.status, str(stop)
    report = finish_report(
        run=run, pm=pm, spec=spec, tallies=loop.tallies, predicted_misses=scheduler.cache_misses,
        wall_s=time.perf_counter() - started,
        extra={"status": status, "error": error, "max_window_items": scheduler.max_window_seen,
               "simulated_cost_tokens": {k: int(v) for k, v in executor.clocks.items()}},
    )
    report.pop("useful_tokens_per_s", None)
    for d in report["devices"]:
        d.pop("busy_s", None)  # simulated: see simulated_cost_tokens
    if keep_batches:
        report["_batches"] = kept.batches
    return report
