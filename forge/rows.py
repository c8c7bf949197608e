"""Input rows as a function reads them: each a good `Row`, a `Rejected` naming the fix, or a
`Skipped` repeat of an id.

Model: `read(input, columns)` is the one place where every model function's rows are read and
checked. `forge.inputs.InputFile` parses the file and owns the id rule (canonical ids, the
`input.duplicate_ids` policy, the row-size cap, rows that cannot be parsed); this module then
checks each declared column: a required string column must hold a non-empty string (or a
string, for `MayBeEmpty`), an optional one a string or nothing, no string may hold an unpaired
surrogate (tokenizers refuse the whole batch it is in), and a label Forge journals must be
JSON. What a column *means* is the function's business; what makes a row readable is decided
here, once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from forge.inputs import Column, InputFile, Row, json_problem, string_problem
from forge.run import Rejected, Skipped


@dataclass(frozen=True)
class MayBeEmpty(Column):
    """A required string column whose value may be the empty string (score's `context`)."""


def read(input: InputFile, columns: Mapping[str, Column]) -> Iterator[Row | Rejected | Skipped]:
    """Every record of the input, in order: a checked `Row`, or a `Rejected` / `Skipped`."""
    for row in input.rows():
        if not isinstance(row, Row):  # unreadable, a bad id, or a repeated id: recorded as it is
            yield row
            continue
        problem = check(row.data, columns)
        yield row if problem is None else row.reject(problem)


def check(data: Mapping, columns: Mapping[str, Column]) -> str | None:
    """What is wrong with a row's declared columns (and its label), naming the field and the
    fix; None for a good row."""
    for name, column in columns.items():
        if name == "id" or "string" not in column.kinds:
            continue
        problem = string_problem(data, name, required=column.required,
                                 empty_ok=isinstance(column, MayBeEmpty) or not column.required)
        if problem is not None:
            return problem
    return json_problem(data, "label")
