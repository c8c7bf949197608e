"""A rich progress bar for runs: items, tokens/s, padding % and cache-hit %.

Shown only on a terminal or in a notebook (Jupyter); plans and captured output stay quiet.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from forge.hookspecs import hookimpl

NAME = "progress"


class _Bar:
    def __init__(self, total: int | None):
        self.progress = Progress(
            TextColumn("[bold]forge[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("items"),
            TextColumn("{task.fields[rate]:>8} tok/s"),
            TextColumn("pad {task.fields[pad]}"),
            TextColumn("cache {task.fields[hit]}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=False,
        )
        self.task = self.progress.add_task("run", total=total, rate="-", pad="-", hit="-")
        self.started = time.perf_counter()
        self.tokens = self.padding = self.slots = self.prefix = self.hit = 0
        self.progress.start()

    def update(self, batch, stats) -> None:
        self.tokens += batch.num_tokens
        self.padding += batch.padding
        self.slots += stats.padded_slots
        self.prefix += batch.prefix_tokens
        self.hit += stats.cache_hit_tokens
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        self.progress.update(
            self.task,
            advance=len(batch.items),
            rate=f"{self.tokens / elapsed:,.0f}",
            pad=f"{100 * self.padding / max(self.slots, 1):.1f}%",
            hit=f"{100 * self.hit / self.prefix:.1f}%" if self.prefix else "-",
        )


@hookimpl
def forge_run_start(run):
    console = Console(stderr=True)
    if run.dry_run or not (console.is_terminal or console.is_jupyter):  # a terminal, or a notebook (forge.run)
        return
    run.state[NAME] = _Bar(run.expected_items)


@hookimpl
def forge_batch_completed(run, batch, device, stats):
    bar = run.state.get(NAME)
    if bar is not None:
        bar.update(batch, stats)


@hookimpl
def forge_run_end(run, report):
    bar = run.state.pop(NAME, None)
    if bar is not None:
        bar.progress.stop()
