"""A whole third-party tracker: every figure Forge logs, one JSON line each, in the run directory."""

import json
from dataclasses import dataclass

from forge.tracker import Tracker, TrackerSettings


@dataclass
class JsonlSettings(TrackerSettings):
    file: str = "figures.jsonl"  # under <run dir>/trackers/jsonl/


class JsonlTracker(Tracker):
    config_schema = JsonlSettings

    def start(self, run):
        self.out = open(run.folder / run.settings.file, "a")  # a resumed run appends
        self._write({"params": run.params, "resumed": run.resume_id is not None})
        return run.run_name  # kept in <run dir>/trackers/ids.json, handed back as resume_id

    def log(self, step, figures):
        self._write({"step": step, **figures})

    def finish(self, step, totals, status):
        self._write({"step": step, "totals": dict(totals), "status": status})
        self.out.close()

    def _write(self, record):
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()
