"""A shared prefix's keys and values, run on the runner's device into a `PrefixEntry`: the whole
prefix, or only what follows a start of it that another cached entry holds
(`PrefixCache.longest_start`: the first n tokens' keys and values are that entry's first n).

After a start, the prefix's own tokens run at positions n.. on a cache holding the start's keys; on
a model with sliding windows Forge's 4D mask (`forge.runtime.forward.masks`) keeps each query to its
window of them, as for rows after a split prefix. Equal to one forward pass of the whole prefix,
within float rounding (tests/test_fidelity.py).
"""

from __future__ import annotations

from typing import Any

import torch

from forge.runtime.forward.masks import additive_masks
from forge.runtime.forward.prefix_cache import PrefixEntry
from forge.runtime.hooks import points as hooks
from forge.runtime.model import hf_compat


def run_prefix(runner: Any, prefix: torch.Tensor, start: tuple[PrefixEntry, int] | None = None) -> PrefixEntry:
    """`prefix` (1-D token ids) through `runner`'s base decoder (a `CausalLMRunner`), after `start`
    (an entry and how many of its first tokens begin `prefix`; None: from the first token)."""
    P, n = prefix.numel(), (start[1] if start is not None else 0)
    dev = runner.device
    past = [(k[:, :, :n], v[:, :, :n]) for k, v in start[0].key_values] if start is not None else None
    kv_cache = hf_compat.plain_cache(past)  # every layer keeps all prefix keys; masks apply the windows
    slots = hooks.Slots.prefix(P, dev, runner._table) if runner.hooks.active else None
    positions = torch.arange(n, P).view(1, P - n)
    extra: dict[str, Any] = {}
    if n and runner.caps.windows:  # a window's far keys of the start are masked off, layer type by layer type
        seg = torch.zeros(1, P - n, dtype=torch.long)
        layer_types, window = runner.caps.layer_types, runner.caps.windows[0]
        extra["attention_mask"] = additive_masks(seg, positions, n, layer_types, window, runner.dtype, dev)
    out, _ = runner.hooks.run(
        runner.base,
        slots,
        False,  # captures keep an item's own tokens: a split-off prefix is not one
        input_ids=prefix[n:].view(1, P - n).to(dev),
        position_ids=positions.to(dev),
        use_cache=True,
        output_hidden_states=runner._hs_select or False,
        **{runner._cache_kw: kv_cache},
        **extra,
    )
    produced = hf_compat.output_cache(out)
    return PrefixEntry(
        key_values=hf_compat.cache_key_values(produced if produced is not None else kv_cache),
        length=P,
        tokens=prefix.clone(),
        last_hidden={i: out.hidden_states[i][0, -1].float().cpu() for i in runner._hs_select},
        last_state=out.last_hidden_state[0, -1].clone(),
    )
