"""Schemas as config nodes and back: `defaults_of` gives the node a YAML extends while Hydra
composes (a schema's defaults), `instantiate` the typed config the edge hands a function from
validated plain values. Generic over any schema dataclass, Forge's or a plugin's."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from omegaconf import OmegaConf

from forge.config.checks import unwrap_optional

T = TypeVar("T")


def defaults_of(schema_cls: type) -> dict[str, Any]:
    """A schema's keys and their defaults as plain values (`???` where a value must be set): the
    node a YAML extends while Hydra composes (`forge.cli.searchpath`). Plain, not typed, so that
    `validate` sees each value as written (a typed node turns `2` into true while composing)."""
    return typing.cast(dict, OmegaConf.to_container(OmegaConf.structured(schema_cls)))


def instantiate(schema_cls: type[T], values: Mapping[str, Any]) -> T:
    """An instance of a schema from validated plain values, nested schemas built from their
    mappings: the typed config the edge hands a function. Keys of `values` the schema does not
    declare are left out (the root holds the core's keys beside the function's)."""
    hints = typing.get_type_hints(schema_cls)
    kwargs = {}
    for f in dataclasses.fields(typing.cast(Any, schema_cls)):
        if f.name in values:
            value, inner = values[f.name], unwrap_optional(hints[f.name])
            is_schema = dataclasses.is_dataclass(inner) and isinstance(inner, type) and isinstance(value, Mapping)
            kwargs[f.name] = instantiate(inner, value) if is_schema else value
    return schema_cls(**kwargs)
