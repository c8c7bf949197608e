"""A process by its pid, as several floors ask of one (a server, a worker's leftovers)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists (one of another user's counts: it cannot be signalled, but it is there)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def resident_bytes() -> int:
    """The resident memory (RSS) this process holds now (0 where the OS does not say: Linux's /proc)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def resident_peak_bytes() -> int:
    """The most resident memory (RSS) this process has held since it started, as its OS counts it
    (getrusage's ru_maxrss: kilobytes on Linux, bytes on macOS). A process forked from another
    starts its count afresh."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
