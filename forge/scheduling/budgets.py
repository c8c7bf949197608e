"""Each device as the scheduler knows it now: its limits and memory budget, lowered after an
out-of-memory error.

Model: a device starts as its inventory declares it. After a batch runs out of memory there,
later batches on it stay below the failed one: max_batch_tokens drops to three quarters of the
failed batch's padded slots (never below one full-length row, never above what it was) and
its memory budget by a tenth. The scheduler splits the failed batch; the device itself is not
changed (a simulated one keeps its true budget).
"""

from __future__ import annotations

from dataclasses import replace

from forge.vocab.geometry import Batch, Device, Limits


class DeviceBudgets:
    def __init__(self, devices: list[Device]):
        self.devices: dict[str, Device] = {d.name: d for d in devices}  # as known now (budgets drop on OOM)
        self.oom_splits = 0  # batches split after running out of memory

    def lower(self, name: str, batch: Batch) -> None:
        """`batch` ran out of memory on `name`: later batches there stay below it."""
        d = self.devices[name]
        lim = d.limits
        floor = lim.pad(lim.max_seq_len)
        tokens = max(floor, min(lim.max_batch_tokens, batch.padded_slots * 3 // 4))
        memory = int(d.memory_bytes * 0.9) if d.memory_bytes else d.memory_bytes
        self.devices[name] = replace(
            d, limits=Limits(tokens, lim.max_rows, lim.max_seq_len, lim.pad_multiple), memory_bytes=memory
        )
        self.oom_splits += 1
