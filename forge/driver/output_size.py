"""What a run will write, before it runs: `forge plan` states it; `forge run` checks the disk.

Model: a function's result fields declare their dtype and per-value shape (`forge.io.results.Field`);
a ragged field holds one value per own token of an item (its tokens after its prefix). So the
bytes a run writes follow from two counts, committed items and their own tokens:
`Function.output_bytes(items, own_tokens)`, per field (per layer, for probe_gen), plus the total
and the bytes per stored token. `forge plan` counts both exactly (every item is tokenized and
routed); `forge run` estimates them before any work from the first `SAMPLE_ROWS` input rows,
scaled to the rows left, and refuses a local output directory whose disk has less room than
that (`check_disk=false` skips the check). An object store is not checked.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from forge.errors import ForgeError
from forge.function import Function

SAMPLE_ROWS = 512  # input rows tokenized before a run to estimate what it writes
MARGIN = 1.05  # room asked beyond the estimate (shard headers, offsets, the journal)


def describe(function: Function, items: int, own_tokens: int) -> dict[str, Any] | None:
    """The report's `output_bytes`: per field, in total, per item and per stored token (None: unknown)."""
    fields = function.output_bytes(items, own_tokens)
    if fields is None:
        return None
    total = sum(v for v in fields.values() if v is not None)
    per_token = any((function.output_bytes(0, 1) or {}).values())  # a field holds values per token
    return {
        "fields": fields,
        "total": total,
        "items": items,
        "stored_tokens": own_tokens if per_token else 0,
        "per_item": round(total / items, 3) if items else None,
        "per_stored_token": round(total / own_tokens, 3) if own_tokens and per_token else None,
        "unknown": sorted(name for name, v in fields.items() if v is None),
    }


def check_space(
    function: Function, run_dir: Path, rows_left: int | None, max_seq_len: int | None = None, too_long: str = "skip"
) -> dict[str, Any] | None:
    """Refuse, in one line, a local run directory without room for what the run will write (a
    row that will be skipped as too long counts nothing)."""
    if rows_left is None or rows_left <= 0:
        return None
    sample = function.sample_output(SAMPLE_ROWS, max_seq_len, too_long)
    if sample is None or not sample[2]:
        return None
    scale = rows_left / sample[2]
    items, own, sampled = int(sample[0] * scale + 0.5), int(sample[1] * scale + 0.5), sample[2]
    sized = describe(function, items, own)
    if sized is None or not sized["total"]:
        return None
    need = int(sized["total"] * MARGIN)
    free = shutil.disk_usage(run_dir).free
    if need > free:
        per = (
            f"{_size(sized['per_stored_token'])} per stored token"
            if sized["per_stored_token"]
            else f"{_size(sized['per_item'] or 0)} per item"
        )
        raise ForgeError(
            f"output_dir={run_dir}: the run will write about {_size(sized['total'])} ({per}, estimated "
            f"from {sampled:,} of {rows_left:,} rows) but its disk has {_size(free)} free; free space, "
            "choose another output_dir, or set check_disk=false to skip this check"
        )
    return sized


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return f"{n} B"
