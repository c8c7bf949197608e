"""The scheduler: one call, `schedule(device)`, returns the next batch for that device.

Model: items stream from a feed into the packer's bounded window. The feed keeps the Items
and hands the packer only their geometry as numpy columns (`forge.columns`); the packer
cuts `Cut`s that name items by id, and the scheduler turns each back into a `Batch` of
Items. `next_cut` is the same step without Items, for geometry-only feeds.

For a device the scheduler walks the waiting prefix groups in affinity order (groups whose
prefix that device's cache holds, then groups no device holds, then groups another device
holds: work stealing, so nobody idles while work waits) and asks the packer for a
batch. It tracks each device's
prefix cache with the same LRU policy and capacity the device uses, so predicted hits
are the hits the device will see. Every outcome comes back through `update_from_output`
(vLLM's pairing of `schedule` with it): a lost worker's cache is forgotten, an out-of-memory
error lowers the device's budget, and a failed batch goes back whole (worker lost or timed
out) or split in halves (an error, out of memory, or an item lost with its worker
`max_attempts` times), until a single item that still fails is failed with its reason.
Batches that come back run first, on the first device they fit (its four limits, and in
`memory` mode its budget: a batch predicted over a device's budget is never routed to it).

Unequal devices (`rates`: padded slots per second, declared by a simulated device, measured
by the run loop for a real one) pull from one backlog. Affinity weighs them: a device passes
over a free prefix group it could not drain before the whole backlog would be done at
everyone's pace (a faster device takes it), and steals first from the group whose holders
need longest to drain it. Once the input is exhausted, a batch larger than the device's
fair share of what is left (the backlog plus the work in flight, divided in proportion to
rates) is cut down to that share and the rest goes back to run first elsewhere, so the
devices finish together.

A step asks, in order: for a batch planned already (`Urgency.WAIT`); then, with the window
topped up (in eighths: admitting a chunk has a fixed cost), for a plan from what the full
window holds (`ROOM`); then for another device's prefix (work stealing); and only when the
input is exhausted, or nothing else is left, for whatever remains (`DRAIN`). Per-batch cost
stays flat: a device keeps taking the planned batches of the group it ran last while that
group is cached there, which is where the full affinity order would send it anyway.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace
from operator import attrgetter
from typing import Iterable

from forge.batching.base import NO_PREFIX, Cut, GroupInfo, Packer, Urgency
from forge.columns import ColumnFeed, GeometryFeed, ItemFeed
from forge.executors.base import Outcome, Status
from forge.geometry import Batch, Device, Item, Limits, batch_fits, step_cost
from forge.lru import TokenLRU

_new_tokens = attrgetter("new_tokens")


def _keys(groups: list[GroupInfo], ready: bool = False) -> list[int]:
    """Keys of `groups`, in order; with `ready`, only those that hold ready batches."""
    return [g.key for g in groups if g.ready] if ready else [g.key for g in groups]


class Scheduler:
    def __init__(
        self,
        packer: Packer,
        items: Iterable[Item] | GeometryFeed | ColumnFeed,
        devices: list[Device],
        *,
        window: int = 65536,
        cache_tokens: int = 0,
        max_attempts: int = 3,
    ):
        self.packer = packer
        self.devices: dict[str, Device] = {d.name: d for d in devices}  # as known now (budgets drop on OOM)
        self.max_attempts = max(1, int(max_attempts))  # runs of an item lost with its worker before it fails
        self.attempts: dict[int, int] = {}  # input index -> runs lost with a worker (crash, hang)
        self.oom_splits = 0  # batches split after running out of memory
        self.window = max(1, int(window))
        # where items come from: Items (a run), or bare geometry (plans and benchmarks at scale)
        self.feed = items if isinstance(items, (GeometryFeed, ColumnFeed)) else ItemFeed(items, self.window)
        self.exhausted = False
        self.max_window_seen = 0  # most items ever held in the window
        self.cache_tokens = cache_tokens
        self.caches = {d.name: TokenLRU(cache_tokens) for d in devices}  # predicted device caches
        self.cache_misses = {d.name: 0 for d in devices}
        self._retries: deque[Batch] = deque()  # batches that came back, run first
        self._seq = 0
        self._refill_chunk = max(1, self.window // 8)  # top the window up once this much room is free
        self._last_key: dict[str, int] = {}  # device -> prefix code it cut last
        # padded slots per second: declared (simulated devices), else measured (`note_rate`)
        self.rates: dict[str, float] = {d.name: 1.0 / d.sim.seconds_per_slot for d in devices if d.sim is not None}
        self.in_flight_slots: dict[str, int] = {d.name: 0 for d in devices}  # routed, outcome not heard yet
        self.end_splits = 0  # batches cut down to a device's share near the end of the backlog

    # -- state ------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return len(self.packer) + sum(len(b.items) for b in self._retries)

    @property
    def done(self) -> bool:
        """Nothing left to cut, now or later (in-flight batches are the caller's to track)."""
        return self.exhausted and not self.waiting

    # -- scheduling -------------------------------------------------------------
    def schedule(self, device: Device) -> Batch | None:
        """The next batch for `device`, or None when nothing waiting fits it now."""
        batch = self._next_retry(device)
        if batch is not None:
            batch.seq = self._seq
            self._seq += 1
        else:
            cut = self.next_cut(device)
            if cut is None:
                return None
            batch = self._batch(cut)
        if self.exhausted:
            batch = self._fair_share(batch, device)
            if batch is None:
                return None
        self.in_flight_slots[device.name] = self.in_flight_slots.get(device.name, 0) + batch.padded_slots
        return batch

    def note_rate(self, device: str, slots_per_s: float) -> None:
        """A device's measured speed (padded slots per second), for balancing."""
        if slots_per_s > 0:
            self.rates[device] = slots_per_s

    def by_speed(self) -> list[str]:
        """Device names, fastest first: when several are free at once, the fastest asks first."""
        if not self.rates:
            return list(self.devices)
        return sorted(self.devices, key=self._rate, reverse=True)

    def _rate(self, name: str) -> float:
        rate = self.rates.get(name)
        if rate is not None:
            return rate
        known = [r for r in self.rates.values()]
        return sum(known) / len(known) if known else 1.0  # not measured yet: the average device

    def _fair_share(self, batch: Batch, device: Device) -> Batch | None:
        """Near the end of the backlog: `batch` cut down to this device's share of what is left,
        the rest back to run first elsewhere; None (the device waits) when it is the last work
        and another device, once free, would finish it sooner.

        Model: each device is busy for its in-flight slots / its rate (an upper bound: as if
        its batches had just started); the waiting slots and this batch are shared so that
        every device finishes at the same time T (water-filling over the busy times). This
        device keeps the rows its step time (declared, or slots / rate) fits before T."""
        waiting = sum(g.tokens for g in self.packer.groups()) + sum(b.padded_slots for b in self._retries)
        rates = {name: self._rate(name) for name in self.devices}
        busy = {name: self.in_flight_slots.get(name, 0) / rates[name] for name in self.devices}
        work, pace, level = waiting + batch.padded_slots, 0.0, 0.0
        for name in sorted(busy, key=busy.get):  # raise the level over the devices free soonest
            if pace and level + work / pace <= busy[name]:
                break
            work -= pace * (busy[name] - level)
            level, pace = busy[name], pace + rates[name]
        finish = level + work / pace
        room = finish - busy[device.name]  # seconds this device may still take
        hit = bool(batch.cache_hit)
        whole = self._seconds(device.name, batch, rates, hit)
        if whole <= room or batch.num_rows < 2:
            return self._or_sooner_elsewhere(batch, device, rates, busy, finish)
        one = self._seconds(device.name, replace(batch, rows=batch.rows[:1]), rates, hit)
        rows = 1 + int((room - one) / ((whole - one) / (batch.num_rows - 1))) if room >= one else 0
        if rows < 1:
            return self._or_sooner_elsewhere(batch, device, rates, busy, finish)
        self.end_splits += 1
        keep, rest = replace(batch, rows=batch.rows[:rows]), replace(batch, rows=batch.rows[rows:], seq=-1)
        keep = _fit(keep, device.limits) or keep  # padded to its own longest row
        rest.cache_hit = None
        self._retries.appendleft(rest)
        return keep

    def _seconds(self, name: str, batch: Batch, rates: dict[str, float], hit: bool | None = None) -> float:
        """How long `batch` would take on a device (its prefix computed unless that device's cache
        holds it): its declared step time, else slots / rate."""
        if hit is None and batch.split_prefix and batch.prefix_len:
            code = self.feed.code(batch.prefix_key) if batch.prefix_key is not None else NO_PREFIX
            hit = code in self.caches[name].keys()
        cost = step_cost(batch, cache_hit=bool(hit))
        sim = self.devices[name].sim
        if sim is None:
            return cost.tokens / rates[name]
        return sim.seconds(cost.tokens, cost.scores)

    def _or_sooner_elsewhere(self, batch: Batch, device: Device, rates: dict[str, float],
                             busy: dict[str, float], finish: float) -> Batch | None:
        """`batch`, unless it would outlast the fair finish of everything left on this device
        and a busy device, once free, would finish it sooner: then it waits for that one."""
        mine = self._seconds(device.name, batch, rates, hit=bool(batch.cache_hit))
        if mine <= finish or not any(busy[e] and busy[e] + self._seconds(e, batch, rates) < mine for e in self.devices
                   if e != device.name):
            return batch
        if batch.cache_hit is False and batch.split_prefix and batch.prefix_len:
            self.cache_misses[device.name] -= 1  # it does not run here after all
        batch.cache_hit = None
        self._retries.appendleft(batch)
        return None

    def next_cut(self, device: Device) -> Cut | None:
        """The next batch's geometry for `device` (retries aside), cache hit predicted."""
        cut = self._cut(device)
        if cut is None:
            return None
        cut.seq = self._seq
        self._seq += 1
        self._track_cache(cut, device)
        return cut

    def update_from_output(self, device: str, batch: Batch, outcome: Outcome) -> str | None:
        """Learn from what happened to `batch` on `device`. Returns the reason when its item
        fails for good (a single item that cannot succeed); None when it completed or went back."""
        status = outcome.status
        left = self.in_flight_slots.get(device, 0) - batch.padded_slots
        self.in_flight_slots[device] = max(0, left)
        if status == Status.COMPLETED:
            return None
        if status in (Status.LOST, Status.TIMEOUT):
            self.caches[device] = TokenLRU(self.cache_tokens)  # a new worker starts with an empty cache
            if not outcome.charged:  # queued behind the batch that failed: it goes back as it was
                self._retries.appendleft(replace(batch, retry=True))
                return None
            for it in batch.items:
                self.attempts[it.index] = self.attempts.get(it.index, 0) + 1
            worn = max(self.attempts[it.index] for it in batch.items)
            if worn < self.max_attempts:
                self._retries.appendleft(replace(batch, retry=True))
                return None
            if len(batch.items) == 1:
                return f"{outcome.reason}; its worker was lost {worn} times running it"
        elif status == Status.OOM:
            self._lower_budget(device, batch)
            self.oom_splits += 1
            if len(batch.items) == 1:
                return f"{outcome.reason}; out of memory even alone on {device}"
        elif len(batch.items) == 1:  # FAILED
            return outcome.reason
        self._retries.extendleft(reversed(batch.halves()))  # halves isolate what fails
        return None

    def _lower_budget(self, name: str, batch: Batch) -> None:
        """After an out-of-memory error: later batches on this device stay below the failed one."""
        d = self.devices[name]
        lim = d.limits
        floor = lim.pad(lim.max_seq_len)
        tokens = max(floor, min(lim.max_batch_tokens, batch.padded_slots * 3 // 4))
        memory = int(d.memory_bytes * 0.9) if d.memory_bytes else d.memory_bytes
        self.devices[name] = replace(d, limits=Limits(tokens, lim.max_rows, lim.max_seq_len, lim.pad_multiple),
                                     memory_bytes=memory)

    def waiting_items(self) -> list[Item]:
        """Every item waiting (window and retries), e.g. to account for them when a run stops."""
        items = [it for b in self._retries for it in b.items]
        waiting = getattr(self.feed, "waiting", None)
        return items + (waiting() if waiting else [])

    def _refill(self) -> bool:
        """Fill the window from the feed. True if it grew."""
        room = self.window - len(self.packer)
        if self.exhausted or room <= 0:
            return False
        chunk = self.feed.admit(room)
        if len(chunk) < room:
            self.exhausted = True
        if len(chunk):
            self.packer.add(chunk)
        self.max_window_seen = max(self.max_window_seen, len(self.packer))
        return bool(len(chunk))

    def _cut(self, device: Device) -> Cut | None:
        last = self._last_key.get(device.name)  # None: no group yet
        mine = self.caches[device.name].keys()
        # The last group goes on while ready: the affinity order puts it first when this
        # device caches its prefix, and no other group ranks above it when it has no prefix
        # and this device caches none.
        if last is not None and (last in mine or (last == NO_PREFIX and not mine)):
            cut = self.packer.cut(last, device, Urgency.WAIT)  # same group, still ready: no reordering
            if cut is not None:
                return cut
        near, far = self._affinity_order(device)
        cut = self._first_ready(_keys(near, ready=True), device, Urgency.WAIT)  # cut already
        if cut is not None:
            return cut
        # Nothing ready: plan from a full window, so batches pick from the most items (a
        # nearly full one is not topped up: admitting a chunk has a fixed cost).
        if self.window - len(self.packer) >= self._refill_chunk and self._refill():
            near, far = self._affinity_order(device)
        if not self.exhausted:
            cut = self._first_ready(_keys(near), device, Urgency.ROOM)
            if cut is None and self._refill():  # nothing worth running yet: the last room first
                near, far = self._affinity_order(device)
                cut = self._first_ready(_keys(near), device, Urgency.ROOM)
            # work stealing: another device's prefix, before cutting what should wait
            cut = (cut or self._first_ready(_keys(far, ready=True), device, Urgency.WAIT)
                   or self._first_ready(_keys(far), device, Urgency.ROOM))
            if cut is not None:
                return cut
        # Nothing more will arrive, or nothing is worth waiting for: cut what there is, in
        # affinity order (a device drains its own prefixes before taking another's).
        return self._first_ready(_keys(near + far), device, Urgency.DRAIN)

    def _first_ready(self, keys: list[int], device: Device, urgency: Urgency) -> Cut | None:
        cut = self.packer.first_cut(keys, device, urgency)
        if cut is not None:
            self._last_key[device.name] = cut.prefix
        return cut

    def _batch(self, cut: Cut) -> Batch:
        """The Items a cut names, in its rows."""
        if isinstance(self.feed, ColumnFeed):  # streamed columns: the batch keeps them, no Item per item
            return self.feed.batch(cut)
        items = self.feed.take(cut.ids)
        if cut.row_ends is None:
            rows = [[it] for it in items]
        else:
            rows = [items[a:b] for a, b in zip([0, *cut.row_ends], cut.row_ends)]
        return Batch(rows=rows, padded_len=cut.padded_len, prefix_key=self.feed.key(cut.prefix),
                     prefix_len=self.feed.prefix_len(cut.prefix), split_prefix=cut.split_prefix,
                     packed=cut.packed, seq=cut.seq, cache_hit=cut.cache_hit)

    def _affinity_order(self, device: Device) -> tuple[list[GroupInfo], list[GroupInfo]]:
        """Waiting groups, best first: (groups this device caches or no device does, groups only
        another device caches); within each, the most tokens not yet planned first."""
        mine = self.caches[device.name].keys()
        theirs = set().union(*(c.keys() for name, c in self.caches.items() if name != device.name))
        held, free, stolen = [], [], []
        groups = sorted(self.packer.groups(), key=_new_tokens, reverse=True)  # stable
        for g in groups:
            if not g.cacheable:
                free.append(g)
            elif g.key in mine:
                held.append(g)
            elif g.key in theirs:
                stolen.append(g)
            else:
                free.append(g)
        if len(self.rates) and len(self.devices) > 1:
            free, stolen = self._weigh(device, groups, free, stolen)
        return held + free, stolen

    def _weigh(self, device: Device, groups: list[GroupInfo], free: list[GroupInfo],
               stolen: list[GroupInfo]) -> tuple[list[GroupInfo], list[GroupInfo]]:
        """Affinity weighed by rates: a free group this device could not drain before the whole
        backlog would be done at everyone's pace goes last (a faster device takes it); a group
        to steal is the one whose holders need longest to drain it."""
        rates = {name: self._rate(name) for name in self.devices}
        pace = sum(g.tokens for g in groups) / sum(rates.values())  # seconds until all is done
        mine = rates[device.name]
        fits = [g for g in free if g.tokens <= pace * mine or not g.cacheable]
        if len(fits) < len(free):
            free = fits + [g for g in free if g.tokens > pace * mine and g.cacheable]
        if len(stolen) > 1:
            others = [(rates[n], c.keys()) for n, c in self.caches.items() if n != device.name]
            holders = {}  # prefix code -> summed rates of the other devices caching it
            for g in stolen:
                held = 0
                for rate, keys in others:
                    if g.key in keys:
                        held += rate
                holders[g.key] = held
            stolen = sorted(stolen, key=lambda g: g.tokens / max(holders[g.key], 1e-12), reverse=True)
        return free, stolen

    def _next_retry(self, device: Device) -> Batch | None:
        """The first batch that came back and fits `device` (limits and budget); one that fits
        no device goes back as single items, and a single item that fits no device's budget
        runs where its limits allow (out of memory alone, it fails with the reason)."""
        for i, batch in enumerate(self._retries):
            fitted = self._fit(batch, device)
            if fitted is not None:
                del self._retries[i]
                self._track_batch(fitted, device)
                return fitted
        for i, batch in enumerate(self._retries):
            if len(batch.items) > 1 and not any(self._fit(batch, d) for d in self.devices.values()):
                del self._retries[i]
                self._retries.extend(replace(batch, rows=[[it]]) for it in batch.items)
                return self._next_retry(device)
        for i, batch in enumerate(self._retries):
            if len(batch.items) == 1 and not any(self._fit(batch, d) for d in self.devices.values()):
                fitted = _fit(batch, device.limits)
                if fitted is not None:
                    del self._retries[i]
                    self._track_batch(fitted, device)
                    return fitted
        return None

    def _fit(self, batch: Batch, device: Device) -> Batch | None:
        """`batch` padded for `device`, or None when it breaks a limit or the packer's budget."""
        fitted = _fit(batch, device.limits)
        if fitted is None or not self.packer.batch_fits(fitted.num_rows, fitted.padded_len, fitted.row_offset, device):
            return None
        return fitted

    def _track_batch(self, batch: Batch, device: Device) -> None:
        code = self.feed.code(batch.prefix_key) if batch.prefix_key is not None else NO_PREFIX
        if not (batch.split_prefix and batch.prefix_len):
            return
        cache = self.caches[device.name]
        batch.cache_hit = cache.get(code) is not None
        if not batch.cache_hit:
            self.cache_misses[device.name] += 1
            cache.put(code, True, batch.prefix_len)

    def _track_cache(self, cut: Cut, device: Device) -> None:
        prefix_len = self.feed.prefix_len(cut.prefix)
        if not (cut.split_prefix and prefix_len):
            return
        cache = self.caches[device.name]  # keyed by prefix code, as the packer's groups are
        cut.cache_hit = cache.get(cut.prefix) is not None
        if not cut.cache_hit:
            self.cache_misses[device.name] += 1
            cache.put(cut.prefix, True, prefix_len)


def _fit(batch: Batch, limits: Limits) -> Batch | None:
    """`batch` padded for `limits`, or None when it breaks one of them."""
    off = batch.row_offset
    used = max(sum(it.num_tokens - off for it in row) for row in batch.rows)
    fitted = replace(batch, padded_len=limits.pad(used))
    return fitted if batch_fits(fitted, limits) is None else None
