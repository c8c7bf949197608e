"""Ground truth for tests: one prompt, one row, no padding, no cache, the full model forward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from forge.runtime.model.hf_compat import input_device

POOLINGS = ("last", "mean")


def reference_hidden(model: Any, tokens: Sequence[int], layers: Sequence[int]) -> dict[int, torch.Tensor]:
    """{layer: hidden states [n_tokens, hidden]} of one plain forward pass, in the model's dtype."""
    ids = torch.as_tensor(tokens, dtype=torch.long).reshape(1, -1)
    device = input_device(model)  # a model split over devices (forge.runtime.placement.dispatch) too
    with torch.inference_mode():
        out = model(input_ids=ids.to(device), output_hidden_states=True, use_cache=False)
    return {layer: out.hidden_states[layer][0] for layer in layers}


def pool(h: torch.Tensor, prefix_len: int, pooling: str) -> torch.Tensor:
    """`last`: the last token's state; `mean`: the mean over h[prefix_len:] (float32, CPU)."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    if pooling == "mean" and prefix_len >= h.shape[0]:
        raise ValueError("mean pooling needs at least one token after the prefix")
    v = h[-1] if pooling == "last" else h[prefix_len:].float().mean(dim=0)
    return v.float().cpu()


def reference_pooled(
    model: Any,
    tokens: Sequence[int],
    prefix_len: int,
    layers: Sequence[int],
    pooling: str,
) -> dict[int, torch.Tensor]:
    """{layer: float32 CPU tensor [hidden]} pooled from one plain forward pass.

    Pooling `last` is the last token's hidden state; `mean` the mean over tokens[prefix_len:]
    (all tokens when prefix_len == 0).
    """
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    if pooling == "mean" and prefix_len >= len(tokens):
        raise ValueError("mean pooling needs at least one token after the prefix")
    hidden = reference_hidden(model, tokens, layers)
    return {layer: pool(h, prefix_len, pooling) for layer, h in hidden.items()}
