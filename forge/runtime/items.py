"""What a runner checks of what it is given: hidden-state layer indices resolved into the
model's range (`resolve_layers`), and an item's token ids as a tensor (`token_tensor`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from forge.core.geometry import Item


def resolve_layers(layers: Sequence[int], num_layers: int, allow_empty: bool = False) -> list[int]:
    """Layer indices resolved into 0..num_layers (negative ones count from the end)."""
    out = []
    for layer in layers:
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise ValueError(f"layers must be integers, got {layer!r}")
        if not -(num_layers + 1) <= layer <= num_layers:
            raise ValueError(
                f"layer {layer} is out of range: the model has hidden states 0..{num_layers} "
                f"(0 = embeddings, {num_layers} = final normed output)"
            )
        out.append(layer % (num_layers + 1))
    if not out and not allow_empty:
        raise ValueError("layers must name at least one layer")
    return out


def token_tensor(item: Item) -> torch.Tensor:
    """An item's token ids as a CPU long tensor, checked against its `num_tokens`."""
    if item.tokens is None:
        raise ValueError(f"item {item.id!r} has no tokens; the causal LM runner needs token ids")
    t = torch.as_tensor(item.tokens, dtype=torch.long).reshape(-1).cpu()
    if t.numel() != item.num_tokens:
        raise ValueError(f"item {item.id!r}: num_tokens={item.num_tokens} but it has {t.numel()} token ids")
    if t.numel() == 0:
        raise ValueError(f"item {item.id!r} has no tokens")
    return t
