"""The decoder's KV budget: what of the waiting prompts fits, whether a prefilled block is admitted,
room made for the next step by preempting, and the slots' byte bound.

Model: a worker's keys and values (slot buffers, the block being prefilled, prefixes being
computed, stored and stacked prefixes) stay within `kv_bytes` (batching=memory: the device's budget
less the weights; None: no limit). A block is taken only as large as its prompts' KV fits beside
what runs; a prefilled block waits until its slots fit; when running sequences outgrow the budget,
the latest admitted is preempted (its slot freed, put back first in line, its tokens recomputed
when a block takes it again). `KVBudget` is the collaborator `forge.runtime.decoder.engine.Decoder`
asks (vLLM's KV cache manager plays this part there).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable

from forge.runtime.decoder.kv_slots import SlotKV
from forge.runtime.decoder.prefill import BlockPrefill
from forge.runtime.decoder.rows_kv import RowKV
from forge.runtime.decoder.sequence import Sequence
from forge.runtime.forward.prefix_cache import PrefixCache, PrefixKey


class KVBudget:
    """The KV budget of one decoder: `kv_bytes` (None: no limit) over its slots (`SlotKV`), its stored
    prefixes (`prefixes`), the prefixes being computed (`computing_bytes`) and the decode steps'
    stacked prefixes (`stacked_bytes`; `drop_stacked` forgets them when no step reads them)."""

    def __init__(
        self,
        kv_bytes: int | None,
        prefixes: PrefixCache,
        key: Callable[[Sequence], PrefixKey],
        drop_stacked: Callable[[], None],
    ):
        self.kv_bytes = kv_bytes
        self.prefixes = prefixes
        self.key = key  # what a sequence's prefix is stored under
        self.drop_stacked = drop_stacked
        self.computing_bytes = 0  # prefixes being computed: their cache (and its stored copy, before the block's)
        self.stacked_bytes = 0  # the decode steps' stacked prefixes (0: none stacked)

    @property
    def limited(self) -> bool:
        return self.kv_bytes is not None

    def other_bytes(self, kv: SlotKV | RowKV, block: list[Sequence], fill: BlockPrefill | None) -> int:
        """KV held beside the slots: stored, stacked and computing prefixes, the block being prefilled (its
        cache; and when some of its rows ended at their first token, the others gathered for the slots)."""
        held = self.prefixes.bytes + self.stacked_bytes
        if block:
            width = max(len(s.tokens()) for s in block)
            columns = fill.held_columns() if fill is not None else len(block) * width
            gathered = sum(not s.finished for s in block) if any(s.finished for s in block) else 0
            # prefixes being computed: their cache and stored copy now, stored beside the block's cache next
            new = self.computing_bytes
            held += new + max(new, (columns + gathered * width) * kv.column_bytes)
        return held

    def bound(self, kv: SlotKV | RowKV, beside: int) -> int:
        """The slots' byte limit: the KV budget less what is held `beside` them; returned."""
        assert self.kv_bytes is not None
        kv.limit, kv.beside = self.kv_bytes - beside, beside
        kv.peak_bytes = max(kv.peak_bytes, beside + kv.held_bytes())
        return kv.limit

    def fitting(self, waiting: deque, take: int, kv: SlotKV | RowKV, running: dict[int, Sequence]) -> int:
        """How many of the next `take` waiting prompts a block can hold within the KV budget; at least
        one when nothing runs (and an error when even that one does not fit)."""
        assert self.kv_bytes is not None
        base = self.prefixes.bytes + self.stacked_bytes
        if not running:
            self.drop_stacked()  # no step reads them now
            self.stacked_bytes, base = 0, self.prefixes.bytes
            self.bound(kv, base)
            kv.tidy(force=True)  # nor any slot
        widths = list(itertools.accumulate((len(waiting[k].tokens()) for k in range(take)), max))
        computing, new = [], 0  # bytes of the prefixes the first n would compute and store
        seen: set[PrefixKey] = set()
        for k in range(take):
            key = self.key(waiting[k])
            if key[1] and key not in seen and key not in self.prefixes:
                seen.add(key)
                new += len(key[1]) * kv.column_bytes
            computing.append(new)
        for n in range(take, 0, -1):  # their cache and stored copy, then stored beside the block's cache
            new = computing[n - 1]
            limit = self.kv_bytes - base - new - max(new, n * widths[n - 1] * kv.column_bytes)
            if limit > 0 and kv.place_fits(n, widths[n - 1], limit):
                return n
        if running:
            return 0  # the running ones first: they free their slots as they end
        raise RuntimeError(
            f"generate: the KV budget of {self.kv_bytes / 2**20:.1f} MiB does not hold one sequence of "
            f"{widths[0]} tokens ({kv.column_bytes} bytes a token); raise the device's memory_gb"
        )

    def admits(
        self, kv: SlotKV | RowKV, running: dict[int, Sequence], block: list[Sequence], fill: BlockPrefill
    ) -> bool:
        """Whether a prefilled block's slots fit the KV budget now (else it waits for running ones to end)."""
        if self.kv_bytes is None:
            return True
        limit = self.bound(kv, self.other_bytes(kv, block, fill))
        if not running:  # what it holds is free: dropped, the block fits as `fitting` found
            kv.tidy(force=True)
            return True
        return kv.place_fits(len(block), fill.width, limit)

    def make_room(self, kv: SlotKV | RowKV, running: dict[int, Sequence], waiting: deque, other: int) -> list[Sequence]:
        """Room for the next step's column within the KV budget: free slots and dead columns dropped,
        then the latest admitted sequences preempted (put back first in line, their tokens so far
        recomputed when a block takes them again). Returns those preempted."""
        limit = self.bound(kv, other)
        preempted: list[Sequence] = []
        while not kv.grow_fits(limit):
            if kv.free or kv.capacity > kv.columns + 1:
                renumber(running, kv.tidy(force=True))
                if kv.grow_fits(limit):
                    break
            if len(running) <= 1:
                raise RuntimeError(
                    f"generate: the KV budget of {(self.kv_bytes or 0) / 2**20:.1f} MiB does not hold one sequence "
                    f"of {kv.columns + 1} columns; raise the device's memory_gb"
                )
            victim = max(running.values(), key=lambda seq: seq.admitted)
            kv.release(victim.slot)
            del running[victim.slot]
            victim.slot, victim.prefix_kv = -1, None
            waiting.appendleft(victim)
            preempted.append(victim)
        return preempted


def renumber(running: dict[int, Sequence], moved: dict[int, int] | None) -> None:
    """The running sequences under their slots' new numbers after `SlotKV.tidy` moved them (None: none moved)."""
    if moved is None:
        return
    for seq in running.values():
        seq.slot = moved[seq.slot]
    renumbered = {seq.slot: seq for seq in running.values()}
    running.clear()
    running.update(renumbered)
