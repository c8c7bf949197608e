"""Batches complete in virtual time: no model, no sleeping (`forge plan`).

Model: a batch costs its padded slots, plus the prefix tokens it must compute (none on a
predicted cache hit), plus the device's per-step overhead, all in token-equivalents; each
device has a clock, and the batch that finishes first is collected first, so the device
that would be idle first asks for the next batch, as in a run.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable

from forge.executors.base import Executor, Outcome, Status
from forge.geometry import Batch, Device


@dataclass(frozen=True, slots=True)
class SimOutput:
    prefix_computed_tokens: int  # prefix tokens the batch ran (0 on a predicted hit)
    cache_hit: bool


class SimExecutor(Executor):
    def __init__(self, overhead_tokens: Callable[[Device], int]):
        super().__init__()
        self.overhead_tokens = overhead_tokens
        self.clocks: dict[str, float] = {}  # device -> virtual time its last batch ends
        self._heap: list[tuple[float, int, str, float, SimOutput]] = []  # (end, ticket, device, cost, output)
        self._busy: set[str] = set()  # devices with a batch in the heap (free_slots without scanning it)

    def start(self, devices: list[Device]) -> None:
        self.clocks = {d.name: 0.0 for d in devices}

    def free_slots(self, device: str) -> int:
        return 0 if device in self._busy else 1

    def submit(self, ticket: int, device: Device, batch: Batch, timeout_s: float | None) -> None:
        computed = batch.prefix_len if (batch.split_prefix and not batch.cache_hit) else 0
        cost = batch.padded_slots + computed + self.overhead_tokens(device)
        end = self.clocks[device.name] + cost
        self.clocks[device.name] = end
        heapq.heappush(self._heap, (end, ticket, device.name, float(cost), SimOutput(computed, bool(batch.cache_hit))))
        self._busy.add(device.name)

    def in_flight(self) -> int:
        return len(self._heap)

    def collect(self, wait_s: float) -> list[Outcome]:
        if not self._heap:
            return []
        _, ticket, name, cost, output = heapq.heappop(self._heap)
        self._busy.discard(name)  # one batch per device at a time (free_slots), so it is free now
        return [Outcome(ticket, name, Status.COMPLETED, output, "", cost)]
