"""Forge: GPU batch functions scheduled, packed and accounted in tokens."""

from forge.errors import ForgeError
from forge.hookspecs import hookimpl
from forge.vocab.geometry import Batch, Device, Item, Limits

__all__ = [
    "Batch",
    "Device",
    "ForgeError",
    "Item",
    "Limits",
    "hookimpl",
    "load_activations",
    # the in-process API (forge.inproc: docs/python-api.md), imported on first use
    "Result",
    "Session",
    "run",
    # the public function API (forge.api), imported on first use: `import forge` stays light
    "Aggregate",
    "CausalLMFunction",
    "Column",
    "EncoderFunction",
    "Field",
    "Forward",
    "GenerativeConfig",
    "GenerativeFunction",
    "InputSpec",
    "ItemView",
    "ModelFunction",
    "ModelFunctionConfig",
    "ModelSpec",
    "Prompt",
    "Rejected",
    "Row",
    "RowLimits",
    "SamplingConfig",
    "Tokens",
]
_INPROC = frozenset(__all__[7:10])
_API = frozenset(__all__[10:])


def __getattr__(name: str):
    if name in _INPROC:
        from forge import inproc

        return getattr(inproc, name)
    if name in _API:
        from forge import api

        return getattr(api, name)
    raise AttributeError(f"module 'forge' has no attribute {name!r}")


def load_activations(run_dir):
    """ids, labels and {layer: tensor[N, hidden]} saved by a probe_gen run, aligned; `run_dir`
    is a local path or an fsspec URL (s3://bucket/run, ...)."""
    from forge.functions.activations import load_activations as _load

    return _load(run_dir)
