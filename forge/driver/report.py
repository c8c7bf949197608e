"""The run's report: what the engine measured plus what plugins (the ledger) add."""

from __future__ import annotations

import json
import os
import time
from typing import Any


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


def finish_report(*, run, pm, spec, tallies, predicted_misses, wall_s, extra=None, write=None) -> dict[str, Any]:
    """The report, written as report.json through `write(name, data)` (the run's store: fenced,
    so a run that lost its directory writes none there) when the run has a directory."""
    described = spec.function.describe()
    report: dict[str, Any] = {
        "function": spec.function.name,
        "batching": spec.mode,
        "dry_run": run.dry_run,
        "model": described.get("model"),
        "input": described.get("input"),
        "path": described.get("path"),
        "config": spec.config,
        "devices": [
            {
                "name": d.name,
                "limits": d.limits.as_dict(),
                "batches": tallies[d.name].batches,
                "tree_batches": tallies[d.name].tree_batches,
                "tokens": tallies[d.name].tokens,
                "padded_slots": tallies[d.name].padded_slots,
                "busy_s": round(tallies[d.name].busy_s, 4),
                "cache_misses": tallies[d.name].cache_misses,
                "predicted_cache_misses": predicted_misses.get(d.name, 0),
                **(
                    {
                        "predicted_peak_bytes": tallies[d.name].peak_bytes,
                        "memory_budget_bytes": tallies[d.name].budget_bytes,
                    }
                    if tallies[d.name].peak_bytes
                    else {}
                ),
            }
            for d in spec.devices
        ],
        "warnings": spec.function.warnings(),
        "wall_s": round(wall_s, 4),
    }
    report.update(extra or {})
    pm.hook.forge_run_end(run=run, report=report)
    completed = report.get("tokens", {}).get("completed", 0)
    report["batches"] = sum(t.batches for t in tallies.values())
    report["useful_tokens_per_s"] = round(completed / wall_s, 1) if wall_s > 0 else None
    if write is not None:
        try:
            write("report.json", json.dumps(report, indent=2, default=str).encode())
        except OSError as exc:  # a full disk, a lost directory: the summary still reaches the terminal
            report["warnings"] = [*report["warnings"], f"report.json could not be written ({exc})"]
    return report
