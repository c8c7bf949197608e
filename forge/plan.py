"""`forge plan`: admit, pack and route the whole input without loading any weights.

Model: the same scheduler a run uses, driven by simulated device clocks. A batch costs its
padded slots plus the device's per-step overhead plus the prefix tokens it must compute;
the device whose clock is lowest asks for the next batch, as the first idle device would.
The figures are those a run reports, with time in token-equivalents.
"""

from __future__ import annotations

from typing import Any

import pluggy

from forge.engine import DeviceTally, RunSpec, prepare
from forge.geometry import Batch
from forge.report import finish_report
from forge.run import batch_stats


def plan(spec: RunSpec, pm: pluggy.PluginManager, keep_batches: bool = False) -> dict[str, Any]:
    """The run's geometry: batches, padding, predicted cache hits, per device."""
    import time

    started = time.perf_counter()
    run, scheduler = prepare(spec, pm, dry_run=True)
    packer = scheduler.packer
    clocks = {d.name: 0.0 for d in spec.devices}
    tallies = {d.name: DeviceTally() for d in spec.devices}
    active = list(spec.devices)
    kept: list[tuple[str, Batch]] = []
    while active:
        device = min(active, key=lambda d: clocks[d.name])
        batch = scheduler.schedule(device)
        if batch is None:
            active.remove(device)  # nothing that fits it remains
            continue
        pm.hook.forge_batch_routed(run=run, batch=batch, device=device)
        computed = batch.prefix_len if (batch.split_prefix and not batch.cache_hit) else 0
        cost = batch.padded_slots + computed + packer.overhead_tokens(device)
        clocks[device.name] += cost
        stats = batch_stats(batch, float(cost), computed)
        tallies[device.name].add(batch, stats)
        if batch.cache_hit is False:
            tallies[device.name].cache_misses += 1
        pm.hook.forge_batch_completed(run=run, batch=batch, device=device, stats=stats)
        if keep_batches:
            kept.append((device.name, batch))
    report = finish_report(
        run=run,
        pm=pm,
        spec=spec,
        tallies=tallies,
        predicted_misses=scheduler.cache_misses,
        wall_s=time.perf_counter() - started,
        extra={"max_window_items": scheduler.max_window_seen,
               "simulated_cost_tokens": {k: int(v) for k, v in clocks.items()}},
    )
    report.pop("useful_tokens_per_s", None)
    for d in report["devices"]:
        d.pop("busy_s", None)  # simulated: see simulated_cost_tokens
    if keep_batches:
        report["_batches"] = kept
    return report
