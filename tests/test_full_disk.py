"""A full disk (ENOSPC) anywhere a run writes is a clean stop: one line, run.json says how the run
ended, no temporary file left, what was committed intact, and a resume finishes exactly."""

import errno
import json
import os
import subprocess
import threading
import uuid

import pytest

import forge.io.journal
import forge.io.nofollow
from conftest import run_forge, small_run
from forge.io.location import LocalLocation
from forge.io.store import read_journal

N = 24
FAST = small_run(N, "shard_size=4")


def _enospc(what: str) -> OSError:
    return OSError(errno.ENOSPC, f"No space left on device (simulated at {what})")


class _FullAfter:
    """Counts writes to one site and fails from the `nth` on."""

    def __init__(self, nth: int):
        self.nth, self.seen = nth, 0

    def full(self) -> bool:
        self.seen += 1
        return self.seen >= self.nth


def _fill_file_writes(monkeypatch, suffix: str, nth: int) -> None:
    """Small files replaced whole (run.json, report.json, meta.json): half the temporary file
    is written, then the disk is full."""
    real, site = forge.io.nofollow.write_new, _FullAfter(nth)

    def write_new(dir_fd, name, data):
        if name == suffix + ".tmp" and site.full():
            real(dir_fd, name, data[: len(data) // 2])
            raise _enospc(suffix)
        return real(dir_fd, name, data)

    monkeypatch.setattr(forge.io.nofollow, "write_new", write_new)


def _fill_journal(monkeypatch, name: str, nth: int) -> None:
    """Appends to commits.jsonl or pending.jsonl: half the line reaches the disk, then it is full."""
    site = _FullAfter(nth)

    class Torn:
        def __init__(self, f):
            self.f = f

        def write(self, text):
            if site.full():
                self.f.write(text[: len(text) // 2])
                self.f.flush()
                raise _enospc(name)
            return self.f.write(text)

        def __getattr__(self, attr):
            return getattr(self.f, attr)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    real = forge.io.journal.LineJournal._append_file

    def append_file(self, mode):
        f = real(self, mode)
        return Torn(f) if self.name == f"{name}.jsonl" else f

    monkeypatch.setattr(forge.io.journal.LineJournal, "_append_file", append_file)


def _fill_shard_puts(monkeypatch, nth: int) -> None:
    real, site = LocalLocation.put, _FullAfter(nth)

    def put(self, staged, rel):
        if site.full():
            raise _enospc("the shard's flush")
        return real(self, staged, rel)

    monkeypatch.setattr(LocalLocation, "put", put)


SITES = {
    "shard": lambda mp: _fill_shard_puts(mp, 2),
    "commits": lambda mp: _fill_journal(mp, "commits", 2),
    "pending": lambda mp: _fill_journal(mp, "pending", 3),
    "meta": lambda mp: _fill_file_writes(mp, "meta.json", 1),
    "run.json": lambda mp: _fill_file_writes(mp, "run.json", 2),  # the first is the start's own
    "report": lambda mp: _fill_file_writes(mp, "report.json", 1),
}


@pytest.mark.parametrize("site", SITES)
def test_enospc_at_each_write_site_is_a_clean_stop_and_resume_is_exact(tmp_path, monkeypatch, site):
    out = tmp_path / "run"
    with monkeypatch.context() as mp:
        SITES[site](mp)
        try:
            report = run_forge(out, *FAST)
        except Exception as exc:  # noqa: BLE001 - only the start's own writes may refuse, in one line
            from forge.errors import ForgeError

            assert isinstance(exc, ForgeError) and "No space left" in str(exc), exc
            assert site == "meta"
            report = None
    assert not list(out.rglob("*.tmp")), "no temporary file left"
    if report is not None:
        status = json.loads((out / "run.json").read_text())["status"]
        assert status == report["status"] and report["balanced"]
        if site == "report":
            assert status == "finished" and any("report.json could not be written" in w for w in report["warnings"])
        elif site != "run.json":
            assert status == "stopped" and "No space left" in report["error"]
    committed = [i for r in read_journal(out) for i in r["index"]] if (out / "run.json").exists() else []
    assert len(committed) == len(set(committed))
    again = run_forge(out, *FAST, "resume=true") if committed or (out / "run.json").exists() else run_forge(out, *FAST)
    assert again["status"] == "finished" and again["balanced"]
    ids = [i for r in read_journal(out) for i in r["ids"]]
    assert len(ids) == len(set(ids)) == N


@pytest.fixture
def tiny_disk(tmp_path):
    """A 4 MiB tmpfs (root can mount one here, as in CI); skipped where mounting is not allowed."""
    where = tmp_path / "disk"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.parametrize("nth", [1, 3])
def test_a_disk_filled_to_zero_by_another_writer_mid_run(tiny_disk, monkeypatch, nth):
    """Another writer fills the disk to its last byte while the run is between two commits."""
    out = tiny_disk / f"run-{uuid.uuid4().hex[:6]}"
    filled = threading.Event()
    real = LocalLocation.put

    def put(self, staged, rel):
        real(self, staged, rel)
        if not filled.is_set() and len(read_journal(out)) + 1 >= nth:
            with open(tiny_disk / "filler", "wb", buffering=0) as f:  # another writer: all that is left
                try:
                    while True:
                        f.write(b"\0" * 4096)
                except OSError:
                    pass
            filled.set()

    monkeypatch.setattr(LocalLocation, "put", put)
    report = run_forge(out, *FAST)
    assert filled.is_set(), report
    assert report["status"] == "stopped" and "No space left" in report["error"]
    assert report["balanced"]
    assert json.loads((out / "run.json").read_text())["status"] == "stopped"
    assert not list(out.rglob("*.tmp"))
    committed = [i for r in read_journal(out) for i in r["index"]]
    assert len(committed) == len(set(committed)) >= 4 * (nth - 1)
    os.remove(tiny_disk / "filler")  # room again: a resume finishes
    monkeypatch.setattr(LocalLocation, "put", real)
    again = run_forge(out, *FAST, "resume=true")
    assert again["status"] == "finished" and again["items"]["resumed"] == len(committed)
    ids = [i for r in read_journal(out) for i in r["ids"]]
    assert len(ids) == len(set(ids)) == N
