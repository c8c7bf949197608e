"""The engine: one thread per device, each looping schedule -> run -> postprocess.

The scheduler (behind one lock) owns the backlog and decides what each device runs; the
workers only see batches. Accounting happens through hooks, so the ledger sees every
token received, routed, completed and failed.
"""

from __future__ import annotations

import inspect
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pluggy

from forge.admission import admit
from forge.batching.base import create_packer
from forge.errors import ForgeError
from forge.function import Function
from forge.geometry import Batch, Device
from forge.plugins import batching_modes
from forge.run import RunContext, batch_stats
from forge.scheduler import Scheduler


@dataclass
class RunSpec:
    """Everything a run needs, as plain values. Built from config at the edge (forge.config)."""

    function: Function  # the function instance
    mode: str  # batching mode name
    mode_options: dict[str, Any]  # keyword arguments of the mode's packer
    devices: list[Device]  # consumers, limits already capped by the step budget
    window: int = 65536  # most items held waiting for a batch
    cache_tokens: int = 0  # per-device prefix cache capacity; 0 = off
    too_long: str = "skip"  # skip | truncate | error
    max_tokens: int | None = None  # stop admitting once this many tokens were received
    run_dir: Path | None = None  # outputs; None for a plan
    config: dict[str, Any] = field(default_factory=dict)  # resolved config, for the report


@dataclass
class DeviceTally:
    """Per-device figures for the report."""

    batches: int = 0
    tokens: int = 0  # useful tokens completed
    padded_slots: int = 0
    busy_s: float = 0.0
    cache_misses: int = 0  # prefix computed on this device because its cache lacked it

    def add(self, batch: Batch, stats) -> None:
        self.batches += 1
        self.tokens += batch.num_tokens
        self.padded_slots += stats.padded_slots
        self.busy_s += stats.seconds


def prepare(spec: RunSpec, pm: pluggy.PluginManager, dry_run: bool) -> tuple[RunContext, Scheduler]:
    """Start a run: fire run_start, build the packer and the scheduler over admitted items."""
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
    )
    pm.hook.forge_run_start(run=run)
    modes = {name: factory for name, (factory, _) in batching_modes(pm).items()}
    options = dict(spec.mode_options)
    factory = modes.get(spec.mode)
    if factory is not None and "cost_model" in inspect.signature(factory).parameters:
        options["cost_model"] = spec.function.cost_model()
    packer = create_packer(modes, spec.mode, options)
    for device in spec.devices:
        packer.check_device(device)
    splits = getattr(packer, "split_prefix", False)
    # refuse, before any work, a layout the function cannot run exactly
    spec.function.check_mode(splits, getattr(packer, "packing", "rows") == "packed", spec.cache_tokens > 0)
    if splits and not spec.function.causal:
        raise ForgeError(
            f"batching={spec.mode} shares prefixes, but {spec.function.name}'s model is not causal; "
            "set batching.prefix_cache=false and batching.packing=rows"
        )
    items = admit(
        spec.function.records(),
        run=run,
        hook=pm.hook,
        max_seq_len=max(d.limits.max_seq_len for d in spec.devices),
        too_long=spec.too_long,
        max_tokens=spec.max_tokens,
    )
    scheduler = Scheduler(
        packer, items, spec.devices, window=spec.window, cache_tokens=spec.cache_tokens if splits else 0
    )
    return run, scheduler


def execute(spec: RunSpec, pm: pluggy.PluginManager) -> dict[str, Any]:
    """Run the function over its input on every device; return the report (also written)."""
    from forge.report import finish_report

    assert spec.run_dir is not None
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    run, scheduler = prepare(spec, pm, dry_run=False)
    sink = spec.function.open_sink(spec.run_dir)
    tallies = {d.name: DeviceTally() for d in spec.devices}
    cond = threading.Condition()
    in_flight = [0]
    errors: list[BaseException] = []

    scheduler_s = [0.0]  # time spent deciding what runs (admission and tokenizing included)

    def next_batch(device: Device) -> Batch | None:
        with cond:
            while not errors:
                t0 = time.perf_counter()
                batch = scheduler.schedule(device)
                scheduler_s[0] += time.perf_counter() - t0
                if batch is not None:
                    in_flight[0] += 1
                    pm.hook.forge_batch_routed(run=run, batch=batch, device=device)
                    return batch
                if scheduler.done and not in_flight[0]:
                    cond.notify_all()
                    return None
                cond.wait(0.05)
            return None

    def device_loop(device: Device) -> None:
        try:
            worker = spec.function.open_worker(device, scheduler.cache_tokens)
        except BaseException as exc:  # a device that cannot load leaves the others running
            with cond:
                errors.append(exc)
                cond.notify_all()
            return
        try:
            while (batch := next_batch(device)) is not None:
                t0 = time.perf_counter()
                try:
                    output = worker.run(batch)
                except Exception as exc:  # recorded, retried item by item, and the run goes on
                    reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    with cond:
                        retry = len(batch.items) > 1
                        pm.hook.forge_batch_failed(run=run, batch=batch, device=device,
                                                   reason=reason, will_retry=retry)
                        if retry:
                            scheduler.requeue(batch.items)
                        in_flight[0] -= 1
                        cond.notify_all()
                    continue
                stats = batch_stats(batch, time.perf_counter() - t0, output.prefix_computed_tokens)
                with cond:
                    sink.write(batch, output)
                    tally = tallies[device.name]
                    tally.add(batch, stats)
                    if batch.split_prefix and batch.prefix_len and not output.cache_hit:
                        tally.cache_misses += 1
                    pm.hook.forge_batch_completed(run=run, batch=batch, device=device, stats=stats)
                    in_flight[0] -= 1
                    cond.notify_all()
        except BaseException as exc:
            with cond:
                errors.append(exc)
                cond.notify_all()
        finally:
            worker.close()

    threads = [threading.Thread(target=device_loop, args=(d,), name=f"forge-{d.name}", daemon=True)
               for d in spec.devices]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors and (len(errors) == len(spec.devices) or not scheduler.done):
        raise errors[0]
    outputs = sink.close()
    return finish_report(
        run=run,
        pm=pm,
        spec=spec,
        tallies=tallies,
        predicted_misses=scheduler.cache_misses,
        wall_s=time.perf_counter() - started,
        extra={"outputs": outputs, "max_window_items": scheduler.max_window_seen,
               "scheduler_s": round(scheduler_s[0], 4),
               # devices that could not run (the others finished the work)
               "device_errors": [f"{type(e).__name__}: {e}" for e in errors]},
    )
