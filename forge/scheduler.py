"""The scheduler: one call, `schedule(device)`, returns the next batch for that device.

Model: items stream from admission into the packer's bounded window. For a device the
scheduler walks the waiting prefix groups in affinity order (groups whose prefix that
device's cache holds, then groups no device holds, then groups another device holds:
work stealing, so nobody idles while work waits) and asks the packer to cut a batch:
first a full one, then, when none is ready, whatever fits. It tracks each device's
prefix cache with the same LRU policy and capacity the device uses, so predicted hits
are the hits the device will see. Failed batches come back through `requeue` and run
first, one item per batch.

Per-batch cost is kept flat: the window refills in chunks (a quarter of it at a time,
or all of it before anything is drained), and a device keeps cutting from the prefix
group it ran last while that group is ready and cached there, which is where the full
affinity order would send it anyway.
"""

from __future__ import annotations

from collections import deque
from itertools import islice
from typing import Iterable, Iterator

from forge.batching.base import Packer
from forge.geometry import Batch, Device, Item
from forge.lru import TokenLRU


class Scheduler:
    def __init__(
        self,
        packer: Packer,
        items: Iterable[Item],
        devices: list[Device],
        *,
        window: int = 65536,
        cache_tokens: int = 0,
    ):
        self.packer = packer
        self._items: Iterator[Item] = iter(items)
        self.window = max(1, int(window))
        self.exhausted = False
        self.max_window_seen = 0  # most items ever held in the window
        self.cache_tokens = cache_tokens
        self.caches = {d.name: TokenLRU(cache_tokens) for d in devices}  # predicted device caches
        self.cache_misses = {d.name: 0 for d in devices}
        self._retries: deque[Item] = deque()
        self._seq = 0
        self._refill_chunk = max(1, self.window // 4)  # refill once this much room is free
        self._last_key: dict[str, str | None] = {}  # device -> prefix group it cut last

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
        if batch is None:
            self._refill()
            batch = self._cut(device)
        if batch is None:
            return None
        batch.seq = self._seq
        self._seq += 1
        self._track_cache(batch, device)
        return batch

    def requeue(self, items: list[Item]) -> None:
        """Items of a failed batch: each runs again on its own, before new work."""
        self._retries.extend(items)

    def _refill(self, full: bool = False) -> bool:
        """Top the window up (only once a chunk's worth is free, unless `full`). True if it grew."""
        room = self.window - len(self.packer)
        if self.exhausted or room <= 0 or (room < self._refill_chunk and not full):
            return False
        chunk = list(islice(self._items, room))
        if len(chunk) < room:
            self.exhausted = True
        self.packer.add_many(chunk)
        self.max_window_seen = max(self.max_window_seen, len(self.packer))
        return bool(chunk)

    def _cut(self, device: Device) -> Batch | None:
        last = self._last_key.get(device.name)  # None: no group yet, or one no cache holds
        if last is not None and last in self.caches[device.name]:
            batch = self.packer.cut(last, device, False)  # same group, still ready: no reordering
            if batch is not None:
                return batch
        batch = self._first_ready(device, drain=False)
        if batch is None and self._refill(full=True):  # nothing ready: fill the window first
            batch = self._first_ready(device, drain=False)
        return batch or self._first_ready(device, drain=True)

    def _first_ready(self, device: Device, drain: bool) -> Batch | None:
        for key in self._affinity_order(device):
            batch = self.packer.cut(key, device, drain)
            if batch is not None:
                self._last_key[device.name] = batch.prefix_key
                return batch
        return None

    def _affinity_order(self, device: Device) -> list[str | None]:
        """Group keys, best first: held by this device, held by none, held by another."""
        mine = self.caches[device.name]
        others = [c for name, c in self.caches.items() if name != device.name]

        def rank(g) -> tuple[int, int]:
            if g.cacheable and g.key in mine:
                tier = 0
            elif not g.cacheable or not any(g.key in c for c in others):
                tier = 1
            else:
                tier = 2
            return tier, -g.tokens

        return [g.key for g in sorted(self.packer.groups(), key=rank)]

    def _next_retry(self, device: Device) -> Batch | None:
        lim = device.limits
        for _ in range(len(self._retries)):
            item = self._retries.popleft()
            if item.num_tokens <= lim.max_seq_len:
                return Batch(rows=[[item]], padded_len=lim.pad(item.num_tokens),
                             prefix_key=item.prefix_key, prefix_len=item.prefix_len, retry=True)
            self._retries.append(item)  # too long here; another device takes it
        return None

    def _track_cache(self, batch: Batch, device: Device) -> None:
        if not (batch.split_prefix and batch.prefix_key is not None and batch.prefix_len):
            return
        cache = self.caches[device.name]
        batch.cache_hit = cache.get(batch.prefix_key) is not None
        if not batch.cache_hit:
            self.cache_misses[device.name] += 1
            cache.put(batch.prefix_key, True, batch.prefix_len)
