"""Forge: GPU batch functions scheduled, packed and accounted in tokens."""

from importlib.util import find_spec

from forge.errors import ForgeError as ForgeError
from forge.hookspecs import hookimpl as hookimpl
from forge.vocab.geometry import Batch as Batch, Device as Device, Item as Item, Limits as Limits

#: what `forge` holds itself, beside the in-process API (forge.inproc: docs/python-api.md) and the
#: public function API, whose names `forge.api.__all__` lists (once): both are imported on first
#: use, so `import forge` stays light. `forge.__all__` is the three together.
OWN_NAMES = ("Batch", "Device", "ForgeError", "Item", "Limits", "hookimpl", "load_activations")
INPROC_NAMES = ("Result", "Session", "run")


def __getattr__(name: str):
    if name in INPROC_NAMES:
        from forge import inproc

        return getattr(inproc, name)
    if name == "__all__" or not (name.startswith("_") or _is_submodule(name)):  # probes import nothing
        from forge import api

        if name == "__all__":
            return sorted({*OWN_NAMES, *INPROC_NAMES, *api.__all__})
        if name in api.__all__:
            return getattr(api, name)
    raise AttributeError(f"module 'forge' has no attribute {name!r}")


def _is_submodule(name: str) -> bool:
    """`forge.<name>` is a module (`from forge import cli` asks for the attribute before importing it)."""
    return find_spec(f"forge.{name}") is not None


def load_activations(run_dir):
    """ids, labels and {layer: tensor[N, hidden]} saved by a probe_gen run, aligned; `run_dir`
    is a local path or an fsspec URL (s3://bucket/run, ...)."""
    from forge.functions.activations import load_activations as _load

    return _load(run_dir)
