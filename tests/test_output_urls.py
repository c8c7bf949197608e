"""output_dir as an fsspec URL: a run to memory:// equals a local run, resumes after a fault in
the middle of a commit with nothing lost or duplicated, and a protocol whose package is missing
is one line before any work.

memory:// lives in this process, so runs here go through `execute` or the in-process CLI
runner (the process executor works too: workers return outputs and the driver writes).
"""

import json
import sys
import uuid
from pathlib import Path

import fsspec
import pytest
from typer.testing import CliRunner

from conftest import assert_same_output, clean_activations, run_forge, small_run
from forge.cli.app import app
from forge.errors import ForgeError
from forge.io.location import check_output_dir, hydra_dir
from forge.io.store import read_journal

N = 16
FAST = small_run(N, "batching.merge_groups=false")  # the shard counts these tests are planned on


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return clean_activations(tmp_path_factory.mktemp("clean"), *FAST, n=N)


@pytest.fixture
def url():
    """A fresh memory:// run directory, dropped after the test."""
    path = f"/forge-test-{uuid.uuid4().hex[:8]}/run"
    yield f"memory://{path}"
    fs = fsspec.filesystem("memory")
    if fs.exists(path.rsplit("/", 1)[0]):
        fs.rm(path.rsplit("/", 1)[0], recursive=True)


def _files(url: str) -> set[str]:
    fs, path = fsspec.core.url_to_fs(url)
    return {p[len(path) + 1 :] for p in fs.find(path)}


def _read_json(url: str, rel: str):
    fs, path = fsspec.core.url_to_fs(url)
    return json.loads(fs.cat_file(f"{path}/{rel}"))


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["inprocess", "process"])
def test_a_run_to_a_memory_url_equals_a_local_run(url, clean, executor):
    report = run_forge(url, *FAST, f"runtime.executor={executor}", "shard_size=8")
    assert report["status"] == "finished" and report["balanced"], report["imbalance"]
    assert report["outputs"]["activations"] == f"{url}/activations"
    files = _files(url)
    markers = sorted(f for f in files if f.startswith("commits/"))
    shards = sorted(f for f in files if f.startswith("activations/shard-"))
    assert len(markers) == len(shards) == report["outputs"]["shards"] >= 2  # one marker object per shard
    assert "commits.jsonl" not in files and not any(f.endswith(".tmp") for f in files)
    assert [r["file"] for r in read_journal(url)] == shards  # the journal: markers in commit order
    assert _read_json(url, "run.json")["status"] == "finished"
    assert _read_json(url, "report.json")["items"]["completed"] == N
    assert_same_output(url, clean, atol=1e-5)


def _shards(out) -> set[str]:
    if isinstance(out, Path):
        return {p.relative_to(out).as_posix() for p in out.rglob("shard-*")}
    return {f for f in _files(out) if f.rpartition("/")[2].startswith("shard-")}


@pytest.mark.slow
@pytest.mark.parametrize("where", ["memory", "local"])
def test_a_fault_in_the_middle_of_a_commit_then_resume(url, tmp_path, faults, clean, where):
    """From the 2nd shard on, shards are put in place but their commit records fail: the run
    stops cleanly and removes the shard it could not commit (it had recorded it as pending);
    resume skips what was committed, and every item is committed exactly once. (An orphan
    left by a crash is test_rundir's; a shard write that fails before the shard is in place
    is test_faults' full disk.)"""
    out = url if where == "memory" else tmp_path / "run"
    args = [*FAST, "runtime.executor=inprocess", "shard_size=8"]
    faults(fail_commit=2)
    report = run_forge(out, *args, "plugins=[faults]")
    assert report["status"] == "stopped" and "(simulated)" in report["error"] and report["balanced"]
    journal = read_journal(out)
    committed = sum(len(r["index"]) for r in journal)
    assert _shards(out) == {r["file"] for r in journal} and 8 <= committed < N  # no orphan stays
    faults()
    report = run_forge(out, *args, "resume=true")
    assert report["status"] == "finished" and report["balanced"], report["imbalance"]
    assert report["items"]["resumed"] == committed and report["items"]["completed"] == N
    assert _shards(out) == {r["file"] for r in read_journal(out)}
    if where == "memory":
        assert _read_json(url, "run.json")["sessions"] == 2
    assert_same_output(out, clean, atol=1e-5)


@pytest.mark.parametrize("protocol,package", [("s3", "s3fs"), ("gs", "gcsfs")])
def test_a_protocol_whose_package_is_missing_is_one_line_before_work(monkeypatch, tmp_path, protocol, package):
    monkeypatch.setitem(sys.modules, package, None)  # import fails, installed or not
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ForgeError,
        match=rf"^output_dir={protocol}://bucket/run: the {protocol}:// protocol needs a "
        rf"package that is not installed: pip install {package}$",
    ):
        check_output_dir(f"{protocol}://bucket/run")
    result = CliRunner().invoke(app, ["run", f"output_dir={protocol}://bucket/run"])
    assert result.exit_code == 2 and f"pip install {package}" in result.output
    assert "Traceback" not in result.output and "\n" not in result.output.strip()
    assert not list(tmp_path.iterdir())  # nothing made locally, no run started
    with pytest.raises(ForgeError, match="fsspec knows no protocol 'nosuch'"):
        check_output_dir("nosuch://bucket/run")


def test_cli_to_a_url_keeps_hydra_files_with_the_run(url, tmp_path, monkeypatch):
    """Hydra writes .hydra/ to a local staging folder; it is copied to the URL and the folder
    removed, and nothing named after the URL appears locally."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(
        app, ["run", f"output_dir={url}", "runtime.executor=inprocess", *FAST[:-2], "input.limit=8"]
    )
    assert result.exit_code == 0, result.output
    files = _files(url)
    assert {".hydra/config.yaml", ".hydra/overrides.yaml", "report.json", "run.json", "activations/meta.json"} <= files
    assert _read_json(url, "report.json")["items"]["completed"] == 8
    assert not list(tmp_path.iterdir()) and not Path(hydra_dir(url)).exists()


def test_a_run_directory_that_cannot_be_written_is_one_line(tmp_path):
    from forge.io.store import RunStore

    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(ForgeError, match=r"^output_dir=.*/file/run: cannot read or write there: \w+Error: "):
        RunStore(tmp_path / "file" / "run", {"model": "m"})


def test_hydra_jobs_map_to_run_directories_under_the_url():
    from forge.io.location import run_dir_of

    url = "s3://bucket/runs/sweep"
    assert run_dir_of(url, hydra_dir(url)) == url
    assert run_dir_of(url, f"{hydra_dir(url)}/3") == f"{url}/3"  # a sweep's job
    # Hydra never writes into a local run directory either: a staging folder of this process
    for local in ("file:///data/run", "outputs/x"):
        assert not hydra_dir(local).startswith(("/data", "outputs")) and hydra_dir(local) != hydra_dir(url)
    assert run_dir_of("file:///data/run", f"{hydra_dir('file:///data/run')}/2") == Path("/data/run/2")
    assert run_dir_of("outputs/x", hydra_dir("outputs/x")) == Path("outputs/x")
