"""Reading input rows: JSONL (one object per line) or Parquet, with one rule for ids.

Model: a record is one non-blank JSONL line or one Parquet row, and `InputFile.rows` turns
each into exactly one of: a `Row` (parsed, with its canonical id), a `Rejected` (it cannot be
read, or its id is bad: a recorded failure naming its line and the fix) or a `Skipped` (a
repeat of an id that `input.duplicate_ids=first|last` drops). Nothing in a row can raise out
of the reader: any exception parsing it becomes its failure, and a row over
`input.max_row_bytes` is refused before it is parsed (JSONL lines are read in bounded pieces,
never whole; Parquet row sizes come from the string and binary columns, vectorised). A
Parquet row group that cannot be read fails its rows, counted from the file's metadata.

Ids: an integer and a string of the same text are the same id (`1` and `"1"` are "1"); a row
without one gets `#<row index>`, a form an explicit id may not take, so the two never collide;
any other type is a bad id. Repeated ids are found before any work by a scan over the ids
(64-bit hashes in numpy, repeats confirmed on the id strings): `error` refuses the input in
one line, `first` and `last` keep one row of each id and skip the others, each with its line.

Forge reads the input more than once (its hash, its row count, the id scan, its rows), so
it must be a regular file. A Parquet file's schema is checked up front
(`check_input(columns=...)`): a wrong column type would fail every row, so it is one error.
The format readers (JSONL lines, Parquet rows, as records) are `forge.io.readers`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from forge.config.schema import MISSING, one_of, positive
from forge.errors import ForgeError
from forge.io.ids import canonical_id, good_id, id_token, short
from forge.io.readers import (
    MAX_ROW_BYTES,
    Column,
    Record,
    check_parquet_schema,
    count_rows,
    jsonl_lines,
    jsonl_records,
    parquet_records,
    parse_line,
    place,
)
from forge.vocab.records import Rejected, Skipped, reason_kind

SUFFIXES = (".jsonl", ".json", ".ndjson", ".parquet")
DUPLICATE_POLICIES = ("error", "first", "last")
_ID_KEY = re.compile(rb'"id"\s*:\s*("(?:[^"\\]|\\.)*"|-?[0-9]+)')  # an "id" key and its value token


@dataclass
class InputSpec:
    """The `input` keys every model function reads, and the one home of their defaults: each
    function YAML extends it (`- /schema_input@input` in its defaults list, registered by
    `forge.cli.searchpath.store_schemas`) and sets only `path`."""

    path: str = MISSING  # JSONL or Parquet file, or "embedded:<name>" (input.dataset, when set, replaces it)
    # a Hugging Face dataset (pip install 'forge[datasets]'): a save_to_disk folder, a dataset in the local Hub
    # cache (read offline), or a builder over local files (json, csv, parquet, arrow) with input.data_files
    dataset: str | None = None
    split: str = "train"  # the dataset's split
    config: str | None = None  # the dataset's configuration (load_dataset's second argument)
    data_files: list[str] = field(default_factory=list)  # the files a builder (input.dataset=json, ...) reads
    # Forge's field -> the dataset's column, e.g. {text: sentence, id: idx} (on the command line:
    # +input.columns.text=sentence); unmapped fields keep their own names
    columns: dict[str, str] = field(default_factory=dict)
    streaming: bool = False  # read the dataset batch by batch, never whole in memory (docs/datasets.md)
    limit: int | None = positive(None)  # take only the first N rows
    duplicate_ids: str = one_of("error", *DUPLICATE_POLICIES)  # a repeated id: refuse | keep first | keep last
    max_row_bytes: int = positive(MAX_ROW_BYTES)  # a longer row fails before it is parsed or tokenized


@dataclass(frozen=True, slots=True)
class Row:
    """A parsed row: its place in the input, its canonical id and its fields."""

    index: int  # zero-based row index (blank lines are not rows)
    line: int | None  # JSONL line number (from 1); None for Parquet
    id: str  # the row's own id as a string, or "#<index>" where it has none
    data: dict  # the row's fields as parsed

    @property
    def where(self) -> str:
        return f"{place(self.index, self.line)} (id {short(self.id)})"

    def reject(self, problem: str, kind: str | None = None) -> Rejected:
        """This row as a recorded failure: `problem` says what is wrong and the fix."""
        return Rejected(self.id, f"{self.where}: {problem}", kind or reason_kind(problem))


# -- checks before any work ---------------------------------------------------------------


def check_input(path: Path, key: str = "input.path", columns: Mapping[str, Column] | None = None) -> Path:
    """The path, if it is a non-empty regular JSONL or Parquet file; a Parquet file's schema
    must also fit `columns` (JSONL rows are checked one by one as they are read)."""
    if not path.exists():
        raise ForgeError(f"{key}={path}: no such file; point {key} at a JSONL or Parquet file")
    if path.is_dir():
        raise ForgeError(f"{key}={path} is a directory; point it at a JSONL or Parquet file")
    if not stat.S_ISREG(path.stat().st_mode):
        raise ForgeError(
            f"{key}={path} is not a regular file (a FIFO, socket or device?); Forge reads the input "
            "more than once (its hash, its row count, its rows): write it to a file first"
        )
    if path.suffix.lower() not in SUFFIXES:
        raise ForgeError(f"{key}={path}: unknown format {path.suffix!r}; use one of {', '.join(SUFFIXES)}")
    if path.stat().st_size == 0:
        raise ForgeError(f"{key}={path} is empty; it needs at least one row with a 'text' field")
    if path.suffix.lower() == ".parquet":
        check_parquet_schema(path, columns or {}, key)  # with no columns: still readable, names unique
    return path


def check_spec(spec: InputSpec) -> None:
    """One ForgeError line for a bad `input` setting (the config schema checks them too; a
    function built in code gets the same lines)."""
    if spec.dataset is None and (spec.columns or spec.data_files or spec.streaming):
        raise ForgeError(
            "input.columns, input.data_files and input.streaming apply to input.dataset only; set "
            "input.dataset=NAME_OR_PATH, or rename the file's columns"
        )
    if spec.duplicate_ids not in DUPLICATE_POLICIES:
        raise ForgeError(f"input.duplicate_ids={spec.duplicate_ids!r}; choose one of: {', '.join(DUPLICATE_POLICIES)}")
    for key, value in (("max_row_bytes", spec.max_row_bytes), ("limit", spec.limit)):
        if value is None and key == "limit":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ForgeError(f"input.{key}={value!r}: must be a positive integer")


def _spec(keys: Mapping[str, Any]) -> InputSpec:
    known = [f.name for f in dataclasses.fields(InputSpec)]
    unknown = sorted(set(keys) - set(known))
    if unknown:
        raise ForgeError(f"input: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(known)}")
    return InputSpec(**keys)


# -- the input, as the functions read it --------------------------------------------------


class InputFile:
    """One input file with its `input` settings: checked, its ids scanned, read as records.

    The constructor does every check that can refuse the input (path, format, schema, repeated
    ids under `duplicate_ids=error`), so a bad input is one line before any work."""

    def __init__(self, path: Path, spec: InputSpec | Mapping[str, Any], columns: Mapping[str, Column] | None = None):
        self.spec = spec if isinstance(spec, InputSpec) else _spec(spec)
        check_spec(self.spec)
        self.path = check_input(path, columns=columns)
        self.source = f"input.path={self.path}"  # where the rows come from, as a message starts
        self.limit = self.spec.limit
        self.max_row_bytes = self.spec.max_row_bytes
        self.duplicate_ids = self.spec.duplicate_ids
        self._drop = self._scan_ids()  # row index -> why it is skipped (a repeated id)
        self._count: int | None = None  # records, once counted

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_drop": {}}  # workers never read rows

    def rows(self, start: int = 0) -> Iterator[Row | Rejected | Skipped]:
        """Every record of the input, in order, as exactly one Row, Rejected or Skipped; from
        record `start` on (a resumed run's read mark: the records before it are not parsed)."""
        for rec in self._records(skip=start):
            if rec.data is None:
                yield Rejected(place(rec.index, rec.line), rec.problem or "", rec.kind or "")
                continue
            rid, problem = canonical_id(rec.data.get("id"), rec.index)
            if problem is not None:
                where = place(rec.index, rec.line)
                yield Rejected(where, f"{where}: {problem}", "bad id")
            elif rec.index in self._drop:
                yield Skipped(
                    rid, self._drop[rec.index], f"duplicate id (input.duplicate_ids={self.duplicate_ids})", rec.line
                )
            else:
                yield Row(rec.index, rec.line, rid, rec.data)

    def count(self) -> int:
        """Records in the input (up to `limit`): what `rows` yields (counted once)."""
        if self._count is None:
            rows = count_rows(self.path, self.max_row_bytes)
            self._count = rows if self.limit is None else min(rows, self.limit)
        return self._count

    def fingerprint(self) -> dict[str, Any]:
        """What of the input decides results: its content and the settings that pick rows."""
        digest = hashlib.sha256()
        with open(self.path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        return {
            "path": str(self.path),
            "bytes": self.path.stat().st_size,
            "sha256": digest.hexdigest(),
            "limit": self.limit,
            "duplicate_ids": self.duplicate_ids,
            "max_row_bytes": self.max_row_bytes,
        }

    # -- reading ---------------------------------------------------------------------
    def _records(self, only: set[int] | None = None, skip: int = 0) -> Iterator[Record]:
        """Every record up to `limit` (with `only`, JSONL lines of other rows are not parsed: a
        placeholder stands in for them), from record `skip` on (lines before it not parsed)."""
        parquet = self.path.suffix.lower() == ".parquet"
        records = (
            parquet_records(self.path, self.max_row_bytes)
            if parquet
            else jsonl_records(self.path, self.max_row_bytes, only, skip)
        )
        for rec in records:
            if self.limit is not None and rec.index >= self.limit:
                return
            if rec.index >= skip:
                yield rec

    def _ids(self, only: set[int] | None = None) -> Iterator[tuple[int, int | None, str]]:
        """(row index, line, canonical id) of every record with a good id (of those in `only`)."""
        for rec in self._records(only):
            rid = good_id(rec)
            if rid is not None and (only is None or rec.index in only):
                yield rec.index, rec.line, rid

    def _candidate_ids(self) -> Iterator[tuple[int, str]]:
        """(row index, id) of every row that may hold an explicit id: a superset of the good ids
        `rows` yields, cheaply. A JSONL line is matched with a regex, and parsed only where that
        could miss (a \\u escape, which could spell the key) or be ambiguous (several "id"
        keys); a line without `"id"` has none. The repeats among them are confirmed on the
        rows themselves (`_ids`)."""
        if self.path.suffix.lower() == ".parquet":
            yield from ((index, rid) for index, _, rid in self._ids())
            return
        with open(self.path, "rb") as f:
            for index, (line_no, raw, _) in enumerate(jsonl_lines(f, self.max_row_bytes)):
                if self.limit is not None and index >= self.limit:
                    return
                if raw is None or (b'"id"' not in raw and b"\\u" not in raw):
                    continue  # over the cap (a failure), or no id: '#<index>' never repeats
                found = _ID_KEY.findall(raw)
                if len(found) == 1 and b"\\u" not in raw:
                    rid = id_token(found[0], index)
                else:
                    rid = good_id(parse_line(index, line_no, raw))
                if rid is not None:
                    yield index, rid

    def _scan_ids(self) -> dict[int, str]:
        """Rows to skip as repeats (first/last), each with its reason; raise under `error`.

        Memory: 16 bytes per row (hash, index), then only the rows whose hash repeats."""
        hashes, indexes = _Int64s(), _Int64s()
        for index, rid in self._candidate_ids():
            hashes.append(hash(rid))
            indexes.append(index)
        h = hashes.array()
        uniq, counts = np.unique(h, return_counts=True)
        suspects = uniq[counts > 1]
        if not len(suspects):
            return {}
        flagged = set(indexes.array()[np.isin(h, suspects)].tolist())
        seen: dict[str, list[tuple[int, int | None]]] = {}
        for index, line, rid in self._ids(only=flagged):
            seen.setdefault(rid, []).append((index, line))
        repeats = {rid: places for rid, places in seen.items() if len(places) > 1}  # a hash collision drops out
        if not repeats:
            return {}
        if self.duplicate_ids == "error":
            raise ForgeError(self._repeats_line(repeats))
        return self._dropped(repeats)

    def _repeats_line(self, repeats: dict[str, list[tuple[int, int | None]]]) -> str:
        rid, places = next(iter(repeats.items()))
        unit = "lines" if places[0][1] is not None else "rows"
        spots = [str(line if line is not None else index) for index, line in places[:3]]
        listed = (", ".join(spots[:-1]) + " and " + spots[-1]) if len(places) <= 3 else ", ".join(spots) + ", ..."
        n = len(repeats)
        return (
            f"{self.source}: {n} {'id repeats' if n == 1 else 'ids repeat'}, e.g. {short(rid)} at "
            f"{unit} {listed}; make ids unique, or set input.duplicate_ids=first or input.duplicate_ids=last "
            "to keep one row of each"
        )

    def _dropped(self, repeats: dict[str, list[tuple[int, int | None]]]) -> dict[int, str]:
        drop: dict[int, str] = {}
        policy = self.duplicate_ids
        for rid, places in repeats.items():
            kept = places[0] if policy == "first" else places[-1]
            there = place(*kept)
            for index, line in places:
                if (index, line) != kept:
                    drop[index] = (
                        f"{place(index, line)} (id {short(rid)}): id {short(rid)} is also at {there}; "
                        f"input.duplicate_ids={policy} keeps {there}"
                    )
        return drop


def read_rows(
    path: Path, limit: int | None = None, max_row_bytes: int = MAX_ROW_BYTES
) -> Iterator[tuple[int, dict | str]]:
    """(zero-based row index, row dict) or (row index, 'line N: reason') for each row, ids
    untouched (`InputFile.rows` applies the id rules)."""
    check_input(path)
    parquet = path.suffix.lower() == ".parquet"
    for rec in parquet_records(path, max_row_bytes) if parquet else jsonl_records(path, max_row_bytes):
        if limit is not None and rec.index >= limit:
            return
        yield rec.index, (rec.data if rec.data is not None else rec.problem or "")


class _Int64s:
    """An append-only int64 column, kept as numpy chunks (8 bytes per value)."""

    def __init__(self, chunk: int = 1 << 16):
        self.chunks: list[np.ndarray] = []
        self.buf: list[int] = []
        self.chunk = chunk

    def append(self, value: int) -> None:
        self.buf.append(value)
        if len(self.buf) >= self.chunk:
            self.chunks.append(np.array(self.buf, np.int64))
            self.buf = []

    def array(self) -> np.ndarray:
        return np.concatenate([*self.chunks, np.array(self.buf, np.int64)])
