"""class_means: a dataset-level result, exact in every batching mode and exactly once across
kill -9 and resume.

The reference shares nothing with Forge but the embedded model's files: each row is tokenized
with `AutoTokenizer` (prefix with special tokens, text without), run alone through
`AutoModelForCausalLM`, and its last token's hidden state at the layer averaged per label.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from forge.io.results import aggregate  # noqa: E402
from forge.testing import MODES, run_function  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py
TOL = 1e-4
LAYER = 2
LIMITS = [
    "devices=auto",
    "devices.limits.max_batch_tokens=1024",
    "devices.limits.max_seq_len=512",
    "budget.tokens_per_step=1024",
    f"layer={LAYER}",
]


def _rows(n: int = 24) -> list[dict]:
    """Embedded rows with labels 0/1, three prefixes, and some rows without one."""
    from forge.functions.assets import embedded_dataset_path

    rows = [json.loads(line) for line in open(embedded_dataset_path())][-300:]
    prefixes = sorted({r["prefix"] for r in rows if r.get("prefix")}, key=len)[:3]
    out = [r for r in rows if r.get("prefix") in prefixes][: n - 4]
    out += [{k: v for k, v in r.items() if k != "prefix"} for r in rows if not r.get("prefix")][:4]
    assert {r["label"] for r in out} == {0, 1}
    return out


def _reference(rows) -> dict:
    from forge.functions.assets import embedded_model_source, materialize_model

    source = embedded_model_source()
    tok = transformers.AutoTokenizer.from_pretrained(str(source))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(materialize_model(source)), dtype=torch.float32)
    states: dict = {}
    for row in rows:
        if row.get("prefix"):
            ids = tok(row["prefix"])["input_ids"] + tok(row["text"], add_special_tokens=False)["input_ids"]
        else:
            ids = tok(row["text"])["input_ids"]
        with torch.no_grad():
            out = model.eval()(input_ids=torch.tensor([ids]), output_hidden_states=True)
        states.setdefault(row["label"], []).append(out.hidden_states[LAYER][0, -1].double().numpy())
    return {label: (np.mean(v, axis=0), len(v)) for label, v in states.items()}


def _check(result: dict, want: dict) -> None:
    assert set(result["mean"]) == set(want) == {0, 1}
    for label, (mean, count) in want.items():
        assert result["count"][label] == count
        assert np.abs(result["mean"][label] - mean).max() < TOL, label
    assert np.abs(result["direction"] - (want[1][0] - want[0][0])).max() < TOL


@pytest.mark.slow
def test_class_means_equals_one_row_at_a_time_in_every_mode(tmp_path):
    rows = _rows()
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    want = _reference(rows)
    for mode, options in MODES.items():
        report = run_function("class_means", tmp_path / "rows.jsonl", tmp_path / mode, [*LIMITS, *options])
        assert report["items"]["completed"] == len(rows) and report["balanced"], mode
        _check(aggregate(tmp_path / mode), want)


@pytest.mark.slow
def test_class_means_in_one_mode(tmp_path):
    rows = _rows(12)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = run_function("class_means", tmp_path / "rows.jsonl", tmp_path / "run", [*LIMITS, "shard_size=5"])
    assert report["items"]["completed"] == 12
    _check(aggregate(tmp_path / "run"), _reference(rows))
    from forge.io.results import load

    assert load(tmp_path / "run").ids == [r["id"] for r in rows]  # every item journaled, no per-item values


@pytest.mark.slow
def test_a_row_without_a_label_is_a_recorded_failure_never_a_class_of_its_own(tmp_path):
    rows = _rows(12)
    unlabelled = [{k: v for k, v in r.items() if k != "label"} | {"id": f"nolabel-{k}"} for k, r in enumerate(rows[:3])]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [*rows, *unlabelled]))
    report = run_function("class_means", path, tmp_path / "run", LIMITS)
    assert report["items"]["completed"] == 12 and report["items"]["failed"] == 3 and report["balanced"]
    failures = [json.loads(line) for line in (tmp_path / "run" / "failures.jsonl").read_text().splitlines()]
    assert sorted(f["id"] for f in failures) == ["nolabel-0", "nolabel-1", "nolabel-2"]
    assert all("has no 'label' field" in f["reason"] for f in failures)
    _check(aggregate(tmp_path / "run"), _reference(rows))  # two classes, and the direction between them


@pytest.mark.slow
def test_class_means_after_kill9_and_resume_equals_a_clean_run(tmp_path, faults):
    from test_aggregate import forge_run_killed

    from conftest import run_forge, small_run

    args = [*small_run(40, "batching.merge_groups=false"), "function=class_means", "runtime.executor=process"]
    args = [a for a in args if not a.startswith("layers=")] + ["shard_size=8", f"layer={LAYER}"]
    clean = run_forge(tmp_path / "clean", *args)
    assert clean["items"]["completed"] == 40
    committed = forge_run_killed(tmp_path / "killed", *args, faults=faults)
    assert 0 < committed < 40
    report = run_forge(tmp_path / "killed", *args, "resume=true")
    assert report["items"]["resumed"] == committed and report["items"]["completed"] == 40
    got, want = aggregate(tmp_path / "killed"), aggregate(tmp_path / "clean")
    assert got["count"] == want["count"] and sum(got["count"].values()) == 40
    for label in want["mean"]:
        assert np.abs(got["mean"][label] - want["mean"][label]).max() < 1e-12
    assert np.abs(got["direction"] - want["direction"]).max() < 1e-12
