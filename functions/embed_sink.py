"""Embedding shards on disk, safetensors or Parquet, committed through the run's journal.

    run_dir/embeddings/meta.json                         format, dim, pooling, normalize, model
    run_dir/embeddings/shard-SSS-KKKKK.safetensors       {"embedding": float32 [n, dim]}   (format=safetensors)
    run_dir/embeddings/shard-SSS-KKKKK.parquet           id, index, embedding (list<float32>[dim])   (format=parquet)
    run_dir/commits.jsonl                                one line per shard: file, index, ids

Rows are buffered as batches finish and written a shard at a time through
`RunStore.write_shard` (temporary name, fsync, rename, then the journal line), so a shard is
either whole and journaled or absent. `load_embeddings` reads only journaled shards and puts
rows back in input order. Small on purpose: a generic sink can replace `EmbeddingSink`
without touching `forge.functions.embed`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from forge.errors import ForgeError
from forge.store import RunStore, read_journal

SUBDIR = "embeddings"
META = "meta.json"
FORMATS = {"safetensors": ".safetensors", "parquet": ".parquet"}


class Embeddings(NamedTuple):
    ids: list[str]  # item ids, in input order
    vectors: np.ndarray  # float32 [N, dim], aligned with ids


class EmbeddingSink:
    """Buffers embedding rows; `flush` commits them as one shard (the `forge.function.Sink` seam)."""

    def __init__(self, store: RunStore, fmt: str, meta: dict[str, Any], shard_size: int = 4096):
        if fmt not in FORMATS:
            raise ForgeError(f"output_format={fmt!r}; choose one of: {', '.join(FORMATS)}")
        self.store = store
        self.fmt = fmt
        self.rows_per_shard = shard_size  # the loop flushes once this many rows are buffered
        store.write_file(f"{SUBDIR}/{META}", json.dumps({"format": fmt, **meta}))
        self.shards = 0  # written by this session
        self.rows_written = 0
        self._clear()

    def _clear(self) -> None:
        self._vectors: list[np.ndarray] = []
        self._ids: list[str] = []
        self._index: list[int] = []

    def write(self, batch, output, keep: list[bool] | None) -> None:
        items, vectors = batch.items, output.vectors
        if keep is not None:
            items = [it for it, k in zip(items, keep) if k]
            vectors = vectors[np.asarray(keep, bool)]
        self._ids.extend(it.id for it in items)
        self._index.extend(it.index for it in items)
        self._vectors.append(np.asarray(vectors, np.float32))

    def flush(self) -> None:
        if not self._ids:
            return
        vectors = np.ascontiguousarray(np.concatenate(self._vectors))
        name = f"{SUBDIR}/{self.store.shard_name(self.shards, FORMATS[self.fmt])}"
        ids, index = list(self._ids), list(self._index)
        write = _safetensors_writer(vectors) if self.fmt == "safetensors" else _parquet_writer(ids, index, vectors)
        self.shards += 1  # a failed write's name is not reused, and its rows are dropped (the loop
        self._clear()     # reports them uncommitted): nothing it said was lost is committed later
        self.store.write_shard(name, write, {"index": index, "ids": ids})
        self.rows_written += len(ids)

    def close(self) -> dict[str, Any]:
        self.flush()
        return {"embeddings": self.store.url(SUBDIR), "format": self.fmt, "shards": self.shards,
                "rows": self.rows_written}


def _safetensors_writer(vectors: np.ndarray):
    def write(path: Path) -> None:
        from safetensors.numpy import save_file

        save_file({"embedding": vectors}, str(path))

    return write


def _parquet_writer(ids: list[str], index: list[int], vectors: np.ndarray):
    def write(path: Path) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        dim = vectors.shape[1]
        column = pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1), pa.float32()), dim)
        table = pa.table({"id": pa.array(ids, pa.string()), "index": pa.array(index, pa.int64()),
                          "embedding": column})
        pq.write_table(table, str(path))

    return write


def load_embeddings(run_dir) -> Embeddings:
    """ids and float32 vectors [N, dim] of an `embed` run, journaled shards only, in input order."""
    directory = Path(run_dir) / SUBDIR
    if not (directory / META).exists():
        raise ForgeError(f"{run_dir}: no {SUBDIR}/{META}; is this an embed run directory?")
    meta = json.loads((directory / META).read_text())
    ids: list[str] = []
    index: list[int] = []
    parts: list[np.ndarray] = []
    for shard in read_journal(run_dir):
        if not shard["file"].startswith(SUBDIR + "/"):
            continue
        path = Path(run_dir) / shard["file"]
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(path)
            column = table.column("embedding").combine_chunks()
            parts.append(column.flatten().to_numpy().reshape(len(table), -1).astype(np.float32, copy=False))
        else:
            from safetensors.numpy import load_file

            parts.append(load_file(str(path))["embedding"])
        ids += shard["ids"]
        index += shard["index"]
    order = np.argsort(np.asarray(index, np.int64), kind="stable")
    dim = int(meta.get("dim") or (parts[0].shape[1] if parts else 0))
    vectors = np.concatenate(parts)[order] if parts else np.zeros((0, dim), np.float32)
    return Embeddings([ids[i] for i in order], vectors)
