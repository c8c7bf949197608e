"""Batches complete in virtual time: no model, no sleeping (`forge plan`).

Model: each device has a clock. A batch starts when its device is free and virtual time has
reached the moment it was routed ("now": the end of the last outcome collected), and takes
the device's step time: a simulated device (`sim:` in its inventory entry) declares it in
seconds, a + b x tokens + c x scores, where tokens are the padded slots plus the prefix
tokens computed (none on a predicted cache hit) and scores the query x key pairs attention
computes; a plain device costs tokens + its per-step overhead, in token-equivalents. The
batch that finishes first is collected first, so the device that would be idle first asks
for the next batch, as in a run.

Memory: given the measured memory model (`true_bytes`: the fit without its safety margin)
and a device's budget, a batch whose true peak exceeds the budget fails with a simulated
out-of-memory error (`Status.OOM`) after its step time, and the scheduler handles it as a
real one (split, retry, lower budget). Budgets lowered by the scheduler after an OOM do not
change the device: its true budget stays what the inventory declares.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

from forge.errors import ForgeError
from forge.executors.base import Executor, Outcome, Status
from forge.vocab.geometry import Batch, Device, step_cost


@dataclass(frozen=True, slots=True)
class SimOutput:
    prefix_computed_tokens: int  # prefix tokens the batch ran (0 on a predicted hit)
    cache_hit: bool
    # an engine that shares its whole-sequence rows' prefixes itself (generate's decoder), as predicted:
    # (prefix tokens held from the device's earlier batches, shared within the batch, prefixes run)
    engine_prefix: tuple[int, int, int] | None = None


@dataclass(frozen=True, slots=True)
class Span:
    """One batch on a device's timeline (`forge plan --plot`)."""

    device: str
    start: float  # virtual time it started
    end: float  # virtual time it finished
    rows: int
    padded_slots: int
    status: str  # completed | oom


def time_unit(devices: list[Device]) -> str:
    """ "s" when every device is simulated, "token-equivalents" when none is; a mix is refused."""
    sims = [d.name for d in devices if d.sim is not None]
    if not sims:
        return "token-equivalents"
    if len(sims) == len(devices):
        return "s"
    plain = [d.name for d in devices if d.sim is None]
    raise ForgeError(
        f"devices: {', '.join(sims)} simulated (sim:) but {', '.join(plain)} not; a plan's virtual "
        "time needs every device simulated or none (give each entry a sim block, or none)"
    )


class SimExecutor(Executor):
    def __init__(
        self,
        overhead_tokens: Callable[[Device], int],
        true_bytes: Callable[[Batch], int] | None = None,
        timeline: bool = False,
        planned: Callable[[Batch, Device, int], int | None] | None = None,
    ):
        super().__init__()
        self.overhead_tokens = overhead_tokens
        self.true_bytes = true_bytes  # a batch's true peak bytes; None: memory is not simulated
        self.record = timeline  # keep every batch's Span (`forge plan --plot`)
        # the function's bound of what a worker holds running a batch (`Function.planned_peak_bytes`)
        self.planned = planned
        self.planned_peaks: dict[str, int] = {}  # device -> the largest such bound of a batch it completed
        self.clocks: dict[str, float] = {}  # device -> virtual time its last batch ends
        self.busy: dict[str, float] = {}  # device -> virtual time spent running batches
        self.budgets: dict[str, int | None] = {}  # device -> its true memory budget (as declared)
        self.ooms: dict[str, int] = {}  # device -> simulated out-of-memory errors
        self.peaks: dict[str, int] = {}  # device -> largest true peak of a batch it completed
        self.timeline: list[Span] = []
        self.now = 0.0  # virtual time of the last outcome collected
        self._heap: list[tuple] = []  # (end, ticket, device, cost, status, output, reason)
        self._busy: set[str] = set()  # devices with a batch in the heap (free_slots without scanning it)
        self.held: dict[str, dict] = {}  # device -> {prefix key: length} its engine computed (engine devices only)

    def start(self, devices: list[Device]) -> None:
        time_unit(devices)
        self.clocks = {d.name: 0.0 for d in devices}
        self.busy = {d.name: 0.0 for d in devices}
        self.ooms = {d.name: 0 for d in devices}
        self.budgets = {d.name: d.memory_bytes for d in devices}

    def free_slots(self, device: str) -> int:
        return 0 if device in self._busy else 1

    def step_seconds(self, device: Device, batch: Batch) -> tuple[float, int]:
        """(the step's virtual time, prefix tokens it computes)."""
        cost = step_cost(batch)
        if device.sim is not None:
            return device.sim.seconds(cost.tokens, cost.scores), cost.prefix_computed
        return float(cost.tokens + self.overhead_tokens(device)), cost.prefix_computed

    def submit(self, ticket: int, device: Device, batch: Batch, timeout_s: float | None) -> None:
        cost, computed = self.step_seconds(device, batch)
        start = max(self.clocks[device.name], self.now)
        end = start + cost
        self.clocks[device.name] = end
        self.busy[device.name] += cost
        budget = self.budgets.get(device.name)
        need = self.true_bytes(batch) if self.true_bytes is not None else 0
        oom = budget is not None and need > budget
        if not oom:
            self.peaks[device.name] = max(self.peaks.get(device.name, 0), need)
        status = Status.OOM if oom else Status.COMPLETED
        if oom:
            self.ooms[device.name] += 1
        if self.record:
            self.timeline.append(Span(device.name, start, end, batch.num_rows, batch.padded_slots, status.value))
        reason = (
            f"simulated out of memory: the batch needs more than the device's {budget / (1 << 30):.2f} GiB"
            if budget is not None and oom
            else ""
        )
        engine = None
        if status == Status.COMPLETED and device.steps().engine:  # only an engine's batches: no per-item walk else
            if self.planned is not None:
                keys = {it.prefix_key for it in batch.items}
                stored = sum(n for k, n in self.held.get(device.name, {}).items() if k not in keys)  # earlier batches'
                bound = self.planned(batch, device, stored)
                if bound is not None:
                    self.planned_peaks[device.name] = max(self.planned_peaks.get(device.name, 0), bound)
            engine = self._engine_prefix(device, batch)
        output = SimOutput(computed, bool(batch.cache_hit), engine)
        self._push(end, ticket, device.name, cost, status, output, reason)

    def _engine_prefix(self, device: Device, batch: Batch) -> tuple[int, int, int] | None:
        """What an engine of the function's own that shares prefixes (`Device.steps().engine`) does with
        a batch of whole sequences: each prefix run once, by its first item, unless an earlier batch on
        the device ran it (the engine keeps it: an unbounded prediction of its prefix cache)."""
        if not device.steps().engine or batch.split_prefix or batch.tree:
            return None
        held = self.held.setdefault(device.name, {})
        paid: dict = {}
        hit = shared = runs = 0
        for item in batch.items:
            if not item.prefix_len:
                continue
            key = item.prefix_key
            if key in held:
                hit += item.prefix_len
            elif key in paid:
                shared += item.prefix_len
            else:
                paid[key] = item.prefix_len
                runs += 1
        held.update(paid)
        return hit, shared, runs

    def _push(
        self, end: float, ticket: int, device: str, cost: float, status: Status, output: SimOutput, reason: str
    ) -> None:
        heapq.heappush(self._heap, (end, ticket, device, cost, status, output, reason))
        self._busy.add(device)

    def in_flight(self) -> int:
        return len(self._heap)

    def collect(self, wait_s: float) -> list[Outcome]:
        if not self._heap:
            return []
        end, ticket, name, cost, status, output, reason = heapq.heappop(self._heap)
        self._busy.discard(name)  # one batch per device at a time (free_slots), so it is free now
        self.now = max(self.now, end)
        return [Outcome(ticket, name, status, output if status == Status.COMPLETED else None, reason, cost)]

    def balance(self) -> dict:
        """Per device: busy, idle and finish in virtual time; the finish skew and the least busy share."""
        makespan = max(self.clocks.values(), default=0.0)
        devices = {
            name: {
                "busy": self.busy[name],
                "finish": self.clocks[name],
                "busy_share": self.busy[name] / makespan if makespan else 0.0,
                "oom": self.ooms[name],
                "peak_bytes": self.peaks.get(name, 0),
            }
            for name in self.clocks
        }
        finishes = [d["finish"] for d in devices.values()]
        return {
            "makespan": makespan,
            "finish_skew": (max(finishes) - min(finishes)) / makespan if makespan else 0.0,
            "min_busy_share": min((d["busy_share"] for d in devices.values()), default=0.0),
            "devices": devices,
        }
