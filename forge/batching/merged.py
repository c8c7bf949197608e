"""Prefix groups merged into rows (`batching.merge_groups`): a prefix tree packed into rows.

Model: a prefix group too small to fill a batch pays a whole step's fixed cost for a few
short rows, and its prefix's own pass besides when no batch has run that prefix yet. Such a
group joins the pool of merged groups instead, as one unit of ``prefix_len + row tokens``
slots: its prefix once, then each of its items' suffixes. The pool cuts tree batches
(`Batch.tree`): units go first fit decreasing into rows of `tree_row_len` slots, so one step
carries many prefixes, each computed once, and masks keep every suffix to its own prefix
and itself (`forge.runtime.forward.masks`). A 4D mask makes attention compute every pair of a row,
so a tree batch's rows are as long as its longest unit, and no shorter than max_rows rows
need to fill the step (`tree_row_len`); shorter units share rows. A unit may be at most
`tree_row_cap` long: `packed_row_tokens`, else `TREE_UNIT_CAP`, within max_seq_len; units share
rows of at most `tree_row_fill` (`packed_row_tokens`, else `TREE_ROW_FILL`), and a longer unit
takes a row alone. That keeps the quadratic term small: a row computes every pair of its slots,
so short units never pad a long unit's row. A group longer than the cap (a long prefix with many
suffixes) already fills a batch of its own, and runs there behind its prefix's cached KV. A unit
between the two merges only when its suffixes are short next to its prefix (`SHORT_SUFFIXES`): a
few-shot question's context with its choices. Alone in a row it computes about what its own batch
would (a row computes all of its pairs, its own batch the prefix's causal half and each suffix
against the prefix), in one step with others instead of one each: on MMLU-shaped contexts of 640
tokens, 500 batches became 40 and the score run 13.2 s became 6.2 s (docs/benchmarks.md). A unit
of many suffixes behind a short prefix would compute several times the pairs in a row, so it
keeps its own batch.

Rows pad to the longest unit, and a unit longer than half a row fills one alone, so a batch
headed by a 494-slot unit pads a 260-slot one by 90%. Draining (the pool is all there will
be), a cut fills up to twice its rows and takes, after the head, the fullest rows while each
raises useful slots per cost (`_worth_rows`); the rest go back to head batches of shorter
rows, which also compute fewer attention pairs. The last rows for a device join the batch
when a batch of their own would cost more. Before draining a cut stays a full batch in order,
since the pool's next arrivals may fill those rows. On random small groups this costs at most
0.5% over full batches in order and 0.8% less in total (tests/test_tree_rows.py); `probe_gen`'s
1,000 rows over 40 prefixes: padding 21% -> 9%, forward time -17 to -25%.

When a group merges is decided from geometry alone (`MergedPlanning._merges`). With O the
per-step overhead in token slots, B the step's token slots, P the prefix, T the group's row
tokens and S the padded slots of its own batch, its own batch costs O + S, plus P unless a
batch of its own has run that prefix already with the prefix cache on (then a device's cache is
likely to hold it; a tree batch computes its prefixes in the rows and caches none); its share of
a tree batch costs (P + T)(1 + O / B). The group merges when the share is cheaper and the
unit fits one tree row. Under `Urgency.ROOM` the pool cuts only full batches (a full batch's
worth of units waits for company); under `DRAIN` it cuts everything.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import numpy as np

from forge.batching.base import Cut, GroupInfo, Urgency
from forge.batching.groups import Group
from forge.vocab.geometry import NO_PREFIX, Device

MERGED = -2  # the group key of the pool of merged prefix groups (never a prefix code)
TREE_ROW_FILL = 512  # the row short units share, unless batching.packed_row_tokens says otherwise
TREE_UNIT_CAP = 1024  # the longest unit that merges (in a row alone past TREE_ROW_FILL), unless packed_row_tokens
SHORT_SUFFIXES = 4  # past TREE_ROW_FILL a unit merges only if its suffixes are at most 1/4 of its prefix


class _Unit:
    """One merged prefix group: its prefix once, then its items' suffixes."""

    __slots__ = ("code", "prefix_len", "lengths", "ids", "tokens")

    def __init__(self, code: int, prefix_len: int, lengths: np.ndarray, ids: np.ndarray):
        self.code = code
        self.prefix_len = prefix_len
        self.lengths = lengths  # each item's suffix, its tokens in the row
        self.ids = ids
        self.tokens = prefix_len + int(lengths.sum())  # slots the unit takes in a row


class MergedPlanning:
    """The pool of merged prefix groups for `TokenPacker` (its `merge_groups`, `packed_row_tokens`,
    `row_cap`, `overhead_tokens`)."""

    merge_groups: bool
    packed_row_tokens: int | None
    packing: str
    if TYPE_CHECKING:

        def row_cap(self, padded_len: int, prefix_len: int, device: Device) -> int: ...
        def overhead_tokens(self, device: Device) -> int: ...

    def _init_pool(self) -> None:
        self._pool_lens: list[int] = []  # unit lengths, ascending (what bisect searches)
        self._pool: list[_Unit] = []  # the units, aligned with _pool_lens
        self._pool_items = 0
        self._pool_tokens = 0
        self._pool_info: GroupInfo | None = None
        self._ran = bytearray()  # per prefix code: a batch has run it split off, so a device's cache may hold it

    def tree_row_cap(self, device: Device) -> int:
        """The longest tree row on `device` (the longest unit that may merge): `packed_row_tokens`,
        else `TREE_UNIT_CAP`, within max_seq_len."""
        return min(device.limits.max_seq_len, self.packed_row_tokens or TREE_UNIT_CAP)

    def tree_row_fill(self, device: Device) -> int:
        """The longest row units share on `device`: `packed_row_tokens`, else `TREE_ROW_FILL`; a
        longer unit has a row of its own (a row computes every pair of its slots)."""
        return min(device.limits.max_seq_len, self.packed_row_tokens or TREE_ROW_FILL)

    def tree_row_len(self, longest: int, device: Device) -> int:
        """Slots of a tree row whose longest unit is `longest`: that, padded, and no fewer than
        max_rows rows need to fill max_batch_tokens (within the fill), so short units share rows."""
        lim = device.limits
        cap, fill = self.tree_row_cap(device), self.tree_row_fill(device)
        row = max(longest, min(fill, -(-lim.max_batch_tokens // lim.max_rows)))
        return min(lim.pad(row), max(cap - cap % lim.pad_multiple, longest))

    def _tree_rows(self, row: int, device: Device) -> int:
        """Rows of `row` tokens (padded) one tree batch on `device` may hold."""
        padded = device.limits.pad(row)
        return min(device.limits.max_batch_tokens // padded, self.row_cap(padded, 0, device))

    def _note_ran(self, code: int) -> None:
        if code >= len(self._ran):
            self._ran.extend(bytes(code + 1 - len(self._ran) + len(self._ran) // 2))
        self._ran[code] = 1

    def _merges(self, g: Group, device: Device) -> bool:
        """Whether group `g` (merged, its arrays sorted) costs less in a tree batch than in its own."""
        if not self.merge_groups or g.code == NO_PREFIX or not g.offset or not len(g.lengths):
            return False
        lim = device.limits
        unit = g.offset + g.tokens
        if unit > self.tree_row_cap(device) or self._tree_rows(self.tree_row_len(unit, device), device) < 1:
            return False
        if unit > self.tree_row_fill(device) and g.tokens * SHORT_SUFFIXES > g.offset:
            return False  # alone in a row, its every pair computed: only where its prefix is most of it
        overhead = self.overhead_tokens(device)
        longest = lim.pad(int(g.lengths[-1]))
        own_slots = lim.pad(g.tokens) if self.packing == "packed" else len(g.lengths) * longest
        ran = g.code < len(self._ran) and self._ran[g.code]
        own = overhead + own_slots + (0 if ran else g.offset)
        return unit * (lim.max_batch_tokens + overhead) < own * lim.max_batch_tokens

    def _pool_add(self, g: Group) -> None:
        self._pool_put(_Unit(g.code, g.offset, g.lengths, g.ids))
        self._pool_items += len(g.lengths)
        self._pool_tokens += int(g.offset) + int(g.lengths.sum())
        self._pool_info = None

    def _pool_put(self, unit: _Unit) -> None:
        """Insert `unit` where its length sorts (the pool's counts are the caller's)."""
        at = bisect.bisect_right(self._pool_lens, unit.tokens)
        self._pool_lens.insert(at, unit.tokens)
        self._pool.insert(at, unit)

    def _pool_group(self) -> GroupInfo | None:
        if not self._pool:
            return None
        if self._pool_info is None:
            self._pool_info = GroupInfo(MERGED, self._pool_items, self._pool_tokens, False, 0, self._pool_tokens)
        return self._pool_info

    def _pool_cut(self, device: Device, urgency: Urgency) -> Cut | None:
        """The next tree batch for `device`: rows filled first fit decreasing, largest units first,
        then only the rows that pay for their slots (`_worth_rows`); the others go back to the pool."""
        if not self._pool or urgency == Urgency.WAIT:
            return None
        lens = self._pool_lens
        top = bisect.bisect_right(lens, self.tree_row_cap(device))  # units this device's rows hold
        if not top:
            return None  # longer than a row here: another device's rows hold them
        row = self.tree_row_len(lens[top - 1], device)
        n_rows = self._tree_rows(row, device)
        if n_rows < 1 or (urgency < Urgency.DRAIN and self._pool_tokens < n_rows * row):
            return None
        draining = urgency == Urgency.DRAIN
        alone = row > self.tree_row_fill(device)  # long units: one a row, no short unit in their long rows
        rows, used = self._fill_rows(row, 2 * n_rows if draining else n_rows, alone)
        if not rows:
            return None
        if draining:  # before that, a full batch: what the pool holds now is not all it will hold
            keep = self._rows_that_pay(rows, used, row, n_rows, device)
            kept = set(keep)
            for i in reversed(range(len(rows))):
                if i not in kept:
                    for u in rows[i]:
                        self._pool_put(u)
            rows, used = [rows[i] for i in keep], [used[i] for i in keep]
        units = [u for r in rows for u in r]
        ids = np.concatenate([u.ids for u in units])
        lengths = np.concatenate([u.lengths for u in units])
        row_ends = np.cumsum([sum(len(u.ids) for u in r) for r in rows]).tolist()
        tokens = sum(used)
        self._pool_items -= len(ids)
        self._pool_tokens -= sum(u.tokens for u in units)
        self._pool_info = None
        pad = device.limits.pad(max(used))
        return Cut(ids, lengths, row_ends, pad, tokens, NO_PREFIX, False, packed=True, tree=True)

    def _rows_that_pay(
        self, rows: list[list[_Unit]], used: list[int], row: int, n_rows: int, device: Device
    ) -> list[int]:
        """Draining: which filled rows the batch takes (`_worth_rows`); the others head batches of
        shorter rows. When nothing else is left for `device`, the rows left would make one batch
        of their own, so they join this one when that costs less."""
        overhead = self.overhead_tokens(device)
        keep = _worth_rows(used, row, n_rows, overhead)
        rest = [i for i in range(len(rows)) if i not in keep]
        if rest and len(rows) <= n_rows and not bisect.bisect_right(self._pool_lens, self.tree_row_cap(device)):
            left = sorted((u.tokens for i in rest for u in rows[i]), reverse=True)
            own = self.tree_row_len(left[0], device)
            if len(rest) * row <= overhead + own * _ffd_count(left, own):
                return list(range(len(rows)))
        return keep

    def _fill_rows(self, row: int, most: int, alone: bool = False) -> tuple[list[list[_Unit]], list[int]]:
        """Up to `most` rows of `row` slots, first fit decreasing, their units taken from the pool;
        with each row's used slots (a prefix once where units of one code share a row). `alone`:
        each row one unit longer than half a row, the longest left (shorter units wait for rows
        of their length)."""
        lens, pool = self._pool_lens, self._pool
        rows: list[list[_Unit]] = []
        used: list[int] = []
        while len(rows) < most and lens:
            room = row
            taken: list[_Unit] = []
            while (i := bisect.bisect_right(lens, room)) > 0 and not (alone and (taken or 2 * lens[i - 1] <= row)):
                room -= lens[i - 1]
                del lens[i - 1]
                taken.append(pool.pop(i - 1))
            if not taken:
                break
            # units of one prefix code (a group that merged twice) sit together: the prefix once
            taken.sort(key=lambda u: u.code)
            again = sum(u.prefix_len for a, u in zip(taken, taken[1:]) if a.code == u.code)
            rows.append(taken)
            used.append(row - room - again)
        return rows, used


def _worth_rows(used: list[int], row: int, n_rows: int, overhead: int) -> list[int]:
    """Which of the filled rows (their `used` slots of `row`) one tree batch of at most `n_rows`
    rows takes, in their order: the first (the longest unit, which sets the row length), then
    the fullest while each raises useful slots per cost, a step costing `overhead` slots plus
    its rows (a row fuller than the batch so far). The rows left go back to the pool, so a unit
    of half a row's length is not padded to the longest but heads a batch of shorter rows later."""
    keep, total = [0], used[0]
    for i in sorted(range(1, len(used)), key=lambda i: -used[i])[: n_rows - 1]:
        if used[i] * (overhead + len(keep) * row) < total * row:
            break
        keep.append(i)
        total += used[i]
    return sorted(keep)


def _ffd_count(lengths: list[int], row: int) -> int:
    """Rows of `row` slots that first fit decreasing fills with `lengths` (descending, each <= row)."""
    rooms: list[int] = []
    for n in lengths:
        for j, r in enumerate(rooms):
            if r >= n:
                rooms[j] = r - n
                break
        else:
            rooms.append(row - n)
    return len(rooms)
