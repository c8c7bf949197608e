"""`token` mode: group by prefix, then cut batches whose padded slots carry useful tokens.

Model: every item belongs to the group of its prefix key. A batch comes from one group, so
its rows share one prefix, which runs once per batch and can be served from the device's
prefix cache; rows then hold only the suffixes. Inside a group, items sit in buckets by
row length, so a cut costs O(distinct lengths it spans) in plain Python: no per-item
search and no numpy call per batch, which keeps 1,000,000 items well under a second.

* Without the prefix cache (`prefix_cache=false`, rows only) rows hold whole sequences, so
  all items form one group sorted by total length.
* Rows per sequence (`packing=rows`): a batch is a run of consecutive lengths headed by
  the group's longest item and padded to it. A step costs its padded slots plus a fixed
  overhead in token-equivalents (`batch_overhead_tokens`), so the run grows downward only
  while the next item raises useful tokens per unit of cost: short items are not padded
  up to a long head, and near-zero padding is not bought with tiny batches. Against the
  exact optimum of the same items (a dynamic program over contiguous cuts) this greedy
  costs at most 8% more in tests, and under 2% on realistic length spreads.
* Packed rows (`packing=packed`): each row holds several suffixes end to end (largest that
  fits first), so padding is only the unfilled tail of rows. Rows are sized so that
  rows x row_len fills `max_batch_tokens`; a group's last batch spreads what is left evenly.

With `drain=False` a group is cut only when it can fill a batch; the scheduler drains when
the input is exhausted or the window is full.
"""

from __future__ import annotations

import bisect
import heapq

from forge.batching.base import GroupInfo, Packer
from forge.errors import ForgeError
from forge.geometry import Batch, Device, Item


class _Group:
    """Waiting items of one prefix key, in buckets by row length.

    Cuts work on runs of equal length, so their cost grows with the distinct lengths a
    batch spans, not with its items.
    """

    __slots__ = ("key", "prefix_len", "offset", "buckets", "lengths", "count", "tokens", "wait_above", "wait_for", "stale_for")

    def __init__(self, key: str | None, prefix_len: int, offset: int):
        self.key = key
        self.prefix_len = prefix_len
        self.offset = offset  # tokens of each item outside its row (the split prefix)
        self.buckets: dict[int, list[Item]] = {}  # row length -> items
        self.lengths: list[int] = []  # row lengths that have items, ascending
        self.count = 0  # items waiting
        self.tokens = 0  # row tokens waiting
        # rows longer than this were found too sparse to head a batch for device `wait_for`;
        # they wait for company, and a longer arrival clears the mark (rows mode, not draining)
        self.wait_above: int | None = None
        self.wait_for: Device | None = None
        self.stale_for: Device | None = None  # device that found nothing ready here; an arrival clears it

    def take(self, n: int, q: int, out: list[Item]) -> None:
        """Move `q` items of row length `n` into `out`."""
        bucket = self.buckets[n]
        if q >= len(bucket):
            q = len(bucket)
            out += bucket
            del self.buckets[n]
            del self.lengths[bisect.bisect_left(self.lengths, n)]
        else:
            out += bucket[-q:]
            del bucket[-q:]
        self.count -= q
        self.tokens -= q * n

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
        self.add_many((item,))

    def add_many(self, items) -> None:
        # This runs once per item of the whole input, so the per-item work is a few C-level
        # loops: split by prefix key, then per group read lengths in bulk and bucket them.
        if self.split_prefix:
            by_key: dict[str | None, list[Item]] = {}
            for item in items:
                lst = by_key.get(item.prefix_key)
                if lst is None:
                    by_key[item.prefix_key] = [item]
                else:
                    lst.append(item)
        else:
            # Rows hold whole sequences and every row runs its own prefix: sharing one buys
            # nothing, so one group sorted by total length packs tightest.
            by_key = {None: items if isinstance(items, list) else list(items)}
        for key, group_items in by_key.items():
            self._add_group(key, group_items)

    def _add_group(self, key: str | None, items: list[Item]) -> None:
        if not items:
            return
        g = self._groups.get(key)
        if g is None:
            plen = items[0].prefix_len if key is not None else 0
            g = self._groups[key] = _Group(key, plen, plen)
        if key is not None and {it.prefix_len for it in items} != {g.prefix_len}:
            bad = next(it for it in items if it.prefix_len != g.prefix_len)
            raise ForgeError(
                f"item {bad.id!r}: prefix {key!r} has length {bad.prefix_len}, "
                f"but earlier items gave {g.prefix_len}; one prefix key must mean one token block"
            )
        off = g.offset
        rows = [it.num_tokens - off for it in items] if off else [it.num_tokens for it in items]
        buckets, lengths = g.buckets, g.lengths
        for n, item in zip(rows, items):
            bucket = buckets.get(n)
            if bucket is None:
                buckets[n] = [item]
                bisect.insort(lengths, n)
            else:
                bucket.append(item)
        longest = max(rows)
        if g.wait_above is not None and longest > g.wait_above:
            g.wait_above = None  # company for the waiting tail: look at it again
        g.count += len(rows)
        g.tokens += sum(rows)
        g.stale_for = None
        self._count += len(rows)

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
        if not drain and (g.stale_for is device or g.tokens < self.ready_batches * device.limits.max_batch_tokens):
            return None  # not enough waiting to fill a batch well: wait for more, or a drain
        count = g.count
        batch = self._cut_packed(g, device) if self.packing == "packed" else self._cut_rows(g, device, drain)
        if batch is None:
            g.stale_for = None if drain else device
        else:
            self._count -= count - g.count
            if not g.count:
                del self._groups[key]
        return batch

    def row_cap(self, padded_len: int, prefix_len: int, device: Device) -> int:
        """Most rows of `padded_len` slots one step may hold. Memory mode narrows this."""
        lim = device.limits
        return min(lim.max_rows, lim.max_batch_tokens // padded_len)

    def _cut_rows(self, g: _Group, device: Device, drain: bool) -> Batch | None:
        # A batch is a run of consecutive lengths padded to its head, the longest. From a
        # head it grows downward one run of equal lengths at a time while the next length l
        # still pays for its slot, that is while l > head x (useful / cost) of the batch so
        # far, where cost is padded slots plus the per-step overhead: a shorter item would
        # lower the batch's useful tokens per unit of cost, so it waits for a lower head.
        # Heads are tried from the longest down. Unless draining, a batch with fewer than
        # half the rows its head allows is left to wait for company (a sparse long tail)
        # and the next head below it is tried.
        lim = device.limits
        lengths, buckets = g.lengths, g.buckets
        top = lim.max_seq_len - g.offset  # longer rows wait for a bigger device
        if not drain and g.wait_above is not None and g.wait_for is device:
            top = min(top, g.wait_above)
        hi = bisect.bisect_right(lengths, top) - 1
        m = lim.pad_multiple
        prefix_len = g.prefix_len if g.offset else 0
        overhead = self.overhead_tokens(device)
        while hi >= 0:
            padded = -(-lengths[hi] // m) * m
            cap = self.row_cap(padded, prefix_len, device)
            if cap < 1:
                return None
            k = useful = 0
            takes: list[tuple[int, int]] = []  # (row length, items of it)
            i = hi
            while i >= 0:
                n = lengths[i]
                if k and n * (k * padded + overhead) <= padded * useful:
                    break
                q = len(buckets[n])
                if q > cap - k:
                    q = cap - k
                takes.append((n, q))
                k += q
                useful += q * n
                if k >= cap:
                    break
                i -= 1
            if drain or 2 * k >= cap:
                items: list[Item] = []
                for n, q in takes:
                    g.take(n, q, items)
                return self._batch(g, [[it] for it in items], padded, packed=False)
            hi = i  # these wait; try the heads below them
            g.wait_above, g.wait_for = (lengths[i] if i >= 0 else 0), device
        return None

    def _cut_packed(self, g: _Group, device: Device) -> Batch | None:
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
        n_rows = min(n_rows, self.row_cap(row_len, off, device))
        if n_rows < 1:
            return None
        fill = min(row_len, lim.max_seq_len - off)  # tokens a row may hold; padding may round past it
        if g.tokens <= n_rows * fill:
            return self._last_packed(g, n_rows, fill, lim)
        # Best fit decreasing, a run at a time: the longest length that fits, as many of it
        # as fit, until the row is full or nothing fits.
        rows: list[list[Item]] = []
        lengths, buckets = g.lengths, g.buckets
        used_max = 0
        while len(rows) < n_rows and g.count:
            room, row = fill, []
            while (i := bisect.bisect_right(lengths, room)) > 0:
                n = lengths[i - 1]
                q = min(len(buckets[n]), room // n)
                g.take(n, q, row)
                room -= q * n
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
            for _ in range(len(g.buckets[n])):  # takes may empty the bucket: count first
                load, r = loads[0]
                if load + n <= fill:
                    heapq.heapreplace(loads, (load + n, r))
                elif len(rows) < n_rows:
                    r = len(rows)
                    rows.append([])
                    heapq.heappush(loads, (n, r))
                else:
                    break  # the rest of this length waits for the next batch
                g.take(n, 1, rows[r])
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
