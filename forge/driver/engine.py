"""The engine: turns a RunSpec into a run (or a plan) on the run loop.

`prepare` builds what every run needs (packer, scheduler over admitted items); `execute`
adds the run directory (`forge.io.store`), the function's sink and an executor, and drives
`forge.core.loop.RunLoop` until the work is done or the run stops early. The loop, the
scheduler and the hooks do the rest; accounting happens through hooks, so the ledger sees
every token received, routed, completed, retried, discarded and failed.
"""

from __future__ import annotations

import inspect
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pluggy

from forge.batching.base import Packer, create_packer
from forge.config.schema import CoreConfig, Runtime
from forge.core.admission import AdmissionRules, admit
from forge.core.loop import Committer, RunLoop, Stop
from forge.core.scheduler import Scheduler
from forge.driver.output_size import check_space
from forge.driver.phases import phases
from forge.driver.report import Report, RunFigures, finish_report, make_report
from forge.driver.seek import start_reading
from forge.errors import ForgeError
from forge.executors import Executor
from forge.function import Function
from forge.io.location import local_path
from forge.io.store import RunStore
from forge.pluginmanager import batching_modes, executors, load_object, trackers
from forge.vocab.geometry import DEFAULT_WINDOW, Device, Item
from forge.vocab.procs import resident_peak_bytes
from forge.vocab.records import RunContext


@dataclass
class RunSpec:
    """Everything a run needs, as plain values. Built from config at the edge (forge.cli.build)."""

    function: Function  # the function instance
    mode: str  # batching mode name
    mode_options: dict[str, Any]  # the mode's keys (its packer's config_schema), plain: create_packer types them
    devices: list[Device]  # consumers, limits already capped by the step budget
    window: int = DEFAULT_WINDOW  # most items held waiting for a batch
    cache_tokens: int = 0  # per-device prefix cache capacity; 0 = off
    too_long: str = CoreConfig.too_long  # skip | truncate | error (the schema's default)
    max_tokens: int | None = None  # stop admitting once this many tokens were received
    run_dir: Path | str | None = None  # outputs: a local path or an fsspec URL (s3://...); None for a plan
    config: dict[str, Any] = field(default_factory=dict)  # resolved config, for the report
    runtime: Runtime = field(default_factory=Runtime)  # executor, timeouts, restarts (forge.config.schema's defaults)
    resume: bool = False  # finish the run in run_dir, skipping what it committed
    fail_fast: bool = False  # the first bad record stops the run
    check_disk: bool = True  # refuse a local run directory without room for what the run will write
    plugins: tuple[str, ...] = ()  # extra plugin modules, registered in workers too
    files: dict[str, bytes] = field(default_factory=dict)  # written into the run directory where absent (.hydra/)
    started_at: float | None = None  # time.time() the command started (the CLI's process start); None: execute's
    composed_at: float | None = None  # time.time() the CLI had the composed config (before build_spec); None: unknown
    warm_start: bool = False  # a `forge server` ran the command: its imports were paid before it started
    placements: dict[str, Any] = field(
        default_factory=dict
    )  # device group -> its `forge.runtime.placement.device_map.Placement`


def build_packer(spec: RunSpec, pm: pluggy.PluginManager) -> Packer:
    modes = {name: factory for name, (factory, _) in batching_modes(pm).items()}
    options = dict(spec.mode_options)
    factory = modes.get(spec.mode)
    if factory is not None and "cost_model" in inspect.signature(factory).parameters:
        options["cost_model"] = spec.function.cost_model()
    packer = create_packer(modes, spec.mode, options)
    for device in spec.devices:
        packer.check_device(device)
    return packer


def placeable(packer: Packer, devices: list[Device], mode: str):
    """Admission's check: why each item can never run (None where some device takes it)."""

    def reasons(items: list[Item]) -> list[str | None]:
        n = np.fromiter((it.num_tokens for it in items), np.int64, len(items))
        p = np.fromiter((it.prefix_len for it in items), np.int64, len(items))
        ok = np.zeros(len(items), bool)
        for device in devices:
            ok |= packer.fits(n, p, device)
        return [
            None
            if good
            else (
                f"item {it.id!r} ({it.num_tokens} tokens, {it.prefix_len} of them prefix) fits no device under "
                f"batching={mode}: a batch of it alone breaks every device's limits or memory budget; raise a "
                "device's memory_gb or limits, or set too_long=truncate"
            )
            for it, good in zip(items, ok.tolist())
        ]

    return reasons


def prepare(
    spec: RunSpec, pm: pluggy.PluginManager, dry_run: bool, committed: set[int] | frozenset = frozenset(), fp=None
) -> tuple[RunContext, Scheduler]:
    """Start a run: fire run_start, build the packer and the scheduler over admitted items (`fp`:
    the run's fingerprint, whose read marks a resume starts reading at, forge.driver.seek)."""
    if not spec.devices:
        raise ForgeError("no devices: set devices=auto or list devices in a devices config")
    run = RunContext(
        function=spec.function.name,
        batching=spec.mode,
        devices=spec.devices,
        run_dir=spec.run_dir,
        config=spec.config,
        dry_run=dry_run,
        expected_items=None if dry_run else spec.function.expected_items(),
        trackers={} if dry_run else selected_trackers(spec.config, pm),
    )
    packer = build_packer(spec, pm)
    if not spec.function.prefix_groups and getattr(packer, "packing", "rows") == "rows":
        packer.split_prefix = packer.merge_groups = False  # whole sequences, prefixes mixed
    splits = packer.split_prefix
    packed = packer.packing == "packed"
    # refuse, before any work, a layout the function cannot run exactly
    if packer.merge_groups:
        # merged prefix groups run as tree rows (packed): only for a function whose workers run
        # them, and a model whose packed rows are exact; otherwise groups stay apart
        try:
            spec.function.check_mode(True, True, spec.cache_tokens > 0)
            packer.merge_groups = spec.function.tree_rows and spec.function.causal
        except ForgeError:
            packer.merge_groups = False
    spec.function.check_mode(splits, packed, spec.cache_tokens > 0)
    # a non-causal function may pack whole sequences without a cache (its check_mode accepted them:
    # embed's encoders, whose items have no prefix); sharing a prefix's KV stays refused
    if splits and not spec.function.causal and (spec.cache_tokens > 0 or not packed):
        raise ForgeError(
            f"batching={spec.mode} shares prefixes, but {spec.function.name}'s model is not causal; "
            "set batching.prefix_cache=false and batching.packing=rows"
        )
    pm.hook.forge_run_start(run=run)
    rules = AdmissionRules(
        max_seq_len=max(d.limits.max_seq_len for d in spec.devices),
        too_long=spec.too_long,
        max_tokens=spec.max_tokens,
        fail_fast=spec.fail_fast,
        placeable=placeable(packer, spec.devices, spec.mode),
    )
    # read ahead: reading and tokenizing the input overlap the worker's start and the batches in flight
    seek = start_reading(spec.function, spec.run_dir if fp is not None else None, fp, committed)
    records, ahead = spec.function.records(), spec.runtime.read_ahead
    items = admit(records, run=run, hook=pm.hook, rules=rules, committed=committed, read_ahead=ahead, seek=seek)
    scheduler = Scheduler(
        packer,
        items,
        spec.devices,
        window=spec.window,
        cache_tokens=spec.cache_tokens if splits else 0,
        max_attempts=spec.runtime.max_attempts,
    )
    return run, scheduler


def selected_trackers(config: dict[str, Any], pm: pluggy.PluginManager) -> dict[str, tuple[Any, str]]:
    """The trackers `trackers=[...]` selects (the keys of the `trackers` node), from the ones
    plugins register (forge_trackers); a name none registers is refused, listing those that are."""
    chosen = list(config.get("trackers") or {})
    if not chosen:
        return {}
    offered = trackers(pm)
    unknown = [name for name in chosen if name not in offered]
    if unknown:
        raise ForgeError(
            f"trackers: {unknown[0]!r} is not a registered tracker; choose among: {', '.join(sorted(offered))} "
            "(plugins add more through forge_trackers)"
        )
    return {name: offered[name] for name in chosen}


def make_executor(spec: RunSpec, cache_tokens: int, pm: pluggy.PluginManager) -> Executor:
    """The executor `runtime.executor` names, from the ones plugins register (forge_executors). Its
    workers' prefix caches hold `cache_tokens` (the scheduler's), but a function that lays out its own
    batches (prefix_groups false: generate's decoder) keeps its prefixes itself, within the run's
    batching.cache_tokens."""
    offered = executors(pm)
    name = spec.runtime.executor
    if name not in offered:
        raise ForgeError(
            f"runtime.executor={name!r}; choose one of: {', '.join(sorted(offered))} "
            "(plugins add more through forge_executors)"
        )
    ref, plugin = offered[name]
    factory = load_object(ref, f"executor {name} (plugin {plugin})")
    if not spec.function.prefix_groups:
        cache_tokens = spec.cache_tokens
    return factory(spec.function, cache_tokens, spec.runtime, plugins=spec.plugins, hook=pm.hook)


#: executors whose workers run on this machine: their devices must be here (Ray's are the cluster's)
LOCAL_EXECUTORS = ("inprocess", "process")
#: a run's report counts every kind of failed attempt, none too
ATTEMPTS = dict.fromkeys(("failed", "oom", "timeout", "lost", "late_results", "discarded"), 0)


def execute(spec: RunSpec, pm: pluggy.PluginManager) -> Report:
    """Run the function over its input on every device; return the report (also written).

    The report's `status` says how the run ended: finished, interrupted (Ctrl-C), stopped
    (a recurring failure, a write error, every device retired) or stalled; `error` says why.
    Every status but finished leaves a run that `resume=true` finishes.
    """
    assert spec.run_dir is not None
    simulated = [d.name for d in spec.devices if d.sim is not None]
    if simulated:
        raise ForgeError(
            f"devices: {', '.join(simulated)} simulated (sim:); `forge run` needs real devices: "
            "plan on simulated ones with `forge plan` and the same overrides"
        )
    if spec.runtime.executor in LOCAL_EXECUTORS:  # before the run directory is made or a model loads
        from forge.runtime.placement.device_check import check_present

        check_present(spec.devices)
    started = time.perf_counter()
    began = time.time()
    store = RunStore(
        spec.run_dir,
        spec.function.fingerprint(),
        resume=spec.resume,
        fault=lambda point: pm.hook.forge_fault(point=point, device=None, batch=None),
    )
    scheduler = None
    try:
        if spec.check_disk and local_path(spec.run_dir) is not None:
            expected = spec.function.expected_items()
            check_space(
                spec.function,
                local_path(spec.run_dir),
                None if expected is None else expected - len(store.committed),
                max(d.limits.max_seq_len for d in spec.devices),
                spec.too_long,
            )
        run, scheduler = prepare(spec, pm, dry_run=False, committed=store.committed, fp=store.fingerprint)
        sink = spec.function.open_sink(store)
        store.add_missing(spec.files)
    except BaseException as exc:  # a refusal, a write that failed, or Ctrl-C / SIGTERM during start-up
        if scheduler is not None:
            scheduler.close()
        store.abandon()
        if isinstance(exc, OSError):  # a full disk, a lost directory: one line, the run left as it was
            raise ForgeError(
                f"output_dir={spec.run_dir}: writing the run's files failed at start-up ({exc}); nothing was "
                "committed: fix the cause and run the same command again"
            ) from None
        raise
    status = "interrupted"  # what run.json says if anything below escapes
    try:
        committer = Committer(sink, set(store.committed), spec.runtime.commit_interval_s)
        executor = make_executor(spec, scheduler.cache_tokens, pm)
        loop = RunLoop(scheduler, executor, committer, run=run, hook=pm.hook, policy=spec.runtime)
        run.timings["loop_at"] = time.time()
        status, error = _drive(loop, executor, list(scheduler.devices.values()))
        outputs, status, error = _close_sink(sink, status, error)
        report = make_report(
            run,
            spec,
            loop,
            scheduler,
            wall_s=time.perf_counter() - started,
            status=status,
            error=error,
            attempts={**ATTEMPTS, **dict(loop.counts), "oom_splits": scheduler.oom_splits},
            figures=_run_figures(outputs, run, executor, spec, loop, began),
        )
        for d in report.devices:
            d.resident_peak_bytes = executor.resident_peak_bytes.get(d.name)
            d.resident_ready_bytes = executor.resident_ready_bytes.get(d.name)
        return finish_report(report, run=run, pm=pm, write=store.write_file)
    finally:
        scheduler.close()
        store.close(status)  # after the report: the directory stays ours until it is written


INTERRUPTED_TWICE = (
    "interrupted twice: stopped at once without waiting for batches in flight; "
    "committed work stays, resume=true finishes the run"
)


def _run_figures(outputs: dict, run: RunContext, executor: Executor, spec: RunSpec, loop: RunLoop, began: float):
    """What only a run reports, once its loop has ended."""
    return RunFigures(
        outputs=outputs,
        phases=phases(run.timings, executor, spec, began),
        scheduler_s=round(loop.scheduler_s, 4),
        restarts=dict(executor.restarts),
        retired=dict(executor.retired),
        executor=executor.info(),
        driver_resident_peak_bytes=resident_peak_bytes(),
    )


def _close_sink(sink: Any, status: str, error: str | None) -> tuple[dict, str, str | None]:
    """The sink's figures once it flushed its last shard and folded the dataset result; a write
    or a dataset result that fails stops the run with the reason (what was committed stays)."""
    try:
        return sink.close(), status, error
    except OSError as exc:
        return {}, "stopped", f"writing the last shard failed ({exc}); resume=true finishes the run"
    except ForgeError as exc:  # the dataset result: an aggregate's finish, or shards that disagree
        return {}, "stopped", f"{exc}; the items' shards stay committed"


def _drive(loop: RunLoop, executor: Executor, devices: list[Device]) -> tuple[str, str | None]:
    """Run the loop to its end: (status, error). A second Ctrl-C stops the workers at once and
    winds the loop down where it stands, so even then there is a report."""
    try:
        try:
            with _stop_on_signals(loop):
                executor.start(devices)
                loop.run_until_done()
            return "finished", None
        except Stop as stop:
            return stop.status, str(stop)
        except KeyboardInterrupt:
            executor.close(grace_s=0.0)
            loop.wind_down(INTERRUPTED_TWICE)
            return "interrupted", INTERRUPTED_TWICE
    finally:
        executor.close()


@contextmanager
def _stop_on_signals(loop: RunLoop):
    """Ctrl-C (or SIGTERM) asks the loop to stop gracefully; a second one stops at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if loop.halt is not None and loop.halt[0] == "interrupted":
            raise KeyboardInterrupt
        loop.halt = (
            "interrupted",
            f"interrupted by {signal.Signals(signum).name}; committed work stays, resume=true finishes the run",
        )

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
