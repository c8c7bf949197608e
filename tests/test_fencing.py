"""Nothing lost when the lock is defeated from outside: a lock file removed or replaced while the
run is live, a lease holder paused past its time (also in the middle of a commit). Every commit
carries its session's fencing token; a late one never counts, and a holder that lost the
directory writes and deletes nothing there again."""

import json
import os
import shutil
import time
from pathlib import Path

import fsspec
import pytest

from conftest import forge_process, small_run
from forge.errors import LockLost
from forge.io.store import RunStore, read_journal

N = 40


def _shard(store: RunStore, k: int, index: list[int]) -> str:
    name = f"results/{store.shard_name(k, '.bin')}"
    store.write_shard(name, lambda path: Path(path).write_bytes(b"x" * 8), {"index": index, "ids": index})
    return name


def _ids(run) -> list[int]:
    return [i for record in read_journal(run) for i in record["index"]]


@pytest.fixture(params=["removed", "replaced"])
def defeat(request):
    """Defeat a local run directory's lock from outside, as a user, a sync tool or a restore would."""

    def act(run: Path) -> None:
        lock = run / "lock.json"
        if request.param == "removed":
            lock.unlink()
        else:
            shutil.copy(lock, run / "copy")
            os.replace(run / "copy", lock)  # same name, a new file

    return act


def test_a_holder_whose_lock_file_is_defeated_stops_and_deletes_nothing(tmp_path, defeat):
    run = tmp_path / "run"
    old = RunStore(run, {"f": 1})
    first = _shard(old, 0, [0, 1])
    defeat(run)
    with pytest.raises(LockLost, match="lock.json was (removed|replaced) while this run held it"):
        _shard(old, 1, [2])  # it re-takes nothing: it stops before its next commit
    new = RunStore(run, {"f": 1}, resume=True)  # the lock is free to take: a second run gets in
    assert new.committed == {0, 1} and new.session == 1
    mine = [_shard(new, 0, [2, 3]), _shard(new, 1, [4])]
    status_before = (run / "run.json").read_bytes()
    old.close("finished")  # its clean-up: no run.json, no deletion, no lock touched
    assert (run / "run.json").read_bytes() == status_before
    assert all((run / rel).exists() for rel in [first, *mine])
    with pytest.raises(LockLost):
        old.write_file("report.json", "{}")
    new.close("finished")
    assert _ids(run) == [0, 1, 2, 3, 4]
    assert json.loads((run / "run.json").read_text())["status"] == "finished"


def _pause_in_commit(store: RunStore, before_record: bool, takeover):
    """The holder is paused in the middle of its next commit: after its shard is in place and
    before (`before_record`: the token not yet verified) or after it verified its token; a
    successor takes the directory meanwhile (`takeover()`)."""
    if before_record:
        store.fault = lambda point: takeover() if point == "commit_record" else None
        return
    append = store._journal.append

    def paused(record, session, n):
        takeover()
        append(record, session, n)

    store._journal.append = paused


@pytest.mark.parametrize("before_record", [True, False], ids=["before-verify", "after-verify"])
def test_a_local_holder_paused_inside_a_commit_never_counts_twice(tmp_path, before_record):
    run = tmp_path / "run"
    old = RunStore(run, {"f": 1})
    _shard(old, 0, [0])
    taken = []

    def takeover():
        (run / "lock.json").unlink()  # the lock defeated while the holder is paused
        taken.append(RunStore(run, {"f": 1}, resume=True))

    _pause_in_commit(old, before_record, takeover)
    late = f"results/{old.shard_name(1, '.bin')}"
    if before_record:
        with pytest.raises(LockLost):
            old.write_shard(late, lambda p: Path(p).write_bytes(b"x"), {"index": [1], "ids": [1]})
        assert not (run / late).exists()  # its own shard, never journaled: removed by its writer
    else:
        old.write_shard(late, lambda p: Path(p).write_bytes(b"x"), {"index": [1], "ids": [1]})  # published late
    new = taken[0]
    assert new.committed == {0}
    assert _ids(run) == [0]  # the late record is sealed off: it does not count for any reader
    _shard(new, 0, [1])  # the successor computes item 1 again: it counts once
    old.close("interrupted")
    new.close("finished")
    assert _ids(run) == [0, 1]
    assert RunStore(run, {"f": 1}, resume=True).committed == {0, 1}


@pytest.mark.parametrize("before_record", [True, False], ids=["before-verify", "after-verify"])
def test_a_lease_holder_paused_past_its_lease_inside_a_commit_deletes_and_duplicates_nothing(
    lease_url, short_lease, before_record
):
    url = lease_url
    old = RunStore(url, {"f": 1})
    _shard(old, 0, [0])
    taken = []

    def takeover():
        old.lock._stop.set()  # paused: no renewals
        time.sleep(1.0)  # past the lease
        new = RunStore(url, {"f": 1}, resume=True)
        taken.append((new, [_shard(new, 0, [5]), _shard(new, 1, [6])]))

    _pause_in_commit(old, before_record, takeover)
    try:
        _shard(old, 1, [1])
    except LockLost:
        assert before_record
    new, mine = taken[0]
    old.close("interrupted")  # after a lost lease its clean-up deletes nothing
    fs, root = fsspec.core.url_to_fs(url)
    assert all(fs.exists(f"{root}/{rel}") for rel in mine)
    assert _ids(url) == [0, 5, 6]
    _shard(new, 2, [1])
    new.close("finished")
    assert _ids(url) == [0, 5, 6, 1]


def test_a_start_that_crashed_before_run_json_leaves_its_token_taken(tmp_path):
    run = tmp_path / "run"
    RunStore(run, {"f": 1}).abandon()
    assert sorted(p.name for p in run.iterdir()) == ["lock.json"]  # a first session leaves nothing
    (run / "sessions").mkdir()
    (run / "sessions" / "000.json").write_text("{}")  # killed after taking its token
    store = RunStore(run, {"f": 1})
    assert store.session == 1
    store.close("finished")


def _wait_for(predicate, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.slow
def test_the_issue_repro_lock_removed_while_live_then_a_resume(tmp_path, faults):
    """Issue 34's first reproduction, end to end: the lock file removed after the first commits,
    a resume runs to the end while the first run is paused in its next commit; the first run then
    stops in one line, and every id is committed exactly once."""
    from forge.io.results import load

    out, go = tmp_path / "x", tmp_path / "go"
    faults(pause_at_commit={"nth": 3, "until": str(go)})
    args = [*small_run(N, "shard_size=4", "runtime.executor=inprocess"), f"output_dir={out}"]
    first = forge_process(*args, env=os.environ.copy())
    try:
        _wait_for(lambda: len(read_journal(out)) >= 2 if (out / "commits.jsonl").exists() else False)
        (out / "lock.json").unlink()
        second = forge_process(*args, "resume=true", env={**os.environ, "FORGE_FAULTS": "{}"})
        said = second.communicate(timeout=300)[0].decode()
        assert second.returncode == 0, said
        go.touch()
        said_first = first.communicate(timeout=300)[0].decode()
    finally:
        first.kill()
        first.wait(30)
    assert first.returncode == 2 and "Traceback" not in said_first, said_first
    assert "lock.json was removed while this run held it" in said_first
    results = load(out)
    ids = list(results.ids)
    assert len(ids) == len(set(ids)) == N
    assert json.loads((out / "run.json").read_text())["status"] == "finished"
    assert json.loads((out / "report.json").read_text())["status"] == "finished"


def test_an_abandoned_first_session_removes_only_the_empty_folders_it_made(tmp_path):
    """Its clean-up never reaches through a link into a folder that is not the run's."""
    run, outside = tmp_path / "run", tmp_path / "outside"
    (outside / "keep").mkdir(parents=True)
    store = RunStore(run, {"f": 1})
    (run / "activations" / "empty").mkdir(parents=True)  # as a sink that failed at start-up leaves it
    (run / "link").symlink_to(outside)  # someone else's, linked in meanwhile
    store.abandon()
    assert (outside / "keep").is_dir()
    assert not (run / "activations").exists()
    assert (run / "link").is_symlink()
