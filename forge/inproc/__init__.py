"""Forge in the calling process: `forge.run` and `forge.Session` (docs/python-api.md).

`session.py` composes a call's config as `forge run` does and runs it here, keeping the models
its runs loaded; `result.py` reads a run back as tables and tensors; `functions.py` registers a
function class handed in by the caller."""

from forge.inproc.result import Result
from forge.inproc.session import Session, run

__all__ = ["Result", "Session", "run"]
