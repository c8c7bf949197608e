"""Reading ahead: a function's records are read and tokenized on a thread while the run works.

Model: `ReadAhead(records)` iterates over the same records in the same order, but a thread
advances `records` up to `ahead` records in front of the consumer, a chunk at a time. The
records cross a bounded queue, so memory stays bounded however large the input is. Reading
and tokenizing thus overlap the run's own set-up, the worker's start, and later the batches in
flight. A fast tokenizer releases the GIL while it encodes. What it cannot hide is a refill
that needs more than was read ahead: the scheduler's first refill takes the whole input when
it fits the window. At 8,000 `score` requests, read in 3.7 s, the first batch came at 6.9 s
instead of 7.1 s. With `batching.window=1024`, the run's wait for its input fell from about
4.9 s to 0.2-0.4 s. On a 2-core CPU, though, the worker's threads took that time back; a
device that leaves the CPU free should not.

What the consumer sees does not change: the same records in the same order. An exception the
reader raises is raised by `__next__` where the records stop. Nothing is counted here:
admission (`forge.core.admission`) counts every record as it takes it, on the run's thread.
So a run that stops early has read ahead, but never received, what it did not take. `close()`
stops the thread and closes `records` (a generator's files) on it; `busy_s` is the thread's
time spent reading.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any

#: records per hand-over (one queue operation), and most records read ahead of the consumer
CHUNK = 256
AHEAD = 8192


class _Raised:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


_END = object()


class _Reader:
    """The thread's side: it holds no reference to the `ReadAhead`, so an abandoned one is
    collected, and its `__del__` stops the thread."""

    def __init__(self, ahead: int, chunk: int):
        self.chunk = max(1, chunk)
        self.queue: queue.Queue = queue.Queue(maxsize=max(1, ahead // self.chunk))
        self.stop = threading.Event()
        self.busy_s = 0.0

    def run(self, records: Iterable[Any]) -> None:
        source = iter(records)
        try:
            while not self.stop.is_set():
                t0 = time.perf_counter()
                part = list(islice(source, self.chunk))
                self.busy_s += time.perf_counter() - t0
                if (part and not self.put(part)) or len(part) < self.chunk:
                    break
            self.put(_END)
        except BaseException as exc:  # noqa: BLE001 - the consumer raises it where the records stop
            self.put(_Raised(exc))
        finally:
            close = getattr(source, "close", None)  # a generator's own clean-up (its open files)
            if close is not None:
                close()

    def put(self, what: Any) -> bool:
        """Hand `what` over unless the consumer has closed; False once it has."""
        while not self.stop.is_set():
            try:
                self.queue.put(what, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False


class ReadAhead:
    """`records`, advanced on a thread up to `ahead` records before the consumer."""

    def __init__(self, records: Iterable[Any], ahead: int = AHEAD, chunk: int = CHUNK):
        self._reader = _Reader(ahead, chunk)
        self._current: Iterator[Any] = iter(())
        self._done = False
        self._thread = threading.Thread(target=self._reader.run, args=(records,), name="forge-read-ahead", daemon=True)
        self._thread.start()

    @property
    def busy_s(self) -> float:
        """The thread's time reading (and tokenizing) so far."""
        return self._reader.busy_s

    def __iter__(self) -> ReadAhead:
        return self

    def __next__(self) -> Any:
        for record in self._current:
            return record
        if self._done:
            raise StopIteration
        got = self._reader.queue.get()
        if got is _END or isinstance(got, _Raised):
            self._done = True
            if got is _END:
                raise StopIteration
            raise got.exc
        self._current = iter(got)
        return next(self._current)

    def close(self) -> None:
        """Stop reading; the thread ends (and closes the records) within one chunk's read."""
        self._stop()
        self._thread.join(timeout=5.0)

    def _stop(self) -> None:
        self._done = True
        self._reader.stop.set()
        while True:  # free a reader blocked on a full queue at once
            try:
                self._reader.queue.get_nowait()
            except queue.Empty:
                break

    def __del__(self) -> None:  # abandoned without close(): the thread must not wait forever
        self._stop()
