"""Prefill: a block of prompts run through the model chunk by chunk, into a cache of their own.

Model: the prompts of a block are left-padded to a common length (``pads[g]`` columns before prompt
``g``), so each is contiguous and ends at the block's last column, as a decoding slot wants it
(`forge.runtime.decoder.kv_slots`). Where prompts start with a prefix whose KV is known (computed
once, kept in a `forge.runtime.forward.prefix_cache.PrefixCache`), the block's first ``C`` columns
are that KV instead of a forward pass: prompt ``g`` holds its prefix's first ``C - pads[g]`` tokens
there, and its remaining tokens are computed. ``C`` is the most every prompt allows, min over g of
``pads[g] + P_g``: a prompt shorter than the longest, or with a shorter prefix, recomputes the rest
of its prefix: `BlockPrefill` splits a block into such rectangles of prompts that compute about as
many columns each (`split`), so little is recomputed or padded. Each `run` computes the next columns
within a token budget; once all are computed, `last_logits` gives each prompt's next token's logits
and `kv(g)` its keys and values, for a slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicLayer

from forge.runtime.model.hf_compat import input_device

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values


def forward(model: Any, ids, mask, positions, cache: Cache):
    """The model's logits of the last column only, with `cache` extended by the columns of `ids`
    (position ids where the model takes them: BLOOM's ALiBi counts the mask's ones itself)."""
    known = _TAKES.get(type(model))
    if known is None:
        import inspect

        params = inspect.signature(type(model).forward).parameters
        cache_key = "cache" if "cache" in params else "past_key_values"  # transformers 5.x renames it
        known = _TAKES[type(model)] = ("position_ids" in params, "logits_to_keep" in params, cache_key)
    extra = {"position_ids": positions} if known[0] else {}
    if known[1]:
        extra["logits_to_keep"] = 1
    out = model(input_ids=ids, attention_mask=mask, use_cache=True, **{known[2]: cache}, **extra)
    return out.logits[:, -1]


_TAKES: dict[type, tuple[bool, bool, str]] = {}


@dataclass
class Steer:
    """What the interventions' hooks are told of a prefill's prompts (`forge.runtime.hooks.points.Slots`)."""

    hooks: Any  # a forge.runtime.hooks.points.HookSet
    lens: list[tuple[int, int]] | None  # each prompt's (prefix length, prompt length); None: shared prefixes alone
    items: list[int] | None = None  # each prompt's item in the batch (a shared prefix's: an item holding it)
    table: Any = None  # the batch's per-item parameters (forge.runtime.hooks.row_tables.RowTables), or None

    def take(self, rows: list[int]) -> Steer:
        """The same for the prompts `rows` of these (a block's part)."""
        lens = None if self.lens is None else [self.lens[g] for g in rows]
        return Steer(self.hooks, lens, None if self.items is None else [self.items[g] for g in rows], self.table)


def steered(hooks: Any, slots: Any, model: Any, ids, mask, positions, cache: Cache):
    """`forward` with the interventions' hooks told where each slot sits (`slots`)."""
    hooks.begin(slots, False)
    try:
        return forward(model, ids, mask, positions, cache)
    finally:
        hooks.end()


class Prefill:
    """Prompts prefilled together; `prefixes[g]`: the KV (``[1, heads, P, dim]`` per layer) of prompt
    g's first tokens, or None. `steer`: a `Steer`: the interventions' hooks, where each prompt's tokens
    sit, and whose per-row parameters apply to it."""

    def __init__(self, model: Any, prompts: list[list[int]], num_layers: int, pad_id: int, prefixes: list[KV | None],
                 steer: Steer | None = None, offsets: list[int] | None = None,
                 shared: Any = None):  # fmt: skip
        self.model, self.device = model, input_device(model)  # split over devices: its embeddings' device
        self.steer = steer
        # the stored prefixes these prompts come after (a `shared_prefix.Step`, or what builds it when the
        # first columns run: a block's parts do not each hold a stack of prefixes at once), or None
        self.shared = shared
        self.lens = [len(t) for t in prompts]
        width = max(self.lens)
        self.pads = [width - n for n in self.lens]
        known = [0 if kv is None else kv[0][0].shape[2] for kv in prefixes]
        self.p = min(a + min(k, n - 1) for a, k, n in zip(self.pads, known, self.lens))  # a token of each computed
        rows = [[pad_id] * a + t for a, t in zip(self.pads, prompts)]
        self.ids = torch.tensor(rows, device=self.device)
        self.mask = torch.tensor([[0] * a + [1] * n for a, n in zip(self.pads, self.lens)], device=self.device)
        self.positions = (self.mask.cumsum(1) - 1).clamp(min=0)
        if offsets is not None:  # prompts that start after a stored prefix: their tokens' own positions
            self.positions += torch.tensor(offsets, device=self.device)[:, None]
        self.layers = [DynamicLayer() for _ in range(num_layers)]
        self.cache = Cache(layers=list[Any](self.layers))
        if self.p:
            self._seed(prefixes)
        self.done_to = self.p  # columns computed (or seeded)
        self.width = width
        self.last_logits: torch.Tensor | None = None

    def _seed(self, prefixes: list[KV | None]) -> None:
        """The first C columns from the prefixes' KV: prompt g's [pads[g], C) are its tokens [0, C - pads[g])."""
        b, c = len(self.lens), self.p
        some = next(kv for kv in prefixes if kv is not None)
        for i, layer in enumerate(self.layers):
            k0, v0 = some[i]
            keys = k0.new_zeros(b, k0.shape[1], c, k0.shape[3])
            values = v0.new_zeros(b, v0.shape[1], c, v0.shape[3])
            for g, (a, kv) in enumerate(zip(self.pads, prefixes)):
                if a < c and kv is not None:
                    keys[g, :, a:] = kv[i][0][0, :, : c - a]
                    values[g, :, a:] = kv[i][1][0, :, : c - a]
            layer.update(keys, values)

    @property
    def finished(self) -> bool:
        return self.done_to >= self.width

    def run(self, budget: int) -> int:
        """Compute the next columns, at most `budget` tokens of prompts; returns the tokens computed."""
        w = max(1, budget // len(self.lens))
        a, b = self.done_to, min(self.width, self.done_to + w)
        args = (self.model, self.ids[:, a:b], self.mask[:, :b], self.positions[:, a:b], self.cache)
        if callable(self.shared):
            self.shared = self.shared()
        if self.shared is not None:
            from forge.runtime.forward import shared_prefix

            shared_prefix.SHARED.step = self.shared
        try:
            logits = forward(*args) if self.steer is None else steered(self.steer.hooks, self._slots(a, b), *args)
        finally:
            if self.shared is not None:
                shared_prefix.SHARED.step = None
        self.done_to = b
        if self.finished:
            self.last_logits = logits
            self.shared = None  # its stack of prefixes is not held past the last columns
        return int(self.mask[:, a:b].sum())

    def _slots(self, a: int, b: int) -> Any:
        """Where the tokens of columns [a, b) sit in their sequences (`forge.runtime.hooks.points.Slots`)."""
        from forge.runtime.hooks.points import Slots

        steer = self.steer
        assert steer is not None
        position = self.positions[:, a:b].cpu()
        valid = self.mask[:, a:b].cpu().bool()
        item = torch.tensor(steer.items)[:, None].expand_as(position) if steer.items is not None else None
        if steer.lens is None:  # shared prefixes: every token a prefix token
            return Slots(position, position + 1, torch.full_like(position, -1), valid, item, steer.table)
        prefix = torch.tensor([p for p, _ in steer.lens])[:, None].expand_as(position)
        prompt = torch.tensor([n for _, n in steer.lens])[:, None].expand_as(position)
        return Slots(position, prefix, prompt, valid, item, steer.table)

    def drop_cache(self) -> None:
        """Free its keys and values (its prompts have been placed: `kv`, `layer_kv` no longer answer)."""
        self.layers = []
        self.cache = Cache(layers=[])

    def layer_kv(self) -> KV:
        """Every prompt's keys and values so far, ``[prompts, heads, columns, dim]`` per layer."""
        out = []
        for layer in self.layers:
            assert layer.keys is not None and layer.values is not None  # filled by a forward pass
            out.append((layer.keys, layer.values))
        return out

    def kv(self, g: int) -> KV:
        """Prompt g's keys and values, ``[heads, its tokens, dim]`` per layer."""
        a = self.pads[g]
        return [(k[g, :, a:], v[g, :, a:]) for k, v in self.layer_kv()]


FORWARD_TOKENS = 32  # a forward pass's fixed cost in tokens of work (its weight reads, its per-layer calls)


def split(rests: list[int], overhead: int = FORWARD_TOKENS) -> list[list[int]]:
    """The prompts of a block (by `rests`: the columns each computes) in parts, each one `Prefill`
    of its rows x its longest rest: the split of least work, `overhead` a part plus its rows x
    columns (pads and recomputed prefix tokens included), over the prompts sorted by rest (a
    dynamic program over its distinct values). Returns each part's indexes into `rests`."""
    order = np.argsort(np.asarray(rests), kind="stable")
    values, counts = np.unique(np.asarray(rests)[order], return_counts=True)
    before = np.concatenate([[0], np.cumsum(counts)])  # prompts before each distinct value
    best = np.zeros(len(values) + 1)  # least work for the prompts before each value
    start = np.zeros(len(values) + 1, dtype=int)  # where the last part of that best begins
    for j in range(1, len(values) + 1):
        work = best[:j] + overhead + (before[j] - before[:j]) * values[j - 1]
        start[j] = int(np.argmin(work))
        best[j] = work[start[j]]
    parts, j = [], len(values)
    while j > 0:
        parts.append(order[before[start[j]] : before[j]].tolist())
        j = start[j]
    return parts[::-1]


class BlockPrefill:
    """A block of prompts prefilled in parts (`split`): the prompts of a part compute about as many
    columns each, so few pads and recomputed prefix tokens go through the model."""

    def __init__(self, model: Any, prompts: list[list[int]], num_layers: int, pad_id: int, prefixes: list[KV | None],
                 steer: Steer | None = None, shared: Any = None):  # fmt: skip
        """`shared(prefixes)`: where given, prompts after a stored prefix compute only their own
        tokens and read the prefix through Forge's attention (a `forge.runtime.forward.shared_prefix.Step` for a part's
        rows' prefixes); else their first columns are seeded with the prefix's KV."""
        known = [0 if kv is None else kv[0][0].shape[2] for kv in prefixes]
        if shared is None:  # a prompt as long as its prefix recomputes its last token
            rests = [len(t) - min(k, len(t) - 1) for t, k in zip(prompts, known)]
        else:  # read apart: a prompt reads its whole prefix or none of it
            rests = [len(t) - (k if k < len(t) else 0) for t, k in zip(prompts, known)]
        self.parts = []
        self.skipped = [
            len(t) - r for t, r in zip(prompts, rests)
        ]  # prefix tokens each prompt reads apart (not computed)
        for rows in split(rests):
            part = None if steer is None else steer.take(rows)
            kvs = [prefixes[g] for g in rows]
            if shared is None:
                fill = Prefill(model, [prompts[g] for g in rows], num_layers, pad_id, kvs, part)
            else:
                skip = [self.skipped[g] for g in rows]
                step = partial(shared, [kv if k else None for kv, k in zip(kvs, skip)])  # built when it runs
                own = [prompts[g][k:] for g, k in zip(rows, skip)]
                fill = Prefill(model, own, num_layers, pad_id, [None] * len(rows), part, skip, step)
            self.parts.append((rows, fill))
        self.width = max(map(len, prompts))
        self.slots_run = 0  # rows x columns computed: the work, its pads and recomputed prefix tokens included
        self.tokens_run = 0  # the prompt tokens among them

    @property
    def finished(self) -> bool:
        return all(part.finished for _, part in self.parts)

    def run(self, budget: int) -> int:
        """The next columns of the parts in turn, at most `budget` rows x columns in all (a part
        runs when a column of each of its rows fits); returns the prompt tokens computed."""
        tokens = 0
        for rows, part in self.parts:
            if part.finished:
                continue
            if budget < len(rows):
                break
            done, computed = part.done_to, part.run(budget)
            used = len(rows) * (part.done_to - done)
            tokens, budget = tokens + computed, budget - used
            self.tokens_run += computed
            self.slots_run += used
        return tokens

    def held_columns(self) -> int:
        """The rows x columns of KV its parts' caches hold once computed."""
        return sum(len(rows) * part.width for rows, part in self.parts)


#: the stored prefixes' bound, in prefix tokens, when the run's mode has no prefix cache (batching.cache_tokens)
PREFIX_TOKENS = 65536
