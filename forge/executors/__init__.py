"""Executors: where batches run. The run loop submits batches and collects outcomes.

* `InProcessExecutor`: workers in the calling process, one batch at a time (debugging).
* `ProcessExecutor`: one worker process per device; crashes, hangs and out-of-memory
  errors come back as outcomes, and dead workers are replaced.
* `SimExecutor`: no model; batches complete in virtual time (`forge plan`).
"""

from forge.executors.base import Executor, Outcome, Status, classify_error
from forge.executors.inprocess import InProcessExecutor
from forge.executors.sim import SimExecutor

__all__ = ["Executor", "InProcessExecutor", "Outcome", "SimExecutor", "Status", "classify_error"]
