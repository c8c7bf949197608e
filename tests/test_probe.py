"""`forge probe`: linear probes per layer on a probe_gen run (CLI), and the fit itself."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from forge.errors import ForgeError
from forge.functions.probe import fit_probes, in_test, wilson
from tests.conftest import run_forge

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py
LAYERS = [1, 2]


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """A 60-item embedded probe_gen run (labels come from the embedded dataset)."""
    out = tmp_path_factory.mktemp("probe-run")
    report = run_forge(out, "function=probe_gen", "input.limit=60", f"layers=[{','.join(map(str, LAYERS))}]")
    assert report["balanced"] and report["items"]["completed"] == 60
    return out


@pytest.mark.slow
def test_cli_writes_json_and_png(small_run, tmp_path):
    from forge.cli.app import app

    runner = CliRunner()
    out, plot = tmp_path / "p.json", tmp_path / "p.png"
    res = runner.invoke(app, ["probe", str(small_run), "--out", str(out), "--plot", str(plot)])
    assert res.exit_code == 0, res.output
    got = json.loads(out.read_text())
    assert [r["layer"] for r in got["layers"]] == LAYERS
    assert got["items"] == got["labelled"] == 60 and sorted(got["classes"]) == [0, 1]
    for r in got["layers"]:
        assert 0 <= r["ci_low"] <= r["accuracy"] <= r["ci_high"] <= 1
        assert r["test_items"] + r["train_items"] == 60 and r["correct"] == round(r["accuracy"] * r["test_items"])
    assert 0 <= got["chance"] <= 1
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the split is a function of the ids: a second run agrees exactly
    again = tmp_path / "q.json"
    assert runner.invoke(app, ["probe", str(small_run), "--out", str(again), "--plot", str(plot)]).exit_code == 0
    assert json.loads(again.read_text())["split"] == got["split"]
    assert json.loads(again.read_text())["layers"] == got["layers"]


def test_cli_defaults_to_run_dir_and_refuses_other_dirs(small_run, tmp_path):
    from forge.cli.app import app

    runner = CliRunner()
    assert runner.invoke(app, ["probe", str(small_run)]).exit_code == 0
    assert (small_run / "probe.json").exists() and (small_run / "probe.png").exists()
    res = runner.invoke(app, ["probe", str(tmp_path)])
    assert res.exit_code == 2 and "not a probe_gen run" in res.output


def test_split_depends_on_the_id_only():
    ids = [f"s{i:05d}" for i in range(2000)]
    test = [in_test(i, 0.25) for i in ids]
    assert 0.2 < np.mean(test) < 0.3
    shuffled = list(reversed(ids))
    assert [in_test(i, 0.25) for i in shuffled] == test[::-1]


def test_separable_set_gets_high_accuracy_and_noise_does_not():
    rng = np.random.default_rng(0)
    n, d = 400, 16
    y = rng.integers(0, 2, n)
    signal = rng.normal(size=(n, d)) + np.outer(2 * y - 1, np.eye(d)[0]) * 3.0  # separable along axis 0
    noise = rng.normal(size=(n, d))
    ids = [f"x{i}" for i in range(n)]
    got = fit_probes(ids, y.tolist(), {0: noise, 1: signal})
    by_layer = {r["layer"]: r for r in got["layers"]}
    assert by_layer[1]["accuracy"] >= 0.95 and by_layer[1]["ci_low"] > 0.85
    assert by_layer[0]["ci_low"] < 0.6 < by_layer[1]["ci_low"]  # noise stays near chance


def test_wilson_interval():
    low, high = wilson(50, 100)
    assert low == pytest.approx(0.4038, abs=1e-4) and high == pytest.approx(0.5962, abs=1e-4)
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == pytest.approx(1.0)
    assert wilson(3, 10)[0] < 0.3 < wilson(3, 10)[1]


@pytest.mark.parametrize(
    "labels, message",
    [
        ([None] * 40, "no labels"),
        ([1] * 40, "one class only"),
        ([0, 1] * 3, "too few labelled items"),
    ],
)
def test_clear_errors(labels, message):
    ids = [f"i{k}" for k in range(len(labels))]
    with pytest.raises(ForgeError, match=message):
        fit_probes(ids, labels, {1: np.zeros((len(labels), 4))})
