"""A set of input indexes kept as a bitmap: which items a run has committed.

Model: one byte per input position up to the largest seen (grown by doubling), so ten
million committed items cost 10 MB instead of a Python int and a hash entry each (~70 B);
negative indexes (hand-built Items that never got a position) go to a small Python set.
It answers `in`, `update` and `len` as a set does, and `contains`/`add_array` for whole
numpy columns at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np


class IndexSet:
    def __init__(self, indexes: Iterable[int] = ()):
        self._bits = np.zeros(0, np.bool_)  # position -> committed
        self._negative: set[int] = set()  # indexes below 0
        self.update(indexes)

    def __contains__(self, index: int) -> bool:
        if index < 0:
            return index in self._negative
        return index < len(self._bits) and bool(self._bits[index])

    def __len__(self) -> int:
        return int(np.count_nonzero(self._bits)) + len(self._negative)

    def __iter__(self) -> Iterator[int]:
        yield from sorted(self._negative)
        yield from np.flatnonzero(self._bits).tolist()

    def contains(self, indexes: np.ndarray) -> np.ndarray:
        """Membership of every entry of a non-negative int64 array, as a bool array."""
        if len(indexes) and int(indexes.max()) < len(self._bits):  # the usual case: one gather
            return self._bits[indexes]
        inside = indexes < len(self._bits)
        out = np.zeros(len(indexes), np.bool_)
        out[inside] = self._bits[indexes[inside]]
        return out

    def add_array(self, indexes: np.ndarray) -> None:
        """Add every entry of a non-negative int64 array."""
        if not len(indexes):
            return
        top = int(indexes.max()) + 1
        if top > len(self._bits):
            grown = np.zeros(max(top, 2 * len(self._bits)), np.bool_)
            grown[: len(self._bits)] = self._bits
            self._bits = grown
        self._bits[indexes] = True

    def update(self, indexes: Iterable[int]) -> None:
        values = np.fromiter(indexes, np.int64)
        negative = values < 0
        if negative.any():
            self._negative.update(values[negative].tolist())
            values = values[~negative]
        self.add_array(np.unique(values))
