"""The typed report: report.json's keys read off it as a mapping, `schema_version` first, plugin
keys beside the engine's, and the engine's own keys out of a plugin's reach; and the worker body
every executor shares (fault points, errors as data, sticky device errors)."""

import json

import pytest

from forge.driver.report import SCHEMA_VERSION, PlanFigures, Report
from forge.driver.simulate import plan_geometry
from forge.executors.base import Status
from forge.executors.worker import run_batch
from forge.hookspecs import hookimpl
from forge.pluginmanager import make_plugin_manager
from forge.vocab.geometry import Batch, Device, Item, Limits

CPU = Device("cpu", Limits(2048, 64, 1024))
ITEMS = [Item(f"i{k}", 8 + k % 5, "p" if k % 2 else None, 4 if k % 2 else 0) for k in range(40)]


def test_a_plan_reads_as_report_json_and_keeps_its_own_figures_typed():
    report = plan_geometry(ITEMS, [CPU], "token", keep_batches=True)
    assert isinstance(report, Report) and isinstance(report.plan, PlanFigures) and report.run is None
    view = report.as_dict()
    assert next(iter(view)) == "schema_version" and report["schema_version"] == SCHEMA_VERSION
    assert dict(report) == view and len(report) == len(view) and "config" in report
    assert report["status"] == "finished" and report.get("nothing") is None
    # the ledger's keys (a plugin's) read like the engine's; the kept batches are no key at all
    assert report["balanced"] and report["items"]["completed"] == len(ITEMS) == report.plugins["items"]["completed"]
    assert sum(len(b.items) for b in report.plan.kept_batches) == len(ITEMS)
    assert not any(k.startswith("_") for k in view) and "useful_tokens_per_s" not in view
    assert view["virtual_time"]["unit"] == report.plan.virtual_time.unit
    device = view["devices"][0]
    assert "busy_s" not in device and device["virtual_finish"] == report.devices[0].virtual_finish
    assert json.loads(json.dumps(view, default=str))["batches"] == report.batches > 0
    with pytest.raises(TypeError):
        report["status"] = "stopped"  # read-only


def test_a_plugin_adds_keys_but_cannot_replace_the_engines():
    class Adds:
        @hookimpl
        def forge_run_end(self, run, report):
            assert report["schema_version"] == SCHEMA_VERSION  # it sees the engine's figures
            report["mine"] = {"n": 1}
            report["status"] = "hijacked"
            del report["batching"]

    pm = make_plugin_manager()
    pm.register(Adds())
    report = plan_geometry(ITEMS, [CPU], "item", pm=pm)
    assert report["mine"] == {"n": 1} and report.plugins["mine"] == {"n": 1}
    assert report["status"] == "finished" and report["batching"] == "item"
    assert any("replaced the report's 'status'" in w for w in report.warnings)
    assert any("removed the report's 'batching'" in w for w in report.warnings)


class _Hook:
    """A hook relay that records the fault points and raises at one of them."""

    def __init__(self, raise_at=None, error=None):
        self.points, self.raise_at, self.error = [], raise_at, error

    def forge_fault(self, point, device, batch):
        self.points.append(point)
        if point == self.raise_at:
            raise self.error


class _Worker:
    def __init__(self, error=None):
        self.error = error

    def run(self, batch):
        if self.error is not None:
            raise self.error
        return "out"


BATCH = Batch(rows=[[ITEMS[0]]], padded_len=16)


def test_the_worker_body_fires_both_fault_points_and_times_the_batch():
    hook = _Hook()
    ran = run_batch(_Worker(), hook, CPU, BATCH)
    assert hook.points == ["before_forward", "after_forward"]
    assert ran.status == Status.COMPLETED and ran.payload == "out" and ran.seconds >= 0 and not ran.sticky
    outcome = ran.outcome(7, "cpu")
    assert (outcome.ticket, outcome.output, outcome.reason) == (7, "out", "")
    assert run_batch(_Worker(), None, CPU, BATCH).status == Status.COMPLETED  # no plugins, no fault points


@pytest.mark.parametrize(
    ("error", "status", "sticky"),
    [
        (RuntimeError("boom\nmore"), Status.FAILED, False),
        (MemoryError("can't allocate memory"), Status.OOM, False),
        (RuntimeError("step failed\nCUDA error: an illegal memory access"), Status.FAILED, True),
    ],
)
def test_every_error_comes_back_as_data_and_a_sticky_one_says_so(error, status, sticky):
    ran = run_batch(_Worker(error), _Hook(), CPU, BATCH)
    assert (ran.status, ran.sticky) == (status, sticky)
    outcome = ran.outcome(3, "cpu")
    assert outcome.output is None and outcome.reason == ran.payload and "\n" not in outcome.reason
    hook = _Hook("after_forward", RuntimeError("injected"))
    ran = run_batch(_Worker(), hook, CPU, BATCH)  # a fault after the forward pass fails the batch
    assert ran.status == Status.FAILED and ran.payload == "RuntimeError: injected"


# -- layouts and prefixes: which layouts ran, and how the prefixes were had, in words ---------


def _drive(source, packer, devices):
    """The run loop over `source` (Items or a ColumnFeed) on simulated `devices`; the loop."""
    from forge.config.schema import Runtime
    from forge.core.columns import ColumnFeed
    from forge.core.loop import Committer, RunLoop
    from forge.core.scheduler import Scheduler
    from forge.executors import SimExecutor
    from forge.vocab.records import RunContext

    pm = make_plugin_manager(load_entry_points=False, modules=("forge.builtin.ledger",))
    run = RunContext(function="t", batching="token", devices=devices, run_dir=None, dry_run=True)
    pm.hook.forge_run_start(run=run)
    if isinstance(source, ColumnFeed):
        source.received = lambda items: pm.hook.forge_items_received(run=run, items=items)
    else:
        pm.hook.forge_items_received(run=run, items=source)
    sched = Scheduler(packer, source, devices, window=2048, cache_tokens=1 << 16)
    executor = SimExecutor(packer.overhead_tokens)
    executor.start(devices)
    loop = RunLoop(sched, executor, Committer(None, set(), float("inf")), run=run, hook=pm.hook, policy=Runtime())
    loop.run_until_done()
    return loop, sched


@pytest.mark.parametrize(
    ("packer", "prefixes"),
    [("token", 12), ("token-merged", 300), ("packed", 12), ("item", 12)],
)
def test_streamed_column_batches_count_layouts_and_prefixes_as_item_batches_do(packer, prefixes):
    """The report's layout and prefix counts of a streamed run (column batches, no Item per
    item) equal those of the same workload run as Items."""
    import numpy as np

    from benchmarks.workloads import geometry, items as workload_items
    from forge.batching import ItemPacker, TokenPacker
    from forge.config.modes import ItemBatching, TokenBatching
    from forge.core.columns import ColumnFeed

    def make():
        options = {"token": {}, "token-merged": {}, "packed": {"packing": "packed", "packed_row_tokens": 512}}
        return ItemPacker(ItemBatching()) if packer == "item" else TokenPacker(TokenBatching(**options[packer]))

    devices = [Device(f"card{k}", Limits(8192, 256, 2048, 8), memory_bytes=16 << 30) for k in "ab"]
    n = 1500
    as_items = workload_items(n, prefixes, seed=1)
    for i, it in enumerate(as_items):
        it.index = i
    want, sched = _drive(as_items, make(), devices)
    which, prefix_lens, suffix = geometry(n, prefixes, 1)
    code = np.array([sched.feed.keys.index(f"prefix{k}") for k in range(prefixes)])  # the item feed's numbering
    lens = np.zeros(prefixes, np.int64)
    lens[code] = prefix_lens
    chunks = [
        (prefix_lens[which[a : a + 500]] + suffix[a : a + 500], code[which[a : a + 500]]) for a in range(0, n, 500)
    ]
    got, _ = _drive(ColumnFeed(chunks, lens, keys=sched.feed.keys, capacity=2048), make(), devices)
    for name, tally in want.tallies.items():
        assert got.tallies[name].shapes == tally.shapes, name
    shapes = [t.shapes for t in want.tallies.values()]
    assert sum(sum(s.layouts.values()) for s in shapes) == sum(t.batches for t in want.tallies.values())
    assert sum(s.items for s in shapes) == n
    layouts = {name for s in shapes for name in s.layouts}
    expected = {"token": "split-prefix rows", "token-merged": "tree rows", "packed": "split-prefix packed rows"}
    assert expected.get(packer, "rows") in layouts


def test_the_prefix_words_say_sharing_and_why_no_cache_hits():
    from forge.driver.report import prefix_words

    merged = {
        "items": 40,
        "distinct": 8,
        "computed": 8,
        "computed_in": {"tree rows": 8},
        "cache_hits": 0,
        "repeated": 0,
    }
    assert prefix_words(merged, cache_on=True) == (
        "8 distinct in 40 items; computed 8 times: 8 in tree rows (shared by a group's items); "
        "cache hits 0 (none needed: no device computed a prefix twice)"
    )
    cached = {**merged, "computed_in": {"split-prefix batches": 8}, "cache_hits": 3}
    assert prefix_words(cached).endswith("; cache hits 3 (split-prefix batches served from the device's cache)")
    whole = {**merged, "computed": 40, "computed_in": {"whole rows": 40}, "repeated": 32}
    assert prefix_words(whole) == (
        "8 distinct in 40 items; computed 40 times: 40 in whole rows (one per item); "
        "cache hits 0 (only split-prefix batches use the cache; none ran)"
    )
    split = {**merged, "computed": 12, "computed_in": {"split-prefix batches": 12}, "repeated": 4}
    assert prefix_words(split, cache_on=False).endswith("cache hits 0 (prefix cache off)")
    assert prefix_words(split, cache_on=True).endswith("cache hits 0 (4 computations of a prefix again)")


@pytest.mark.slow
def test_a_run_whose_prefix_groups_merged_says_each_prefix_ran_once_not_a_cache_failure(tmp_path):
    """With the defaults, small prefix groups merge into one batch of tree rows: no cache hit,
    none needed. The report and the summary say so (a real run of the embedded model)."""
    import io

    from rich.console import Console

    from forge.cli.summary import _run_table
    from forge.testing import run_function

    rows = [{"id": f"r{k}", "text": f"Statement {k} is true.", "prefix": f"Set {k % 8}. Answer.\n"} for k in range(40)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = run_function("surprisal", tmp_path / "rows.jsonl", tmp_path / "run", ["devices=cpu"])
    assert report["layouts"] == {"tree rows": 1} and report["tokens"]["cache_hit"] == 0
    words = (
        "8 distinct in 40 items; computed 8 times: 8 in tree rows (shared by a group's items); "
        "cache hits 0 (none needed: no device computed a prefix twice)"
    )
    assert report["prefixes"]["words"] == words
    assert report["devices"][0]["layouts"] == {"tree rows": 1}
    out = io.StringIO()
    Console(file=out, width=400).print(_run_table(report))
    printed = out.getvalue()
    assert words in printed and "1 (tree rows 1)" in printed
    assert "% not computed again: " in printed and "% in tree rows" in printed
    saved = json.loads((tmp_path / "run" / "report.json").read_text())
    assert saved["prefixes"] == report["prefixes"] and saved["layouts"] == report["layouts"]
