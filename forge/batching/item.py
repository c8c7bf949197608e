"""`item` mode: a fixed number of items per batch, the baseline most pipelines use.

Model: take up to `batch_size` items in arrival order (or longest first with
`order=length`, as lm-evaluation-harness does), one item per row, every row padded to the
longest. A batch is closed early only when the next item would break a device limit.
Rows hold whole sequences: every row runs its own prefix.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from forge.batching.base import GroupInfo, Packer
from forge.errors import ForgeError
from forge.geometry import Batch, Device, Item


class ItemPacker(Packer):
    def __init__(self, batch_size: int = 32, order: str = "arrival", batch_overhead_tokens: int = 0):
        if batch_size < 1:
            raise ForgeError(f"batching.batch_size must be >= 1, got {batch_size}")
        if order not in ("arrival", "length"):
            raise ForgeError(f"batching.order must be 'arrival' or 'length', got {order!r}")
        self.batch_size = batch_size
        self.order = order
        self.batch_overhead_tokens = batch_overhead_tokens
        self._queue: deque[Item] = deque()  # arrival order
        self._heap: list[tuple[int, int, Item]] = []  # longest first, ties in arrival order
        self._seq = itertools.count()
        self._tokens = 0

    def priority(self, item: Item) -> int | None:
        """Lower runs first; None keeps arrival order. Subclasses may reorder here."""
        return -item.num_tokens if self.order == "length" else None

    def add(self, item: Item) -> None:
        p = self.priority(item)
        if p is None:
            self._queue.append(item)
        else:
            heapq.heappush(self._heap, (p, next(self._seq), item))
        self._tokens += item.num_tokens

    def __len__(self) -> int:
        return len(self._queue) + len(self._heap)

    def groups(self) -> list[GroupInfo]:
        return [GroupInfo(None, len(self), self._tokens, 0, False)]

    def _peek(self) -> Item | None:
        if self._heap:
            return self._heap[0][2]
        return self._queue[0] if self._queue else None

    def _pop(self) -> Item:
        return heapq.heappop(self._heap)[2] if self._heap else self._queue.popleft()

    def cut(self, key: str | None, device: Device, drain: bool) -> Batch | None:
        if not len(self) or (not drain and len(self) < self.batch_size):
            return None
        lim = device.limits
        rows: list[list[Item]] = []
        longest = 0
        while (item := self._peek()) is not None and len(rows) < min(self.batch_size, lim.max_rows):
            if item.num_tokens > lim.max_seq_len:
                break
            new_longest = max(longest, item.num_tokens)
            if lim.pad(new_longest) * (len(rows) + 1) > lim.max_batch_tokens:
                break
            longest = new_longest
            rows.append([self._pop()])
        if not rows:
            return None
        self._tokens -= sum(r[0].num_tokens for r in rows)
        return Batch(rows=rows, padded_len=lim.pad(longest))
