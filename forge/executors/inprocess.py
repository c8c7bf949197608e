"""Workers in the calling process, one batch at a time: no isolation, easiest to debug.

A batch runs when its outcome is collected, so errors carry a plain traceback in a
debugger. Timeouts cannot be enforced here (use the process executor). A batch runs through
the same body as in a worker process (`forge.executors.worker.run_batch`): fault points,
error classification, memory clean-up after an out-of-memory error.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any

from forge.executors.base import Executor, Outcome, Status
from forge.executors.worker import Ran, run_batch
from forge.vocab.geometry import Batch, Device
from forge.vocab.procs import resident_bytes, resident_peak_bytes

if TYPE_CHECKING:
    from forge.config.schema import Runtime


class InProcessExecutor(Executor):
    """The executor `runtime.executor=inprocess` builds (a forge_executors factory). `plugins`
    are registered in this process already: only worker processes load them."""

    def __init__(self, function, cache_tokens: int, runtime: Runtime, *, plugins: tuple[str, ...] = (), hook=None):
        super().__init__()
        self.keep_freed_memory = runtime.keep_freed_memory  # for this process's CPU forwards
        self.hook = hook  # fault points fire here too (a test plugin may raise; killing would kill the run)
        self.function = function
        self.cache_tokens = cache_tokens
        self.workers: dict[str, Any] = {}
        self._queue: deque[tuple[int, Device, Batch]] = deque()

    def start(self, devices: list[Device]) -> None:
        if self.keep_freed_memory and any(d.torch_device == "cpu" for d in devices):
            from forge.executors.cpu_process import keep_freed_memory

            keep_freed_memory()  # this process runs the CPU forwards (its threads stay torch's)
        for device in devices:
            t0 = time.perf_counter()
            self.workers[device.name] = self.function.open_worker(device, self.cache_tokens)
            self.load_s[device.name] = round(time.perf_counter() - t0, 3)
            self.resident_ready_bytes[device.name] = resident_bytes()  # this process's: the run's own
            self.ready_at[device.name] = time.time()

    def free_slots(self, device: str) -> int:
        return 0 if self.retired.get(device) or any(d.name == device for _, d, _ in self._queue) else 1

    def submit(self, ticket: int, device: Device, batch: Batch, timeout_s: float | None) -> None:
        self._queue.append((ticket, device, batch))

    def in_flight(self) -> int:
        return len(self._queue)

    def collect(self, wait_s: float) -> list[Outcome]:
        if not self._queue:
            return []
        ticket, device, batch = self._queue.popleft()
        parts: list[Outcome] = []  # a streaming worker's parts: they come first, in order

        def emit(p) -> None:
            parts.append(Ran(Status.PARTIAL, (p.positions, p.output), p.seconds).outcome(ticket, device.name))

        # a sticky device error retires nothing here: the driver's own process cannot be replaced
        ran = run_batch(self.workers[device.name], self.hook, device, batch, emit)
        self._resident(device.name, resident_peak_bytes())  # this process's: the run's own
        return [*parts, ran.outcome(ticket, device.name)]

    def close(self, grace_s: float = 5.0) -> None:
        for worker in self.workers.values():
            worker.close()
        self.workers.clear()
