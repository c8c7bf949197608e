"""The built-in trackers, registered through `forge_trackers` exactly as a third-party
tracker is. Import paths: listing them, or composing a config, imports no tracker library."""

from __future__ import annotations

from forge.hookspecs import hookimpl


@hookimpl
def forge_trackers():
    return {
        "tensorboard": "forge.builtin.tracker_tensorboard:TensorBoardTracker",
        "mlflow": "forge.builtin.tracker_mlflow:MlflowTracker",
        "wandb": "forge.builtin.tracker_wandb:WandbTracker",
        "trackio": "forge.builtin.tracker_trackio:TrackioTracker",
    }
