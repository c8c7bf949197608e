"""The format readers: a JSONL file's non-blank lines, or a Parquet file's rows, as `Record`s.

Model: a record is a row's fields, or why it has none (its problem, starting with its place).
Nothing in a row raises out of a reader: a JSONL line is read in bounded pieces and one over
`cap` bytes (`input.max_row_bytes`) is skipped to its end unparsed; Parquet row sizes come
from the string and binary columns, vectorised, and a row group that cannot be read fails
its rows, counted from the file's metadata; a Parquet file's schema is checked before any
row is read (`check_parquet_schema`). `forge.io.inputs.InputFile` turns records into rows under
the id rules.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from forge.errors import ForgeError


@dataclass(frozen=True)
class Column:
    """What a function needs of one input column: whether it must exist, and its kinds of value."""

    required: bool = False
    kinds: tuple[str, ...] = ("string",)  # among "string", "integer", "any" (any JSON value: a label)


BOM = b"\xef\xbb\xbf"
MAX_ROW_BYTES = 1 << 20  # input.max_row_bytes' default: 1 MiB
MAX_DEPTH = 100  # containers nested deeper than this in a row fail it (they break repr, pickle, JSON)
PARQUET_BATCH = 4096
_CHUNK = 1 << 20  # an over-long JSONL line is skipped this many bytes at a time


class Record(NamedTuple):
    """What a format reader yields: a row's fields, or why it has none."""

    index: int  # type: ignore[assignment]  # a field named like tuple.index: NamedTuple allows it
    line: int | None
    data: dict | None
    problem: str | None = None  # one line, starting with the place ("line N" or "row N")
    kind: str | None = None  # the problem without its place, e.g. "invalid JSON"


def check_parquet_schema(path: Path, columns: Mapping[str, Column], key: str = "input.path") -> None:
    """One ForgeError line if a column is missing or holds the wrong type (pyarrow's schema)."""
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except Exception as exc:  # pyarrow raises several types for a bad file
        raise ForgeError(f"{key}={path}: not a readable Parquet file ({first_line(exc)})") from None
    check_unique_columns(path, schema.names, key)
    check_schema(schema, columns, f"{key}={path}", "and write the file again")


def check_schema(schema, columns: Mapping[str, Column], source: str, fix: str, add: str = "add") -> None:
    """One ForgeError line if an Arrow schema lacks a required column or holds a wrong type;
    `source` starts the line (e.g. "input.path=x.parquet"), `fix` ends a type's fix, `add`
    starts a missing column's fix."""
    import pyarrow as pa

    kinds = {"string": is_string_type, "integer": pa.types.is_integer, "any": lambda t: True}
    for name, column in columns.items():
        if name not in schema.names:
            if column.required:
                raise ForgeError(
                    f"{source}: no {name!r} column (columns: {', '.join(schema.names)}); "
                    f"{add} a {'' if column.kinds == ('any',) else ' or '.join(column.kinds) + ' '}column {name!r}"
                )
            continue
        t = schema.field(name).type
        if pa.types.is_dictionary(t):
            t = t.value_type
        if pa.types.is_null(t) and not column.required:
            continue  # an all-null optional column: every row lacks it
        if not any(kinds[k](t) for k in column.kinds):
            raise ForgeError(
                f"{source}: column {name!r} is {t}; it must be {' or '.join(column.kinds)} "
                f"(cast it, e.g. with pyarrow or pandas, {fix})"
            )


def check_unique_columns(path: Path, names: list[str], key: str = "input.path") -> None:
    """One ForgeError line if two columns share a name: a row is read as a mapping of column
    names, so one of them would be dropped unseen (or, for a column Forge reads, which one is
    meant is unknown)."""
    repeated = sorted({n for n in names if names.count(n) > 1}, key=names.index)
    if repeated:
        name, n = repeated[0], names.count(repeated[0])
        others = f" (and {', '.join(map(repr, repeated[1:]))} too)" if len(repeated) > 1 else ""
        raise ForgeError(
            f"{key}={path}: its Parquet schema has {n} columns named {name!r}{others}; rename or drop "
            f"{'one' if n == 2 else 'all but one'} of them and write the file again"
        )


def count_rows(path: Path, max_row_bytes: int = MAX_ROW_BYTES) -> int:
    """Records in a JSONL (non-blank lines) or Parquet file (from its metadata)."""
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(path).metadata
        return sum(meta.row_group(group).num_rows for group in range(meta.num_row_groups))  # as they are read
    with open(path, "rb") as f:
        return sum(1 for _ in jsonl_lines(f, max_row_bytes))


def jsonl_records(path: Path, cap: int, only: set[int] | None = None, skip: int = 0) -> Iterator[Record]:
    """Lines are read as bytes, at most `cap` at a time, and decoded one by one, so a bad byte
    or an over-long line fails only its line. With `only`, other lines are not parsed; the
    first `skip` records are passed over unparsed (nothing yielded for them)."""
    with open(path, "rb") as f:
        for index, (line_no, raw, size) in enumerate(jsonl_lines(f, cap)):
            if index < skip:
                continue
            if only is not None and index not in only:
                yield Record(index, line_no, None, "not read", "not read")
            elif raw is None:
                yield Record(
                    index,
                    line_no,
                    None,
                    (
                        f"line {line_no}: {size} bytes, over input.max_row_bytes={cap}; "
                        "raise input.max_row_bytes or split the row"
                    ),
                    "row over input.max_row_bytes",
                )
            else:
                yield parse_line(index, line_no, raw)


def jsonl_lines(f, cap: int) -> Iterator[tuple[int, bytes | None, int]]:
    """(line number, bytes without the line end, size) of each non-blank line; bytes are None
    for a line over `cap` bytes, which is skipped to its end in bounded pieces. A BOM at the
    start of the file is dropped before anything else is looked at."""
    if f.read(len(BOM)) != BOM:
        f.seek(0)
    line_no = 0
    while True:
        raw = f.readline(cap + 2)  # cap bytes and "\r\n"
        if not raw:
            return
        line_no += 1
        if raw.endswith(b"\n") or len(raw) < cap + 2:
            body = raw.rstrip(b"\r\n")
            if body.strip():
                yield line_no, (body if len(body) <= cap else None), len(body)
            continue
        size, blank = len(raw), not raw.strip()
        while not raw.endswith(b"\n"):
            raw = f.readline(_CHUNK)
            if not raw:
                break
            size += len(raw)
            blank = blank and not raw.strip()
        if not blank:
            yield line_no, None, size - (len(raw) - len(raw.rstrip(b"\r\n")))


def parse_line(index: int, line_no: int, raw: bytes) -> Record:
    where = f"line {line_no}"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return Record(
            index,
            line_no,
            None,
            (f"{where}: invalid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); save the file as UTF-8"),
            "invalid UTF-8",
        )
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        return Record(
            index,
            line_no,
            None,
            (f"{where}: invalid JSON ({exc.msg} at column {exc.colno}); each line must be one JSON object"),
            "invalid JSON",
        )
    except RecursionError:
        return Record(
            index, line_no, None, f"{where}: nested too deeply to parse; flatten the row", "nested too deeply"
        )
    except Exception as exc:  # noqa: BLE001  (e.g. an integer of more digits than Python converts)
        return Record(
            index,
            line_no,
            None,
            (f"{where}: cannot be parsed ({first_line(exc)}); each line must be one JSON object"),
            "unparseable JSON",
        )
    if not isinstance(row, dict):
        return Record(
            index,
            line_no,
            None,
            (f'{where}: expected a JSON object, got {type(row).__name__}; write each row as {{"text": ...}}'),
            "not a JSON object",
        )
    if _deeper_than(row, MAX_DEPTH):
        return Record(
            index,
            line_no,
            None,
            f"{where}: nested more than {MAX_DEPTH} levels deep; flatten the row",
            "nested too deeply",
        )
    return Record(index, line_no, row)


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether containers nest more than `limit` levels (iterative: no recursion to overflow)."""
    if isinstance(value, dict) and not any(isinstance(v, (dict, list)) for v in value.values()):
        return False  # a flat row: the common case
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def parquet_records(path: Path, cap: int) -> Iterator[Record]:
    """Row group by row group; a group (or the rest of one) that cannot be read fails its rows."""
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a bad file
        raise ForgeError(f"input.path={path}: not a readable Parquet file ({first_line(exc)})") from None
    check_unique_columns(path, file.schema_arrow.names)
    start = 0
    for group in range(file.metadata.num_row_groups):
        n = file.metadata.row_group(group).num_rows
        done, why = 0, "it holds fewer rows than its metadata says"
        try:
            batches = iter(file.iter_batches(batch_size=PARQUET_BATCH, row_groups=[group]))
        except Exception as exc:  # noqa: BLE001
            batches, why = iter(()), first_line(exc)
        while done < n:
            try:
                batch = next(batches)
            except StopIteration:
                break
            except Exception as exc:  # noqa: BLE001  (corrupt pages, bad compression, ...)
                why = first_line(exc)
                break
            take = min(batch.num_rows, n - done)
            yield from batch_records(batch.slice(0, take), start + done, cap)
            done += take
        for index in range(start + done, start + n):
            yield Record(
                index,
                None,
                None,
                (f"row {index}: row group {group} of the Parquet file cannot be read ({why}); write the file again"),
                "unreadable Parquet row group",
            )
        start += n


def batch_records(batch, start: int, cap: int) -> Iterator[Record]:
    sizes = _row_sizes(batch)
    over = sizes > cap
    if over.any():
        import pyarrow as pa

        kept = batch.filter(pa.array(~over))
    else:
        kept = batch
    rows = iter(_pylist(kept))
    for k in range(batch.num_rows):
        index = start + k
        if over[k]:
            yield Record(
                index,
                None,
                None,
                (
                    f"row {index}: {int(sizes[k])} bytes, over input.max_row_bytes={cap}; "
                    "raise input.max_row_bytes or split the row"
                ),
                "row over input.max_row_bytes",
            )
            continue
        row = next(rows)
        if isinstance(row, dict):
            yield Record(index, None, row)
        else:
            yield Record(
                index,
                None,
                None,
                f"row {index}: cannot be read ({row}); write the file again",
                "unreadable Parquet row",
            )


def _row_sizes(batch) -> np.ndarray:
    """Bytes per row in the batch's string and binary columns (pyarrow.compute, no row made)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    sizes = np.zeros(batch.num_rows, np.int64)
    for column in batch.columns:
        try:
            if pa.types.is_dictionary(column.type):
                column = column.dictionary_decode()
            t = column.type
            if is_string_type(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t):
                sizes += pc.fill_null(pc.binary_length(column), 0).to_numpy(zero_copy_only=False).astype(np.int64)
        except Exception:  # noqa: BLE001  (a column pyarrow cannot measure counts as 0 bytes)
            continue
    return sizes


def _pylist(batch) -> list[dict | str]:
    """The batch's rows as dicts; a row that cannot become one is the reason, in one line."""
    try:
        return batch.to_pylist()
    except Exception:  # noqa: BLE001  (one bad value: find it row by row)
        out: list[dict | str] = []
        for k in range(batch.num_rows):
            try:
                out.append(batch.slice(k, 1).to_pylist()[0])
            except Exception as exc:  # noqa: BLE001
                out.append(first_line(exc))
        return out


def is_string_type(t) -> bool:
    """Whether a pyarrow type holds strings (string, large string, string view)."""
    import pyarrow as pa

    return (
        pa.types.is_string(t) or pa.types.is_large_string(t) or getattr(pa.types, "is_string_view", lambda _: False)(t)
    )


def place(index: int, line: int | None) -> str:
    return f"line {line}" if line is not None else f"row {index}"


def first_line(exc: BaseException) -> str:
    """An exception in one line: its message's first line, or its type."""
    return (str(exc).splitlines() or [type(exc).__name__])[0]
