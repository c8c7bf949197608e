"""Input rows as a function reads them: each a good `Row`, a `Rejected` naming the fix, or a
`Skipped` repeat of an id.

Model: `read(input, columns)` is the one place where every model function's rows are read and
checked. `forge.io.inputs.InputFile` parses the file and owns the id rule (canonical ids, the
`input.duplicate_ids` policy, the row-size cap, rows that cannot be parsed); this module then
checks each declared column: a required string column must hold a non-empty string (or a
string, for `MayBeEmpty`), an optional one a string or nothing, no string may hold an unpaired
surrogate (tokenizers refuse the whole batch it is in), and a label Forge journals must be
JSON (`string_problem`, `json_problem`). What a column *means* is the function's business;
what makes a row readable is decided here, once. `each_row` runs a function's batched step
over rows so that only a row it raises for fails.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from forge.errors import ForgeError
from forge.io.ids import short, unencodable
from forge.io.inputs import Column, InputFile, Row
from forge.io.readers import first_line
from forge.vocab.records import Rejected, Skipped

T = TypeVar("T")


@dataclass(frozen=True)
class MayBeEmpty(Column):
    """A required string column whose value may be the empty string (score's `context`)."""


def read(input: InputFile, columns: Mapping[str, Column], start: int = 0) -> Iterator[Row | Rejected | Skipped]:
    """Every record of the input, in order (from record `start`): a checked `Row`, or a `Rejected` / `Skipped`."""
    for row in input.rows(start):
        if not isinstance(row, Row):  # unreadable, a bad id, or a repeated id: recorded as it is
            yield row
            continue
        problem = check(row.data, columns)
        yield row if problem is None else row.reject(problem)


def check(data: Mapping, columns: Mapping[str, Column]) -> str | None:
    """What is wrong with a row's declared columns (and its label), naming the field and the
    fix; None for a good row."""
    for name, column in columns.items():
        if name != "id" and "string" not in column.kinds and column.required and data.get(name) is None:
            return f"has no {name!r} field; every row needs a {name!r}: add it, or leave the row out of the input"
        if name == "id" or "string" not in column.kinds:
            continue
        problem = string_problem(
            data, name, required=column.required, empty_ok=isinstance(column, MayBeEmpty) or not column.required
        )
        if problem is not None:
            return problem
    return json_problem(data, "label")


def string_problem(row: Mapping[str, Any], name: str, *, required: bool, empty_ok: bool = False) -> str | None:
    """What is wrong with `row[name]` as a string field (missing, not a string, empty, an
    unpaired surrogate), in words with the fix; None when it is fine."""
    value = row.get(name)
    need = f"a string {name!r} (it may be empty)" if empty_ok else f"a non-empty string {name!r}"
    fix = f"every row needs {need}" if required else "fix it or leave it out"
    if value is None:
        return f"has no {name!r} field; {fix}" if required else None
    if not isinstance(value, str):
        if empty_ok:
            return f"{name!r} must be a string, got {type(value).__name__} {short(value)}; {fix}"
        return f"has an empty or non-string {name!r} ({type(value).__name__} {short(value)}); {fix}"
    if not empty_ok and not value.strip():
        return f"has an empty or non-string {name!r} ({short(value)}); {fix}"
    bad = unencodable(value)
    if bad is not None:
        return (
            f"{name!r} holds an unpaired surrogate (\\u{ord(value[bad]):04x} at position {bad}); "
            "write the character whole or drop it"
        )
    return None


def json_problem(row: Mapping[str, Any], name: str) -> str | None:
    """What is wrong with `row[name]` as a value Forge keeps as it is (a label, in the run's
    journal): it must be JSON. A JSONL row always is; a Parquet value may not be (bytes, a
    timestamp)."""
    value = row.get(name)
    if value is None or isinstance(value, (str, int, float)):
        return None
    try:
        json.dumps(value)
    except (TypeError, ValueError, RecursionError) as exc:
        return (
            f"{name!r} must be a JSON value (a number, string, list or object), got {type(value).__name__} "
            f"({first_line(exc)}); convert the column or leave it out"
        )
    return None


def each_row(rows: list[Row], make: Callable[[list[Row]], Iterable[T]], what: str) -> Iterator[T | Rejected]:
    """`make(rows)` (a function's batched step, e.g. tokenizing), or, where it raises, `make([row])`
    for each row alone, so only a row it raises for fails, with the error. A ForgeError (a
    setting, a model that will not load) is not a row's fault and is raised."""
    try:
        made = list(make(rows))
    except ForgeError:
        raise
    except Exception:  # noqa: BLE001  (some row is odd: find it)
        for row in rows:
            try:
                one = list(make([row]))
            except ForgeError:
                raise
            except Exception as exc:  # noqa: BLE001
                yield row.reject(f"{what} failed on it ({first_line(exc)}); fix or drop the row", f"{what} failed")
            else:
                yield from one
        return
    yield from made
