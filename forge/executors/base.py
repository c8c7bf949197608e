"""The executor seam: submit a batch to a device, collect outcomes as they finish.

Narrow on purpose, so a thread, a process or a Ray actor can sit behind it: the run loop
asks which devices have a free slot, submits a batch with a ticket, and collects
`Outcome`s in completion order. Everything that can happen to a batch comes back as an
outcome; the loop and the scheduler decide what follows.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from typing import Any

from forge.geometry import Batch, Device


class Status(str, Enum):
    COMPLETED = "completed"  # the worker returned the batch's output
    FAILED = "failed"  # the worker raised an error for it
    OOM = "oom"  # the device ran out of memory on it
    TIMEOUT = "timeout"  # no answer within its timeout; the worker is replaced if it stays silent
    LOST = "lost"  # the worker died (crash, kill, restart) with the batch in flight


@dataclass(slots=True)
class Outcome:
    """What happened to one submitted batch."""

    ticket: int  # the ticket it was submitted with
    device: str  # the device's name
    status: Status
    output: Any = None  # the function's output (COMPLETED only)
    reason: str = ""  # one line, when not COMPLETED
    seconds: float = 0.0  # time on the device (virtual time for the simulator)
    charged: bool = True  # the failure is this batch's own; False: it was only queued behind the one that failed


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def classify_error(exc: BaseException) -> Status:
    """OOM for out-of-memory errors (CUDA's, and the CPU allocator's RuntimeError), else FAILED."""
    name = type(exc).__name__
    text = str(exc).lower()
    if name == "OutOfMemoryError" or isinstance(exc, MemoryError) or "out of memory" in text \
            or "can't allocate memory" in text:
        return Status.OOM
    return Status.FAILED


class Executor(ABC):
    """Runs batches on devices. `start` before the first submit, `close` always."""

    def __init__(self) -> None:
        self.restarts: dict[str, int] = {}  # device -> workers replaced
        self.retired: dict[str, str] = {}  # device -> why it runs no more work

    @abstractmethod
    def start(self, devices: list[Device]) -> None: ...

    @abstractmethod
    def free_slots(self, device: str) -> int:
        """Batches `device` would take now (0 while busy, loading or retired)."""

    @abstractmethod
    def submit(self, ticket: int, device: Device, batch: Batch, timeout_s: float | None) -> None: ...

    @abstractmethod
    def collect(self, wait_s: float) -> list[Outcome]:
        """Outcomes that finished, waiting up to `wait_s` for the first one."""

    @abstractmethod
    def in_flight(self) -> int:
        """Batches submitted whose outcome has not been collected."""

    def live(self, device: str) -> bool:
        """Whether the device can still run work (not retired)."""
        return device not in self.retired

    def close(self) -> None:
        """Stop every worker; nothing is left running."""

    def info(self) -> dict[str, Any]:
        """Executor-specific report entries (where its workers run); none by default."""
        return {}
