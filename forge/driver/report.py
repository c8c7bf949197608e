"""The run's report: what the engine measured plus what plugins (the ledger) add.

Model: a `Report` holds the figures every run and plan has, a run's own (`RunFigures`) or a
plan's own (`PlanFigures`), and `plugins`: the keys `forge_run_end` implementations added
(the ledger's items, tokens, balance, ...), kept as they gave them. `as_dict()` is report.json:
the same keys the report has always had, plus `schema_version`. The report also reads as that
mapping, read-only (`report["status"]`, `report.get("items")`), so code holding the returned
report and code reading report.json name the same keys; a plugin's keys have no attribute.

Light on purpose: the warm path of the `forge` command imports this module (`process_started`),
so it imports only the standard library.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pluggy

    from forge.core.loop import RunLoop
    from forge.core.scheduler import Scheduler
    from forge.vocab.geometry import Batch, Device
    from forge.vocab.records import RunContext

#: report.json's layout: raised when a key changes meaning or goes away (a new key keeps it)
SCHEMA_VERSION = 1


def process_started() -> float:
    """When this process started, on the time.time() scale: a command's start as its user pays
    it (interpreter start and imports included). Linux's /proc; elsewhere, now."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])  # field 22, starttime, in clock ticks since boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - max(0.0, age)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


@dataclass
class DeviceReport:
    """One device's figures. A None field is one this kind of report lacks: left out of JSON."""

    name: str
    limits: dict[str, int]  # as declared (`Report.effective_limits`: where the run changed them)
    batches: int
    tree_batches: int  # of them, batches of merged prefix groups
    tokens: int  # useful tokens completed
    padded_slots: int
    busy_s: float | None  # wall seconds busy; None in a plan (it has only virtual time)
    cache_misses: int
    predicted_cache_misses: int
    layouts: dict[str, int] | None = None  # completed batches per layout (forge.core.layouts.layout)
    predicted_peak_bytes: int | None = None  # batching=memory: the largest predicted peak routed here
    memory_budget_bytes: int | None = None  # batching=memory: the budget it was planned against
    # a plan's, in virtual time (forge.executors.sim)
    virtual_busy: float | None = None
    virtual_finish: float | None = None
    busy_share: float | None = None
    oom: int | None = None
    simulated_peak_bytes: int | None = None  # a simulated device's true peak (no margin) of its largest batch
    # a plan's: the function's bound of the device memory its worker holds (Function.planned_peak_bytes)
    planned_peak_bytes: int | None = None
    # a run's: the most resident memory (RSS) its worker's process held, as that process measured it
    # after each batch (the run's own process for runtime.executor=inprocess; the largest where replaced)
    resident_peak_bytes: int | None = None
    resident_ready_bytes: int | None = None  # a run's: what that process held once the model was loaded

    def as_dict(self) -> dict[str, Any]:
        # a predicted peak comes with its budget, even an unknown one
        paired = self.predicted_peak_bytes is not None
        return {
            f.name: v
            for f in fields(self)
            if (v := getattr(self, f.name)) is not None or (paired and f.name == "memory_budget_bytes")
        }


@dataclass
class RunFigures:
    """What only a run reports."""

    outputs: dict[str, Any]  # the sink's figures: what it wrote, and where
    phases: dict[str, float | bool | None]  # where the time went (`forge.driver.phases.phases`)
    scheduler_s: float  # time spent in the scheduler
    restarts: dict[str, int]  # device -> workers replaced
    retired: dict[str, str]  # device -> why it ran no more work
    executor: dict[str, Any] = field(default_factory=dict)  # `Executor.info()`: top-level keys ("ray")
    useful_tokens_per_s: float | None = None  # tokens this session completed per wall second (a resume: its own)
    #: the most resident memory (RSS) the run's own process held (with the in-process executor, its
    #: model and batches too); each device's worker's is its `DeviceReport.resident_peak_bytes`
    driver_resident_peak_bytes: int | None = None


@dataclass
class VirtualTime:
    """A plan's virtual clock: when the last device finished, and how evenly they did."""

    unit: str  # "s" (simulated devices' declared step times) or "token-equivalents"
    makespan: float
    finish_skew: float
    min_busy_share: float


@dataclass
class PlanFigures:
    """What only a plan reports. `kept_batches` and `timeline` are for `forge plan --plot`: never
    in JSON."""

    end_splits: int  # batches split at the end of the input to even out the devices' finish
    output_bytes: dict[str, Any] | None = None  # what the run would write (None: unknown)
    virtual_time: VirtualTime | None = None
    simulated_cost_tokens: dict[str, int] | None = None  # device -> its clock, in token-equivalents
    kept_batches: list[Batch] | None = None  # every batch, in commit order (`keep_batches`)
    timeline: list[Any] | None = None  # every batch's span on its device (`forge.executors.sim.Span`)
    placements: dict[str, Any] | None = None  # device group -> its placement (`Placement.as_dict`); None: no group


@dataclass(eq=False)
class Report(Mapping[str, Any]):
    """A run's or a plan's report; reads as report.json's mapping (`as_dict`)."""

    function: str
    batching: str
    dry_run: bool  # a plan
    model: Any
    input: Any
    path: Any  # how the function runs, in words
    config: dict[str, Any]  # the resolved config
    devices: list[DeviceReport]
    warnings: list[str]
    wall_s: float
    status: str = "finished"  # finished | interrupted | stopped | stalled | failed (every item failed)
    error: str | None = None  # why, when not finished
    max_window_items: int = 0
    attempts: dict[str, int] = field(default_factory=dict)  # failed attempts by kind, and OOM splits
    effective_limits: dict[str, dict[str, int]] = field(default_factory=dict)  # device -> limits, where changed
    batches: int = 0
    layouts: dict[str, int] = field(default_factory=dict)  # completed batches per layout, every device
    prefixes: dict[str, Any] | None = None  # how the items' prefixes were had (`prefix_figures`)
    run: RunFigures | None = None  # a run's own figures
    plan: PlanFigures | None = None  # a plan's own figures
    plugins: dict[str, Any] = field(default_factory=dict)  # keys forge_run_end implementations added
    schema_version: int = SCHEMA_VERSION

    def as_dict(self) -> dict[str, Any]:
        """report.json, keys in the order they have always had (`schema_version` first)."""
        run, plan = self.run, self.plan
        out: dict[str, Any] = {"schema_version": self.schema_version}
        for key in ("function", "batching", "dry_run", "model", "input", "path", "config"):
            out[key] = getattr(self, key)
        out.update(devices=[d.as_dict() for d in self.devices], warnings=self.warnings, wall_s=self.wall_s)
        out.update(status=self.status, error=self.error)
        if run is not None:
            out.update(outputs=run.outputs, phases=run.phases)
        out["max_window_items"] = self.max_window_items
        if run is not None:
            out["scheduler_s"] = run.scheduler_s
        out["attempts"] = self.attempts
        if run is not None:
            out.update({**run.executor, "restarts": run.restarts, "retired": run.retired})
        if plan is not None:
            out["end_splits"] = plan.end_splits
        out["effective_limits"] = self.effective_limits
        out.update(self.plugins)
        out["batches"] = self.batches
        out.update(layouts=self.layouts, prefixes=self.prefixes)
        if run is not None:
            out["useful_tokens_per_s"] = run.useful_tokens_per_s
            out["driver_resident_peak_bytes"] = run.driver_resident_peak_bytes
        if plan is not None:
            vt = plan.virtual_time
            out["output_bytes"] = plan.output_bytes
            out["virtual_time"] = None if vt is None else {f.name: getattr(vt, f.name) for f in fields(vt)}
            if plan.simulated_cost_tokens is not None:
                out["simulated_cost_tokens"] = plan.simulated_cost_tokens
            if plan.placements:
                out["placements"] = plan.placements
        return out

    # read-only mapping: report.json's keys (a view built afresh each time: the report may still change)
    def __getitem__(self, key: str) -> Any:
        return self.as_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(self.as_dict())

    def take_plugin_keys(self, view: dict[str, Any], given: dict[str, Any]) -> None:
        """Keep the keys forge_run_end implementations added to `view`, the dict they were handed
        (`given`: a copy of it as handed). The engine's own keys are read-only: a plugin that
        replaced or removed one is said in the warnings, not obeyed."""
        for key, value in view.items():
            if key not in given:
                self.plugins[key] = value
            elif value is not given[key]:
                self.warnings.append(f"a forge_run_end plugin replaced the report's {key!r}: kept the engine's")
        for key in given.keys() - view.keys():
            self.warnings.append(f"a forge_run_end plugin removed the report's {key!r}: kept the engine's")


def effective_limits(scheduled: Mapping[str, Device], declared: list[Device]) -> dict[str, dict[str, int]]:
    """Device -> the limits the run used, where they differ from the declared ones (the
    scheduler lowers a device's limits after it ran out of memory)."""
    was = {d.name: d.limits for d in declared}
    return {name: d.limits.as_dict() for name, d in scheduled.items() if d.limits != was[name]}


_WHERE = {
    "tree rows": "in tree rows (shared by a group's items)",
    "split-prefix batches": "split off (shared by the batch's items)",
    "whole rows": "in whole rows (one per item)",
    "engine": "by the function's engine (once per prefix it did not hold, shared by its items)",
}


def prefix_figures(shapes: list, config: Mapping[str, Any]) -> dict[str, Any] | None:
    """How the completed items' prefixes were had, over every device (`shapes`: each device's
    `forge.core.layouts.BatchShapes`); None when no item had a prefix. `computed`: prefix
    computations, by where they ran; `cache_hits`: split-prefix batches served by the device's
    cache; `repeated`: computations of a prefix its device had computed before (what a cache
    could have saved; None when too many distinct prefixes to track); `words`: all that, as the
    summary says it."""
    items = sum(s.items for s in shapes)
    if not items:
        return None
    known = all(s.keys is not None for s in shapes)
    computed_in = {where: n for where in _WHERE if (n := sum(s.computed.get(where, 0) for s in shapes))}
    figures: dict[str, Any] = {
        "items": items,
        "distinct": len(set().union(*(s.keys for s in shapes))) if known else None,
        "computed": sum(computed_in.values()),
        "computed_in": computed_in,
        "cache_hits": sum(s.cache_hits for s in shapes),
        "repeated": sum(max(0, sum(s.computed.values()) - len(s.keys)) for s in shapes) if known else None,
    }
    cache_on = (config.get("batching") or {}).get("prefix_cache")
    figures["words"] = prefix_words(figures, cache_on)
    return figures


def _times(n: int, one: str, many: str) -> str:
    return f"{n:,} {one if n == 1 else many}"


def prefix_words(p: Mapping[str, Any], cache_on: bool | None = None) -> str:
    """The prefix figures in a user's words: how many distinct prefixes, how often each ran and
    where, and the cache hits, with why there were none."""
    head = f"{p['distinct']:,} distinct in " if p.get("distinct") is not None else "in "
    where = [f"{n:,} {_WHERE.get(k, k)}" for k, n in p["computed_in"].items() if n]
    text = f"{head}{_times(p['items'], 'item', 'items')}; computed {_times(p['computed'], 'time', 'times')}"
    text += f": {', '.join(where)}" if where else ""
    hits, repeated = p["cache_hits"], p.get("repeated")
    if set(p["computed_in"]) == {"engine"}:  # its own cache: the prefix tokens' cache_hit says what it held
        return text
    if hits:
        why = f"{hits:,} (split-prefix {'batch' if hits == 1 else 'batches'} served from the device's cache)"
    elif repeated == 0:
        why = "0 (none needed: no device computed a prefix twice)"
    elif cache_on is False:
        why = "0 (prefix cache off)"
    elif not p["computed_in"].get("split-prefix batches"):
        why = "0 (only split-prefix batches use the cache; none ran)"
    else:
        again = "" if repeated is None else f" ({_times(repeated, 'computation', 'computations')} of a prefix again)"
        why = f"0{again}"
    return f"{text}; cache hits {why}"


def make_report(
    run: RunContext,
    spec,  # the run's `forge.driver.engine.RunSpec` (not imported: the engine imports this module)
    loop: RunLoop,
    scheduler: Scheduler,
    *,
    wall_s: float,
    status: str,
    error: str | None,
    attempts: dict[str, int],
    figures: RunFigures | PlanFigures,
) -> Report:
    """The report of a run (`figures`: RunFigures) or a plan (PlanFigures) that `loop` drove over
    `scheduler`'s work, before plugins add theirs."""
    tallies, predicted_misses = loop.tallies, scheduler.cache_misses
    described = spec.function.describe()
    devices = []
    for d in spec.devices:
        t = tallies[d.name]
        devices.append(
            DeviceReport(
                name=d.name,
                limits=d.limits.as_dict(),
                batches=t.batches,
                tree_batches=t.tree_batches,
                tokens=t.tokens,
                padded_slots=t.padded_slots,
                busy_s=None if run.dry_run else round(t.busy_s, 4),
                cache_misses=t.cache_misses,
                predicted_cache_misses=predicted_misses.get(d.name, 0),
                predicted_peak_bytes=t.peak_bytes or None,
                memory_budget_bytes=t.budget_bytes if t.peak_bytes else None,  # only beside a peak
                layouts=dict(t.shapes.layouts),
            )
        )
    layouts: dict[str, int] = {}
    for d in devices:
        for name, n in (d.layouts or {}).items():
            layouts[name] = layouts.get(name, 0) + n
    return Report(
        function=spec.function.name,
        batching=spec.mode,
        dry_run=run.dry_run,
        model=described.get("model"),
        input=described.get("input"),
        path=described.get("path"),
        config=spec.config,
        devices=devices,
        warnings=spec.function.warnings(),
        wall_s=round(wall_s, 4),
        status=status,
        error=error,
        max_window_items=scheduler.max_window_seen,
        attempts=attempts,
        effective_limits=effective_limits(scheduler.devices, spec.devices),
        batches=sum(t.batches for t in tallies.values()),
        layouts=layouts,
        prefixes=prefix_figures([t.shapes for t in tallies.values()], spec.config),
        run=figures if isinstance(figures, RunFigures) else None,
        plan=figures if isinstance(figures, PlanFigures) else None,
    )


def finish_report(
    report: Report,
    *,
    run: RunContext,
    pm: pluggy.PluginManager,
    write: Callable[[str, bytes], Any] | None = None,
) -> Report:
    """Let plugins add theirs (`forge_run_end`, handed report.json's dict), then write report.json
    through `write(name, data)` (the run's store: fenced, so a run that lost its directory writes
    none there) when the run has a directory."""
    view = report.as_dict()
    given = dict(view)
    pm.hook.forge_run_end(run=run, report=view)
    report.take_plugin_keys(view, given)
    if report.run is not None:
        tokens = report.plugins.get("tokens") or {}  # the ledger's counts: completed holds earlier sessions' too
        done_now = tokens.get("completed", 0) - tokens.get("resumed", 0)
        report.run.useful_tokens_per_s = round(done_now / report.wall_s, 1) if report.wall_s > 0 else None
    if write is not None:
        try:
            write("report.json", json.dumps(report.as_dict(), indent=2, default=str).encode())
        except OSError as exc:  # a full disk, a lost directory: the summary still reaches the terminal
            report.warnings = [*report.warnings, f"report.json could not be written ({exc})"]
    return report
