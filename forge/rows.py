"""Input rows as a function reads them: each a good `Row` or a `Rejected` naming the fix.

Model: `read(path, limit, columns)` is the one place where every function's rows are read and
checked (`forge.inputs.read_rows` parses the file): the row's id (a string or an integer; its
position when absent), then each declared column: a required string column must hold a
non-empty string, an optional one a string or nothing, and no string may hold an unpaired
surrogate (tokenizers refuse the whole batch it is in). What a column *means* is the
function's business; what makes a row readable is decided here, once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from forge.inputs import Column, read_rows
from forge.run import Rejected


@dataclass(frozen=True)
class MayBeEmpty(Column):
    """A required string column whose value may be the empty string (score's `context`)."""


@dataclass(frozen=True, slots=True)
class Row:
    """One good input row."""

    index: int  # zero-based position in the input
    id: str  # its id: the row's own, else its position
    data: dict[str, Any]  # the row's fields, as read


def read(path: Path, limit: int | None, columns: Mapping[str, Column]) -> Iterator[Row | Rejected]:
    """Every row of the input, in order: a `Row`, or a `Rejected` with its reason."""
    for index, row in read_rows(path, limit):
        if isinstance(row, str):
            yield Rejected(record_id=row.split(":", 1)[0], reason=row)
            continue
        checked = check(index, row, columns)
        yield checked


def check(index: int, row: dict, columns: Mapping[str, Column]) -> Row | Rejected:
    rid = row.get("id")
    if rid is not None and (isinstance(rid, bool) or not isinstance(rid, (str, int))):
        return Rejected(str(index), f"row {index}: 'id' must be a string or an integer, got "
                                    f"{type(rid).__name__} {short(rid)}; fix the id or leave it out")
    rid = str(index) if rid is None else str(rid)
    for name, column in columns.items():
        if name == "id" or "string" not in column.kinds:
            continue
        value = row.get(name)
        empty_ok = isinstance(column, MayBeEmpty) and isinstance(value, str)
        if column.required and not empty_ok and (not isinstance(value, str) or not value.strip()):
            what = (f"has no {name!r} field" if value is None else
                    f"has an empty or non-string {name!r} ({type(value).__name__} {short(value)})")
            return Rejected(rid, f"row {index} (id {rid}) {what}; every row needs a non-empty string {name!r}")
        if value is not None and not isinstance(value, str):
            return Rejected(rid, f"row {index} (id {rid}): {name!r} must be a string, got "
                                 f"{type(value).__name__} {short(value)}; fix it or leave it out")
        bad = unencodable(value)
        if bad is not None:
            return Rejected(rid, f"row {index} (id {rid}): {name!r} holds an unpaired surrogate "
                                 f"(\\u{ord(value[bad]):04x} at position {bad}); write the character whole or drop it")
    return Row(index, rid, row)


def short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def unencodable(text: str | None) -> int | None:
    """Position of the first character UTF-8 cannot encode (an unpaired surrogate, from a JSON
    escape like \\ud800), or None."""
    if not text or not isinstance(text, str) or text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None
