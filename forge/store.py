"""The run directory: what decides results (a fingerprint), and a journal of committed shards.

    run_dir/run.json        fingerprint, status, sessions
    run_dir/commits.jsonl   local disk: one line per committed shard: {"file", "index": [...], ...}
    run_dir/commits/SSS-NNNNNN.json   object store: one marker object per committed shard (same record)
    run_dir/<shards>        written by the function's sink through `write_shard`

Model: the journal is the truth. A shard is first put in place whole, and only then is its
commit record written; a shard without a record is an orphan from a crash and is removed on
resume. A resumed run skips every item whose input index the journal names, so nothing is
recomputed or committed twice.

`run_dir` is a local path or an fsspec URL (`forge.location`), and the journal takes the form
the storage makes safe and fast:
- local disk: the shard is written under a temporary name, flushed and renamed into place;
  its record is appended to `commits.jsonl` and flushed. One append per commit; a torn last
  line (a crash mid-append) is cut off on resume.
- object store (no rename, append or fsync): the shard is uploaded whole (a PUT is atomic:
  readers never see half an object), then its record is PUT as its own small marker object,
  named by session and commit number so that listing them in name order is commit order.
  A marker is all there or absent, so there is no torn record to cut.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from forge.errors import ForgeError
from forge.location import Location, open_location, reach

RUN_FILE = "run.json"
JOURNAL = "commits.jsonl"
MARKERS = "commits"
SHARD_PREFIX = "shard-"
TMP_SUFFIX = ".tmp"


def fingerprint_changes(old: dict, new: dict, where: str = "") -> list[str]:
    """What differs between two fingerprints, in words: 'layers: [1, 2] -> [1, 4]'."""
    changes = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changes += fingerprint_changes(a, b, f"{where}{key}.")
        elif a != b:
            changes.append(f"{where}{key}: {a!r} -> {b!r}")
    return changes


class _LineJournal:
    """commits.jsonl on a local disk: appended and flushed, one line per commit."""

    def __init__(self, where: Location):
        self.path = Path(where.root) / JOURNAL
        self._file = None

    def read(self, repair: bool = False) -> list[dict]:
        """The records, in commit order; a torn last line is ignored (cut off with `repair`)."""
        if not self.path.exists():
            return []
        records, good = [], 0
        with open(self.path, "rb") as f:
            for raw in f:
                if not raw.endswith(b"\n"):
                    break
                try:
                    records.append(json.loads(raw))
                except ValueError:
                    break  # a torn last line: the shard it named is an orphan
                good += len(raw)
        if repair:
            with open(self.path, "r+b") as f:
                f.truncate(good)
        return records

    def append(self, record: dict, session: int, n: int) -> None:
        import os

        if self._file is None:
            self._file = open(self.path, "a")
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class _MarkerJournal:
    """commits/SSS-NNNNNN.json on an object store: one whole object per commit."""

    def __init__(self, where: Location):
        self.where = where

    def _markers(self) -> list[tuple[tuple[int, ...], str]]:
        found = []
        for rel in self.where.files(MARKERS):
            folder, _, name = rel.rpartition("/")
            if folder != MARKERS or not name.endswith(".json"):
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

    def append(self, record: dict, session: int, n: int) -> None:
        self.where.write_bytes(f"{MARKERS}/{session:03d}-{n:06d}.json", json.dumps(record).encode())

    def close(self) -> None:
        pass


def _journal(where: Location):
    return _LineJournal(where) if where.durable_rename else _MarkerJournal(where)


class RunStore:
    """The run directory of one run, opened fresh or to resume.

    `run_dir` is a local path or an fsspec URL. `fingerprint` is a JSON-able dict of
    everything that decides results (function, model, input content, layers, ...). Opening a
    directory that already holds a run needs `resume=True` and the same fingerprint.
    """

    def __init__(self, run_dir: Path | str, fingerprint: dict[str, Any], resume: bool = False,
                 fault: Callable[[str], None] | None = None):
        # fault: called with a point's name (a test seam): "write_shard" once a shard is written
        # but not in place, "commit_record" once it is in place but its record is not written
        self.fault = fault
        self.where = open_location(run_dir)
        previous = reach(run_dir, lambda: json.loads(self.where.read_bytes(RUN_FILE))
                          if self.where.exists(RUN_FILE) else None)
        self.dir = self.where.root  # a Path for a local directory, else the URL (use `url` and `write_file`)
        self.fingerprint = json.loads(json.dumps(fingerprint, default=str))  # as it reads back
        self.committed: set[int] = set()  # input indexes of committed items (earlier sessions)
        self.shards: list[dict] = []  # journal records of earlier sessions
        if previous is not None and not resume:
            raise ForgeError(
                f"output_dir={run_dir} already holds a run ({previous.get('status', 'unknown')}); "
                "add resume=true to finish it, or choose a new output_dir")
        self.session = 0  # this session's number: shard names stay unique across crashes
        self._journal = _journal(self.where)
        self._commits = 0  # records this session wrote or tried to write
        if previous is not None:
            changes = fingerprint_changes(previous.get("fingerprint", {}), self.fingerprint)
            if changes:
                raise ForgeError(f"resume refused: {'; '.join(changes)} since the run in {run_dir} started; "
                                 "run with its settings again, or choose a new output_dir")
            self.session = int(previous.get("sessions", 0))
            self.shards = self._journal.read(repair=True)
            for record in self.shards:
                self.committed.update(record["index"])
            self._remove_orphans()
        self.status = "running"
        reach(run_dir, self._save)

    def _remove_orphans(self) -> None:
        """Shards written but never journaled, and staged files, from a crashed session."""
        known = {record["file"] for record in self.shards}
        for rel in self.where.files():
            if rel.rpartition("/")[2].startswith(SHARD_PREFIX) and rel not in known:
                self.where.remove(rel)

    # -- writing ----------------------------------------------------------------
    def write_shard(self, rel_path: str, write: Callable[[Path], None], record: dict[str, Any]) -> None:
        """Write one shard whole, then journal it. `write(path)` writes the shard to a local
        path (a temporary name; the store puts it in place). `record` must hold "index"
        (input indexes of its items)."""
        staged = self.where.staging(rel_path)
        write(staged)
        if self.fault is not None:
            self.fault("write_shard")
        n, self._commits = self._commits, self._commits + 1  # never reused, even after a failure
        try:
            self.where.put(staged, rel_path)
            if self.fault is not None:
                self.fault("commit_record")
            self._journal.append({"file": rel_path, **record}, self.session, n)
        except OSError:
            raise
        except Exception as exc:  # noqa: BLE001 - a store package's own error: a write error all the same
            raise OSError(f"{type(exc).__name__}: {exc}") from exc

    def write_file(self, rel_path: str, data: bytes | str) -> None:
        """A small file of the run (metadata), replaced whole; not journaled."""
        self.where.write_bytes(rel_path, data.encode() if isinstance(data, str) else data)

    def url(self, rel_path: str = "") -> str:
        """Where a file of the run lives (a local path or a URL), for reports."""
        return self.where.url(rel_path)

    def shard_name(self, k: int, suffix: str) -> str:
        """A shard file name unique across sessions of this run."""
        return f"{SHARD_PREFIX}{self.session:03d}-{k:05d}{suffix}"

    # -- status -----------------------------------------------------------------
    def _save(self) -> None:
        self.write_file(RUN_FILE, json.dumps({"fingerprint": self.fingerprint, "status": self.status,
                                              "sessions": self.session + 1}, indent=2, default=str))

    def abandon(self) -> None:
        """A first session refused before any work: the directory holds no run after all."""
        if self.session == 0 and self._commits == 0:
            self.where.remove(RUN_FILE)
        self.where.close()

    def close(self, status: str) -> None:
        """Record how this session ended (finished, interrupted, stopped: ...)."""
        self._journal.close()
        self.status = status
        self._save()
        self.where.close()


def read_journal(run_dir: Path | str) -> list[dict]:
    """The committed shards of a run directory (a local path or a URL), in commit order."""
    return _journal(open_location(run_dir)).read()
