"""`item` mode: a fixed number of items per batch, the baseline most pipelines use.

Model: take up to `batch_size` items in arrival order (or longest first with
`order=length`, as lm-evaluation-harness does), one item per row, every row padded to the
longest. A batch is closed early only when the next item would break a device limit.
Rows hold whole sequences: every row runs its own prefix.
"""

from __future__ import annotations

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
        self._queue: deque[Item] = deque()
        self._tokens = 0
        self._sorted = True

    def add(self, item: Item) -> None:
        self._queue.append(item)
        self._tokens += item.num_tokens
        self._sorted = False

    def __len__(self) -> int:
        return len(self._queue)

    def groups(self) -> list[GroupInfo]:
        return [GroupInfo(None, len(self._queue), self._tokens, 0, False)]

    def cut(self, key: str | None, device: Device, drain: bool) -> Batch | None:
        q = self._queue
        if not q or (not drain and len(q) < self.batch_size):
            return None
        if self.order == "length" and not self._sorted:
            self._queue = q = deque(sorted(q, key=lambda it: -it.num_tokens))
            self._sorted = True
        lim = device.limits
        rows: list[list[Item]] = []
        longest = 0
        while q and len(rows) < min(self.batch_size, lim.max_rows):
            n = q[0].num_tokens
            if n > lim.max_seq_len:
                break
            new_longest = max(longest, n)
            if lim.pad(new_longest) * (len(rows) + 1) > lim.max_batch_tokens:
                break
            longest = new_longest
            rows.append([q.popleft()])
        if not rows:
            return None
        self._tokens -= sum(r[0].num_tokens for r in rows)
        return Batch(rows=rows, padded_len=lim.pad(longest))
