"""Streamed column geometry through the real run loop (the scale benchmark's path): the
ledger balances, every item is committed once, memory follows the window, and column
batches equal the batches the same workload makes as Items."""

import numpy as np
import pytest

from benchmarks.workloads import geometry, items as workload_items
from forge.batching import TokenPacker
from forge.builtin import ledger
from forge.config.schema import Runtime
from forge.core.columns import ColumnFeed
from forge.core.loop import Committer, RunLoop
from forge.core.scheduler import Scheduler
from forge.executors import SimExecutor
from forge.executors.base import Outcome, Status
from forge.hookspecs import hookimpl
from forge.pluginmanager import make_plugin_manager
from forge.vocab.column_batch import ColumnBatch
from forge.vocab.geometry import Device, Limits, broken_limit
from forge.vocab.indexset import IndexSet
from forge.vocab.records import RunContext

DEVICES = [Device(f"card{gb}{k}", Limits(8192, 256, 2048, 8), memory_bytes=gb << 30) for gb in (16, 80) for k in "ab"]


class Seen:
    """Every completed batch's geometry, and whether it fits its device."""

    def __init__(self):
        self.batches = []

    @hookimpl
    def forge_batch_completed(self, run, batch, device, stats):
        self.batches.append((device.name, batch.num_rows, batch.padded_len, batch.num_tokens, len(batch.items)))
        assert broken_limit(batch, device.limits) is None


def columns(n, chunk, seed=0):
    which, prefix_lens, suffix = geometry(n, 12, seed)
    for a in range(0, n, chunk):
        yield prefix_lens[which[a : a + chunk]] + suffix[a : a + chunk], which[a : a + chunk]


def drive(source, window, executor=None):
    seen = Seen()
    pm = make_plugin_manager(load_entry_points=False, extra=(seen,), modules=("forge.builtin.ledger",))
    run = RunContext(function="t", batching="token", devices=DEVICES, run_dir=None, dry_run=True)
    pm.hook.forge_run_start(run=run)
    if isinstance(source, ColumnFeed):
        source.received = lambda items: pm.hook.forge_items_received(run=run, items=items)
    else:
        pm.hook.forge_items_received(run=run, items=source)
    packer = TokenPacker()
    sched = Scheduler(packer, source, DEVICES, window=window, cache_tokens=1 << 16)
    executor = executor or SimExecutor(packer.overhead_tokens)
    executor.start(DEVICES)
    committer = Committer(None, set(), float("inf"))
    loop = RunLoop(sched, executor, committer, run=run, hook=pm.hook, policy=Runtime())
    loop.run_until_done()
    return ledger.ledger_of(run), seen.batches, sched, committer


def test_streamed_run_balances_and_memory_follows_the_window():
    n, window = 100_000, 4096
    _, prefix_lens, _ = geometry(1, 12)
    feed = ColumnFeed(columns(n, 10_000), prefix_lens, capacity=window)
    led, batches, sched, committer = drive(feed, window)
    assert led.check() == []
    assert led.items["received"] == led.items["completed"] == n and led.items["failed"] == 0
    total = sum(int(t.sum()) for t, _ in columns(n, 10_000))
    assert led.tokens["received"] == led.tokens["completed"] == led.tokens["routed"] == total
    assert sum(b[4] for b in batches) == n
    assert len(committer.committed) == n and committer.committed.contains(np.arange(n)).all()
    # bounded memory: the window never held more than its size, the feed never grew its slots
    assert sched.max_window_seen <= window and len(feed._index) == window


def test_column_batches_equal_item_batches():
    n = 6000
    which, prefix_lens, _ = geometry(n, 12, 1)
    as_items = workload_items(n, 12, seed=1)
    for i, it in enumerate(as_items):
        it.index = i
    _, want, sched, _ = drive(as_items, 2048)
    # the item feed numbers prefixes as it meets them; tie-breaks follow those codes, so the
    # columns use the same numbering
    code = np.array([sched.feed.keys.index(f"prefix{k}") for k in range(12)])
    lens = np.zeros(12, np.int64)
    lens[code] = prefix_lens
    chunks = ((t, code[p]) for t, p in columns(n, 1000, seed=1))
    _, got, _, _ = drive(ColumnFeed(chunks, lens, keys=sched.feed.keys, capacity=2048), 2048)
    assert got == want and len(got) > 50


class OomOnce(SimExecutor):
    """The first batch of more than one item on each device runs out of memory."""

    def __init__(self, overhead):
        super().__init__(overhead)
        self.failed: set[str] = set()
        self.split = 0

    def collect(self, wait_s):
        out = super().collect(wait_s)
        return [self._maybe_oom(o) for o in out]

    def submit(self, ticket, device, batch, timeout_s):
        self._last = getattr(self, "_last", {})
        self._last[ticket] = batch
        super().submit(ticket, device, batch, timeout_s)

    def _maybe_oom(self, o):
        batch = self._last.pop(o.ticket)
        if o.device not in self.failed and len(batch.items) > 1:
            self.failed.add(o.device)
            self.split += isinstance(batch, ColumnBatch)
            return Outcome(o.ticket, o.device, Status.OOM, reason="simulated out of memory", seconds=o.seconds)
        return o


def test_a_failed_column_batch_splits_into_items_and_nothing_is_lost():
    n = 5000
    _, prefix_lens, _ = geometry(1, 12)
    executor = OomOnce(TokenPacker().overhead_tokens)
    led, batches, sched, committer = drive(ColumnFeed(columns(n, 1000), prefix_lens, capacity=1024), 1024, executor)
    assert executor.split == len(DEVICES) and sched.oom_splits == len(DEVICES)
    assert led.check() == [] and led.items["completed"] == n and len(committer.committed) == n
    assert led.tokens["retried"] > 0


def test_index_set_answers_as_a_set():
    values = [5, 3, -1, 5, 70, 0]
    s = IndexSet(values)
    assert len(s) == len(set(values)) and list(s) == sorted(set(values))
    for i in range(-3, 80):
        assert (i in s) == (i in set(values))
    s.add_array(np.array([200, 3]))
    assert s.contains(np.array([200, 4, 10_000])).tolist() == [True, False, False] and len(s) == 6


def test_feed_refuses_an_item_without_a_suffix():
    from forge.errors import ForgeError

    feed = ColumnFeed([(np.array([10, 3]), np.array([0, 0]))], [3], capacity=4)
    with pytest.raises(ForgeError, match="item 1: 3 tokens, not more than its prefix"):
        feed.admit(2)


def test_a_column_batch_given_other_rows_counts_those_rows():
    from dataclasses import replace

    from forge.batching.base import Cut

    feed = ColumnFeed([(np.array([10, 12, 15]), np.array([0, 0, 0]))], [4], capacity=4)
    chunk = feed.admit(3)
    cut = Cut(chunk.ids, chunk.num_tokens - 4, None, 11, 25, 0, True)
    batch = feed.batch(cut)
    assert isinstance(batch.items, type(batch.columns)) and batch.num_tokens == 37 and batch.prefix_tokens == 12
    assert batch.row_tokens == 25 and batch.num_rows == 3 and [it.num_tokens for it in batch.items] == [10, 12, 15]
    retry = replace(batch, retry=True)  # same rows: still columns
    assert retry.columns is batch.columns and retry.num_tokens == 37
    single = replace(batch, rows=[[batch.items[1]]])  # one item, as a retry that fits no device makes
    assert single.columns is None and single.num_tokens == 12 and len(single.items) == 1
    assert single.prefix_tokens == 4 and single.row_tokens == 8
    halves = batch.halves()
    assert [len(h.items) for h in halves] == [1, 2] and sum(h.num_tokens for h in halves) == 37
