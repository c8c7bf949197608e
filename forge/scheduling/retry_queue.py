"""The retry queue: batches that came back from a failure, run before anything new.

Model: a failed batch goes back whole (its worker was lost or timed out, or it was queued
behind the batch that failed) or in halves (an error, out of memory, or an item lost with
its worker `max_attempts` times), until a single item that still fails is failed with its
reason. What comes back first runs first, on the first device it fits (`fits`: its four
limits and the packer's budget). A batch that fits no device goes back as single items, and
a single item that fits no device's budget runs where its limits allow (out of memory alone,
it fails with the reason).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import replace

from forge.vocab.geometry import Batch, Device, Item, pad_to_limits

Fits = Callable[[Batch, Device], "Batch | None"]  # the batch padded for a device, or None if it may not run there


class RetryQueue:
    def __init__(self, max_attempts: int = 3):
        self.max_attempts = max(1, int(max_attempts))  # runs of an item lost with its worker before it fails
        self.attempts: dict[int, int] = {}  # input index -> runs lost with a worker (crash, hang)
        self._batches: deque[Batch] = deque()  # first in line first

    def __len__(self) -> int:
        return len(self._batches)

    def __iter__(self) -> Iterator[Batch]:
        return iter(self._batches)

    @property
    def item_count(self) -> int:
        """Items waiting in the queue."""
        return sum(len(b.items) for b in self._batches)

    @property
    def padded_slots(self) -> int:
        """Padded slots of the batches waiting in the queue."""
        return sum(b.padded_slots for b in self._batches)

    def items(self) -> list[Item]:
        return [it for b in self._batches for it in b.items]

    def push_front(self, batch: Batch) -> None:
        """`batch` runs next."""
        self._batches.appendleft(batch)

    def push_halves(self, batch: Batch) -> None:
        """`batch`'s halves run next, in order (they isolate what fails)."""
        self._batches.extendleft(reversed(batch.halves()))

    def count_lost(self, batch: Batch) -> int:
        """`batch` was lost with its worker: one more run for each of its items; the most runs
        any of them has now."""
        for it in batch.items:
            self.attempts[it.index] = self.attempts.get(it.index, 0) + 1
        return max(self.attempts[it.index] for it in batch.items)

    def take(self, device: Device, devices: list[Device], fits: Fits) -> Batch | None:
        """The first batch waiting that fits `device`, padded for it, and out of the queue."""
        for i, batch in enumerate(self._batches):
            fitted = fits(batch, device)
            if fitted is not None:
                del self._batches[i]
                return fitted
        for i, batch in enumerate(self._batches):
            if len(batch.items) > 1 and not any(fits(batch, d) for d in devices):
                del self._batches[i]
                self._batches.extend(replace(batch, rows=[[it]]) for it in batch.items)
                return self.take(device, devices, fits)
        for i, batch in enumerate(self._batches):
            if len(batch.items) == 1 and not any(fits(batch, d) for d in devices):
                fitted = pad_to_limits(batch, device.limits)
                if fitted is not None:
                    del self._batches[i]
                    return fitted
        return None
