"""Admission: what happens to each record between the input and the packer's window.

Records come from a function as `Item`s or `Rejected`. Every record is counted as
received, then either admitted, skipped (too long, over `budget.max_tokens`) or failed
(rejected). Hooks fire per chunk so counting stays cheap on millions of items.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Iterator

from forge.errors import ForgeError
from forge.geometry import Item
from forge.run import Rejected, RunContext

TOO_LONG_POLICIES = ("skip", "truncate", "error")


def admit(
    records: Iterable[Item | Rejected],
    *,
    run: RunContext,
    hook,
    max_seq_len: int,
    too_long: str = "skip",
    max_tokens: int | None = None,
    chunk: int = 512,
) -> Iterator[Item]:
    """Yield the items that may run; report every record to the hooks."""
    if too_long not in TOO_LONG_POLICIES:
        raise ForgeError(f"too_long={too_long!r}; choose one of: {', '.join(TOO_LONG_POLICIES)}")
    received_tokens = 0
    buf: list[Item] = []
    for record in records:
        if isinstance(record, Rejected):
            hook.forge_input_failed(run=run, record_id=record.record_id, reason=record.reason)
            continue
        if record.num_tokens <= (record.prefix_len if record.prefix_key is not None else 0):
            hook.forge_input_failed(run=run, record_id=record.id, reason=(
                f"item {record.id!r} has {record.num_tokens} tokens and a {record.prefix_len}-token prefix: "
                "it needs at least one token of its own after the prefix"))
            continue
        buf.append(record)
        if len(buf) < chunk:
            continue
        received_tokens = yield from _admit_chunk(buf, run, hook, max_seq_len, too_long, max_tokens, received_tokens)
        buf = []
    if buf:
        yield from _admit_chunk(buf, run, hook, max_seq_len, too_long, max_tokens, received_tokens)


def _admit_chunk(items, run, hook, max_seq_len, too_long, max_tokens, received_tokens):
    hook.forge_items_received(run=run, items=items)
    ok: list[Item] = []
    over_budget: list[Item] = []
    too_long_items: list[Item] = []
    truncated: list[tuple[Item, Item]] = []
    for item in items:
        if max_tokens is not None and received_tokens >= max_tokens:
            over_budget.append(item)
            continue
        received_tokens += item.num_tokens
        if item.num_tokens > max_seq_len:
            if too_long == "error":
                raise ForgeError(
                    f"item {item.id!r} has {item.num_tokens} tokens, over max_seq_len={max_seq_len}; "
                    "set too_long=skip or too_long=truncate, or raise the devices' max_seq_len"
                )
            if too_long == "truncate" and item.prefix_len < max_seq_len:
                short = replace(
                    item,
                    num_tokens=max_seq_len,
                    tokens=item.tokens[:max_seq_len] if item.tokens is not None else None,
                )
                truncated.append((item, short))
                ok.append(short)
            else:
                too_long_items.append(item)
            continue
        ok.append(item)
    if truncated:
        state = run.state.setdefault("admission", {"truncated_items": 0, "truncated_tokens": 0})
        state["truncated_items"] += len(truncated)
        state["truncated_tokens"] += sum(a.num_tokens - b.num_tokens for a, b in truncated)
    if too_long_items:
        hook.forge_items_skipped(run=run, items=too_long_items, reason=f"too_long (> max_seq_len={max_seq_len})")
    if over_budget:
        hook.forge_items_skipped(run=run, items=over_budget, reason=f"budget.max_tokens={max_tokens} reached")
    yield from ok
    return received_tokens
