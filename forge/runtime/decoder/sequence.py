"""A sequence being generated, what a decoder's call did, and where a decode step's tokens sit.

`Sequence` is one prompt in Forge's decoder (`forge.runtime.decoder.engine`): its tokens, limits and
stream, the slot it holds. `step_slots` says where each running slot's token sits in its sequence
for the interventions' hooks (`forge.runtime.hooks.points.Slots`): past its prompt, a generated token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class Sequence:
    """One prompt being generated."""

    index: int  # in the request
    prompt: list[int]
    prefix_len: int  # its first tokens shared with other prompts (0: none)
    max_new_tokens: int
    stop: tuple[str, ...]
    rng: np.random.Generator | None
    out: list[int] = field(default_factory=list)
    slot: int = -1
    finished: bool = False
    prefix_kv: Any = None  # its prefix's KV, read by shared-prefix attention (None: its slot holds every token)
    admitted: int = -1  # when it last took a slot (the latest admitted is preempted first)
    # what else decides its prefix's KV beside the tokens: its per-row interventions' changes to its
    # prefix tokens (its item's prefix key; None: none), so only prefixes changed alike are shared
    prefix_tag: Any = None

    def tokens(self) -> list[int]:
        """What a prefill computes: the prompt, and after a preemption the tokens generated so far."""
        return self.prompt + self.out


@dataclass
class DecodeFigures:
    """What one `Decoder.generate` did."""

    steps: list[int]  # tokens each step carried (decode + prefill)
    prefix_hits: int  # prefixes a block found already stored
    decode_tokens: int = 0  # tokens fed back to the model one per running sequence and step
    preempted: int = 0  # sequences put back to wait (their slots freed for the KV budget), then recomputed
    recomputed_tokens: int = 0  # the tokens they had generated, prefilled again with their prompts
    kv_peak_bytes: int = 0  # the most keys and values held at once, as accounted: slots, copies, what is beside
    kv_held_peak_bytes: int = 0  # the most the sequences' and prefixes' tokens held at once (0: not counted)
    prefix_stored_tokens: int = 0  # prefix tokens of sequences whose prefix the store held when called
    prefill_pads: int = 0  # pad slots prompt blocks ran through the model (masked: work, not tokens)


def least_kv_bytes(longest: int, column_bytes: float, layers: int) -> int:
    """A KV budget (`Decoder(kv_bytes=)`) that runs one sequence of `longest` tokens: its prompt's
    prefill cache and its slot, a buffer copy's one layer more included, beside stored prefixes'
    quarter of the budget."""
    return int(longest * column_bytes * (2 + 1 / layers) * 4 / 3) + 1


def step_slots(positions: torch.Tensor, running: dict[int, Sequence], table: Any = None) -> Any:
    """Where a decode step's tokens sit in their sequences (`forge.runtime.hooks.points.Slots`): each running
    slot's token is at its position, past its prompt (a generated token), of its sequence's item in
    the batch; `table`: the batch's per-item intervention parameters (`forge.runtime.hooks.row_tables`)."""
    from forge.runtime.hooks.points import Slots

    position = positions[:, None].cpu()
    prefix = torch.zeros_like(position)
    prompt = torch.zeros_like(position)
    item = torch.full_like(position, -1)
    valid = torch.zeros_like(position, dtype=torch.bool)
    slots = list(running)
    prefix[slots, 0] = torch.tensor([running[s].prefix_len for s in slots])
    prompt[slots, 0] = torch.tensor([len(running[s].prompt) for s in slots])
    item[slots, 0] = torch.tensor([running[s].index for s in slots])
    valid[slots, 0] = True
    return Slots(position, prefix, prompt, valid, item, table)
