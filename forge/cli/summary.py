"""What the CLI prints: the consoles, one-line errors and statuses, and a run's or plan's
summary (`print_summary`: what ran, the ledger, the geometry, per device)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

console = Console()
err = Console(stderr=True)
GIB = 1 << 30


def reset_consoles() -> None:
    """Make both consoles again, in place, for this process's streams and terminal: a command
    that `forge server` forked imported this module in the server, whose output is a log file
    (a console reads the terminal's colours and width when it is made)."""
    console.__init__()  # type: ignore[misc]
    err.__init__(stderr=True)  # type: ignore[misc]


def error_line(exc: Exception) -> None:
    """`error: <message>` on one line: never wrapped, never read as markup."""
    err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)


def status_line(report: Mapping[str, Any]) -> None:
    """`<status>: <why>` for a run or plan that did not finish (the status said once)."""
    status, error = report["status"], str(report.get("error"))
    why = error[len(status) + 1 :].lstrip() if error.startswith(f"{status}:") else error
    err.print(f"[bold red]{status}:[/] {escape(why)}", highlight=False, soft_wrap=True)


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return f"{n:,.1f} TB"


def print_summary(report: Mapping[str, Any]) -> None:
    """One screen: what ran, the ledger, the geometry, per device."""
    console.print(_run_table(report))
    console.print(_devices_table(report))
    from forge.cli.placement_view import placement_tables

    for table in placement_tables(report):
        console.print(table)
    _notes(report)


def _run_table(report: Mapping[str, Any]) -> Table:
    """What ran and the ledger, one row each."""
    items, tokens = report.get("items", {}), report.get("tokens", {})
    hit = report.get("cache_hit_rate")
    title = f"{report['function']} · batching={report['batching']}" + (" · plan" if report.get("dry_run") else "")
    table = Table(title=title, show_header=False)
    table.add_row("items", "  ".join(f"{k} {v:,}" for k, v in items.items()))
    # the ledger's columns, and those that only some runs have when they have any (so the counts add up)
    shown = ["received", "routed", "completed", "failed", "skipped", "unfinished", "resumed", "truncated"]
    shown = [k for k in shown if k not in ("unfinished", "resumed", "truncated") or tokens.get(k)]
    shown += ["padding", "prefix", "cache_hit", "prefix_shared"]
    table.add_row("tokens", "  ".join(f"{k} {tokens.get(k, 0):,}" for k in shown))
    layouts = ", ".join(f"{name} {n:,}" for name, n in (report.get("layouts") or {}).items())
    table.add_row("batches", f"{report.get('batches', 0):,}" + (f" ({layouts})" if layouts else ""))
    table.add_row("padding waste", f"{100 * report.get('padding_waste', 0):.2f}%")
    prefixes = report.get("prefixes")
    table.add_row("prefixes", prefixes["words"] if prefixes else "none")
    reuse = report.get("prefix_reuse_rate")
    if reuse is not None and hit is not None:
        engine = "engine" in ((report.get("prefixes") or {}).get("computed_in") or {})
        table.add_row("prefix tokens", _reuse_words(reuse, hit, tokens, engine))
    if report.get("path"):
        table.add_row("path", str(report["path"]))
    table.add_row("balanced", "yes" if report.get("balanced") else f"NO: {'; '.join(report.get('imbalance', []))}")
    table.add_row("status", str(report.get("status", "finished")))
    sized = report.get("output_bytes")
    if sized and sized.get("total"):
        per = sized.get("per_stored_token")
        fields = "  ".join(f"{k} {_bytes(v)}" for k, v in sized["fields"].items() if v)
        table.add_row(
            "will write",
            f"{_bytes(sized['total'])}" + (f" ({per:,.0f} B per stored token)" if per else "") + f": {fields}",
        )
    attempts = {k: v for k, v in (report.get("attempts") or {}).items() if v}
    if attempts or report.get("items", {}).get("resumed"):
        table.add_row(
            "recovered",
            "  ".join(
                [f"{k} {v:,}" for k, v in attempts.items()]
                + [f"restarts {sum((report.get('restarts') or {}).values())}", f"resumed {items.get('resumed', 0):,}"]
            ),
        )
    if not report.get("dry_run"):
        _ran_rows(table, report)
    return table


def _reuse_words(reuse: float, hit: float, tokens: Mapping[str, Any], engine: bool = False) -> str:
    """What share of the prefix tokens the items needed ran again, and why not (the ledger's
    `cache_hit` tokens are those a split-prefix batch did not run: its prefix ran once for all
    its items, or came from the cache (so did a tree batch's root); `engine`: a function's engine
    shared the prefixes itself, holding them in its own cache across batches, as generate's decoder
    does)."""
    shared = tokens.get("prefix_shared", 0) / tokens["prefix"] if tokens.get("prefix") else 0.0
    held = "held by the engine's prefix cache" if engine else "in split-prefix batches or cached roots"
    parts = [f"{100 * hit:.2f}% {held} (cache_hit_rate)"] if hit else []
    parts += [f"{100 * shared:.2f}% {'shared by the engine' if engine else 'in tree rows'}"] if shared else []
    return f"{100 * reuse:.2f}% not computed again" + (f": {', '.join(parts)}" if parts else "")


def _resident_words(report: Mapping[str, Any]) -> str:
    """The most resident memory each of the run's processes held: this one, and each device's worker
    process ("" where not measured). In process, the device's figure is this process's own."""
    driver = report.get("driver_resident_peak_bytes")
    if not driver:
        return ""
    mib = lambda b: f"{b / 2**20:,.0f} MiB"  # noqa: E731
    if report.get("config", {}).get("runtime", {}).get("executor") == "inprocess":
        return f"{mib(driver)} (one process: the run and its model)"
    workers = [(d["name"], d["resident_peak_bytes"]) for d in report.get("devices", []) if d.get("resident_peak_bytes")]
    each = "  ".join(f"{name} worker {mib(b)}" for name, b in workers)
    return f"this process {mib(driver)}" + (f"  {each}" if each else "")


def _ran_rows(table: Table, report: Mapping[str, Any]) -> None:
    """The rows only a run has: its wall time, model, outputs and a function's own line."""
    table.add_row(
        "wall", f"{report.get('wall_s', 0):.2f} s  ({report.get('useful_tokens_per_s') or 0:,.0f} useful tok/s)"
    )
    phases = report.get("phases") or {}
    if phases.get("first_batch_s") is not None:
        how = "warm start: forge server" if phases.get("warm_start") else "cold start; forge server start imports once"
        table.add_row("start", f"first batch at {phases['first_batch_s']:.2f} s  ({how})")
    memory = _resident_words(report)
    if memory:
        table.add_row("peak RSS", memory)
    table.add_row("model", str(report.get("model")))
    out = report.get("outputs") or {}
    table.add_row(
        "outputs",
        str(out.get("results") or out.get("activations") or out.get("table") or out.get("embeddings") or "-"),
    )
    trackers = report.get("trackers") or {}  # trackers=[...]: which logged (a failed one's warning is above)
    if trackers:
        logged = [name for name, note in trackers.items() if note == "logged"]
        failed = [name for name in trackers if name not in logged]
        words = f"{', '.join(logged) or 'none'} logged"
        table.add_row("trackers", words + (f"; {', '.join(failed)} did not (the warning above)" if failed else ""))
    acc = out.get("accuracy")
    if acc and acc.get("questions"):
        from forge.functions.score import accuracy_line  # the score function's result keys

        table.add_row("accuracy", accuracy_line(acc))


def _devices_table(report: Mapping[str, Any]) -> Table:
    """Per device: its batches, tokens and padding (and memory, virtual time where planned)."""
    devices = report.get("devices", [])
    virtual = report.get("virtual_time")
    memory = any("memory_budget_bytes" in d for d in devices)
    cols = ["device", "batches", "tokens", "padded slots", "cache misses"]
    if memory:
        cols.append("GiB peak/budget")
    resident = any(d.get("resident_peak_bytes") for d in devices)
    planned = any(d.get("planned_peak_bytes") for d in devices)
    if virtual:
        cols = ["device", "batches", "tokens", "slots", "misses", *cols[5:]]
        cols += ["finish s" if virtual["unit"] == "s" else "finish tok-eq", "busy %", "oom"]
    else:
        cols.append("busy s")
    if resident:
        cols.append("RSS MiB loaded/peak")
    if planned:
        cols.append("MiB held at most")
    title = "devices" + (f" (virtual time: finish skew {100 * virtual['finish_skew']:.1f}%)" if virtual else "")
    dev = Table(title=title, box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False)
    for col in cols:
        dev.add_column(col)
    for d in devices:
        row = [
            d["name"],
            f"{d['batches']:,}",
            f"{d['tokens']:,}",
            f"{d['padded_slots']:,}",
            str(d.get("cache_misses", 0)),
        ]
        if memory:
            row.append(
                f"{d['predicted_peak_bytes'] / GIB:.2f}/{d['memory_budget_bytes'] / GIB:.2f}"
                if d.get("memory_budget_bytes")
                else "-"
            )
        if virtual:
            fmt = "{:,.2f}" if virtual["unit"] == "s" else "{:,.0f}"
            row += [fmt.format(d["virtual_finish"]), f"{100 * d['busy_share']:.1f}", str(d.get("oom", 0))]
        else:
            row.append(f"{d['busy_s']:.2f}" if "busy_s" in d else "-")
        if resident:
            ready = f"{d['resident_ready_bytes'] / 2**20:,.0f}/" if d.get("resident_ready_bytes") else ""
            row.append(f"{ready}{d['resident_peak_bytes'] / 2**20:,.0f}" if d.get("resident_peak_bytes") else "-")
        if planned:
            row.append(f"{d['planned_peak_bytes'] / 2**20:,.0f}" if d.get("planned_peak_bytes") else "-")
        dev.add_row(*row)
    return dev


def _notes(report: Mapping[str, Any]) -> None:
    """Skipped and failed items, warnings and retired devices, one line each (stderr)."""
    items = report.get("items", {})
    for reason, count in (report.get("skipped_reasons") or {}).items():
        err.print(f"[yellow]skipped[/] {count} item(s): {reason}")
    failures = report.get("failures") or []
    if failures:
        err.print(
            f"[yellow]failed[/] {items.get('failed', 0)} item(s), e.g. {failures[0]['id']}: {failures[0]['reason']}"
        )
    for warning in report.get("warnings") or []:
        err.print(f"[yellow]warning:[/] {warning}")
    for why in (report.get("retired") or {}).values():
        err.print(f"[yellow]retired:[/] {why}", highlight=False)
