"""Bad input fails per row, with its reason; a bad Parquet schema fails before any work."""

import json
import random

import pytest

from forge.errors import ForgeError
from forge.geometry import Item
from forge.inputs import read_rows
from forge.run import Rejected

N = 5000


def probe_gen(path, **input_options):
    from forge.functions.probe_gen import ProbeGen

    return ProbeGen(model={"name": "embedded:tiny-llama"}, input={"path": str(path), **input_options}, layers=[1])


# each kind of corruption: (the line's bytes, a phrase its reason must hold)
CORRUPT = [
    (b'{"text": "broken', "invalid JSON"),
    (b'{"text": "caf\xe9 au lait", "id": "x"}', "invalid UTF-8 (byte 0xe9 at column 14)"),
    (b'{"text": "ok \xff\xfe"}', "invalid UTF-8 (byte 0xff at column 14)"),
    (b'\xc3(', "invalid UTF-8 (byte 0xc3 at column 1)"),
    (b'["a", "list"]', "expected a JSON object, got list"),
    (b'"just a string"', "expected a JSON object, got str"),
    (b'{"label": 1}', "no 'text' field"),
    (b'{"text": null}', "no 'text' field"),
    (b'{"text": ""}', "empty or non-string 'text'"),
    (b'{"text": "   \\t "}', "empty or non-string 'text'"),
    (b'{"text": 5}', "empty or non-string 'text' (int 5)"),
    (b'{"text": ["a"]}', "empty or non-string 'text' (list"),
    (b'{"text": "fine", "prefix": 3}', "'prefix' must be a string, got int 3"),
    (b'{"text": "fine", "prefix": {"a": 1}}', "'prefix' must be a string, got dict"),
    (b'{"text": "fine", "id": [1, 2]}', "'id' must be a string or an integer, got list"),
    (b'{"text": "fine", "id": {"k": "v"}}', "'id' must be a string or an integer, got dict"),
    (b'{"text": "fine", "id": 1.5}', "'id' must be a string or an integer, got float"),
    (b'{"text": "fine", "id": true}', "'id' must be a string or an integer, got bool"),
    (b'{"text": "half \\ud800 a pair"}', "'text' holds an unpaired surrogate (\\ud800 at position 5)"),
]


def test_one_percent_corrupted_rows_each_become_a_rejected_with_its_reason(tmp_path):
    rng = random.Random(7)
    bad_rows = set(rng.sample(range(N), N // 100))
    want: dict[int, str] = {}  # row index -> phrase of its reason
    lines = []
    for i in range(N):
        if i in bad_rows:
            line, phrase = CORRUPT[len(want) % len(CORRUPT)]
            want[i] = phrase
        else:
            row = {"text": f"Statement {i} is true.", "id": f"r{i}", "label": i % 2}
            if i % 3:
                row["prefix"] = "Answer True or False.\n"
            if i % 7 == 0:
                row["id"] = i  # integer ids are fine
            line = json.dumps(row).encode()
        lines.append(line)
        if i % 1000 == 999:
            lines.append(b"   ")  # blank lines are not rows
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    assert len(want) == 50

    rows = list(read_rows(path))  # never raises for a bad row
    assert [i for i, _ in rows] == list(range(N))
    strings = {i: r for i, r in rows if isinstance(r, str)}
    assert set(strings) == {i for i, p in want.items() if p.startswith(("invalid", "expected a JSON"))}
    assert all(r.startswith("line ") and ";" in r for r in strings.values())

    records = list(probe_gen(path).records())
    rejected = [r for r in records if isinstance(r, Rejected)]
    items = [r for r in records if isinstance(r, Item)]
    assert len(rejected) == len(want) and len(items) == N - len(want)
    assert len({r.record_id for r in rejected}) == len(rejected)
    by_row = {}
    for r in rejected:
        head = r.reason.split(":", 1)[0].split(" (", 1)[0]  # "line N" or "row N"
        kind, number = head.split()
        # line numbers count from 1 and include the blank lines; row indices from 0
        row = int(number) - 1 - (int(number) - 1) // 1001 if kind == "line" else int(number)
        by_row[row] = r.reason
        assert "\n" not in r.reason
    assert set(by_row) == set(want)
    for row, phrase in want.items():
        assert phrase in by_row[row], (row, by_row[row])
    good_ids = {str(i) if i % 7 == 0 else f"r{i}" for i in range(N) if i not in want}
    assert {it.id for it in items} == good_ids
    assert all(it.num_tokens > it.prefix_len for it in items)


def test_bom_and_crlf_lines_are_fine(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "first"}\r\n{"text": "second"}\r\n')
    assert [row for _, row in read_rows(path)] == [{"text": "first"}, {"text": "second"}]


def _parquet(path, **columns):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return path


@pytest.mark.parametrize("columns,message", [
    ({"statement": ["a", "b"]}, r"no 'text' column \(columns: statement\); add a string column 'text'"),
    ({"text": [1, 2]}, r"column 'text' is int64; it must be string"),
    ({"text": ["a", "b"], "prefix": [1.0, 2.0]}, r"column 'prefix' is double; it must be string"),
    ({"text": ["a", "b"], "id": [0.5, 1.5]}, r"column 'id' is double; it must be string or integer"),
])
def test_a_bad_parquet_schema_is_one_line_before_any_work(tmp_path, columns, message):
    path = _parquet(tmp_path / "in.parquet", **columns)
    with pytest.raises(ForgeError, match=message) as info:
        probe_gen(path)  # the constructor: before a single row is read
    assert "\n" not in str(info.value) and str(info.value).startswith(f"input.path={path}: ")


def test_a_good_parquet_schema_reads_rows_and_checks_each(tmp_path):
    import pyarrow as pa

    path = _parquet(tmp_path / "in.parquet", text=pa.array(["one", "", None, "four"]).dictionary_encode(),
                    id=[10, 11, 12, 13], prefix=pa.array([None] * 4, pa.null()))
    records = list(probe_gen(path).records())
    assert [r.id for r in records if isinstance(r, Item)] == ["10", "13"]
    rejected = {r.record_id: r.reason for r in records if isinstance(r, Rejected)}
    assert set(rejected) == {"11", "12"}
    assert "empty or non-string 'text'" in rejected["11"] and "no 'text' field" in rejected["12"]


def test_a_file_that_is_not_parquet_is_one_line(tmp_path):
    path = tmp_path / "in.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(ForgeError, match="not a readable Parquet file") as info:
        probe_gen(path)
    assert "\n" not in str(info.value)
