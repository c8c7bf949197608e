"""Freed memory handed back to the system after the decoder's large, rare frees.

Model: a worker on a CPU keeps what its forwards free in its heap (`runtime.keep_freed_memory`,
`forge.executors.cpu_process`): a step's transients are reused by the next step instead of being
faulted in again. But a prefill's caches and transients, freed once its prompts have rows, can be
hundreds of MiB that the decode steps after it never reuse whole: kept, they add to the process's
peak resident memory (measured on 200 long prompts, 32 new tokens: 230 MiB free in the heap at the
first decode step; measured on branch i46rss, before the port onto the shared `shared_prefix`).
`release_free_heap` asks glibc's `malloc_trim` to return the heap's free pages; the decoder calls
it after the shared prefixes are stored, after each block's admission, after a rows resize
(`forge.runtime.decoder.rows_kv`) and after each layer of a restack of prefixes (a few times a
run, each a few ms). On a C library without `malloc_trim` (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes

from forge.vocab.libc import libc_function


def release_free_heap() -> bool:
    """Return the heap's free pages to the system (glibc); False where there is no `malloc_trim`."""
    trim = libc_function("malloc_trim", (ctypes.c_size_t,), ctypes.c_int)
    if trim is None:
        return False
    trim(0)
    return True
