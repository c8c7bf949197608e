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
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("forge_plugin_example") is None,
    reason="examples/forge-plugin-example is not installed (pip install -e examples/forge-plugin-example; .ci/run does)")
N = 120


def _forge(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "forge.cli", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=600)


def test_forge_run_their_function_with_their_mode(tmp_path):
    out = tmp_path / "run"
    result = _forge("run", "function=token_norms", "batching=sorted", "batching.batch_size=16", f"input.limit={N}",
                    "devices=cpu", "runtime.executor=inprocess", f"output_dir={out}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["function"] == "token_norms" and report["batching"] == "sorted"
    assert report["balanced"], report.get("imbalance")
    assert report["items"]["completed"] == N and report["batches"] == -(-N // 16)

    from forge.functions.assets import embedded_dataset_path, embedded_model_source, materialize_model
    from forge.results import load
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer

    res = load(out)
    rows = [json.loads(line) for line in open(embedded_dataset_path())][:N]
    assert res.ids == [r["id"] for r in rows]  # input order, whatever order batches ran in
    # the same numbers computed directly: the embedding table, each row tokenized alone
    source = embedded_model_source()
    table = load_file(str(materialize_model(source) / "model.safetensors"))["model.embed_tokens.weight"]
    tok = AutoTokenizer.from_pretrained(str(source))
    for k, row in enumerate(rows):
        if row.get("prefix"):
            ids = tok(row["prefix"])["input_ids"] + tok(row["text"], add_special_tokens=False)["input_ids"]
        else:
            ids = tok(row["text"])["input_ids"]
        norms = np.linalg.norm(table[ids], axis=1)
        assert res.columns["num_tokens"][k] == len(ids)
        assert abs(res.columns["mean_norm"][k] - norms.mean()) < 1e-5
        assert abs(res.columns["max_norm"][k] - norms.max()) < 1e-5


def test_forge_ls_lists_their_function_and_mode(tmp_path):
    result = _forge("ls", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    for word in ("token_norms", "function=token_norms", "forge_plugin_example", "sorted", "batching=sorted",
                 "SortedPacker", "probe_gen"):
        assert word in result.stdout, word


def test_sorted_mode_cuts_fixed_batches_shortest_first():
    report = plan_forge("function=token_norms", "batching=sorted", "batching.batch_size=8", "input.limit=100",
                        "devices=cpu", keep_batches=True)
    batches = report["_batches"]
    assert report["function"] == "token_norms" and report["balanced"]
    assert [len(b.items) for b in batches] == [8] * 12 + [4]
    lengths = [it.num_tokens for b in batches for it in b.items]
    assert lengths == sorted(lengths)  # one window: the whole input, shortest first
    longest_first = plan_forge("batching=sorted", "batching.descending=true", "input.limit=100", "devices=cpu",
                               keep_batches=True)["_batches"]
    lengths = [it.num_tokens for b in longest_first for it in b.items]
    assert lengths == sorted(lengths, reverse=True)
