"""A process that runs a CPU device: its torch threads, and an allocator that keeps what it frees.

Model: a forward on a CPU allocates its activations afresh at every step, and in a batch
run every step has another shape. glibc's malloc serves blocks above its mmap threshold with
mmap and hands them back with munmap. That threshold starts at 128 KiB and rises, up to
32 MiB, only as blocks that size are freed. It also trims the top of its heap back to the
system. So the next step's tensors fault their pages in again, each zeroed by the kernel.

`keep_freed_memory()` sets, through glibc's `mallopt`:
- the mmap threshold to its 64-bit maximum (32 MiB);
- the trim threshold to 2 GiB;
- the top pad to 256 MiB.

Freed blocks are then reused from the heap. Measured on the embedded model with 2 threads, over
32 forwards of the shapes a run makes (16 x 400-490 and 20-300 x 7-12): 24,400-25,800 slots/s
before and 29,200-29,400 after. End to end (`forge run`, embedded model, interleaved, 2 rounds),
the worker's busy time fell from 4.20-4.42 to 3.39 s on 200 `score` questions and from
1.68-1.86 to 1.36-1.38 s on 3,000 `probe_gen` rows.

The cost: the worker's resident memory stays near its peak instead of falling between steps.
On 200 `score` questions in one process (`runtime.executor=inprocess`), the peak rose from
651-684 to 744-756 MiB. On a C library without `mallopt` (macOS, musl) nothing changes.
`runtime.keep_freed_memory=false` turns it off.
"""

from __future__ import annotations

import ctypes

from forge.vocab.libc import libc_function

#: (mallopt parameter from glibc's malloc.h, the environment variable glibc reads it from, value)
SETTINGS = (
    (-3, "MALLOC_MMAP_THRESHOLD_", 32 * 2**20),  # M_MMAP_THRESHOLD: its 64-bit maximum
    (-1, "MALLOC_TRIM_THRESHOLD_", 2**31 - 1),  # M_TRIM_THRESHOLD
    (-2, "MALLOC_TOP_PAD_", 256 * 2**20),  # M_TOP_PAD
)
#: the same settings as environment variables, which glibc reads when a process starts (another tool)
ENV = {name: str(value) for _, name, value in SETTINGS}


def keep_freed_memory() -> bool:
    """Keep freed blocks in this process's heap (glibc); False where the C library has no
    `mallopt` or refuses a setting."""
    mallopt = libc_function("mallopt", (ctypes.c_int, ctypes.c_int), ctypes.c_int)
    if mallopt is None:
        return False
    return all(mallopt(param, value) == 1 for param, _, value in SETTINGS)


def run_cpu_device(threads: int, keep: bool) -> None:
    """Set this process up to run a CPU device: `threads` torch threads, and with `keep`
    (`runtime.keep_freed_memory`) the allocator above."""
    import torch

    torch.set_num_threads(threads)
    if keep:
        keep_freed_memory()
