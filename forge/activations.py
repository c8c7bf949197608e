"""Activation shards: probe_gen's results, read and written through the generic result seam.

    run_dir/activations/meta.json                      layers, pooling, model (+ format, fields)
    run_dir/activations/shard-SSS-KKKKK.safetensors    {"layer_4": [n, hidden], ...}
    run_dir/commits.jsonl                              one line per shard: file, ids, labels, index

`ShardWriter` is a `forge.sinks.ShardBuffer` whose fields are `layer_<L>` tensors;
`load_activations` is `forge.results.load` shaped as (ids, labels, {layer: tensor}).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from forge.results import Field, ResultSchema, load, read_info
from forge.sinks import ShardBuffer
from forge.store import RunStore

SUBDIR = "activations"
META = "meta.json"
LABELS = "labels"  # journal key of each item's label


class Activations(NamedTuple):
    ids: list[str]
    labels: list[Any]
    layers: dict[int, Any]  # layer -> torch.Tensor[N, hidden]


def activation_schema(layers: list[int], meta: dict[str, Any], shard_size: int = 4096) -> ResultSchema:
    """Pooled hidden states per layer (`layer_<L>`, float32 [hidden] per item), labels kept."""
    layers = list(layers)
    return ResultSchema(fields=tuple(Field(f"layer_{layer}", "float32", None) for layer in layers),
                        format="safetensors", folder=SUBDIR, rows_per_shard=shard_size, meta_key=LABELS,
                        meta={"layers": layers, **meta})


class ShardWriter(ShardBuffer):
    """Buffers pooled rows per layer; `flush` commits them as one shard."""

    def __init__(self, store: RunStore, layers: list[int], meta: dict[str, Any], shard_size: int = 4096):
        super().__init__(store, activation_schema(layers, meta, shard_size))
        self.layers = list(layers)

    def add(self, ids, labels, index, pooled: dict[int, np.ndarray]) -> None:  # type: ignore[override]
        super().add(ids, index, {f"layer_{layer}": pooled[layer] for layer in self.layers}, labels)


def load_activations(run_dir) -> Activations:
    """ids, labels and {layer: tensor[N, hidden]} of a run, aligned and in input order."""
    import torch

    from forge.errors import ForgeError

    try:
        layers_kept = read_info(run_dir, SUBDIR)["layers"]
    except (ForgeError, KeyError):
        raise ForgeError(f"{run_dir}: no {SUBDIR}/{META}; is this a probe_gen run directory?") from None
    res = load(run_dir, SUBDIR)
    layers = {layer: torch.from_numpy(res.columns[f"layer_{layer}"]) if len(res) else torch.empty(0)
              for layer in layers_kept}
    return Activations(res.ids, res.meta or [None] * len(res), layers)
