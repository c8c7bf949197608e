"""Packer cost and geometry at scale (no model): `python -m benchmarks.bench_packer`.

1. Time to pack 1,000,000 items through the scheduler's bounded window (65,536 items), per
   mode: every batch is cut, routed and cache-tracked exactly as in a run, then dropped
   (a run hands it to a device and forgets it). Two inputs, interleaved:
   - geometry: lengths and prefix codes only, as numpy columns (`GeometryFeed`): the
     packer's own cost, the figure the issue sets;
   - Items: the same workload as `Item` objects (`ItemFeed`), as a run feeds it, which adds
     reading each Item's geometry and handing each batch its Items.
2. Geometry on the reference workload and on a 200,000-item / 50-prefix variant with two
   devices: padding waste, batches against the minimum possible, prefix-cache hit rate.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections import Counter

from benchmarks.workloads import geometry as workload_geometry, items as workload_items
from forge.batching import ItemPacker, TokenPacker
from forge.core.columns import GeometryFeed
from forge.core.geometry import Device, Limits
from forge.core.scheduler import Scheduler

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
    return (
        f"| {name} | {len(items):,} | {len(batches):,} | {len(batches) / minimum:.3f} | "
        f"{100 * padding / slots:.3f}% | {100 * hit:.3f}% | {misses} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    print(f"## Packer cost: {args.n:,} items, 50 prefixes, window 65,536, one device\n")
    print("| mode | batches | geometry: median s | geometry: items/s | Items: median s |")
    print("| --- | --- | --- | --- | --- |")
    which, prefix_lens, suffix = workload_geometry(args.n, 50, seed=3)
    big = workload_items(args.n, 50, seed=3)
    # The Items are built up front, which a streaming run never does: freeze them so the
    # garbage collector does not walk a million resident Items on every collection.
    gc.collect()
    gc.freeze()
    modes = {
        "item (32, arrival)": lambda: ItemPacker(32),
        "token rows": lambda: TokenPacker(),
        "token packed": lambda: TokenPacker(packing="packed"),
    }
    times = {(m, src): [] for m in modes for src in ("geometry", "items")}
    batches = {}
    for _ in range(args.repeat):  # interleaved: A B C A B C ...
        for src in ("geometry", "items"):
            for m, make in modes.items():
                feed = GeometryFeed(prefix_lens[which] + suffix, which, prefix_lens) if src == "geometry" else big
                batches[m], s = pack_seconds(make(), feed, Device("d0", LIMITS))
                times[m, src].append(s)
    for m in modes:
        geo, its = statistics.median(times[m, "geometry"]), statistics.median(times[m, "items"])
        print(f"| {m} | {batches[m]:,} | {geo:.2f} | {args.n / geo:,.0f} | {its:.2f} |")

    print("\n## Geometry (max_batch_tokens=8192, max_rows=256, pad_multiple=1)\n")
    print(
        "| workload / mode | items | batches | batches / minimum | padding waste | prefix hit rate "
        "| misses per device |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    two = [Device("d0", LIMITS), Device("d1", LIMITS)]
    for label, its, devs in (
        ("reference, 1 device", workload_items(3000, 12), [Device("d0", LIMITS)]),
        ("200k x 50 prefixes, 2 devices", workload_items(200_000, 50, seed=2), two),
    ):
        for m, make in (
            ("item 32", lambda: ItemPacker(32)),
            ("item 32 sorted", lambda: ItemPacker(32, "length")),
            ("token rows", lambda: TokenPacker()),
            ("token packed", lambda: TokenPacker(packing="packed")),
        ):
            batches, sched, _ = drive(make(), its, devs)
            print(geometry_row(f"{label}: {m}", batches, its, sched))


if __name__ == "__main__":
    main()
