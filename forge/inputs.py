"""Reading input rows: JSONL (one object per line) or Parquet.

Yields (row_index, row) for good rows and (row_index, reason) for bad ones, so a
malformed line (invalid UTF-8, invalid JSON, not an object) becomes a recorded failure and
the run goes on. A Parquet file's schema is checked up front (`check_input(columns=...)`):
a wrong column type would fail every row, so it is one error before any work.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

from forge.errors import ForgeError

SUFFIXES = (".jsonl", ".json", ".ndjson", ".parquet")
BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True)
class Column:
    """What a function needs of one input column: whether it must exist, and its kinds of value."""

    required: bool = False
    kinds: tuple[str, ...] = ("string",)  # among "string", "integer"


def check_input(path: Path, key: str = "input.path", columns: Mapping[str, Column] | None = None) -> Path:
    """The path, if it is a non-empty JSONL or Parquet file; a Parquet file's schema must also
    fit `columns` (JSONL rows are checked one by one as they are read)."""
    if not path.exists():
        raise ForgeError(f"{key}={path}: no such file; point {key} at a JSONL or Parquet file")
    if path.is_dir():
        raise ForgeError(f"{key}={path} is a directory; point it at a JSONL or Parquet file")
    if path.suffix.lower() not in SUFFIXES:
        raise ForgeError(f"{key}={path}: unknown format {path.suffix!r}; use one of {', '.join(SUFFIXES)}")
    if path.stat().st_size == 0:
        raise ForgeError(f"{key}={path} is empty; it needs at least one row with a 'text' field")
    if columns and path.suffix.lower() == ".parquet":
        check_parquet_schema(path, columns, key)
    return path


def check_parquet_schema(path: Path, columns: Mapping[str, Column], key: str = "input.path") -> None:
    """One ForgeError line if a column is missing or holds the wrong type (pyarrow's schema)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except Exception as exc:  # pyarrow raises several types for a bad file
        raise ForgeError(f"{key}={path}: not a readable Parquet file ({_first_line(exc)})") from None
    kinds = {"string": lambda t: pa.types.is_string(t) or pa.types.is_large_string(t)
             or getattr(pa.types, "is_string_view", lambda _: False)(t),
             "integer": pa.types.is_integer}
    for name, column in columns.items():
        if name not in schema.names:
            if column.required:
                raise ForgeError(f"{key}={path}: no {name!r} column (columns: {', '.join(schema.names)}); "
                                 f"add a {' or '.join(column.kinds)} column {name!r}")
            continue
        t = schema.field(name).type
        if pa.types.is_dictionary(t):
            t = t.value_type
        if pa.types.is_null(t) and not column.required:
            continue  # an all-null optional column: every row lacks it
        if not any(kinds[k](t) for k in column.kinds):
            raise ForgeError(f"{key}={path}: column {name!r} is {t}; it must be {' or '.join(column.kinds)} "
                             f"(cast it, e.g. with pyarrow or pandas, and write the file again)")


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def read_rows(path: Path, limit: int | None = None) -> Iterator[tuple[int, dict | str]]:
    """(zero-based row index, row dict) or (row index, 'line N: reason') for each row."""
    check_input(path)
    rows = _parquet_rows(path) if path.suffix.lower() == ".parquet" else _jsonl_rows(path)
    for index, row in rows:
        if limit is not None and index >= limit:
            return
        yield index, row


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict | str]]:
    """Lines are read as bytes and decoded one by one, so a bad byte fails only its line."""
    index = 0
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            if line_no == 1 and raw.startswith(BOM):
                raw = raw[len(BOM):]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield index, (f"line {line_no}: invalid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
                              "save the file as UTF-8")
                index += 1
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                yield index, (f"line {line_no}: invalid JSON ({exc.msg} at column {exc.colno}); "
                              "each line must be one JSON object")
            else:
                if isinstance(row, dict):
                    yield index, row
                else:
                    yield index, (f"line {line_no}: expected a JSON object, got {type(row).__name__}; "
                                  'write each row as {"text": ...}')
            index += 1


def _parquet_rows(path: Path) -> Iterator[tuple[int, dict | str]]:
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a bad file
        raise ForgeError(f"input.path={path}: not a readable Parquet file ({_first_line(exc)})") from None
    index = 0
    for batch in file.iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            yield index, row
            index += 1


def count_rows(path: Path) -> int:
    """Rows in a JSONL (non-blank lines) or Parquet file (from its metadata)."""
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())
