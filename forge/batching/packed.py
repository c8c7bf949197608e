"""Packed rows (`packing=packed`) for `token` mode: several suffixes end to end per row.

Model: best fit decreasing, a run of equal lengths at a time: into each row goes the longest
length that fits, as many of it as fit, until the row is full or nothing fits. Items of a run
are interchangeable, so a take is (run, how many), drawn from the run's top end; the plan's
positions are gathered in one numpy pass at the end. Rows are sized so that rows x row_len
fills `max_batch_tokens`; unless draining, a group keeps its last batch's worth for arrivals
to join, and its very last batch spreads what is left evenly over as few rows as hold it
(worst fit, longest first). `PackedPlanning` is the part of `TokenPacker` that plans them.
"""

from __future__ import annotations

import bisect
import heapq
from typing import TYPE_CHECKING

import numpy as np

from forge.batching.base import Cut, Urgency
from forge.batching.groups import Group
from forge.vocab.geometry import Device


class PackedPlanning:
    """Packed planning for `TokenPacker` (its `packed_row_tokens`, `row_cap`, `_shapes`,
    `_profile_of`)."""

    # what the mixin reads of TokenPacker, declared for the type checker only
    packed_row_tokens: int | None
    _shapes: dict[tuple, dict[int, tuple[int, int]]]
    if TYPE_CHECKING:

        def row_cap(self, padded_len: int, prefix_len: int, device: Device) -> int: ...
        def _profile_of(self, device: Device) -> tuple: ...

    def _packed_shape(self, longest: int, g: Group, device: Device) -> tuple[int, int]:
        """(rows, tokens a row may hold) for a packed batch whose longest item is `longest`."""
        lim = device.limits
        limit = lim.max_seq_len - g.offset
        row_cap = min(limit, self.packed_row_tokens) if self.packed_row_tokens else limit
        row_cap = max(lim.pad(longest), row_cap - row_cap % lim.pad_multiple, lim.pad_multiple)
        n_rows = min(lim.max_rows, -(-lim.max_batch_tokens // row_cap))
        row_len = lim.max_batch_tokens // n_rows
        row_len = max(lim.pad(longest), min(row_cap, row_len - row_len % lim.pad_multiple))
        n_rows = min(n_rows, self.row_cap(row_len, g.offset, device))
        if n_rows < 1:  # rows this long do not fit the budget: rows as long as the longest item
            row_len = lim.pad(longest)
            n_rows = min(lim.max_rows, self.row_cap(row_len, g.offset, device))
        return n_rows, min(row_len, limit)  # padding may round a row past `limit`; its tokens may not

    def _plan_packed(self, g: Group, device: Device, urgency: Urgency) -> None:
        # Best fit decreasing, a run at a time: into each row goes the longest length that
        # fits, as many of it as fit, until the row is full or nothing fits. Items of a run
        # are interchangeable, so a take is (run, how many), drawn from the run's top end;
        # the plan's positions are gathered in one numpy pass at the end.
        lim = device.limits
        lengths = g.lengths
        # per run with items left, ascending: its length (what bisect searches), items left,
        # and the end of its items in the sorted arrays (takes come off the top end)
        starts, avail, below = g.runs()
        ends = [*starts[1:], len(lengths)]
        left = [e - s for s, e in zip(starts, ends)]
        limit = lim.max_seq_len - g.offset
        keep = 0 if urgency == Urgency.DRAIN else lim.max_batch_tokens  # the last batch's worth waits for arrivals
        remaining = g.tokens
        fitting = below[bisect.bisect_right(avail, limit)]  # tokens of rows short enough for this device
        shapes = self._shapes.setdefault((self._profile_of(device), g.offset), {})  # packed shape by longest item
        take_end: list[int] = []  # takes in plan order: positions [end - q, end) of the sorted arrays
        take_q: list[int] = []
        batches = []  # (first take item, last take item, row ends, padded_len, useful tokens)
        taken = 0
        while remaining >= keep and (top := bisect.bisect_right(avail, limit)):
            longest = avail[top - 1]
            shape = shapes.get(longest)
            if shape is None:
                shape = shapes[longest] = self._packed_shape(longest, g, device)
            n_rows, fill = shape
            if n_rows < 1:
                break
            first = taken
            if fitting <= n_rows * fill:
                last, row_ends, used, useful = self._last_rows(avail, left, ends, n_rows, fill)
                take_end += last  # takes of one item each
                take_q += [1] * len(last)
                taken += len(last)
                batches.append((first, taken, row_ends, lim.pad(used), useful))
                break
            row_ends = []
            used_max = useful = 0
            for _ in range(n_rows):
                room, placed = _fill_row(avail, left, ends, take_end, take_q, fill)
                taken += placed
                if room == fill:
                    break
                row_ends.append(taken - first)
                if fill - room > used_max:
                    used_max = fill - room
                useful += fill - room
            if not row_ends:
                break
            batches.append((first, taken, row_ends, lim.pad(used_max), useful))
            remaining -= useful
            fitting -= useful
        if batches:
            _keep_plan(g, take_q, take_end, taken, batches)

    @staticmethod
    def _last_rows(
        avail: list[int], left: list[int], ends: list[int], n_rows: int, fill: int
    ) -> tuple[list[int], list[int], int, int]:
        """The group's last batch: spread what is left evenly over as few rows as hold it
        (worst fit, longest first), so padding is the spread between rows, not an empty tail.
        Returns the items row by row as the ends of one-item takes (position + 1), each
        row's end in that list, the fullest row's tokens and the tokens placed."""
        top = bisect.bisect_right(avail, fill)  # runs short enough for a row
        total = sum(avail[j] * left[j] for j in range(top))
        # a heap of rows by (tokens, row), each entry one int: tokens x n_rows + row
        k = n_rows
        loads = list(range(min(n_rows, max(1, -(-total // fill)))))  # all empty: sorted, so a heap
        rows: list[list[int]] = [[] for _ in loads]
        over = (fill + 1) * k  # an entry at or above this holds more than `fill` tokens
        for j in range(top - 1, -1, -1):
            step, c, e = avail[j] * k, left[j], ends[j]
            while c:
                head = loads[0]
                if head + step < over:
                    heapq.heapreplace(loads, head + step)
                    rows[head % k].append(e)
                elif len(rows) < n_rows:
                    heapq.heappush(loads, step + len(rows))
                    rows.append([e])
                else:
                    break  # the rest of this length waits for the next batch
                c -= 1
                e -= 1
            left[j], ends[j] = c, e
        takes: list[int] = []
        row_ends: list[int] = []
        for row in rows:
            if row:
                takes += row
                row_ends.append(len(takes))
        return takes, row_ends, max(loads) // k, sum(load // k for load in loads)


def _fill_row(
    avail: list[int], left: list[int], ends: list[int], take_end: list[int], take_q: list[int], fill: int
) -> tuple[int, int]:
    """One row of `fill` tokens, best fit decreasing: whole runs, longest first, while they
    fit; then as many of the next as fit. Takes are appended to (`take_end`, `take_q`), and
    runs used up are dropped from (`avail`, `left`, `ends`). Returns (tokens of room left,
    items placed)."""
    room, placed = fill, 0
    while (i := bisect.bisect_right(avail, room)) > 0:
        j = i - 1
        while j >= 0:
            n, c = avail[j], left[j]
            if n * c <= room:
                room -= n * c
                placed += c
                j -= 1
                continue
            q = room // n
            if q:
                left[j] = c - q
                ends[j] -= q
                room -= q * n
                placed += q
                take_end.append(ends[j] + q)
                take_q.append(q)
            break
        if j + 1 < i:  # whole runs j+1 .. i-1
            take_end.extend(ends[j + 1 : i])
            take_q.extend(left[j + 1 : i])
            del avail[j + 1 : i], left[j + 1 : i], ends[j + 1 : i]
        if j < 0:
            break
    return room, placed


def _keep_plan(g: Group, take_q: list[int], take_end: list[int], taken: int, batches: list[tuple]) -> None:
    """The planned takes gathered in one numpy pass into the group's ready Cuts; what is left
    stays waiting in the group."""
    lengths = g.lengths
    q = np.array(take_q, np.int64)
    ends = np.array(take_end, np.int64)
    skip = np.cumsum(q) - q  # items before each take
    where = np.repeat(ends - q - skip, q) + np.arange(taken)  # positions, in plan order
    plan_ids, plan_lengths = g.ids[where], lengths[where]
    for first, last, row_ends, padded, useful in batches:
        g.ready.append(
            Cut(plan_ids[first:last], plan_lengths[first:last], row_ends, padded, useful, g.code, True, packed=True)
        )
    kept = np.ones(len(lengths), bool)
    kept[where] = False
    g.lengths, g.ids = lengths[kept], g.ids[kept]
