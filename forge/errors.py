"""The one exception type users see: a clear, one-line message with the fix."""


class ForgeError(Exception):
    """Bad input or configuration. The message names the key or item and the fix."""


class LockLost(OSError):
    """The run directory is no longer this run's (its lock file removed or replaced, its lease
    taken, a later session started): nothing more may be written or deleted there."""
