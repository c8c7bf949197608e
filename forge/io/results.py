"""A function's results: what it declares it writes (`ResultSchema`) and reading them back.

    run_dir/<folder>/meta.json          format, fields, meta_key, and the function's own meta
    run_dir/<folder>/shard-SSS-KKKKK.*  .safetensors (one tensor per field) or .parquet (a table)
    run_dir/<folder>/aggregate.json     the dataset result (`Aggregate`s) as the last close folded it
    run_dir/commits.jsonl (or commits/*.json)  one record per shard: file, index, ids (and per-item meta)

A result is one row per committed item: its `id`, its input `index` and one value per
field (a scalar, a fixed shape, a string, or ragged: a variable number of values per item,
each of the field's shape, such as one hidden state per token: [tokens, hidden]).
`load` reads only journaled shards (`forge.io.store.read_journal`) and puts rows back in input
order; `shards` streams them one shard at a time. The one sink (`forge.io.sinks`) writes them.
Dataset-level results (`forge.io.aggregate.Aggregate`) are folded from every committed item:
`load(run).aggregate`, or `aggregate(run)` alone.
`run_dir` is a local path or an fsspec URL (`forge.io.location`).
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from forge.errors import ForgeError
from forge.io.aggregate import Aggregate, dataset_result
from forge.io.location import Location, open_location
from forge.io.store import read_journal

META = "meta.json"
FORMATS = {"safetensors": ".safetensors", "parquet": ".parquet"}
STRING = "string"  # dtype of a text field (Parquet only)
BFLOAT16 = "bfloat16"  # held in numpy as its uint16 bit patterns; a real BF16 tensor in safetensors shards
RESERVED = ("id", "index")  # columns every result row has
SHARD_BYTES = 256 << 20  # a shard is cut once its rows hold this many bytes (the default of every result schema)
OFFSETS = ".offsets"  # safetensors: a ragged field is its values end to end plus <name>.offsets [rows + 1]


def _numpy_dtype(dtype: str) -> bool:
    try:
        np.dtype(dtype)
    except TypeError:
        return False
    return True


def storage_dtype(dtype: str) -> str:
    """The numpy dtype a field's values are held in (bfloat16: its bit patterns, uint16)."""
    return "uint16" if dtype == BFLOAT16 else dtype


def to_storage(values, dtype: str) -> np.ndarray:
    """Values (numpy, or a torch tensor) as a field of `dtype` holds them in numpy: floats cast
    to bfloat16 become bit patterns, rounded to nearest as torch rounds."""
    if dtype != BFLOAT16:
        if hasattr(values, "numpy"):  # a torch tensor
            values = values.detach().cpu().numpy()
        return np.asarray(values).astype(dtype, copy=False)
    import torch

    t = values if isinstance(values, torch.Tensor) else None
    if t is None:
        arr = np.asarray(values)
        if arr.dtype == np.uint16:  # bit patterns already
            return arr
        t = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
    return t.detach().to("cpu", torch.bfloat16).contiguous().view(torch.uint16).numpy()


def bfloat16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) as float32 (exact: every bfloat16 is a float32)."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


@dataclass(frozen=True)
class Field:
    """One per-item result value: a column of a table, or a tensor with a row per item."""

    name: str  # column (Parquet) or tensor (safetensors) name
    dtype: str  # numpy dtype name (float32, float16, int64, int32, bool), "bfloat16", or "string" (Parquet only)
    shape: tuple[int, ...] | None = ()  # per-value shape: () a scalar, (hidden,) a vector; None: any, same for all
    ragged: bool = False  # a variable number of values per item: an array [n, *shape] each (per-token values)

    @property
    def itemsize(self) -> int | None:
        """Bytes of one number of this field (None: a string)."""
        return None if self.dtype == STRING else np.dtype(storage_dtype(self.dtype)).itemsize

    def value_bytes(self) -> int | None:
        """Bytes of one value (one item's, or one token's when ragged); None: not known before the run."""
        if self.itemsize is None or self.shape is None:
            return None
        return self.itemsize * int(np.prod(self.shape, dtype=np.int64))

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": None if self.shape is None else list(self.shape),
            "ragged": self.ragged,
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Field:
        shape = d.get("shape", ())
        return Field(d["name"], d["dtype"], None if shape is None else tuple(shape), bool(d.get("ragged", False)))


@dataclass(frozen=True)
class ResultSchema:
    """What a function writes per item, and how it is committed."""

    fields: tuple[Field, ...]  # the values each item yields, in column order
    format: str = "parquet"  # parquet: a table row per item | safetensors: a tensor per field, a row per item
    folder: str = "results"  # subfolder of the run directory holding the shards and meta.json
    rows_per_shard: int = 4096  # the loop commits a shard once this many rows wait
    bytes_per_shard: int = SHARD_BYTES  # ... or once the rows waiting hold this many bytes (per-token states)
    meta_key: str | None = None  # journal key recording each item's `meta` (e.g. "labels"); None: not kept
    meta: dict[str, Any] = field(default_factory=dict)  # written to meta.json (model, pooling, ...)
    aggregates: tuple[Aggregate, ...] = ()  # dataset-level results folded from every item (none per item)

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ForgeError(f"result format {self.format!r}; choose one of: {', '.join(FORMATS)}")
        names = [f.name for f in self.fields] + [a.name for a in self.aggregates]
        if not names:
            raise ForgeError("a function needs at least one result field or aggregate; declare its fields")
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ForgeError(f"result fields {twice} are named twice (a layer or capture twice?); list each once")
        if reserved := sorted(set(names) & set(RESERVED)):
            raise ForgeError(f"result fields {reserved}: {', '.join(RESERVED)} are Forge's own columns; rename them")
        for f in self.fields:
            if f.dtype not in (STRING, BFLOAT16) and not _numpy_dtype(f.dtype):
                raise ForgeError(
                    f"result field {f.name!r}: dtype {f.dtype!r} is not one numpy knows; use float32, float16, "
                    "bfloat16, int64, int32, bool or string"
                )
        if self.format == "safetensors" and any(f.dtype == STRING for f in self.fields):
            raise ForgeError("result format safetensors holds tensors only; write string fields as parquet")
        if self.format == "parquet" and any(f.dtype == BFLOAT16 for f in self.fields):
            raise ForgeError("result format parquet has no bfloat16; write bfloat16 fields as safetensors")
        if self.rows_per_shard < 1 or self.bytes_per_shard < 1:
            raise ForgeError(
                f"rows_per_shard and bytes_per_shard must be positive, got {self.rows_per_shard} "
                f"and {self.bytes_per_shard}"
            )

    def output_bytes(self, items: int, own_tokens: int) -> dict[str, int | None]:
        """Bytes each field will hold for `items` items whose own tokens (after their prefixes)
        number `own_tokens`: a ragged field is taken to hold one value per own token. None: a
        field whose size is not known before the run (strings, shapes left open)."""
        out: dict[str, int | None] = {}
        for f in self.fields:
            per = f.value_bytes()
            out[f.name] = None if per is None else per * (own_tokens if f.ragged else items)
        return out

    def describe(self) -> dict[str, Any]:
        """meta.json: the function's meta plus how to read the shards."""
        return {
            **self.meta,
            "format": self.format,
            "fields": [f.as_dict() for f in self.fields],
            "meta_key": self.meta_key,
            **({"aggregates": [a.as_dict() for a in self.aggregates]} if self.aggregates else {}),
        }


@dataclass
class Results:
    """A run's results, rows in input order."""

    ids: list[str]  # item ids
    index: np.ndarray  # input position of each row (int64, ascending)
    columns: dict[str, np.ndarray]  # field name -> array [rows, *shape] (object array for strings and ragged fields)
    meta: list[Any] | None  # each item's meta (labels, ...) where the function keeps it
    info: dict[str, Any]  # meta.json: format, fields and the function's own meta
    aggregate: dict[str, Any] = field(default_factory=dict)  # the dataset result (`aggregate`); {}: none

    def __len__(self) -> int:
        return len(self.ids)

    def table(self):
        """The results as one pyarrow Table: id, index, then the fields."""
        import pyarrow as pa

        data: dict[str, Any] = {"id": pa.array(self.ids, pa.string()), "index": pa.array(self.index, pa.int64())}
        for name, values in self.columns.items():
            data[name] = _arrow_column(values)
        return pa.table(data)

    def to_dataset(self):
        """The results as a Hugging Face `datasets.Dataset` (the `datasets` extra) over `table()`:
        Arrow buffers that share the numeric columns' memory, not copied again; ready for
        `save_to_disk` or `push_to_hub`."""
        try:
            import datasets
        except ImportError:
            raise ForgeError(
                "to_dataset() needs the Hugging Face datasets package: pip install 'forge[datasets]'"
            ) from None
        return datasets.Dataset(self.table())


def result_folders(run_dir) -> list[str]:
    """Folders of the run directory that hold committed results (journal order)."""
    seen: dict[str, None] = {}
    for line in read_journal(run_dir):
        seen.setdefault(posixpath.dirname(line["file"]), None)
    for rel in sorted(open_location(run_dir).files()):  # results with nothing committed yet
        folder, _, name = rel.rpartition("/")
        if name == META and folder and "/" not in folder:
            seen.setdefault(folder, None)
    return list(seen)


def read_info(run_dir, folder: str) -> dict[str, Any]:
    """A results folder's meta.json; folders written before ResultSchema (probe_gen's
    activations: layers only) read as safetensors with a `layer_<L>` field per layer."""
    where = open_location(run_dir)
    if not where.exists(f"{folder}/{META}"):
        there = result_folders(run_dir)
        raise ForgeError(
            f"{run_dir}: no {folder}/{META}; "
            + (f"this run's results are in {', '.join(there)}/" if there else "is this a Forge run directory?")
        )
    info = json.loads(where.read_bytes(f"{folder}/{META}"))
    if "format" not in info and "layers" in info:
        info = {
            **info,
            "format": "safetensors",
            "meta_key": "labels",
            "fields": [{"name": f"layer_{layer}", "dtype": "float32", "shape": None} for layer in info["layers"]],
        }
    return info


def _folder(run_dir, folder: str | None) -> str:
    """`folder`, or the run's one results folder (a folder whose meta.json says it is `part_of`
    another, such as probe_gen's prefix_states/, is not a candidate)."""
    if folder is not None:
        return folder
    folders = result_folders(run_dir)
    if len(folders) > 1:
        where = open_location(run_dir)
        folders = [f for f in folders if "part_of" not in json.loads(where.read_bytes(f"{f}/{META}"))] or folders
    if len(folders) != 1:
        raise ForgeError(
            f"{run_dir}: {'no results' if not folders else 'results in ' + ', '.join(folders)}; "
            + ("is this a Forge run directory?" if not folders else "pass folder=<one of them>")
        )
    return folders[0]


def shards(run_dir, folder: str | None = None) -> Iterator[Results]:
    """The committed results of a run shard by shard, in commit order (each shard's rows in its
    own order), one shard in memory at a time: for results larger than memory."""
    folder = _folder(run_dir, folder)
    info = read_info(run_dir, folder)
    fields = [Field.from_dict(d) for d in info["fields"]]
    meta_key = info.get("meta_key")
    where = open_location(run_dir)
    for line in read_journal(run_dir):
        if posixpath.dirname(line["file"]) != folder:
            continue
        values = _read_shard(where, line["file"], info["format"], fields)
        meta = line.get(meta_key, [None] * len(line["ids"])) if meta_key else None
        yield Results(list(line["ids"]), np.asarray(line["index"], np.int64), values, meta, info)


def load(run_dir, folder: str | None = None) -> Results:
    """The committed results of a run, rows in input order: any function's, from a local path
    or an fsspec URL. `folder` picks one results folder when a run has several (default: its only one)."""
    folder = _folder(run_dir, folder)
    info = read_info(run_dir, folder)
    fields = [Field.from_dict(d) for d in info["fields"]]
    parts = list(shards(run_dir, folder))
    ids = [i for part in parts for i in part.ids]
    index = np.concatenate([part.index for part in parts]) if parts else np.zeros(0, np.int64)
    order = np.argsort(index, kind="stable")
    columns = {f.name: _concat([part.columns[f.name] for part in parts], f)[order] for f in fields}
    meta = [m for part in parts for m in (part.meta or ())] if info.get("meta_key") else None
    ordered_meta = [meta[i] for i in order] if meta else meta
    return Results(
        [ids[i] for i in order], index[order], columns, ordered_meta, info, _aggregate(run_dir, folder, info)
    )


def aggregate(run_dir, folder: str | None = None) -> dict[str, Any]:
    """A run's dataset result, without reading per-item values: name -> value (a float, an int
    for count, a float64 array) or, for `by="label"`, name -> {label: value}; {} when the
    function declares no `Aggregate`. A closed run's includes its `finish` values; a partial
    run's is the committed shards folded now (and has none)."""
    folder = _folder(run_dir, folder)
    return _aggregate(run_dir, folder, read_info(run_dir, folder))


def _aggregate(run_dir, folder: str, info: dict[str, Any]) -> dict[str, Any]:
    aggregates = [Aggregate.from_dict(d) for d in info.get("aggregates", ())]
    return dataset_result(open_location(run_dir), folder, aggregates, read_journal(run_dir)) if aggregates else {}


def _read_shard(where: Location, rel: str, fmt: str, fields: list[Field]) -> dict[str, np.ndarray]:
    """A shard's fields: mapped from a local disk, read whole from an object store (bfloat16
    fields come back as float32, which holds every bfloat16 exactly)."""
    path = where.local_file(rel)
    wanted = [f.name for f in fields]
    if fmt == "safetensors":
        if any(f.dtype == BFLOAT16 for f in fields):  # numpy has no bfloat16: read through torch
            from safetensors.torch import load as load_pt, load_file as load_file_pt

            raw = load_file_pt(str(path)) if path is not None else load_pt(where.read_bytes(rel))
            tensors = {k: (v.float() if str(v.dtype) == "torch.bfloat16" else v).numpy() for k, v in raw.items()}
        else:
            from safetensors.numpy import load, load_file

            tensors = load_file(str(path)) if path is not None else load(where.read_bytes(rel))
        return {
            name: _split_ragged(tensors[name], tensors[name + OFFSETS]) if name + OFFSETS in tensors else tensors[name]
            for name in wanted
        }
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = str(path) if path is not None else pa.BufferReader(where.read_bytes(rel))
    table = pq.read_table(source, columns=list(wanted), thrift_string_size_limit=2**31 - 1)  # big partials
    return {name: _numpy_column(table.column(name)) for name in wanted}


def _numpy_column(column) -> np.ndarray:
    """A Parquet column as numpy: scalars as they are, fixed-size lists as [rows, *shape],
    lists (ragged) as one array [n, *shape] per row."""
    import pyarrow as pa

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        return np.asarray(column.to_pylist(), dtype=object)
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):  # ragged: one array per row
        offsets = column.offsets.to_numpy()
        flat = column.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
        return _split_ragged(_numpy_column(flat), offsets - offsets[0])
    if pa.types.is_fixed_size_list(column.type):
        shape = []
        arr, kind = column, column.type
        while pa.types.is_fixed_size_list(kind):
            shape.append(kind.list_size)
            arr, kind = arr.flatten(), kind.value_type
        return arr.to_numpy(zero_copy_only=False).reshape(len(column), *shape)
    return column.to_numpy(zero_copy_only=False)


def _arrow_column(values: np.ndarray):
    """A numpy column for a pyarrow table: [rows, *shape] becomes nested fixed-size lists, a
    ragged column (one array [n, *shape] per row) a list of them."""
    import pyarrow as pa

    if values.dtype == object and len(values) and isinstance(values[0], np.ndarray):  # ragged
        offsets = np.concatenate([[0], np.cumsum([len(v) for v in values])]).astype(np.int32)
        flat = np.concatenate(list(values))
        return pa.ListArray.from_arrays(pa.array(offsets), _arrow_column(flat))
    if values.dtype == object:
        return pa.array(values.tolist(), pa.string())
    arr = pa.array(np.ascontiguousarray(values).reshape(-1))
    for size in reversed(values.shape[1:]):
        arr = pa.FixedSizeListArray.from_arrays(arr, size)
    return arr


def ragged_array(values: list) -> np.ndarray:
    """A 1-D object array holding one array per row (numpy would otherwise try to stack them)."""
    out = np.empty(len(values), dtype=object)
    for k, v in enumerate(values):
        out[k] = v
    return out


def _split_ragged(flat: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    return ragged_array([flat[a:b] for a, b in zip(offsets[:-1], offsets[1:])])


def _concat(chunks: list[np.ndarray], f: Field) -> np.ndarray:
    if chunks:
        return np.concatenate(chunks)
    dtype = object if f.dtype == STRING or f.ragged else np.dtype("float32" if f.dtype == BFLOAT16 else f.dtype)
    return np.zeros((0, *(f.shape or ())), dtype)
