"""What a tracker author imports: the `Tracker` base class and what Forge hands it.

A tracker logs one run's figures where a team charts them (TensorBoard, MLflow, Weights &
Biases, trackio, or a tracker of your own). Forge's built-in tracking plugin
(`forge.builtin.tracking`) counts in the driver process's accounting hooks, where the ledger
counts, and drives every tracker the config selects in a process of their own, each on a thread
of its own, so a slow tracker never holds a batch up (the class is imported there: it must be
importable by its module's name):

1. `start(run)` once (the library's import belongs here, not at module import): open the
   tracker's run, or continue the one `run.resume_id` names, log `run.params`; return the id to
   keep in the run directory (`trackers/ids.json`), so a resumed Forge run continues it;
2. `log(step, figures)` after each completed batch, `step` counted in tokens completed;
3. `finish(totals, status)` once at the end: report.json's totals and how the run ended.

An exception from any of them is one warning line: the run goes on without that tracker. An
`ImportError` from `start` is said as the package to install (`requires`).

Register a tracker with the `forge_trackers` hook (`forge/hookspecs.py`), as the built-in ones
do in `plugins/trackers.py`, and make it selectable with a config option
`trackers/<name>.yaml`; docs/trackers.md walks through a whole one.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from forge.config.trackers import TrackerSettings

__all__ = ["Tracker", "TrackerRun", "TrackerSettings", "flat_params"]  # TrackerSettings: a settings schema's base


@dataclass
class TrackerRun:
    """What a tracker gets at its start."""

    name: str  # the tracker's name (what `trackers=[...]` selected)
    folder: Path  # its own folder inside the run directory, <run dir>/trackers/<name> (made for it)
    settings: Any  # its settings: an instance of its `config_schema` (`trackers.<name>.*`)
    run_name: str  # the run's name: settings.run_name, else the run directory's name
    params: dict[str, str | int | float | bool] = field(default_factory=dict)  # the resolved config, flat
    resume_id: str | None = None  # the id its `start` returned in an earlier session of this run


class Tracker(ABC):
    """One tracker's connection for one Forge run (one instance per run)."""

    config_schema: ClassVar[type] = TrackerSettings  # the keys `trackers.<name>.*` and their defaults
    requires: ClassVar[str] = ""  # the pip requirement it imports, named in the warning when missing

    @abstractmethod
    def start(self, run: TrackerRun) -> str | None:
        """Open (or, with `run.resume_id`, continue) the tracker's run and log `run.params`;
        return the id to keep for a resume (None: nothing to keep)."""

    @abstractmethod
    def log(self, step: int, figures: Mapping[str, float]) -> None:
        """Log one completed batch's figures at `step` (tokens completed so far)."""

    @abstractmethod
    def finish(self, step: int, totals: Mapping[str, float], status: str) -> None:
        """Log the run's totals (report.json's, flat: `items/completed`, `tokens/padding`, ...)
        and its status (`finished`, `interrupted`, `stopped`, `stalled`), and close."""


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str | int | float | bool]:
    """A nested config as dotted keys with scalar values (lists and nulls as JSON text): the
    parameters a tracker logs."""
    out: dict[str, str | int | float | bool] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, f"{name}."))
        elif isinstance(value, (str, int, float, bool)):
            out[name] = value
        else:
            out[name] = json.dumps(value, default=str)
    return out
