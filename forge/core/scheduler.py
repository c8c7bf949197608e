"""The scheduler: one call, `schedule(device)`, returns the next batch for that device.

Model: items stream from a feed into the packer's bounded window. The feed keeps the Items
and hands the packer only their geometry as numpy columns (`forge.core.columns`); the packer
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

The policies are parts, each owning its state (`forge.scheduling`): the predicted prefix
caches (`PrefixCacheModel`), the batches that came back (`RetryQueue`), rates and fair
shares (`Balancer`) and the budgets lowered after an out-of-memory error (`DeviceBudgets`).
The scheduler owns the window, the affinity walk and the order in which it asks them.

A step asks, in order: for a batch planned already (`Urgency.WAIT`); then, with the window
topped up (in eighths: admitting a chunk has a fixed cost), for a plan from what the full
window holds (`ROOM`); then for another device's prefix (work stealing); and only when the
input is exhausted, or nothing else is left, for whatever remains (`DRAIN`). Per-batch cost
stays flat: a device keeps taking the planned batches of the group it ran last while that
group is cached there, which is where the full affinity order would send it anyway.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from operator import attrgetter

from forge.batching.base import Cut, Feed, GroupInfo, Packer, Urgency
from forge.core.columns import ItemFeed
from forge.executors.base import Outcome, Status
from forge.scheduling import Balancer, DeviceBudgets, PrefixCacheModel, RetryQueue
from forge.vocab.geometry import DEFAULT_WINDOW, NO_PREFIX, Batch, Device, Item, pad_to_limits
from forge.vocab.lru import TokenLRU

_new_tokens = attrgetter("new_tokens")


def _keys(groups: list[GroupInfo], ready: bool = False) -> list[int]:
    """Keys of `groups`, in order; with `ready`, only those that hold ready batches."""
    return [g.key for g in groups if g.ready] if ready else [g.key for g in groups]


class Scheduler:
    def __init__(
        self,
        packer: Packer,
        items: Iterable[Item] | Feed,
        devices: list[Device],
        *,
        window: int = DEFAULT_WINDOW,
        cache_tokens: int = 0,
        max_attempts: int = 3,
    ):
        self.packer = packer
        self.window = max(1, int(window))
        # where items come from: Items (a run), or bare geometry (plans and benchmarks at scale)
        self.feed: Feed = items if isinstance(items, Feed) else ItemFeed(items, self.window)
        self.exhausted = False
        self.max_window_seen = 0  # most items ever held in the window
        self.budgets = DeviceBudgets(devices)
        self.prefix_caches = PrefixCacheModel([d.name for d in devices], cache_tokens)
        self.retries = RetryQueue(max_attempts)
        self.balancer = Balancer(devices, self._holds)
        self._seq = 0  # seq of the next batch handed out
        self._refill_chunk = max(1, self.window // 8)  # top the window up once this much room is free
        self._last_key: dict[str, int] = {}  # device -> prefix code it cut last

    # -- state ------------------------------------------------------------------
    @property
    def devices(self) -> dict[str, Device]:
        """Each device as known now (budgets drop on OOM)."""
        return self.budgets.devices

    @property
    def caches(self) -> dict[str, TokenLRU]:
        return self.prefix_caches.caches

    @property
    def cache_misses(self) -> dict[str, int]:
        return self.prefix_caches.misses

    @property
    def cache_tokens(self) -> int:
        return self.prefix_caches.cache_tokens

    @property
    def oom_splits(self) -> int:
        return self.budgets.oom_splits

    @property
    def end_splits(self) -> int:
        return self.balancer.end_splits

    @property
    def waiting(self) -> int:
        return len(self.packer) + self.retries.item_count

    @property
    def done(self) -> bool:
        """Nothing left to cut, now or later (in-flight batches are the caller's to track)."""
        return self.exhausted and not self.waiting

    def waiting_items(self) -> list[Item]:
        """Every item waiting (window and retries), e.g. to account for them when a run stops."""
        return self.retries.items() + self.feed.waiting()

    def close(self) -> None:
        """The run is over: the feed stops reading its input."""
        self.feed.close()

    # -- scheduling -------------------------------------------------------------
    def schedule(self, device: Device) -> Batch | None:
        """The next batch for `device`, or None when nothing waiting fits it now."""
        batch = self._next_retry(device)
        if batch is None:
            cut = self.next_cut(device)
            if cut is None:
                return None
            batch = self.feed.batch(cut)
        if self.exhausted:
            batch = self._fair_share(batch, device)
            if batch is None:
                return None
        self.balancer.routed(device.name, batch.padded_slots)
        return batch

    def note_rate(self, device: str, slots_per_s: float) -> None:
        """A device's measured speed (padded slots per second), for balancing."""
        self.balancer.note_rate(device, slots_per_s)

    def by_speed(self) -> list[str]:
        """Device names, fastest first: when several are free at once, the fastest asks first."""
        return self.balancer.by_speed()

    def next_cut(self, device: Device) -> Cut | None:
        """The next batch's geometry for `device` (retries aside), cache hit predicted."""
        cut = self._cut(device)
        if cut is None:
            return None
        seq, self._seq = self._seq, self._seq + 1
        prefix_len = self.feed.prefix_len(cut.prefix)
        if not (cut.split_prefix and prefix_len):
            return replace(cut, seq=seq)
        return replace(cut, seq=seq, cache_hit=self.prefix_caches.route(device.name, cut.prefix, prefix_len))

    def heard(self, device: str, part: Batch) -> None:
        """`device` gave the output of `part` of a batch it runs on (a PARTIAL outcome)."""
        self.balancer.heard(device, part.padded_slots)

    def update_from_output(self, device: str, batch: Batch, outcome: Outcome) -> str | None:
        """Learn from what happened to `batch` on `device`. Returns the reason when its item
        fails for good (a single item that cannot succeed); None when it completed or went back."""
        status = outcome.status
        self.balancer.heard(device, batch.padded_slots)
        if status == Status.COMPLETED:
            return None
        if status in (Status.LOST, Status.TIMEOUT):
            self.prefix_caches.forget(device)  # a new worker starts with an empty cache
            if not outcome.charged:  # queued behind the batch that failed: it goes back as it was
                self.retries.push_front(replace(batch, retry=True))
                return None
            worn = self.retries.count_lost(batch)
            if worn < self.retries.max_attempts:
                self.retries.push_front(replace(batch, retry=True))
                return None
            if len(batch.items) == 1:
                return f"{outcome.reason}; its worker was lost {worn} times running it"
        elif status == Status.OOM:
            self.budgets.lower(device, batch)
            if len(batch.items) == 1:
                return f"{outcome.reason}; out of memory even alone on {device}"
        elif len(batch.items) == 1:  # FAILED
            return outcome.reason
        self.retries.push_halves(batch)  # halves isolate what fails
        return None

    # -- parts ------------------------------------------------------------------
    def _code(self, batch: Batch) -> int:
        return self.feed.code(batch.prefix_key) if batch.prefix_key is not None else NO_PREFIX

    def _holds(self, name: str, batch: Batch) -> bool:
        """Whether `name`'s predicted cache holds `batch`'s prefix."""
        return self._code(batch) in self.prefix_caches.held(name)

    def _fair_share(self, batch: Batch, device: Device) -> Batch | None:
        """`batch`, or the part of it that is `device`'s fair share near the end of the backlog
        (the rest back to run first elsewhere); None when the device should wait."""
        waiting = sum(g.tokens for g in self.packer.groups()) + self.retries.padded_slots
        share = self.balancer.fair_share(batch, device, waiting)
        if share.keep is None and batch.cache_hit is False and batch.split_prefix and batch.prefix_len:
            self.prefix_caches.unroute_miss(device.name)  # it does not run here after all
        if share.back is not None:
            self.retries.push_front(share.back)
        return share.keep

    def _next_retry(self, device: Device) -> Batch | None:
        """The first batch that came back and fits `device`, its cache hit predicted."""
        batch = self.retries.take(device, list(self.devices.values()), self._routable)
        if batch is None:
            return None
        seq, self._seq = self._seq, self._seq + 1
        if not (batch.split_prefix and batch.prefix_len):
            return replace(batch, seq=seq)
        hit = self.prefix_caches.route(device.name, self._code(batch), batch.prefix_len)
        return replace(batch, seq=seq, cache_hit=hit)

    def _routable(self, batch: Batch, device: Device) -> Batch | None:
        """`batch` padded for `device`, or None when it breaks a limit or the packer's budget."""
        fitted = pad_to_limits(batch, device.limits)
        if fitted is None or not self.packer.batch_fits(fitted.num_rows, fitted.padded_len, fitted.row_offset, device):
            return None
        return fitted

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

    # -- the affinity walk ------------------------------------------------------
    def _cut(self, device: Device) -> Cut | None:
        last = self._last_key.get(device.name)  # None: no group yet
        mine = self.prefix_caches.held(device.name)
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
            cut = (
                cut
                or self._first_ready(_keys(far, ready=True), device, Urgency.WAIT)
                or self._first_ready(_keys(far), device, Urgency.ROOM)
            )
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

    def _affinity_order(self, device: Device) -> tuple[list[GroupInfo], list[GroupInfo]]:
        """Waiting groups, best first: (groups this device caches or no device does, groups only
        another device caches); within each, the most tokens not yet planned first."""
        mine = self.prefix_caches.held(device.name)
        theirs = self.prefix_caches.held_elsewhere(device.name)
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
        if self.balancer.weighs:
            free, stolen = self.balancer.weigh(device, groups, free, stolen, self.prefix_caches)
        return held + free, stolen
