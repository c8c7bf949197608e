"""The trackers' settings: the keys `trackers.<name>.*` and their defaults, one dataclass per
built-in tracker (a third-party tracker's `config_schema` extends `TrackerSettings` the same way).

A tracker is selected by naming it, `trackers=[tensorboard,mlflow]` (a Hydra group with several
options chosen, `conf/trackers/<name>.yaml`, each extending its schema below), and set by its keys,
`trackers.mlflow.uri=http://host:5000`. Every tracker is offline by default: what it writes stays
inside the run directory, under `trackers/<name>/` (docs/trackers.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from forge.config.checks import CHECK, one_of, show
from forge.errors import ForgeError


@dataclass
class TrackerSettings:
    """Keys every tracker takes."""

    project: str = "forge"  # the project (experiment) the run is logged under
    run_name: str | None = None  # the run's name in the tracker; null: the run directory's name


@dataclass
class TensorBoardSettings(TrackerSettings):
    """trackers=tensorboard: event files (needs `pip install 'forge-tokens[tensorboard]'`)."""

    log_dir: str | None = None  # where the event files go; null: <run dir>/trackers/tensorboard


@dataclass
class MlflowSettings(TrackerSettings):
    """trackers=mlflow: an MLflow run (needs `pip install 'forge-tokens[mlflow]'`)."""

    # the tracking URI (http://host:5000, sqlite:///mlflow.db, databricks); null: a file store
    # inside the run directory, file:<run dir>/trackers/mlflow
    uri: str | None = None


@dataclass
class WandbSettings(TrackerSettings):
    """trackers=wandb: a Weights & Biases run (needs `pip install 'forge-tokens[wandb]'`)."""

    # wandb's mode: offline (a run folder under <run dir>/trackers/wandb, `wandb sync` uploads it),
    # online, or disabled; null: the WANDB_MODE environment variable when set, else offline
    mode: str | None = one_of(None, "offline", "online", "disabled")
    entity: str | None = None  # the W&B entity (user or team); null: wandb's default


@dataclass
class TrackioSettings(TrackerSettings):
    """trackers=trackio: a trackio run in its local SQLite store (needs `pip install 'forge-tokens[trackio]'`)."""

    dir: str | None = None  # the local store's folder; null: <run dir>/trackers/trackio (TRACKIO_DIR when set)


#: the built-in trackers' settings, by name
SETTINGS: dict[str, type[TrackerSettings]] = {
    "tensorboard": TensorBoardSettings,
    "mlflow": MlflowSettings,
    "wandb": WandbSettings,
    "trackio": TrackioSettings,
}


def check_trackers(trackers: dict[str, Any] | None) -> None:
    """The built-in trackers' keys, typed and checked: one ForgeError line naming the key (a
    third-party tracker's are checked when the run builds its settings)."""
    for name, values in (trackers or {}).items():
        schema = SETTINGS.get(name)
        if schema is None or not isinstance(values, dict):
            continue
        try:
            OmegaConf.merge(OmegaConf.structured(schema), values)
        except OmegaConfBaseException as exc:
            key = f"trackers.{name}.{exc.full_key}" if exc.full_key else f"trackers.{name}"
            raise ForgeError(f"config {key}: {str(exc).splitlines()[0]}") from None
        for f in dataclasses.fields(schema):
            check = f.metadata.get(CHECK)
            value = values.get(f.name)
            problem = check(value) if check is not None and value is not None else None
            if problem:
                raise ForgeError(f"config trackers.{name}.{f.name}={show(value)}: {problem}")
