"""The one exception type users see: a clear, one-line message with the fix."""

from typing import Any


class ForgeError(Exception):
    """Bad input or configuration. The message names the key or item and the fix."""

    #: raised by `forge.run` / `Session.run` for a run that stopped (too many failures, a full disk):
    #: what it committed, as a `forge.Result` (its failures and skipped rows included); None otherwise
    result: Any = None


class LockLost(OSError):
    """The run directory is no longer this run's (its lock file removed or replaced, its lease
    taken, a later session started): nothing more may be written or deleted there."""
