"""docs/configuration.md, written from the schemas: every key with its type, default and meaning.

Model: a schema dataclass is the one home of its keys' defaults, and a field's comment is its
documentation: the comment lines right above the field and the comment after it on its line
(a field a subclass declares again without a comment keeps its base's). `render` turns
sections, each a config group's schema, into Markdown tables (a nested schema's keys are dotted:
`devices.limits.max_rows`). Which sections there are is the edge's to say, since the functions'
and modes' schemas live above this floor: `forge.cli.config_docs` collects them and writes the
file; tests/test_docs.py fails when it is stale.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import textwrap
import tokenize
import typing
from collections.abc import Collection, Iterable
from typing import Any, NamedTuple

from omegaconf import MISSING

from forge.config.checks import unwrap_optional

HEADER = (
    "<!-- Written by `python -m forge.cli.config_docs` from the schema dataclasses; edit their comments, "
    "not this file. -->\n"
)


class Section(NamedTuple):
    """One table: a config group (or option) and the schema whose keys it lists."""

    title: str  # the heading: the group and option, e.g. "batching=token"
    schema: type  # the dataclass
    prefix: str = ""  # the keys' node, e.g. "batching." ("" for root keys)
    skip: Collection[str] = ()  # fields listed elsewhere (another section's, or a node of their own)
    note: str = ""  # a line under the heading (what the shipped YAML sets, ...)


def comments(schema: type) -> dict[str, str]:
    """Each field's comment, from the source of the classes that declare it (bases first)."""
    found: dict[str, str] = {}
    for klass in reversed(schema.__mro__):
        if dataclasses.is_dataclass(klass):
            found.update({name: text for name, text in _own_comments(klass).items() if text})
    return found


def _own_comments(klass: type) -> dict[str, str]:
    try:
        lines, _ = inspect.getsourcelines(klass)
    except (OSError, TypeError):  # a class made at run time has no source
        return {}
    source = textwrap.dedent("".join(lines))
    text = source.splitlines()
    notes = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    body = typing.cast(ast.ClassDef, ast.parse(source).body[0]).body
    out = {}
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, line = [], node.lineno - 1
        while line in notes and text[line - 1].lstrip().startswith("#"):  # whole comment lines right above
            above.insert(0, notes[line])
            line -= 1
        after = notes.get(node.end_lineno or node.lineno)
        out[node.target.id] = " ".join([*above, *([after] if after else [])])
    return out


def rows(schema: type, prefix: str = "", skip: Collection[str] = ()) -> list[tuple[str, str, str, str]]:
    """(key, type, default, meaning) per key of `schema`, a nested schema's keys dotted after it."""
    hints, notes = typing.get_type_hints(schema), comments(schema)
    out = []
    for f in dataclasses.fields(schema):
        if f.name in skip:
            continue
        inner = unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(inner) and isinstance(inner, type) and f.default in (None, dataclasses.MISSING):
            if f.default is None:  # an optional node: it may be null, or hold the nested keys
                out.append((f"{prefix}{f.name}", _type(f), "`null`", notes.get(f.name, "")))
            out += rows(inner, f"{prefix}{f.name}.")
            continue
        out.append((f"{prefix}{f.name}", _type(f), _default(f), notes.get(f.name, "")))
    return out


def _type(f: dataclasses.Field) -> str:
    tp = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    return f"`{tp}`"


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value: Any = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "required"
    if value is MISSING:
        return "required"
    if isinstance(value, str) and value.strip() == value and value:
        return f"`{value}`"
    return f"`{json.dumps(value)}`"  # null, true, false, numbers, lists, and strings with spaces quoted


def render(sections: Iterable[Section], intro: str) -> str:
    """The Markdown of every section's table, under `intro`."""
    parts = [HEADER, "# Configuration reference\n", intro.strip() + "\n"]
    for s in sections:
        doc = inspect.cleandoc(s.schema.__doc__ or "").split("\n\n")[0].replace("\n", " ")
        where = f"`{s.schema.__module__}.{s.schema.__qualname__}`"
        parts.append(f"## {s.title}\n\n{where}: {doc}\n" if doc else f"## {s.title}\n\n{where}\n")
        if s.note:
            parts.append(s.note.strip() + "\n")
        keys = rows(s.schema, s.prefix, s.skip)
        table = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
        for key, tp, default, meaning in keys:
            cells = [f"`{key}`", tp, default, meaning]
            table.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        parts.append("\n".join(table) + "\n" if keys else "No keys of its own.\n")
    return "\n".join(parts)
