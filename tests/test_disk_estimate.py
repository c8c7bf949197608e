"""The disk check counts what a row can actually write: a row that admission will skip as too
long counts nothing, so one hostile row cannot make the whole run refuse."""

from __future__ import annotations

import json

import pytest
import torch

from forge.testing import run_function

LIMITS = ["devices=auto", "devices.limits.max_seq_len=256", "max_new_tokens=2", "layers=[]"]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_one_row_asking_for_a_trillion_tokens_is_skipped_not_a_refusal_of_the_run(tmp_path):
    rows = [{"id": f"r{k}", "prompt": f"Statement number {k} is"} for k in range(4)]
    rows.append({"id": "hostile", "prompt": "Tell me everything", "max_new_tokens": 10**12})
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = run_function("generate", path, tmp_path / "run", LIMITS)
    assert report["status"] == "finished" and report["balanced"], report.get("error")
    assert report["items"]["completed"] == 4 and report["items"]["skipped"] == 1
    skipped = [json.loads(line) for line in (tmp_path / "run" / "skipped.jsonl").read_text().splitlines()]
    assert [r["id"] for r in skipped] == ["hostile"] and "too_long" in skipped[0]["reason"]
