"""trackers=trackio: a trackio run in trackio's local SQLite store, by default
<run dir>/trackers/trackio (`trackio show` charts it; TRACKIO_DIR, when set, names the store).

The config goes in as the run's config; each batch's figures are logged at a step counted in
tokens; at the end the totals under `final/` and the status (`final/status`, its text) at the
last step. The run is named after the run directory, and a resumed run continues it by name.
trackio reads its store's folder once per process, at import (from TRACKIO_DIR): the tracker sets
it before that, and points trackio's modules at the store of each later run of the process (a sweep).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

from forge.config.trackers import TrackioSettings
from forge.tracker import Tracker, TrackerRun

USER_DIR = os.environ.get("TRACKIO_DIR")  # the user's store, when they name one


class TrackioTracker(Tracker):
    config_schema = TrackioSettings
    requires = "forge-tokens[trackio]"

    def start(self, run: TrackerRun) -> str | None:
        store = Path(run.settings.dir or USER_DIR or run.folder)
        os.environ["TRACKIO_DIR"] = str(store)  # read at trackio's import: the first run's store
        import trackio

        for name, module in sys.modules.copy().items():  # a copy: other trackers' threads import meanwhile
            if not name.startswith("trackio"):
                continue
            if isinstance(getattr(module, "TRACKIO_DIR", None), Path):  # a later run of this process: its own store
                module.TRACKIO_DIR = store

        with contextlib.redirect_stdout(io.StringIO()):  # its banner and dashboard instructions
            self.run = trackio.init(
                project=run.settings.project,
                name=run.resume_id or run.run_name,
                config=run.params if run.resume_id is None else None,
                resume="allow",
                embed=False,
                auto_log_cpu=False,
                auto_log_gpu=False,
            )
        return self.run.name

    def log(self, step, figures) -> None:
        self.run.log(dict(figures), step=step)

    def finish(self, step, totals, status) -> None:
        self.run.log({**{f"final/{k}": v for k, v in totals.items()}, "final/status": status}, step=step)
        with contextlib.redirect_stdout(io.StringIO()):
            self.run.finish()
