"""Feeds: where the scheduler's window gets its items, as the columns the packer reads.

A feed hands out the next items' geometry as a `Chunk` (lengths and prefix codes as numpy
columns, plus ids that name each item while it waits) and owns the prefix table (code <->
key, code -> length).

* `ItemFeed` reads `Item`s (a run's input) and files them into slots until a cut names
  them in `take`. Each step is a few C-level passes, with no Python loop per item. It
  checks that one prefix key means one length.
* `GeometryFeed` reads bare columns (lengths and prefix codes, no Items): for planning and
  benchmarking the packer at the scale of millions of items.
* `ColumnFeed` streams column chunks through the whole run loop: its batches
  (`ColumnBatch`) keep their items as columns (`ItemColumns`), so the loop, the ledger and
  the simulator account tens of millions of items with no Python object per item.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import islice
from operator import attrgetter

import numpy as np

from forge.batching.base import Chunk, Cut, Feed  # noqa: F401 (Feed: re-exported, the protocol these implement)
from forge.errors import ForgeError
from forge.vocab.column_batch import ColumnBatch, ItemColumns, LazyRows
from forge.vocab.geometry import NO_PREFIX, Batch, Item

_num_tokens, _prefix_key, _prefix_len = attrgetter("num_tokens"), attrgetter("prefix_key"), attrgetter("prefix_len")


class ItemFeed:
    def __init__(self, items: Iterable[Item], capacity: int = 1024):
        self._items = iter(items)
        self._codes: dict[str | None, int] = {None: NO_PREFIX}  # prefix key -> code
        self.keys: list[str] = []  # code -> prefix key
        self.prefix_lens: list[int] = []  # code -> prefix length
        self._table = np.zeros(1, np.int64)  # prefix_lens + [0]: index -1 (NO_PREFIX) reads the 0
        self._slots = np.empty(max(1, capacity), dtype=object)  # id -> waiting Item
        self._free = np.arange(len(self._slots) - 1, -1, -1, dtype=np.int64)  # free ids, a stack: [:_top]
        self._top = len(self._slots)

    def __len__(self) -> int:
        """Items held."""
        return len(self._slots) - self._top

    def key(self, code: int) -> str | None:
        return None if code == NO_PREFIX else self.keys[code]

    def prefix_len(self, code: int) -> int:
        return 0 if code == NO_PREFIX else self.prefix_lens[code]

    def code(self, key: str | None) -> int:
        return self._codes[key]

    def waiting(self) -> list[Item]:
        """Every Item held (admitted and not yet taken by a cut), and those the source
        received but has not handed over yet (`pending`, as `forge.core.admission.Admission` has)."""
        held = [it for it in self._slots.tolist() if it is not None]
        return held + list(getattr(self._items, "pending", ()))

    def close(self) -> None:
        """Close the source when it can be closed (an `Admission` reading ahead, a generator)."""
        close = getattr(self._items, "close", None)
        if close is not None:
            close()

    def admit(self, n: int) -> Chunk:
        """Up to `n` more items (fewer only when the input ends), stored under free ids."""
        items = list(islice(self._items, n))
        n = len(items)
        keys = list(map(_prefix_key, items))
        codes = self._codes
        new = [k for k in dict.fromkeys(keys) if k not in codes]  # first seen first: codes (and the packer's
        for key in new:  # order among equal keys) never depend on the string hash's seed
            codes[key] = len(self.keys)
            self.keys.append(key)
            self.prefix_lens.append(-1)  # set from its first item below
        prefix = np.fromiter(map(codes.__getitem__, keys), np.int64, n)
        given = np.fromiter(map(_prefix_len, items), np.int64, n)
        num_tokens = np.fromiter(map(_num_tokens, items), np.int64, n)
        if new:
            uniq, first = np.unique(prefix, return_index=True)
            for code, i in zip(uniq.tolist(), first.tolist()):
                if code != NO_PREFIX and self.prefix_lens[code] < 0:
                    self.prefix_lens[code] = int(given[i])
            self._table = np.array(self.prefix_lens + [0], np.int64)
        prefix_len = self._table[prefix]
        bad = np.flatnonzero((prefix_len != given) & (prefix != NO_PREFIX))
        if len(bad):
            it = items[int(bad[0])]
            raise ForgeError(
                f"item {it.id!r}: prefix {it.prefix_key!r} has length {it.prefix_len}, but earlier "
                f"items gave {int(prefix_len[bad[0]])}; one prefix key must mean one token block"
            )
        empty = np.flatnonzero(num_tokens <= prefix_len)
        if len(empty):
            it = items[int(empty[0])]
            raise ForgeError(
                f"item {it.id!r} has {it.num_tokens} tokens and a {it.prefix_len}-token prefix: "
                "it needs at least one token of its own (admission fails such items)"
            )
        if n > self._top:
            self._grow(n - self._top)
        self._top -= n
        ids = self._free[self._top : self._top + n].copy()
        self._slots[ids] = np.fromiter(items, dtype=object, count=n)
        return Chunk(ids, num_tokens, prefix, prefix_len)

    def batch(self, cut: Cut) -> Batch:
        """The Items a cut names, in its rows."""
        items = self.take(cut.ids)
        if cut.row_ends is None:
            rows = [[it] for it in items]
        else:
            rows = [items[a:b] for a, b in zip([0, *cut.row_ends], cut.row_ends)]
        return Batch(
            rows=rows,
            padded_len=cut.padded_len,
            prefix_key=self.key(cut.prefix),
            prefix_len=self.prefix_len(cut.prefix),
            split_prefix=cut.split_prefix,
            packed=cut.packed,
            tree=cut.tree,
            seq=cut.seq,
            cache_hit=cut.cache_hit,
        )

    def take(self, ids: np.ndarray) -> list[Item]:
        """Remove and return the Items named by `ids`, in that order."""
        items = self._slots[ids].tolist()
        self._slots[ids] = None
        n = len(ids)
        self._free[self._top : self._top + n] = ids
        self._top += n
        return items

    def _grow(self, at_least: int) -> None:
        old = len(self._slots)
        size = max(2 * old, old + at_least)
        self._slots = np.concatenate((self._slots, np.empty(size - old, dtype=object)))
        # new ids go under the free ones, so the stack stays [:_top]
        self._free = np.concatenate(
            (
                np.arange(size - 1, old - 1, -1, dtype=np.int64),
                self._free[: self._top],
                np.empty(old - self._top, np.int64),
            )
        )
        self._top += size - old


class GeometryFeed:
    """Items as bare columns: `num_tokens` per item, and optionally its prefix code (an index
    into `prefix_lens`, or -1 for none). Ids are positions in the input."""

    def __init__(
        self,
        num_tokens: np.ndarray,
        prefix: np.ndarray | None = None,
        prefix_lens: Sequence[int] = (),
        keys: Sequence[str] | None = None,
    ):
        self.num_tokens = np.asarray(num_tokens, np.int64)
        n = len(self.num_tokens)
        self.prefix = np.full(n, NO_PREFIX, np.int64) if prefix is None else np.asarray(prefix, np.int64)
        self.prefix_lens = [int(p) for p in prefix_lens]
        self.keys = list(keys) if keys is not None else [f"prefix{i}" for i in range(len(self.prefix_lens))]
        table = np.array(self.prefix_lens + [0], np.int64)  # index -1 (NO_PREFIX) reads the trailing 0
        self.item_prefix_len = table[self.prefix]
        if np.any(self.item_prefix_len >= self.num_tokens):
            i = int(np.argmax(self.item_prefix_len >= self.num_tokens))
            raise ForgeError(f"item {i}: {self.num_tokens[i]} tokens, not more than its prefix; give it a suffix")
        self._next = 0

    def key(self, code: int) -> str | None:
        return None if code == NO_PREFIX else self.keys[code]

    def prefix_len(self, code: int) -> int:
        return 0 if code == NO_PREFIX else self.prefix_lens[code]

    def code(self, key: str | None) -> int:
        return NO_PREFIX if key is None else self.keys.index(key)

    def batch(self, cut: Cut) -> Batch:
        raise ForgeError("a GeometryFeed holds bare geometry, no items: plan it with Scheduler.next_cut")

    def waiting(self) -> list[Item]:
        """No Items: bare geometry has none to account for."""
        return []

    def close(self) -> None:
        """Nothing to close: the geometry is in memory."""

    def admit(self, n: int) -> Chunk:
        a = self._next
        b = self._next = min(len(self.num_tokens), a + n)
        return Chunk(np.arange(a, b, dtype=np.int64), self.num_tokens[a:b], self.prefix[a:b], self.item_prefix_len[a:b])


class ColumnFeed:
    """Items streamed as column chunks (tokens and prefix code per item), never as Items:
    planning and benchmarking the whole loop at tens of millions of items in bounded memory.

    Waiting items sit in slots (their ids), as in `ItemFeed`, so memory follows the window,
    not the input. `chunks` yields (num_tokens, prefix code) array pairs; `received` is told
    each admitted chunk as `ItemColumns` (the ledger's `forge_items_received`).
    """

    def __init__(
        self,
        chunks: Iterable[tuple[np.ndarray, np.ndarray]],
        prefix_lens: Sequence[int],
        keys: Sequence[str] | None = None,
        capacity: int = 65536,
        received: Callable[[ItemColumns], None] | None = None,
    ):
        self._chunks = iter(chunks)
        self._buf: list[tuple[np.ndarray, np.ndarray]] = []  # pulled from `chunks`, not admitted yet
        self._buffered = 0
        self.prefix_lens = [int(p) for p in prefix_lens]
        self.keys = list(keys) if keys is not None else [f"prefix{i}" for i in range(len(self.prefix_lens))]
        self._table = np.array(self.prefix_lens + [0], np.int64)  # index -1 (NO_PREFIX) reads the 0
        self.received = received
        self.admitted = 0  # items admitted so far: the next one's input position
        cap = max(1, capacity)
        self._index = np.zeros(cap, np.int64)  # slot -> input position
        self._num_tokens = np.zeros(cap, np.int64)
        self._prefix = np.zeros(cap, np.int64)
        self._free = np.arange(cap - 1, -1, -1, dtype=np.int64)  # free slots, a stack: [:_top]
        self._top = cap

    def key(self, code: int) -> str | None:
        return None if code == NO_PREFIX else self.keys[code]

    def prefix_len(self, code: int) -> int:
        return 0 if code == NO_PREFIX else self.prefix_lens[code]

    def code(self, key: str | None) -> int:
        return NO_PREFIX if key is None else self.keys.index(key)

    def _pull(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        while self._buffered < n:
            try:
                tokens, prefix = next(self._chunks)
            except StopIteration:
                break
            self._buf.append((np.asarray(tokens, np.int64), np.asarray(prefix, np.int64)))
            self._buffered += len(self._buf[-1][0])
        if not self._buf:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        tokens = np.concatenate([b[0] for b in self._buf]) if len(self._buf) > 1 else self._buf[0][0]
        prefix = np.concatenate([b[1] for b in self._buf]) if len(self._buf) > 1 else self._buf[0][1]
        self._buf = [(tokens[n:], prefix[n:])] if len(tokens) > n else []
        self._buffered = max(0, len(tokens) - n)
        return tokens[:n], prefix[:n]

    def admit(self, n: int) -> Chunk:
        tokens, prefix = self._pull(n)
        n = len(tokens)
        prefix_len = self._table[prefix]
        if np.any(tokens <= prefix_len):
            i = int(np.argmax(tokens <= prefix_len))
            raise ForgeError(
                f"item {self.admitted + i}: {tokens[i]} tokens, not more than its prefix; give it a suffix"
            )
        if n > self._top:
            self._grow(n - self._top)
        self._top -= n
        ids = self._free[self._top : self._top + n].copy()
        index = np.arange(self.admitted, self.admitted + n, dtype=np.int64)
        self.admitted += n
        self._index[ids], self._num_tokens[ids], self._prefix[ids] = index, tokens, prefix
        if self.received is not None and n:
            self.received(ItemColumns(index, tokens, prefix, self.keys, self._table))
        return Chunk(ids, tokens, prefix, prefix_len)

    def batch(self, cut: Cut) -> ColumnBatch:
        """The batch a cut names, its items as columns; their slots are freed."""
        ids = cut.ids
        cols = ItemColumns(self._index[ids], self._num_tokens[ids], self._prefix[ids], self.keys, self._table)
        n = len(ids)
        self._free[self._top : self._top + n] = ids
        self._top += n
        num_tokens = cols.total_tokens
        prefix_len = self.prefix_len(cut.prefix)
        prefix_tokens = prefix_len * n if cut.prefix != NO_PREFIX else cols.prefix_tokens
        return ColumnBatch(
            rows=LazyRows(cols, cut.row_ends),
            padded_len=cut.padded_len,
            prefix_key=self.key(cut.prefix),
            prefix_len=prefix_len,
            split_prefix=cut.split_prefix,
            packed=cut.packed,
            tree=cut.tree,
            seq=cut.seq,
            cache_hit=cut.cache_hit,
            columns=cols,
            totals=(num_tokens, cut.row_tokens, prefix_tokens),
        )

    def close(self) -> None:
        """Nothing to close: the chunks' source is the caller's."""

    def waiting(self) -> list[Item]:
        """Every item held (admitted, not yet in a batch), as Items."""
        held = np.ones(len(self._index), bool)
        held[self._free[: self._top]] = False
        ids = np.flatnonzero(held)
        return list(ItemColumns(self._index[ids], self._num_tokens[ids], self._prefix[ids], self.keys, self._table))

    def _grow(self, at_least: int) -> None:
        old = len(self._index)
        size = max(2 * old, old + at_least)
        pad = np.zeros(size - old, np.int64)
        self._index, self._num_tokens, self._prefix = (
            np.concatenate((a, pad)) for a in (self._index, self._num_tokens, self._prefix)
        )
        self._free = np.concatenate(
            (
                np.arange(size - 1, old - 1, -1, dtype=np.int64),
                self._free[: self._top],
                np.empty(old - self._top, np.int64),
            )
        )
        self._top += size - old
