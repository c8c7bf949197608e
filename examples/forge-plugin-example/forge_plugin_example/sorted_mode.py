"""`sorted`: a fixed number of items per batch after sorting the window by length.

Model: the window (up to `batching.window` items) is kept sorted by token count, shortest
first (or longest first with `descending=true`); each batch takes the next `batch_size`
items, one per row, padded to the longest. Neighbours in length pad little, and no prefix is
shared (every row runs its whole sequence), so any function runs it exactly. It is the item
packer with another order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from forge.batching import ItemPacker
from forge.config.modes import ItemBatching


@dataclass
class SortedBatching(ItemBatching):
    """`sorted`: item batches from a window sorted by length (`order` is not read: the sort decides)."""

    mode: str = "sorted"
    descending: bool = False  # false: shortest first; true: longest first


class SortedPacker(ItemPacker):
    config_schema = SortedBatching  # its keys, types and defaults: the run's config is checked against it

    def __init__(self, config: SortedBatching | None = None):
        config = config if config is not None else SortedBatching()
        super().__init__(config)
        self.descending = config.descending

    def sort_key(self, lengths: np.ndarray) -> np.ndarray:
        return -lengths if self.descending else lengths
