"""Value checks of config fields: `positive`, `non_negative`, `share` and `one_of` make a
dataclass field with its default and a check in its metadata (`CHECK`), which
`forge.config.schema.validate` runs on the value after OmegaConf has checked its type. Forge's
schema (`forge.config.schema`) and every function's `config_schema` declare their fields with them.
The strict check below also types what OmegaConf does not: a bool field's raw value (OmegaConf
takes 2 for true).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import field
from typing import Any

from omegaconf import MISSING, DictConfig, ListConfig

from forge.errors import ForgeError

CHECK = "forge_check"  # field metadata key: a callable value -> problem (str) or None


def _positive(value) -> str | None:
    if value > 0:
        return None
    return "must be a positive integer" if isinstance(value, int) else "must be a positive number"


def _non_negative(value) -> str | None:
    if value >= 0:
        return None
    return "must be 0 or more"


def _share(value) -> str | None:
    return None if 0 < value <= 1 else "must be a share in (0, 1]"


def positive(default: Any = MISSING) -> Any:
    """A field whose value (when not null) must be > 0."""
    return field(default=default, metadata={CHECK: _positive})


def non_negative(default: Any = MISSING) -> Any:
    return field(default=default, metadata={CHECK: _non_negative})


def share(default: Any = MISSING) -> Any:
    """A fraction in (0, 1]."""
    return field(default=default, metadata={CHECK: _share})


def one_of(default: Any, *choices: str) -> Any:
    """A string field limited to `choices`."""

    def check(value) -> str | None:
        return None if value in choices else f"choose one of: {', '.join(choices)}"

    return field(default=default, metadata={CHECK: check})


# -- strict types, for values OmegaConf would coerce -------------------------


def boolean(value) -> str | None:
    """true or false only: OmegaConf reads 2, 'yes' or 'on' as true, which hides a typo."""
    return None if isinstance(value, bool) else "expected true or false"


def check_bools(schema_cls: Any, cfg: DictConfig, prefix: str = "") -> None:
    """A bool field given anything but true or false, as written (merged, 2 would be true)."""
    hints = typing.get_type_hints(schema_cls)
    for f in dataclasses.fields(schema_cls):
        node = cfg._get_node(f.name) if f.name in cfg else None
        if node is None or node._is_interpolation() or node._is_none():
            continue
        inner = unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(inner) and isinstance(node, DictConfig):
            check_bools(inner, node, f"{prefix}{f.name}.")
        elif inner is bool and not isinstance(node, (DictConfig, ListConfig)):
            value = node._value()
            if boolean(value) and str(value).lower() not in ("true", "false"):  # a quoted 'true' is fine
                raise ForgeError(f"config {prefix}{f.name}={show(value)}: {boolean(value)}")


def unwrap_optional(tp):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if args and type(None) in typing.get_args(tp):
        return args[0]
    return tp


def show(value) -> str:
    """A config value as the command line writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value)
