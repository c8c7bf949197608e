"""`token` mode: group by prefix, then cut batches whose padded slots carry useful tokens.

Model: every item belongs to the group of its prefix key. A batch comes from one group, so
its rows share one prefix, which runs once per batch and can be served from the device's
prefix cache; rows then hold only the suffixes. Inside a group, items sit in buckets by
row length, so a cut costs O(distinct lengths), not O(items).

* Without the prefix cache (`prefix_cache=false`, rows only) rows hold whole sequences, so
  all items form one group sorted by total length.
* Rows per sequence (`packing=rows`): a batch is a run of consecutive lengths, padded to
  the longest. A step costs its padded slots plus a fixed overhead in token-equivalents
  (`batch_overhead_tokens`), so the packer takes the run (head length and row count) with
  the most useful tokens per unit of cost: short items are not padded up to a long head,
  near-zero padding is not bought with tiny batches, and sparse long tails wait for company
  while the window has room.
* Packed rows (`packing=packed`): each row holds several suffixes end to end (largest that
  fits first), so padding is only the unfilled tail of rows. Rows are sized so that
  rows x row_len fills `max_batch_tokens`; a group's last batch spreads what is left evenly.

With `drain=False` a group is cut only when it can fill a batch; the scheduler drains when
the input is exhausted or the window is full.
"""

from __future__ import annotations

import bisect
import heapq

import numpy as np

from forge.batching.base import GroupInfo, Packer
from forge.errors import ForgeError
from forge.geometry import Batch, Device, Item


class _Group:
    """Waiting items of one prefix key, bucketed by row length."""

    __slots__ = ("key", "prefix_len", "offset", "buckets", "lengths", "sizes", "count", "tokens")

    def __init__(self, key: str | None, prefix_len: int, offset: int):
        self.key = key
        self.prefix_len = prefix_len
        self.offset = offset  # tokens of each item outside its row (the split prefix)
        self.buckets: dict[int, list[Item]] = {}  # row length -> items
        self.lengths: list[int] = []  # row lengths that have items, ascending
        self.sizes: list[int] = []  # items per entry of `lengths`
        self.count = 0  # items waiting
        self.tokens = 0  # row tokens waiting

    def add(self, item: Item) -> None:
        n = item.num_tokens - self.offset
        bucket = self.buckets.get(n)
        i = bisect.bisect_left(self.lengths, n)
        if bucket is None:
            self.buckets[n] = [item]
            self.lengths.insert(i, n)
            self.sizes.insert(i, 1)
        else:
            bucket.append(item)
            self.sizes[i] += 1
        self.count += 1
        self.tokens += n

    def pop(self, n: int) -> Item:
        bucket = self.buckets[n]
        item = bucket.pop()
        i = bisect.bisect_left(self.lengths, n)
        if bucket:
            self.sizes[i] -= 1
        else:
            del self.buckets[n], self.lengths[i], self.sizes[i]
        self.count -= 1
        self.tokens -= n
        return item

    def largest_at_most(self, room: int) -> int | None:
        i = bisect.bisect_right(self.lengths, room)
        return self.lengths[i - 1] if i else None


class TokenPacker(Packer):
    def __init__(
        self,
        packing: str = "rows",
        prefix_cache: bool = True,
        batch_overhead_tokens: int = 256,
        packed_row_tokens: int | None = None,
        ready_batches: float = 2.0,
    ):
        if packing not in ("rows", "packed"):
            raise ForgeError(f"batching.packing must be 'rows' or 'packed', got {packing!r}")
        if batch_overhead_tokens < 0:
            raise ForgeError("batching.batch_overhead_tokens must be >= 0")
        self.packing = packing
        self.prefix_cache = bool(prefix_cache)
        self.batch_overhead_tokens = int(batch_overhead_tokens)
        self.packed_row_tokens = packed_row_tokens
        self.ready_batches = ready_batches
        # packed rows always split the prefix: it is what every sequence in a row attends to
        self.split_prefix = self.prefix_cache or packing == "packed"
        self._groups: dict[str | None, _Group] = {}
        self._count = 0

    # -- window -----------------------------------------------------------------
    def add(self, item: Item) -> None:
        if not self.split_prefix:
            # Rows hold whole sequences and every row runs its own prefix: sharing one buys
            # nothing, so one group sorted by total length packs tightest.
            g = self._groups.get(None)
            if g is None:
                g = self._groups[None] = _Group(None, 0, 0)
            g.add(item)
            self._count += 1
            return
        g = self._groups.get(item.prefix_key)
        if g is None:
            offset = item.prefix_len if item.prefix_key is not None else 0
            g = self._groups[item.prefix_key] = _Group(item.prefix_key, item.prefix_len, offset)
        elif item.prefix_len != g.prefix_len:
            raise ForgeError(
                f"item {item.id!r}: prefix {item.prefix_key!r} has length {item.prefix_len}, "
                f"but earlier items gave {g.prefix_len}; one prefix key must mean one token block"
            )
        g.add(item)
        self._count += 1

    def __len__(self) -> int:
        return self._count

    def groups(self) -> list[GroupInfo]:
        return [
            GroupInfo(g.key, g.count, g.tokens, g.prefix_len, self.split_prefix and g.key is not None)
            for g in self._groups.values()
        ]

    # -- cutting ----------------------------------------------------------------
    def cut(self, key: str | None, device: Device, drain: bool) -> Batch | None:
        g = self._groups.get(key)
        if g is None:
            return None
        if not drain and g.tokens < self.ready_batches * device.limits.max_batch_tokens:
            return None  # not enough waiting to fill a batch well: wait for more, or a drain
        cut = self._cut_packed if self.packing == "packed" else self._cut_rows
        batch = cut(g, device, drain)
        if batch is not None:
            self._count -= sum(len(row) for row in batch.rows)
            if not g.count:
                del self._groups[key]
        return batch

    def row_cap(self, padded_len, prefix_len: int, device: Device):
        """Most rows of `padded_len` slots (an int or an array of them) one step may hold.
        Memory mode narrows this."""
        lim = device.limits
        return np.minimum(lim.max_rows, lim.max_batch_tokens // padded_len)

    def _cut_rows(self, g: _Group, device: Device, drain: bool) -> Batch | None:
        lim = device.limits
        hi = bisect.bisect_right(g.lengths, lim.max_seq_len - g.offset)  # longer ones wait for a bigger device
        if hi == 0:
            return None
        lengths = np.array(g.lengths[hi - 1::-1], dtype=np.int64)  # distinct row lengths, descending
        counts = np.array(g.sizes[hi - 1::-1], dtype=np.int64)
        first = np.concatenate(([0], np.cumsum(counts)))  # index of each length's first item
        before = np.concatenate(([0], np.cumsum(lengths * counts)))  # tokens of the items before it
        total = int(first[-1])

        def tokens_upto(m: np.ndarray) -> np.ndarray:
            """Row tokens of the m longest items."""
            i = np.minimum(np.searchsorted(first, m, side="right") - 1, len(lengths) - 1)
            return before[i] + (m - first[i]) * lengths[i]

        m = lim.pad_multiple
        pad = -(-lengths // m) * m
        caps = np.minimum(self.row_cap(pad, g.prefix_len if g.offset else 0, device), total - first[:-1])
        overhead = self.overhead_tokens(device)
        # the best full batch headed by each length: useful tokens per unit of step cost
        useful = tokens_upto(first[:-1] + caps) - before[:-1]
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(caps > 0, useful / (caps * pad + overhead), -1.0)
        head = int(np.argmax(ratio))
        cap = int(caps[head])
        if cap < 1:
            return None
        # then the best row count under that head
        start = int(first[head])
        ks = np.arange(1, cap + 1)
        per_k = (tokens_upto(start + ks) - before[head]) / (ks * pad[head] + overhead)
        k = cap - int(np.argmax(per_k[::-1]))  # the largest k among the best
        rows, n = [], int(lengths[head])
        for _ in range(k):
            while n not in g.buckets:
                n = g.largest_at_most(n)
            rows.append([g.pop(n)])
        return self._batch(g, rows, int(pad[head]), packed=False)

    def _cut_packed(self, g: _Group, device: Device, drain: bool) -> Batch | None:
        lim = device.limits
        off = g.offset
        longest = g.largest_at_most(lim.max_seq_len - off)
        if longest is None:
            return None  # everything waiting is too long for this device
        row_cap = lim.max_seq_len - off
        if self.packed_row_tokens:
            row_cap = min(row_cap, self.packed_row_tokens)
        row_cap = max(lim.pad(longest), row_cap - row_cap % lim.pad_multiple, lim.pad_multiple)
        n_rows = min(lim.max_rows, -(-lim.max_batch_tokens // row_cap))
        row_len = lim.max_batch_tokens // n_rows
        row_len = max(lim.pad(longest), min(row_cap, row_len - row_len % lim.pad_multiple))
        n_rows = min(n_rows, int(self.row_cap(row_len, off, device)))
        if n_rows < 1:
            return None
        fill = min(row_len, lim.max_seq_len - off)  # tokens a row may hold; padding may round past it
        if g.tokens <= n_rows * fill:
            return self._last_packed(g, n_rows, fill, lim)
        rows: list[list[Item]] = []
        used_max = 0
        while len(rows) < n_rows and g.count:
            room, row = fill, []
            while (n := g.largest_at_most(room)) is not None:  # best fit: the largest that fits
                row.append(g.pop(n))
                room -= n
            if not row:
                break
            rows.append(row)
            used_max = max(used_max, fill - room)
        if not rows:
            return None
        return self._batch(g, rows, lim.pad(used_max), packed=True)

    def _last_packed(self, g: _Group, n_rows: int, fill: int, lim) -> Batch:
        """The group's last batch: spread what is left evenly over as few rows as hold it
        (worst fit, longest first), so padding is the spread between rows, not an empty tail."""
        fitting = [n for n in g.lengths if n <= fill]
        total = sum(n * len(g.buckets[n]) for n in fitting)
        loads = [(0, r) for r in range(min(n_rows, max(1, -(-total // fill))))]  # (tokens, row) heap
        rows: list[list[Item]] = [[] for _ in loads]
        for n in reversed(fitting):
            for _ in range(len(g.buckets[n])):  # pops may empty the bucket: count first
                load, r = loads[0]
                if load + n <= fill:
                    heapq.heapreplace(loads, (load + n, r))
                elif len(rows) < n_rows:
                    r = len(rows)
                    rows.append([])
                    heapq.heappush(loads, (n, r))
                else:
                    break  # the rest of this length waits for the next batch
                rows[r].append(g.pop(n))
        rows = [row for row in rows if row]
        used = max(load for load, _ in loads)
        return self._batch(g, rows, lim.pad(used), packed=True)

    def _batch(self, g: _Group, rows: list[list[Item]], padded_len: int, packed: bool) -> Batch:
        return Batch(
            rows=rows,
            padded_len=padded_len,
            prefix_key=g.key,
            prefix_len=g.prefix_len,
            split_prefix=bool(g.offset) or (packed and self.split_prefix),
            packed=packed,
        )
