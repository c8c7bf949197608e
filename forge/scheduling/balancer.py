"""The balancer: unequal devices pulling from one backlog finish together.

Model: each device has a rate (padded slots per second: declared by a simulated device,
measured by the run loop for a real one; a device not measured yet counts as the average
one) and the slots routed to it whose outcome is not heard yet. Affinity is weighed by rates
(`weigh`): a device passes over a free prefix group it could not drain before the whole
backlog would be done at everyone's pace (a faster device takes it), and steals first from
the group whose holders need longest to drain it. Once the input is exhausted, a batch
larger than the device's fair share of what is left (the backlog plus the work in flight,
divided in proportion to rates) is cut down to that share and the rest goes back to run
first elsewhere (`fair_share`), so the devices finish together; a batch that overruns the
common finish by less than a step's fixed cost stays whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from forge.batching.base import GroupInfo
from forge.scheduling.prefix_cache import PrefixCacheModel
from forge.vocab.geometry import Batch, Device, StepTime, pad_to_limits, step_cost


@dataclass(frozen=True, slots=True)
class Share:
    """What the balancer makes of a batch near the end of the backlog."""

    keep: Batch | None  # what the device runs now; None: it waits for the work to go elsewhere
    back: Batch | None = None  # what goes back to run first elsewhere (the rest, or the whole batch); None: nothing


class Balancer:
    def __init__(self, devices: list[Device], holds: Callable[[str, Batch], bool]):
        self.names = [d.name for d in devices]
        self.sims: dict[str, StepTime | None] = {d.name: d.sim for d in devices}  # declared step times
        # padded slots per second: declared (simulated devices), else measured (`note_rate`)
        self.rates: dict[str, float] = {d.name: 1.0 / d.sim.seconds_per_slot for d in devices if d.sim is not None}
        self.in_flight_slots: dict[str, int] = {d.name: 0 for d in devices}  # routed, outcome not heard yet
        self.end_splits = 0  # batches cut down to a device's share near the end of the backlog
        self._holds = holds  # whether a device's predicted cache holds a batch's prefix

    @property
    def weighs(self) -> bool:
        """Whether rates weigh affinity: some rate is known and there is more than one device."""
        return bool(self.rates) and len(self.names) > 1

    def note_rate(self, device: str, slots_per_s: float) -> None:
        """A device's measured speed (padded slots per second)."""
        if slots_per_s > 0:
            self.rates[device] = slots_per_s

    def rate(self, name: str) -> float:
        rate = self.rates.get(name)
        if rate is not None:
            return rate
        known = [r for r in self.rates.values()]
        return sum(known) / len(known) if known else 1.0  # not measured yet: the average device

    def by_speed(self) -> list[str]:
        """Device names, fastest first: when several are free at once, the fastest asks first."""
        if not self.rates:
            return list(self.names)
        return sorted(self.names, key=self.rate, reverse=True)

    def routed(self, name: str, slots: int) -> None:
        self.in_flight_slots[name] = self.in_flight_slots.get(name, 0) + slots

    def heard(self, name: str, slots: int) -> None:
        self.in_flight_slots[name] = max(0, self.in_flight_slots.get(name, 0) - slots)

    def fair_share(self, batch: Batch, device: Device, waiting_slots: int) -> Share:
        """Near the end of the backlog: `batch` cut down to this device's share of what is left
        (`waiting_slots` and the work in flight), the rest back; or nothing kept (the device
        waits) when it is the last work and another device, once free, would finish it sooner.

        Model: each device is busy for its in-flight slots / its rate (an upper bound: as if
        its batches had just started); the waiting slots and this batch are shared so that
        every device finishes at the same time T (water-filling over the busy times). This
        device keeps the rows its step time (declared, or slots / rate) fits before T, unless
        the batch overruns T by no more than one step's fixed cost: the rest, run as a batch
        of its own, would add more than the cut saves, so the batch stays whole."""
        rates = {name: self.rate(name) for name in self.names}
        busy = {name: self.in_flight_slots.get(name, 0) / rates[name] for name in self.names}
        work: float = waiting_slots + batch.padded_slots
        pace, level = 0.0, 0.0
        for name in sorted(busy, key=lambda n: busy[n]):  # raise the level over the devices free soonest
            if pace and level + work / pace <= busy[name]:
                break
            work -= pace * (busy[name] - level)
            level, pace = busy[name], pace + rates[name]
        finish = level + work / pace
        room = finish - busy[device.name]  # seconds this device may still take
        hit = bool(batch.cache_hit)
        whole = self.seconds(device.name, batch, rates, hit)
        if whole <= room or batch.num_rows < 2:
            return self._or_sooner_elsewhere(batch, device, rates, busy, finish)
        one = self.seconds(device.name, replace(batch, rows=batch.rows[:1]), rates, hit)
        fixed = one - (whole - one) / (batch.num_rows - 1)  # a step's cost beyond its rows
        rows = rows_within(room, one, whole, batch.num_rows)
        if rows < 1 or whole - room <= fixed:  # or the overrun is less than the rest's own step would add
            return self._or_sooner_elsewhere(batch, device, rates, busy, finish)
        self.end_splits += 1
        keep = replace(batch, rows=batch.rows[:rows])
        rest = replace(batch, rows=batch.rows[rows:], seq=-1, cache_hit=None)
        return Share(pad_to_limits(keep, device.limits) or keep, rest)  # padded to its own longest row

    def seconds(self, name: str, batch: Batch, rates: dict[str, float], hit: bool | None = None) -> float:
        """How long `batch` would take on a device (its prefix computed unless `hit`; None: unless
        that device's predicted cache holds it): its declared step time, else slots / rate."""
        if hit is None and batch.split_prefix and batch.prefix_len:
            hit = self._holds(name, batch)
        cost = step_cost(batch, cache_hit=bool(hit))
        sim = self.sims[name]
        if sim is None:
            return cost.tokens / rates[name]
        return sim.seconds(cost.tokens, cost.scores)

    def _or_sooner_elsewhere(
        self, batch: Batch, device: Device, rates: dict[str, float], busy: dict[str, float], finish: float
    ) -> Share:
        """`batch` kept, unless it would outlast the fair finish of everything left on this device
        and a busy device, once free, would finish it sooner: then it goes back for that one."""
        mine = self.seconds(device.name, batch, rates, hit=bool(batch.cache_hit))
        if mine <= finish or not any(
            busy[e] and busy[e] + self.seconds(e, batch, rates) < mine for e in self.names if e != device.name
        ):
            return Share(batch)
        return Share(None, replace(batch, cache_hit=None))

    def weigh(
        self,
        device: Device,
        groups: list[GroupInfo],
        free: list[GroupInfo],
        stolen: list[GroupInfo],
        caches: PrefixCacheModel,
    ) -> tuple[list[GroupInfo], list[GroupInfo]]:
        """Affinity weighed by rates: a free group this device could not drain before the whole
        backlog would be done at everyone's pace goes last (a faster device takes it); a group
        to steal is the one whose holders need longest to drain it."""
        rates = {name: self.rate(name) for name in self.names}
        pace = sum(g.tokens for g in groups) / sum(rates.values())  # seconds until all is done
        mine = rates[device.name]
        fits = [g for g in free if g.tokens <= pace * mine or not g.cacheable]
        if len(fits) < len(free):
            free = fits + [g for g in free if g.tokens > pace * mine and g.cacheable]
        if len(stolen) > 1:
            others = [(rates[n], keys) for n, keys in caches.others(device.name)]
            holders = {}  # prefix code -> summed rates of the other devices caching it
            for g in stolen:
                held: float = 0
                for rate, keys in others:
                    if g.key in keys:
                        held += rate
                holders[g.key] = held
            stolen = sorted(stolen, key=lambda g: g.tokens / max(holders[g.key], 1e-12), reverse=True)
        return free, stolen


def rows_within(room: float, one: float, whole: float, num_rows: int) -> int:
    """Rows of a batch that fit `room` seconds when one row takes `one` and all `num_rows` take
    `whole` (> room), the rows between costing alike: 0 to num_rows - 1, so that something
    always goes back (rounding could otherwise keep every row and send back an empty batch)."""
    if room < one:
        return 0
    return min(num_rows - 1, 1 + int((room - one) / ((whole - one) / (num_rows - 1))))
