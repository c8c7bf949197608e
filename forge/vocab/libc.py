"""The C library's own functions that Forge calls (glibc's allocator controls), loaded in one place.

`forge.executors.cpu_process` sets the allocator to keep what a worker frees (`mallopt`);
`forge.runtime.decoder.heap` hands a large free back to the system (`malloc_trim`). On a C library
without them (macOS, musl) `libc_function` answers None and each does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any


@functools.cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def libc_function(name: str, argtypes: tuple[Any, ...], restype: Any) -> Any:
    """The C library's function `name` with its argument and result types, or None where it has none."""
    lib = _libc()
    fn = getattr(lib, name, None) if lib is not None else None
    if fn is not None:
        fn.argtypes, fn.restype = argtypes, restype
    return fn
