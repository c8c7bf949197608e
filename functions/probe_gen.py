"""probe_gen: hidden-state activations of prompts (shared few-shot prefix + statement) at
chosen layers of a Hugging Face causal LM, saved for linear probes.

Written on `forge.api`: the base reads rows (`text`, optional `prefix`, `label`, `id`),
applies the token rule (a prefix tokenized alone with the special tokens, the text after it
without them), runs every batching mode exactly and commits the results. This file says what is
kept: per item and layer, the state of its last token (`pooling=last`; an item that is all
prefix: the prefix's last state) or the mean over its tokens after the prefix (`pooling=mean`),
float32, as safetensors shards under ``activations/`` with the labels journaled
(`forge.load_activations`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List

from forge.api import CausalLMFunction, Field, ForgeError, Forward, ItemView, ModelFunctionConfig
from forge.schema import MISSING, one_of

POOLINGS = ("last", "mean")


@dataclass
class ProbeGenConfig(ModelFunctionConfig):
    """The root keys probe_gen reads (its constructor's parameters), checked at the edge."""

    layers: List[int] = MISSING  # hidden-state indices (0 = embeddings)
    pooling: str = one_of("last", *POOLINGS)


class ProbeGen(CausalLMFunction):
    name = "probe_gen"
    config_schema = ProbeGenConfig
    format = "safetensors"
    folder = "activations"
    keep_labels = True

    def __init__(self, model: dict, input: dict, layers: list[int], pooling: str = "last", shard_size: int = 4096,
                 too_long: str = "skip"):
        if pooling not in POOLINGS:
            raise ForgeError(f"pooling={pooling!r}; choose one of: {', '.join(POOLINGS)}")
        self.layers, self.pooling = list(layers), pooling
        if not self.layers:
            raise ForgeError("layers=[]: choose at least one layer (0 = embeddings)")
        self.forward = Forward(layers=tuple(self.layers))
        self.fields = tuple(Field(f"layer_{layer}", "float32", None) for layer in self.layers)
        super().__init__(model, input, shard_size, too_long)

    def options(self) -> dict[str, Any]:
        return {"layers": self.layers, "pooling": self.pooling}

    def memory_pooling(self) -> str:
        return self.pooling

    def reduce(self, view: ItemView) -> dict[str, Any]:
        if self.pooling == "last":
            return {f"layer_{layer}": view.last(layer).float() for layer in self.layers}
        if not view.hidden[self.layers[0]].shape[0]:
            raise ValueError(f"item {view.id!r} has no tokens after its prefix; mean pooling needs at least one")
        return {f"layer_{layer}": view.hidden[layer].float().mean(dim=0) for layer in self.layers}
