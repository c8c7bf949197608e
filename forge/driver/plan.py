"""`forge plan`: admit, pack and route the whole input without loading any weights.

Model: the run loop of `forge run`, with the simulated executor (`forge.executors.sim`):
batches complete in virtual time, so the device that would be idle first asks for the next
batch. Simulated devices (`sim:` in the inventory) run in seconds, from their declared step
time, and run out of memory when a batch's true peak (the measured memory model without its
safety margin) exceeds their budget; plain devices run in token-equivalents (padded slots +
prefix tokens computed + the per-step overhead). The figures are those a run reports, plus
each device's busy share and finish time in virtual time.
"""

from __future__ import annotations

import time

import pluggy

from forge.core.loop import Committer, RunLoop, Stop
from forge.driver.engine import RunSpec, prepare
from forge.driver.output_size import describe
from forge.driver.report import PlanFigures, Report, VirtualTime, finish_report, make_report
from forge.executors import SimExecutor
from forge.executors.sim import time_unit
from forge.hookspecs import hookimpl
from forge.vocab.geometry import Batch


class _Kept:
    """A sink that keeps every batch (`forge plan --plot`)."""

    def __init__(self):
        self.batches: list[Batch] = []

    def write(self, batch, output, keep) -> None:
        self.batches.append(batch if keep is None else batch.select(keep))

    def full(self) -> bool:
        return False

    def flush(self) -> None:
        pass


class _Stored:
    """Counts what the run would store: committed items and their own tokens (after their prefixes)."""

    def __init__(self):
        self.items = 0
        self.own_tokens = 0

    @hookimpl
    def forge_batch_completed(self, run, batch, device, stats) -> None:
        self.items += len(batch.items)
        self.own_tokens += batch.num_tokens - batch.prefix_tokens


def plan(spec: RunSpec, pm: pluggy.PluginManager, keep_batches: bool = False) -> Report:
    """The run's geometry: batches, padding, predicted cache hits, per device."""
    started = time.perf_counter()
    unit = time_unit(spec.devices)
    run, scheduler = prepare(spec, pm, dry_run=True)
    executor = SimExecutor(
        scheduler.packer.overhead_tokens,
        _true_bytes(spec, scheduler.packer),
        timeline=keep_batches,
        planned=spec.function.planned_peak_bytes,
    )
    executor.start(spec.devices)
    kept = _Kept() if keep_batches else None
    loop = RunLoop(
        scheduler, executor, Committer(kept, set(), float("inf")), run=run, hook=pm.hook, policy=spec.runtime
    )
    status, error = "finished", None
    stored = _Stored()
    pm.register(stored)
    try:
        loop.run_until_done()
    except Stop as stop:
        status, error = stop.status, str(stop)
    finally:
        pm.unregister(stored)
        scheduler.close()
    wall_s = time.perf_counter() - started
    balance = executor.balance()
    figures = PlanFigures(
        end_splits=scheduler.end_splits,
        output_bytes=describe(spec.function, stored.items, stored.own_tokens),
        virtual_time=VirtualTime(
            unit=unit,
            makespan=round(balance["makespan"], 6),
            finish_skew=round(balance["finish_skew"], 6),
            min_busy_share=round(balance["min_busy_share"], 6),
        ),
        simulated_cost_tokens={k: int(v) for k, v in executor.clocks.items()} if unit == "token-equivalents" else None,
        kept_batches=kept.batches if kept is not None else None,
        timeline=executor.timeline if keep_batches else None,
        placements={name: p.as_dict() for name, p in spec.placements.items()} or None,
    )
    report = make_report(
        run,
        spec,
        loop,
        scheduler,
        wall_s=wall_s,
        status=status,
        error=error,
        attempts={"oom": loop.counts.get("oom", 0), "oom_splits": scheduler.oom_splits},
        figures=figures,
    )
    for d in report.devices:
        b = balance["devices"][d.name]
        d.virtual_busy = round(b["busy"], 6)
        d.virtual_finish = round(b["finish"], 6)
        d.busy_share = round(b["busy_share"], 6)
        d.oom = b["oom"]
        if executor.true_bytes is not None:
            d.simulated_peak_bytes = b["peak_bytes"]  # true peak (no margin) of its largest completed batch
        d.planned_peak_bytes = executor.planned_peaks.get(d.name)  # the function's own bound (generate's)
    return finish_report(report, run=run, pm=pm)


def _true_bytes(spec: RunSpec, packer):
    """A batch's true peak bytes on a simulated device with a memory budget (the measured model
    without its safety margin); None when no simulated device declares memory or the function
    has no memory model."""
    if not any(d.sim is not None and d.memory_bytes for d in spec.devices):
        return None
    cost = packer.cost_model or spec.function.cost_model()
    if cost is None:
        return None

    def true_bytes(batch: Batch) -> int:
        return cost.true_bytes(batch.num_rows, batch.padded_len, batch.prefix_len if batch.split_prefix else 0)

    return true_bytes
