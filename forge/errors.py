"""The one exception type users see: a clear, one-line message with the fix."""


class ForgeError(Exception):
    """Bad input or configuration. The message names the key or item and the fix."""
