"""Item views: one item's share of a batch's forward pass, the same in every layout.

Model: `CausalLMRunner.forward_tokens` runs a batch in any layout (rows of whole sequences;
padded rows of suffixes after a shared prefix run once or taken from the prefix cache; packed
rows of several items end to end). `views(...)` cuts what it computed into one `ItemView` per
item: the item's own tokens' hidden states at each requested layer (the tokens after its
prefix, in order), the state at its prefix's last position, and, when asked, the
log-probabilities of its target tokens. A target at position p of the item's sequence is
predicted by the final state at position p - 1: inside the item's own tokens, or, for the
first token after a split-off prefix, the prefix's last state, which the prefix cache keeps
(`PrefixEntry.last_state`), so no token is computed twice and no layout is shifted.

The LM head runs only at target positions, in chunks; log_softmax is float32. Which layout ran
is invisible here: views of the same item in two layouts are equal up to float rounding
(tests/test_views.py, tests/test_fidelity.py, tests/test_surprisal.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from forge.runtime.forward.request import Forward
from forge.runtime.forward.scoring import HEAD_CHUNK_TOKENS, LogitHead, StateHead
from forge.runtime.tokens.prompts import ItemMeta
from forge.vocab.geometry import Batch, Item
from forge.vocab.records import ResultColumns


@dataclass
class ItemView:
    """One item as its function sees it, whatever layout ran it. Tensors are on the model's device (a split
    model's: each layer's states on that layer's device)."""

    id: str  # the item's id
    index: int  # its commit key (input order)
    tokens: list[int]  # every token id of the item, prefix first
    prefix_len: int  # how many of them are the prefix
    hidden: dict[int, torch.Tensor]  # layer -> [len(tokens) - prefix_len, hidden], model dtype: own tokens, in order
    prefix_state: dict[int, torch.Tensor]  # layer -> [hidden]: the prefix's last position (empty without a prefix)
    targets: torch.Tensor  # int64 [m]: the target token ids
    logprobs: torch.Tensor | None  # float32 [m]: log-probability of each target (None: targets not asked for)
    greedy: torch.Tensor | None  # bool [m]: each target is the argmax of its position
    label: Any = None  # the row's label
    data: Any = None  # the function's own per-item metadata (`ItemMeta.data`)
    prefix_key: str | None = None  # identity of its shared prefix (None: it has none)
    # hook point -> its own tokens' values [len(tokens) - prefix_len, ...] in order (Forward.capture);
    # an attention pattern: [heads, own tokens, len(tokens)] (each own token over every key of its sequence)
    captured: dict[str, torch.Tensor] = field(default_factory=dict)
    logits: torch.Tensor | None = (
        None  # float32 [m, vocab]: at each target's position, or each own token (Forward.logits)
    )
    final_head: Any = field(default=None, repr=False)  # the worker's StateHead (Forward.head)

    def head(self, states: torch.Tensor) -> torch.Tensor:
        """float32 logits [..., vocab]: the model's final norm and LM head on `states` [..., hidden]
        (for example ``view.head(view.hidden[L])``: the logit lens). Needs ``Forward(head=True)``."""
        if self.final_head is None:
            raise ValueError("view.head needs Forward(head=True) in the function's forward")
        return self.final_head(states)

    def last(self, layer: int) -> torch.Tensor:
        """The state of the item's last token at `layer` (the prefix's, for an item that is all prefix)."""
        own = self.hidden[layer]
        return own[-1] if own.shape[0] else self.prefix_state[layer]


@dataclass
class ViewBatch:
    """A batch's views and what the runtime accounts for it."""

    views: list[ItemView]  # batch.items order
    prefix_computed_tokens: int  # prefix tokens run this batch (0 on a prefix-cache hit)
    cache_hit: bool  # the prefix came from the device's cache
    root_held_tokens: int = 0  # tree rows: prefix tokens a root held for them (`RowStates.root_held_tokens`)


class CausalViews:
    """Item views of batches run through a `CausalLMRunner` (layers as the runner keeps them)."""

    def __init__(self, runner: Any, forward: Forward):
        from forge.runtime.model.hf_compat import text_config

        self.runner = runner
        self.logits = forward.logits
        self.targets = forward.targets
        self.head = None
        if forward.lm_head:
            self.head = LogitHead(runner.model)
            self.head.verify(runner.base, int(getattr(text_config(runner.config), "vocab_size", 8) or 8))
        self.final_head = StateHead(runner.model, runner.base) if forward.head else None
        hooks = getattr(runner, "hooks", None)
        self.patterns = {n for n, p in hooks.captures.items() if p.kind == "attn_pattern"} if hooks else set()

    def run(self, batch: Batch) -> ViewBatch:
        if batch.split_prefix and not batch.prefix_len:
            batch = replace(batch, split_prefix=False)  # nothing to split off: rows hold whole sequences
        with torch.inference_mode():
            states = self.runner.forward_tokens(batch)
            if states is None:
                return ViewBatch([], 0, False)
            views = self._views(batch, states)
        return ViewBatch(views, states.prefix_computed_tokens, states.cache_hit, states.root_held_tokens)

    def _views(self, batch: Batch, states) -> list[ItemView]:
        items = batch.items
        offs = states.item_off.tolist()  # per item: its tokens before its span in the row
        entry = states.entry
        dev = self.runner.device
        layers = list(zip(self.runner.layers, self.runner._layer_idx))
        at = {i: states.hidden[i].device if i in states.hidden else dev for _, i in layers}  # each layer's own device
        prefix_split = {layer: entry.last_hidden[i].to(at[i]) for layer, i in layers} if entry is not None else {}
        logprobs, greedy, at_targets = self._targets(items, states) if self.targets else (None, None, None)
        logits: Any = at_targets if self.logits == "targets" else {} if self.logits == "all" else None
        views = []
        places = zip(states.item_row.tolist(), states.starts.tolist(), states.lens.tolist())
        in_row = [t.tolist() for t in states.prefix_at] if states.prefix_at is not None else None
        for k, (item, (row, start, n)) in enumerate(zip(items, places)):
            own_from = item.prefix_len - offs[k]
            hidden, prefix_state = {}, {}
            for layer, i in layers:
                span = states.hidden[i][row, start : start + n] if n else None
                hidden[layer] = span[own_from:] if span is not None else torch.empty(0, device=at[i])
                if not item.prefix_len:
                    continue
                if in_row is not None:  # tree rows: the prefix's last token sits in the row
                    prefix_state[layer] = states.hidden[i][in_row[0][k], in_row[1][k]]
                elif offs[k]:  # the prefix ran apart (or came from the cache)
                    prefix_state[layer] = prefix_split[layer]
                else:
                    assert span is not None  # the prefix is in the row: the row's span holds it
                    prefix_state[layer] = span[own_from - 1]
            own = (row, start + own_from, start + n)
            captured = {
                name: self._captured(name, value, states, k, item, own) for name, value in states.captured.items()
            }
            if self.logits == "all":
                logits[k] = self._own_logits(states, own)
            meta = item.meta if isinstance(item.meta, ItemMeta) else ItemMeta(label=item.meta)
            views.append(
                ItemView(
                    item.id,
                    item.index,
                    token_list(item.tokens),
                    item.prefix_len,
                    hidden,
                    prefix_state,
                    torch.as_tensor(meta.targets, dtype=torch.long),
                    None if logprobs is None else logprobs[k],
                    None if greedy is None else greedy[k],
                    meta.label,
                    meta.data,
                    item.prefix_key,
                    captured,
                    None if logits is None else logits[k],
                    self.final_head,
                )
            )
        return views

    def _captured(self, name: str, value: torch.Tensor, states, k: int, item: Item, own) -> torch.Tensor:
        """One item's share of a captured value: its own tokens (an attention pattern: their rows,
        over every key of its sequence, wherever the layout put those keys)."""
        row, lo, hi = own
        if name not in self.patterns:
            return value[row, lo:hi] if hi > lo else value.new_empty((0, *value.shape[2:]))
        if hi <= lo:
            return value.new_empty((value.shape[1], 0, item.num_tokens))
        off = int(states.item_off[k])
        start = int(states.starts[k])
        cached = states.entry.length if states.entry is not None and states.prefix_at is None else 0
        pos = torch.arange(item.num_tokens)
        keys = cached + start + pos - off
        if off:
            if states.prefix_at is not None:  # tree rows: the prefix's span sits in the row
                first = int(states.prefix_at[1][k]) - (off - 1)
                keys[:off] = first + pos[:off]
            else:  # the split prefix: the cache's keys come first
                keys[:off] = pos[:off]
        return value[row][:, lo:hi][:, :, keys.to(value.device)]

    def _own_logits(self, states, own) -> torch.Tensor:
        row, lo, hi = own
        head = self.head
        assert head is not None  # logits are asked for: the views hold the LM head
        h = states.last[row, lo:hi] if states.last is not None else states.entry.last_state[None, :0]
        return torch.cat([head(h[a : a + HEAD_CHUNK_TOKENS]).float() for a in range(0, h.shape[0], HEAD_CHUNK_TOKENS)])

    def _targets(self, items: list[Item], states):
        """Per item: float32 log-probabilities and greedy flags of its targets, and (Forward.logits
        = "targets") the float32 logits at their positions."""
        metas = [it.meta for it in items]
        counts = torch.tensor([len(m.targets) for m in metas], dtype=torch.long)
        start = torch.tensor([m.target_start for m in metas], dtype=torch.long)
        total = int(counts.sum())
        owner = torch.repeat_interleave(torch.arange(len(items)), counts)
        place = start[owner] + torch.arange(total) - (torch.cumsum(counts, 0) - counts)[owner]  # predicting position
        off = states.item_off[owner]  # per target: its item's tokens before its span
        from_prefix = place < off
        lens = torch.tensor([it.num_tokens for it in items])
        outside = (place < off - 1) | (place < 0) | (place >= lens[owner])
        if bool(outside.any()):
            k = int(owner[outside][0])
            raise ValueError(
                f"item {items[k].id!r}: its targets are predicted from positions outside "
                f"{max(int(states.item_off[k]) - 1, 0)}..{items[k].num_tokens - 1}"
            )
        final = states.last if states.last is not None else states.entry.last_state
        dev = final.device  # the final norm's device (the LM head's may differ on a split model: logp says)
        targets = torch.tensor([t for m in metas for t in m.targets], dtype=torch.long)
        width, dtype = final.shape[-1], final.dtype
        h = torch.empty(total, width, dtype=dtype, device=dev)
        rows_in = ~from_prefix
        if bool(rows_in.any()):
            rows = states.item_row[owner[rows_in]].to(dev)
            cols = (states.starts[owner[rows_in]] + place[rows_in] - off[rows_in]).to(dev)
            h[rows_in.to(dev)] = states.last[rows, cols]
        if bool(from_prefix.any()):
            if states.prefix_at is not None:  # tree rows: the prefix's last token sits in the row
                p_row, p_col = (t[owner[from_prefix]].to(dev) for t in states.prefix_at)
                h[from_prefix.to(dev)] = states.last[p_row, p_col]
            else:
                h[from_prefix.to(dev)] = states.entry.last_state.to(dev, dtype)
        logprob = torch.empty(total, dtype=torch.float32, device=dev)
        best = torch.empty(total, dtype=torch.bool, device=dev)
        head = self.head
        assert head is not None  # a scoring function's views are built with the model's head
        kept = []
        for lo in range(0, total, HEAD_CHUNK_TOKENS):
            hi = min(lo + HEAD_CHUNK_TOKENS, total)
            logits = head(h[lo:hi]).float()
            logp = torch.log_softmax(logits, dim=-1)
            tgt = targets[lo:hi].to(logp.device)
            logprob[lo:hi] = logp.gather(1, tgt[:, None])[:, 0]
            best[lo:hi] = logp.argmax(dim=-1) == tgt
            if self.logits == "targets":
                kept.append(logits)
        sizes = counts.tolist()
        at = torch.split(torch.cat(kept), sizes) if kept else None
        return torch.split(logprob, sizes), torch.split(best, sizes), at

    def close(self) -> None:
        self.runner = None


def collect(values: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """Per-item result dicts as one column per field (numpy, CPU), in item order. A field whose
    values differ in shape per item (ragged) becomes a list of arrays. bfloat16 tensors (which
    numpy lacks) travel as their bit patterns, uint16 (`forge.io.results.to_storage`)."""
    columns: dict[str, Any] = {}
    missing = [n for n in names if values and any(n not in v for v in values)]
    if missing:
        raise ValueError(f"reduce returned no {missing[0]!r}, a field the function declares; return it, or drop it")
    declared = set(names)
    extra = next((k for v in values for k in v if k not in declared), None)
    if extra is not None:  # a value no field stores would be lost without a word
        raise ValueError(
            f"reduce returned {extra!r}, which no field of the function declares; add a Field for it, or drop it"
        )
    for name in names:
        vals = [v[name] for v in values]
        if vals and isinstance(vals[0], torch.Tensor):
            shapes = {tuple(v.shape) for v in vals}
            if len(shapes) == 1:
                columns[name] = _numpy(torch.stack(vals))
            else:
                columns[name] = [_numpy(v) for v in vals]
        elif vals and isinstance(vals[0], str):
            columns[name] = list(vals)
        else:
            columns[name] = np.asarray(vals)
    return columns


def token_list(tokens) -> list[int]:
    """An item's token ids as a list of ints (items hold them as an int32 array while they wait)."""
    return tokens.tolist() if isinstance(tokens, np.ndarray) else list(tokens)


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    return t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


@dataclass
class ReducingWorker:
    """A worker: item views of each batch, reduced one item at a time by the function's `reduce`."""

    views: Any  # CausalViews (or an encoder's equivalent): run(batch) -> ViewBatch
    reduce: Callable[[ItemView], dict[str, Any]]  # one item's view -> its result values
    names: list[str] = field(default_factory=list)  # the result fields, in schema order
    folded: list[str] = field(default_factory=list)  # of them, the Aggregates (dataset-level)
    closing: Callable[[], None] | None = None  # after the views close (a device group's offload folder goes)

    def run(self, batch: Batch):
        out = self.views.run(batch)
        with torch.inference_mode():
            values = [self.reduce(view) for view in out.views]
            for name in self.folded:  # an Aggregate's values are summed in float64 by the sink: never bit patterns
                for v in values:
                    if isinstance(v[name], torch.Tensor) and v[name].is_floating_point():
                        v[name] = v[name].double()
        held = getattr(out, "root_held_tokens", 0)  # an encoder's views have no root
        columns = collect(values, self.names)
        return ResultColumns(columns, out.prefix_computed_tokens, out.cache_hit, root_held_tokens=held)

    def close(self) -> None:
        if self.views is not None:
            self.views.close()
        self.views = None
        if self.closing is not None:
            self.closing()
        self.closing = None
