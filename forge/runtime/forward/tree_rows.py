"""Tree rows (`Batch.tree`): where each prefix and each suffix sits in a row.

Model: a tree row holds prefix groups end to end. Each run of items that share a prefix key
puts that prefix in the row once, then the items' own tokens (their suffixes) after it. An
item without a prefix is a group of its own with no prefix span. Positions restart at 0 for
each prefix and run on from its length for each of its suffixes; masks let a suffix see its
prefix's span and itself only (`forge.runtime.forward.masks`, `ctx`), so every item's states equal a
one-prompt forward pass of prefix + suffix.

A root (`root` > 0: the leading tokens every prefix of the batch shares, their keys and values
held apart, `forge.runtime.forward.tree_root`) is left out of the rows: each prefix span holds its
tokens after the root, at positions from `root` on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from forge.vocab.geometry import Item

NO_CONTEXT = -3  # the context segment of an item without a prefix span: no key carries it


@dataclass(slots=True)
class TreeLayout:
    """The spans of a batch's tree rows (row indices as in `batch.rows`)."""

    starts: list[int]  # per item: the first column of its own tokens in its row
    used: list[int]  # per row: the slots its spans take
    group_of: list[int]  # per item: the prefix span it sees (index into `spans`), -1 for none
    # per prefix span: (row, first column, its tokens in the row, an item holding its tokens)
    spans: list[tuple[int, int, int, int]]
    root: int = 0  # leading prefix tokens held apart, not in the rows


def tree_layout(rows: list[list[Item]], seqs: list[torch.Tensor], root: int = 0) -> TreeLayout:
    """Lay out `rows` (items in `batch.items` order, `seqs` their token tensors) as tree rows, each
    prefix's first `root` tokens left out; refuse items of one run whose prefixes differ."""
    starts, used, group_of = [], [], []
    spans: list[tuple[int, int, int, int]] = []
    items_prefix = [it.prefix_len for row in rows for it in row]
    k = 0
    for r, row in enumerate(rows):
        col, last = 0, None
        for it in row:
            key = it.prefix_key if it.prefix_len else None
            if key is None:
                group = -1
            elif key != last:
                spans.append((r, col, it.prefix_len - root, k))
                col += it.prefix_len - root
                group = len(spans) - 1
            else:
                holder, length = spans[group][3], it.prefix_len
                if length != items_prefix[holder] or not torch.equal(seqs[k][:length], seqs[holder][:length]):
                    raise ValueError(
                        f"item {it.id!r} shares prefix_key={key!r} with item {rows[r][0].id!r}'s run "
                        "but not its prefix tokens"
                    )
            group_of.append(group)
            starts.append(col)
            col += it.num_tokens - it.prefix_len
            last = key
            k += 1
        used.append(col)
    return TreeLayout(starts, used, group_of, spans, root)


def write_prefix_spans(
    layout: TreeLayout,
    seqs: list[torch.Tensor],
    row_map: dict[int, int],
    n_items: int,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    seg: torch.Tensor,
    ctx: torch.Tensor,
) -> None:
    """Put each prefix span's tokens in the rows (positions root..P-1, a segment of its own: n_items + span)."""
    root = layout.root
    for g, (r, col, length, holder) in enumerate(layout.spans):
        row = row_map[r]
        input_ids[row, col : col + length] = seqs[holder][root : root + length]
        position_ids[row, col : col + length] = torch.arange(root, root + length)
        seg[row, col : col + length] = n_items + g
        ctx[row, col : col + length] = n_items + g


def prefix_places(layout: TreeLayout, row_map: dict[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per item: (row run, column) of its prefix's last token; -1 for an item without one."""
    rows, cols = [], []
    for g in layout.group_of:
        if g < 0:
            rows.append(-1)
            cols.append(-1)
        else:
            r, col, length, _ = layout.spans[g]
            rows.append(row_map[r])
            cols.append(col + length - 1)
    return torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)
