"""Shared-prefix attention: rows after a prefix read its keys and values once per forward pass, one
copy for all of them, never a copy per row. One function, one registration, one rule, for both users:

- the forward runners (`forge.runtime.forward.causal_lm`): rows of suffixes after ONE cached prefix
  (`forward`, a `Step` of one prefix that every row reads: `one`). Handing the model a KV cache
  instead makes every layer concatenate the prefix's keys, expanded to every row, with the rows'
  own: B x (P + S) keys per layer, about 60% of such a forward on a CPU (B=256 rows of S=10 after
  P=340, the embedded model);
- the decoder (`forge.runtime.decoder.engine`): decode steps and prefills of rows after G stored
  prefixes, stacked (`stack`), each row reading its own (`Step.rows`, `group`, `place`), and its
  own keys either under transformers' mask or at its own length (`Step.own`,
  `forge.runtime.decoder.rows_kv`).

Model: each row's queries attend over its prefix's keys and then its own. The softmax over both is
split exactly (the log-sum-exp merge): each part gives its maximum score ``m``, the sum of
``exp(score - m)`` and the weighted sum of values, and the two combine with ``exp(m_part - m)``
factors; scores and softmax in float32. The prefix part is one matmul per prefix over ``[kv heads,
rows x queries, dim] x [kv heads, dim, P]`` (query head h reads key head h // rep, so grouped heads
are never expanded). With one prefix that every row reads, rows go in chunks that bound the
scores' memory (`CHUNK_SCORES`); the decoder's stacked prefixes go in groups that bound their
scores' (`PREFIX_SCORE_BYTES`: a prefill part's queries over every stacked prefix can be hundreds of
MiB). Scores are scaled, masked and exponentiated in place: one such tensor held at a time.

It is registered in transformers' attention registry (`AttentionInterface`, with sdpa's mask
format) as ``forge_shared_prefix``, and it reads the pass's prefixes from `SHARED.step` (this
thread's); with none set it is sdpa itself. The one rule (`eligible`): the split equals the
model's attention where that is plain scaled dot-product over the keys: every layer full attention
(no sliding window), no ALiBi, no logit soft-capping, no attention sinks, no latent (MLA) heads,
and the model dispatches its attention through the interface. What arrives here anyway with
anything else set is refused (`NotShareable`), never computed differently. The forward runner also
counts the layers that came here (`Step.calls`): fewer than the model has, and it keeps the cache
path for good.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

NAME = "forge_shared_prefix"
#: most float32 score elements one chunk of rows holds (128 MiB), prefix and row keys together
CHUNK_SCORES = 32 * 2**20
KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values


@dataclass
class Step:
    """The shared prefixes of one forward pass: per layer ``[G, kv heads, P, dim]`` keys and values
    (zero past each prefix's length, `valid` says where; None: all P long), which rows read which
    (`rows`, each one's prefix `group` and its `place` among that prefix's rows, `width` the most
    rows of one prefix; `rows` None: every row reads prefix 0, in order); and `own`, the columns of
    its own keys each row reads (``[rows, 1, 1, columns]`` bool, `forge.runtime.decoder.rows_kv`),
    or None: transformers' mask says (causal when it gives none)."""

    kv: KV  # empty: no row reads a prefix
    valid: torch.Tensor | None  # [G, 1, 1, P] bool
    rows: torch.Tensor | None  # rows reading a prefix
    group: torch.Tensor | None  # each one's prefix (0..G-1)
    place: torch.Tensor | None  # its place among its prefix's rows
    width: int  # the most rows of one prefix
    own: torch.Tensor | None = None
    calls: int = 0  # attention calls that read it (one per layer where the family dispatches here)
    copies: dict = field(default_factory=dict)  # (valid, rows, group, place, own) per device of a layer split off

    def on(self, device: torch.device) -> tuple[Any, ...]:
        """`valid`, `rows`, `group`, `place` and `own` on `device` (a model split over devices: a layer's own)."""
        tensors = (self.valid, self.rows, self.group, self.place, self.own)
        here = next((t.device for t in tensors if t is not None), device)
        if device == here:
            return tensors
        if device not in self.copies:
            self.copies[device] = tuple(None if t is None else t.to(device) for t in tensors)
        return self.copies[device]


def one(key_values: KV) -> Step:
    """A pass whose every row reads the one prefix `key_values` (``[1, kv heads, P, dim]`` per layer)."""
    return Step(key_values, None, None, None, None, 0)


def stack(
    prefixes: list[KV], adopt: bool = False, each_layer: Callable[[], object] | None = None
) -> tuple[KV, torch.Tensor]:
    """Per layer, the prefixes' KV ``[1, kv heads, P_g, dim]`` zero-padded into one tensor; and `valid`.
    `adopt`: each prefix's list then holds views into the stack, replaced layer by layer as it is
    built, so the stack is their storage and what they held before is freed a layer at a time
    instead of being kept beside the whole new stack. `each_layer`: called after each layer (the
    decoder hands the freed copies back to the system there, `forge.runtime.decoder.heap`)."""
    lengths = [kv[0][0].shape[2] for kv in prefixes]
    longest = max(lengths)
    layers = []
    for i in range(len(prefixes[0])):
        k0, v0 = prefixes[0][i]
        k = k0.new_zeros(len(prefixes), k0.shape[1], longest, k0.shape[3])
        v = v0.new_zeros(len(prefixes), v0.shape[1], longest, v0.shape[3])
        for g, (kv, n) in enumerate(zip(prefixes, lengths)):
            k[g, :, :n], v[g, :, :n] = kv[i][0][0], kv[i][1][0]
            if adopt:
                kv[i] = (k[g : g + 1, :, :n], v[g : g + 1, :, :n])
        layers.append((k, v))
        if each_layer is not None:
            each_layer()
    valid = torch.zeros(len(prefixes), 1, 1, longest, dtype=torch.bool, device=layers[0][0].device)
    for g, n in enumerate(lengths):
        valid[g, ..., :n] = True
    return layers, valid


class _Shared(threading.local):
    step: Step | None = None


SHARED = _Shared()
_registered = False


class NotShareable(RuntimeError):
    """This attention call cannot use the shared prefixes exactly (`eligible` should have said so)."""


def register() -> bool:
    """Register the attention function (and sdpa's mask builder under its name) once; False on a
    transformers without these interfaces (older 4.x releases): no model takes it there."""
    global _registered
    if not _registered:
        try:
            from transformers import AttentionInterface
            from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
        except ImportError:
            return False
        AttentionInterface.register(NAME, attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _registered = True
    return True


def eligible(model: Any) -> str | None:
    """None when the split is exact for this model's attention; else why not (the one rule)."""
    config = model.config.get_text_config()
    for key in ("attn_logit_softcapping", "sliding_window", "alibi", "kv_lora_rank", "use_sliding_window"):
        if getattr(config, key, None):
            return f"its config sets {key}"
    if getattr(config, "position_embedding_type", None) == "alibi" or config.model_type in ("bloom", "mpt"):
        return "it adds ALiBi biases to the scores"
    if set(getattr(config, "layer_types", None) or ()) - {"full_attention"}:
        return "it has layers other than full attention"
    if any(name.endswith(".sinks") for name, _ in model.named_parameters()):
        return "its attention has sinks"
    if not getattr(type(model), "_supports_attention_backend", False):
        return "its attention does not go through transformers' attention interface"
    return None


def install(model: Any) -> str | None:
    """Make it the model's attention for good (the decoder: every pass, sdpa itself outside Forge's);
    None when done, else why not: not `eligible`, or the model runs other than the sdpa it stands in for."""
    why = eligible(model)
    if why is None and getattr(model.config, "_attn_implementation", "sdpa") not in ("sdpa", NAME):
        why = f"it runs {model.config._attn_implementation} attention, not the sdpa the split stands in for"
    if why is None and not register():
        why = "this transformers has no attention interface"
    if why is None:
        model.set_attn_implementation(NAME)
    return why


def _sdpa(*args, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(*args, **kwargs)


def _keep(attention_mask: torch.Tensor | None, s: int, n: int, device) -> torch.Tensor | None:
    """Which of its own keys each query sees, ``[B or 1, 1 or kv heads, 1 or rep, S, n]`` as the
    scores are laid out grouped (transformers' mask: bool, or additive with 0 where seen); causal
    when it gives none."""
    if attention_mask is None:
        if s == 1:
            return None
        cols = torch.arange(n, device=device)
        return (cols[None] <= (n - s + torch.arange(s, device=device))[:, None])[None, None, None]
    keep = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    return keep[:, :, None]  # [B, 1 or H, S, n] -> heads split below when given per head


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """transformers' attention-interface signature: ``query [B, H, S, d]``, ``key``/``value``
    ``[B, kv heads, n, d]``; returns ``[B, S, H, d]`` and no weights."""
    step = SHARED.step
    if step is None:
        return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    extra = [k for k in ("sliding_window", "softcap", "s_aux", "sinks", "position_bias") if kwargs.get(k) is not None]
    if dropout:
        extra.append("dropout")
    index = getattr(module, "layer_idx", None)
    b, heads, s, d = query.shape
    kv_heads = key.shape[1]
    pk, pv = step.kv[int(index)] if step.kv and index is not None else (None, None)
    if extra or index is None or heads % kv_heads or (pk is not None and pk.shape[1] != kv_heads):
        why = ", ".join(extra) or "no layer_idx, or an unexpected head layout"
        raise NotShareable(f"shared-prefix attention cannot split this attention: {why}")
    step.calls += 1
    scale = scaling if scaling is not None else d**-0.5
    rep = heads // kv_heads
    valid, rows, group, place, own = step.on(query.device)
    keep = own[:, :, None] if own is not None else _keep(attention_mask, s, key.shape[2], query.device)
    if keep is not None and keep.shape[1] == heads and rep > 1:
        keep = keep.reshape(keep.shape[0], kv_heads, rep, s, -1)
    q = query.float().reshape(b, kv_heads, rep * s, d)
    if pk is None or rows is not None:  # no prefix, or the decoder's stacked ones: the whole pass at once
        out = _attend(q, key, value, keep, scale, rep, s, pk, pv, valid, rows, group, place, step.width)
    else:  # one prefix every row reads: rows in chunks
        chunk = max(1, CHUNK_SCORES // max(1, heads * s * (pk.shape[2] + key.shape[2])))
        out = torch.empty(b, kv_heads, rep * s, value.shape[-1], dtype=torch.float32, device=query.device)
        for lo in range(0, b, chunk):
            hi = min(b, lo + chunk)
            part = keep if keep is None or keep.shape[0] == 1 else keep[lo:hi]
            out[lo:hi] = _attend(q[lo:hi], key[lo:hi], value[lo:hi], part, scale, rep, s, pk, pv)
    out = out.to(query.dtype).view(b, heads, s, -1)
    return out.transpose(1, 2).contiguous(), None


def _attend(q, key, value, keep, scale: float, rep: int, s: int, pk, pv, valid=None, rows=None, group=None,
            place=None, width: int = 0) -> torch.Tensor:  # fmt: skip
    """Rows' queries ``q [b, kv heads, rep x S, d]`` (float32) over their own keys and, merged in,
    their prefix's: ``[b, kv heads, rep x S, dv]`` float32, normalised."""
    b, kv_heads = q.shape[:2]
    n = key.shape[2]
    scores = torch.matmul(q, key.float().transpose(-1, -2)).mul_(scale)  # [b, kv heads, rep x S, n]
    if keep is not None:
        scores.view(b, kv_heads, rep, s, n).masked_fill_(~keep, float("-inf"))
    m = scores.amax(-1, keepdim=True).clamp_(min=torch.finfo(torch.float32).min)  # all masked: no NaN
    p = scores.sub_(m).exp_()
    total = p.sum(-1, keepdim=True)  # [b, kv heads, rep x S, 1]
    out = torch.matmul(p, value.float())  # [b, kv heads, rep x S, dv]
    del scores, p  # freed before the prefix's scores are made: not both held at once
    if pk is None:
        return out.div_(total.clamp_(min=torch.finfo(torch.float32).tiny))
    if rows is None:  # every row reads prefix 0: all rows' queries against its one copy
        qp = q.transpose(0, 1).reshape(kv_heads, b * rep * s, -1)
        s2 = torch.matmul(qp, pk[0].float().transpose(-1, -2)).mul_(scale)  # [kv heads, b x rep x S, P]
        m2 = s2.amax(-1, keepdim=True)
        p2 = s2.sub_(m2).exp_()
        t2, o2 = p2.sum(-1, keepdim=True), torch.matmul(p2, pv[0].float())
        m2, t2, o2 = (x.view(kv_heads, b, rep * s, -1).transpose(0, 1) for x in (m2, t2, o2))
        top = torch.maximum(m, m2)
        a, c = (m - top).exp_(), (m2 - top).exp_()
        out = out.mul_(a).add_(o2 * c)
        total = total.mul_(a).add_(t2 * c)
        return out.div_(total)
    groups = pk.shape[0]
    qg = q.new_zeros(groups, width, kv_heads, rep * s, q.shape[-1])
    qg[group, place] = q[rows]
    qg = qg.permute(0, 2, 1, 3, 4).reshape(groups, kv_heads, width * rep * s, -1)
    m2, t2, o2 = _prefix_part(qg, pk, pv, valid, scale)  # [G, kv heads, width x rep x S, 1 | 1 | d]
    m2, t2, o2 = (x.view(groups, kv_heads, width, rep * s, -1)[group, :, place] for x in (m2, t2, o2))
    m1 = m[rows]  # [rows, kv heads, rep x S, 1]
    top = torch.maximum(m1, m2)
    a, c = torch.exp(m1 - top), torch.exp(m2 - top)
    out[rows] = out[rows] * a + o2 * c
    total[rows] = total[rows] * a + t2 * c
    return out.div_(total.clamp_(min=torch.finfo(torch.float32).tiny))


#: the most bytes of prefix scores one matmul of the decoder's stacked prefixes makes: a prefill
#: part's rows x queries over every stacked prefix can be hundreds of MiB at once, so the prefixes
#: are taken this many scores' worth at a time
PREFIX_SCORE_BYTES = 32 * 2**20


def _prefix_part(qg: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor, valid: torch.Tensor | None, scale: float):
    """Each prefix's part of the split softmax for its queries ``qg [G, kv heads, Q, d]``: the maximum
    score, the sum of exp(score - maximum) and the weighted values (``[G, kv heads, Q, 1 | 1 | dv]``),
    over the prefixes in groups whose scores hold at most PREFIX_SCORE_BYTES. Each prefix's figures
    come from its own matmuls either way, so they equal those of all the prefixes at once."""
    groups, kv_heads, queries, _ = qg.shape
    take = max(1, PREFIX_SCORE_BYTES // max(1, kv_heads * queries * pk.shape[2] * 4))  # float32 scores
    m2 = qg.new_empty(groups, kv_heads, queries, 1)
    t2 = qg.new_empty(groups, kv_heads, queries, 1)
    o2 = qg.new_empty(groups, kv_heads, queries, pv.shape[-1])
    for a in range(0, groups, take):
        z = slice(a, a + take)
        s2 = torch.matmul(qg[z], pk[z].float().transpose(-1, -2)).mul_(scale)  # [g, kv heads, Q, P]
        if valid is not None:
            s2.masked_fill_(~valid[z], float("-inf"))
        torch.amax(s2, -1, keepdim=True, out=m2[z])
        p2 = s2.sub_(m2[z]).exp_()  # in place: one group's scores held at a time
        torch.sum(p2, -1, keepdim=True, out=t2[z])
        torch.matmul(p2, pv[z].float(), out=o2[z])
    return m2, t2, o2


# ----------------------------------------------------------------------------- the forward runners' use


def worth_sharing(row_len: int, heads: int, key_values: KV) -> bool:
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


def forward(base: Any, key_values: KV, used: list[int], **inputs: Any):
    """The base model's forward over rows after the one prefix `key_values`, through this
    attention (the model's implementation switched to it for this call alone); None when the
    family cannot take it (not every layer's attention came here): the caller runs the cache path
    instead, and should not ask again. The caller has checked `eligible`."""
    config = base.config
    if getattr(config, "sub_configs", None) or not register():
        return None  # sub-configs: setting the implementation would reach configs this forward does not run
    step = one(key_values)
    before, outer = config._attn_implementation, SHARED.step
    ids = inputs["input_ids"]
    mask = row_masks(used, ids.shape[1], next(base.parameters()).dtype, ids.device)
    config._attn_implementation = NAME
    SHARED.step = step
    try:
        out = base(**inputs, attention_mask=mask, use_cache=False)
    finally:
        config._attn_implementation, SHARED.step = before, outer
    return out if step.calls == len(key_values) else None
