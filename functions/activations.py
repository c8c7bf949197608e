"""Activation shards: probe_gen's results, read through the one result reader.

    run_dir/activations/meta.json                      layers, pooling, model (+ format, fields)
    run_dir/activations/shard-SSS-KKKKK.safetensors    {"layer_4": [n, hidden], ...}
    run_dir/commits.jsonl                              one line per shard: file, ids, labels, index

`load_activations` is `forge.io.results.load` shaped as (ids, labels, {layer: tensor}).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from forge.api import load_results as load, read_info
from forge.errors import ForgeError

SUBDIR = "activations"


class Activations(NamedTuple):
    ids: list[str]
    labels: list[Any]
    layers: dict[int, Any]  # layer -> torch.Tensor[N, hidden]


def load_activations(run_dir) -> Activations:
    """ids, labels and {layer: tensor[N, hidden]} of a run, aligned and in input order."""
    import torch

    try:
        info = read_info(run_dir, SUBDIR)
        layers_kept = info["layers"]
    except (ForgeError, KeyError):
        raise ForgeError(f"{run_dir}: no {SUBDIR}/meta.json; is this a probe_gen run directory?") from None
    if info.get("pooling") == "none":
        raise ForgeError(
            f"{run_dir}: holds every token's states (pooling=none), not one vector per item; stream them "
            "with forge.data.token_states(run_dir, layer, ...)"
        )
    res = load(run_dir, SUBDIR)
    return Activations(
        res.ids,
        res.meta or [None] * len(res),
        {
            layer: torch.from_numpy(res.columns[f"layer_{layer}"]) if len(res) else torch.empty(0)
            for layer in layers_kept
        },
    )
