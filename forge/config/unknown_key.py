"""The one line for an override of a key the composed config does not have (Hydra alone says
`Could not override` and offers `+key=`, which the schema then refuses for a typed node)."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping

from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException


def unknown_key_line(key: str, valid: list[str], hints: list[str] | None = None) -> str:
    """`config: unknown key 'name' in parent; did you mean ...? valid keys: ...` (the one home of that line)."""
    parent, _, name = key.rpartition(".")
    where = f"in {parent}" if parent else "at the root"
    hint = f"did you mean {' or '.join(hints[:3])}? " if hints else ""
    return f"config: unknown key {name!r} {where}; {hint}valid keys: {', '.join(valid)}"


def explain_unknown_key(key: str, cause: OmegaConfBaseException, choices: Mapping[str, Mapping[str, type]]) -> str:
    """The line for a key OmegaConf refused (`cause`): with its siblings' names close to it, or
    where a key of that name lives (`batching.max_rows`: devices.limits.max_rows), or which
    choice of its group has it. `choices`: per group whose schema a key chooses (runtime,
    batching), each choice's schema (`runtime.address`: runtime=ray's; `batching.packing`:
    batching=token's)."""
    parent, _, name = key.rpartition(".")
    node = getattr(cause, "parent_node", None)
    if isinstance(node, DictConfig):
        valid = [str(k) for k in node.keys() if k != "hydra"]
    else:
        valid = _fields(getattr(cause, "object_type", None))
    hints = [f"{parent}.{m}" if parent else m for m in difflib.get_close_matches(name, valid, n=2)]
    if isinstance(node, DictConfig):
        hints += [k for k in _keys_named(node._get_root(), name) if k not in hints and k != key]
    others = (choices.get(parent) or {}).items()
    hints += [f"{parent}={choice}, which has {key}" for choice, cls in others if name in _fields(cls)]
    return unknown_key_line(key, valid, hints)


def _keys_named(node: DictConfig, name: str, prefix: str = "", depth: int = 3) -> list[str]:
    """Full keys under `node` whose last part is `name` (Hydra's own node left out)."""
    found = []
    for k in node.keys():
        if k == "hydra":
            continue
        path = f"{prefix}{k}"
        if k == name:
            found.append(path)
        child = node._get_node(k)
        if depth and isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            found += _keys_named(child, name, f"{path}.", depth - 1)
    return found


def _fields(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)] if isinstance(cls, type) and dataclasses.is_dataclass(cls) else []
