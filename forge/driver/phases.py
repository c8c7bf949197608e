"""Where a run's time went (report.json's `phases`), from the run's timings and its executor's."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from forge.executors import Executor


def phases(
    timings: dict[str, float],
    executor: Executor,
    spec: Any,  # the run's `forge.driver.engine.RunSpec` (not imported: the engine imports this module)
    began: float,
) -> dict[str, float | bool | None]:
    """Where the time went, in seconds from the command's start (spans) or summed (totals). The
    start is `spec.started_at` (the CLI's process start), else when the config was composed,
    else `execute`'s start `began`:

    - start_s: to `execute` (imports, config composition, the function's set-up): compose_s and
      setup_s together;
    - compose_s: to the composed config (the interpreter, the CLI's imports, Hydra composing the
      config and setting up its job); 0 where the command's start is not known;
    - setup_s: from the composed config to `execute` (`build_spec`: the schema check, the function
      built from its config, its tokenizer and model config read, the capability check, the
      devices); None where the CLI did not say when it composed;
    - open_s: the run directory (lock, fingerprint), the packer and the sink, to the loop's start;
    - worker_start_s: the slowest device's worker start, from its process being asked for
      to its model load's start (the process executor's fork server finishing its imports
      of torch, transformers and the function's modules, the fork, the worker's own imports);
    - worker_load_s: the slowest device's model load, as its worker measured it;
    - worker_ready_s: until every device's worker was ready (by the worker's own clock where it
      runs on this machine, not when the driver, perhaps still reading input, heard of it);
    - first_batch_s: until the first batch's result was committed;
    - drain_s: from the last batch routed to the end;
    - read_tokenize_s and commit_s: totals of reading and tokenizing input (on its own thread,
      `forge.core.read_ahead`), and of committing results (both overlap the other phases);
    - read_wait_s: the total the run waited for its input (what reading ahead did not hide);
    - warm_start: `spec.warm_start`, whether a `forge server` ran the command (torch and
      transformers imported before it started; `forge.cli.server`).
    """
    end = time.time()
    composed = spec.composed_at
    t0 = spec.started_at or composed or began
    at = lambda key: None if key not in timings else round(timings[key] - t0, 3)  # noqa: E731
    return {
        "start_s": round(began - t0, 3),
        "compose_s": None if composed is None else round(composed - t0, 3),
        "setup_s": None if composed is None else round(began - composed, 3),
        "open_s": round(timings.get("loop_at", end) - began, 3),
        "worker_start_s": max(executor.worker_start_s.values(), default=None),
        "worker_load_s": max(executor.load_s.values(), default=None),
        "worker_ready_s": round(max(executor.ready_at.values()) - t0, 3) if executor.ready_at else None,
        "first_batch_s": at("first_batch_at"),
        "drain_s": round(end - timings["last_routed_at"], 3) if "last_routed_at" in timings else None,
        "read_tokenize_s": round(timings.get("read_tokenize_s", 0.0), 3),
        "read_wait_s": round(timings.get("read_wait_s", 0.0), 3),
        "commit_s": round(timings.get("commit_s", 0.0), 3),
        "total_s": round(end - t0, 3),
        "warm_start": spec.warm_start,
    }
