"""What a runner checks of what it is given: hidden-state layer indices resolved into the
model's range (`resolve_layers`), an item's token ids as a tensor (`token_tensor`), and a
batch's items against its layout (`check_batch_items`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from forge.vocab.geometry import Batch, Item


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


def check_batch_items(batch: Batch, seqs: list[torch.Tensor], items: list[Item], pooling: str) -> None:
    """Raise ValueError naming the item when the items do not fit the batch's layout: more
    than one per row unpacked, a prefix that differs from the batch's, a prefix_len out of
    range, or nothing after the prefix to mean-pool."""
    if not batch.packed:
        for r, row in enumerate(batch.rows):
            if len(row) > 1:
                raise ValueError(f"row {r} holds {len(row)} items but batch.packed is False")
    if batch.split_prefix:
        P = batch.prefix_len
        first = seqs[0][:P]
        for item, seq in zip(items, seqs):
            if item.prefix_len != P:
                raise ValueError(f"item {item.id!r} has prefix_len={item.prefix_len}, batch has {P}")
            if batch.prefix_key is not None and item.prefix_key != batch.prefix_key:
                raise ValueError(f"item {item.id!r} has prefix_key={item.prefix_key!r}, batch has {batch.prefix_key!r}")
            if not torch.equal(seq[:P], first):
                raise ValueError(f"item {item.id!r}: its first {P} tokens differ from the batch's shared prefix")
    for item, seq in zip(items, seqs):
        if item.prefix_len < 0 or item.prefix_len > seq.numel():
            raise ValueError(f"item {item.id!r}: prefix_len={item.prefix_len} is out of range")
        if pooling == "mean" and item.prefix_len >= seq.numel():
            raise ValueError(f"item {item.id!r} has no tokens after its prefix; mean pooling needs at least one")
