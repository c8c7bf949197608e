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
are the hits the device will see. Failed batches come back through `requeue` and run
first, one item per batch.

A step asks, in order: for a batch planned already (`Urgency.WAIT`); then, with the window
topped up (in eighths: admitting a chunk has a fixed cost), for a plan from what the full
window holds (`ROOM`); then for another device's prefix (work stealing); and only when the
input is exhausted, or nothing else is left, for whatever remains (`DRAIN`). Per-batch cost
stays flat: a device keeps taking the planned batches of the group it ran last while that
group is cached there, which is where the full affinity order would send it anyway.
"""

from __future__ import annotations

from collections import deque
from operator import attrgetter
from typing import Iterable

from forge.batching.base import NO_PREFIX, Cut, GroupInfo, Packer, Urgency
from forge.columns import GeometryFeed, ItemFeed
from forge.geometry import Batch, Device, Item
from forge.lru import TokenLRU

_new_tokens = attrgetter("new_tokens")


def _keys(groups: list[GroupInfo], ready: bool = False) -> list[int]:
    """Keys of `groups`, in order; with `ready`, only those that hold ready batches."""
    return [g.key for g in groups if g.ready] if ready else [g.key for g in groups]


class Scheduler:
    def __init__(
        self,
        packer: Packer,
        items: Iterable[Item] | GeometryFeed,
        devices: list[Device],
        *,
        window: int = 65536,
        cache_tokens: int = 0,
    ):
        self.packer = packer
        self.window = max(1, int(window))
        # where items come from: Items (a run), or bare geometry (plans and benchmarks at scale)
        self.feed = items if isinstance(items, GeometryFeed) else ItemFeed(items, self.window)
        self.exhausted = False
        self.max_window_seen = 0  # most items ever held in the window
        self.cache_tokens = cache_tokens
        self.caches = {d.name: TokenLRU(cache_tokens) for d in devices}  # predicted device caches
        self.cache_misses = {d.name: 0 for d in devices}
        self._retries: deque[Item] = deque()
        self._seq = 0
        self._refill_chunk = max(1, self.window // 8)  # top the window up once this much room is free
        self._last_key: dict[str, int] = {}  # device -> prefix code it cut last

    # -- state ------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return len(self.packer) + len(self._retries)

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
            return batch
        cut = self.next_cut(device)
        return None if cut is None else self._batch(cut)

    def next_cut(self, device: Device) -> Cut | None:
        """The next batch's geometry for `device` (retries aside), cache hit predicted."""
        cut = self._cut(device)
        if cut is None:
            return None
        cut.seq = self._seq
        self._seq += 1
        self._track_cache(cut, device)
        return cut

    def requeue(self, items: list[Item]) -> None:
        """Items of a failed batch: each runs again on its own, before new work."""
        self._retries.extend(items)

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
        for key in keys:
            cut = self.packer.cut(key, device, urgency)
            if cut is not None:
                self._last_key[device.name] = cut.prefix
                return cut
        return None

    def _batch(self, cut: Cut) -> Batch:
        """The Items a cut names, in its rows."""
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
        for g in sorted(self.packer.groups(), key=_new_tokens, reverse=True):  # stable
            if not g.cacheable:
                free.append(g)
            elif g.key in mine:
                held.append(g)
            elif g.key in theirs:
                stolen.append(g)
            else:
                free.append(g)
        return held + free, stolen

    def _next_retry(self, device: Device) -> Batch | None:
        lim = device.limits
        for _ in range(len(self._retries)):
            item = self._retries.popleft()
            if item.num_tokens <= lim.max_seq_len:
                return Batch(rows=[[item]], padded_len=lim.pad(item.num_tokens),
                             prefix_key=item.prefix_key, prefix_len=item.prefix_len, retry=True)
            self._retries.append(item)  # too long here; another device takes it
        return None

    def _track_cache(self, cut: Cut, device: Device) -> None:
        prefix_len = self.feed.prefix_len(cut.prefix)
        if not (cut.split_prefix and prefix_len):
            return
        cache = self.caches[device.name]  # keyed by prefix code, as the packer's groups are
        cut.cache_hit = cache.get(cut.prefix) is not None
        if not cut.cache_hit:
            self.cache_misses[device.name] += 1
            cache.put(cut.prefix, True, prefix_len)
