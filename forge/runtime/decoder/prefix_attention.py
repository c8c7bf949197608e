"""Shared-prefix attention for the decoder: a prefix's keys and values read once per forward pass
for all the sequences that share it, not once per sequence.

Model: in a decode step each sequence's one query (in a prefill after a stored prefix, each of its
S queries) attends over its prefix's keys and then its own tokens' keys. The softmax over both is
split exactly (the log-sum-exp merge): each part gives its maximum score ``m``, the sum of
``exp(score - m)`` and the weighted sum of values, and the two combine with ``exp(m_part - m)``
factors. The own part is the sequence's row (`forge.runtime.decoder.rows_kv`, read at its own
length: `Step.own`) or, in a prefill, its own tokens under transformers' mask (causal when it gives
none); the prefix part is one matmul per shared prefix over ``[heads, sequences x queries, dim] x
[heads, dim, prefix]``: a prefix's KV is read once per layer and pass instead of once per sequence.

Its sibling for forward passes, `forge.runtime.forward.shared_prefix`, serves rows after one prefix with
the same exactness conditions. This one is registered in transformers' attention registry
(`AttentionInterface`, with sdpa's mask format) as ``forge_decode_prefixes``; outside the decoder's
passes (`SHARED.step` unset: a prefix's own prefill, a states forward) it is sdpa itself. A model
takes it only where the split is exact for its attention (`eligible`): plain scaled dot-product
over the keys, no logit soft-capping, no attention sinks, no sliding window, nothing added to the
scores.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

NAME = "forge_decode_prefixes"  # (forge.runtime.forward.shared_prefix registers "forge_shared_prefix")


@dataclass
class Step:
    """The shared prefixes of one forward pass (a decode step, or a prefill of rows after stored
    prefixes), stacked: per layer ``[G, kv heads, P, dim]`` keys and values (zero past each
    prefix's length, `valid` says where), which rows read which; and `own`, the columns of its own
    keys each row reads (``[rows, 1, 1, columns]`` bool, `forge.runtime.decoder.rows_kv`), or None:
    transformers' mask says (causal when it gives none)."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]  # empty: no row reads a prefix
    valid: torch.Tensor  # [G, 1, 1, P] bool
    rows: torch.Tensor  # rows reading a prefix
    group: torch.Tensor  # each one's prefix (0..G-1)
    place: torch.Tensor  # its place among its prefix's rows
    width: int  # the most rows of one prefix
    own: torch.Tensor | None = None
    copies: dict = field(default_factory=dict)  # (valid, rows, group, place, own) per device of a layer split off

    def on(self, device: torch.device) -> tuple[Any, ...]:
        """`valid`, `rows`, `group` and `place` on `device` (a model split over devices: a layer's own)."""
        if device == self.rows.device:
            return self.valid, self.rows, self.group, self.place, self.own
        if device not in self.copies:
            tensors = (self.valid, self.rows, self.group, self.place, self.own)
            self.copies[device] = tuple(None if t is None else t.to(device) for t in tensors)
        return self.copies[device]


def stack(prefixes: list[list[tuple[torch.Tensor, torch.Tensor]]]):
    """Per layer, the prefixes' KV ``[1, kv heads, P_g, dim]`` zero-padded into one tensor; and `valid`."""
    longest = max(kv[0][0].shape[2] for kv in prefixes)
    layers = []
    for i in range(len(prefixes[0])):
        k0, v0 = prefixes[0][i]
        k = k0.new_zeros(len(prefixes), k0.shape[1], longest, k0.shape[3])
        v = v0.new_zeros(len(prefixes), v0.shape[1], longest, v0.shape[3])
        for g, kv in enumerate(prefixes):
            n = kv[i][0].shape[2]
            k[g, :, :n], v[g, :, :n] = kv[i][0][0], kv[i][1][0]
        layers.append((k, v))
    valid = torch.zeros(len(prefixes), 1, 1, longest, dtype=torch.bool, device=k0.device)
    for g, kv in enumerate(prefixes):
        valid[g, ..., : kv[0][0].shape[2]] = True
    return layers, valid


class _Shared(threading.local):
    step: Step | None = None


SHARED = _Shared()
_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    _registered = True


def eligible(model: Any) -> str | None:
    """None when the split is exact for this model's attention; else why not."""
    config = model.config.get_text_config()
    for key in ("attn_logit_softcapping", "sliding_window", "alibi", "kv_lora_rank", "use_sliding_window"):
        if getattr(config, key, None):
            return f"its config sets {key}"
    if set(getattr(config, "layer_types", None) or ()) - {"full_attention"}:
        return "it has layers other than full attention"
    if any(name.endswith(".sinks") for name, _ in model.named_parameters()):
        return "its attention has sinks"
    if not getattr(type(model), "_supports_attention_backend", False):
        return "its attention does not go through transformers' attention interface"
    if getattr(model.config, "_attn_implementation", "sdpa") not in ("sdpa", NAME):
        return f"it runs {model.config._attn_implementation} attention, not the sdpa the split stands in for"
    return None


def _sdpa(*args, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(*args, **kwargs)


def _own_keep(attention_mask, b: int, heads: int, kv_heads: int, s: int, n: int, device) -> torch.Tensor | None:
    """transformers' mask regrouped as the queries are (``[B, kv heads, rep x S, n]``), causal when it gives none."""
    rep = heads // kv_heads
    if attention_mask is None:
        if s == 1:
            return None
        cols = torch.arange(n, device=device)
        keep = cols[None] <= (n - s + torch.arange(s, device=device))[:, None]  # [S, n]
        return keep.repeat(rep, 1)[None, None]
    keep = attention_mask if attention_mask.dtype == torch.bool else attention_mask > float("-inf")
    if keep.shape[1] == 1 and rep == 1:
        return keep
    return keep.expand(b, heads, s, n).reshape(b, kv_heads, rep * s, n)


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """transformers' attention-interface signature: ``query [B, H, S, d]``, ``key``/``value``
    ``[B, kv heads, n, d]``; returns ``[B, S, H, d]`` and no weights."""
    step = SHARED.step
    if step is None:
        return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    extra = [k for k in ("sliding_window", "softcap", "s_aux", "sinks", "position_bias") if kwargs.get(k) is not None]
    if extra:  # `eligible` should have kept this model off the split: never a silently different result
        raise RuntimeError(f"shared-prefix attention cannot split attention with {', '.join(extra)}")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    b, heads, s, d = query.shape
    kv_heads = key.shape[1]
    rep = heads // kv_heads
    valid, rows, group, place, own = step.on(query.device)
    # grouped-query attention without expanding the keys: query head h reads kv head h // rep, so the
    # rep x S queries of a kv head are rows of one matmul against that head's keys (the same dot products)
    q = query.float().reshape(b, kv_heads, rep * s, d)
    scores = torch.matmul(q, key.float().transpose(-1, -2)) * scale  # [B, kv heads, rep x S, n]
    keep = own if own is not None else _own_keep(attention_mask, b, heads, kv_heads, s, key.shape[2], query.device)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    m = scores.amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).min)  # all masked: no NaN
    p = torch.exp(scores - m)
    total = p.sum(-1, keepdim=True)  # [B, kv heads, rep x S, 1]
    out = torch.matmul(p, value.float())  # [B, kv heads, rep x S, d]
    if step.kv:
        pk, pv = step.kv[module.layer_idx]  # [G, kv heads, P, d]
        groups = pk.shape[0]
        qg = q.new_zeros(groups, step.width, kv_heads, rep * s, d)
        qg[group, place] = q[rows]
        qg = qg.permute(0, 2, 1, 3, 4).reshape(groups, kv_heads, step.width * rep * s, d)
        s2 = torch.matmul(qg, pk.float().transpose(-1, -2)) * scale  # [G, kv heads, width x rep x S, P]
        s2 = s2.masked_fill(~valid, float("-inf"))
        m2 = s2.amax(-1, keepdim=True)
        p2 = torch.exp(s2 - m2)
        t2, o2 = p2.sum(-1, keepdim=True), torch.matmul(p2, pv.float())  # [G, kv heads, width x rep x S, 1 | d]
        m2, t2, o2 = (x.view(groups, kv_heads, step.width, rep * s, -1)[group, :, place] for x in (m2, t2, o2))
        m1 = m[rows]  # [rows, kv heads, rep x S, 1]
        top = torch.maximum(m1, m2)
        a, c = torch.exp(m1 - top), torch.exp(m2 - top)
        out[rows] = out[rows] * a + o2 * c
        total[rows] = total[rows] * a + t2 * c
    out = (out / total.clamp(min=torch.finfo(torch.float32).tiny)).to(query.dtype).view(b, heads, s, d)
    return out.transpose(1, 2).contiguous(), None
