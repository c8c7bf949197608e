"""Which layouts a device's completed batches ran in, and how their items' prefixes were had:
the report's `layouts` and `prefixes` (`forge.driver.report`).

Model: each completed batch is one layout (`layout`): `rows` (a whole sequence per row),
`packed rows` (several whole sequences end to end), their `split-prefix` forms (the batch's
one shared prefix run once for all its items) and `cache-hit` forms (that prefix taken from the
device's prefix cache, none run), or `tree rows` (packed prefix groups: each group's prefix once
in its row, then its items' suffixes). A prefix is computed once per split-prefix batch that
missed the cache, once per prefix group in a tree row, and once per item in whole rows, unless
the function's engine shares prefixes itself (generate's decoder: `BatchStats.prefix_runs`, once
per prefix it did not hold).
Counting a streamed batch (`ColumnBatch`) takes numpy sums, never an Item per item.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from forge.vocab.column_batch import ColumnBatch, LazyRows
from forge.vocab.geometry import NO_PREFIX, Batch
from forge.vocab.records import BatchStats

MAX_DISTINCT = 100_000  # distinct prefixes tracked per device; beyond, their count is unknown (None)


def layout(batch: Batch, stats: BatchStats) -> str:
    """The batch's layout, in the words the report uses."""
    if batch.tree:
        return "tree rows"
    rows = "packed rows" if batch.packed else "rows"
    if batch.split_prefix and batch.prefix_len:
        return f"{'cache-hit' if stats.prefix_computed_tokens == 0 else 'split-prefix'} {rows}"
    return rows


@dataclass
class BatchShapes:
    """One device's completed batches per layout, and its prefix computations."""

    layouts: Counter = field(default_factory=Counter)  # layout -> completed batches
    items: int = 0  # completed items that have a prefix
    computed: Counter = field(default_factory=Counter)  # prefix computations by where: tree rows, split-prefix
    # batches, whole rows (see the module's docstring)
    cache_hits: int = 0  # split-prefix batches whose prefix came from the device's cache
    keys: set | None = field(default_factory=set)  # distinct prefix keys; None once over MAX_DISTINCT

    def add(self, batch: Batch, stats: BatchStats, whole: bool = True) -> None:
        """`whole` False: a part of a batch (its items; the batch's layout is counted with its last part)."""
        if whole:
            self.layouts[layout(batch, stats)] += 1
        if batch.split_prefix and batch.prefix_len:
            hit = stats.prefix_computed_tokens == 0
            self.items += len(batch.items)
            self.cache_hits += hit and whole
            self.computed["split-prefix batches"] += not hit and whole
            self._see([batch.prefix_key])
            return
        items, computed, keys = _prefix_runs(batch)
        self.items += items
        if stats.prefix_runs is not None:  # whole sequences to an engine that shares their prefixes itself
            self.computed["engine"] += stats.prefix_runs
        else:
            self.computed["tree rows" if batch.tree else "whole rows"] += computed
        self._see(keys)

    def _see(self, keys) -> None:
        if self.keys is not None:
            self.keys.update(keys)
            if len(self.keys) > MAX_DISTINCT:
                self.keys = None


def _prefix_runs(batch: Batch) -> tuple[int, int, list]:
    """(items with a prefix, prefix computations, their distinct keys) of a batch whose rows hold
    whole sequences or tree rows."""
    columns = batch.columns if isinstance(batch, ColumnBatch) else None
    if columns is not None and isinstance(batch.rows, LazyRows):
        codes = np.asarray(columns.prefix)
        has = (codes != NO_PREFIX) & (columns._prefix_lens[codes] > 0)
        if not batch.tree:  # each item runs its own prefix
            computed = int(has.sum())
        else:  # a run of items sharing a key within a row: its prefix once
            ends = batch.rows.row_ends
            first = np.zeros(len(codes), bool)
            first[np.arange(len(codes)) if ends is None else [0, *ends[:-1]]] = True  # row starts
            first[1:] |= codes[1:] != codes[:-1]
            computed = int((first & has).sum())
        _, where = np.unique(codes[has], return_index=True)
        index = np.flatnonzero(has)[where]
        return int(has.sum()), computed, [columns[int(i)].prefix_key for i in index]
    items = computed = 0
    keys = set()
    for row in batch.rows:
        last = None
        for it in row:
            key = it.prefix_key if it.prefix_len else None
            if key is None:
                last = None
                continue
            items += 1
            computed += not batch.tree or key != last
            keys.add(key)
            last = key
    return items, computed, list(keys)


@dataclass
class DeviceTally:
    """Per-device figures for the report."""

    batches: int = 0
    tree_batches: int = 0  # of them, batches of merged prefix groups (Batch.tree)
    tokens: int = 0  # useful tokens completed
    padded_slots: int = 0
    busy_s: float = 0.0
    cache_misses: int = 0  # prefix computed on this device because its cache lacked it
    peak_bytes: int = 0  # batching=memory: largest predicted peak of a batch routed here
    budget_bytes: int | None = None  # batching=memory: the budget it was planned against
    shapes: BatchShapes = field(default_factory=BatchShapes)  # batches per layout, prefix computations

    def add(self, batch: Batch, stats: BatchStats, *, whole: bool = True) -> None:
        """A completed batch's figures; `whole` False: a part of one (its items only, not a batch more)."""
        self.shapes.add(batch, stats, whole)
        self.batches += whole
        self.tree_batches += batch.tree
        self.tokens += batch.num_tokens
        self.padded_slots += stats.padded_slots
        self.busy_s += stats.seconds
