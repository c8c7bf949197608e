"""A batch whose items stay columns: `ColumnBatch`, its items as `ItemColumns` and its rows
made on demand (`LazyRows`). `forge.core.columns.ColumnFeed` cuts them, so the loop, the
ledger and the simulator account tens of millions of streamed items with no Python object
per item.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from forge.vocab.geometry import NO_PREFIX, Batch, Item


class ItemColumns(Sequence):
    """Items as columns: a read-only sequence of `Item`s made one at a time on access.

    Counting them (`len`, `total_tokens`) costs nothing per item, so accounting a batch of
    streamed geometry needs no Python object per item; code that iterates (a failure, a
    stop) gets real Items, ids being input positions as text.
    """

    __slots__ = ("index", "num_tokens", "prefix", "_keys", "_prefix_lens")
    # `index` is the column of input positions; it hides Sequence.index (look items up by id instead)
    index: np.ndarray  # type: ignore[assignment]

    def __init__(
        self,
        index: np.ndarray,
        num_tokens: np.ndarray,
        prefix: np.ndarray,
        keys: Sequence[str],
        prefix_lens: np.ndarray,
    ):
        self.index = index  # input position of each item (int64)
        self.num_tokens = num_tokens  # whole sequence, prefix included (int64)
        self.prefix = prefix  # prefix code per item, NO_PREFIX for none (int64)
        self._keys = keys  # code -> prefix key
        self._prefix_lens = prefix_lens  # code -> prefix length, plus a trailing 0 read by NO_PREFIX

    def __len__(self) -> int:
        return len(self.index)

    @property
    def total_tokens(self) -> int:
        return int(self.num_tokens.sum())

    @property
    def prefix_tokens(self) -> int:
        return int(self._prefix_lens[self.prefix].sum())

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        code = int(self.prefix[i])
        index = int(self.index[i])
        return Item(
            str(index),
            int(self.num_tokens[i]),
            None if code == NO_PREFIX else self._keys[code],
            int(self._prefix_lens[code]),
            None,
            None,
            index,
        )

    def __iter__(self):
        return (self[i] for i in range(len(self)))


class LazyRows(Sequence):
    """A column batch's rows as lists of Items, made only when something reads them."""

    __slots__ = ("columns", "row_ends")

    def __init__(self, columns: ItemColumns, row_ends: list[int] | None):
        self.columns, self.row_ends = columns, row_ends

    def __len__(self) -> int:
        return len(self.columns) if self.row_ends is None else len(self.row_ends)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if self.row_ends is None:
            return [self.columns[i]]
        i = range(len(self))[i]
        return self.columns[(self.row_ends[i - 1] if i else 0) : self.row_ends[i]]


@dataclass(frozen=True, slots=True)
class ColumnBatch(Batch):
    """A `Batch` whose items stay columns (`ColumnFeed`): counts are numpy sums taken once,
    rows and Items are made only if read (a retry, a failure). Splitting or selecting gives
    a plain Batch of Items; given other rows (`dataclasses.replace(batch, rows=...)`), it
    drops its columns and counts its rows as a plain Batch does."""

    columns: ItemColumns | None = None  # the items, in row order; None: `rows` holds Items
    totals: tuple[int, int, int] = (0, 0, 0)  # (num_tokens, row_tokens, prefix_tokens) of `columns`

    def __post_init__(self) -> None:
        if not (isinstance(self.rows, LazyRows) and self.rows.columns is self.columns):
            # rows were replaced: they, not the columns, say what the batch holds
            object.__setattr__(self, "columns", None)

    @property
    def items(self):
        return self.columns if self.columns is not None else Batch.__dict__["items"].fget(self)

    @property
    def num_tokens(self) -> int:
        return self.totals[0] if self.columns is not None else Batch.__dict__["num_tokens"].fget(self)

    @property
    def row_tokens(self) -> int:
        return self.totals[1] if self.columns is not None else Batch.__dict__["row_tokens"].fget(self)

    @property
    def prefix_tokens(self) -> int:
        return self.totals[2] if self.columns is not None else Batch.__dict__["prefix_tokens"].fget(self)

    def as_items(self) -> Batch:
        return Batch(
            rows=list(self.rows),
            padded_len=self.padded_len,
            prefix_key=self.prefix_key,
            prefix_len=self.prefix_len,
            split_prefix=self.split_prefix,
            packed=self.packed,
            tree=self.tree,
            seq=self.seq,
            retry=self.retry,
            cache_hit=self.cache_hit,
        )

    def select(self, keep) -> Batch:
        return self.as_items().select(keep)

    def halves(self) -> list[Batch]:
        return self.as_items().halves()
