"""Activation shards on disk: safetensors files plus a manifest of ids and labels.

    run_dir/activations/shard-00000.safetensors   {"layer_4": [n, hidden], ...}
    run_dir/activations/manifest.json             layers, pooling, shards: [{file, ids, labels, index}]

Rows are written as batches finish; `load_activations` puts them back in input order.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NamedTuple

SUBDIR = "activations"
MANIFEST = "manifest.json"


class Activations(NamedTuple):
    ids: list[str]
    labels: list[Any]
    layers: dict[int, Any]  # layer -> torch.Tensor[N, hidden]


def _atomic_write_bytes(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


class ShardWriter:
    """Buffers pooled rows and writes a shard every `shard_size` rows."""

    def __init__(self, run_dir: Path, layers: list[int], meta: dict[str, Any], shard_size: int = 4096):
        self.dir = Path(run_dir) / SUBDIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self.layers = list(layers)
        self.meta = meta
        self.shard_size = shard_size
        self.shards: list[dict[str, Any]] = []
        self._rows: dict[int, list] = {layer: [] for layer in self.layers}
        self._ids: list[str] = []
        self._labels: list[Any] = []
        self._index: list[int] = []
        self.rows_written = 0

    def add(self, ids, labels, index, pooled: dict[int, Any]) -> None:
        self._ids.extend(ids)
        self._labels.extend(labels)
        self._index.extend(index)
        for layer in self.layers:
            self._rows[layer].append(pooled[layer])
        if len(self._ids) >= self.shard_size:
            self.flush()

    def flush(self) -> None:
        if not self._ids:
            return
        import torch
        from safetensors.torch import save_file

        name = f"shard-{len(self.shards):05d}.safetensors"
        tensors = {f"layer_{layer}": torch.cat(self._rows[layer]).contiguous() for layer in self.layers}
        _atomic_write_bytes(self.dir / name, lambda p: save_file(tensors, str(p)))
        self.shards.append({"file": name, "ids": self._ids, "labels": self._labels, "index": self._index})
        self.rows_written += len(self._ids)
        self._rows = {layer: [] for layer in self.layers}
        self._ids, self._labels, self._index = [], [], []

    def close(self) -> dict[str, Any]:
        self.flush()
        manifest = {"layers": self.layers, **self.meta, "rows": self.rows_written, "shards": self.shards}
        _atomic_write_bytes(self.dir / MANIFEST, lambda p: p.write_text(json.dumps(manifest)))
        return {"activations": str(self.dir), "shards": len(self.shards), "rows": self.rows_written}


def load_activations(run_dir) -> Activations:
    """ids, labels and {layer: tensor[N, hidden]} of a run, aligned and in input order."""
    import torch
    from safetensors.torch import load_file

    from forge.errors import ForgeError

    directory = Path(run_dir) / SUBDIR
    manifest_path = directory / MANIFEST
    if not manifest_path.exists():
        raise ForgeError(f"{run_dir}: no {SUBDIR}/{MANIFEST}; is this a finished probe_gen run directory?")
    manifest = json.loads(manifest_path.read_text())
    ids: list[str] = []
    labels: list[Any] = []
    index: list[int] = []
    parts: dict[int, list] = {layer: [] for layer in manifest["layers"]}
    for shard in manifest["shards"]:
        tensors = load_file(str(directory / shard["file"]))
        ids += shard["ids"]
        labels += shard["labels"]
        index += shard["index"]
        for layer in parts:
            parts[layer].append(tensors[f"layer_{layer}"])
    order = sorted(range(len(ids)), key=index.__getitem__)
    perm = torch.tensor(order, dtype=torch.long)
    layers = {
        layer: (torch.cat(chunks)[perm] if chunks else torch.empty(0)) for layer, chunks in parts.items()
    }
    return Activations([ids[i] for i in order], [labels[i] for i in order], layers)
