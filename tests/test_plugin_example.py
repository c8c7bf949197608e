"""The third-party plugin package in examples/forge-plugin-example: once installed, `forge run
function=token_norms batching=sorted` runs and `forge ls` lists both (CI installs it)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import plan_forge

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("forge_plugin_example") is None,
        reason="examples/forge-plugin-example is not installed "
        "(pip install -e examples/forge-plugin-example; .ci/run does)",
    ),
    pytest.mark.usefixtures("one_torch_thread"),  # tests/conftest.py
]
N = 120


def _forge(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "forge.cli.app", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=600
    )


LAYER = 4


@pytest.mark.slow
def test_forge_run_their_function_with_their_mode(tmp_path):
    out = tmp_path / "run"
    result = _forge(
        "run",
        "function=token_norms",
        "batching=sorted",
        "batching.batch_size=16",
        f"input.limit={N}",
        "devices=cpu",
        "runtime.executor=inprocess",
        f"output_dir={out}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["function"] == "token_norms" and report["batching"] == "sorted"
    assert report["balanced"], report.get("imbalance")
    assert report["items"]["completed"] == N and report["batches"] == -(-N // 16)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from forge.functions.assets import embedded_dataset_path, embedded_model_source, materialize_model
    from forge.io.results import load

    res = load(out)
    rows = [json.loads(line) for line in open(embedded_dataset_path())][:N]
    assert res.ids == [r["id"] for r in rows]  # input order, whatever order batches ran in
    # the same numbers computed directly: each row alone through transformers, its text's tokens
    source = embedded_model_source()
    tok = AutoTokenizer.from_pretrained(str(source))
    model = AutoModelForCausalLM.from_pretrained(str(materialize_model(source))).eval()
    for k, row in enumerate(rows[:40]):
        prefix = tok(row["prefix"])["input_ids"] if row.get("prefix") else []
        ids = prefix + tok(row["text"], add_special_tokens=not prefix)["input_ids"]
        with torch.no_grad():
            hidden = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[LAYER][0]
        norms = hidden[len(prefix) :].norm(dim=-1).numpy()
        assert res.columns["num_tokens"][k] == len(norms)
        assert np.abs(res.columns["norms"][k] - norms).max() < 1e-4
        assert abs(res.columns["mean_norm"][k] - norms.mean()) < 1e-4
        assert abs(res.columns["max_norm"][k] - norms.max()) < 1e-4


@pytest.mark.slow
def test_their_function_is_exact_in_every_mode(tmp_path):
    """forge.testing: every batching mode (prefix cache on and off, packed) equals one item at a time."""
    from forge.functions.assets import embedded_dataset_path
    from forge.testing import check_modes

    rows = [json.loads(line) for line in open(embedded_dataset_path())]
    short = sorted({r["prefix"] for r in rows if r.get("prefix")}, key=len)[:2]
    rows = [r for r in rows if r.get("prefix") in short][:16] + [r for r in rows if not r.get("prefix")][:2]
    check = check_modes(
        "token_norms",
        rows,
        tmp_path,
        tol=1e-4,
        limits=[
            "devices=auto",
            "devices.limits.max_batch_tokens=512",
            "devices.limits.max_seq_len=256",
            "budget.tokens_per_step=512",
        ],
    )
    assert set(check.results) == {"item", "token-cache", "token-nocache", "token-packed", "memory", "token-merged"}
    # it uses the prefix cache: in token mode the rows sharing a prefix take it from the cache
    from forge.testing import run_function

    report = run_function(
        "token_norms", tmp_path / "rows.jsonl", tmp_path / "cached", ["batching=token", "batching.merge_groups=false"]
    )
    assert report["tokens"]["cache_hit"] > 0 and report["items"]["completed"] == len(rows)


def test_their_function_imports_only_the_public_api():
    import ast

    import forge_plugin_example.token_norms as module

    allowed = {"forge", "forge.api"}
    for node in ast.walk(ast.parse(Path(module.__file__).read_text())):
        names = (
            [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else [node.module]
            if isinstance(node, ast.ImportFrom)
            else []
        )
        for name in names:
            assert not name.startswith("forge") or name in allowed, f"token_norms imports {name}"
    source = Path(module.__file__).read_text()
    assert "forge.functions" not in source and "forge.runtime" not in source


@pytest.mark.slow
def test_forge_ls_lists_their_function_and_mode(tmp_path):
    result = _forge("ls", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    for word in (
        "token_norms",
        "function=token_norms",
        "forge_plugin_example",
        "sorted",
        "batching=sorted",
        "SortedPacker",
        "probe_gen",
    ):
        assert word in result.stdout, word


def test_sorted_mode_cuts_fixed_batches_shortest_first():
    report = plan_forge(
        "function=token_norms",
        "batching=sorted",
        "batching.batch_size=8",
        "input.limit=100",
        "devices=cpu",
        keep_batches=True,
    )
    batches = report.plan.kept_batches
    assert report["function"] == "token_norms" and report["balanced"]
    assert [len(b.items) for b in batches] == [8] * 12 + [4]
    lengths = [it.num_tokens for b in batches for it in b.items]
    assert lengths == sorted(lengths)  # one window: the whole input, shortest first
    longest_first = plan_forge(
        "batching=sorted", "batching.descending=true", "input.limit=100", "devices=cpu", keep_batches=True
    ).plan.kept_batches
    lengths = [it.num_tokens for b in longest_first for it in b.items]
    assert lengths == sorted(lengths, reverse=True)


@pytest.mark.slow
def test_their_tracker_logs_the_ledger_and_a_resume_appends_to_it(tmp_path):
    """trackers=[jsonl]: their tracker, selected and set as the built-in ones are; its last line
    holds report.json's totals; a resume hands it back the id it kept."""
    out = tmp_path / "run"
    args = ["run", f"input.limit={N}", "devices=cpu", "runtime.executor=inprocess", f"output_dir={out}"]
    result = _forge(*args, "trackers=[jsonl]", "trackers.jsonl.file=mine.jsonl", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["trackers"] == {"jsonl": "logged"}
    lines = [json.loads(line) for line in (out / "trackers" / "jsonl" / "mine.jsonl").read_text().splitlines()]
    assert lines[0]["params"]["trackers.jsonl.file"] == "mine.jsonl" and lines[0]["resumed"] is False
    steps = [line["step"] for line in lines[1:-1]]
    assert steps == sorted(steps) and steps[-1] == report["tokens"]["completed"]
    end = lines[-1]
    assert end["status"] == "finished"
    assert end["totals"]["items/completed"] == report["items"]["completed"] == N
    assert end["totals"]["tokens/padding"] == report["tokens"]["padding"]
    again = _forge(*args, "trackers=[jsonl]", "trackers.jsonl.file=mine.jsonl", "resume=true", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    lines = [json.loads(line) for line in (out / "trackers" / "jsonl" / "mine.jsonl").read_text().splitlines()]
    resumed = [line for line in lines if "resumed" in line]
    assert [r["resumed"] for r in resumed] == [False, True]
    assert lines[-1]["totals"]["items/resumed"] == N and lines[-1]["status"] == "finished"
