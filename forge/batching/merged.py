"""Prefix groups merged into rows (`batching.merge_groups`): a prefix tree packed into rows.

Model: a prefix group too small to fill a batch pays a whole step's fixed cost for a few
short rows, and its prefix's own pass besides when no batch has run that prefix yet. Such a
group joins the pool of merged groups instead, as one unit of ``prefix_len + row tokens``
slots: its prefix once, then each of its items' suffixes. The pool cuts tree batches
(`Batch.tree`): units go first fit decreasing into rows of `tree_row_len` slots, so one step
carries many prefixes, each computed once, and masks keep every suffix to its own prefix
and itself (`forge.runtime.masks`). A 4D mask makes attention compute every pair of a row,
so a tree batch's rows are as long as its longest unit, and no shorter than max_rows rows
need to fill the step (`tree_row_len`); shorter units share rows. A unit may be at most
`tree_row_cap` long: `packed_row_tokens`, else `TREE_ROW_CAP`, within max_seq_len. The cap
is what keeps that quadratic term small: a group longer than it (a long prefix with many
suffixes) already fills a batch of its own, and runs there behind its prefix's cached KV.

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

from forge.batching.base import NO_PREFIX, Cut, GroupInfo, Urgency
from forge.core.geometry import Device

if TYPE_CHECKING:
    from forge.batching.token import _Group

MERGED = -2  # the group key of the pool of merged prefix groups (never a prefix code)
TREE_ROW_CAP = 512  # the longest tree row (and merged group) unless batching.packed_row_tokens says otherwise


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
        else `TREE_ROW_CAP`, within max_seq_len."""
        return min(device.limits.max_seq_len, self.packed_row_tokens or TREE_ROW_CAP)

    def tree_row_len(self, longest: int, device: Device) -> int:
        """Slots of a tree row whose longest unit is `longest`: that, padded, and no fewer than
        max_rows rows need to fill max_batch_tokens (within the cap), so short units share rows."""
        lim = device.limits
        cap = self.tree_row_cap(device)
        row = max(longest, min(cap, -(-lim.max_batch_tokens // lim.max_rows)))
        return min(lim.pad(row), max(cap - cap % lim.pad_multiple, longest))

    def _tree_rows(self, row: int, device: Device) -> int:
        """Rows of `row` tokens (padded) one tree batch on `device` may hold."""
        padded = device.limits.pad(row)
        return min(device.limits.max_batch_tokens // padded, self.row_cap(padded, 0, device))

    def _note_ran(self, code: int) -> None:
        if code >= len(self._ran):
            self._ran.extend(bytes(code + 1 - len(self._ran) + len(self._ran) // 2))
        self._ran[code] = 1

    def _merges(self, g: _Group, device: Device) -> bool:
        """Whether group `g` (merged, its arrays sorted) costs less in a tree batch than in its own."""
        if not self.merge_groups or g.code == NO_PREFIX or not g.offset or not len(g.lengths):
            return False
        lim = device.limits
        unit = g.offset + g.tokens
        if unit > self.tree_row_cap(device) or self._tree_rows(self.tree_row_len(unit, device), device) < 1:
            return False
        overhead = self.overhead_tokens(device)
        longest = lim.pad(int(g.lengths[-1]))
        own_slots = lim.pad(g.tokens) if self.packing == "packed" else len(g.lengths) * longest
        ran = g.code < len(self._ran) and self._ran[g.code]
        own = overhead + own_slots + (0 if ran else g.offset)
        return unit * (lim.max_batch_tokens + overhead) < own * lim.max_batch_tokens

    def _pool_add(self, g: _Group) -> None:
        unit = _Unit(g.code, g.offset, g.lengths, g.ids)
        at = bisect.bisect_right(self._pool_lens, unit.tokens)
        self._pool_lens.insert(at, unit.tokens)
        self._pool.insert(at, unit)
        self._pool_items += len(g.lengths)
        self._pool_tokens += unit.tokens
        self._pool_info = None

    def _pool_group(self) -> GroupInfo | None:
        if not self._pool:
            return None
        if self._pool_info is None:
            self._pool_info = GroupInfo(MERGED, self._pool_items, self._pool_tokens, False, 0, self._pool_tokens)
        return self._pool_info

    def _pool_cut(self, device: Device, urgency: Urgency) -> Cut | None:
        """The next tree batch for `device`: rows filled first fit decreasing, largest units first."""
        if not self._pool or urgency == Urgency.WAIT:
            return None
        lens, pool = self._pool_lens, self._pool
        top = bisect.bisect_right(lens, self.tree_row_cap(device))  # units this device's rows hold
        if not top:
            return None  # longer than a row here: another device's rows hold them
        row = self.tree_row_len(lens[top - 1], device)
        n_rows = self._tree_rows(row, device)
        if n_rows < 1 or (urgency < Urgency.DRAIN and self._pool_tokens < n_rows * row):
            return None
        rows: list[list[_Unit]] = []
        used: list[int] = []
        while len(rows) < n_rows and lens:
            room, taken = row, []
            while (i := bisect.bisect_right(lens, room)) > 0:
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
        if not rows:
            return None
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
