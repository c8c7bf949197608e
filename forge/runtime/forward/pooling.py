"""Pooling a batch's hidden states per item: the last token's state, or the mean over the tokens
after the item's prefix (`CausalLMRunner.run`), the same in every layout. Each layer's states are
read on the device they are on (a model split over devices keeps each layer's on its own)."""

from __future__ import annotations

import torch

from forge.runtime.forward.outputs import RowStates


def pool_states(
    states: RowStates, n: int, pooling: str, layers: list[int], layer_idx: list[int]
) -> dict[int, torch.Tensor]:
    """{layer: float32 CPU [n, hidden]} for the `n` items of a batch's forward pass."""
    hidden, tok, lens, starts = states.hidden, states.tok, states.lens, states.starts
    item_row, pool_from, entry = states.item_row, states.pool_from, states.entry
    result: dict[int, torch.Tensor] = {}
    if pooling == "last":
        has = lens > 0
        rows_d = item_row[has]
        cols_d = (starts + lens - 1)[has]
        for i in sorted(set(layer_idx)):
            out: torch.Tensor | None = None
            if hidden:
                at = hidden[i].device
                vals = hidden[i][rows_d.to(at), cols_d.to(at)].float().cpu()
                out = torch.empty(n, vals.shape[-1], dtype=torch.float32)
                out[has] = vals
            if not bool(has.all()):  # items that are all prefix: the prefix's last state
                if states.prefix_at is not None:  # tree rows: the prefix's span in the row
                    p_row, p_col = states.prefix_at
                    at = hidden[i].device
                    last = hidden[i][p_row[~has].to(at), p_col[~has].to(at)].float().cpu()
                else:
                    assert entry is not None  # an item all prefix has its prefix's cache entry
                    last = entry.last_hidden[i]
                if out is None:
                    out = torch.empty(n, last.shape[-1], dtype=torch.float32)
                out[~has] = last
            assert out is not None  # n > 0: some item has states or is all prefix
            result[i] = out
    else:
        assert tok is not None  # mean pooling runs only over row tokens, which exist (n > 0)
        tok_item, tok_within, tok_row, tok_col = tok
        sel = tok_within >= pool_from[tok_item]
        sel_item, sel_row, sel_col = tok_item[sel], tok_row[sel], tok_col[sel]
        counts = (lens - pool_from).clamp_(min=1).to(torch.float32)
        for i in sorted(set(layer_idx)):
            at = hidden[i].device
            vals = hidden[i][sel_row.to(at), sel_col.to(at)].float()
            sums = torch.zeros(n, vals.shape[-1], dtype=torch.float32, device=at)
            sums.index_add_(0, sel_item.to(at), vals)
            result[i] = (sums / counts.to(at)[:, None]).cpu()
    return {layer: result[i] for layer, i in zip(layers, layer_idx)}
