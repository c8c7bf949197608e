"""Reading input rows: JSONL (one object per line) or Parquet.

Yields (row_index, row) for good rows and (row_index, reason) for bad ones, so a
malformed line becomes a recorded failure and the run goes on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from forge.errors import ForgeError

SUFFIXES = (".jsonl", ".json", ".ndjson", ".parquet")


def check_input(path: Path, key: str = "input.path") -> Path:
    if not path.exists():
        raise ForgeError(f"{key}={path}: no such file; point {key} at a JSONL or Parquet file")
    if path.is_dir():
        raise ForgeError(f"{key}={path} is a directory; point it at a JSONL or Parquet file")
    if path.suffix.lower() not in SUFFIXES:
        raise ForgeError(f"{key}={path}: unknown format {path.suffix!r}; use one of {', '.join(SUFFIXES)}")
    if path.stat().st_size == 0:
        raise ForgeError(f"{key}={path} is empty; it needs at least one row with a 'text' field")
    return path


def read_rows(path: Path, limit: int | None = None) -> Iterator[tuple[int, dict | str]]:
    """(zero-based row index, row dict) or (row index, 'line N: reason') for each row."""
    check_input(path)
    rows = _parquet_rows(path) if path.suffix.lower() == ".parquet" else _jsonl_rows(path)
    for index, row in rows:
        if limit is not None and index >= limit:
            return
        yield index, row


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict | str]]:
    index = 0
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                yield index, f"line {line_no}: invalid JSON ({exc.msg} at column {exc.colno})"
            else:
                if isinstance(row, dict):
                    yield index, row
                else:
                    yield index, f"line {line_no}: expected a JSON object, got {type(row).__name__}"
            index += 1


def _parquet_rows(path: Path) -> Iterator[tuple[int, dict | str]]:
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a bad file
        raise ForgeError(f"input.path={path}: not a readable Parquet file ({exc})") from None
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
