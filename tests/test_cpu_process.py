"""A CPU device's process keeps the memory it frees (forge.executors.cpu_process): blocks up to
32 MiB come from the heap, not from a fresh mmap whose pages fault in again every step."""

from __future__ import annotations

import subprocess
import sys

import pytest

from forge.executors import cpu_process

PROBE = """
import ctypes, ctypes.util, sys
from forge.executors import cpu_process

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                             "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
if not hasattr(libc, "mallinfo2"):
    print("skip"); sys.exit()
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
if sys.argv[1] == "keep":
    assert cpu_process.keep_freed_memory() is True
mapped = []
for size in (24 * 2**20, 1024 * 2**20):  # an activation, and a block larger than the heap can grow by
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(size)
    mapped.append(libc.mallinfo2().hblkhd - before)
    libc.free(block)
print(*mapped)
"""


def _mapped(mode: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True).stdout
    if out.strip() == "skip":
        pytest.skip("not glibc 2.33 or later: no mallinfo2 to read the allocator's state")
    return [int(x) for x in out.split()]


def test_blocks_up_to_32_mib_come_from_the_heap_once_it_is_set():
    """In a fresh process, so the allocator's state is its default."""
    assert _mapped("default")[0] >= 24 * 2**20  # glibc's default: a fresh mmap
    heap, big = _mapped("keep")
    assert heap == 0  # from the heap, whose pages stay faulted in
    assert big >= 1024 * 2**20  # the probe sees an mmap where one still happens


def test_a_c_library_without_mallopt_changes_nothing(monkeypatch):
    from forge.vocab import libc

    monkeypatch.setattr(libc, "_libc", lambda: object())  # a C library without mallopt (macOS, musl)
    assert cpu_process.keep_freed_memory() is False
    monkeypatch.setattr(libc, "_libc", lambda: None)  # none found
    assert cpu_process.keep_freed_memory() is False
