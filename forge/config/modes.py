"""The `batching` group's schemas: the keys every mode has (`Batching`) and each built-in mode's own.

Each mode's dataclass is the one home of its defaults: its packer takes an instance of it
(`Packer.config_schema`, `forge.batching.base.create_packer`), `forge.config.schema.validate`
checks the `batching` node against the schema of the mode it names, and conf/batching/<mode>.yaml
extends it (`- /schema_batching/<mode>@_here_`) and restates nothing. A plugin's mode declares its
own the same way: a dataclass extending `Batching` (or a built-in mode's), named by its packer's
`config_schema`.

A field's comment (the lines right above it and the one after it) is its documentation:
`forge.config.docs` writes docs/configuration.md from them.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from forge.config.checks import non_negative, one_of, positive
from forge.vocab.geometry import DEFAULT_WINDOW


@dataclass
class Batching:
    """Keys every batching mode has. A mode's own options are fields of its schema, a subclass."""

    mode: str = MISSING  # the mode's name: a registered batching mode (`forge ls` lists them)
    window: int = positive(DEFAULT_WINDOW)  # most items held waiting for a batch


@dataclass
class ItemBatching(Batching):
    """`item`: a fixed number of items per batch (the baseline), each row padded to the longest."""

    mode: str = "item"
    batch_size: int = positive(32)  # items per batch (fewer where the next item would break a device limit)
    order: str = one_of("arrival", "arrival", "length")  # arrival | length (longest first, as lm-evaluation-harness)
    # per-step cost in token slots, for devices that declare none: `forge plan`'s virtual time
    # (item batches are cut by count, not weighed against padding)
    batch_overhead_tokens: int = non_negative(0)


@dataclass
class TokenBatching(Batching):
    """`token`: rows grouped by prefix and similar length; the prefix runs once per batch or from cache."""

    mode: str = "token"
    packing: str = one_of("rows", "rows", "packed")  # rows: one sequence per row | packed: several end to end per row
    prefix_cache: bool = True  # keep each prefix's KV on the device (LRU) and run only the suffixes
    cache_tokens: int = positive(32768)  # per-device prefix cache capacity, in prefix tokens
    # per-step cost in token slots, weighed against padding (a device's own batch_overhead_tokens wins)
    batch_overhead_tokens: int = non_negative(256)
    # packed: row length cap (null: max_seq_len - prefix); merged groups: the row units share and the longest
    # unit that merges (null: rows of 512 shared, units up to 1,024 alone in a row)
    packed_row_tokens: int | None = positive(None)
    merge_groups: bool = True  # small prefix groups share batches (each prefix once in a row) where that costs less


@dataclass
class MemoryBatching(TokenBatching):
    """`memory`: token-mode grouping, batch size bounded by each device's memory budget (the
    function's cost model)."""

    mode: str = "memory"
    # budget for devices whose entry has no memory_gb (auto-discovered ones have one)
    default_memory_gb: float | None = positive(None)
