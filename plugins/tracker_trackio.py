"""trackers=trackio: a trackio run in trackio's local SQLite store, by default
<run dir>/trackers/trackio (`trackio show` charts it; TRACKIO_DIR, when set, names the store).

The config goes in as the run's config; each batch's figures are logged at a step counted in
tokens; at the end the totals under `final/` and the status (`final/status`, its text) at the
last step. The run is named after the run directory, and a resumed run continues it by name.
trackio reads its store's folder once per process (at import): the folder is set before that,
so a second run in the same process logs where the first one did.
"""

from __future__ import annotations

import contextlib
import io
import os

from forge.config.trackers import TrackioSettings
from forge.tracker import Tracker, TrackerRun


class TrackioTracker(Tracker):
    config_schema = TrackioSettings
    requires = "forge-tokens[trackio]"

    def start(self, run: TrackerRun) -> str | None:
        os.environ.setdefault("TRACKIO_DIR", str(run.settings.dir or run.folder))
        import trackio

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
