"""Fuzz the input reader over bytes: whatever a JSONL or Parquet file holds, every record
ends as exactly one of an item, a recorded failure or a recorded skip; nothing raises but
the documented one-line refusals (repeated ids under duplicate_ids=error, a bad Parquet
schema or footer, before any work); and the counts add up to the records in the file."""

import io
import json

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from forge.errors import ForgeError
from forge.io.inputs import InputFile, Row
from forge.io.readers import BOM
from forge.vocab.geometry import Item
from forge.vocab.records import Rejected, Skipped

FUZZ = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
POLICIES = ("error", "first", "last")

ids = st.one_of(
    st.none(),
    st.integers(-3, 3),
    st.sampled_from(["1", "2", "a", "", "#1", "#x", "\ud800", "é"]),
    st.booleans(),
    st.floats(allow_nan=False),
    st.lists(st.integers(0, 2), max_size=2),
    st.dictionaries(st.just("k"), st.integers(0, 1), max_size=1),
)
texts = st.one_of(st.text(max_size=12), st.none(), st.integers(), st.sampled_from(["", "  ", "half \ud800 pair"]))
rows = st.fixed_dictionaries(
    {},
    optional={
        "id": ids,
        "text": texts,
        "prefix": st.one_of(st.text(max_size=4), st.integers()),
        "label": st.one_of(st.integers(), st.text(max_size=3)),
    },
)


def _deep(depth: int) -> bytes:
    return b'{"text": "t", "x": ' + b"[" * depth + b"]" * depth + b"}"


ODD_LINES = [
    b"",
    b"   ",
    b"\t",
    b"\r",
    BOM,
    BOM + b'{"text": "x"}',
    b'{"text": "caf\xe9"}',
    b"[1, 2]",
    b'"str"',
    b"null",
    b'{"text": "t", "id": 1e400}',
    b'{"id": ' + b"9" * 5000 + b', "text": "t"}',  # too many digits
    _deep(101),
    _deep(999),
    _deep(1500),
    _deep(5000),
    # ids the id scan's regex must not miss: escapes, spacing, nesting, repeated keys, -0
    b'{"\\u0069d": "1", "text": "t"}',
    b'{"id": "\\u0031", "text": "t"}',
    b'{"id"\t :\n 1, "text": "t"}',
    b'{"meta": {"id": "1"}, "text": "t"}',
    b'{"id": "2", "id": "1", "text": "t"}',
    b'{"id": -0, "text": "t"}',
    b'{"text": "say \\"id\\": 1", "id": "1"}',
    b'{"id": "a\\"b", "text": "t"}',
    b'{"id": "1"}',
]
lines = st.one_of(
    rows.map(lambda r: json.dumps(r).encode()),
    st.binary(max_size=30),  # anything: bad UTF-8, stray newlines, NULs
    st.sampled_from(ODD_LINES),
    st.integers(0, 6000).map(lambda n: json.dumps({"text": "x" * n, "id": f"long{n}"}).encode()),  # long lines
    st.integers(1, 5000).map(lambda n: b" " * n),  # long blank lines are still blank
)


def _oracle_count(data: bytes, limit: int | None) -> int:
    """Non-blank lines, by the plain definition (a BOM at the start is not part of the first line)."""
    if data.startswith(BOM):
        data = data[len(BOM) :]
    n = sum(1 for line in data.split(b"\n") if line.strip())
    return n if limit is None else min(n, limit)


def _as_item(record):
    """probe_gen's row check (every model function's: forge.io.rows), and a stand-in for its
    tokenizer (no model needed)."""
    from forge.api import TEXT_COLUMNS
    from forge.io.rows import check

    if not isinstance(record, Row):
        return record
    problem = check(record.data, TEXT_COLUMNS)
    if problem is not None:
        return record.reject(problem)
    return Item(record.id, len(record.data["text"]) + 1, None, 0, None, record.data.get("label"), record.index)


def _account(source: InputFile) -> tuple[list[Item], dict]:
    """The records through admission and the ledger, as a run counts them."""
    from forge.core.admission import AdmissionRules, admit
    from forge.pluginmanager import make_plugin_manager
    from forge.vocab.records import RunContext

    pm = make_plugin_manager()
    run = RunContext(function="fuzz", batching="none", devices=[], run_dir=None)
    pm.hook.forge_run_start(run=run)
    records = [_as_item(r) for r in source.rows()]
    for r in records:
        assert isinstance(r, (Item, Rejected, Skipped)), r
        if not isinstance(r, Item):
            assert r.reason and "\n" not in r.reason and r.record_id is not None
    items = list(admit(records, run=run, hook=pm.hook, rules=AdmissionRules(max_seq_len=1 << 30)))
    return items, run.state["ledger"].items


def _check(path, count: int | None, **options) -> None:
    """Every policy over one file: the properties every input must keep."""
    outcomes = {}
    for policy in POLICIES:
        try:
            source = InputFile(path, {"path": str(path), "duplicate_ids": policy, **options})
        except ForgeError as exc:  # a documented refusal, before any work: one line
            assert "\n" not in str(exc)
            outcomes[policy] = str(exc)
            continue
        explicit = {(index, rid) for index, _, rid in source._ids() if rid != f"#{index}"}
        assert explicit <= set(source._candidate_ids())  # the cheap id scan misses no explicit id
        items, counted = _account(source)
        received = source.count()
        if count is not None:
            assert received == count
        assert counted["received"] == received == len(items) + counted["failed"] + counted["skipped"]
        outcomes[policy] = (sorted(it.id for it in items), counted["skipped"])
    if isinstance(outcomes["first"], str):  # refused for all: the schema or the file
        assert outcomes["first"] == outcomes["last"] == outcomes["error"]
        return
    (first_ids, first_skipped), (last_ids, last_skipped) = outcomes["first"], outcomes["last"]
    assert len(first_ids) == len(set(first_ids)) and len(last_ids) == len(set(last_ids))  # ids unique
    assert first_skipped == last_skipped
    if first_skipped:
        assert "repeat" in outcomes["error"]  # error refuses exactly when first/last drop rows
    else:
        assert outcomes["error"] == outcomes["first"]


@pytest.mark.slow
@FUZZ
@given(
    body=st.lists(lines, min_size=1, max_size=25),
    sep=st.sampled_from([b"\n", b"\r\n"]),
    bom=st.booleans(),
    cap=st.sampled_from([64, 300, 1 << 20, 1 << 20]),
    limit=st.one_of(st.none(), st.integers(1, 20)),
)
def test_jsonl_bytes_every_record_ends_as_an_item_a_failure_or_a_skip(tmp_path_factory, body, sep, bom, cap, limit):
    data = (BOM if bom else b"") + sep.join(body)
    if not data:
        return  # an empty file is refused by name (tests/test_inputs.py)
    path = tmp_path_factory.mktemp("fuzz") / "in.jsonl"
    path.write_bytes(data)
    _check(path, _oracle_count(data, limit), max_row_bytes=cap, limit=limit)


@st.composite
def tables(draw):
    import datetime

    import pyarrow as pa

    n = draw(st.integers(1, 24))

    def col(values):
        return draw(st.lists(values, min_size=n, max_size=n))

    long_text = st.integers(0, 700).map(lambda k: "x" * k)
    columns = {"text": (pa.string(), col(st.one_of(st.none(), st.text(max_size=8), long_text, st.just(" "))))}
    kind = draw(st.sampled_from(["none", "int", "string"]))
    if kind == "int":
        columns["id"] = (pa.int64(), col(st.one_of(st.none(), st.integers(-2, 3))))
    elif kind == "string":
        columns["id"] = (pa.string(), col(st.one_of(st.none(), st.sampled_from(["1", "2", "#0", "#x", "a", ""]))))
    if draw(st.booleans()):
        columns["prefix"] = (pa.string(), col(st.one_of(st.none(), st.text(max_size=4))))
    odd = draw(st.sets(st.sampled_from(["binary", "list", "struct", "time", "float", "null"])))
    if "binary" in odd:
        columns["blob"] = (pa.binary(), col(st.one_of(st.none(), st.binary(max_size=400))))
    if "list" in odd:
        columns["nums"] = (pa.list_(pa.int32()), col(st.one_of(st.none(), st.lists(st.integers(0, 9), max_size=3))))
    if "struct" in odd:
        columns["meta"] = (
            pa.struct([("a", pa.string())]),
            col(st.one_of(st.none(), st.builds(lambda a: {"a": a}, st.text(max_size=3)))),
        )
    if "time" in odd:
        columns["at"] = (
            pa.timestamp("us"),
            col(
                st.one_of(
                    st.none(),
                    st.datetimes(min_value=datetime.datetime(1, 1, 1), max_value=datetime.datetime(9999, 1, 1)),
                )
            ),
        )
    if "float" in odd:
        columns["score"] = (pa.float64(), col(st.one_of(st.none(), st.floats())))
    if "null" in odd:
        columns["nothing"] = (pa.null(), [None] * n)
    table = pa.table({name: pa.array(values, type=t) for name, (t, values) in columns.items()})
    if draw(st.booleans()):
        table = table.set_column(0, "text", table.column("text").dictionary_encode())
    return table, draw(st.integers(1, 10))


@pytest.mark.slow
@FUZZ
@given(
    made=tables(),
    cap=st.sampled_from([64, 300, 4096]),
    damage=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), max_size=6),
)
def test_parquet_tables_and_damaged_files_every_record_ends_as_an_item_a_failure_or_a_skip(
    tmp_path_factory, made, cap, damage
):
    import pyarrow.parquet as pq

    table, group = made
    buffer = io.BytesIO()
    pq.write_table(table, buffer, row_group_size=group, compression=None)
    data = bytearray(buffer.getvalue())
    for where, byte in damage:  # corrupt bytes anywhere: pages, metadata, the footer
        data[min(len(data) - 1, int(where * len(data)))] = byte
    path = tmp_path_factory.mktemp("fuzz") / "in.parquet"
    path.write_bytes(bytes(data))
    _check(path, None if damage else table.num_rows, max_row_bytes=cap)
