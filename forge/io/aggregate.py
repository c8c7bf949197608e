"""Dataset-level results: values folded from every committed item (`Aggregate`), not stored per item.

A function lists `Aggregate`s among its fields; `reduce(view)` returns a value for each one
(a number or an array of one fixed shape; for `count`, anything). The sink folds each shard's
items into a *partial* (float64 sums, int64 counts, and for `cov` the sum of outer products
about the group's mean), grouped by item label when `by="label"`, and commits it inside the
shard itself, so a partial counts exactly when its shard's journal record counts:

    safetensors shard: tensors  __aggregate__/<name>/<group>/<count|sum|m2>
    parquet shard:     the file's key-value metadata b"forge.aggregate": those tensors, as safetensors bytes

<group> is the label as JSON (`json.dumps(label)`; "" for `by=None`). Reading folds the
partials of the journaled shards in ascending order of each shard's first item index, in
float64 (pairs merged as Chan et al.'s parallel variance), so a resumed run equals a clean one
up to float64 rounding. At close the sink writes the folded values, with the function's
`finish` values, to <folder>/aggregate.json (+ aggregate.safetensors for arrays), tagged with
a digest of the shards folded: a reader uses them only while the journal still names exactly
those shards, and otherwise folds the partials itself.
"""

from __future__ import annotations

import hashlib
import io
import json
import posixpath
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from forge.errors import ForgeError
from forge.io.location import Location

OPS = ("sum", "mean", "count", "cov")
PREFIX = "__aggregate__/"  # safetensors shards: the reserved prefix of partials' tensors
PARQUET_KEY = b"forge.aggregate"  # parquet shards: key-value metadata holding the partial
RESULT_JSON, RESULT_TENSORS = "aggregate.json", "aggregate.safetensors"
DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "U8": "u1", "BOOL": "?"}
ARRAY = "__array__"  # aggregate.json: {"__array__": key} is a tensor of aggregate.safetensors
ITEMS = "__items__"  # aggregate.json: {"__items__": [[key, value], ...]}: a dict (keys any JSON value)

Stats = dict[str, np.ndarray]  # "count": int64 (), "sum": float64 [*shape], "m2": float64 [d, d] (cov)
Partial = dict[str, dict[str, Stats]]  # aggregate name -> group key -> stats


@dataclass(frozen=True)
class Aggregate:
    """A dataset-level result folded from every item's value (not stored per item)."""

    name: str  # the value reduce() returns under this name, and the result's name
    op: str = "sum"  # sum | mean | count | cov   (cov: covariance matrix of vectors, n-1 denominator)
    by: str | None = None  # None: one result for the dataset; "label": one result per item label

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ForgeError(f"aggregate {self.name!r}: op={self.op!r}; choose one of: {', '.join(OPS)}")
        if self.by not in (None, "label"):
            raise ForgeError(f"aggregate {self.name!r}: by={self.by!r}; choose None or 'label'")
        if not self.name or "/" in self.name:
            raise ForgeError(f"aggregate name {self.name!r}: need a non-empty name without '/'")

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "op": self.op, "by": self.by}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Aggregate:
        return Aggregate(d["name"], d.get("op", "sum"), d.get("by"))


def label_of(item: Any) -> Any:
    """An item's label: `item.meta.label` (an ItemMeta), else `item.meta` itself."""
    return getattr(item.meta, "label", item.meta)


def group_key(label: Any) -> str:
    """The JSON text of a label (a number, string, bool or None): a group's key, `json.loads` gives it back."""
    if hasattr(label, "item") and np.ndim(label) == 0:  # a numpy or torch scalar
        label = label.item()
    if label is not None and not isinstance(label, (bool, int, float, str)):
        raise ForgeError(f"aggregate by label: the label {label!r} is not a number, string, bool or None")
    return json.dumps(label)


# -- one batch's values -----------------------------------------------------------------
def _float64(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor (bfloat16 included), without importing torch
        value = value.detach().cpu().double().numpy()
    return np.asarray(value)


def check_values(agg: Aggregate, column: Any, n: int, shapes: dict[str, tuple[int, ...]]) -> np.ndarray | None:
    """A batch's values of `agg` as float64 [n, *shape] (None for count), the shape the same for
    every item (`shapes` remembers it across batches)."""
    if isinstance(column, (list, tuple)) or (hasattr(column, "detach") and column.ndim):
        rows = [_float64(v) for v in column]
        shape_set, given = sorted({r.shape for r in rows}), len(rows)
    else:
        array = np.asarray(column)
        rows, shape_set, given = [], [array.shape[1:]], len(array) if array.ndim else 0
    if given != n:
        raise ForgeError(f"aggregate {agg.name!r}: the worker gave {given} values for {n} item(s)")
    if agg.op == "count":
        return None
    seen = shapes.setdefault(agg.name, shape_set[0])
    if len(shape_set) > 1 or shape_set[0] != seen:
        got = ", ".join(str(s) for s in sorted({*shape_set, seen}))
        raise ForgeError(f"aggregate {agg.name!r}: every item's value must have one shape; the items gave {got}")
    if agg.op == "cov" and len(seen) != 1:
        raise ForgeError(f"aggregate {agg.name!r}: op=cov needs a 1-D vector per item, the items gave shape {seen}")
    values = np.stack(rows) if rows else np.asarray(column)
    if values.dtype.kind not in "biuf":
        raise ForgeError(f"aggregate {agg.name!r}: op={agg.op} needs numbers, the worker gave {values.dtype}")
    return values.astype(np.float64, copy=False).reshape(n, *seen)


def stats_of(agg: Aggregate, values: np.ndarray | None, n: int) -> Stats:
    """One group's stats from its rows."""
    out: Stats = {"count": np.asarray(n, np.int64)}
    if values is not None:
        out["sum"] = values.sum(axis=0)
        if agg.op == "cov":
            centered = values - out["sum"] / max(n, 1)
            out["m2"] = centered.T @ centered
    return out


def fold_rows(agg: Aggregate, values: np.ndarray | None, keys: Sequence[str]) -> dict[str, Stats]:
    """Rows' stats by group (`keys[i]`: row i's group key)."""
    order = np.asarray(keys, dtype=object)
    groups: dict[str, Stats] = {}
    for key in sorted(set(keys)):
        rows = np.flatnonzero(order == key)
        groups[key] = stats_of(agg, None if values is None else values[rows], len(rows))
    return groups


def merge_stats(a: Stats, b: Stats) -> Stats:
    """Two groups' stats as one (Chan et al.: the centered sums merged exactly in real numbers)."""
    na, nb = int(a["count"]), int(b["count"])
    out: Stats = {"count": np.asarray(na + nb, np.int64)}
    if "sum" in a:
        out["sum"] = a["sum"] + b["sum"]
    if "m2" in a:
        delta = b["sum"] / nb - a["sum"] / na
        out["m2"] = a["m2"] + b["m2"] + np.outer(delta, delta) * (na * nb / (na + nb))
    return out


def merge(into: Partial, more: Partial) -> Partial:
    """`more` folded into `into` (changed in place, and returned)."""
    for name, groups in more.items():
        mine = into.setdefault(name, {})
        shapes = sorted({_shape(stats) for stats in [*mine.values(), *groups.values()]}, key=str)
        if len(shapes) > 1:
            got = ", ".join(map(str, shapes))
            raise ForgeError(f"aggregate {name!r}: every item's value must have one shape; the shards hold {got}")
        for key, stats in groups.items():
            mine[key] = merge_stats(mine[key], stats) if key in mine else stats
    return into


def _shape(stats: Stats) -> tuple[int, ...] | None:
    return tuple(stats["sum"].shape) if "sum" in stats else None


def finalize(partial: Partial, aggregates: Iterable[Aggregate]) -> dict[str, Any]:
    """The dataset result: name -> value, or name -> {label: value} for `by="label"`."""
    out: dict[str, Any] = {}
    for agg in aggregates:
        groups = partial.get(agg.name, {})
        if agg.by is None:
            out[agg.name] = _value(agg, groups[""]) if "" in groups else (0 if agg.op == "count" else None)
            continue
        values = {json.loads(key): _value(agg, groups[key]) for key in sorted(groups)}
        if len(values) != len(groups):  # True and 1, or 1.0 and 1: one key in a Python dict
            raise ForgeError(f"aggregate {agg.name!r}: labels {sorted(groups)} collide as Python dict keys")
        out[agg.name] = values
    return out


def _value(agg: Aggregate, stats: Stats) -> Any:
    n = int(stats["count"])
    if agg.op == "count":
        return n
    if agg.op == "cov":
        m2 = stats["m2"]
        return m2 / (n - 1) if n > 1 else np.full(m2.shape, np.nan)
    value = stats["sum"] / n if agg.op == "mean" else stats["sum"]
    return float(value) if np.ndim(value) == 0 else np.asarray(value, np.float64)


# -- partials in shards -------------------------------------------------------------------
def to_tensors(partial: Partial) -> dict[str, np.ndarray]:
    """A partial as named tensors (the reserved prefix, then name/group/part)."""
    return {
        f"{PREFIX}{name}/{key}/{part}": np.asarray(array, order="C")  # (ascontiguousarray makes 0-d 1-d)
        for name, groups in partial.items()
        for key, stats in groups.items()
        for part, array in stats.items()
    }


def from_tensors(tensors: dict[str, np.ndarray]) -> Partial:
    """The partial held by a shard's tensors (others are ignored)."""
    partial: Partial = {}
    for full, array in tensors.items():
        if full.startswith(PREFIX):
            name, _, rest = full[len(PREFIX) :].partition("/")
            key, _, part = rest.rpartition("/")
            partial.setdefault(name, {}).setdefault(key, {})[part] = array
    return partial


def partial_bytes(partial: Partial) -> bytes:
    """A partial as safetensors bytes (parquet shards keep it in their key-value metadata)."""
    from safetensors.numpy import save

    return save(to_tensors(partial))


def read_safetensors(f: Any, wanted: Callable[[str], bool]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The tensors of a safetensors file (a binary file object) whose names are `wanted`, and its
    metadata; reads the header and those tensors only."""
    n = int.from_bytes(f.read(8), "little")
    header = json.loads(f.read(n))
    meta = header.pop("__metadata__", None) or {}
    out = {}
    for name, t in header.items():
        if wanted(name):
            if t["dtype"] not in DTYPES:
                raise ForgeError(f"aggregate tensor {name!r}: dtype {t['dtype']} is not one Forge writes")
            start, end = t["data_offsets"]
            f.seek(8 + n + start)
            out[name] = np.frombuffer(f.read(end - start), DTYPES[t["dtype"]]).reshape(t["shape"])
    return out, meta


def read_partial(where: Location, rel: str) -> Partial:
    """The partial committed in one shard (its file under the run directory)."""
    path = where.local_file(rel)
    if rel.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        source = str(path) if path is not None else pa.BufferReader(where.read_bytes(rel))
        meta = pq.ParquetFile(source, thrift_string_size_limit=2**31 - 1).metadata.metadata or {}
        data = meta.get(PARQUET_KEY)
        return {} if data is None else from_tensors(read_safetensors(io.BytesIO(data), lambda _: True)[0])
    with open(path, "rb") if path is not None else io.BytesIO(where.read_bytes(rel)) as f:
        return from_tensors(read_safetensors(f, lambda name: name.startswith(PREFIX))[0])


def in_folder(records: Iterable[dict], folder: str) -> list[dict]:
    """The journal records of a folder's shards, in fold order: ascending first item index."""
    mine = [r for r in records if posixpath.dirname(r["file"]) == folder and r.get("index")]
    return sorted(mine, key=lambda r: min(r["index"]))


def digest(records: Iterable[dict]) -> str:
    """What identifies a set of shards: a hash of their file names."""
    return hashlib.sha256("\n".join(sorted(r["file"] for r in records)).encode()).hexdigest()


def fold(where: Location, records: list[dict], aggregates: Sequence[Aggregate], known: dict | None = None) -> Partial:
    """The partials of `records` (fold order) folded; `known`: partials already in memory, by file.
    A shard whose partial does not hold every aggregate as declared is refused (the function's
    aggregates changed since it was written: folding it would count some items for some only)."""
    total: Partial = {}
    for record in records:
        part = (known or {}).get(record["file"])
        part = part if part is not None else read_partial(where, record["file"])
        for a in aggregates:
            groups = part.get(a.name, {})
            need = {"count", *(("sum",) if a.op != "count" else ()), *(("m2",) if a.op == "cov" else ())}
            if not groups or ("" in groups) != (a.by is None) or any(need - set(s) for s in groups.values()):
                raise ForgeError(
                    f"{record['file']}: its partial does not hold aggregate {a.name!r} (op={a.op}, by={a.by}); "
                    "the function's aggregates changed since it was written: use a new output_dir"
                )
        merge(total, part)
    return total


# -- the dataset result file ----------------------------------------------------------------
def _encode(value: Any, arrays: dict[str, np.ndarray], where: str) -> Any:
    if isinstance(value, dict):
        pairs = [(k.item() if isinstance(k, np.generic) else k, v) for k, v in value.items()]
        return {ITEMS: [[k, _encode(v, arrays, f"{where}/{k}")] for k, v in pairs]}
    if hasattr(value, "detach"):
        value = _float64(value)
    if isinstance(value, (np.ndarray, np.generic)):
        kind = {"f": np.float64, "i": np.int64, "u": np.int64, "b": np.bool_}.get(value.dtype.kind)
        if value.ndim == 0 or kind is None:
            return value.tolist()
        key = f"{len(arrays)}{where}"
        arrays[key] = np.ascontiguousarray(value.astype(kind))
        return {ARRAY: key}
    if isinstance(value, (list, tuple)):
        return [_encode(v, arrays, f"{where}/{k}") for k, v in enumerate(value)]
    return value


def _decode(value: Any, arrays: dict[str, np.ndarray]) -> Any:
    if isinstance(value, dict) and ARRAY in value:
        return np.array(arrays[value[ARRAY]])
    if isinstance(value, dict) and ITEMS in value:
        return {k: _decode(v, arrays) for k, v in value[ITEMS]}
    if isinstance(value, list):
        return [_decode(v, arrays) for v in value]
    return value


def write_result(write_file: Callable[[str, bytes], None], folder: str, values: dict[str, Any], tag: str) -> None:
    """The dataset result as <folder>/aggregate.json (+ .safetensors for arrays), tagged with the
    digest of the shards folded; the JSON is written last (readers check both tags)."""
    from safetensors.numpy import save

    arrays: dict[str, np.ndarray] = {}
    encoded = {name: _encode(v, arrays, f"/{name}") for name, v in values.items()}
    if arrays:
        write_file(f"{folder}/{RESULT_TENSORS}", save(arrays, metadata={"digest": tag}))
    doc = {"digest": tag, "arrays": bool(arrays), "values": encoded}
    write_file(f"{folder}/{RESULT_JSON}", json.dumps(doc, default=str).encode())


def read_result(where: Location, folder: str, tag: str) -> dict[str, Any] | None:
    """The dataset result written at close, if it folded exactly the shards `tag` names (else None)."""
    if not where.exists(f"{folder}/{RESULT_JSON}"):
        return None
    doc = json.loads(where.read_bytes(f"{folder}/{RESULT_JSON}"))
    arrays: dict[str, np.ndarray] = {}
    if doc.get("digest") != tag:
        return None
    if doc.get("arrays"):
        if not where.exists(f"{folder}/{RESULT_TENSORS}"):
            return None
        arrays, meta = read_safetensors(io.BytesIO(where.read_bytes(f"{folder}/{RESULT_TENSORS}")), lambda _: True)
        if meta.get("digest") != tag:
            return None
    return {name: _decode(v, arrays) for name, v in doc["values"].items()}


def dataset_result(where: Location, folder: str, aggregates: Sequence[Aggregate], journal: list[dict]) -> dict:
    """A folder's dataset result: the one written at close while it is current, else the
    journaled shards' partials folded now (without the function's `finish` values)."""
    if not aggregates:
        return {}
    records = in_folder(journal, folder)
    closed = read_result(where, folder, digest(records))
    return closed if closed is not None else finalize(fold(where, records, aggregates), aggregates)
