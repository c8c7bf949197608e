"""Admission: what happens to each record between the input and the packer's window.

Records come from a function as `Item`s, `Rejected` or `Skipped`. Every record is counted
as received, then exactly one of: resumed (an earlier session of this run committed it),
skipped (a repeated id the input drops, too long, over `budget.max_tokens`), failed
(rejected, no token after its prefix, too long under `too_long=error`, or no device can ever
take it) or admitted. Hooks fire per chunk so counting stays cheap on millions of items.

Bad input counts toward `max_failure_share`: each record read enters the run's input
window (`RunContext.input_window`, set by the run loop from its policy) as fine or as its
failure's kind, and once one kind fills the share, admission stops reading and the loop
stops the run. With `fail_fast` the first failure stops the run instead.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from forge.config.schema import CoreConfig
from forge.core.read_ahead import ReadAhead
from forge.errors import ForgeError
from forge.vocab.column_batch import ItemColumns
from forge.vocab.geometry import Item
from forge.vocab.records import Rejected, RunContext, Skipped, reason_kind

TOO_LONG_POLICIES = ("skip", "truncate", "error")

#: reasons an item can never run (None where it can), aligned with the items given
Placeable = Callable[[list[Item]], list[str | None]]


@dataclass(frozen=True)
class Seek:
    """A resumed run's read mark (forge.io.read_marks), as admission sees it: the records it
    starts after (`prefix`, all committed, counted as received and resumed without being read;
    None: it reads from the start) and where it tells each record it takes (`seen`: its tokens,
    -1 for one that is not an item)."""

    prefix: ItemColumns | None
    seen: Callable[[int], None] | None = None
    close: Callable[[], None] | None = None  # at the run's end (`Admission.close`)


@dataclass(frozen=True, slots=True)
class AdmissionRules:
    """What admission checks, as plain values."""

    max_seq_len: int  # the longest sequence any device takes
    too_long: str = CoreConfig.too_long  # skip | truncate | error (error: the item fails with its reason)
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

    def __init__(
        self,
        records: Iterable[Item | Rejected | Skipped],
        *,
        run: RunContext,
        hook,
        rules: AdmissionRules,
        committed: set[int] | frozenset = frozenset(),
        chunk: int = 512,
        read_ahead: bool = False,
        seek: Seek | None = None,
    ):
        # read_ahead: the records are read and tokenized on a thread (forge.core.read_ahead)
        self._ahead = ReadAhead(records) if read_ahead else None
        self.records = self._ahead if self._ahead is not None else iter(records)
        self.run, self.hook, self.rules, self.committed, self.chunk = run, hook, rules, committed, chunk
        self.pending: deque[Item] = deque()
        self.state = {"received_tokens": 0, "ordinal": 0}
        self.exhausted = False
        self.seek = seek
        if seek is not None and seek.prefix is not None:  # records a read mark passed over: all committed
            self.state["ordinal"] = len(seek.prefix)
            self.state["received_tokens"] = int(seek.prefix.num_tokens.sum())  # budget.max_tokens counts them
            hook.forge_items_received(run=run, items=seek.prefix)
            hook.forge_items_resumed(run=run, items=seek.prefix)

    def __iter__(self) -> Admission:
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
            timings, took = self.run.timings, time.perf_counter() - t0
            timings["read_wait_s"] = timings.get("read_wait_s", 0.0) + took  # the run waiting on its input
            timings["read_tokenize_s"] = (
                self._ahead.busy_s if self._ahead is not None else timings.get("read_tokenize_s", 0.0) + took
            )

    def close(self) -> None:
        """Read no further (a run that ends early stops its reading thread here)."""
        self.exhausted = True
        if self._ahead is not None:
            self._ahead.close()
        if self.seek is not None and self.seek.close is not None:
            self.seek.close()

    def _read_records(self) -> None:
        hook, run, rules, state = self.hook, self.run, self.rules, self.state
        buf: list[Item] = []
        outcomes: list[str | Item | None] = []  # per record read, in order: fine, a failure's kind, or an Item
        examples: dict[str, str] = {}  # kind -> a full reason of it
        seen = self.seek.seen if self.seek is not None else None
        for record in self.records:
            state["ordinal"] += 1
            if seen is not None:
                seen(record.num_tokens if isinstance(record, Item) else -1)
            if isinstance(record, Rejected):
                kind = record.kind or reason_kind(record.reason)
                _fail_record(hook, run, rules, record.record_id, record.reason)
                outcomes.append(kind)
                examples.setdefault(kind, record.reason)
            elif isinstance(record, Skipped):
                hook.forge_input_skipped(run=run, record=record)
                outcomes.append(None)
            elif record.num_tokens <= (record.prefix_len if record.prefix_key is not None else 0):
                reason = (
                    f"item {record.id!r} has {record.num_tokens} tokens and a {record.prefix_len}-token "
                    "prefix: it needs at least one token of its own after the prefix"
                )
                _fail_record(hook, run, rules, record.id, reason)
                outcomes.append("no token after its prefix")
                examples.setdefault("no token after its prefix", reason)
            else:
                if record.index < 0:
                    record.index = state["ordinal"] - 1
                buf.append(record)
                outcomes.append(record)
            if len(outcomes) >= self.chunk:
                break
        else:
            self.exhausted = True
        failed: dict[int, tuple[str, str]] = {}
        if buf:
            ok, failed = _admit_chunk(buf, run, hook, rules, self.committed, state)
            self.pending.extend(ok)
        window = run.input_window
        if window is not None:
            for kind, reason in failed.values():
                examples.setdefault(kind, reason)
            kinds = [failed.get(o.index, (None,))[0] if isinstance(o, Item) else o for o in outcomes]
            window.add(kinds, what="input records", examples=examples)
            if window.stop is not None:
                self.exhausted = True  # recurring bad input: read no further, the loop stops the run


def admit(
    records: Iterable[Item | Rejected | Skipped],
    *,
    run: RunContext,
    hook,
    rules: AdmissionRules,
    committed: set[int] | frozenset = frozenset(),
    chunk: int = 512,
    read_ahead: bool = False,
    seek: Seek | None = None,
) -> Admission:
    """The items that may run, as an iterator; every record is reported to the hooks. With
    `read_ahead`, records are read on a thread; `close()` it when the run ends."""
    return Admission(
        records, run=run, hook=hook, rules=rules, committed=committed, chunk=chunk, read_ahead=read_ahead, seek=seek
    )


def _fail_record(hook, run, rules: AdmissionRules, record_id: str, reason: str) -> None:
    if rules.fail_fast:
        raise ForgeError(
            f"{reason} (fail_fast=true stops at the first bad record; set fail_fast=false "
            "to record bad records and go on)"
        )
    hook.forge_input_failed(run=run, record_id=record_id, reason=reason)


def _admit_chunk(
    items: list[Item], run, hook, rules: AdmissionRules, committed, state
) -> tuple[list[Item], dict[int, tuple[str, str]]]:
    """(the items that may run, {item index: (kind, reason)} of those that failed here)."""
    hook.forge_items_received(run=run, items=items)
    max_seq_len, max_tokens = rules.max_seq_len, rules.max_tokens
    resumed = [it for it in items if it.index in committed] if committed else []
    if resumed:
        hook.forge_items_resumed(run=run, items=resumed)
        if max_tokens is None:
            items = [it for it in items if it.index not in committed]
    ok: list[Item] = []
    over_budget: list[Item] = []
    too_long: list[Item] = []
    failed: dict[int, tuple[str, str]] = {}
    truncated: list[tuple[Item, Item]] = []
    for item in items:
        if resumed and item.index in committed:  # an earlier session's: budget.max_tokens counts it, in order
            state["received_tokens"] += item.num_tokens
            continue
        if max_tokens is not None and state["received_tokens"] >= max_tokens:
            over_budget.append(item)
            continue
        state["received_tokens"] += item.num_tokens
        if item.num_tokens <= max_seq_len:
            ok.append(item)
        elif rules.too_long == "truncate" and item.prefix_len < max_seq_len:
            short = replace(
                item, num_tokens=max_seq_len, tokens=item.tokens[:max_seq_len] if item.tokens is not None else None
            )
            truncated.append((item, short))
            ok.append(short)
        else:
            too_long.append(item)
    if truncated:
        hook.forge_items_truncated(
            run=run, items=[a for a, _ in truncated], tokens=sum(a.num_tokens - b.num_tokens for a, b in truncated)
        )
    if too_long:
        if rules.too_long == "error":
            for item in too_long:
                _fail_item(
                    hook,
                    run,
                    rules,
                    item,
                    failed,
                    "too long (too_long=error)",
                    (
                        f"item {item.id!r} has {item.num_tokens} tokens, over every device's max_seq_len "
                        f"({max_seq_len}); too_long=error fails it (set too_long=skip or too_long=truncate, or add "
                        "a device with a larger max_seq_len)"
                    ),
                )
        else:
            hook.forge_items_skipped(run=run, items=too_long, reason=f"too_long (> max_seq_len={max_seq_len})")
    if over_budget:
        hook.forge_items_skipped(run=run, items=over_budget, reason=f"budget.max_tokens={max_tokens} reached")
    if rules.placeable is not None and ok:
        reasons = rules.placeable(ok)
        for item, reason in zip(ok, reasons):
            if reason is not None:
                _fail_item(hook, run, rules, item, failed, "fits no device", reason)
        ok = [it for it, reason in zip(ok, reasons) if reason is None]
    return ok, failed


def _fail_item(hook, run, rules: AdmissionRules, item: Item, failed: dict, kind: str, reason: str) -> None:
    """An item that can never run: failed at admission, before any work, with its reason."""
    if rules.fail_fast:
        raise ForgeError(f"{reason} (fail_fast=true stops at the first failure)")
    hook.forge_items_failed(run=run, items=[item], reason=reason)
    failed[item.index] = (kind, reason)
