"""surprisal equals an independent one-row-at-a-time `transformers` computation, in every mode.

The reference here shares nothing with Forge but the embedded model's files: each row is
tokenized with `AutoTokenizer` (prefix with special tokens, text without), run alone through
`AutoModelForCausalLM`, and its text tokens scored with float32 log_softmax over the full logits.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from forge.errors import ForgeError  # noqa: E402
from forge.testing import check_modes, run_function  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py
TOL = 1e-4
LIMITS = [
    "devices=auto",
    "devices.limits.max_batch_tokens=1024",
    "devices.limits.max_seq_len=512",
    "budget.tokens_per_step=1024",
]


def _rows() -> list[dict]:
    """Held-out few-shot rows (the last of the embedded statements): three prefixes, and rows without one."""
    from forge.functions.assets import embedded_dataset_path

    rows = [json.loads(line) for line in open(embedded_dataset_path())]
    prefixes = sorted({r["prefix"] for r in rows if r.get("prefix")}, key=len)[:3]
    held_out = [r for r in rows[-400:] if r.get("prefix") in prefixes][:21]
    plain = [{"id": r["id"], "text": r["text"]} for r in rows[-400:] if not r.get("prefix")][:3]
    return [{"id": r["id"], "text": r["text"], "prefix": r["prefix"]} for r in held_out] + plain


def _reference(rows):
    """{id: (sum_nll, num_tokens)}, one row at a time, float32."""
    from forge.functions.assets import embedded_model_source, materialize_model

    source = embedded_model_source()
    tok = transformers.AutoTokenizer.from_pretrained(str(source))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(materialize_model(source)), dtype=torch.float32
    ).eval()
    out = {}
    for row in rows:
        if row.get("prefix"):
            prefix = tok(row["prefix"])["input_ids"]
            ids = prefix + tok(row["text"], add_special_tokens=False)["input_ids"]
            first = len(prefix)
        else:
            ids, first = tok(row["text"])["input_ids"], 1
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        scored = [-logp[p - 1, ids[p]].item() for p in range(first, len(ids))]
        out[row["id"]] = (float(np.sum(np.asarray(scored, np.float64))), len(scored))
    return out


@pytest.mark.slow
def test_surprisal_equals_transformers_one_row_at_a_time_in_every_mode(tmp_path):
    rows = _rows()
    assert sum(1 for r in rows if r.get("prefix")) >= 20 and len({r.get("prefix") for r in rows}) == 4
    want = _reference(rows)
    check = check_modes("surprisal", rows, tmp_path, tol=TOL, limits=LIMITS)
    assert not check.refused and set(check.results) == {
        "item",
        "token-cache",
        "token-nocache",
        "token-packed",
        "memory",
        "token-merged",
    }
    for mode, res in [("one-at-a-time", check.reference), *check.results.items()]:
        assert res.ids == [r["id"] for r in rows], mode
        for k, rid in enumerate(res.ids):
            sum_nll, n = want[rid]
            assert res.columns["num_tokens"][k] == n, (mode, rid)
            assert abs(res.columns["sum_nll"][k] - sum_nll) < TOL * max(1.0, n), (mode, rid)
            assert abs(res.columns["mean_nll"][k] - sum_nll / n) < TOL, (mode, rid)


def test_output_is_parquet_with_id_and_three_fields(tmp_path):
    import pyarrow.parquet as pq

    rows = _rows()[:6]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = run_function("surprisal", tmp_path / "rows.jsonl", tmp_path / "run", LIMITS)
    assert report["items"]["completed"] == 6
    shards = sorted((tmp_path / "run" / "surprisal").glob("*.parquet"))
    table = pq.read_table(shards[0])
    assert table.column_names == ["id", "index", "mean_nll", "sum_nll", "num_tokens"]
    assert [str(table.schema.field(n).type) for n in ("mean_nll", "sum_nll", "num_tokens")] == [
        "double",
        "double",
        "int64",
    ]


def test_truncation_is_refused_before_work(tmp_path):
    (tmp_path / "rows.jsonl").write_text('{"text": "a b c"}\n')
    with pytest.raises(ForgeError, match="too_long=truncate cuts items from the right"):
        run_function("surprisal", tmp_path / "rows.jsonl", tmp_path / "run", ["too_long=truncate"])
