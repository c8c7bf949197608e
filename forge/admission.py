"""Admission: what happens to each record between the input and the packer's window.

Records come from a function as `Item`s or `Rejected`. Every record is counted as
received, then exactly one of: resumed (an earlier session of this run committed it),
skipped (too long, over `budget.max_tokens`), failed (rejected, no token after its prefix,
too long under `too_long=error`, or no device can ever take it) or admitted. Hooks fire
per chunk so counting stays cheap on millions of items. With `fail_fast` the first
failure stops the run instead.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, Iterable

from forge.errors import ForgeError
from forge.geometry import Item
from forge.run import Rejected, RunContext

TOO_LONG_POLICIES = ("skip", "truncate", "error")

#: reasons an item can never run (None where it can), aligned with the items given
Placeable = Callable[[list[Item]], list[str | None]]


@dataclass(frozen=True, slots=True)
class AdmissionRules:
    """What admission checks, as plain values."""

    max_seq_len: int  # the longest sequence any device takes
    too_long: str = "skip"  # skip | truncate | error (error: the item fails with its reason)
    max_tokens: int | None = None  # stop admitting once this many tokens were received
    fail_fast: bool = False  # the first failed record stops the run
    placeable: Placeable | None = None  # the packer's check against every device's limits and budget

    def __post_init__(self) -> None:
        if self.too_long not in TOO_LONG_POLICIES:
            raise ForgeError(f"too_long={self.too_long!r}; choose one of: {', '.join(TOO_LONG_POLICIES)}")


class Admission:
    """An iterator over the items that may run, reporting every record to the hooks.

    Records are read a chunk at a time; `pending` holds the items of the current chunk that
    were received (counted) and not yet handed on, so a run that stops early can account
    for them."""

    def __init__(self, records: Iterable[Item | Rejected], *, run: RunContext, hook, rules: AdmissionRules,
                 committed: set[int] | frozenset = frozenset(), chunk: int = 512):
        self.records = iter(records)
        self.run, self.hook, self.rules, self.committed, self.chunk = run, hook, rules, committed, chunk
        self.pending: deque[Item] = deque()
        self.state = {"received_tokens": 0, "ordinal": 0}
        self.exhausted = False

    def __iter__(self) -> "Admission":
        return self

    def __next__(self) -> Item:
        while not self.pending:
            if self.exhausted:
                raise StopIteration
            self._read_chunk()
        return self.pending.popleft()

    def _read_chunk(self) -> None:
        t0 = time.perf_counter()
        try:
            self._read_records()
        finally:
            timings = self.run.timings
            timings["read_tokenize_s"] = timings.get("read_tokenize_s", 0.0) + time.perf_counter() - t0

    def _read_records(self) -> None:
        hook, run, rules, state = self.hook, self.run, self.rules, self.state
        buf: list[Item] = []
        for record in self.records:
            state["ordinal"] += 1
            if isinstance(record, Rejected):
                _fail_record(hook, run, rules, record.record_id, record.reason)
                continue
            if record.index < 0:
                record.index = state["ordinal"] - 1
            if record.num_tokens <= (record.prefix_len if record.prefix_key is not None else 0):
                _fail_record(hook, run, rules, record.id, (
                    f"item {record.id!r} has {record.num_tokens} tokens and a {record.prefix_len}-token prefix: "
                    "it needs at least one token of its own after the prefix"))
                continue
            buf.append(record)
            if len(buf) >= self.chunk:
                break
        else:
            self.exhausted = True
        if buf:
            self.pending.extend(_admit_chunk(buf, run, hook, rules, self.committed, state))


def admit(records: Iterable[Item | Rejected], *, run: RunContext, hook, rules: AdmissionRules,
          committed: set[int] | frozenset = frozenset(), chunk: int = 512) -> Admission:
    """The items that may run, as an iterator; every record is reported to the hooks."""
    return Admission(records, run=run, hook=hook, rules=rules, committed=committed, chunk=chunk)


def _fail_record(hook, run, rules: AdmissionRules, record_id: str, reason: str) -> None:
    if rules.fail_fast:
        raise ForgeError(f"{reason} (fail_fast=true stops at the first bad record; set fail_fast=false "
                         "to record bad records and go on)")
    hook.forge_input_failed(run=run, record_id=record_id, reason=reason)


def _admit_chunk(items: list[Item], run, hook, rules: AdmissionRules, committed, state) -> list[Item]:
    hook.forge_items_received(run=run, items=items)
    if committed:
        resumed = [it for it in items if it.index in committed]
        if resumed:
            hook.forge_items_resumed(run=run, items=resumed)
            items = [it for it in items if it.index not in committed]
    max_seq_len, max_tokens = rules.max_seq_len, rules.max_tokens
    ok: list[Item] = []
    over_budget: list[Item] = []
    too_long: list[Item] = []
    truncated: list[tuple[Item, Item]] = []
    for item in items:
        if max_tokens is not None and state["received_tokens"] >= max_tokens:
            over_budget.append(item)
            continue
        state["received_tokens"] += item.num_tokens
        if item.num_tokens <= max_seq_len:
            ok.append(item)
        elif rules.too_long == "truncate" and item.prefix_len < max_seq_len:
            short = replace(item, num_tokens=max_seq_len,
                            tokens=item.tokens[:max_seq_len] if item.tokens is not None else None)
            truncated.append((item, short))
            ok.append(short)
        else:
            too_long.append(item)
    if truncated:
        hook.forge_items_truncated(run=run, items=[a for a, _ in truncated],
                                   tokens=sum(a.num_tokens - b.num_tokens for a, b in truncated))
    if too_long:
        if rules.too_long == "error":
            for item in too_long:
                _fail_item(hook, run, rules, item, f"item {item.id!r} has {item.num_tokens} tokens, over every "
                           f"device's max_seq_len ({max_seq_len}); too_long=error fails it (set too_long=skip "
                           "or too_long=truncate, or add a device with a larger max_seq_len)")
        else:
            hook.forge_items_skipped(run=run, items=too_long, reason=f"too_long (> max_seq_len={max_seq_len})")
    if over_budget:
        hook.forge_items_skipped(run=run, items=over_budget, reason=f"budget.max_tokens={max_tokens} reached")
    if rules.placeable is not None and ok:
        reasons = rules.placeable(ok)
        for item, reason in zip(ok, reasons):
            if reason is not None:
                _fail_item(hook, run, rules, item, reason)
        ok = [it for it, reason in zip(ok, reasons) if reason is None]
    return ok


def _fail_item(hook, run, rules: AdmissionRules, item: Item, reason: str) -> None:
    """An item that can never run: failed at admission, before any work, with its reason."""
    if rules.fail_fast:
        raise ForgeError(f"{reason} (fail_fast=true stops at the first failure)")
    hook.forge_items_failed(run=run, items=[item], reason=reason)
