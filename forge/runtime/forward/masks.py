"""4D additive attention masks for rows that run on a shared prefix's keys.

Each query token carries its segment (the item it belongs to; -1 for padding) and its
position in its own prompt; each key too, and the P prefix keys (positions 0..P-1) are
visible to every segment. A query sees a key when they share a segment (or the key is in
the prefix), the key's position is not after the query's, and, on a sliding-window layer
of window W, the key is less than W positions back: exactly the keys a one-prompt forward
pass shows it. In tree rows (`Batch.tree`) a prefix sits in the row itself: each query also
carries a context segment (`ctx`: its prefix's span in the row), whose keys it sees as well,
and the prefix's own tokens are a segment of their own. Padding (the tail of a row, positions
still rising) sees the prefix and earlier padding, so no query row is empty.
"""

from __future__ import annotations

import torch

from forge.runtime.model.capabilities import SLIDING

SHARED = -2  # segment of the prefix keys


def additive_masks(
    seg: torch.Tensor,  # (B, S) item index per slot, -1 for padding
    pos: torch.Tensor,  # (B, S) position of each slot in its own prompt
    prefix_len: int,
    layer_types: tuple[str, ...],
    window: int | None,
    dtype: torch.dtype,
    device: torch.device,
    ctx: torch.Tensor | None = None,  # (B, S) a second segment each query sees (tree rows); None: none
) -> torch.Tensor | dict[str, torch.Tensor]:
    """One (B, 1, S, P+S) mask, or {layer type: mask} when the layer types differ."""
    B, S = seg.shape
    P = int(prefix_len)
    k_seg = torch.cat([torch.full((B, P), SHARED, dtype=seg.dtype), seg], dim=1).to(device)
    k_pos = torch.cat([torch.arange(P, dtype=pos.dtype).expand(B, P), pos], dim=1).to(device)
    q_seg, q_pos = seg.to(device), pos.to(device)
    base = (k_seg[:, None, :] == q_seg[:, :, None]) | (k_seg[:, None, :] == SHARED)
    if ctx is not None:
        base |= k_seg[:, None, :] == ctx.to(device)[:, :, None]
    back = q_pos[:, :, None] - k_pos[:, None, :]  # how far back each key is, per query
    base &= back >= 0

    low = torch.finfo(dtype).min
    masks = {}
    for kind in dict.fromkeys(layer_types):
        allowed = base
        if kind == SLIDING and window:
            allowed = base & (back < int(window))
        m = torch.zeros(B, 1, S, P + S, dtype=dtype, device=device)
        m.masked_fill_(~allowed[:, None], low)
        masks[kind] = m
    if len(masks) == 1:
        return next(iter(masks.values()))
    return masks
