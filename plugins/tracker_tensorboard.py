"""trackers=tensorboard: event files, by default under <run dir>/trackers/tensorboard.

The config goes in as hyperparameters (TensorBoard's HPARAMS tab) and as one text summary,
`config`; each batch's figures as scalars at a step counted in tokens; at the end the
totals as scalars under `final/` and the status as a text summary, `final/status`. A resumed
run writes a new event file into the same folder, which TensorBoard reads as one run.
"""

from __future__ import annotations

import json
from pathlib import Path

from forge.config.trackers import TensorBoardSettings
from forge.tracker import Tracker, TrackerRun


class TensorBoardTracker(Tracker):
    config_schema = TensorBoardSettings
    requires = "forge-tokens[tensorboard]"

    def start(self, run: TrackerRun) -> str | None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
        from torch.utils.tensorboard.summary import hparams

        log_dir = Path(run.settings.log_dir) if run.settings.log_dir else run.folder
        self.writer = SummaryWriter(log_dir=str(log_dir), flush_secs=30)
        if run.resume_id is None:  # hyperparameters once per tracker run
            exp, ssi, sei = hparams(run.params, {})
            for summary in (exp, ssi, sei):
                self.writer.file_writer.add_summary(summary)
            self.writer.add_text("config", "```\n" + json.dumps(run.params, indent=1) + "\n```")
        return str(log_dir)

    def log(self, step, figures) -> None:
        for key, value in figures.items():
            self.writer.add_scalar(key, value, step)

    def finish(self, step, totals, status) -> None:
        for key, value in totals.items():
            self.writer.add_scalar(f"final/{key}", value, step)
        self.writer.add_text("final/status", status, step)
        self.writer.close()
