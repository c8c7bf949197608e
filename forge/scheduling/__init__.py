"""The scheduler's parts, each owning its state (`forge.core.scheduler.Scheduler` composes them).

* `PrefixCacheModel`: which prefixes each device's cache holds, as predicted.
* `RetryQueue`: batches that came back from a failure, run first, and how often an item
  was lost with its worker.
* `Balancer`: unequal devices' rates, the work in flight on each, and the fair share near
  the end of the backlog.
* `DeviceBudgets`: each device as known now, its limits and memory budget lowered after an
  out-of-memory error.
"""

from forge.scheduling.balancer import Balancer, Share
from forge.scheduling.budgets import DeviceBudgets
from forge.scheduling.prefix_cache import PrefixCacheModel
from forge.scheduling.retry_queue import RetryQueue

__all__ = ["Balancer", "DeviceBudgets", "PrefixCacheModel", "RetryQueue", "Share"]
