"""A prefix group of the token packer: the waiting items of one prefix code, their row lengths
sorted ascending with their ids, and the batches planned for them (`forge.batching.token`, and its
`packed` and `merged` planning, read and cut them)."""

from __future__ import annotations

from collections import deque

import numpy as np

from forge.batching.base import Cut, GroupInfo

EMPTY = np.zeros(0, np.int64)


def stable_order(key: np.ndarray) -> np.ndarray:
    """`np.argsort(key, kind="stable")`, faster: a plain sort of key x n + position (unique
    values, so ties keep their order) when that cannot overflow."""
    n = len(key)
    if not n or int(key.max()) >= (1 << 62) // n or int(key.min()) < 0:
        return np.argsort(key, kind="stable")
    return np.sort(key * n + np.arange(n)) % n


class Group:
    """Waiting items of one prefix code: row lengths sorted ascending, ids aligned."""

    __slots__ = (
        "code",
        "offset",
        "split",
        "lengths",
        "ids",
        "pending",
        "ready",
        "ready_for",
        "count",
        "tokens",
        "planned_for",
        "arrived",
        "info",
    )

    def __init__(self, code: int, offset: int, split: bool):
        self.code = code
        self.offset = offset  # tokens of each item outside its row (the split prefix)
        self.split = split  # batches run the prefix once (rows hold suffixes)
        self.lengths = EMPTY  # row lengths not yet planned, ascending
        self.ids = EMPTY  # their ids
        self.pending: list[tuple[np.ndarray, np.ndarray]] = []  # arrivals (lengths, ids), each sorted
        self.ready: deque[Cut] = deque()  # batches planned for profile `ready_for`, in order
        self.ready_for: tuple | None = None
        self.count = 0  # items waiting, planned ones included
        self.tokens = 0  # row tokens waiting, planned ones included
        # the profile of the last plan, and the row tokens that arrived since: the same items
        # plan the same way, so the group is planned again for that profile once
        # `replan_batches` batches' worth has arrived
        self.planned_for: tuple | None = None
        self.arrived = 0
        self.info: GroupInfo | None = None  # what `groups()` reports; None once out of date

    def merge(self) -> None:
        """Fold arrivals, and batches planned for another profile, into the sorted arrays."""
        parts = self.pending + [(c.lengths, c.ids) for c in self.ready]
        if not parts:
            return
        if len(self.pending) == 1 and not self.ready and not len(self.lengths):  # one sorted arrival
            (self.lengths, self.ids), self.pending = self.pending[0], []
            return
        lengths = np.concatenate([self.lengths, *(p[0] for p in parts)])
        ids = np.concatenate([self.ids, *(p[1] for p in parts)])
        order = np.argsort(lengths, kind="stable")  # merges the sorted pieces
        self.lengths, self.ids = lengths[order], ids[order]
        self.pending = []
        self.ready.clear()

    def runs(self) -> tuple[list[int], list[int], list[int]]:
        """Runs of equal lengths, ascending: (first position, length, row tokens below it);
        the token list has one more entry, the total."""
        lengths = self.lengths
        starts = np.flatnonzero(np.concatenate(([True], lengths[1:] != lengths[:-1])))
        below = np.concatenate(([0], np.cumsum(lengths)))
        return starts.tolist(), lengths[starts].tolist(), [*below[starts].tolist(), int(below[-1])]
