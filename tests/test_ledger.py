"""The ledger balances on clean runs, on bad input and when batches fail."""

import json
import re

import pytest

from conftest import SMALL, plan_forge, run_forge
from forge.errors import ForgeError


def write_rows(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(row if isinstance(row, str) else json.dumps(row))
            f.write("\n")
    return path


GOOD = [
    {"prefix": "Answer True or False.\n", "text": f"Statement number {i} is true.", "label": i % 2} for i in range(30)
]


def test_clean_run_balances(tmp_path):
    report = run_forge(tmp_path, *SMALL, "input.limit=60")
    assert report["balanced"] and not report["imbalance"]
    assert report["status"] == "finished"
    assert report["items"] == {
        "received": 60,
        "completed": 60,
        "failed": 0,
        "skipped": 0,
        "unfinished": 0,
        "resumed": 0,
    }
    t = report["tokens"]
    assert t["received"] == t["routed"] == t["completed"] > 0
    assert 0 <= t["padding"] < t["padded_slots"]
    assert report["padding_waste"] == round(t["padding"] / t["padded_slots"], 6)
    assert t["cache_hit"] <= t["prefix"]


def test_every_step_is_held_to_the_step_budget_and_one_over_it_unbalances_the_books():
    """The ledger records each device's step budget and the steps it ran (`BatchStats.steps`): a
    batch of one forward pass is one step of its padded rows; a step over the budget is an error."""
    from forge.builtin import ledger
    from forge.vocab.geometry import Batch, Device, Item, Limits, StepBudget
    from forge.vocab.records import RunContext, batch_stats

    limits = Limits(max_batch_tokens=64, max_rows=8, max_seq_len=32)
    device = Device("cpu", limits).with_step_budget(48)
    assert device.limits.max_batch_tokens == 48 and device.steps() == StepBudget(48)
    engine = Device("gpu", limits, step_budget=StepBudget(16, engine=True))
    batch = Batch([[Item(f"i{k}", 10)] for k in range(4)], padded_len=12)
    run = RunContext("surprisal", "token", [device, engine], None)
    ledger.forge_run_start(run)
    for dev, stats in [
        (device, batch_stats(batch, 0.1, 0)),  # one pass: 4 rows x 12 slots
        (engine, batch_stats(batch, 0.1, 0, None, [16, 9, 4])),  # an engine's own steps
    ]:
        ledger.forge_items_received(run, batch.items)
        ledger.forge_batch_routed(run, batch, dev)
        ledger.forge_batch_completed(run, batch, dev, stats)
    report: dict = {}
    ledger.forge_run_end(run, report)
    assert report["balanced"], report["imbalance"]
    assert report["steps"] == {
        "cpu": {"tokens_per_step_budget": 48, "engine_steps": False, "steps": 1, "largest_step_tokens": 48,
                "over_budget": 0},
        "gpu": {"tokens_per_step_budget": 16, "engine_steps": True, "steps": 3, "largest_step_tokens": 16,
                "over_budget": 0},
    }  # fmt: skip

    ledger.forge_items_received(run, batch.items)
    ledger.forge_batch_routed(run, batch, engine)
    ledger.forge_batch_completed(run, batch, engine, batch_stats(batch, 0.1, 0, None, [16, 17, 30]))
    report = {}
    ledger.forge_run_end(run, report)
    assert not report["balanced"] and report["steps"]["gpu"]["over_budget"] == 2
    assert report["imbalance"] == [
        "steps: device gpu ran 2 step(s) over its budget of 16 tokens (budget.tokens_per_step), the largest 30"
    ]


def test_the_step_budget_is_a_positive_integer():
    from forge.vocab.geometry import StepBudget

    for bad in (0, -3, 1.5, True, None):
        with pytest.raises(ForgeError, match="budget.tokens_per_step must be a positive integer"):
            StepBudget(bad)


def test_bad_rows_are_recorded_and_the_run_goes_on(tmp_path):
    rows = (
        GOOD[:10]
        + ['{"text": "broken', {"label": 1}, {"text": "   "}, {"text": 5}, {"text": "word " * 3000, "id": "huge"}]
        + GOOD[10:]
    )
    data = write_rows(tmp_path / "in.jsonl", rows)
    out = tmp_path / "run"
    report = run_forge(out, *SMALL, f"input.path={data}")
    assert report["balanced"], report["imbalance"]
    assert report["items"] == {
        "received": 35,
        "completed": 30,
        "failed": 4,
        "skipped": 1,
        "unfinished": 0,
        "resumed": 0,
    }
    reasons = [f["reason"] for f in report["failures"]]
    assert any(r.startswith("line 11: invalid JSON") for r in reasons)
    assert any("no 'text' field" in r for r in reasons)
    assert any("empty or non-string 'text'" in r for r in reasons)
    assert "line 11" in {f["id"] for f in report["failures"]}
    assert len((out / "failures.jsonl").read_text().splitlines()) == 4
    assert any("too_long" in reason for reason in report["skipped_reasons"])
    assert report["tokens"]["skipped"] > 3000


def test_truncate_and_error_policies(tmp_path):
    data = write_rows(tmp_path / "in.jsonl", GOOD[:5] + [{"text": "word " * 3000, "id": "huge"}])
    report = plan_forge(*SMALL, f"input.path={data}", "too_long=truncate")
    assert report["balanced"] and report["items"]["completed"] == 6
    assert report["tokens"]["truncated"] > 0
    report = plan_forge(*SMALL, f"input.path={data}", "too_long=error")  # the item fails; the run goes on
    assert report["balanced"] and report["items"]["completed"] == 5 and report["items"]["failed"] == 1
    assert re.search(
        r"item 'huge' has \d+ tokens, over every device's max_seq_len \(1024\)", report["failures"][0]["reason"]
    )
    with pytest.raises(ForgeError, match="item 'huge' has .*fail_fast=true"):
        plan_forge(*SMALL, f"input.path={data}", "too_long=error", "fail_fast=true")


def test_budget_max_tokens_skips_the_rest(tmp_path):
    report = plan_forge(*SMALL, "input.limit=100", "budget.max_tokens=2000")
    assert report["balanced"]
    assert 0 < report["items"]["completed"] < 100
    assert report["items"]["skipped"] == 100 - report["items"]["completed"]
    assert report["tokens"]["completed"] >= 2000
    assert any("budget.max_tokens" in r for r in report["skipped_reasons"])


def test_budget_max_tokens_holds_across_a_resume(tmp_path):
    """The budget is the run's: a resume with the same settings counts what the first session took
    and skips the rows it skipped, in order, instead of spending the budget again."""
    args = (*SMALL, "input.limit=40", "budget.max_tokens=2000", "layers=[1]")
    first = run_forge(tmp_path, *args)
    assert 0 < first["items"]["completed"] < 40 and first["items"]["skipped"] > 0
    again = run_forge(tmp_path, *args, "resume=true")
    assert again["balanced"] and again["items"]["resumed"] == first["items"]["completed"]
    assert [again["items"][k] for k in ("completed", "skipped")] == [
        first["items"][k] for k in ("completed", "skipped")
    ]
    assert again["tokens"]["completed"] == first["tokens"]["completed"]
    # the rate is this session's own: it completed nothing (earlier sessions' tokens are resumed)
    assert first["useful_tokens_per_s"] > 0 and again["useful_tokens_per_s"] == 0


def test_a_failing_item_is_isolated_and_recorded(tmp_path, monkeypatch):
    from forge.runtime.forward.causal_lm import CausalLMRunner

    real = CausalLMRunner.forward_tokens  # what every function's worker runs a batch through

    def flaky(self, batch):
        if any(it.index == 7 for it in batch.items):  # the eighth row
            raise RuntimeError("simulated device fault")
        return real(self, batch)

    monkeypatch.setattr(CausalLMRunner, "forward_tokens", flaky)
    report = run_forge(tmp_path, *SMALL, "input.limit=40", "runtime.executor=inprocess")
    assert report["balanced"], report["imbalance"]
    assert report["items"]["failed"] == 1 and report["items"]["completed"] == 39
    assert report["failures"][0]["id"] == json.loads(open(_dataset()).readlines()[7])["id"]
    assert "simulated device fault" in report["failures"][0]["reason"]
    # halves isolate it: every failed attempt held row 7, and each is in the retry reasons
    assert report["tokens"]["retried"] > 0
    assert sum(report["retry_reasons"].values()) >= 1
    assert all("simulated device fault" in r for r in report["retry_reasons"])


def test_missing_and_empty_inputs_fail_clearly(tmp_path):
    with pytest.raises(ForgeError, match="no such file"):
        plan_forge(f"input.path={tmp_path / 'nope.jsonl'}")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ForgeError, match="is empty"):
        plan_forge(f"input.path={tmp_path / 'empty.jsonl'}")


def test_parquet_input(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(GOOD), tmp_path / "in.parquet")
    report = plan_forge(f"input.path={tmp_path / 'in.parquet'}")
    assert report["items"]["completed"] == 30 and report["balanced"]


def _dataset():
    from forge.functions.assets import embedded_dataset_path

    return embedded_dataset_path()


def test_an_item_with_nothing_after_its_prefix_fails_alone(pm):
    from forge.core.admission import AdmissionRules, admit
    from forge.vocab.geometry import Device, Item, Limits
    from forge.vocab.records import RunContext

    run = RunContext("probe_gen", "token", [Device("cpu", Limits(2048, 64, 1024))], None)
    pm.hook.forge_run_start(run=run)
    items = [Item("ok", 7, "p", 4), Item("bare", 4, "p", 4), Item("ok2", 6, "p", 4)]
    admitted = list(admit(items, run=run, hook=pm.hook, rules=AdmissionRules(max_seq_len=1024)))
    assert [it.id for it in admitted] == ["ok", "ok2"]
    report, batch = {}, _batch_of(admitted)
    pm.hook.forge_batch_routed(run=run, batch=batch, device=run.devices[0])
    pm.hook.forge_batch_completed(run=run, batch=batch, device=run.devices[0], stats=_stats())
    pm.hook.forge_run_end(run=run, report=report)
    assert report["items"] == {"received": 3, "completed": 2, "failed": 1, "skipped": 0, "unfinished": 0, "resumed": 0}
    assert "needs at least one token of its own" in report["failures"][0]["reason"]
    assert report["balanced"], report["imbalance"]


def _batch_of(items):
    from forge.vocab.geometry import Batch

    return Batch(rows=[[it] for it in items], padded_len=8)


def _stats():
    from forge.vocab.records import BatchStats

    return BatchStats(0.0, 0, 0, 16)


# -- bad input counts toward max_failure_share; skipped and failed ids are listed -------------


def test_an_input_of_only_bad_rows_stops_the_run_with_its_reason(tmp_path):
    data = write_rows(tmp_path / "in.jsonl", ['{"text": "broken'] * 5)
    report = run_forge(tmp_path / "run", *SMALL, f"input.path={data}")
    assert report["status"] == "stopped" and report["balanced"], report["imbalance"]
    assert report["items"]["failed"] == report["items"]["received"] == 5
    assert report["error"].startswith(
        "stopped: 5 of the last 5 input records failed with: invalid JSON (e.g. line 1: invalid JSON ("
    )
    assert report["error"].endswith("; fix the input, or raise runtime.max_failure_share")


def test_a_long_bad_input_stops_while_it_is_read(tmp_path):
    data = write_rows(tmp_path / "in.jsonl", GOOD[:3] + [{"id": i, "label": 1} for i in range(3000)])
    report = plan_forge(*SMALL, f"input.path={data}")
    assert report["status"] == "stopped" and report["balanced"], report["imbalance"]
    assert report["items"]["received"] < 3003  # it stopped reading
    assert "of the last 200 input records failed with: has no 'text' field" in report["error"]


def test_bad_rows_below_the_share_do_not_stop_the_run(tmp_path):
    rows = [row if i % 3 else '{"text": "broken' for i, row in enumerate(GOOD * 10)]  # a third bad, read ahead
    report = plan_forge(*SMALL, f"input.path={write_rows(tmp_path / 'in.jsonl', rows)}")
    assert report["status"] == "finished" and report["balanced"]
    assert report["items"]["failed"] == 100 and report["items"]["completed"] == 200


def test_fail_fast_stops_at_the_first_bad_row(tmp_path):
    data = write_rows(tmp_path / "in.jsonl", GOOD[:3] + ['{"text": "broken'])
    with pytest.raises(ForgeError, match="line 4: invalid JSON .*fail_fast=true stops at the first bad record"):
        plan_forge(*SMALL, f"input.path={data}", "fail_fast=true")


def test_skipped_ids_are_listed_with_their_line_and_reason(tmp_path):
    rows = [
        {"id": 1, "text": "one"},
        {"id": "1", "text": "one again"},
        {"text": "word " * 3000, "id": "huge"},
        '{"text": "broken',
    ] + GOOD[:5]
    out = tmp_path / "run"
    report = run_forge(
        out, *SMALL, f"input.path={write_rows(tmp_path / 'in.jsonl', rows)}", "input.duplicate_ids=first"
    )
    assert report["status"] == "finished" and report["balanced"], report["imbalance"]
    assert report["items"] == {"received": 9, "completed": 6, "failed": 1, "skipped": 2, "unfinished": 0, "resumed": 0}
    assert report["skipped_reasons"] == {
        "duplicate id (input.duplicate_ids=first)": 1,
        "too_long (> max_seq_len=1024)": 1,
    }
    skipped = [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]
    assert skipped == [
        {
            "id": "1",
            "line": 2,
            "reason": "line 2 (id '1'): id '1' is also at line 1; input.duplicate_ids=first keeps line 1",
        },
        {"id": "huge", "reason": "too_long (> max_seq_len=1024)"},
    ]
    failures = [json.loads(line) for line in (out / "failures.jsonl").read_text().splitlines()]
    assert [f["id"] for f in failures] == ["line 4"]


def test_resume_keeps_the_same_rows_of_repeated_ids_and_refuses_another_policy(tmp_path):
    rows = [{"id": "a", "text": "first a"}, {"id": "b", "text": "b"}, {"id": "a", "text": "second a"}] + GOOD[:5]
    data = write_rows(tmp_path / "in.jsonl", rows)
    out = tmp_path / "run"
    first = run_forge(out, *SMALL, f"input.path={data}", "input.duplicate_ids=last", "layers=[1]")
    assert first["status"] == "finished" and first["items"]["completed"] == 7 and first["items"]["skipped"] == 1
    again = run_forge(out, *SMALL, f"input.path={data}", "input.duplicate_ids=last", "layers=[1]", "resume=true")
    assert again["balanced"] and again["items"]["resumed"] == 7 and again["items"]["skipped"] == 1

    from forge import load_activations

    ids, _, _ = load_activations(out)
    assert sorted(ids) == sorted(["a", "b", *(f"#{i}" for i in range(3, 8))])
    with pytest.raises(ForgeError, match="resume refused: input.duplicate_ids"):
        run_forge(out, *SMALL, f"input.path={data}", "input.duplicate_ids=first", "layers=[1]", "resume=true")
