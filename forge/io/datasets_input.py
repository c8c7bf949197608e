"""Input rows from a Hugging Face dataset (`input.dataset=NAME_OR_PATH`; the `datasets` extra).

Model: `InputDataset` is an `InputFile` whose records come from Arrow record batches instead
of a file's lines, so every rule after reading is the same: the id rule (a column's value, or
`#<row index>`), `input.duplicate_ids`, `input.max_row_bytes`, `input.limit`, and a row that
cannot be used is a recorded failure naming its row. Where the dataset comes from:

* a `save_to_disk` folder (`state.json`, or `dataset_dict.json` with one folder per split),
  read as the Arrow files it is, without importing `datasets`;
* a builder over local files: `input.dataset=json|csv|parquet|arrow|text` with `input.data_files`;
* otherwise a name in the local Hub cache, read offline (HF_DATASETS_OFFLINE and HF_HUB_OFFLINE
  are set before `datasets` is imported: nothing is downloaded).

`input.columns` maps Forge's fields to the dataset's columns (`{text: sentence, id: idx}`): each
batch's columns are renamed, no value is copied. A missing column or split is one ForgeError
line listing the ones there are. With `input.streaming=true` the rows are read a batch at a time
and never held whole: a `save_to_disk` folder's Arrow files through pyarrow's stream reader (not
a memory map, whose pages would count as the process's memory), a builder through `datasets`'
own streaming. The order is the dataset's, the same on every read, so a resume skips exactly
the rows the journal names (each item's input position) and reads on from there.

This module imports `datasets` only to open a builder or a Hub cache entry; the core never imports it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from forge.errors import ForgeError
from forge.io.ids import canonical_id
from forge.io.inputs import InputFile, InputSpec, _spec, check_spec
from forge.io.readers import Column, Record, batch_records, check_schema, first_line

BUILDERS = ("json", "csv", "parquet", "arrow", "text")
BATCH_ROWS = 4096  # rows per Arrow batch read


def load_datasets():
    """The `datasets` module, offline (one line naming the extra where it is not installed)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise ForgeError(
            "input.dataset needs the Hugging Face datasets package: pip install 'forge[datasets]'"
        ) from None
    datasets.config.HF_HUB_OFFLINE = True  # imported earlier by the caller: offline all the same
    datasets.config.HF_DATASETS_OFFLINE = True
    try:
        import huggingface_hub.constants

        huggingface_hub.constants.HF_HUB_OFFLINE = True
    except ImportError:  # datasets depends on it; an odd install only misses this guard
        pass
    datasets.disable_progress_bars()  # the run prints its own progress
    return datasets


class InputDataset(InputFile):
    """A dataset with its `input` settings: opened and checked at construction (a missing split,
    a missing column: one line before any work), its ids scanned, read as records."""

    def __init__(self, spec: InputSpec | Mapping[str, Any], columns: Mapping[str, Column] | None = None):
        self.spec = spec if isinstance(spec, InputSpec) else _spec(spec)
        check_spec(self.spec)
        self.path = str(self.spec.dataset)  # type: ignore[assignment]  # a name or a folder, for messages
        self.source = f"input.dataset={self.path}"
        self.limit, self.max_row_bytes = self.spec.limit, self.spec.max_row_bytes
        self.duplicate_ids = self.spec.duplicate_ids
        self.mapping = {str(k): str(v) for k, v in dict(self.spec.columns or {}).items()}
        self._source: _Source | None = None
        self.names = self._check(columns or {})
        self._count: int | None = None
        self._drop = self._scan_ids()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_drop": {}, "_source": None}  # workers never read rows

    @property
    def data(self) -> _Source:
        if self._source is None:
            self._source = open_source(self.spec, self.source)
        return self._source

    def _check(self, columns: Mapping[str, Column]) -> list[str]:
        """The columns a row has, under Forge's names (refusing a mapping to no column, or a
        required column the rows lack)."""
        have = self.data.names
        for name, column in self.mapping.items():
            if column not in have:
                raise ForgeError(
                    f"{self.source}: input.columns.{name}={column} names no column of split "
                    f"{self.spec.split!r} (columns: {', '.join(have)}); map {name} to one of them"
                )
        schema = _renamed_schema(self.data.schema, self.mapping)
        for name, need in columns.items():
            if need.required and name not in schema.names:
                raise ForgeError(
                    f"{self.source}: no {name!r} column in split {self.spec.split!r} (columns: {', '.join(have)}); "
                    f"map one to it: input.columns.{name}=COLUMN"
                )
        check_schema(schema, columns, self.source, "or map another column")
        return list(schema.names)

    def count(self) -> int:
        if self._count is None:
            known = self.data.num_rows()
            self._count = known if known is not None else self._counted()
        return self._count if self.limit is None else min(self._count, self.limit)

    def _counted(self) -> int:
        return sum(b.num_rows for b in self.data.batches(self._one_column()))

    def _id_column(self) -> str | None:
        """The source column the rows' ids come from (None: the row index)."""
        id_col = self.mapping.get("id", "id" if "id" not in self.mapping.values() else None)
        return id_col if id_col in self.data.names else None

    def _one_column(self) -> list[str]:
        """The source columns the id scan reads: the id's, else the first (to count rows)."""
        id_col = self._id_column()
        return [id_col] if id_col is not None else self.data.names[:1]

    def fingerprint(self) -> dict[str, Any]:
        digest = hashlib.sha256()
        size = 0
        for path in self.data.files():
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
                    size += len(block)
        return {
            "dataset": self.path,
            "split": self.spec.split,
            "config": self.spec.config,
            "columns": self.mapping,
            "bytes": size,
            "sha256": digest.hexdigest(),
            "limit": self.limit,
            "duplicate_ids": self.duplicate_ids,
            "max_row_bytes": self.max_row_bytes,
        }

    def _records(self, only: set[int] | None = None, skip: int = 0) -> Iterator[Record]:
        """The rows as records, from row `skip` on: earlier batches are passed over by their row
        counts, never converted to Python (a resumed run's read mark)."""
        start = 0
        for batch in self.data.batches():
            if self.limit is not None and start >= self.limit:
                return
            if start + batch.num_rows <= skip:
                start += batch.num_rows
                continue
            if start < skip:
                batch, start = batch.slice(skip - start), skip
            batch = _renamed(batch, self.mapping)
            if self.limit is not None and start + batch.num_rows > self.limit:
                batch = batch.slice(0, self.limit - start)
            yield from batch_records(batch, start, self.max_row_bytes)
            start += batch.num_rows

    def _candidate_ids(self) -> Iterator[tuple[int, str]]:
        has_ids = self._id_column() is not None
        start, counted = 0, 0
        for batch in self.data.batches(self._one_column()):
            if self.limit is not None and start >= self.limit:
                self._count = self.limit  # at least this many: count() says the limit
                return
            counted += batch.num_rows
            if has_ids:
                for k, value in enumerate(batch.column(0).to_pylist()):
                    if value is not None and (self.limit is None or start + k < self.limit):
                        rid, problem = canonical_id(value, start + k)
                        if problem is None:
                            yield start + k, rid
            start += batch.num_rows
        if self._count is None:
            self._count = counted  # the scan read every row: the count comes with it


# -- sources: where the record batches come from ---------------------------------------------


class _Source:
    """One split of a dataset as Arrow record batches, read from the start on each call."""

    names: list[str]
    schema: Any

    def batches(self, columns: list[str] | None = None) -> Iterator[Any]:
        raise NotImplementedError

    def num_rows(self) -> int | None:
        return None

    def files(self) -> list[str]:
        """The files whose bytes are the split's rows (its fingerprint)."""
        raise NotImplementedError


class _TableSource(_Source):
    """An in-memory or memory-mapped `datasets.Dataset` (its Arrow table, batch by batch)."""

    def __init__(self, ds, sources: list[str] | None = None):
        self.ds = ds.flatten_indices() if getattr(ds, "_indices", None) is not None else ds
        self.schema = self.ds.data.schema
        self.names = list(self.schema.names)
        self.sources = sources  # a builder's own files: its fingerprint, streamed or not

    def batches(self, columns: list[str] | None = None) -> Iterator[Any]:
        table = self.ds.data.table
        if columns is not None:
            table = table.select(columns)
        yield from table.to_batches(max_chunksize=BATCH_ROWS)

    def num_rows(self) -> int | None:
        return self.ds.num_rows

    def files(self) -> list[str]:
        return list(self.sources) if self.sources is not None else [f["filename"] for f in self.ds.cache_files]


class _ArrowFiles(_Source):
    """A save_to_disk split: its Arrow stream files (`state.json`'s `_data_files`), a batch at a
    time, memory-mapped as `datasets.load_from_disk` maps them, or (`streaming`) read through
    pyarrow's stream reader, whose batches are freed once read (a map's pages would count as
    the process's memory). `datasets` itself is not imported."""

    def __init__(self, folder: Path, source: str, streaming: bool):
        import pyarrow as pa

        try:
            state = json.loads((folder / "state.json").read_text())
            self.paths = [str(folder / f["filename"]) for f in state["_data_files"]]
            with self._open(self.paths[0]) as f:
                self.schema = pa.ipc.open_stream(f).schema
        except (OSError, ValueError, KeyError, IndexError, TypeError, pa.ArrowException) as exc:
            raise ForgeError(
                f"{source}: cannot be read as a saved dataset ({first_line(exc)}); save it again"
            ) from None
        self.streaming = streaming
        self.names = list(self.schema.names)

    @staticmethod
    def _open(path: str, streaming: bool = True):
        import pyarrow as pa

        return pa.OSFile(path) if streaming else pa.memory_map(path)

    def batches(self, columns: list[str] | None = None) -> Iterator[Any]:
        import pyarrow as pa

        for path in self.paths:
            with self._open(path, self.streaming) as f:
                for batch in pa.ipc.open_stream(f):
                    for lo in range(0, batch.num_rows, BATCH_ROWS):
                        part = batch.slice(lo, BATCH_ROWS)
                        yield part if columns is None else part.select(columns)

    def files(self) -> list[str]:
        return list(self.paths)


class _Streamed(_Source):
    """A `datasets.IterableDataset` (a builder over local files, streamed), as Arrow batches."""

    def __init__(self, ds, data_files: list[str]):
        self.ds, self.data_files = ds, data_files
        first = next(iter(ds.with_format("arrow").iter(batch_size=1)), None)
        if first is None:
            raise ForgeError(f"input.dataset: the files {', '.join(data_files)} hold no rows; give files with rows")
        self.schema = first.schema
        self.names = list(self.schema.names)

    def batches(self, columns: list[str] | None = None) -> Iterator[Any]:
        ds = self.ds if columns is None else self.ds.select_columns(columns)
        for table in ds.with_format("arrow").iter(batch_size=BATCH_ROWS):
            yield from table.to_batches()

    def files(self) -> list[str]:
        return list(self.data_files)


def open_source(spec: InputSpec, source: str) -> _Source:
    """The split `spec` names, opened (one ForgeError line for a missing one, or a dataset
    that cannot be read)."""
    name = str(spec.dataset)
    folder = Path(name).expanduser()
    if folder.is_dir() and ((folder / "state.json").exists() or (folder / "dataset_dict.json").exists()):
        return _from_disk(folder, spec, source)
    if name in BUILDERS:
        return _from_builder(name, spec, source)
    if spec.data_files:
        raise ForgeError(
            f"{source}: input.data_files goes with a builder ({', '.join(BUILDERS)}); set input.dataset to one"
        )
    return _from_hub_cache(name, spec, source)


def _from_disk(folder: Path, spec: InputSpec, source: str) -> _Source:
    if (folder / "dataset_dict.json").exists():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        if spec.split not in splits:
            raise ForgeError(f"{source}: no split {spec.split!r} (splits: {', '.join(splits)}); set input.split")
        folder = folder / spec.split
    else:  # one Dataset: its split is the one it was saved as (none: any name but another one asked for)
        own = json.loads((folder / "state.json").read_text()).get("_split") or "train"
        if spec.split != own:
            raise ForgeError(
                f"{source}: one dataset saved with save_to_disk (split {own!r}), not a DatasetDict: it has no "
                f"split {spec.split!r}; leave input.split out, or set it to {own!r}"
            )
    return _ArrowFiles(folder, source, spec.streaming)


def _from_builder(name: str, spec: InputSpec, source: str) -> _Source:
    files = [str(f) for f in spec.data_files]
    if not files:
        raise ForgeError(f"{source}: a builder reads local files; set input.data_files=[FILE,...]")
    missing = [f for f in files if not Path(f).expanduser().is_file()]
    if missing:
        raise ForgeError(f"{source}: input.data_files names {missing[0]}, which is not a file; fix the path")
    if spec.split != "train":
        raise ForgeError(f"{source}: no split {spec.split!r} (splits: train); a builder's files are split 'train'")
    datasets = load_datasets()
    try:
        ds = datasets.load_dataset(name, data_files=files, split="train", streaming=spec.streaming)
    except Exception as exc:  # noqa: BLE001
        raise ForgeError(f"{source}: its files cannot be read ({first_line(exc)}); fix them") from None
    return _Streamed(ds, files) if spec.streaming else _TableSource(ds, files)


def _from_hub_cache(name: str, spec: InputSpec, source: str) -> _Source:
    datasets = load_datasets()
    try:
        found = datasets.load_dataset(name, spec.config)
    except Exception as exc:  # noqa: BLE001  (not cached, no such config: offline, nothing is fetched)
        raise ForgeError(
            f"{source}: not a save_to_disk folder, a builder ({', '.join(BUILDERS)}) or a dataset in the "
            f"local Hugging Face cache ({first_line(exc)}); download it first, or give its folder"
        ) from None
    if spec.split not in found:
        raise ForgeError(f"{source}: no split {spec.split!r} (splits: {', '.join(found)}); set input.split")
    return _TableSource(found[spec.split])


# -- renaming columns ---------------------------------------------------------------------


def _renamed_schema(schema, mapping: Mapping[str, str]):
    import pyarrow as pa

    return pa.schema([schema.field(c).with_name(n) for n, c in _layout(list(schema.names), mapping)])


def _renamed(batch, mapping: Mapping[str, str]):
    """The batch with Forge's names (a column a mapped field shadows is left out); no copy."""
    if not mapping:
        return batch
    import pyarrow as pa

    names = list(batch.schema.names)
    layout = _layout(names, mapping)
    return pa.RecordBatch.from_arrays([batch.column(names.index(c)) for _, c in layout], [n for n, _ in layout])


def _layout(names: list[str], mapping: Mapping[str, str]) -> list[tuple[str, str]]:
    """(Forge's name, source column) for each column a row has: a mapped column under each
    field mapped to it, an unmapped one under its own name unless a mapped field takes it."""
    out: list[tuple[str, str]] = []
    for c in names:
        fields = [n for n, source in mapping.items() if source == c]
        out += [(n, c) for n in fields] if fields else [(c, c)] if c not in mapping else []
    return out
