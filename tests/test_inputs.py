"""Bad input fails per row, with its reason; a bad Parquet schema fails before any work."""

import json
import random
from pathlib import Path

import pytest

from forge.errors import ForgeError
from forge.io.inputs import read_rows
from forge.vocab.geometry import Item
from forge.vocab.records import Rejected

N = 5000


def probe_gen(path, **input_options):
    from forge.api import InputSpec, ModelSpec
    from forge.functions.probe_gen import ProbeGen, ProbeGenConfig

    return ProbeGen(
        ProbeGenConfig(
            model=ModelSpec(name="embedded:tiny-llama"), input=InputSpec(path=str(path), **input_options), layers=[1]
        )
    )


# each kind of corruption: (the line's bytes, a phrase its reason must hold)
CORRUPT = [
    (b'{"text": "broken', "invalid JSON"),
    (b'{"text": "caf\xe9 au lait", "id": "x"}', "invalid UTF-8 (byte 0xe9 at column 14)"),
    (b'{"text": "ok \xff\xfe"}', "invalid UTF-8 (byte 0xff at column 14)"),
    (b"\xc3(", "invalid UTF-8 (byte 0xc3 at column 1)"),
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


@pytest.mark.parametrize(
    "columns,message",
    [
        ({"statement": ["a", "b"]}, r"no 'text' column \(columns: statement\); add a string column 'text'"),
        ({"text": [1, 2]}, r"column 'text' is int64; it must be string"),
        ({"text": ["a", "b"], "prefix": [1.0, 2.0]}, r"column 'prefix' is double; it must be string"),
        ({"text": ["a", "b"], "id": [0.5, 1.5]}, r"column 'id' is double; it must be string or integer"),
    ],
)
def test_a_bad_parquet_schema_is_one_line_before_any_work(tmp_path, columns, message):
    path = _parquet(tmp_path / "in.parquet", **columns)
    with pytest.raises(ForgeError, match=message) as info:
        probe_gen(path)  # the constructor: before a single row is read
    assert "\n" not in str(info.value) and str(info.value).startswith(f"input.path={path}: ")


def test_a_good_parquet_schema_reads_rows_and_checks_each(tmp_path):
    import pyarrow as pa

    path = _parquet(
        tmp_path / "in.parquet",
        text=pa.array(["one", "", None, "four"]).dictionary_encode(),
        id=[10, 11, 12, 13],
        prefix=pa.array([None] * 4, pa.null()),
    )
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


# -- ids: one rule, and repeats are refused or resolved before any work ----------------------

MIXED_IDS = [{"id": 1, "text": "one"}, {"id": "1", "text": "one again"}, {"text": "no id"}, {"id": "2", "text": "two"}]


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _input(path, **options):
    from forge.io.inputs import InputFile

    return InputFile(path, {"path": str(path), **options})


def test_an_integer_and_a_string_of_the_same_text_are_one_id_and_repeats_are_refused_in_one_line(tmp_path):
    path = _write(tmp_path / "in.jsonl", MIXED_IDS)
    with pytest.raises(ForgeError) as info:
        probe_gen(path)  # the constructor: before any work
    assert str(info.value) == (
        f"input.path={path}: 1 id repeats, e.g. '1' at lines 1 and 2; make ids unique, or set "
        "input.duplicate_ids=first or input.duplicate_ids=last to keep one row of each"
    )


@pytest.mark.parametrize("policy,kept_line,dropped_line", [("first", 1, 2), ("last", 2, 1)])
def test_first_and_last_keep_one_row_of_each_id_and_skip_the_others_with_their_line(
    tmp_path, policy, kept_line, dropped_line
):
    from forge.vocab.records import Skipped

    path = _write(tmp_path / "in.jsonl", MIXED_IDS)
    records = list(probe_gen(path, duplicate_ids=policy).records())
    items = [r for r in records if isinstance(r, Item)]
    skipped = [r for r in records if isinstance(r, Skipped)]
    # a row without an id is '#<row index>': it can never collide with an explicit id
    assert sorted(it.id for it in items) == ["#2", "1", "2"]
    assert next(it for it in items if it.id == "1").index == kept_line - 1
    assert len(skipped) == 1 and skipped[0].record_id == "1" and skipped[0].line == dropped_line
    assert skipped[0].reason == (
        f"line {dropped_line} (id '1'): id '1' is also at line {kept_line}; "
        f"input.duplicate_ids={policy} keeps line {kept_line}"
    )


def test_an_explicit_id_in_the_form_of_a_missing_one_is_rejected(tmp_path):
    path = _write(tmp_path / "in.jsonl", [{"text": "a"}, {"id": "#0", "text": "b"}, {"id": "#x", "text": "c"}])
    records = list(probe_gen(path).records())
    assert [r.id for r in records if isinstance(r, Item)] == ["#0", "#x"]
    rejected = [r for r in records if isinstance(r, Rejected)]
    assert len(rejected) == 1 and rejected[0].record_id == "line 2"
    assert "reserved for rows without an id" in rejected[0].reason


def test_a_hash_collision_is_not_a_repeat(tmp_path, monkeypatch):
    import builtins

    import forge.io.inputs

    monkeypatch.setattr(forge.io.inputs, "hash", lambda value: 7, raising=False)  # every id hashes alike
    assert forge.io.inputs.hash is not builtins.hash
    path = _write(tmp_path / "in.jsonl", [{"id": f"r{i}", "text": "t"} for i in range(50)])
    assert sum(1 for r in _input(path).rows()) == 50  # no refusal: the strings differ


def test_the_id_scan_honours_the_limit(tmp_path):
    path = _write(tmp_path / "in.jsonl", [{"id": "a", "text": "1"}, {"id": "b", "text": "2"}, {"id": "a", "text": "3"}])
    assert len(list(_input(path, limit=2).rows())) == 2  # the repeat lies past the limit
    with pytest.raises(ForgeError, match="ids? repeats?"):
        _input(path)


def test_parquet_ids_follow_the_same_rule(tmp_path):
    import pyarrow as pa

    path = _parquet(tmp_path / "in.parquet", text=["a", "b", "c"], id=pa.array([1, None, 1]))
    with pytest.raises(ForgeError, match=r"e\.g\. '1' at rows 0 and 2"):
        probe_gen(path)
    from forge.vocab.records import Skipped

    records = list(probe_gen(path, duplicate_ids="last").records())
    assert [r.id for r in records if isinstance(r, Item)] == ["#1", "1"]
    assert [r.reason for r in records if isinstance(r, Skipped)] == [
        "row 0 (id '1'): id '1' is also at row 2; input.duplicate_ids=last keeps row 2"
    ]


def test_the_duplicate_policy_and_the_row_cap_decide_results_so_they_are_in_the_fingerprint(tmp_path):
    path = _write(tmp_path / "in.jsonl", [{"text": "a"}])
    fp = probe_gen(path).fingerprint()["input"]
    assert fp["duplicate_ids"] == "error" and fp["max_row_bytes"] == 1 << 20
    assert probe_gen(path, duplicate_ids="first").fingerprint()["input"]["duplicate_ids"] == "first"


@pytest.mark.parametrize(
    "override,message",
    [
        ("input.duplicate_ids=second", r"config input\.duplicate_ids='second': choose one of: error, first, last"),
        ("input.max_row_bytes=0", r"config input\.max_row_bytes=0: must be a positive integer"),
        ("input.max_row_bytes=null", r"config input\.max_row_bytes=null: expected an integer"),
    ],
)
def test_bad_input_settings_are_one_line(override, message):
    from conftest import spec_for

    with pytest.raises(ForgeError, match=message):
        spec_for(override)


def test_every_function_yaml_takes_its_input_defaults_from_the_schema():
    """InputSpec is the one home of the `input` defaults: a function YAML extends it and sets
    only the path, and every key can still be overridden without '+'."""
    import dataclasses

    import yaml

    from conftest import compose
    from forge.cli.build import conf_dir, to_plain
    from forge.io.inputs import InputSpec

    defaults = {
        f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        for f in dataclasses.fields(InputSpec)
        if f.name != "path"
    }
    example = Path(__file__).resolve().parent.parent / "examples" / "forge-plugin-example" / "forge_plugin_example"
    paths = sorted((conf_dir() / "function").glob("*.yaml")) + sorted((example / "conf" / "function").glob("*.yaml"))
    assert {p.stem for p in paths} >= {"probe_gen", "score", "embed", "surprisal", "token_norms"}
    for path in paths:
        data = yaml.safe_load(path.read_text())
        assert "/schema_input@input" in data["defaults"] and set(data["input"]) == {"path"}, path.name
    for name in ("probe_gen", "score", "embed", "surprisal"):
        got = to_plain(compose(f"function={name}"))["input"]
        assert {k: got[k] for k in defaults} == defaults, name
    got = to_plain(compose("input.duplicate_ids=last", "input.max_row_bytes=64", "input.limit=3"))["input"]
    assert (got["duplicate_ids"], got["max_row_bytes"], got["limit"]) == ("last", 64, 3)


# -- nothing in a row raises out of the reader ---------------------------------------------


def test_a_deeply_nested_row_is_its_own_failure(tmp_path):
    deep = '{"text": "t", "x": ' + "[" * 1000 + "]" * 1000 + "}"
    mid = '{"text": "t", "label": ' + "[" * 300 + "]" * 300 + "}"  # parses, but would break repr, pickle, JSON
    huge_int = '{"text": "t", "id": ' + "9" * 5000 + "}"  # more digits than Python converts
    path = _write(tmp_path / "in.jsonl", [{"text": "before"}, deep, mid, huge_int, {"text": "after"}])
    records = list(probe_gen(path).records())
    assert [r.id for r in records if isinstance(r, Item)] == ["#0", "#4"]
    reasons = {r.record_id: r.reason for r in records if isinstance(r, Rejected)}
    assert reasons["line 2"] == "line 2: nested too deeply to parse; flatten the row"
    assert reasons["line 3"] == "line 3: nested more than 100 levels deep; flatten the row"
    assert reasons["line 4"].startswith("line 4: cannot be parsed (") and "\n" not in reasons["line 4"]


def test_odd_values_in_messages_are_short_and_never_raise():
    from forge.io.ids import short

    nested: list = []
    for _ in range(5000):
        nested = [nested]
    assert short(nested) in ("<list>", "[" * 37 + "...")  # its type or a cut repr, never a RecursionError
    assert short("x" * 10_000) == "'" + "x" * 36 + "..." and short(list(range(100))) == "<list of 100>"


def test_a_bom_then_a_blank_line_is_not_a_row(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'\xef\xbb\xbf\n{"text": "first"}\n\xef\xbb\xbf{"text": "a BOM later is bad UTF-8... or JSON"}\n')
    rows = list(read_rows(path))
    assert rows[0] == (0, {"text": "first"})
    assert len(rows) == 2 and isinstance(rows[1][1], str) and rows[1][1].startswith("line 3: invalid JSON")


def test_a_fifo_is_refused_in_one_line(tmp_path):
    import os

    path = tmp_path / "in.jsonl"
    os.mkfifo(path)
    with pytest.raises(ForgeError) as info:
        probe_gen(path)
    assert str(info.value) == (
        f"input.path={path} is not a regular file (a FIFO, socket or device?); Forge reads the "
        "input more than once (its hash, its row count, its rows): write it to a file first"
    )


def test_a_row_over_max_row_bytes_fails_before_it_is_parsed_and_the_next_line_reads(tmp_path):
    path = tmp_path / "in.jsonl"
    long_line = json.dumps({"text": "word " * 1000}).encode()  # 5014 bytes
    path.write_bytes(b'{"text": "short"}\n' + long_line + b"\r\n" + b"x" * 3_000_000 + b'\n{"text": "after"}')
    rows = list(read_rows(path, max_row_bytes=1000))
    assert rows[0] == (0, {"text": "short"}) and rows[3] == (3, {"text": "after"})
    assert rows[1] == (
        1,
        f"line 2: {len(long_line)} bytes, over input.max_row_bytes=1000; raise input.max_row_bytes or split the row",
    )
    assert rows[2][1].startswith("line 3: 3000000 bytes, over input.max_row_bytes=1000")
    from forge.io.inputs import count_rows

    assert count_rows(path, 1000) == 4


def test_a_parquet_row_over_max_row_bytes_fails_before_it_is_parsed(tmp_path):
    path = _parquet(
        tmp_path / "in.parquet", text=["short", "x" * 5000, "fine"], id=["a", "b", "c"], note=["n" * 1000, "", None]
    )
    records = list(probe_gen(path, max_row_bytes=1000).records())
    assert [r.id for r in records if isinstance(r, Item)] == ["c"]
    reasons = [r.reason for r in records if isinstance(r, Rejected)]
    assert reasons == [
        "row 0: 1006 bytes, over input.max_row_bytes=1000; raise input.max_row_bytes or split the row",
        "row 1: 5001 bytes, over input.max_row_bytes=1000; raise input.max_row_bytes or split the row",
    ]


def test_an_unreadable_parquet_row_group_fails_its_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "in.parquet"
    pq.write_table(
        pa.table({"text": [f"row {i} " * 20 for i in range(30)]}), path, row_group_size=10, compression="none"
    )
    data = bytearray(path.read_bytes())
    meta = pq.ParquetFile(path).metadata.row_group(1).column(0)
    start = meta.data_page_offset
    data[start + 8 : start + 200] = b"\xff" * 192  # the second row group's page: garbage
    path.write_bytes(bytes(data))
    rows = list(read_rows(path))
    assert [i for i, _ in rows] == list(range(30))
    bad = [i for i, r in rows if isinstance(r, str)]
    assert set(bad) <= set(range(10, 20)) and bad, rows[10:20]
    assert all(r.startswith(f"row {i}: row group 1 of the Parquet file cannot be read (") for i, r in rows if i in bad)


def test_a_row_the_tokenizer_raises_for_fails_alone(tmp_path):
    path = _write(tmp_path / "in.jsonl", [{"text": "fine"}, {"text": "BOOM"}, {"text": "also fine", "prefix": "P: "}])
    function = probe_gen(path)
    real = function.tokenizer

    class Tokenizer:  # the real one, but it raises for one text
        def __call__(self, text, **kwargs):
            if "BOOM" in (text if isinstance(text, str) else " ".join(text)):
                raise ValueError("cannot take this\nsecond line")
            return real(text, **kwargs)

        def __getattr__(self, name):
            return getattr(real, name)

    function.hf._tokenizer = Tokenizer()
    records = list(function.records())
    assert [r.id for r in records if isinstance(r, Item)] == ["#0", "#2"]
    assert [r.reason for r in records if isinstance(r, Rejected)] == [
        "line 2 (id '#1'): tokenizing failed on it (cannot take this); fix or drop the row"
    ]


def test_a_parquet_label_that_is_not_json_fails_its_row(tmp_path):
    import datetime

    path = _parquet(tmp_path / "in.parquet", text=["a", "b"], label=[datetime.datetime(2020, 1, 1), None])
    records = list(probe_gen(path).records())
    assert [r.id for r in records if isinstance(r, Item)] == ["#1"]
    reason = next(r.reason for r in records if isinstance(r, Rejected))
    assert reason.startswith(
        "row 0 (id '#0'): 'label' must be a JSON value (a number, string, list or object), got datetime"
    )


@pytest.mark.parametrize(
    "line,repeats",
    [
        ('{"\\u0069d": "1", "text": "an escaped key"}', True),
        ('{"id": "\\u0031", "text": "an escaped value"}', True),
        ('{"id"\t :\n 1, "text": "spaces"}'.replace("\n", " "), True),
        ('{"id": "2", "id": "1", "text": "a repeated key: the last counts"}', True),
        ('{"id": "1", "id": "2", "text": "a repeated key: the last counts"}', False),
        ('{"meta": {"id": "1"}, "text": "a nested id is not the id"}', False),
        ('{"text": "say \\"id\\": 1", "id": "x"}', False),
    ],
)
def test_the_id_scan_finds_every_id_however_it_is_written(tmp_path, line, repeats):
    path = _write(tmp_path / "in.jsonl", [line, {"id": 1, "text": "the other one"}])
    if repeats:
        with pytest.raises(ForgeError, match="1 id repeats, e.g. '1' at lines 1 and 2"):
            _input(path)
    else:
        assert len(list(_input(path).rows())) == 2


@pytest.mark.parametrize("name", ["/no/such/model", "./no-such-model", "~/no-such-model-here", "~nosuchuser/m"])
def test_a_model_path_that_is_not_a_directory_is_one_line(name):
    from forge.api import InputSpec, ModelSpec
    from forge.functions.probe_gen import ProbeGen, ProbeGenConfig

    with pytest.raises(ForgeError, match=r"^model\.name=\S+: no such directory; point it at a model directory"):
        ProbeGen(ProbeGenConfig(model=ModelSpec(name=name), input=InputSpec(path="rows.jsonl"), layers=[1]))
