"""`sorted`: a fixed number of items per batch after sorting the window by length.

Model: the window (up to `batching.window` items) is kept sorted by token count, shortest
first (or longest first with `descending=true`); each batch takes the next `batch_size`
items, one per row, padded to the longest. Neighbours in length pad little, and no prefix is
shared (every row runs its whole sequence), so any function runs it exactly. It is the item
packer with another order.
"""

from __future__ import annotations

import numpy as np

from forge.batching import ItemPacker


class SortedPacker(ItemPacker):
    def __init__(self, batch_size: int = 32, descending: bool = False, batch_overhead_tokens: int = 0):
        super().__init__(batch_size=batch_size, order="arrival", batch_overhead_tokens=batch_overhead_tokens)
        self.descending = bool(descending)

    def sort_key(self, lengths: np.ndarray) -> np.ndarray:
        return -lengths if self.descending else lengths
