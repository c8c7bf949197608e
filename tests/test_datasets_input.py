"""Hugging Face datasets as input (`input.dataset`): the same rows give the same results from a
save_to_disk folder, a local json builder, and JSONL, streamed or not; resume after kill -9
commits each id once; missing columns and splits are one line listing what there is."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import forge_process, run_forge, small_run
from forge.errors import ForgeError

datasets = pytest.importorskip("datasets")

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py
N = 24
ASSETS = Path(__file__).resolve().parent.parent / "functions" / "assets"
MAP = ["+input.columns.text=sentence", "+input.columns.id=uid", "+input.columns.prefix=shots"]
RUN = [*small_run(N), "runtime.executor=inprocess", "shard_size=8"]


@pytest.fixture(scope="module", autouse=True)
def _datasets_cache(tmp_path_factory):
    """The json builder's Arrow cache in a temporary folder, not the user's ~/.cache."""
    folder = tmp_path_factory.mktemp("hf-datasets-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", folder)
        yield folder


def _renamed(row: dict) -> dict:
    return {"uid": row["id"], "shots": row.get("prefix"), "sentence": row["text"], "label": row["label"]}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The first N embedded statements as JSONL (Forge's names), and, with the dataset's own
    column names, as a save_to_disk folder (train and test splits) and a JSON file."""
    folder = tmp_path_factory.mktemp("data")
    rows = [json.loads(line) for line in (ASSETS / "statements.jsonl").read_text().splitlines()[:N]]
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    renamed = [_renamed(r) for r in rows]
    (folder / "renamed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in renamed))
    ds = datasets.Dataset.from_list(renamed)
    ds.save_to_disk(str(folder / "disk"))
    datasets.DatasetDict({"train": ds, "test": ds.select(range(4))}).save_to_disk(str(folder / "dict"))
    return folder


def _table(run_dir: Path):
    from forge.io.results import load

    return load(run_dir).table()


@pytest.mark.slow
def test_the_same_rows_from_disk_a_json_builder_and_jsonl_give_equal_results(tmp_path, data):
    want = run_forge(tmp_path / "jsonl", *RUN, f"input.path={data / 'rows.jsonl'}")
    assert want["items"]["completed"] == N
    reference = _table(tmp_path / "jsonl")
    variants = {
        "disk": [f"input.dataset={data / 'disk'}"],
        "disk_streamed": [f"input.dataset={data / 'disk'}", "input.streaming=true"],
        "dict": [f"input.dataset={data / 'dict'}", "input.split=train"],
        "json": ["input.dataset=json", f"input.data_files=[{data / 'renamed.jsonl'}]"],
        "json_streamed": ["input.dataset=json", f"input.data_files=[{data / 'renamed.jsonl'}]", "input.streaming=true"],
    }
    for name, overrides in variants.items():
        report = run_forge(tmp_path / name, *RUN, *overrides, *MAP)
        assert report["items"]["completed"] == N and report["balanced"], name
        got = _table(tmp_path / name)
        assert got.equals(reference), name  # bit for bit: ids, labels and every state


def test_rows_get_ids_from_a_column_or_their_index(data):
    from forge.api import TEXT_COLUMNS
    from forge.io.datasets_input import InputDataset

    by_column = list(
        InputDataset({"dataset": str(data / "disk"), "columns": {"text": "sentence", "id": "uid"}}, TEXT_COLUMNS).rows()
    )
    by_index = list(InputDataset({"dataset": str(data / "disk"), "columns": {"text": "sentence"}}, TEXT_COLUMNS).rows())
    first = json.loads((data / "rows.jsonl").read_text().splitlines()[0])
    assert by_column[0].id == first["id"] and by_column[0].data["text"] == first["text"]
    assert [r.id for r in by_index] == [f"#{k}" for k in range(N)]
    assert "uid" in by_index[0].data  # an unmapped column keeps its own name


def test_a_dataset_in_the_local_hub_cache_is_read_offline(data, _datasets_cache):
    """A Hub name that `load_dataset` cached earlier (made here from the json builder's cache,
    laid out as the Hub's would be), read with HF_HUB_OFFLINE: nothing is fetched."""
    import shutil

    from forge.api import TEXT_COLUMNS
    from forge.io.datasets_input import InputDataset

    datasets.load_dataset("json", data_files=[str(data / "renamed.jsonl")], split="train")
    built = next((_datasets_cache / "json").glob("*/*/*"))
    cached = _datasets_cache / "me___statements" / "default" / "0.0.0" / built.name
    shutil.copytree(built, cached)
    for f in cached.glob("json-*"):
        f.rename(cached / f.name.replace("json-", "statements-"))
    spec = {"dataset": "me/statements", "columns": {"text": "sentence", "id": "uid"}}
    got = list(InputDataset(spec, TEXT_COLUMNS).rows())
    assert [r.id for r in got] == [json.loads(line)["id"] for line in (data / "rows.jsonl").read_text().splitlines()]
    with pytest.raises(ForgeError, match=r"input.dataset=me/statements: no split 'test' \(splits: train\)"):
        InputDataset({**spec, "split": "test"}, TEXT_COLUMNS)


def test_a_column_may_feed_two_fields_and_a_mapped_field_shadows_a_column_of_its_name(tmp_path):
    from forge.api import TEXT_COLUMNS
    from forge.io.datasets_input import InputDataset

    datasets.Dataset.from_list([{"text": "old", "s": "new", "n": 1}]).save_to_disk(str(tmp_path / "d"))
    spec = {"dataset": str(tmp_path / "d"), "columns": {"text": "s", "prefix": "s"}}
    (row,) = InputDataset(spec, TEXT_COLUMNS).rows()
    assert row.data == {"text": "new", "prefix": "new", "n": 1}


def test_streaming_reads_the_same_rows_and_counts_them(data):
    from forge.api import TEXT_COLUMNS
    from forge.io.datasets_input import InputDataset

    spec = {"dataset": str(data / "disk"), "columns": {"text": "sentence", "id": "uid"}, "limit": 10}
    whole, streamed = InputDataset(spec, TEXT_COLUMNS), InputDataset({**spec, "streaming": True}, TEXT_COLUMNS)
    assert [r.data for r in whole.rows()] == [r.data for r in streamed.rows()]
    assert whole.count() == streamed.count() == 10
    assert whole.fingerprint() == streamed.fingerprint()  # a resume may switch streaming on or off
    builder = {"dataset": "json", "data_files": [str(data / "renamed.jsonl")], "columns": spec["columns"]}
    a, b = InputDataset(builder, TEXT_COLUMNS), InputDataset({**builder, "streaming": True}, TEXT_COLUMNS)
    assert [r.data for r in a.rows()] == [r.data for r in b.rows()] and a.fingerprint() == b.fingerprint()


@pytest.mark.parametrize(
    "spec, match",
    [
        (
            {"columns": {"text": "sentense"}},
            r"input.columns.text=sentense names no column .*\(columns: uid, shots, sentence, label\)",
        ),
        (
            {},
            r"no 'text' column in split 'train' \(columns: uid, shots, sentence, label\); map one to it: "
            r"input.columns.text=COLUMN",
        ),
        (
            {"dataset": "dict", "split": "validation", "columns": {"text": "sentence"}},
            r"no split 'validation' \(splits: train, test\)",
        ),
        (  # one Dataset saved alone: it has its own split, no other
            {"split": "test", "columns": {"text": "sentence"}},
            r"one dataset saved with save_to_disk \(split 'train'\), not a DatasetDict: it has no split 'test'",
        ),
        ({"dataset": "json", "columns": {"text": "sentence"}}, r"set input.data_files"),
        (
            {"dataset": "no-such/dataset"},
            r"not a save_to_disk folder, a builder .* or a dataset in the local Hugging Face cache",
        ),
        ({"columns": {"text": "label"}}, r"column 'text' is int64; it must be string"),
    ],
)
def test_a_missing_column_or_split_is_one_line_listing_what_there_is(data, spec, match):
    from forge.api import TEXT_COLUMNS
    from forge.io.datasets_input import InputDataset

    name = spec.pop("dataset", "disk")
    where = str(data / name) if name in ("disk", "dict") else name
    with pytest.raises(ForgeError, match=match) as got:
        InputDataset({"dataset": where, **spec}, TEXT_COLUMNS)
    assert "\n" not in str(got.value)


def test_a_row_a_function_cannot_use_is_a_recorded_failure(tmp_path):
    from forge.api import TEXT_COLUMNS
    from forge.io.datasets_input import InputDataset
    from forge.io.rows import read
    from forge.vocab.records import Rejected, Skipped

    rows = [
        {"sentence": "fine", "n": 1},
        {"sentence": "", "n": 2},
        {"sentence": None, "n": 3},
        {"sentence": "x" * 300, "n": 4},
    ]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "d"))
    spec = {
        "dataset": str(tmp_path / "d"),
        "columns": {"text": "sentence"},
        "max_row_bytes": 200,
        "duplicate_ids": "first",
    }
    got = list(read(InputDataset(spec, TEXT_COLUMNS), TEXT_COLUMNS))
    assert not isinstance(got[0], (Rejected, Skipped)) and got[0].data["text"] == "fine"
    assert [type(r) for r in got[1:]] == [Rejected] * 3
    assert got[1].reason.startswith("row 1 (id '#1'): has an empty or non-string 'text'")
    assert got[2].reason.startswith("row 2 (id '#2'): has no 'text' field")
    assert got[3].reason.startswith("row 3: 300 bytes, over input.max_row_bytes=200")


def test_repeated_ids_in_a_dataset_follow_input_duplicate_ids(tmp_path):
    from forge.api import TEXT_COLUMNS
    from forge.io.datasets_input import InputDataset
    from forge.vocab.records import Skipped

    rows = [{"text": "a", "id": 7}, {"text": "b", "id": "7"}, {"text": "c", "id": 8}]
    datasets.Dataset.from_list([{**r, "id": str(r["id"])} for r in rows]).save_to_disk(str(tmp_path / "d"))
    with pytest.raises(ForgeError, match=r"input.dataset=.*: 1 id repeats, e.g. '7' at rows 0 and 1"):
        InputDataset({"dataset": str(tmp_path / "d")}, TEXT_COLUMNS)
    got = list(
        InputDataset({"dataset": str(tmp_path / "d"), "duplicate_ids": "last", "streaming": True}, TEXT_COLUMNS).rows()
    )
    assert isinstance(got[0], Skipped) and [r.id for r in got[1:]] == ["7", "8"]


def test_input_columns_without_input_dataset_is_refused():
    from forge.io.inputs import InputSpec, check_spec

    with pytest.raises(ForgeError, match="apply to input.dataset only"):
        check_spec(InputSpec(path="x.jsonl", columns={"text": "sentence"}))


@pytest.mark.slow
def test_the_core_never_imports_datasets_unless_input_dataset_is_set():
    code = (
        "import sys, forge.api, forge.driver.engine, forge.cli.app, forge.io.results, forge.data\n"
        "from forge.cli.build import build_spec\nfrom forge.cli.compose import compose\n"
        "build_spec(compose(['input.limit=4']), None)\n"
        "print('datasets' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


@pytest.mark.slow
def test_a_streamed_run_killed_with_kill9_then_resumed_commits_each_id_once(tmp_path, data, faults):
    clean = run_forge(tmp_path / "clean", *RUN, f"input.dataset={data / 'disk'}", "input.streaming=true", *MAP)
    assert clean["items"]["completed"] == N
    out = tmp_path / "run"
    args = [*small_run(N), "shard_size=4", f"input.dataset={data / 'disk'}", "input.streaming=true", *MAP]
    faults(kill_run_at_write=3)  # SIGKILL to the whole process group while the 3rd shard is written
    proc = forge_process(
        *args, "runtime.executor=process", "plugins=[faults]", f"output_dir={out}", env=dict(os.environ)
    )
    proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "report.json").exists()
    records = [json.loads(line) for line in (out / "commits.jsonl").read_text().splitlines()]
    committed = sum(len(r["index"]) for r in records)
    assert 8 <= committed < N
    faults()
    report = run_forge(out, *args, "resume=true", "runtime.executor=inprocess")
    assert report["status"] == "finished" and report["balanced"], report["imbalance"]
    assert report["items"]["resumed"] == committed and report["items"]["completed"] == N
    indexes = [i for line in (out / "commits.jsonl").read_text().splitlines() for i in json.loads(line)["index"]]
    assert sorted(indexes) == list(range(N))  # each row's item committed exactly once, none skipped
    _same(out, tmp_path / "clean")  # other batches than the clean run's: equal within float tolerance


def _same(run_dir: Path, clean_dir: Path) -> None:
    import numpy as np

    from forge.io.results import load

    got, want = load(run_dir), load(clean_dir)
    assert list(got.ids) == list(want.ids)
    for name, values in want.columns.items():
        assert np.allclose(got.columns[name], values, atol=1e-5, rtol=0), name


@pytest.mark.slow
def test_the_datasets_pages_examples_run(tmp_path, monkeypatch):
    """docs/datasets.md: every `forge run` command (on a few rows, in this process) and every
    Python block, in order, in a folder holding the data the page names."""
    import re

    from conftest import compose
    from forge.cli.build import build_spec
    from forge.driver.engine import execute
    from forge.pluginmanager import make_plugin_manager

    page = (Path(__file__).resolve().parent.parent / "docs" / "datasets.md").read_text()
    rows = [_renamed(json.loads(line)) for line in (ASSETS / "statements.jsonl").read_text().splitlines()[:16]]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "statements.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(tmp_path / "data" / "statements"))
    datasets.DatasetDict({"train": ds, "test": ds.select(range(4))}).save_to_disk(
        str(tmp_path / "data" / "statements_dict")
    )
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```(bash|python)\n(.*?)```", page, flags=re.S)
    ran = 0
    for lang, block in blocks:
        if lang == "python":
            exec(compile(block, "docs/datasets.md", "exec"), {})
            ran += 1
            continue
        for command in block.replace("\\\n", " ").splitlines():
            if not command.startswith("forge run "):
                continue
            args = [a.strip("'") for a in command.split()[2:]]
            spec = build_spec(compose(*args, "runtime.executor=inprocess", "input.limit=8"), tmp_path / _out(args))
            report = execute(spec, make_plugin_manager(modules=spec.plugins))
            assert report["status"] == "finished" and report["items"]["completed"] >= 4, command
            ran += 1
    assert ran == 6


def _out(args: list[str]) -> str:
    return next(a.split("=", 1)[1] for a in args if a.startswith("output_dir="))
