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
