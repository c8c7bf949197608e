"""Rows that share one cached prefix attend to its keys without a copy of them per row.

Model: a batch of rows whose items share a prefix runs the prefix once (or takes its keys and
values from the prefix cache) and then the suffixes as rows. Handing the model a KV cache for
that makes every layer concatenate the prefix's keys and values, expanded to every row, with
the rows' own: B x (P + S) keys per layer, which on a CPU took about 60% of such a forward
(B=256 rows of S=10 after a prefix of P=340, the embedded model). Here the rows run without a
cache: `SharedPrefix` carries the prefix's keys and values, one copy per layer, into an
attention function registered with transformers (`AttentionInterface`, under `NAME`), which
every family that dispatches its attention through that interface calls. It computes one
softmax over the prefix's keys (all rows' queries against the one copy, a single batched
matrix product) and the row's own keys (under the rows' causal mask), exactly as the eager
attention does over the concatenated keys: scores and softmax in float32, the running max
subtracted, rows taken in chunks to bound the scores' memory.

Only where that equals the concatenated attention: every layer full attention (no sliding
window), no ALiBi bias, no logit soft-capping, no attention sinks. A family whose attention
does not come here (its module does not dispatch through the interface) is caught after the
forward: `SharedPrefix.calls` must equal the number of layers, and the runner falls back to
the cache path for good (`forge.runtime.forward.causal_lm`).
"""

from __future__ import annotations

from typing import Any

import torch

NAME = "forge_shared_prefix"
#: most float32 score elements one chunk of rows holds (128 MiB), prefix and row keys together
CHUNK_SCORES = 32 * 2**20
_registered = False


class SharedPrefix:
    """The prefix's keys and values per layer ([1, kv heads, P, head dim] each), for one forward."""

    def __init__(self, key_values: list[tuple[torch.Tensor, torch.Tensor]]):
        self.key_values = key_values
        self.calls = 0  # attention calls that used it (one per layer when the family dispatches here)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        return self.key_values[index]


class NotShareable(Exception):
    """This attention call cannot use the shared prefix exactly (the caller falls back)."""


def register() -> bool:
    """Register the attention function (and sdpa's mask builder under its name) once; False on a
    transformers without these interfaces (older 4.x releases), which keeps the cache path."""
    global _registered
    if not _registered:
        try:
            from transformers import AttentionInterface
            from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
        except ImportError:
            return False
        AttentionInterface.register(NAME, shared_prefix_attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _registered = True
    return True


def shared_prefix_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    forge_prefix: SharedPrefix | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of rows [B, heads, S, d] over the shared prefix's keys and their own, as
    transformers' attention functions are called; returns [B, S, heads, d] and no weights."""
    if forge_prefix is None or dropout:
        raise NotShareable("no shared prefix given, or dropout in training")
    for name in ("softcap", "sliding_window", "s_aux", "sinks", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotShareable(f"{name} is set")
    index = getattr(module, "layer_idx", None)
    if index is None:
        raise NotShareable("the attention module has no layer_idx")
    k_p, v_p = forge_prefix.layer(int(index))
    B, H, S, d = query.shape
    Hkv, P = key.shape[1], k_p.shape[2]
    if H % Hkv or k_p.shape[1] != Hkv or attention_mask is None:
        raise NotShareable("unexpected head layout, or no mask")
    scale = scaling if scaling is not None else d**-0.5
    g = H // Hkv
    rows = max(1, CHUNK_SCORES // max(1, H * S * (P + S)))
    out = torch.empty(B, Hkv, g * S, value.shape[-1], dtype=torch.float32, device=query.device)
    kp_t = k_p[0].float().transpose(-1, -2)  # [Hkv, d, P]
    vp = v_p[0].float()  # [Hkv, P, dv]
    for lo in range(0, B, rows):
        hi = min(B, lo + rows)
        out[lo:hi] = _chunk(query[lo:hi], key[lo:hi], value[lo:hi], attention_mask[lo:hi], kp_t, vp, scale, g)
    return out.view(B, H, S, -1).transpose(1, 2).to(query.dtype).contiguous(), None


def _chunk(q, k, v, mask, kp_t, vp, scale: float, g: int) -> torch.Tensor:
    """One chunk of rows: [b, Hkv, g*S, dv] float32."""
    b, H, S, d = q.shape
    Hkv = k.shape[1]
    qg = q.float().reshape(b, Hkv, g * S, d)  # query head h reads key head h // g
    # the prefix: every row's queries against its one copy, [Hkv, b*g*S, P]
    qp = qg.transpose(0, 1).reshape(Hkv, b * g * S, d)
    s_p = torch.matmul(qp, kp_t).mul_(scale)
    # the row's own keys under its mask, [b, Hkv, g, S, S]
    s_r = torch.matmul(qg, k.float().transpose(-1, -2)).mul_(scale).view(b, Hkv, g, S, S)
    bias = (
        mask.float()
        if mask.dtype != torch.bool
        else torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, float("-inf"))
    )
    s_r = s_r + bias[:, :, None, :, : s_r.shape[-1]]
    m_p = s_p.amax(-1).view(Hkv, b, g, S).permute(1, 0, 2, 3)  # [b, Hkv, g, S]
    m = torch.maximum(m_p, s_r.amax(-1))
    e_r = torch.exp(s_r - m[..., None])
    m_flat = m.permute(1, 0, 2, 3).reshape(Hkv, b * g * S, 1)
    e_p = torch.exp(s_p.sub_(m_flat))
    num_p = torch.matmul(e_p, vp).view(Hkv, b, g * S, -1).transpose(0, 1)  # [b, Hkv, g*S, dv]
    den_p = e_p.sum(-1).view(Hkv, b, g * S).transpose(0, 1)
    num_r = torch.matmul(e_r.view(b, Hkv, g * S, S), v.float())
    den_r = e_r.sum(-1).view(b, Hkv, g * S)
    return (num_p + num_r) / (den_p + den_r)[..., None]


def worth_sharing(row_len: int, heads: int, key_values: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether this attention beats the concatenated cache at this shape: per row token it
    holds `heads x row_len` float32 scores where the cache copies `kv heads x head dim x 2`
    values of every key per row. Measured on the embedded model on a CPU (one forward of the
    base model, P=340): 3.3x faster at 256 rows of 10 tokens, 2.0x at 64 rows of 30, 0.88x at
    16 rows of 100 after P=1000, where the rule says no. On CUDA devices the cache path's
    fused attention kernels are not yet measured against it, so they keep the cache path."""
    k = key_values[0][0]
    return k.device.type == "cpu" and 0 < row_len * heads <= k.shape[1] * k.shape[-1]


def row_masks(used: list[int], row_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[B, 1, S, S] additive: a row's token sees its row's tokens up to itself; padding keys
    are hidden (every query still sees the prefix, so no softmax is empty)."""
    pos = torch.arange(row_len)
    allowed = (pos[None, :, None] >= pos[None, None, :]) & (pos[None, None, :] < torch.tensor(used)[:, None, None])
    mask = torch.zeros(len(used), 1, row_len, row_len, dtype=dtype)
    return mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min).to(device)


def forward(base: Any, key_values: list[tuple[torch.Tensor, torch.Tensor]], used: list[int], **inputs: Any):
    """The base model's forward over rows after the shared prefix `key_values`, through this
    attention; None when the family cannot take it (its attention did not dispatch here for
    every layer, or refused): the caller runs the cache path instead, and should not ask again."""
    config = base.config
    if getattr(config, "sub_configs", None) or not register():
        return None  # sub-configs: setting the implementation would reach configs this forward does not run
    prefix = SharedPrefix(key_values)
    before = config._attn_implementation
    ids = inputs["input_ids"]
    mask = row_masks(used, ids.shape[1], next(base.parameters()).dtype, ids.device)
    config._attn_implementation = NAME
    try:
        out = base(**inputs, attention_mask=mask, use_cache=False, forge_prefix=prefix)
    except NotShareable:
        return None
    except TypeError as exc:  # a forward that takes no extra keyword arguments refuses ours
        if prefix.calls or "forge_prefix" not in str(exc):
            raise  # anything else is a bug, and must fail the batch visibly, not slow it silently
        return None
    finally:
        config._attn_implementation = before
    return out if prefix.calls == len(key_values) else None
