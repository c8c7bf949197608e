"""Reading ahead (forge.core.read_ahead): the same records in the same order, an error where the
records stop, bounded memory, and a thread that ends when the run does or abandons it."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from forge.core.read_ahead import ReadAhead


def _threads() -> int:
    return sum(t.name == "forge-read-ahead" for t in threading.enumerate())


def _wait_for(cond, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


@pytest.mark.parametrize("n", [0, 1, 5, 256, 257, 1000])
def test_the_same_records_in_the_same_order(n):
    ahead = ReadAhead(iter(range(n)), ahead=64, chunk=16)
    assert list(ahead) == list(range(n))
    assert list(ahead) == []  # exhausted stays exhausted
    ahead.close()


def test_an_error_is_raised_where_the_records_stop():
    def records():
        yield from range(40)
        raise ValueError("row 41: not JSON")

    ahead = ReadAhead(records(), ahead=16, chunk=4)
    got = [next(ahead) for _ in range(40)]
    assert got == list(range(40))
    with pytest.raises(ValueError, match="row 41"):
        next(ahead)
    with pytest.raises(StopIteration):
        next(ahead)
    ahead.close()


def test_it_reads_at_most_ahead_records_before_the_consumer_and_hides_the_reading():
    read = []

    def records():
        for i in range(10_000):
            read.append(i)
            yield i

    ahead = ReadAhead(records(), ahead=64, chunk=16)
    assert _wait_for(lambda: len(read) >= 64)
    time.sleep(0.1)
    assert 64 <= len(read) <= 64 + 2 * 16  # the queue's chunks, the one being read and the one waiting
    assert next(ahead) == 0 and ahead.busy_s > 0
    ahead.close()


def test_close_ends_the_thread_and_closes_the_records():
    closed = threading.Event()

    def records():
        try:
            yield from range(10_000)
        finally:
            closed.set()

    before = _threads()
    ahead = ReadAhead(records(), ahead=32, chunk=8)
    next(ahead)
    ahead.close()
    assert closed.wait(5) and _wait_for(lambda: _threads() == before)


def test_an_abandoned_reader_stops_its_thread():
    before = _threads()
    ahead = ReadAhead(iter(range(10_000)), ahead=32, chunk=8)
    next(ahead)
    del ahead
    gc.collect()
    assert _wait_for(lambda: _threads() == before)
