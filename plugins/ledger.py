"""The token ledger: counts every item and token through the hooks and checks the balance.

    items:  received = completed + failed + skipped
    tokens: received = completed + failed + skipped + truncated
            routed   = completed + failed          (retries are counted apart)

A leak shows as a difference between two large numbers in report.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from forge.hookspecs import hookimpl

NAME = "ledger"
MAX_FAILURES_IN_REPORT = 20


@dataclass
class Ledger:
    items: dict = field(default_factory=lambda: dict.fromkeys(("received", "completed", "failed", "skipped"), 0))
    tokens: dict = field(default_factory=lambda: dict.fromkeys(
        ("received", "routed", "completed", "failed", "skipped", "truncated", "retried",
         "padding", "padded_slots", "prefix", "cache_hit"), 0))
    failures: list = field(default_factory=list)  # {"id", "reason"} per failed item
    skipped: dict = field(default_factory=dict)  # reason -> items

    def check(self) -> list[str]:
        """Every way the books do not balance, in words; empty when balanced."""
        i, t = self.items, self.tokens
        problems = []
        if i["received"] != i["completed"] + i["failed"] + i["skipped"]:
            problems.append(f"items: received {i['received']} != completed {i['completed']} + failed "
                            f"{i['failed']} + skipped {i['skipped']}")
        if t["received"] != t["completed"] + t["failed"] + t["skipped"] + t["truncated"]:
            problems.append(f"tokens: received {t['received']} != completed {t['completed']} + failed "
                            f"{t['failed']} + skipped {t['skipped']} + truncated {t['truncated']}")
        if t["routed"] != t["completed"] + t["failed"]:
            problems.append(f"tokens: routed {t['routed']} != completed {t['completed']} + failed {t['failed']}")
        return problems


def ledger_of(run) -> Ledger:
    return run.state[NAME]


@hookimpl
def forge_run_start(run):
    run.state[NAME] = Ledger()


@hookimpl
def forge_items_received(run, items):
    led = ledger_of(run)
    led.items["received"] += len(items)
    led.tokens["received"] += sum(it.num_tokens for it in items)


@hookimpl
def forge_input_failed(run, record_id, reason):
    led = ledger_of(run)
    led.items["received"] += 1
    led.items["failed"] += 1
    led.failures.append({"id": record_id, "reason": reason})


@hookimpl
def forge_items_skipped(run, items, reason):
    led = ledger_of(run)
    led.items["skipped"] += len(items)
    led.tokens["skipped"] += sum(it.num_tokens for it in items)
    led.skipped[reason] = led.skipped.get(reason, 0) + len(items)


@hookimpl
def forge_batch_routed(run, batch, device):
    led = ledger_of(run)
    led.tokens["retried" if batch.retry else "routed"] += batch.num_tokens


@hookimpl
def forge_batch_completed(run, batch, device, stats):
    led = ledger_of(run)
    led.items["completed"] += len(batch.items)
    led.tokens["completed"] += batch.num_tokens
    led.tokens["padding"] += batch.padding
    led.tokens["padded_slots"] += stats.padded_slots
    led.tokens["prefix"] += batch.prefix_tokens
    led.tokens["cache_hit"] += stats.cache_hit_tokens


@hookimpl
def forge_batch_failed(run, batch, device, reason, will_retry):
    if will_retry:
        return  # its items come back as retries and end completed or failed
    led = ledger_of(run)
    for item in batch.items:
        led.items["failed"] += 1
        led.tokens["failed"] += item.num_tokens
        led.failures.append({"id": item.id, "reason": f"{reason} (on {device.name})"})


@hookimpl
def forge_run_end(run, report):
    led = ledger_of(run)
    led.tokens["truncated"] = run.state.get("admission", {}).get("truncated_tokens", 0)
    t = led.tokens
    problems = led.check()
    report["items"] = dict(led.items)
    report["tokens"] = dict(t)
    report["skipped_reasons"] = dict(led.skipped)
    report["padding_waste"] = round(t["padding"] / t["padded_slots"], 6) if t["padded_slots"] else 0.0
    report["cache_hit_rate"] = round(t["cache_hit"] / t["prefix"], 6) if t["prefix"] else None
    report["balanced"] = not problems
    report["imbalance"] = problems
    report["failures"] = led.failures[:MAX_FAILURES_IN_REPORT]
    if run.run_dir is not None and led.failures:
        with open(run.run_dir / "failures.jsonl", "w") as f:
            for failure in led.failures:
                f.write(json.dumps(failure) + "\n")
