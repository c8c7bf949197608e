"""Packer cost and geometry at scale, no model.

    python -m benchmarks packer [--rows 1000000] [--rounds 3] [--seed 3]

1. Time to pack `--rows` (1,000,000) items through the scheduler's bounded window (65,536 items), per
   mode: every batch is cut, routed and cache-tracked exactly as in a run, then dropped
   (a run hands it to a device and forgets it). Two inputs, interleaved:
   - geometry: lengths and prefix codes only, as numpy columns (`GeometryFeed`): the
     packer's own cost, the figure the issue sets;
   - Items: the same workload as `Item` objects (`ItemFeed`), as a run feeds it, which adds
     reading each Item's geometry and handing each batch its Items.
   Every mode and input once a round, interleaved (the harness); medians.
2. Geometry on the reference workload and on a 200,000-item / 50-prefix variant with two
   devices: padding waste, batches against the minimum possible, prefix-cache hit rate.
"""

from __future__ import annotations

import gc
import time
from collections import Counter

from benchmarks import harness
from benchmarks.workloads import geometry as workload_geometry, items as workload_items
from forge.batching import ItemPacker, TokenPacker
from forge.config.modes import ItemBatching, TokenBatching
from forge.core.columns import GeometryFeed
from forge.core.scheduler import Scheduler
from forge.vocab.geometry import Device, Limits

LIMITS = Limits(max_batch_tokens=8192, max_rows=256, max_seq_len=2048, pad_multiple=1)


def drive(packer, items, devices, window=65536, cache_tokens=1 << 20):
    """Schedule everything, the least-loaded device asking next. Returns (batches, scheduler, seconds)."""
    sched = Scheduler(packer, items, devices, window=window, cache_tokens=cache_tokens)
    load = {d.name: 0 for d in devices}
    batches = []
    t0 = time.perf_counter()
    while not sched.done:
        d = min(devices, key=lambda d: load[d.name])
        b = sched.schedule(d)
        load[d.name] += b.padded_slots + 256
        batches.append(b)
    return batches, sched, time.perf_counter() - t0


def pack_seconds(packer, source, device, window=65536) -> tuple[int, float]:
    """(batches, seconds) to schedule everything on one device, keeping no batch. `source`
    is a list of Items (whole batches of Items are built) or a GeometryFeed (cuts only)."""
    sched = Scheduler(packer, source, [device], window=window, cache_tokens=1 << 20)
    step = sched.next_cut if isinstance(source, GeometryFeed) else sched.schedule
    n = 0
    t0 = time.perf_counter()
    while not sched.done:
        step(device)
        n += 1
    return n, time.perf_counter() - t0


def geometry_row(name, batches, items, sched):
    slots = sum(b.padded_slots for b in batches)
    padding = sum(b.padding for b in batches)
    group = Counter()
    for it in items:
        group[it.prefix_key] += it.suffix_len
    minimum = sum(-(-t // LIMITS.max_batch_tokens) for t in group.values())
    needed = sum(b.prefix_tokens for b in batches)
    computed = sum(b.prefix_len for b in batches if b.split_prefix and not b.cache_hit) + sum(
        b.prefix_tokens for b in batches if not b.split_prefix
    )
    hit = (needed - computed) / needed if needed else float("nan")
    misses = dict(sched.cache_misses)
    return [name, f"{len(items):,}", f"{len(batches):,}", f"{len(batches) / minimum:.3f}"] + [
        f"{100 * padding / slots:.3f}%",
        f"{100 * hit:.3f}%",
        misses,
    ]


MODES = {
    "item (32, arrival)": lambda: ItemPacker(ItemBatching(batch_size=32)),
    "token rows": lambda: TokenPacker(),
    "token packed": lambda: TokenPacker(TokenBatching(packing="packed")),
}


def cost(rep: harness.Report, args) -> None:
    """The packer's own cost: every mode over geometry columns and over Items, interleaved."""
    which, prefix_lens, suffix = workload_geometry(args.rows, 50, seed=args.seed)
    big = workload_items(args.rows, 50, seed=args.seed)
    # The Items are built up front, which a streaming run never does: freeze them so the
    # garbage collector does not walk a million resident Items on every collection.
    gc.collect()
    gc.freeze()

    def variant(make, src: str):
        def run(r: int) -> dict:
            feed = GeometryFeed(prefix_lens[which] + suffix, which, prefix_lens) if src == "geometry" else big
            batches, seconds = pack_seconds(make(), feed, Device("d0", LIMITS))
            return {"wall_s": seconds, "batches": batches}

        return run

    trials = harness.interleave(
        {f"{m} / {src}": variant(make, src) for src in ("geometry", "items") for m, make in MODES.items()}, args.rounds
    )
    lines = []
    for m in MODES:
        geo, its = trials.median(f"{m} / geometry"), trials.median(f"{m} / items")
        lines.append([m, f"{trials.last(f'{m} / geometry')['batches']:,}", f"{geo:.2f}", f"{args.rows / geo:,.0f}"])
        lines[-1].append(f"{its:.2f}")
    title = f"## Packer cost: {args.rows:,} items, 50 prefixes, window 65,536, one device"
    header = ["mode", "batches", "geometry: median s", "geometry: items/s", "Items: median s"]
    rep.table(header, lines, title=title)
    rep.trials(trials)


def main(argv: list[str] | None = None) -> None:
    args = harness.parser(__doc__, rounds=3, rows=1_000_000, seed=3).parse_args(argv)
    rep = harness.Report(args)
    cost(rep, args)
    two = [Device("d0", LIMITS), Device("d1", LIMITS)]
    lines = []
    for label, its, devs in (
        ("reference, 1 device", workload_items(3000, 12), [Device("d0", LIMITS)]),
        ("200k x 50 prefixes, 2 devices", workload_items(200_000, 50, seed=2), two),
    ):
        for m, make in (
            ("item 32", lambda: ItemPacker(ItemBatching(batch_size=32))),
            ("item 32 sorted", lambda: ItemPacker(ItemBatching(batch_size=32, order="length"))),
            ("token rows", lambda: TokenPacker()),
            ("token packed", lambda: TokenPacker(TokenBatching(packing="packed"))),
        ):
            batches, sched, _ = drive(make(), its, devs)
            lines.append(geometry_row(f"{label}: {m}", batches, its, sched))
    title = "## Geometry (max_batch_tokens=8192, max_rows=256, pad_multiple=1)"
    header = ["workload / mode", "items", "batches", "batches / minimum", "padding waste", "prefix hit rate"]
    rep.table([*header, "misses per device"], lines, title=title)
    rep.save()


if __name__ == "__main__":
    main()
