"""`token` mode: group by prefix, then cut batches whose padded slots carry useful tokens.

Model: every item belongs to the group of its prefix key, kept sorted by length. A batch
comes from one group, so its rows share one prefix, which runs once per batch and can be
served from the device's prefix cache; rows then hold only the suffixes.

* Rows per sequence (`packing=rows`): a batch is the k longest waiting items of a group,
  padded to the longest. The cost of a step is its padded slots plus a fixed overhead in
  token-equivalents (`batch_overhead_tokens`), so k is chosen to maximise
  useful tokens / (k * padded_len + overhead): short items are not padded up to a long
  head, and near-zero padding is not bought with tiny batches.
* Packed rows (`packing=packed`): each row holds several suffixes end to end (best fit,
  longest first), so padding is only the unfilled tail of rows. Rows are sized so that
  rows x row_len fills `max_batch_tokens`.

With `drain=False` a group is cut only when it can fill a batch; the scheduler drains
when the input is exhausted or the window is full.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field

import numpy as np

from forge.batching.base import GroupInfo, Packer
from forge.errors import ForgeError
from forge.geometry import Batch, Device, Item


@dataclass(slots=True)
class _Group:
    key: str | None
    prefix_len: int
    items: list[Item] = field(default_factory=list)  # sorted by num_tokens, ascending
    pending: list[Item] = field(default_factory=list)  # admitted, not yet merged
    tokens: int = 0  # row tokens of items + pending

    def sorted_items(self) -> list[Item]:
        if self.pending:
            self.items.extend(self.pending)
            self.pending.clear()
            self.items.sort(key=_num_tokens)  # timsort: sorted run + short tail
        return self.items


def _num_tokens(item: Item) -> int:
    return item.num_tokens


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
        g = self._groups.get(item.prefix_key)
        if g is None:
            g = self._groups[item.prefix_key] = _Group(item.prefix_key, item.prefix_len)
        elif item.prefix_len != g.prefix_len:
            raise ForgeError(
                f"item {item.id!r}: prefix {item.prefix_key!r} has length {item.prefix_len}, "
                f"but earlier items gave {g.prefix_len}; one prefix key must mean one token block"
            )
        g.pending.append(item)
        g.tokens += item.num_tokens - self._offset(g)
        self._count += 1

    def __len__(self) -> int:
        return self._count

    def groups(self) -> list[GroupInfo]:
        return [
            GroupInfo(g.key, len(g.items) + len(g.pending), g.tokens, g.prefix_len,
                      self.split_prefix and g.key is not None)
            for g in self._groups.values()
            if g.items or g.pending
        ]

    def _offset(self, g: _Group) -> int:
        return g.prefix_len if (self.split_prefix and g.key is not None) else 0

    # -- cutting ----------------------------------------------------------------
    def cut(self, key: str | None, device: Device, drain: bool) -> Batch | None:
        g = self._groups.get(key)
        if g is None:
            return None
        items = g.sorted_items()
        if not items:
            return None
        if self.packing == "packed":
            batch = self._cut_packed(g, items, device, drain)
        else:
            batch = self._cut_rows(g, items, device, drain)
        if batch is not None:
            n = sum(len(r) for r in batch.rows)
            self._count -= n
            g.tokens -= batch.row_tokens
            if not g.items and not g.pending:
                del self._groups[key]
        return batch

    def row_cap(self, padded_len: int, prefix_len: int, device: Device) -> int:
        """Most rows of `padded_len` slots one step may hold. Memory mode narrows this."""
        lim = device.limits
        return min(lim.max_rows, lim.max_batch_tokens // padded_len)

    def _cut_rows(self, g: _Group, items: list[Item], device: Device, drain: bool) -> Batch | None:
        lim = device.limits
        off = self._offset(g)
        end = len(items)
        while end and items[end - 1].num_tokens > lim.max_seq_len:
            end -= 1  # too long for this device; another device may take it
        if end == 0:
            return None
        if not drain and g.tokens < self.ready_batches * lim.max_batch_tokens:
            return None
        padded_len = lim.pad(items[end - 1].num_tokens - off)
        cap = min(end, self.row_cap(padded_len, g.prefix_len if off else 0, device))
        if cap < 1:
            return None
        lens = np.fromiter((items[end - 1 - i].num_tokens - off for i in range(cap)), np.int64, cap)
        # useful tokens per unit of step cost, for k = 1..cap longest items
        ratio = np.cumsum(lens) / (np.arange(1, cap + 1) * padded_len + self.overhead_tokens(device))
        k = cap - int(np.argmax(ratio[::-1]))  # the largest k among the best
        rows = [[it] for it in reversed(items[end - k:end])]
        del items[end - k:end]
        return self._batch(g, rows, padded_len, off, packed=False)

    def _cut_packed(self, g: _Group, items: list[Item], device: Device, drain: bool) -> Batch | None:
        lim = device.limits
        off = self._offset(g)
        fits = bisect.bisect_right(items, lim.max_seq_len, key=_num_tokens)
        if fits == 0:
            return None  # everything waiting is too long for this device
        longest = lim.pad(items[fits - 1].num_tokens - off)
        row_cap = lim.max_seq_len - off
        if self.packed_row_tokens:
            row_cap = min(row_cap, self.packed_row_tokens)
        row_cap = max(longest, row_cap - row_cap % lim.pad_multiple, lim.pad_multiple)
        n_rows = min(lim.max_rows, -(-lim.max_batch_tokens // row_cap))
        row_len = lim.max_batch_tokens // n_rows
        row_len = max(longest, min(row_cap, row_len - row_len % lim.pad_multiple))
        n_rows = min(n_rows, self.row_cap(row_len, off, device))
        if n_rows < 1:
            return None
        if not drain and g.tokens < max(self.ready_batches, 1.0) * n_rows * row_len:
            return None
        rows: list[list[Item]] = []
        used_max = 0
        fill = min(row_len, lim.max_seq_len - off)  # tokens a row may hold; padding may round past it
        if g.tokens <= n_rows * fill:
            return self._last_packed(g, items[:fits], n_rows, fill, lim)
        while len(rows) < n_rows and items:
            room, row = fill, []
            while items:
                # largest waiting suffix that still fits the room left in this row
                i = bisect.bisect_right(items, room + off, key=_num_tokens) - 1
                if i < 0:
                    break
                it = items.pop(i)
                row.append(it)
                room -= it.num_tokens - off
            if not row:
                break
            rows.append(row)
            used_max = max(used_max, fill - room)
        if not rows:
            return None
        return self._batch(g, rows, lim.pad(used_max), off, packed=True)

    def _last_packed(self, g: _Group, fitting: list[Item], n_rows: int, fill: int, lim) -> Batch | None:
        """The group's last batch: spread what is left evenly over as few rows as hold it
        (worst fit, longest first), so padding is the spread between rows, not an empty tail."""
        off = self._offset(g)
        total = sum(it.num_tokens - off for it in fitting)
        n = min(n_rows, max(1, -(-total // fill)))
        loads = [(0, r) for r in range(n)]  # (tokens, row) heap: least loaded first
        rows: list[list[Item]] = [[] for _ in range(n)]
        taken: set[int] = set()
        for it in reversed(fitting):
            size = it.num_tokens - off
            load, r = loads[0]
            if load + size <= fill:
                heapq.heapreplace(loads, (load + size, r))
            elif len(rows) < n_rows:
                r = len(rows)
                rows.append([])
                heapq.heappush(loads, (size, r))
            else:
                continue  # stays for the next batch
            rows[r].append(it)
            taken.add(id(it))
        if len(taken) == len(g.items):
            g.items.clear()
        else:
            g.items[:] = [it for it in g.items if id(it) not in taken]
        rows = [row for row in rows if row]
        used = max(sum(it.num_tokens - off for it in row) for row in rows)
        return self._batch(g, rows, lim.pad(used), off, packed=True)

    def _batch(self, g: _Group, rows: list[list[Item]], padded_len: int, off: int, packed: bool) -> Batch:
        return Batch(
            rows=rows,
            padded_len=padded_len,
            prefix_key=g.key,
            prefix_len=g.prefix_len,
            split_prefix=bool(off) or (packed and self.split_prefix),
            packed=packed,
        )
