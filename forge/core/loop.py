"""The run loop: the one owner of schedule -> run -> complete.

Model: every device with a free slot asks the scheduler for its next batch, which goes to
the executor under a ticket; every outcome the executor collects comes back through
`complete`. A completed result is committed (first commit wins: items already committed are
discarded and counted) and the scheduler hears how it went; anything else goes to the
scheduler, which re-routes the batch whole, splits it, or fails its item with the reason.
The loop stops when the work is done, or early with a reason: interrupted (Ctrl-C), a
recurring failure (one reason filling `max_failure_share` of the last `failure_window` items
finished, or one kind of bad record filling it of the last records read), a stall (work
waits, nothing runs, no device can take it), every device retired, or a shard that cannot be
written. `forge run`, `forge plan` and the benchmarks all drive this loop; only the executor
differs.
"""

from __future__ import annotations

import itertools
import signal
import threading
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from forge.core.layouts import DeviceTally
from forge.core.scheduler import Scheduler
from forge.errors import LockLost
from forge.executors.base import Executor, Outcome, Status
from forge.vocab.column_batch import ItemColumns
from forge.vocab.geometry import Batch, Device, Item
from forge.vocab.indexset import IndexSet
from forge.vocab.records import FailureWindow, RunContext, batch_stats

if TYPE_CHECKING:
    from forge.config.schema import Runtime  # the policy: timeouts, recurring failures, commits, drain
    from forge.function import BatchOutput


class Stop(Exception):
    """The run stopped early; `status` goes to the report and run.json."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status  # interrupted | stopped | stalled | failed


STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@contextmanager
def signals_deferred():
    """Ctrl-C and SIGTERM wait until the block ends (a commit is never cut in half: a second
    Ctrl-C, which stops at once, lands between commits)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class Committer:
    """Hands completed results to the function's sink; first commit wins.

    `committed` holds the input indexes of items committed (earlier sessions included). A
    sink buffers rows and writes a shard on `flush`, called when it is `full()` (a shard's
    rows or bytes) or its oldest row waited `interval_s`. Without a sink (a plan) nothing is written.
    """

    def __init__(self, sink, committed: set[int], interval_s: float):
        self.sink = sink
        # a bitmap, not a set: same answers, ~1 byte per input position instead of ~70 (RSS at 10M items)
        self.committed = committed if isinstance(committed, IndexSet) else IndexSet(committed)
        self.interval_s = interval_s
        self.buffered: list[Item] = []  # completed items whose shard is not written yet
        self._since = time.monotonic()

    def commit(self, batch: Batch, output: Any) -> tuple[Batch | None, Batch | None]:
        """(what was committed, what was a duplicate): either may be None."""
        items: Sequence[Item] = batch.items  # a list, or ItemColumns for a ColumnBatch
        if isinstance(items, ItemColumns):  # streamed columns: one numpy pass, no Item made
            fresh = ~self.committed.contains(items.index)
            if fresh.all() and self.sink is None:
                self.committed.add_array(items.index)
                return batch, None
            keep = fresh.tolist()  # a duplicate or a sink: the general path below, with Items
        else:
            keep = [it.index not in self.committed for it in items]
        if not any(keep):
            return None, batch
        partial = not all(keep)
        if self.sink is not None:
            if not self.buffered:
                self._since = time.monotonic()
            self.sink.write(batch, output, keep if partial else None)
        kept = batch.select(keep) if partial else batch
        self.committed.update(it.index for it in kept.items)
        if self.sink is not None:
            self.buffered.extend(kept.items)
        return kept, (batch.select([not k for k in keep]) if partial else None)

    def due(self) -> bool:
        return bool(self.buffered) and (self.sink.full() or time.monotonic() - self._since >= self.interval_s)

    def flush(self) -> None:
        """Write what is buffered (raises OSError on a write error; nothing is then committed)."""
        if self.sink is not None and self.buffered:
            self.sink.flush()
        self.buffered = []


class RunLoop:
    def __init__(
        self, scheduler: Scheduler, executor: Executor, committer: Committer, *, run: RunContext, hook, policy: Runtime
    ):
        self.scheduler = scheduler
        self.executor = executor
        self.committer = committer
        self.run = run
        self.hook = hook
        self.policy = policy
        self.in_flight: dict[int, tuple[Batch, Device]] = {}  # ticket -> (batch, device)
        self.expired: dict[int, tuple[Batch, Device]] = {}  # tickets given up on; a late result may come
        self.parts: dict[int, list[bool]] = {}  # ticket -> its batch's items given by PARTIAL outcomes so far
        self.tallies: dict[str, DeviceTally] = {d.name: DeviceTally() for d in scheduler.devices.values()}
        self.counts: Counter = Counter()  # timeouts, lost, oom, splits, discarded, late
        self.retry_reasons: Counter = Counter()  # reason -> failed attempts that were retried
        self.halt: tuple[str, str] | None = None  # (status, reason): stop at the next turn (signals set it too)
        self._tickets = itertools.count()
        self._rates: dict[str, float] = {}  # device -> padded slots per second, measured
        self.window = FailureWindow(policy.failure_window, policy.max_failure_share)  # items finished
        self.items_completed = 0  # this session's items committed
        self.items_failed: Counter = Counter()  # reason -> this session's items failed for good
        # records read: admission adds each one's outcome (a separate window, since it reads ahead of the work)
        run.input_window = FailureWindow(policy.failure_window, policy.max_failure_share)
        self.scheduler_s = 0.0  # time spent deciding what runs

    # -- the loop ---------------------------------------------------------------
    def run_until_done(self) -> None:
        """Run until every item is committed or failed; raise `Stop` when stopping early."""
        while True:
            if self.halt:
                self._stop(*self.halt)
            scheduled = self._schedule()
            if self._bad_input():
                continue
            if not self.in_flight and not self.executor.in_flight():
                if self.scheduler.done:
                    break
                live = [d for d in self.scheduler.devices if self.executor.live(d)]
                if not live:
                    self._stop("stopped", "; ".join(self.executor.retired.values()) or "no device can run work")
                if not scheduled and all(self.executor.free_slots(d) for d in live):
                    waiting = self.scheduler.waiting_items()
                    names = ", ".join(repr(it.id) for it in waiting[:5]) + (", ..." if len(waiting) > 5 else "")
                    self._stop(
                        "stalled",
                        f"stalled: {len(waiting)} item(s) wait that no device can take "
                        f"({names}); lower too_long limits or add a larger device",
                    )
            for outcome in self.executor.collect(0.5 if self.in_flight else 0.05):
                self.complete(outcome)
            if self.committer.due():
                self._flush()
        self._flush()
        if self.run.input_window is not None:
            self.run.input_window.judge_partial("input records")  # an input shorter than the window
            self._bad_input()
        if self.halt:
            self._stop(*self.halt)
        if self.items_failed and not self.items_completed:
            (reason, n), total = self.items_failed.most_common(1)[0], sum(self.items_failed.values())
            self._stop("failed", f"failed: every item failed ({total}); the commonest reason ({n}): {reason}")

    def _bad_input(self) -> bool:
        """Stop (at the next turn) once one kind of bad record fills the input window."""
        window = self.run.input_window
        if window is None or window.stop is None or self.halt is not None:
            return False
        self.halt = ("stopped", f"stopped: {window.stop}; fix the input, or raise runtime.max_failure_share")
        return True

    def _schedule(self) -> bool:
        scheduled = False
        for name in self.scheduler.by_speed():
            if not self.executor.live(name):
                continue
            for _ in range(self.executor.free_slots(name)):
                device = self.scheduler.devices[name]
                t0 = time.perf_counter()
                batch = self.scheduler.schedule(device)
                self.scheduler_s += time.perf_counter() - t0
                if batch is None:
                    break
                ticket = next(self._tickets)
                self.in_flight[ticket] = (batch, device)
                self.hook.forge_batch_routed(run=self.run, batch=batch, device=device)
                self.run.timings["last_routed_at"] = time.time()
                self.executor.submit(ticket, device, batch, self._timeout(batch, device))
                self._note_memory(batch, device)
                scheduled = True
        return scheduled

    def _note_memory(self, batch: Batch, device: Device) -> None:
        """batching=memory: the largest predicted peak routed to each device, and its budget (report)."""
        packer = self.scheduler.packer
        peak = packer.predicted_bytes(batch)
        if peak is not None:
            tally = self.tallies[device.name]
            tally.peak_bytes = max(tally.peak_bytes, peak)
            tally.budget_bytes = packer.budget(device)

    def _timeout(self, batch: Batch, device: Device) -> float:
        p = self.policy
        if p.batch_timeout_s is not None:
            return p.batch_timeout_s
        rate = self._rates.get(device.name)
        if rate is None:  # the first batch on a device also warms it up
            return p.timeout_floor_s * p.timeout_factor
        return max(p.timeout_floor_s, p.timeout_factor * batch.padded_slots / rate)

    # -- outcomes ---------------------------------------------------------------
    def complete(self, outcome: Outcome) -> None:
        if outcome.status == Status.PARTIAL:
            self._part(outcome)
            return
        entry = self._rest(self.in_flight.pop(outcome.ticket, None), outcome.ticket)
        if entry is None:  # a late answer for a batch already re-routed
            late = self._rest(self.expired.pop(outcome.ticket, None), outcome.ticket)
            self.parts.pop(outcome.ticket, None)
            if late is not None and outcome.status == Status.COMPLETED:
                self.counts["late_results"] += 1
                self.hook.forge_batch_late(run=self.run, batch=late[0], device=late[1])
                self._commit(late[0], late[1], outcome, late=True)
            return
        if outcome.status != Status.TIMEOUT:  # a timed-out batch's late parts may still come
            self.parts.pop(outcome.ticket, None)
        batch, device = entry
        if outcome.status == Status.COMPLETED:
            if outcome.seconds > 0:
                rate = batch.padded_slots / outcome.seconds
                old = self._rates.get(device.name)
                self._rates[device.name] = rate if old is None else 0.8 * old + 0.2 * rate
                self.scheduler.note_rate(device.name, self._rates[device.name])
            self.scheduler.update_from_output(device.name, batch, outcome)
            self._commit(batch, device, outcome, late=False)
            return
        self.counts[outcome.status.value] += 1
        if outcome.status == Status.TIMEOUT:
            self.expired[outcome.ticket] = entry
        failed = self.scheduler.update_from_output(device.name, batch, outcome)
        reason = f"{outcome.reason} (on {device.name})"
        if failed is None:
            self.retry_reasons[reason] += 1
            self.hook.forge_batch_failed(run=self.run, batch=batch, device=device, reason=reason, will_retry=True)
            return
        self.hook.forge_batch_failed(
            run=self.run, batch=batch, device=device, reason=f"{failed} (on {device.name})", will_retry=False
        )
        self._finished([failed] * len(batch.items))

    def _part(self, outcome: Outcome) -> None:
        """Some items of a running batch, finished: committed now (a streaming worker's parts); the
        batch's own outcome is then for the rest."""
        late = outcome.ticket not in self.in_flight
        entry = self.in_flight.get(outcome.ticket) or self.expired.get(outcome.ticket)
        if entry is None:
            return
        batch, device = entry
        given = self.parts.setdefault(outcome.ticket, [False] * len(batch.items))
        keep = [False] * len(given)
        for k in outcome.part:
            keep[k], given[k] = True, True
        part = batch.select(keep)
        self.scheduler.heard(device.name, part)
        self._commit(part, device, outcome, late=late)

    def _rest(self, entry: tuple[Batch, Device] | None, ticket: int) -> tuple[Batch, Device] | None:
        """A batch's entry less the items its PARTIAL outcomes gave (what its own outcome is for)."""
        given = self.parts.get(ticket)
        if entry is None or given is None:
            return entry
        return entry[0].select([not g for g in given]), entry[1]

    def _commit(self, batch: Batch, device: Device, outcome: Outcome, late: bool) -> None:
        t0 = time.perf_counter()
        with signals_deferred():
            self._commit_now(batch, device, outcome, late)
        self._timed("commit_s", t0)
        self.run.timings.setdefault("first_batch_at", time.time())

    def _timed(self, key: str, t0: float) -> None:
        self.run.timings[key] = self.run.timings.get(key, 0.0) + time.perf_counter() - t0

    def _commit_now(self, batch: Batch, device: Device, outcome: Outcome, late: bool) -> None:
        kept, duplicate = self.committer.commit(batch, outcome.output)
        if duplicate is not None:
            self.counts["discarded"] += 1
            why = "late result after its batch was re-routed" if late else "items committed already by another attempt"
            self.hook.forge_batch_discarded(run=self.run, batch=duplicate, device=device, reason=why)
        if kept is None:
            return
        output: BatchOutput = outcome.output  # what a worker returns (forge.function.Worker), or the simulator's
        # the steps it ran: an engine's own (a part's come with its batch's end; a plan's simulated
        # engine runs none), or one pass of its rows (None)
        steps = getattr(output, "steps", None)
        if outcome.status == Status.PARTIAL or (steps is None and device.steps().engine):
            steps = ()
        prefix, held = getattr(output, "engine_prefix", None), getattr(output, "root_held_tokens", 0)
        stats = batch_stats(kept, outcome.seconds, output.prefix_computed_tokens, prefix, steps, held)
        tally = self.tallies[device.name]
        tally.add(kept, stats, whole=outcome.status != Status.PARTIAL)  # a part: of a batch counted at its end
        if kept.split_prefix and kept.prefix_len and not output.cache_hit:
            tally.cache_misses += 1
        self.hook.forge_batch_completed(run=self.run, batch=kept, device=device, stats=stats)
        self._finished([None] * len(kept.items))

    def _finished(self, reasons: list[str | None]) -> None:
        """Count finished items; stop when one failure reason fills the recent window."""
        self.window.add(reasons)
        failed = [r for r in reasons if r is not None]
        self.items_failed.update(failed)
        self.items_completed += len(reasons) - len(failed)
        if self.window.stop is not None and self.halt is None:
            self.halt = ("stopped", f"stopped: {self.window.stop}")

    def _flush(self) -> None:
        t0 = time.perf_counter()
        try:
            with signals_deferred():
                self.committer.flush()
        except OSError as exc:
            items, self.committer.buffered = self.committer.buffered, []
            reason = f"writing a shard failed ({exc}); what was committed before stays committed"
            self.hook.forge_commit_failed(run=self.run, items=items, reason=reason)
            then = (
                "another run may hold the directory now: resume=true finishes it once that run ends"
                if isinstance(exc, LockLost)
                else "fix the cause and rerun with resume=true"
            )
            self.halt = ("stopped", f"{reason}; {then}")
        finally:
            self._timed("commit_s", t0)

    # -- stopping early ---------------------------------------------------------
    def _stop(self, status: str, message: str) -> None:
        """Let in-flight batches finish for a while, commit what came back, and account every
        item still out as unfinished; then raise Stop."""
        deadline = time.monotonic() + self.policy.drain_s
        while self.in_flight and time.monotonic() < deadline and status != "stalled":
            for outcome in self.executor.collect(min(0.5, max(0.0, deadline - time.monotonic()))):
                if outcome.status == Status.PARTIAL:
                    self._part(outcome)
                    continue
                entry = self._rest(self.in_flight.pop(outcome.ticket, None), outcome.ticket)
                self.parts.pop(outcome.ticket, None)
                if entry is None:
                    continue
                if outcome.status == Status.COMPLETED:
                    self._commit(entry[0], entry[1], outcome, late=False)
                else:
                    self._drop(entry, f"{outcome.reason}; then the run stopped")
        self.wind_down(message)
        raise Stop(status, message)

    def wind_down(self, message: str) -> None:
        """End the run where it stands (no drain): batches still out are given up, what is
        buffered is committed, and every item not committed is accounted as unfinished. The
        executor's workers must be stopped first (a second Ctrl-C does that at once)."""
        with signals_deferred():
            for ticket, entry in list(self.in_flight.items()):
                self._drop(self._rest(entry, ticket) or entry, "in flight when the run stopped")
            self.in_flight.clear()
            try:
                self.committer.flush()
            except OSError as exc:
                items, self.committer.buffered = self.committer.buffered, []
                self.hook.forge_commit_failed(run=self.run, items=items, reason=f"writing a shard failed ({exc})")
            waiting = [it for it in self.scheduler.waiting_items() if it.index not in self.committer.committed]
            if waiting:
                self.hook.forge_items_unfinished(run=self.run, items=waiting, reason=message)

    def _drop(self, entry: tuple[Batch, Device], why: str) -> None:
        batch, device = entry
        self.hook.forge_batch_failed(run=self.run, batch=batch, device=device, reason=why, will_retry=True)
        items = [it for it in batch.items if it.index not in self.committer.committed]
        if items:
            self.hook.forge_items_unfinished(run=self.run, items=items, reason=why)
