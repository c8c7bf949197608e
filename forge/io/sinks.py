"""Generic sinks: commit any function's per-item results, as its `ResultSchema` declares.

Model: a worker returns, for a batch, one array per field with a row per item, aligned
with `batch.items` (`ResultColumns`, or any object with a `columns` mapping). The sink keeps
the rows of items not committed yet, buffers them, and on `flush` writes one shard through
`RunStore.write_shard` (the shard put in place whole, then its journal record naming the
items' input indexes and ids): a safetensors file holding one tensor per field, or a Parquet
table with `id`, `index` and a column per field. `forge.io.results.load` reads either back.

A schema's `Aggregate`s (dataset-level results) are not columns: the buffer folds the items'
values into a partial per shard (by label where asked), committed inside the shard
(`forge.io.aggregate`); at `close` every journaled partial is folded, the function's `finish`
adds its values, and the dataset result is written beside the shards.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from forge.errors import ForgeError
from forge.io import aggregate as agg
from forge.io.results import (
    BFLOAT16,
    FORMATS,
    META,
    OFFSETS,
    STRING,
    Field,
    ResultSchema,
    ragged_array,
    storage_dtype,
    to_storage,
)

if TYPE_CHECKING:
    from forge.io.store import RunStore
    from forge.vocab.geometry import Batch

Finish = Callable[[dict[str, Any]], dict[str, Any]]  # the folded dataset result -> extra values derived from it
KEEP_PARTIALS = 256 << 20  # bytes of this session's partials kept in memory for close (the rest are read back)


class ShardBuffer:
    """Buffers result rows; `flush` commits them as one shard of the schema's format. `finish`:
    the function's finisher of its dataset result (`Aggregate`s), called at `close`."""

    def __init__(self, store: RunStore, schema: ResultSchema, finish: Finish | None = None):
        self.store = store
        self.schema = schema
        self.finish = finish
        self.rows_per_shard = schema.rows_per_shard
        self.bytes_per_shard = schema.bytes_per_shard
        store.write_file(f"{schema.folder}/{META}", json.dumps(schema.describe(), default=str))
        self.shards = 0  # written by this session
        self._names = 0  # shard names used by this session (failed writes included)
        self.rows_written = 0
        self._shapes: dict[str, tuple[int, ...]] = {}  # per-item shape of fields declared with shape None
        self._agg_shapes: dict[str, tuple[int, ...]] = {}  # per-item shape of each aggregate's values
        self._partials: dict[str, agg.Partial] = {}  # shard -> its partial (this session's, up to KEEP_PARTIALS)
        self._kept = 0  # bytes of those
        self._clear()

    def _clear(self) -> None:
        self._parts: dict[str, list[np.ndarray]] = {f.name: [] for f in self.schema.fields}
        self._ids: list[str] = []
        self._index: list[int] = []
        self._meta: list[Any] = []
        self._partial: agg.Partial = {}  # the buffered items' aggregates, folded
        self.bytes_buffered = 0  # bytes of the buffered values

    def full(self) -> bool:
        """A shard's worth is buffered: `rows_per_shard` rows, or `bytes_per_shard` bytes."""
        return len(self._ids) >= self.rows_per_shard or self.bytes_buffered >= self.bytes_per_shard

    def add(
        self,
        ids: Sequence[str],
        index: Sequence[int],
        columns: dict[str, Any],
        meta: Sequence[Any] = (),
        labels: Sequence[Any] = (),
    ) -> None:
        """Buffer rows: `columns[field]` holds a row per id (checked against the schema), and
        `columns[aggregate]` a value per id, folded by `labels` (one per id) where asked."""
        n = len(ids)
        checked = {f.name: self._check(f, columns, n) for f in self.schema.fields}
        partial = self._fold(columns, n, labels) if self.schema.aggregates and n else {}
        for name, values in checked.items():
            self._parts[name].append(values)
            self.bytes_buffered += (
                values.nbytes
                if values.dtype != object
                else sum(v.nbytes if isinstance(v, np.ndarray) else len(str(v)) for v in values)
            )
        self._ids.extend(str(i) for i in ids)
        self._index.extend(int(i) for i in index)
        if self.schema.meta_key:
            self._meta.extend(meta if len(meta) == n else [None] * n)
        agg.merge(self._partial, partial)

    def _fold(self, columns: dict[str, Any], n: int, labels: Sequence[Any]) -> agg.Partial:
        """The batch's aggregates as a partial (checked: every value there, one shape per aggregate)."""
        partial: agg.Partial = {}
        keys: list[str] | None = None
        for a in self.schema.aggregates:
            if a.name not in columns:
                raise ForgeError(
                    f"aggregate {a.name!r} missing from the worker's output (it gave "
                    f"{', '.join(sorted(columns)) or 'nothing'}); reduce() must return a value for it"
                )
            values = agg.check_values(a, columns[a.name], n, self._agg_shapes)
            if a.by is not None and keys is None:
                if len(labels) != n:
                    raise ForgeError(f"aggregate {a.name!r} is by label, but {len(labels)} labels came for {n} items")
                keys = [agg.group_key(label) for label in labels]
            partial[a.name] = agg.fold_rows(a, values, keys if a.by is not None and keys is not None else [""] * n)
        return partial

    def _check(self, f: Field, columns: dict[str, Any], n: int) -> np.ndarray:
        if f.name not in columns:
            raise ForgeError(
                f"result field {f.name!r} missing from the worker's output (it gave "
                f"{', '.join(sorted(columns)) or 'nothing'}); "
                "the function's result_schema and worker disagree"
            )
        if f.ragged:  # an array [n, *shape] per item (shape (): any array, flattened)
            values = [to_storage(v, f.dtype) for v in columns[f.name]]
            if len(values) != n:
                raise ForgeError(f"result field {f.name!r}: the worker gave {len(values)} values for {n} item(s)")
            shape = (
                f.shape
                if f.shape is not None
                else self._shapes.setdefault(f.name, values[0].shape[1:] if values else ())
            )
            for k, v in enumerate(values):
                if not shape:
                    values[k] = v.reshape(-1)
                elif v.shape[1:] != tuple(shape):
                    raise ForgeError(
                        f"result field {f.name!r}: the worker gave shape {v.shape} for one item, "
                        f"expected (n, {', '.join(map(str, shape))})"
                    )
            return ragged_array(values)
        if f.dtype == BFLOAT16:
            array = to_storage(columns[f.name], f.dtype)
        else:
            array = np.asarray(columns[f.name], dtype=object if f.dtype == STRING else None)
        if f.dtype not in (STRING, BFLOAT16):
            if not np.can_cast(array.dtype, np.dtype(f.dtype), casting="same_kind"):
                raise ForgeError(f"result field {f.name!r}: the worker gave {array.dtype}, the schema says {f.dtype}")
            array = array.astype(f.dtype, copy=False)
        shape = f.shape if f.shape is not None else self._shapes.setdefault(f.name, array.shape[1:])
        if array.shape != (n, *shape):
            raise ForgeError(
                f"result field {f.name!r}: the worker gave shape {array.shape} for {n} item(s), expected {(n, *shape)}"
            )
        return array

    def flush(self) -> None:
        """Commit the buffered rows as one shard (raises OSError when the write fails)."""
        if not self._ids:
            return
        columns = {name: np.concatenate(parts) for name, parts in self._parts.items()}
        name = f"{self.schema.folder}/{self.store.shard_name(self._names, FORMATS[self.schema.format])}"
        record: dict[str, Any] = {"index": self._index, "ids": self._ids}
        if self.schema.meta_key:
            record[self.schema.meta_key] = self._meta
        self._names += 1  # a failed write's name is not reused (a shard it left in place is an orphan)
        try:
            self.store.write_shard(name, self._writer(columns), record)
            self.shards += 1
            self.rows_written += len(self._ids)
            size = sum(a.nbytes for a in agg.to_tensors(self._partial).values())
            if self.schema.aggregates and self._kept + size <= KEEP_PARTIALS:
                self._partials[name], self._kept = self._partial, self._kept + size
        finally:  # a failed write commits nothing: its rows are dropped (the loop accounts them)
            self._clear()

    def _writer(self, columns: dict[str, np.ndarray]) -> Callable[[Any], None]:
        if self.schema.format == "safetensors":
            tensors = {}
            for f in self.schema.fields:
                values = columns[f.name]
                if f.ragged:  # values end to end, and where each row's start
                    tensors[f.name + OFFSETS] = np.cumsum([0, *(len(v) for v in values)]).astype(np.int64)
                    values = (
                        np.concatenate(list(values))
                        if len(values)
                        else np.zeros((0, *(f.shape or ())), storage_dtype(f.dtype))
                    )
                tensors[f.name] = np.ascontiguousarray(values)
            tensors.update(agg.to_tensors(self._partial))
            bf16 = [f.name for f in self.schema.fields if f.dtype == BFLOAT16]
            if bf16:  # numpy has no bfloat16: write the shard through torch, as real BF16 tensors
                import torch
                from safetensors.torch import save_file as save_pt

                pt = {k: torch.from_numpy(v) for k, v in tensors.items()}
                for name in bf16:
                    pt[name] = pt[name].view(torch.bfloat16)
                return lambda path: save_pt(pt, str(path))
            from safetensors.numpy import save_file

            return lambda path: save_file(tensors, str(path))
        from forge.io.results import Results

        table = Results(self._ids, np.asarray(self._index, np.int64), columns, None, {}).table()
        extra = {agg.PARQUET_KEY: agg.partial_bytes(self._partial)} if self.schema.aggregates else None
        return lambda path: _write_parquet(table, str(path), extra)

    def close(self) -> dict[str, Any]:
        """Flush what is left, write the dataset result (its aggregates); figures for the report."""
        self.flush()
        where = self.store.url(self.schema.folder)
        figures: dict[str, Any] = {
            "results": where,
            self.schema.folder: where,
            "format": self.schema.format,
            "shards": self.shards,
            "rows": self.rows_written,
        }
        if self.schema.aggregates:
            self.write_aggregate()
            figures["aggregates"] = [a.name for a in self.schema.aggregates]
        return figures

    def write_aggregate(self) -> dict[str, Any]:
        """Fold the partials of every journaled shard of the folder (this session's and earlier
        ones'), add the finisher's values, and write the dataset result beside the shards."""
        from forge.io.store import read_journal

        records = agg.in_folder(read_journal(self.store.dir), self.schema.folder)
        values = agg.finalize(
            agg.fold(self.store.where, records, self.schema.aggregates, self._partials), self.schema.aggregates
        )
        if self.finish is not None:
            try:
                extra = dict(self.finish(dict(values)) or {})
            except Exception as exc:  # noqa: BLE001 - the function's own code: one line naming it
                raise ForgeError(
                    f"the function's finish(aggregate) raised {type(exc).__name__}: {exc}; its shards are "
                    "committed: fix finish and run again with resume=true"
                ) from exc
            clash = sorted(set(extra) & set(values))
            if clash:
                raise ForgeError(f"finish(aggregate) returned {clash}, which are the aggregates' own names")
            values.update(extra)
        agg.write_result(self.store.write_file, self.schema.folder, values, agg.digest(records))
        return values


class ResultSink:
    """The `forge.function.Sink` of a function that declares a `ResultSchema`: rows come from
    the output's `columns` (aligned with `batch.items`), ids and input indexes from the items,
    and each item's `meta` is kept when the schema names a `meta_key`."""

    def __init__(
        self,
        store: RunStore,
        schema: ResultSchema,
        meta_of: Callable[[Any], Any] | None = None,
        finish: Finish | None = None,
        label_of: Callable[[Any], Any] = agg.label_of,
    ):
        self.buffer = ShardBuffer(store, schema, finish)
        self.meta_of = meta_of or (lambda item: item.meta)  # what the journal keeps of an item (schema.meta_key)
        self.label_of = label_of  # an item's label, the group of its `by="label"` aggregates

    def write(self, batch: Batch, output: Any, keep: list[bool] | None) -> None:
        items = batch.items
        columns = dict(output.columns)
        if keep is not None:
            mask = np.asarray(keep, bool)
            items = [it for it, k in zip(items, keep) if k]
            columns = {
                name: [v for v, k in zip(values, keep) if k] if isinstance(values, list) else np.asarray(values)[mask]
                for name, values in columns.items()
            }
        by_label = any(a.by is not None for a in self.buffer.schema.aggregates)
        self.buffer.add(
            [it.id for it in items],
            [it.index for it in items],
            columns,
            [self.meta_of(it) for it in items],
            [self.label_of(it) for it in items] if by_label else (),
        )

    def full(self) -> bool:
        return self.buffer.full()

    def flush(self) -> None:
        self.buffer.flush()

    def close(self) -> dict[str, Any]:
        return self.buffer.close()


class RoutedSink:
    """Results in several folders from one worker output: each item's row goes to the sink
    `route(item)` names (probe_gen's per-token states: items to one folder, the states of each
    distinct prefix, stored once, to another). Every folder's shards are journaled alike, so
    each item is committed exactly once whichever folder holds it."""

    def __init__(self, sinks: dict[str, ResultSink], route: Callable[[Any], str]):
        self.sinks = sinks  # name -> sink; the first is the main one (its figures lead the report's)
        self.route = route  # item -> the name of the sink its row goes to

    def write(self, batch: Batch, output: Any, keep: list[bool] | None) -> None:
        keep = keep if keep is not None else [True] * len(batch.items)
        routes = [self.route(it) for it in batch.items]
        for name, sink in self.sinks.items():
            mask = [k and r == name for k, r in zip(keep, routes)]
            if any(mask):
                sink.write(batch, output, mask)

    def full(self) -> bool:
        return any(sink.full() for sink in self.sinks.values())

    def flush(self) -> None:
        for sink in self.sinks.values():
            sink.flush()

    def close(self) -> dict[str, Any]:
        figures = [sink.close() for sink in self.sinks.values()]
        out = dict(figures[0])
        for name, more in zip(list(self.sinks)[1:], figures[1:]):
            out[name] = more["results"]
            out["shards"] += more["shards"]
            out[f"{name}_rows"] = more["rows"]
        return out


def open_sink(store: RunStore, schema: ResultSchema, finish: Finish | None = None) -> ResultSink:
    """A sink committing `schema`'s fields (safetensors shards or Parquet tables) and its aggregates."""
    return ResultSink(store, schema, finish=finish)


def _write_parquet(table: Any, path: str, extra: dict[bytes, bytes] | None) -> None:
    """A Parquet shard; `extra`: key-value metadata of the file (a partial of the aggregates)."""
    import pyarrow.parquet as pq

    if extra is None:
        return pq.write_table(table, path)
    with pq.ParquetWriter(path, table.schema) as writer:
        writer.write_table(table)
        writer.add_key_value_metadata(extra)
