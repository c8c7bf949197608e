"""Value checks of config fields: `positive`, `non_negative`, `share` and `one_of` make a
dataclass field with its default and a check in its metadata (`CHECK`), which
`forge.config.schema.validate` runs on the value after OmegaConf has checked its type. Forge's
schema (`forge.config.schema`) and every function's `config_schema` declare their fields with them.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

from omegaconf import MISSING

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
