"""An encoder (BERT-style) built from its config on fake tensors, for the memory fit of
`forge.runtime.forward.encoder`'s runner (`forge.runtime.cost.models.encoder_cost_model`)."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from forge.runtime.cost.memory_fit import DTYPES, _with_attn, fake_model, quiet_module_tracking, state_bytes


class FakeEncoder:
    """An encoder built from its config on fake tensors (no weights); `peak(shape)` is what one
    batch of that shape holds at its peak (weights included), for `forge.runtime.cost.memory_fit`.

    It measures the packed layout, whose 4D float mask is the larger: rows use a smaller mask,
    so the fit is an upper bound for them."""

    def __init__(self, config: Any, target: Any, trust_remote_code: bool = False):
        from transformers import AutoModel

        self.target = target
        self.dtype = DTYPES[target.dtype]
        self.mode, self.model = fake_model(_with_attn(config, target.attn), target.dtype, trust_remote_code, AutoModel)
        self.weight_bytes = state_bytes(self.model)

    def peak(self, shape: Any) -> int:
        from torch.distributed._tools.mem_tracker import MemTracker

        R, S = shape.rows, shape.padded_len
        tracker = MemTracker()
        tracker.track_external(self.model)
        with quiet_module_tracking(), self.mode, tracker, torch.inference_mode():
            tracker.reset_mod_stats()
            takes = set(inspect.signature(self.model.forward).parameters)
            extra = {
                "token_type_ids": torch.zeros(R, S, dtype=torch.long),
                "position_ids": torch.arange(S).repeat(R, 1),
                "use_cache": False,
            }
            out = self.model(
                input_ids=torch.zeros(R, S, dtype=torch.long),
                attention_mask=torch.zeros(R, 1, S, S, dtype=self.dtype),
                **{k: v for k, v in extra.items() if k in takes},
            )
            h = out.last_hidden_state
            torch.zeros(R, h.shape[-1]).index_add_(
                0, torch.arange(R).repeat_interleave(S), h.reshape(R * S, -1).float()
            )
        peaks = tracker.get_tracker_snapshot("peak")
        return int(max(v.get("Total", 0) for v in peaks.values()))
