"""trackers=wandb: a Weights & Biases run, offline by default: a run folder under
<run dir>/trackers/wandb that `wandb sync` uploads later. wandb's own mode setting
(`trackers.wandb.mode`, else the WANDB_MODE environment variable) makes it online.

The config goes in as the run's config (dotted keys); each batch's figures are logged with
`tokens/completed` as their x-axis (`define_metric`), so a resumed run's points continue its
line; the totals and the status go into the run's summary (`final/...`, `status`). System
metrics, console capture and the scans of installed packages, git and code are off: the run's
figures are Forge's own (and the scans cost the run CPU time).
"""

from __future__ import annotations

import os
import uuid

from forge.config.trackers import WandbSettings
from forge.tracker import Tracker, TrackerRun

STEP = "tokens/completed"


class WandbTracker(Tracker):
    config_schema = WandbSettings
    requires = "forge-tokens[wandb]"

    def start(self, run: TrackerRun) -> str | None:
        import wandb

        s = run.settings
        mode = s.mode or os.environ.get("WANDB_MODE") or "offline"
        settings = wandb.Settings(  # Forge's figures only: no system metrics, console, pip freeze, git or code scans
            console="off",
            silent=True,
            x_disable_stats=True,
            x_disable_machine_info=True,
            x_disable_meta=True,
            x_save_requirements=False,
            disable_git=True,
            disable_code=True,
            disable_job_creation=True,
        )
        self.run = wandb.init(
            project=s.project,
            entity=s.entity,
            name=run.run_name,
            dir=str(run.folder),
            id=run.resume_id or uuid.uuid4().hex[:12],
            resume="allow",
            mode=mode,
            config=run.params if run.resume_id is None else None,
            settings=settings,
            reinit="create_new",
        )
        self.run.define_metric(STEP)
        self.run.define_metric("*", step_metric=STEP)
        return self.run.id

    def log(self, step, figures) -> None:
        self.run.log({**figures, STEP: step})

    def finish(self, step, totals, status) -> None:
        import wandb

        for key, value in totals.items():
            self.run.summary[f"final/{key}"] = value
        self.run.summary["status"] = status
        self.run.finish(exit_code=0 if status == "finished" else 1)
        wandb.teardown()  # the wandb-core service process ends with the run
