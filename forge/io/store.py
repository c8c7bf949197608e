"""The run directory: what decides results (a fingerprint), and a journal of committed shards.

    run_dir/lock.json       who holds the directory (`forge.io.lock`): one run or resume at a time
    run_dir/run.json        fingerprint, status, sessions
    run_dir/sessions/SSS.json  one per session: its fencing token and what it sealed (`forge.io.journal`)
    run_dir/commits.jsonl   local disk: one line per committed shard: {"file", "session", "index": [...], ...}
    run_dir/commits/SSS-NNNNNN.json   object store: one marker object per committed shard (same record)
    run_dir/pending.jsonl   local disk: one line per shard about to be written: {"file", "session"}
    run_dir/pending/SSS-NNNNNN.json   object store: the same, one marker per shard
    run_dir/<shards>        written by the function's sink through `write_shard`

Model: the journal is the truth. Before a shard is written, its name is recorded as pending;
the shard is then put in place whole, the session's fencing token is verified, and only then
is its commit record written. On resume, a pending shard of an earlier session without a
commit record is an orphan of a crash and is removed, with its staged temporary file: resume
deletes nothing else, so a file Forge did not stage itself is never touched. A resumed run
skips every item whose input index the journal names, so nothing is recomputed or committed
twice. All of it happens under the directory's lock.

The lock can be defeated from outside (its file removed, a lease holder paused past its time),
so it is not trusted alone. Each session takes the next fencing token and seals its
predecessors' journals at what it read (`forge.io.journal`): a commit a defeated holder
publishes late never counts, and a session that finds it no longer holds the directory (`fence`)
stops before its next commit and writes and deletes nothing there again: not run.json, not the
report, not another session's shards.

A directory is a run's when it holds `run.json`. A fresh run refuses a non-empty directory
that is not a run (before writing anything there) and a directory that already holds a run
(unless `resume=True`); both checks happen under the lock, so two runs cannot both pass them.

`run_dir` is a local path or an fsspec URL (`forge.io.location`), and the journal takes the form
the storage makes safe and fast:
- local disk: the shard is written under a temporary name, flushed and renamed into place;
  its record is appended to `commits.jsonl` and flushed. One append per commit; a torn line
  (a crash mid-append) is skipped by readers.
- object store (no rename, append or fsync): the shard is uploaded whole (a PUT is atomic:
  readers never see half an object), then its record is PUT as its own small marker object,
  named by session and commit number so that listing them in name order is commit order.
  A marker is all there or absent, so there is no torn record.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from forge.errors import ForgeError, LockLost
from forge.io import nofollow
from forge.io.fingerprint import fingerprint_changes, same_input_located_alike
from forge.io.journal import PENDING, SESSIONS, Sessions, check_journal_path, counted, open_journal
from forge.io.location import TMP_SUFFIX, Location, check_output_dir, open_location, reach
from forge.io.lock import LOCK_FILE, RunLock, acquire, holder_info
from forge.io.nofollow import check_owner, link_refused

RUN_FILE = "run.json"
SHARD_PREFIX = "shard-"
#: what a directory may hold, and still be taken for a fresh run: what a refused or abandoned start
#: left, or a start that is writing its run.json right now (under a temporary name)
LEFT_BY_A_START = {LOCK_FILE, f"{PENDING}.jsonl", PENDING, SESSIONS, RUN_FILE + TMP_SUFFIX}


class RunStore:
    """The run directory of one run, opened fresh or to resume, and held (locked) until closed.

    `run_dir` is a local path or an fsspec URL. `fingerprint` is a JSON-able dict of
    everything that decides results (function, model, input content, layers, ...). Opening a
    directory that already holds a run needs `resume=True` and the same fingerprint; a
    non-empty directory that holds no run is refused.
    """

    def __init__(
        self,
        run_dir: Path | str,
        fingerprint: dict[str, Any],
        resume: bool = False,
        fault: Callable[[str], None] | None = None,
    ):
        # fault: called with a point's name (a test seam): "write_shard" once a shard is written
        # but not in place, "commit_record" once it is in place but its record is not written
        self.fault = fault
        check_output_dir(run_dir)
        self.where = open_location(run_dir)
        self.dir = self.where.root  # a Path for a local directory, else the URL (use `url` and `write_file`)
        self.fingerprint = json.loads(json.dumps(fingerprint, default=str))  # as it reads back
        self.committed: set[int] = set()  # input indexes of committed items (earlier sessions)
        self.shards: list[dict] = []  # journal records of earlier sessions that count
        self.session = 0  # this session's number and fencing token: shard names stay unique across crashes
        self.lost: str | None = None  # why the directory is no longer this session's (then nothing is written)
        self._sessions = Sessions(self.where)
        self._journal = open_journal(self.where)
        self._pending = open_journal(self.where, PENDING, durable=False)
        self._commits = 0  # records this session wrote or tried to write
        self._written: set[str] = set()  # shards this session committed
        self._previous: bytes | None = None  # run.json as an earlier session left it
        reach(run_dir, lambda: self._refuse_foreign(run_dir))  # before anything is written there
        self.lock: RunLock | None = reach(run_dir, lambda: acquire(self.where, run_dir))
        try:
            reach(run_dir, lambda: self._open(run_dir, resume))
        except BaseException:
            self._release()
            raise

    def _refuse_foreign(self, run_dir) -> None:
        _refuse_foreign(self.where, run_dir)

    def _open(self, run_dir, resume: bool) -> None:
        previous = _previous_run(self.where, run_dir, resume)
        self._previous = None if previous is None else self.where.read_bytes(RUN_FILE)  # restored if abandoned
        taken = self._sessions.numbers()  # a start that crashed before its run.json leaves its number taken
        self.session = max(int((previous or {}).get("sessions", 0)), taken[-1] + 1 if taken else 0)
        if previous is None:
            self._refuse_foreign(run_dir)  # again, under the lock
        else:
            old = previous.get("fingerprint", {})
            changes = fingerprint_changes(old, same_input_located_alike(old, self.fingerprint))
            if changes:
                raise ForgeError(
                    f"resume refused: {'; '.join(changes)} since the run in {run_dir} started; "
                    "run with its settings again, or choose a new output_dir"
                )
            self.shards = counted(self._journal.read(repair=True), self._sessions.seals())
            for record in self.shards:
                check_journal_path(record.get("file"), run_dir)
                self.committed.update(record["index"])
        # the token is taken after the journal is read: what it seals is exactly what this session counts
        self._sessions.take(self.session, self.shards, holder_info(), run_dir)
        self._remove_orphans({record["file"] for record in self.shards}, earlier=True)
        self.status = "running"
        self._save()

    def _remove_orphans(self, known: set[str], earlier: bool) -> None:
        """Shards recorded as pending but never committed, and their staged files: a crashed
        earlier session's (`earlier`, on resume) or this session's own (at close). Nothing else
        is removed: only what Forge staged, by the names it recorded, under the session's token."""
        for record in self._pending.read(repair=earlier):
            rel, session = record.get("file"), record.get("session")
            mine = session == self.session
            if not isinstance(rel, str) or rel in known or (mine if earlier else not mine):
                continue
            check_journal_path(rel, self.dir)
            self.where.remove(rel)
            if self.where.durable_rename:
                self.where.remove(rel + TMP_SUFFIX)
        self._pending.clear()

    # -- fencing ----------------------------------------------------------------
    def fence(self) -> None:
        """Raise LockLost unless the directory is still this session's: its lock held (the lock
        file still the one locked, the lease renewed) and no later session started."""
        if self.lost is None:
            try:
                if self.lock is not None:
                    self.lock.check()
                if self._sessions.superseded(self.session):
                    raise LockLost(
                        f"a later session of this run took output_dir={self.dir} over; nothing more is committed"
                    )
            except LockLost as exc:
                self.lost = str(exc)
        if self.lost is not None:
            raise LockLost(self.lost)

    # -- writing ----------------------------------------------------------------
    def write_shard(self, rel_path: str, write: Callable[[Path], None], record: dict[str, Any]) -> None:
        """Write one shard whole, then journal it. `write(path)` writes the shard to a local
        path (a temporary name; the store puts it in place). `record` must hold "index"
        (input indexes of its items). Any failure (a full disk, a store error, the writer
        library's own error, the directory lost) raises OSError, and nothing of the shard is
        committed. The commit is fenced: put in place, then the token verified, then published."""
        n, self._commits = self._commits, self._commits + 1  # never reused, even after a failure
        staged, placed = None, False
        try:
            self.fence()
            self._pending.append({"file": rel_path, "session": self.session}, self.session, n)
            staged = self.where.staging(rel_path)
            write(staged)
            if self.fault is not None:
                self.fault("write_shard")
            self.where.put(staged, rel_path)
            staged, placed = None, True
            if self.fault is not None:
                self.fault("commit_record")
            self.fence()
            placed = False  # from here the record may be on disk even if the append fails: resume decides
            self._journal.append({"file": rel_path, "session": self.session, **record}, self.session, n)
            self._written.add(rel_path)
        except OSError:
            raise
        except Exception as exc:  # noqa: BLE001 - a writer's or store package's own error: a write error all the same
            raise OSError(f"{type(exc).__name__}: {exc}") from exc
        finally:
            # this session's own shard, named with its token and never journaled: nobody else's file
            for leftover in ([staged] if staged is not None else []) + ([rel_path] if placed else []):
                try:
                    (leftover.unlink(missing_ok=True) if isinstance(leftover, Path) else self.where.remove(leftover))
                except OSError:
                    pass  # resume removes it: it is recorded as pending

    def write_file(self, rel_path: str, data: bytes | str) -> None:
        """A small file of the run (metadata), replaced whole; not journaled. Fenced: a run that
        lost its directory writes nothing there (LockLost)."""
        self.fence()
        self.where.write_bytes(rel_path, data.encode() if isinstance(data, str) else data)

    def add_missing(self, files: dict[str, bytes]) -> None:
        """Files of the run written only where absent (Hydra's .hydra/ of the first session)."""
        for rel, data in files.items():
            if not self.where.exists(rel):
                self.write_file(rel, data)

    def url(self, rel_path: str = "") -> str:
        """Where a file of the run lives (a local path or a URL), for reports."""
        return self.where.url(rel_path)

    def shard_name(self, k: int, suffix: str) -> str:
        """A shard file name unique across sessions of this run."""
        return f"{SHARD_PREFIX}{self.session:03d}-{k:05d}{suffix}"

    # -- status -----------------------------------------------------------------
    def _save(self) -> None:
        data = json.dumps(
            {"fingerprint": self.fingerprint, "status": self.status, "sessions": self.session + 1},
            indent=2,
            default=str,
        ).encode()
        try:
            self.write_file(RUN_FILE, data)
        except OSError as exc:
            if exc.errno != errno.ENOSPC or not self.where.durable_rename:
                raise
            _overwrite_in_place(Path(self.where.root) / RUN_FILE, data)

    def _release(self) -> None:
        self._journal.close()
        self._pending.close()
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        self.where.close()

    def abandon(self) -> None:
        """A session refused or interrupted during start-up: a first session leaves no run
        behind, a resumed one leaves run.json as it found it (one that committed already is
        closed as interrupted)."""
        if self._commits:
            return self.close("interrupted")
        try:
            self.fence()
            if self._previous is None:
                self.where.remove(RUN_FILE)
                self._sessions.drop(self.session)
                self._remove_empty_folders()  # the directory was empty (or a refused start's) when it was taken
            else:
                self.where.write_bytes(RUN_FILE, self._previous)
        except LockLost:
            pass  # someone else's directory now: leave it as it is
        finally:
            self._release()

    def _remove_empty_folders(self) -> None:
        if not self.where.durable_rename:
            return  # an object store has no folders of its own
        # bottom up, never through a link: a folder a link points at is not this run's
        for top, folders, _ in os.walk(self.where.root, topdown=False, followlinks=False):
            for name in folders:
                try:
                    os.rmdir(os.path.join(top, name))  # only an empty one: a file in it is never touched
                except OSError:
                    pass

    def close(self, status: str) -> None:
        """Record how this session ended (finished, interrupted, stopped: ...) and release the
        directory. Call it after the report is written: the lock covers the report too. A
        session that lost the directory writes and deletes nothing there."""
        try:
            self._journal.close()
            self.fence()
            self.status = status
            self._save()
            # a shard whose write failed this session: the journal as it now stands decides
            self._remove_orphans({r["file"] for r in counted(self._journal.read(), self._sessions.seals())}, False)
        except LockLost:
            pass
        except OSError:
            pass  # a clean-up on a failing disk: what it left is recorded as pending, and resume removes it
        finally:
            self._release()


def _overwrite_in_place(path: Path, data: bytes) -> None:
    """run.json rewritten in its own blocks, when a full disk has no room for a new copy: the
    status must still say how the run ended. Not atomic, so only the fallback."""
    with os.fdopen(nofollow.open_file(path.parent, path.name, os.O_RDWR), "r+b") as f:
        f.write(data)
        f.truncate(len(data))
        f.flush()
        os.fsync(f.fileno())


def _refuse_foreign(where: Location, run_dir) -> None:
    """A non-empty directory that holds no run (only what a refused start left is allowed)."""
    names = where.entries()
    if where.durable_rename:
        _refuse_links(Path(where.root), names)
    if RUN_FILE in names or not set(names) - LEFT_BY_A_START:
        return
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    raise ForgeError(
        f"output_dir={run_dir} is not empty ({shown}) and holds no Forge run; Forge writes only "
        "into a new or empty directory or into its own run: choose another output_dir"
    )


#: what a local entry that a start leaves must be (any other kind, a link above all, is refused)
_FOLDERS_LEFT = {PENDING, SESSIONS}


def _refuse_links(root: Path, names: list[str]) -> None:
    """A local run directory of another user's, or one whose own entries are links or of the
    wrong kind, is refused before anything is read or written there (`forge.io.nofollow`)."""
    check_owner(root)
    for name in names:
        if name not in LEFT_BY_A_START and name != RUN_FILE:
            continue
        mode = os.lstat(root / name).st_mode
        if not (stat.S_ISDIR(mode) if name in _FOLDERS_LEFT else stat.S_ISREG(mode)):
            raise link_refused(root / name)


def _previous_run(where: Location, run_dir, resume: bool) -> dict | None:
    """The run the directory holds (None: none); one without `resume` is refused."""
    if not where.exists(RUN_FILE):
        return None
    try:
        previous = json.loads(where.read_bytes(RUN_FILE))
    except ValueError:
        raise ForgeError(f"output_dir={run_dir}: its {RUN_FILE} is damaged; choose a new output_dir") from None
    if not resume:
        raise ForgeError(
            f"output_dir={run_dir} already holds a run ({previous.get('status', 'unknown')}); "
            "add resume=true to finish it, or choose a new output_dir"
        )
    return previous


def check_run_dir(run_dir: Path | str, resume: bool) -> None:
    """The refusals a run would give for this directory, checked before anything (Hydra
    included) writes there. Read-only; the run checks again under the lock."""
    where = open_location(run_dir)

    def check() -> None:
        _refuse_foreign(where, run_dir)
        _previous_run(where, run_dir, resume)

    reach(run_dir, check)


def check_sweep_dir(output_dir: str) -> None:
    """A sweep's directory holds one numbered run directory per job and nothing else."""
    where = open_location(output_dir)
    names = reach(output_dir, where.entries)
    foreign = [n for n in names if not n.isdigit()]
    if foreign:
        raise ForgeError(
            f"output_dir={output_dir} holds {', '.join(foreign[:3])}, which is not a job of a Forge "
            "sweep (a sweep writes only numbered run directories); choose another output_dir"
        )


def read_journal(run_dir: Path | str) -> list[dict]:
    """The committed shards of a run directory (a local path or a URL), in commit order. A
    record naming a file outside the run directory is refused (`check_journal_path`)."""
    where = open_location(run_dir)
    records = counted(open_journal(where).read(), Sessions(where).seals())
    for record in records:
        check_journal_path(record.get("file"), run_dir)
    return records
