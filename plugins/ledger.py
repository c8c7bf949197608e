"""The token ledger: counts every item and token through the hooks and checks the balance.

    items:  received = completed + failed + skipped + unfinished
    tokens: received = completed + failed + skipped + truncated + unfinished
            routed   = run_completed + failed_in_batches + retried + discarded

    steps:  every forward step a device ran <= its step budget (budget.tokens_per_step)

`skipped` counts items (too long, over `budget.max_tokens`) and input records (a repeated id
dropped by `input.duplicate_ids`) that do not run; failed and skipped ones are listed with
their ids and reasons in failures.jsonl and skipped.jsonl. `completed` counts committed
items, those an earlier session committed (`resumed`) included; `routed` counts the tokens
of every attempt, so a retried, discarded or dropped attempt shows as retried or discarded,
never as a gap. `unfinished` is non-zero only when a
run stops early. A leak shows as a difference between two large numbers in report.json.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

from forge.hookspecs import hookimpl
from forge.vocab.column_batch import ItemColumns
from forge.vocab.geometry import StepBudget

NAME = "ledger"
MAX_FAILURES_IN_REPORT = 20
ITEM_KEYS = ("received", "completed", "failed", "skipped", "unfinished", "resumed")
TOKEN_KEYS = (
    "received",
    "routed",
    "completed",
    "failed",
    "skipped",
    "truncated",
    "unfinished",
    "resumed",
    "retried",
    "discarded",
    "padding",
    "padded_slots",
    "prefix",
    "cache_hit",
    "prefix_shared",
)


@dataclass
class StepBook:
    """One device's steps against its step budget: how many ran, the largest, and any over it."""

    budget: StepBudget
    steps: int = 0
    largest: int = 0
    over: list = field(default_factory=list)  # token slots of each step over the budget (none in a sound run)

    def ran(self, steps: tuple[int, ...]) -> None:
        self.steps += len(steps)
        self.largest = max(self.largest, *steps, 0)
        self.over.extend(self.budget.over(steps))

    def as_dict(self) -> dict:
        return {
            "tokens_per_step_budget": self.budget.tokens,
            "engine_steps": self.budget.engine,  # the function's engine ran its own steps (else one pass a batch)
            "steps": self.steps,
            "largest_step_tokens": self.largest,
            "over_budget": len(self.over),
        }


@dataclass
class Ledger:
    items: dict = field(default_factory=lambda: dict.fromkeys(ITEM_KEYS, 0))
    tokens: dict = field(default_factory=lambda: dict.fromkeys(TOKEN_KEYS, 0))
    failed_in_batches: int = 0  # tokens of routed items that failed (the rest failed before routing)
    failures: list = field(default_factory=list)  # {"id", "reason"} per failed item
    skipped: dict = field(default_factory=dict)  # reason (kind, for input records) -> items
    skips: list = field(default_factory=list)  # (id, line or None, reason) per skipped item or record
    retry_reasons: Counter = field(default_factory=Counter)  # reason -> failed attempts retried
    steps: dict = field(default_factory=dict)  # device name -> its StepBook

    def check(self) -> list[str]:
        """Every way the books do not balance, in words; empty when balanced."""
        i, t = self.items, self.tokens
        problems = []
        if i["received"] != i["completed"] + i["failed"] + i["skipped"] + i["unfinished"]:
            problems.append(
                f"items: received {i['received']} != completed {i['completed']} + failed "
                f"{i['failed']} + skipped {i['skipped']} + unfinished {i['unfinished']}"
            )
        if t["received"] != t["completed"] + t["failed"] + t["skipped"] + t["truncated"] + t["unfinished"]:
            problems.append(
                f"tokens: received {t['received']} != completed {t['completed']} + failed "
                f"{t['failed']} + skipped {t['skipped']} + truncated {t['truncated']} "
                f"+ unfinished {t['unfinished']}"
            )
        ran = t["completed"] - t["resumed"]
        if t["routed"] != ran + self.failed_in_batches + t["retried"] + t["discarded"]:
            problems.append(
                f"tokens: routed {t['routed']} != completed this session {ran} + failed in batches "
                f"{self.failed_in_batches} + retried {t['retried']} + discarded {t['discarded']}"
            )
        for name, book in self.steps.items():
            if book.over:
                problems.append(
                    f"steps: device {name} ran {len(book.over)} step(s) over its budget of {book.budget.tokens} "
                    f"tokens (budget.tokens_per_step), the largest {max(book.over)}"
                )
        return problems


def ledger_of(run) -> Ledger:
    return run.state[NAME]


def _write_jsonl(run, name: str, rows: list[dict]) -> None:
    if run.run_dir is not None and rows:
        from forge.io.location import open_location  # a local path or an fsspec URL

        open_location(run.run_dir).write_bytes(name, "".join(json.dumps(r) + "\n" for r in rows).encode())


def _tokens(items) -> int:
    if isinstance(items, ItemColumns):  # streamed columns: a numpy sum, no Item made
        return items.total_tokens
    return sum(it.num_tokens for it in items)


def _fail(led: Ledger, items, reason: str) -> None:
    led.items["failed"] += len(items)
    led.tokens["failed"] += _tokens(items)
    led.failures.extend({"id": it.id, "reason": reason} for it in items)


@hookimpl
def forge_run_start(run):
    run.state[NAME] = Ledger()


@hookimpl
def forge_items_received(run, items):
    led = ledger_of(run)
    led.items["received"] += len(items)
    led.tokens["received"] += _tokens(items)


@hookimpl
def forge_items_resumed(run, items):
    led = ledger_of(run)
    for key in ("completed", "resumed"):
        led.items[key] += len(items)
        led.tokens[key] += _tokens(items)


@hookimpl
def forge_input_failed(run, record_id, reason):
    led = ledger_of(run)
    led.items["received"] += 1
    led.items["failed"] += 1
    led.failures.append({"id": record_id, "reason": reason})


@hookimpl
def forge_items_failed(run, items, reason):
    _fail(ledger_of(run), items, reason)


@hookimpl
def forge_items_truncated(run, items, tokens):
    ledger_of(run).tokens["truncated"] += tokens


@hookimpl
def forge_items_skipped(run, items, reason):
    led = ledger_of(run)
    led.items["skipped"] += len(items)
    led.tokens["skipped"] += _tokens(items)
    led.skipped[reason] = led.skipped.get(reason, 0) + len(items)
    led.skips.extend((it.id, None, reason) for it in items)  # tuples: ~half a dict's memory


@hookimpl
def forge_input_skipped(run, record):
    led = ledger_of(run)
    led.items["received"] += 1
    led.items["skipped"] += 1
    led.skipped[record.kind] = led.skipped.get(record.kind, 0) + 1
    led.skips.append((record.record_id, record.line, record.reason))


@hookimpl
def forge_batch_routed(run, batch, device):
    ledger_of(run).tokens["routed"] += batch.num_tokens


@hookimpl
def forge_batch_completed(run, batch, device, stats):
    led = ledger_of(run)
    led.items["completed"] += len(batch.items)
    led.tokens["completed"] += batch.num_tokens
    led.tokens["padding"] += batch.padding
    led.tokens["padded_slots"] += stats.padded_slots
    led.tokens["prefix"] += batch.prefix_tokens
    led.tokens["cache_hit"] += stats.cache_hit_tokens
    led.tokens["prefix_shared"] += stats.shared_tokens
    book = led.steps.get(device.name)
    if book is None:
        book = led.steps[device.name] = StepBook(device.steps())
    book.ran(stats.steps)


@hookimpl
def forge_batch_discarded(run, batch, device, reason):
    ledger_of(run).tokens["discarded"] += batch.num_tokens


@hookimpl
def forge_batch_late(run, batch, device):
    ledger_of(run).tokens["retried"] -= batch.num_tokens  # it ended after all: completed or discarded


@hookimpl
def forge_batch_failed(run, batch, device, reason, will_retry):
    led = ledger_of(run)
    if will_retry:  # its items come back and end completed, failed or unfinished
        led.tokens["retried"] += batch.num_tokens
        led.retry_reasons[reason] += 1
        return
    led.failed_in_batches += batch.num_tokens
    _fail(led, batch.items, reason)


@hookimpl
def forge_commit_failed(run, items, reason):
    led = ledger_of(run)
    n, t = len(items), _tokens(items)
    led.items["completed"] -= n
    led.tokens["completed"] -= t
    led.tokens["discarded"] += t  # their attempt's tokens bought nothing
    led.items["unfinished"] += n
    led.tokens["unfinished"] += t


@hookimpl
def forge_items_unfinished(run, items, reason):
    led = ledger_of(run)
    led.items["unfinished"] += len(items)
    led.tokens["unfinished"] += _tokens(items)


@hookimpl
def forge_run_end(run, report):
    led = ledger_of(run)
    t = led.tokens
    problems = led.check()
    report["items"] = dict(led.items)
    report["tokens"] = dict(t)
    report["skipped_reasons"] = dict(led.skipped)
    report["retry_reasons"] = dict(led.retry_reasons.most_common())
    report["failure_reasons"] = dict(Counter(f["reason"] for f in led.failures).most_common(MAX_FAILURES_IN_REPORT))
    report["padding_waste"] = round(t["padding"] / t["padded_slots"], 6) if t["padded_slots"] else 0.0
    report["cache_hit_rate"] = round(t["cache_hit"] / t["prefix"], 6) if t["prefix"] else None
    # prefix tokens not run again: served by the cache, or run once in a tree row for several items
    reused = t["cache_hit"] + t["prefix_shared"]
    report["prefix_reuse_rate"] = round(reused / t["prefix"], 6) if t["prefix"] else None
    report["steps"] = {name: book.as_dict() for name, book in led.steps.items()}
    report["balanced"] = not problems
    report["imbalance"] = problems
    report["failures"] = led.failures[:MAX_FAILURES_IN_REPORT]
    _write_jsonl(run, "failures.jsonl", led.failures)
    _write_jsonl(
        run,
        "skipped.jsonl",
        [{"id": i, **({"line": line} if line is not None else {}), "reason": reason} for i, line, reason in led.skips],
    )
