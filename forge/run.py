"""Dataclasses that cross the engine's seams: the run's context and per-batch stats."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forge.geometry import Device


@dataclass
class RunContext:
    """What every hook sees about the run it belongs to."""

    function: str  # function name, e.g. "probe_gen"
    batching: str  # batching mode name
    devices: list[Device]  # consumers, each with its effective limits
    run_dir: Path | str | None  # where outputs go: a local path or an fsspec URL; None for a plan
    config: dict[str, Any] = field(default_factory=dict)  # the resolved config, plain containers
    dry_run: bool = False  # true for `forge plan`: nothing runs, timings are simulated
    expected_items: int | None = None  # records in the input, when known (progress bar total)
    state: dict[str, Any] = field(default_factory=dict)  # per-plugin state, keyed by plugin name
    timings: dict[str, float] = field(default_factory=dict)  # phase figures so far, for the report's "phases"


@dataclass(frozen=True, slots=True)
class BatchStats:
    """What running one batch cost."""

    seconds: float  # wall time on the device (simulated for a plan)
    prefix_computed_tokens: int  # prefix tokens actually run this step (0 on a cache hit)
    cache_hit_tokens: int  # prefix tokens the items needed but did not run
    padded_slots: int  # row slots run plus prefix tokens run


@dataclass(frozen=True, slots=True)
class Rejected:
    """An input record that could not become an item."""

    record_id: str  # the row's id, or "line N"
    reason: str  # one line: what is wrong and how to fix it


def batch_stats(batch, seconds: float, prefix_computed_tokens: int) -> BatchStats:
    """Stats of a batch from what its prefix cost. Rows that hold whole sequences run
    their own prefix, so nothing is served from cache."""
    if batch.split_prefix:
        hit = batch.prefix_tokens - prefix_computed_tokens
    else:
        prefix_computed_tokens, hit = batch.prefix_tokens, 0
    extra = prefix_computed_tokens if batch.split_prefix else 0
    return BatchStats(seconds, prefix_computed_tokens, hit, batch.padded_slots + extra)
