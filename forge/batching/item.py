"""`item` mode: a fixed number of items per batch, the baseline most pipelines use.

Model: take up to `batch_size` items in arrival order (or longest first with
`order=length`, as lm-evaluation-harness does), one item per row, every row padded to the
longest. A batch is closed early only when the next item would break a device limit.
Rows hold whole sequences: every row runs its own prefix.
"""

from __future__ import annotations

import numpy as np

from forge.batching.base import Chunk, Cut, GroupInfo, Packer, Urgency
from forge.config.modes import ItemBatching
from forge.errors import ForgeError
from forge.vocab.geometry import NO_PREFIX, Device


class ItemPacker(Packer):
    config_schema = ItemBatching

    def __init__(self, config: ItemBatching | None = None):
        config = config if config is not None else ItemBatching()  # None: the schema's defaults
        if config.batch_size < 1:
            raise ForgeError(f"batching.batch_size must be >= 1, got {config.batch_size}")
        if config.order not in ("arrival", "length"):
            raise ForgeError(f"batching.order must be 'arrival' or 'length', got {config.order!r}")
        self.config = config
        self.batch_size = config.batch_size
        self.order = config.order
        self.batch_overhead_tokens = config.batch_overhead_tokens
        # the window in the order batches take it: [head:] waits
        self._lengths = np.zeros(0, np.int64)
        self._ids = np.zeros(0, np.int64)
        self._head = 0
        self._tokens = 0

    def sort_key(self, lengths: np.ndarray) -> np.ndarray | None:
        """Per-item key the window is ordered by (lower runs first), or None for arrival
        order. Subclasses may reorder here."""
        return -lengths if self.order == "length" else None

    def add(self, chunk: Chunk) -> None:
        lengths = np.concatenate((self._lengths[self._head :], chunk.num_tokens))
        ids = np.concatenate((self._ids[self._head :], chunk.ids))
        key = self.sort_key(lengths)
        if key is not None:
            order = np.argsort(key, kind="stable")  # ties keep arrival order
            lengths, ids = lengths[order], ids[order]
        self._lengths, self._ids, self._head = lengths, ids, 0
        self._tokens += int(chunk.num_tokens.sum())

    def __len__(self) -> int:
        return len(self._lengths) - self._head

    def groups(self) -> list[GroupInfo]:
        if not len(self):
            return []
        return [GroupInfo(NO_PREFIX, len(self), self._tokens, False, len(self) // self.batch_size, self._tokens)]

    def cut(self, key: int, device: Device, urgency: Urgency) -> Cut | None:
        if not len(self) or (urgency == Urgency.WAIT and len(self) < self.batch_size):
            return None
        lim = device.limits
        h = self._head
        seg = self._lengths[h : h + min(self.batch_size, lim.max_rows)]
        longest = int(seg.max())
        k = len(seg)
        if longest > lim.max_seq_len or lim.pad(longest) * k > lim.max_batch_tokens:
            # close early: the longest run of items whose padded rows fit
            k = longest = 0
            for n in seg.tolist():
                top = max(longest, n)
                if n > lim.max_seq_len or lim.pad(top) * (k + 1) > lim.max_batch_tokens:
                    break
                k, longest = k + 1, top
            if k == 0:
                return None
        lengths = self._lengths[h : h + k]
        self._head = h + k
        row_tokens = int(lengths.sum())
        self._tokens -= row_tokens
        return Cut(self._ids[h : h + k], lengths, None, lim.pad(longest), row_tokens, NO_PREFIX, False)
