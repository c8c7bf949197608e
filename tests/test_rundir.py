"""The run directory is Forge's alone: a lock with a named holder, no foreign file touched or
deleted, nothing read outside it, a clean stop for every write error, and one line (exit 2,
or 130 when interrupted) for every directory it must refuse."""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import forge_process, run_forge
from forge.cli.app import app
from forge.errors import ForgeError
from forge.io.store import RunStore, read_journal

N = 12
FAST = [
    "devices=auto",
    "devices.limits.max_batch_tokens=1024",
    "devices.limits.max_seq_len=512",
    "budget.tokens_per_step=1024",
    "layers=[1]",
    f"input.limit={N}",
    "shard_size=4",
]
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _shard(store: RunStore, k: int, index: list[int]) -> str:
    name = f"results/{store.shard_name(k, '.bin')}"
    store.write_shard(name, lambda path: Path(path).write_bytes(b"x" * 8), {"index": index, "ids": index})
    return name


def _crash(store: RunStore) -> None:
    """As if the process died: the lock goes (the kernel frees it), no clean-up runs."""
    store._release()


def test_resume_removes_only_the_shards_forge_staged(tmp_path):
    """A crash leaves a shard put in place without its commit record, and a torn staged
    file; resume removes exactly those (they were recorded as pending). A nested run's
    shards and a user's file named shard-* stay, whatever their names."""
    run = tmp_path / "run"
    store = RunStore(run, {"f": 1})
    kept = _shard(store, 0, [0, 1])
    failing = {"point": "commit_record"}
    store.fault = lambda point: (_ for _ in ()).throw(OSError("simulated")) if point == failing["point"] else None
    with pytest.raises(OSError):
        _shard(store, 1, [2, 3])  # in place, never journaled: an orphan
    failing["point"] = "write_shard"
    with pytest.raises(OSError):
        _shard(store, 2, [4])  # recorded as pending, staged, never put in place
    torn = run / "results" / (store.shard_name(2, ".bin") + ".tmp")
    torn.write_bytes(b"xx")  # as a process killed mid-write leaves it
    foreign = [
        run / "mine" / "shard-keep.txt",
        run / "nested" / "activations" / "shard-000-00000.safetensors",
        run / "results" / "shard-999-00000.bin",
    ]
    for path in foreign:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("not Forge's")
    orphan = run / "results" / store.shard_name(1, ".bin")
    assert not orphan.exists()  # a failed commit removes its own shard (its session's name, never journaled)
    orphan.write_bytes(b"x")  # as a process killed between the put and its record leaves it
    _crash(store)
    again = RunStore(run, {"f": 1}, resume=True)
    assert again.committed == {0, 1}
    assert sorted(p.relative_to(run).as_posix() for p in (run / "results").iterdir()) == [
        kept,
        "results/shard-999-00000.bin",
    ]
    assert all(path.read_text() == "not Forge's" for path in foreign)
    again.close("finished")
    assert not (run / "pending.jsonl").exists()


def test_the_issue_repro_a_users_file_survives_resume(tmp_path):
    out = tmp_path / "r"
    run_forge(out, *FAST)
    (out / "mine").mkdir()
    (out / "mine" / "shard-keep.txt").write_text("data\n")
    report = run_forge(out, *FAST, "resume=true")
    assert report["status"] == "finished" and report["items"]["resumed"] == N
    assert (out / "mine" / "shard-keep.txt").read_text() == "data\n"


def test_a_second_run_or_resume_is_refused_naming_the_holder(tmp_path):
    run = tmp_path / "run"
    holder = RunStore(run, {"f": 1})
    for resume in (False, True):
        with pytest.raises(
            ForgeError,
            match=rf"^output_dir={run} is in use by another Forge run \(host \S+, pid "
            rf"{os.getpid()}, started \d{{4}}-.*\); wait for it to end",
        ):
            RunStore(run, {"f": 1}, resume=resume)
    holder.close("finished")
    RunStore(run, {"f": 1}, resume=True).close("finished")


def test_the_fresh_run_check_is_atomic(tmp_path):
    """Eight fresh runs start on one new directory at once: exactly one gets it."""
    run, barrier = tmp_path / "run", threading.Barrier(8)
    won, refused = [], []

    def start():
        barrier.wait()
        try:
            won.append(RunStore(run, {"f": 1}))
        except ForgeError as exc:
            refused.append(str(exc))

    threads = [threading.Thread(target=start) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(refused) == 7
    assert all("in use by another Forge run" in r or "already holds a run" in r for r in refused), refused
    won[0].close("finished")


HOLD = """
import sys, time
from forge.io.store import RunStore
RunStore(sys.argv[1], {"f": 1}, resume=True)
print("held", flush=True)
time.sleep(600)
"""


def test_a_dead_holders_lock_is_taken_over(tmp_path):
    """kill -9 of the holder: the kernel frees its lock, and the next resume takes it."""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == b"held"
        with pytest.raises(ForgeError, match=rf"in use by another Forge run \(host \S+, pid {proc.pid},"):
            RunStore(run, {"f": 1}, resume=True)
    finally:
        proc.kill()
        proc.wait(10)
    RunStore(run, {"f": 1}, resume=True).close("finished")


@pytest.mark.slow
def test_an_object_store_lease_refuses_a_second_run_and_is_taken_over_once_expired(lease_url, short_lease):
    url = lease_url
    holder = RunStore(url, {"f": 1})
    time.sleep(1.2)  # past the first lease time: renewals keep it
    with pytest.raises(ForgeError, match=r"in use by another Forge run .*its lease expires in \d+ s"):
        RunStore(url, {"f": 1}, resume=True)
    _shard(holder, 0, [0])  # still ours: commits go on
    holder.lock._stop.set()  # the holder hangs (or dies): no more renewals
    time.sleep(1.0)
    taker = RunStore(url, {"f": 1}, resume=True)
    with pytest.raises(OSError, match="lease on output_dir=.* is no longer ours"):
        _shard(holder, 1, [1])  # the old holder must not commit any more
    assert taker.committed == {0}
    taker.close("finished")
    assert [r["index"] for r in read_journal(url)] == [[0]]


def test_a_non_empty_directory_that_is_not_a_run_is_refused_before_anything_is_written(tmp_path):
    foreign = tmp_path / "data"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    result = CliRunner().invoke(app, ["run", *FAST, f"output_dir={foreign}"])
    assert result.exit_code == 2 and "is not empty (notes.txt) and holds no Forge run" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]  # no .hydra/, no lock, no report
    with pytest.raises(ForgeError, match="holds no Forge run"):
        RunStore(foreign, {"f": 1}, resume=True)


def test_a_finished_run_is_not_touched_by_a_run_without_resume(tmp_path):
    out = tmp_path / "run"
    assert CliRunner().invoke(app, ["run", *FAST, "runtime.executor=inprocess", f"output_dir={out}"]).exit_code == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    result = CliRunner().invoke(app, ["run", *FAST, "layers=[2]", f"output_dir={out}"])
    assert result.exit_code == 2 and "already holds a run (finished); add resume=true" in result.output
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # .hydra/ and report included


@pytest.mark.parametrize(
    "output_dir,message",
    [
        ("{tmp}/file/run", "cannot read or write there: NotADirectoryError"),
        ("{tmp}/file", "is not a folder; choose another output_dir"),
        ("", "output_dir is empty; set output_dir=PATH"),
        ("{tmp}/dangling", "is a symbolic link to {tmp}/nowhere, which does not exist; make that directory"),
    ],
)
def test_an_unusable_output_dir_is_one_line_and_exit_2(tmp_path, output_dir, message):
    (tmp_path / "file").write_text("a file, not a directory")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    message = message.format(tmp=tmp_path)
    result = CliRunner().invoke(app, ["run", *FAST, f"output_dir={output_dir.format(tmp=tmp_path)}"])
    assert result.exit_code == 2 and message in result.output, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_the_loader_reads_only_inside_the_run(tmp_path):
    from forge.io.results import load

    out = tmp_path / "run"
    run_forge(out, *FAST)
    (tmp_path / "other").mkdir()
    journal = out / "commits.jsonl"
    record = json.loads(journal.read_text().splitlines()[0])
    for crafted in ("../other/shard.safetensors", "/etc/passwd", "activations/../../x"):
        journal.write_text(json.dumps({**record, "file": crafted}) + "\n")
        with pytest.raises(ForgeError, match="not a file inside the run directory"):
            load(out)


def test_shards_get_the_mode_the_rest_of_the_run_has(tmp_path):
    out = tmp_path / "run"
    run_forge(out, *FAST)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.rglob("*") if p.is_file()}
    shards = [m for name, m in modes.items() if name.endswith(".safetensors")]
    assert shards and set(shards) == {modes["report.json"]}, modes


def test_a_shard_writer_error_stops_the_run_cleanly_in_every_format(tmp_path, monkeypatch):
    """safetensors raises its own error on a full disk, outside OSError: still a clean stop."""
    import safetensors.numpy
    from safetensors import SafetensorError

    real, calls = safetensors.numpy.save_file, []

    def full_disk(tensors, path, *args, **kwargs):
        calls.append(path)
        if len(calls) >= 2:
            raise SafetensorError("Error while serializing: IoError(No space left on device)")
        return real(tensors, path, *args, **kwargs)

    monkeypatch.setattr(safetensors.numpy, "save_file", full_disk)
    out = tmp_path / "run"
    report = run_forge(out, *FAST)
    assert report["status"] == "stopped" and "SafetensorError" in report["error"] and report["balanced"]
    assert json.loads((out / "run.json").read_text())["status"] == "stopped"
    assert not list(out.rglob("*.tmp"))
    committed = sum(len(r["index"]) for r in read_journal(out))
    monkeypatch.setattr(safetensors.numpy, "save_file", real)
    report = run_forge(out, *FAST, "resume=true")
    assert report["status"] == "finished" and report["balanced"]
    assert 4 <= report["items"]["resumed"] == committed < N


@pytest.mark.slow
def test_sigterm_during_start_up_is_one_line_and_leaves_no_run(tmp_path, faults):
    out = tmp_path / "run"
    faults(sigterm_at_start=True)
    proc = forge_process(
        *FAST, "runtime.executor=inprocess", "plugins=[faults]", f"output_dir={out}", env=dict(os.environ)
    )
    text = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 130, text
    assert "interrupted during start-up, before any work" in text and "Traceback" not in text
    assert not (out / "run.json").exists()  # no run was left half-started
    faults()
    assert run_forge(out, *FAST)["status"] == "finished"  # and the directory takes a fresh run


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_and_still_writes_the_report(tmp_path, faults):
    out = tmp_path / "run"
    faults(hang={"seconds": 120, "nth": 2})  # a batch that would hold the first Ctrl-C's drain
    proc = forge_process(
        *FAST,
        "runtime.executor=process",
        "plugins=[faults]",
        "runtime.max_in_flight=1",
        "runtime.commit_interval_s=0.1",
        "runtime.batch_timeout_s=300",
        f"output_dir={out}",
        env=dict(os.environ),
    )
    try:
        deadline = time.monotonic() + 120
        while not ((out / "commits.jsonl").exists() and (out / "commits.jsonl").read_text()):
            assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read().decode()
            time.sleep(0.1)
        time.sleep(0.5)  # the second batch hangs now
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
        text = proc.communicate(timeout=60)[0].decode()  # not the 120 s hang, nor the 10 s drain
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 130, text
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "interrupted" and report["error"].startswith("interrupted twice") and report["balanced"]
    assert "Traceback" not in text
    faults()
    report = run_forge(out, *FAST, "resume=true")
    assert report["status"] == "finished" and 0 < report["items"]["resumed"] < N and report["balanced"]
    assert not multiprocessing.active_children()


@pytest.mark.slow
def test_soak_kill9_and_concurrent_resumes_lose_and_duplicate_nothing(tmp_path):
    """A few cycles of `python -m benchmarks.soak` (its longer form is the benchmark)."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.soak import soak

    base = [
        "input.limit=400",
        "layers=[1,4]",
        "shard_size=32",
        "runtime.commit_interval_s=0.5",
        "runtime.executor=inprocess",
    ]
    result = soak(tmp_path / "run", tmp_path / "clean", base, cycles=4, seed=3, max_delay_s=12.0)
    assert result.ok, result.problems
    assert result.ids == result.unique_ids == 400 and result.kills >= 1
    assert result.planted and result.foreign_kept


def test_a_resume_refused_in_start_up_leaves_run_json_as_it_was(tmp_path):
    out = tmp_path / "run"
    run_forge(out, *FAST)
    before = (out / "run.json").read_bytes()
    with pytest.raises(ForgeError):
        run_forge(out, *FAST, "resume=true", "batching=item", "+batching.bogus=1")  # refused after the store opened
    assert (out / "run.json").read_bytes() == before
    assert run_forge(out, *FAST, "resume=true")["items"]["resumed"] == N
