"""The executor seam: submit a batch to a device, collect outcomes as they finish.

Narrow on purpose, so a thread, a process or a Ray actor can sit behind it: the run loop
asks which devices have a free slot, submits a batch with a ticket, and collects
`Outcome`s in completion order. Everything that can happen to a batch comes back as an
outcome; the loop and the scheduler decide what follows.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Generic, TypeVar

from forge.vocab.geometry import Batch, Device


class Status(str, Enum):
    COMPLETED = "completed"  # the worker returned the batch's output
    FAILED = "failed"  # the worker raised an error for it
    OOM = "oom"  # the device ran out of memory on it
    TIMEOUT = "timeout"  # no answer within its timeout; the worker is replaced if it stays silent
    LOST = "lost"  # the worker died (crash, kill, restart) with the batch in flight
    PARTIAL = "partial"  # some items' output while the batch runs on (`Outcome.part`); its own outcome follows


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
    #: PARTIAL: the positions in the submitted batch's items that `output` holds, ascending (its order); the
    #: batch's later outcomes are then for the items not given yet
    part: tuple[int, ...] = ()


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def classify_error(exc: BaseException) -> Status:
    """OOM for out-of-memory errors (CUDA's, and the CPU allocator's RuntimeError), else FAILED."""
    name = type(exc).__name__
    text = str(exc).lower()
    if (
        name == "OutOfMemoryError"
        or isinstance(exc, MemoryError)
        or "out of memory" in text
        or "can't allocate memory" in text
    ):
        return Status.OOM
    return Status.FAILED


class Executor(ABC):
    """Runs batches on devices. `start` before the first submit, `close` always."""

    def __init__(self) -> None:
        self.restarts: dict[str, int] = {}  # device -> workers replaced
        self.retired: dict[str, str] = {}  # device -> why it runs no more work
        self.load_s: dict[str, float] = {}  # device -> seconds its first worker took to load the model
        self.ready_at: dict[str, float] = {}  # device -> time.time() its first worker was ready
        #: device -> seconds from its first worker's start to its model load's start (the process
        #: starting, waiting for its imports: torch, transformers, the function's modules)
        self.worker_start_s: dict[str, float] = {}
        #: device -> the most resident memory its worker's process held (the largest of its workers'
        #: peaks, each as the worker measured it after a batch: `forge.vocab.procs.resident_peak_bytes`);
        #: the run's own process for the in-process executor
        self.resident_peak_bytes: dict[str, int] = {}
        #: device -> the resident memory its first worker's process held once its model was loaded
        #: (imports, weights), before any batch: what the batches' keys, values and steps grew from
        self.resident_ready_bytes: dict[str, int] = {}

    def _resident(self, device: str, peak: int | None) -> None:
        if peak:
            self.resident_peak_bytes[device] = max(self.resident_peak_bytes.get(device, 0), int(peak))

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

    def close(self, grace_s: float = 5.0) -> None:
        """Stop every worker; nothing is left running. Workers may take `grace_s` seconds to
        finish and exit; past that they are killed (0: at once)."""

    def info(self) -> dict[str, Any]:
        """Executor-specific report entries (where its workers run); none by default."""
        return {}


@dataclass(kw_only=True)
class Slot:
    """One device's worker (a process, an actor) and the batches sent to it."""

    device: Device
    started: float  # when the worker was started
    ready: bool = False  # model loaded
    queue: deque = field(default_factory=deque)  # (ticket, timeout_s, handle) in send order; the head runs
    head_since: float | None = None  # when the head started running
    silent_since: float | None = None  # set when the head timed out: no more work until it answers


SlotT = TypeVar("SlotT", bound=Slot)


class SlotExecutor(Executor, Generic[SlotT]):
    """One worker per device with a FIFO of at most `max_in_flight` batches; the head runs.

    Model of time: a worker that has not loaded within `startup_timeout_s` is replaced; a
    head past its timeout comes back TIMEOUT (what waits behind it LOST, uncharged) and the
    worker gets no more work; unless it answers within `kill_grace_s` it is replaced. A
    replaced worker's batches come back LOST; after `max_restarts` replacements the device
    is retired. Subclasses start (`_spawn`), stop (`_kill`) and read their workers; `worker`
    names them in reasons ("worker", "actor"). `SlotT` is the subclass's own `Slot`, holding
    its worker's handles.
    """

    worker = "worker"

    def __init__(self, *, max_in_flight: int, max_restarts: int, startup_timeout_s: float, kill_grace_s: float):
        super().__init__()
        self.max_in_flight = max(1, int(max_in_flight))
        self.max_restarts = int(max_restarts)
        self.startup_timeout_s = float(startup_timeout_s)
        self.kill_grace_s = float(kill_grace_s)
        self.slots: dict[str, SlotT] = {}
        self._pending: list[Outcome] = []  # outcomes the next `collect` returns

    @abstractmethod
    def _spawn(self, device: Device) -> None:
        """Start a worker for `device` and put its slot in `self.slots`."""

    @abstractmethod
    def _kill(self, slot: SlotT) -> None:
        """Stop the slot's worker now."""

    def free_slots(self, device: str) -> int:
        slot = self.slots.get(device)
        if slot is None or slot.silent_since is not None:
            return 0
        return self.max_in_flight - len(slot.queue)

    def in_flight(self) -> int:
        return sum(len(s.queue) for s in self.slots.values()) + len(self._pending)

    def _queue(self, slot: SlotT, ticket: int, timeout_s: float | None, handle: Any = None) -> None:
        """A batch sent to the slot's worker; it starts running now if it is the head."""
        if not slot.queue and slot.ready:
            slot.head_since = time.monotonic()
        slot.queue.append((ticket, timeout_s, handle))

    def _ready(self, slot: SlotT, load_s: float | None = None, at: float | None = None) -> None:
        """The slot's worker has loaded its model (`load_s`: the worker's own measure of that;
        `at`: the time.time() it was ready, from a worker on this machine, else now). A driver
        busy reading its input hears of it late; `at` keeps the phases true to the worker."""
        slot.ready = True
        slot.head_since = time.monotonic() if slot.queue else None
        name = slot.device.name
        if name not in self.ready_at:
            now = time.time()
            at = now if at is None else min(at, now)
            self.ready_at[name] = at
            took = time.monotonic() - slot.started - (now - at)
            self.load_s[name] = round(took if load_s is None else load_s, 3)
            self.worker_start_s[name] = round(max(0.0, took - self.load_s[name]), 3)

    @staticmethod
    def _answered(slot: Slot) -> None:
        """The worker answered for its head (the head already popped): slow, not hung."""
        slot.silent_since = None
        slot.head_since = time.monotonic() if slot.queue else None

    def _replace(self, slot: SlotT, reason: str) -> None:
        """Kill the slot's worker, hand its batches back as LOST, start another (or retire)."""
        name = slot.device.name
        self._kill(slot)
        for i, (ticket, _, _) in enumerate(slot.queue):  # the head was running; the rest only waited
            self._pending.append(Outcome(ticket, name, Status.LOST, reason=reason, charged=i == 0 and slot.ready))
        slot.queue.clear()
        if self.restarts[name] >= self.max_restarts:
            self.retired[name] = f"device {name} retired after {self.restarts[name]} restarts; last: {reason}"
            del self.slots[name]
            return
        self.restarts[name] += 1
        self._spawn(slot.device)

    def _due(self, slot: SlotT) -> float | None:
        """The next moment this slot needs attention without an answer."""
        if not slot.ready:
            return slot.started + self.startup_timeout_s
        if slot.silent_since is not None:
            return slot.silent_since + self.kill_grace_s
        if slot.queue and slot.head_since is not None and slot.queue[0][1] is not None:
            return slot.head_since + slot.queue[0][1]
        return None

    def _check_time(self, slot: SlotT, now: float) -> None:
        name, who = slot.device.name, self.worker
        if self.slots.get(name) is not slot:
            return
        if not slot.ready and now > slot.started + self.startup_timeout_s:
            self._replace(slot, f"{who} of {name} did not load within {self.startup_timeout_s:.0f} s")
        elif slot.silent_since is not None and now > slot.silent_since + self.kill_grace_s:
            self._replace(slot, f"{who} of {name} hung: no answer {self.kill_grace_s:.0f} s after a timeout")
        elif slot.silent_since is None and slot.queue and slot.head_since is not None:
            ticket, timeout_s, _ = slot.queue[0]
            if timeout_s is not None and now > slot.head_since + timeout_s:
                for t, _, _ in slot.queue:  # the head timed out; what waits behind it is re-routed too
                    why = (
                        f"no answer within {timeout_s:.1f} s on {name}"
                        if t == ticket
                        else f"re-routed: queued behind a batch that timed out on {name}"
                    )
                    self._pending.append(
                        Outcome(
                            t, name, Status.TIMEOUT if t == ticket else Status.LOST, reason=why, charged=t == ticket
                        )
                    )
                slot.silent_since = now
