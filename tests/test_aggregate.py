"""Dataset-level results (`forge.io.aggregate`): partials folded per shard, committed with their
shard, folded again on read; exactly once under a crash (kill -9 included) and resume."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from forge.errors import ForgeError
from forge.function import ResultColumns
from forge.io import aggregate as agg
from forge.io.aggregate import Aggregate
from forge.io.results import Field, ResultSchema, aggregate, load
from forge.io.sinks import ResultSink
from forge.io.store import RunStore, read_journal
from forge.vocab.geometry import Batch, Item

N, DIM = 23, 4
LABELS = [0, 1, "a", None]
AGGREGATES = (
    Aggregate("x", "sum"),
    Aggregate("x_mean", "mean", by="label"),
    Aggregate("v_sum", "sum", by="label"),
    Aggregate("v_mean", "mean"),
    Aggregate("v_cov", "cov", by="label"),
    Aggregate("all_cov", "cov"),
    Aggregate("n", "count", by="label"),
)
TESTS = Path(__file__).resolve().parent
SCORE = (Field("score", "float32"),)


def dataset(seed: int = 0):
    """Per item: a label, a scalar x and a vector v (a mean far from zero: the cov must not cancel)."""
    rng = np.random.default_rng(seed)
    labels = [LABELS[k % len(LABELS)] for k in rng.permutation(N)]
    x = rng.normal(size=N)
    v = rng.normal(size=(N, DIM)) * [1.0, 2.0, 0.5, 3.0] + 50.0
    return labels, x, v


def columns_of(x: np.ndarray, v: np.ndarray) -> dict:
    """What a worker gives for these items: each aggregate's value under its name."""
    return {"x": x, "x_mean": x, "v_sum": v, "v_mean": v, "v_cov": v, "all_cov": v, "n": [None] * len(x)}


def expected(labels, x, v) -> dict:
    """numpy over every item at once."""
    groups = {label: np.array([lab == label and type(lab) is type(label) for lab in labels]) for label in LABELS}
    return {
        "x": x.sum(),
        "x_mean": {g: x[m].mean() for g, m in groups.items()},
        "v_sum": {g: v[m].sum(axis=0) for g, m in groups.items()},
        "v_mean": v.mean(axis=0),
        "v_cov": {g: np.cov(v[m].T) for g, m in groups.items()},
        "all_cov": np.cov(v.T),
        "n": {g: int(m.sum()) for g, m in groups.items()},
    }


def assert_close(got, want, tol=1e-12) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (got, want)
        for k in want:
            assert_close(got[k], want[k], tol)
    elif isinstance(want, (int, np.integer)):
        assert got == want and isinstance(got, int)
    else:
        assert np.shape(got) == np.shape(want)
        assert np.allclose(got, want, rtol=tol, atol=tol), (got, want)


@pytest.mark.parametrize("rows", [1, 3, N])
def test_folding_shards_equals_numpy_on_every_item_whatever_the_cut(rows):
    labels, x, v = dataset()
    keys = [agg.group_key(label) for label in labels]
    cols = columns_of(x, v)
    partials = []
    for lo in range(0, N, rows):
        part: agg.Partial = {}
        for a in AGGREGATES:
            values = agg.check_values(a, cols[a.name][lo : lo + rows], len(x[lo : lo + rows]), {})
            part[a.name] = agg.fold_rows(a, values, keys[lo : lo + rows] if a.by else [""] * len(x[lo : lo + rows]))
        partials.append(agg.from_tensors(agg.to_tensors(part)))  # as a shard holds it
    random.Random(rows).shuffle(partials)  # any fold order: equal up to float64 rounding
    total: agg.Partial = {}
    for part in partials:
        agg.merge(total, part)
    got = agg.finalize(total, AGGREGATES)
    assert_close(got, expected(labels, x, v))
    assert set(got["n"]) == {0, 1, "a", None}  # labels as their JSON values


def test_group_keys_are_json_and_labels_come_back():
    assert [agg.group_key(x) for x in (0, "0", True, None, np.int64(3))] == ["0", '"0"', "true", "null", "3"]
    with pytest.raises(ForgeError, match="not a number, string, bool or None"):
        agg.group_key([1, 2])
    part = {"n": agg.fold_rows(Aggregate("n", "count", "label"), None, ["true", "1"])}
    with pytest.raises(ForgeError, match="collide as Python dict keys"):
        agg.finalize(part, [Aggregate("n", "count", "label")])


# -- through the sink and the run directory -------------------------------------------------
def schema(fmt: str, rows: int, fields=SCORE) -> ResultSchema:
    return ResultSchema(tuple(fields), format=fmt, folder="res", rows_per_shard=rows, aggregates=AGGREGATES)


def finish(values: dict) -> dict:
    return {"gap": values["x_mean"][1] - values["x_mean"][0], "mean_norm": np.linalg.norm(values["v_mean"])}


def write_items(sink: ResultSink, labels, x, v, which, batch: int = 4) -> None:
    """Items `which` in batches of `batch`, flushed whenever a shard's worth waits (as the loop does)."""
    which = list(which)
    for lo in range(0, len(which), batch):
        ks = which[lo : lo + batch]
        items = [Item(f"i{k}", 1, meta=labels[k], index=k) for k in ks]
        cols = {**columns_of(x[ks], v[ks]), "score": x[ks].astype(np.float32) * 2}
        sink.write(Batch([[it] for it in items], 1), ResultColumns(cols), None)
        if sink.full():
            sink.flush()


def clean_run(run: Path, fmt: str, rows: int, fields=SCORE) -> dict:
    labels, x, v = dataset()
    store = RunStore(run, {"function": "test"})
    sink = ResultSink(store, schema(fmt, rows, fields), finish=finish)
    write_items(sink, labels, x, v, range(N))
    figures = sink.close()
    store.close("finished")
    return figures


@pytest.mark.parametrize("rows", [1, 3, N])
@pytest.mark.parametrize("fmt", ["parquet", "safetensors"])
def test_sink_store_and_load_round_trip(tmp_path, fmt, rows):
    labels, x, v = dataset()
    figures = clean_run(tmp_path, fmt, rows)
    assert figures["aggregates"] == [a.name for a in AGGREGATES] and figures["rows"] == N
    res = load(tmp_path)
    assert list(res.columns) == ["score"]  # aggregates are not per-item columns
    assert np.allclose(res.columns["score"], x * 2, atol=1e-6)
    want = expected(labels, x, v)
    assert_close({k: res.aggregate[k] for k in want}, want)
    gap = want["x_mean"][1] - want["x_mean"][0]
    assert abs(res.aggregate["gap"] - gap) < 1e-12 and "mean_norm" in res.aggregate  # the finisher's values
    assert_close(aggregate(tmp_path), res.aggregate)
    info = json.loads((tmp_path / "res" / "meta.json").read_text())
    assert info["aggregates"][-1] == {"name": "n", "op": "count", "by": "label"}
    assert (tmp_path / "res" / agg.RESULT_JSON).exists() and (tmp_path / "res" / agg.RESULT_TENSORS).exists()


@pytest.mark.parametrize("fmt", ["parquet", "safetensors"])
def test_a_function_with_aggregates_only_journals_its_items(tmp_path, fmt):
    """No per-item field: the shards still journal ids and indexes (exactly once), a Parquet
    shard holds id and index only, and the dataset result reads back."""
    labels, x, v = dataset()
    clean_run(tmp_path, fmt, 5, fields=())
    res = load(tmp_path)
    assert res.columns == {} and res.ids == [f"i{k}" for k in range(N)] and list(res.index) == list(range(N))
    assert_close({"x": res.aggregate["x"]}, {"x": x.sum()})
    assert_close(aggregate(tmp_path)["n"], expected(labels, x, v)["n"])
    if fmt == "parquet":
        import pyarrow.parquet as pq

        shard = next((tmp_path / "res").glob("*.parquet"))
        assert pq.read_table(shard).column_names == ["id", "index"]
        assert agg.PARQUET_KEY in pq.ParquetFile(shard).metadata.metadata
    else:
        from safetensors import safe_open

        with safe_open(str(next((tmp_path / "res").glob("*.safetensors"))), "np") as f:
            assert all(k.startswith(agg.PREFIX) for k in f.keys()) and f"{agg.PREFIX}x//count" in f.keys()


def test_a_function_without_aggregates_has_an_empty_dataset_result(tmp_path):
    store = RunStore(tmp_path, {"function": "test"})
    sink = ResultSink(store, ResultSchema((Field("score", "float32"),), folder="res"))
    sink.write(Batch([[Item("a", 1, index=0)]], 1), ResultColumns({"score": np.ones(1)}), None)
    assert "aggregates" not in sink.close()
    store.close("finished")
    assert load(tmp_path).aggregate == {} and aggregate(tmp_path) == {}
    assert "aggregates" not in json.loads((tmp_path / "res" / "meta.json").read_text())


def test_values_of_one_shape_only_and_numbers(tmp_path):
    sink = ResultSink(
        RunStore(tmp_path, {"function": "test"}),
        ResultSchema((), folder="res", aggregates=(Aggregate("v", "sum"), Aggregate("c", "cov"))),
    )

    def write(v, c, k=0):
        items = [Item(f"i{k + j}", 1, index=k + j) for j in range(len(v))]
        sink.write(Batch([[it] for it in items], 1), ResultColumns({"v": v, "c": c}), None)

    write(np.zeros((2, 3)), np.zeros((2, 2)))
    with pytest.raises(
        ForgeError, match=r"aggregate 'v': every item's value must have one shape; the items gave \(3,\), \(4,\)"
    ):
        write(np.zeros((2, 4)), np.zeros((2, 2)), 2)
    with pytest.raises(ForgeError, match=r"aggregate 'v': .* the items gave \(2,\), \(3,\)"):
        write([np.zeros(3), np.zeros(2)], np.zeros((2, 2)), 2)
    with pytest.raises(ForgeError, match=r"aggregate 'c': op=cov needs a 1-D vector per item"):
        ResultSink(
            RunStore(tmp_path / "b", {"function": "test"}), ResultSchema((), aggregates=(Aggregate("c", "cov"),))
        ).write(Batch([[Item("a", 1, index=0)]], 1), ResultColumns({"c": np.zeros((1, 2, 2))}), None)
    with pytest.raises(ForgeError, match="aggregate 'c' missing from the worker's output"):
        sink.write(Batch([[Item("z", 1, index=9)]], 1), ResultColumns({"v": np.zeros((1, 3))}), None)
    with pytest.raises(ForgeError, match="needs at least one result field or aggregate"):
        ResultSchema(())
    with pytest.raises(ForgeError, match=r"result fields \[.v.\] are named twice"):
        ResultSchema((Field("v", "float32"),), aggregates=(Aggregate("v"),))
    with pytest.raises(ForgeError, match="op='median'"):
        Aggregate("v", "median")


# -- exactly once -------------------------------------------------------------------------------
def _crash(store: RunStore) -> None:
    """As if the process died: the lock goes (the kernel frees it), no clean-up runs."""
    store._release()


@pytest.mark.parametrize("fmt", ["parquet", "safetensors"])
def test_a_crash_then_resume_folds_each_item_once(tmp_path, fmt):
    """Two shards committed, a third put in place but never journaled (an orphan whose partial
    must not count), then a crash; the resumed run equals a clean one. A partial run's result
    is the committed items' (no finisher values); a closed run's result goes stale when a
    later session commits more, and is folded afresh."""
    labels, x, v = dataset()
    clean_run(tmp_path / "clean", fmt, 4)
    clean = aggregate(tmp_path / "clean")

    run = tmp_path / "run"
    store = RunStore(run, {"function": "test"})
    sink = ResultSink(store, schema(fmt, 4), finish=finish)
    write_items(sink, labels, x, v, range(8))  # two shards of 4, committed
    store.fault = lambda point: (_ for _ in ()).throw(OSError("simulated")) if point == "commit_record" else None
    with pytest.raises(OSError, match="simulated"):
        write_items(sink, labels, x, v, range(8, 12))  # put in place, then its record fails: an orphan
    _crash(store)

    partial = aggregate(run)
    assert "gap" not in partial
    assert_close({k: partial[k] for k in ("x", "v_mean")}, {"x": x[:8].sum(), "v_mean": v[:8].mean(axis=0)})

    again = RunStore(run, {"function": "test"}, resume=True)
    assert again.committed == set(range(8))
    sink = ResultSink(again, schema(fmt, 4), finish=finish)
    rest = [k for k in range(N) if k not in again.committed]
    write_items(sink, labels, x, v, rest[:9])  # a closed session's result, with the finisher's values
    sink.close()
    again.close("stopped")
    assert "gap" in aggregate(run)

    third = RunStore(run, {"function": "test"}, resume=True)
    sink = ResultSink(third, schema(fmt, 4), finish=finish)
    write_items(sink, labels, x, v, [k for k in range(N) if k not in third.committed][:4])
    _crash(third)  # aggregate.json no longer names the journal's shards: folded afresh
    stale = aggregate(run)
    assert "gap" not in stale and sum(stale["n"].values()) == 21

    last = RunStore(run, {"function": "test"}, resume=True)
    sink = ResultSink(last, schema(fmt, 4), finish=finish)
    write_items(sink, labels, x, v, [k for k in range(N) if k not in last.committed])
    sink.close()
    last.close("finished")
    res = load(run)
    assert sorted(res.ids) == sorted(f"i{k}" for k in range(N)) and len(res.ids) == N
    assert_close(res.aggregate, clean)
    want = expected(labels, x, v)
    assert_close({k: res.aggregate[k] for k in want}, want)


KILLED = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import test_aggregate as t
from forge.io.sinks import ResultSink
from forge.io.store import RunStore

labels, x, v = t.dataset()
commits = []

def fault(point):
    if point == "commit_record":
        commits.append(1)
        if len(commits) == 3:  # the third shard in place, its record never written
            os.kill(os.getpid(), signal.SIGKILL)

store = RunStore(sys.argv[1], {{"function": "test"}}, fault=fault)
sink = ResultSink(store, t.schema(sys.argv[2], 4), finish=t.finish)
t.write_items(sink, labels, x, v, range(t.N))
"""


@pytest.mark.parametrize("fmt", ["parquet", "safetensors"])
def test_kill9_mid_commit_then_resume_equals_a_clean_run(tmp_path, fmt):
    """A real SIGKILL of the writing process between a shard put in place and its record."""
    clean_run(tmp_path / "clean", fmt, 4)
    run = tmp_path / "run"
    script = KILLED.format(tests=str(TESTS))
    proc = subprocess.run([sys.executable, "-c", script, str(run), fmt], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert sum(aggregate(run)["n"].values()) == 8

    labels, x, v = dataset()
    again = RunStore(run, {"function": "test"}, resume=True)
    assert again.committed == set(range(8))
    sink = ResultSink(again, schema(fmt, 4), finish=finish)
    write_items(sink, labels, x, v, [k for k in range(N) if k not in again.committed])
    sink.close()
    again.close("finished")
    assert_close(aggregate(run), aggregate(tmp_path / "clean"))
    journaled = {Path(r["file"]).name for r in read_journal(run)}
    assert {p.name for p in (run / "res").glob("shard-*")} == journaled  # the orphan removed


# -- for the end-to-end `forge run` test, once functions can declare aggregates ------------------
def forge_run_killed(out: Path, *overrides: str, faults, at_write: int = 3) -> int:
    """`forge run` in its own process group, SIGKILLed (the whole tree) while it writes its
    `at_write`-th shard; returns how many items the journal committed. Then call
    `run_forge(out, *overrides, "resume=true")` and compare `aggregate(out)` with a clean run's.
    `faults` is the fixture of tests/conftest.py; overrides need `shard_size` small enough that
    the run writes more than `at_write` shards."""
    from conftest import forge_process

    faults(kill_run_at_write=at_write)
    proc = forge_process(*overrides, "plugins=[faults]", f"output_dir={out}", env=dict(os.environ))
    proc.communicate(timeout=300)
    faults()
    assert proc.returncode == -signal.SIGKILL, proc.returncode
    assert not (out / "report.json").exists()
    return sum(len(json.loads(line)["index"]) for line in (out / "commits.jsonl").read_text().splitlines())


def test_bfloat16_shards_and_torch_values(tmp_path):
    """A safetensors shard written through torch (a bfloat16 field) keeps its partial; values
    may come as torch tensors of any float dtype (folded in float64)."""
    import torch

    store = RunStore(tmp_path, {"function": "test"})
    fields = (Field("h", "bfloat16", (2,)),)
    sink = ResultSink(store, ResultSchema(fields, format="safetensors", aggregates=(Aggregate("m", "mean"),)))
    values = torch.tensor([[1.0, 2.0], [3.0, 5.0]], dtype=torch.bfloat16)
    items = [Item(f"i{k}", 1, index=k) for k in range(2)]
    sink.write(Batch([[it] for it in items], 1), ResultColumns({"h": values, "m": list(values)}), None)
    sink.close()
    store.close("finished")
    res = load(tmp_path)
    assert res.columns["h"].tolist() == [[1.0, 2.0], [3.0, 5.0]]
    assert res.aggregate["m"].tolist() == [2.0, 3.5]


@pytest.mark.parametrize("fmt", ["parquet", "safetensors"])
def test_an_object_store_run_folds_the_same(tmp_path, lease_url, fmt):
    """On an object store (no local file to map) the partials are read from the shards' bytes."""
    clean_run(tmp_path / "clean", fmt, 5)
    labels, x, v = dataset()
    store = RunStore(lease_url, {"function": "test"})
    sink = ResultSink(store, schema(fmt, 5), finish=finish)
    write_items(sink, labels, x, v, range(N))
    partial, want = aggregate(lease_url), aggregate(tmp_path / "clean")  # before close: the shards folded now
    assert set(want) - set(partial) == {"gap", "mean_norm"}
    assert_close(partial, {k: want[k] for k in partial})
    sink.close()
    store.close("finished")
    assert_close(load(lease_url).aggregate, aggregate(tmp_path / "clean"))


def test_a_resume_with_other_aggregates_is_refused_when_folding(tmp_path):
    """Shards written before an aggregate was added (or its op or grouping changed) hold no
    partial for it: folding them would count only some items, so reading refuses."""

    def session(aggregates, ks, resume):
        store = RunStore(tmp_path, {"function": "test"}, resume=resume)
        sink = ResultSink(store, ResultSchema((), folder="res", aggregates=aggregates))
        items = [Item(f"i{k}", 1, meta=k % 2, index=k) for k in ks]
        cols = {"x": np.arange(len(ks), dtype=float), "y": np.ones(len(ks))}
        sink.write(Batch([[it] for it in items], 1), ResultColumns(cols), None)
        return store, sink

    store, sink = session((Aggregate("x"),), range(3), False)
    sink.close()
    store.close("stopped")
    assert aggregate(tmp_path) == {"x": 3.0}
    store, sink = session((Aggregate("x"), Aggregate("y", "mean")), range(3, 6), True)
    with pytest.raises(ForgeError, match=r"shard-000-00000.parquet: its partial does not hold aggregate 'y'"):
        sink.close()
    store.close("stopped")
    with pytest.raises(ForgeError, match="the function's aggregates changed since it was written"):
        aggregate(tmp_path)
