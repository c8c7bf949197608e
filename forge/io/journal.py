"""The journal of a run directory, and the session records that fence it.

    run_dir/commits.jsonl      local disk: one line per committed shard {"file", "session", "index": [...], ...}
    run_dir/commits/SSS-NNNNNN.json   object store: one marker object per committed shard (same record)
    run_dir/pending.jsonl / pending/  the same forms, one record per shard about to be written {"file", "session"}
    run_dir/sessions/SSS.json  one record per session, created exclusively when it takes the directory

**Fencing.** A session's number is its fencing token: it only grows, and each holder of the
directory gets the next one by creating `sessions/SSS.json`, which nobody ever overwrites. A
holder's commit is published only while no later session record exists: it puts its shard in
place, checks for one (`Sessions.superseded`), then appends its journal record, which carries
its session. Check and append are two steps, so a holder paused between them (SIGSTOP, a VM
pause) or one whose lock was defeated from outside may still append after a successor took
over. The successor's session record therefore *seals* its predecessors: it holds, for each
earlier session, how many of its records the successor read. A reader counts only a sealed
session's first that-many records, so a late record is never counted, by the successor's resume
or by any reader later: a commit is either fully before the takeover or not at all.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import IO, Any

from forge.errors import ForgeError
from forge.io import nofollow
from forge.io.location import Location

JOURNAL = "commits"  # commits.jsonl on a local disk, commits/ on an object store
PENDING = "pending"  # pending.jsonl / pending/: shards about to be written
SESSIONS = "sessions"  # sessions/SSS.json: one per session, its fencing token and its seals


class LineJournal:
    """<name>.jsonl on a local disk: appended and flushed, one line per record."""

    def __init__(self, where: Location, name: str = JOURNAL, durable: bool = True):
        self.root, self.name = Path(where.root), f"{name}.jsonl"
        self.path = self.root / self.name
        self.durable = durable  # fsync each record (commits); pending records need only survive the process
        self._file: IO[Any] | None = None
        self.broken = False  # an append failed part-way: nothing more is appended this session

    def read(self, repair: bool = False) -> list[dict]:
        """The records, in commit order. A line that does not parse (a torn append, a crash
        mid-write) is skipped; with `repair` a torn last line is ended, so the next append
        starts a line of its own. Nothing is truncated: a writer that is still alive (a holder
        whose lock was defeated) may be appending, and its records are fenced, not cut."""
        try:
            data = nofollow.read_bytes(self.root, self.name)
        except FileNotFoundError:
            return []
        records = []
        for raw in data.splitlines():
            try:
                record = json.loads(raw)
            except ValueError:
                continue
            if isinstance(record, dict):
                records.append(record)
        if repair and data and not data.endswith(b"\n"):
            with self._append_file("ab") as f:
                f.write(b"\n")
        return records

    def _append_file(self, mode: str) -> IO[Any]:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
        return os.fdopen(nofollow.open_file(self.root, self.name, flags), mode)

    def open(self) -> None:
        if self._file is None:
            self._file = self._append_file("a")

    def append(self, record: dict, session: int, n: int) -> None:
        if self.broken:
            raise OSError(f"{self.path.name}: an earlier append failed; nothing more is appended this session")
        self.open()
        assert self._file is not None
        try:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
            if self.durable:
                os.fsync(self._file.fileno())
        except OSError:
            self.broken = True  # a part of the line may be on disk: the reader skips it, nothing follows it
            raise

    def clear(self) -> None:
        """Drop every record (they have all been acted on)."""
        self.close()
        nofollow.unlink(self.root, self.name)

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass  # a flush that fails at close: every record was flushed when appended
            self._file = None


class MarkerJournal:
    """<name>/SSS-NNNNNN.json on an object store: one whole object per record."""

    def __init__(self, where: Location, name: str = JOURNAL, durable: bool = True):
        self.where = where
        self.folder = name

    def _markers(self) -> list[tuple[tuple[int, ...], str]]:
        found = []
        for rel in self.where.files(self.folder):
            folder, _, name = rel.rpartition("/")
            if folder != self.folder or not name.endswith(".json"):
                continue
            try:
                found.append((tuple(int(part) for part in name[:-5].split("-")), rel))
            except ValueError:
                continue
        return sorted(found)

    def read(self, repair: bool = False) -> list[dict]:
        records = []
        for _, rel in self._markers():
            try:
                records.append(json.loads(self.where.read_bytes(rel)))
            except ValueError:  # never on an atomic store; a marker that does not parse commits nothing
                if repair:
                    self.where.remove(rel)
        return records

    def open(self) -> None:
        pass

    def append(self, record: dict, session: int, n: int) -> None:
        self.where.write_bytes(f"{self.folder}/{session:03d}-{n:06d}.json", json.dumps(record).encode())

    def clear(self) -> None:
        for _, rel in self._markers():
            self.where.remove(rel)

    def close(self) -> None:
        pass


def open_journal(where: Location, name: str = JOURNAL, durable: bool = True) -> LineJournal | MarkerJournal:
    return (LineJournal if where.durable_rename else MarkerJournal)(where, name, durable)


class Sessions:
    """The session records of a run directory: who took it in turn, and what each sealed."""

    def __init__(self, where: Location):
        self.where = where

    @staticmethod
    def rel(session: int) -> str:
        return f"{SESSIONS}/{session:03d}.json"

    def numbers(self) -> list[int]:
        found = []
        for rel in self.where.files(SESSIONS):
            name = rel.rpartition("/")[2]
            if name.endswith(".json") and name[:-5].isdigit():
                found.append(int(name[:-5]))
        return sorted(found)

    def seals(self) -> dict[int, int]:
        """For each sealed session, how many of its records count (the least any successor saw)."""
        sealed: dict[int, int] = {}
        for number in self.numbers():
            try:
                record = json.loads(self.where.read_bytes(self.rel(number)))
            except (ValueError, FileNotFoundError):
                continue
            for session, count in record.get("seals", {}).items():
                sealed[int(session)] = min(int(count), sealed.get(int(session), int(count)))
        return sealed

    def take(self, session: int, records: list[dict], info: dict[str, Any], run_dir) -> None:
        """Create this session's record, sealing every earlier session at the records read."""
        seen = Counter(r.get("session") for r in records)
        already = self.seals()
        seals = {str(s): seen.get(s, 0) for s in range(session) if s not in already}
        record = json.dumps({"session": session, **info, "seals": seals}).encode()
        if not self.where.create(self.rel(session), record):
            raise ForgeError(
                f"output_dir={run_dir}: another Forge run took session {session} of this run at the same "
                "moment (its lock was defeated from outside); wait for it to end, or choose another output_dir"
            )

    def superseded(self, session: int) -> bool:
        """True once a later session took the directory (this one's token is no longer current)."""
        return self.where.exists(self.rel(session + 1))

    def drop(self, session: int) -> None:
        """Remove this session's own record (a first session that leaves no run behind)."""
        self.where.remove(self.rel(session))
        if self.where.durable_rename and not self.numbers():
            try:
                (Path(self.where.root) / SESSIONS).rmdir()  # an object store has no empty folders
            except OSError:
                pass


def counted(records: list[dict], seals: dict[int, int]) -> list[dict]:
    """The records that count: a sealed session's first records up to its seal, every record of
    a session that nobody sealed (the last one, or one journaled before fencing existed)."""
    if not seals:
        return records
    seen: Counter = Counter()
    kept = []
    for record in records:
        session = record.get("session")
        if isinstance(session, int) and session in seals:
            seen[session] += 1
            if seen[session] > seals[session]:
                continue  # appended after a successor took over: fenced off
        kept.append(record)
    return kept


def check_journal_path(rel: Any, run_dir) -> str:
    """A journaled file name, if it stays inside the run directory (a relative path without
    '..'); a corrupt or crafted journal is one line, never a read elsewhere."""
    if (
        not isinstance(rel, str)
        or not rel
        or rel.startswith("/")
        or "\\" in rel
        or ":" in rel
        or any(part in ("", ".", "..") for part in rel.split("/"))
    ):
        raise ForgeError(
            f"{run_dir}: its journal names {rel!r}, which is not a file inside the run directory; "
            "the journal is damaged: restore commits from a copy, or run again into a new output_dir"
        )
    return rel
