"""Activation shards on disk: safetensors files committed through the run's journal.

    run_dir/activations/meta.json                      layers, pooling, model
    run_dir/activations/shard-SSS-KKKKK.safetensors    {"layer_4": [n, hidden], ...}
    run_dir/commits.jsonl                              one line per shard: file, ids, labels, index

Rows are buffered as batches finish and written a shard at a time (`RunStore.write_shard`:
temporary name, rename, then the journal line). `load_activations` reads only journaled
shards and puts rows back in input order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from forge.store import RunStore, read_journal

SUBDIR = "activations"
META = "meta.json"


class Activations(NamedTuple):
    ids: list[str]
    labels: list[Any]
    layers: dict[int, Any]  # layer -> torch.Tensor[N, hidden]


class ShardWriter:
    """Buffers pooled rows; `flush` commits them as one shard."""

    def __init__(self, store: RunStore, layers: list[int], meta: dict[str, Any], shard_size: int = 4096):
        self.store = store
        self.layers = list(layers)
        self.rows_per_shard = shard_size
        folder = store.dir / SUBDIR
        folder.mkdir(parents=True, exist_ok=True)
        (folder / META).write_text(json.dumps({"layers": self.layers, **meta}))
        self.shards = 0  # written by this session
        self.rows_written = 0
        self._clear()

    def _clear(self) -> None:
        self._rows: dict[int, list[np.ndarray]] = {layer: [] for layer in self.layers}
        self._ids: list[str] = []
        self._labels: list[Any] = []
        self._index: list[int] = []

    def add(self, ids, labels, index, pooled: dict[int, np.ndarray]) -> None:
        self._ids.extend(ids)
        self._labels.extend(labels)
        self._index.extend(index)
        for layer in self.layers:
            self._rows[layer].append(pooled[layer])

    def flush(self) -> None:
        if not self._ids:
            return
        from safetensors.numpy import save_file

        tensors = {f"layer_{layer}": np.ascontiguousarray(np.concatenate(self._rows[layer]))
                   for layer in self.layers}
        name = f"{SUBDIR}/{self.store.shard_name(self.shards, '.safetensors')}"
        record = {"index": self._index, "ids": self._ids, "labels": self._labels}
        self.store.write_shard(name, lambda path: save_file(tensors, str(path)), record)
        self.shards += 1
        self.rows_written += len(self._ids)
        self._clear()

    def close(self) -> dict[str, Any]:
        self.flush()
        return {"activations": str(self.store.dir / SUBDIR), "shards": self.shards, "rows": self.rows_written}


def load_activations(run_dir) -> Activations:
    """ids, labels and {layer: tensor[N, hidden]} of a run, aligned and in input order."""
    import torch
    from safetensors.numpy import load_file

    from forge.errors import ForgeError

    directory = Path(run_dir) / SUBDIR
    if not (directory / META).exists():
        raise ForgeError(f"{run_dir}: no {SUBDIR}/{META}; is this a probe_gen run directory?")
    layers_kept = json.loads((directory / META).read_text())["layers"]
    ids: list[str] = []
    labels: list[Any] = []
    index: list[int] = []
    parts: dict[int, list] = {layer: [] for layer in layers_kept}
    for shard in read_journal(run_dir):
        if not shard["file"].startswith(SUBDIR + "/"):
            continue
        tensors = load_file(str(Path(run_dir) / shard["file"]))
        ids += shard["ids"]
        labels += shard["labels"]
        index += shard["index"]
        for layer in parts:
            parts[layer].append(tensors[f"layer_{layer}"])
    order = np.argsort(np.asarray(index, np.int64), kind="stable")
    layers = {layer: torch.from_numpy(np.concatenate(chunks)[order]) if chunks else torch.empty(0)
              for layer, chunks in parts.items()}
    return Activations([ids[i] for i in order], [labels[i] for i in order], layers)
