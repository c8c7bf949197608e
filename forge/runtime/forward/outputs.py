"""What the causal-LM runner gives back for a batch: the pooled hidden states per layer
(`PooledOutput`, what `CausalLMRunner.run` returns), or the forward pass before pooling
(`RowStates`, what `CausalLMRunner.forward_tokens` returns for views)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from forge.runtime.forward.prefix_cache import PrefixEntry


@dataclass
class PooledOutput:
    pooled: dict[int, torch.Tensor]  # layer -> float32 CPU [n_items, hidden], batch.items order
    prefix_computed_tokens: int  # prefix tokens run this batch (0 on a cache hit)
    cache_hit: bool


@dataclass
class RowStates:
    """A batch's forward pass before pooling (`CausalLMRunner.forward_tokens`).

    Row tokens are numbered item by item in `batch.items` order, each item's in order; `tok`
    gives, per row token, (item, place within the item's row span, row, column).
    """

    hidden: dict[int, torch.Tensor]  # hidden-state index -> [rows run, padded_len, hidden], model dtype
    last: torch.Tensor | None  # the base decoder's last_hidden_state [rows run, padded_len, hidden]; None: no row token
    tok: tuple[torch.Tensor, ...] | None  # (tok_item, tok_within, tok_row, tok_col), CPU int64 [row tokens]
    total: int  # row tokens (outside the split prefix)
    lens: torch.Tensor  # per item: its tokens in the rows
    starts: torch.Tensor  # per item: its first column in its row
    item_row: torch.Tensor  # per item: the row it runs in (among rows run)
    pool_from: torch.Tensor  # per item: first place within its span after its own prefix
    item_off: torch.Tensor  # per item: its tokens before its span (the split prefix; tree rows: its own prefix)
    prefix_at: tuple[torch.Tensor, torch.Tensor] | None  # tree rows: per item, (row, column) of its prefix's last token
    entry: PrefixEntry | None  # the shared prefix's KV, when split off
    cache_hit: bool  # the prefix came from the device's cache
    prefix_computed_tokens: int  # prefix tokens run this batch (0 on a cache hit)
    captured: dict[str, torch.Tensor] = field(default_factory=dict)  # hook point -> [rows run, padded_len, ...]
    # tree rows after a root (`forge.runtime.forward.tree_root`, `entry`): the prefix tokens the rows did not
    # hold, the root's length times the prefix spans
    root_held_tokens: int = 0
