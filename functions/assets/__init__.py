"""Embedded default model and dataset for ``probe_gen`` (the data files of this folder); the
code that finds them and makes the model's weights is `forge.runtime.model.embedded`, re-exported here."""

from forge.runtime.model.embedded import (
    ASSETS_DIR,
    default_cache_dir,
    embedded_dataset_path,
    embedded_model_source,
    materialize_model,
)

__all__ = ["ASSETS_DIR", "embedded_dataset_path", "embedded_model_source", "materialize_model", "default_cache_dir"]
