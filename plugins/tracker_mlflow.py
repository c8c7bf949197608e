"""trackers=mlflow: an MLflow run, by default in a file store inside the run directory
(`file:<run dir>/trackers/mlflow`); `trackers.mlflow.uri` names any other tracking URI.

The config goes in as the run's parameters (dotted keys), each batch's figures as metrics at a
step counted in tokens, the totals as metrics under `final/`, and the status as the run's end
status (finished: FINISHED, interrupted: KILLED, else FAILED) and as the tag `forge.status`.
MLflow 3 keeps its file store in maintenance mode and refuses it unless MLFLOW_ALLOW_FILE_STORE
is set: this tracker sets it for the default store only. Telemetry is off for it too.
"""

from __future__ import annotations

import os
import time

from forge.config.trackers import MlflowSettings
from forge.tracker import Tracker, TrackerRun

STATUS = {"finished": "FINISHED", "interrupted": "KILLED"}  # anything else: FAILED
PARAMS_PER_CALL = 100  # MLflow's limit on parameters in one log_batch
MAX_PARAM_CHARS = 6000  # and on a value's length


class MlflowTracker(Tracker):
    config_schema = MlflowSettings
    requires = "forge-tokens[mlflow]"

    def start(self, run: TrackerRun) -> str | None:
        uri = run.settings.uri
        if uri is None:  # offline: the file store inside the run directory, and no telemetry
            uri = run.folder.resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = client = MlflowClient(tracking_uri=uri)
        if run.resume_id is not None:
            self.run_id = run.resume_id
            client.update_run(self.run_id, status="RUNNING")
            return self.run_id
        experiment = client.get_experiment_by_name(run.settings.project)
        eid = experiment.experiment_id if experiment else client.create_experiment(run.settings.project)
        self.run_id = client.create_run(eid, run_name=run.run_name).info.run_id
        params = [Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in run.params.items()]
        for i in range(0, len(params), PARAMS_PER_CALL):
            client.log_batch(self.run_id, params=params[i : i + PARAMS_PER_CALL])
        return self.run_id

    def _metrics(self, step, figures, prefix=""):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        return [Metric(f"{prefix}{k}", float(v), now, int(step)) for k, v in figures.items()]

    def log(self, step, figures) -> None:
        self.client.log_batch(self.run_id, metrics=self._metrics(step, figures))

    def finish(self, step, totals, status) -> None:
        self.client.log_batch(self.run_id, metrics=self._metrics(step, totals, "final/"))
        self.client.set_tag(self.run_id, "forge.status", status)
        self.client.set_terminated(self.run_id, STATUS.get(status, "FAILED"))
