"""The worker body every executor shares: one batch on a loaded worker, start to answer.

Wherever a worker runs (the driver's own process, a worker process, a Ray actor), running a
batch is the same: the fault points around the forward pass (a test plugin may raise, hang or
kill there), the forward pass itself, its time, any error turned into a status and one line,
and the device's cached memory handed back after an out-of-memory error. Only the transport
differs (a pipe, Ray's object store, a plain return), so `run_batch` returns a plain `Ran`
that each executor sends its own way and turns into an `Outcome` on the driver's side.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from forge.executors.base import Outcome, Status, classify_error, one_line
from forge.vocab.geometry import Batch, Device


@dataclass(frozen=True, slots=True)
class Ran:
    """What running one batch gave."""

    status: Status
    payload: Any  # the function's output when COMPLETED, else the error in one line
    seconds: float  # time on the device, the fault points included
    #: a device error that leaves the process's CUDA context unusable: its worker must be replaced
    sticky: bool = False

    def outcome(self, ticket: int, device: str) -> Outcome:
        """The driver's record of it, for the batch submitted under `ticket`."""
        if self.status == Status.COMPLETED:
            return Outcome(ticket, device, self.status, self.payload, "", self.seconds)
        if self.status == Status.PARTIAL:  # payload: (positions, output)
            return Outcome(ticket, device, self.status, self.payload[1], "", self.seconds, part=self.payload[0])
        return Outcome(ticket, device, self.status, None, self.payload, self.seconds)


def sticky_error(text: str) -> bool:
    """Whether an error's text says the device is unusable for this process from now on (a CUDA
    error or a device-side assert poisons its context: every later call fails the same way)."""
    return "CUDA error" in text or "device-side assert" in text


@dataclass(frozen=True, slots=True)
class Part:
    """Some items' output, given while their batch runs on (a worker that `streams`)."""

    positions: tuple[int, ...]  # in the batch's items, ascending: the output's order
    output: Any
    seconds: float  # time on the device since the batch's previous part (or its start)


def run_batch(worker: Any, hook: Any, device: Device, batch: Batch, emit: Any = None) -> Ran:
    """Run `batch` on `worker` (the function's, loaded on `device`); every error comes back as a
    `Ran`, none escapes. `hook` is the relay the fault points fire through (None: no plugins).
    `emit(Part)`: where a worker that streams (``streams = True``: its `run(batch, emit)` hands
    finished items on as it goes) sends them; the `Ran` is then for the items not sent, its
    seconds those since the last part. None: the batch's output comes whole."""
    mark = [time.perf_counter()]  # the start, then each part's time

    def part(positions, output) -> None:
        now = time.perf_counter()
        emit(Part(tuple(positions), output, now - mark[0]))
        mark[0] = now

    try:
        if hook is not None:
            hook.forge_fault(point="before_forward", device=device, batch=batch)
        output = (
            worker.run(batch, part) if emit is not None and getattr(worker, "streams", False) else worker.run(batch)
        )
        if hook is not None:
            hook.forge_fault(point="after_forward", device=device, batch=batch)
    except Exception as exc:  # noqa: BLE001 - every error becomes an outcome
        seconds = time.perf_counter() - mark[0]
        status = classify_error(exc)
        if status == Status.OOM:
            free_device_memory(device)  # the next batch, smaller, must find the memory this one held
            return Ran(status, one_line(exc), seconds)
        # the whole text: the marker may sit below the first line the reason keeps
        return Ran(status, one_line(exc), seconds, sticky=sticky_error(str(exc)))
    return Ran(Status.COMPLETED, output, time.perf_counter() - mark[0])


def free_device_memory(device: Device) -> None:
    """Hand the memory torch's caching allocator holds on a GPU back to the device."""
    if device.torch_device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()
