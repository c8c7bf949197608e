"""Prefix-affinity routing: compulsory misses only, and no device idles while work waits."""

import numpy as np

from forge.batching import TokenPacker
from forge.config.modes import TokenBatching
from forge.core.scheduler import Scheduler
from forge.vocab.geometry import Device, Item, Limits


def workload(n, n_prefixes, seed=0):
    rng = np.random.default_rng(seed)
    plens = np.linspace(64, 384, n_prefixes).astype(int)
    keys = rng.integers(0, n_prefixes, n)
    lens = np.clip(rng.lognormal(np.log(40), 0.6, n), 4, 400).astype(int)
    return [Item(str(i), int(plens[k] + s), f"p{k}", int(plens[k])) for i, (k, s) in enumerate(zip(keys, lens))]


def run_sim(items, devices, packer, window=65536, cache_tokens=1 << 20):
    sched = Scheduler(packer, items, devices, window=window, cache_tokens=cache_tokens)
    clocks = {d.name: 0 for d in devices}
    runs_prefix = {d.name: set() for d in devices}
    batches = []
    while not sched.done:
        d = min(devices, key=lambda d: clocks[d.name])
        waiting = sched.waiting or not sched.exhausted
        b = sched.schedule(d)
        assert b is not None or not waiting, "a device idled while work waited"
        clocks[d.name] += b.padded_slots + 256
        if not b.tree:  # a tree batch computes its prefixes in its rows, past the cache
            runs_prefix[d.name].add(b.prefix_key)
        batches.append((d.name, b))
    return sched, batches, runs_prefix


def test_cache_misses_are_the_compulsory_ones():
    lim = Limits(8192, 256, 2048)
    devices = [Device("a", lim), Device("b", lim)]
    # groups kept apart: every prefix goes through the cache (merged groups compute theirs in rows)
    packer = TokenPacker(TokenBatching(packing="packed", merge_groups=False))
    sched, batches, runs_prefix = run_sim(workload(20_000, 20), devices, packer, window=4096)
    for d in devices:
        # at most one miss per distinct prefix a device runs
        assert sched.cache_misses[d.name] == len(runs_prefix[d.name])
    hit_tokens = sum(b.prefix_tokens - (0 if b.cache_hit else b.prefix_len) for _, b in batches if not b.tree)
    needed = sum(b.prefix_tokens for _, b in batches)
    compulsory = sum(len(keys) for keys in runs_prefix.values()) * 384  # longest prefix, per device
    assert hit_tokens / needed >= 1 - compulsory / needed > 0.99
    assert {name for name, _ in batches} == {"a", "b"}  # both devices worked


def test_capacity_misses_show_when_the_cache_is_small():
    lim = Limits(8192, 256, 2048)
    devices = [Device("a", lim)]
    items = workload(5000, 12)
    sched, batches, runs_prefix = run_sim(items, devices, TokenPacker(), window=500, cache_tokens=400)
    assert sched.cache_misses["a"] > len(runs_prefix["a"])
    assert sched.caches["a"].evictions > 0


def test_work_stealing_keeps_both_devices_busy():
    lim = Limits(8192, 256, 2048)
    devices = [Device("a", lim), Device("b", lim)]
    items = workload(3000, 1)  # one prefix: affinity alone would leave a device idle
    sched, batches, runs_prefix = run_sim(items, devices, TokenPacker())
    per_device = {n: sum(1 for name, _ in batches if name == n) for n in ("a", "b")}
    assert min(per_device.values()) >= 0.3 * max(per_device.values())
    assert sched.cache_misses == {"a": 1, "b": 1}
