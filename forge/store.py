"""The run directory: what decides results (a fingerprint), and a journal of committed shards.

    run_dir/run.json        fingerprint, status, sessions
    run_dir/commits.jsonl   one line per committed shard: {"file", "index": [...], ...}
    run_dir/<shards>        written by the function's sink through `write_shard`

Model: a shard is written under a temporary name, flushed to disk and renamed into place;
only then is its line appended to the journal (and flushed). The journal is the truth: a
shard without a line is an orphan from a crash and is removed on resume, and a torn last
line is ignored. A resumed run skips every item whose input index the journal names, so
nothing is recomputed or committed twice.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from forge.errors import ForgeError

RUN_FILE = "run.json"
JOURNAL = "commits.jsonl"
TMP_SUFFIX = ".tmp"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + TMP_SUFFIX)
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


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


class RunStore:
    """The run directory of one run, opened fresh or to resume.

    `fingerprint` is a JSON-able dict of everything that decides results (function, model,
    input content, layers, ...). Opening a directory that already holds a run needs
    `resume=True` and the same fingerprint.
    """

    def __init__(self, run_dir: Path, fingerprint: dict[str, Any], resume: bool = False,
                 fault: Callable[[Path], None] | None = None):
        self.dir = Path(run_dir)
        self.fault = fault  # called with a shard's temporary path before its rename (a test seam)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fingerprint = json.loads(json.dumps(fingerprint, default=str))  # as it reads back
        self.committed: set[int] = set()  # input indexes of committed items (earlier sessions)
        self.shards: list[dict] = []  # journal lines of earlier sessions
        path = self.dir / RUN_FILE
        previous = json.loads(path.read_text()) if path.exists() else None
        if previous is not None and not resume:
            raise ForgeError(
                f"output_dir={self.dir} already holds a run ({previous.get('status', 'unknown')}); "
                "add resume=true to finish it, or choose a new output_dir")
        self.session = 0  # this session's number: shard names stay unique across crashes
        if previous is not None:
            changes = fingerprint_changes(previous.get("fingerprint", {}), self.fingerprint)
            if changes:
                raise ForgeError(f"resume refused: {'; '.join(changes)} since the run in {self.dir} started; "
                                 "run with its settings again, or choose a new output_dir")
            self.session = int(previous.get("sessions", 0))
            self._load_journal()
        self.status = "running"
        self._journal = None
        self._save()

    # -- journal ----------------------------------------------------------------
    def _load_journal(self) -> None:
        path = self.dir / JOURNAL
        if not path.exists():
            return
        good = 0
        with open(path, "rb") as f:
            for raw in f:
                try:
                    line = json.loads(raw)
                except ValueError:
                    break  # a torn last line: the shard it named is an orphan
                if not raw.endswith(b"\n"):
                    break
                self.shards.append(line)
                self.committed.update(line["index"])
                good += len(raw)
        with open(path, "r+b") as f:
            f.truncate(good)
        self._remove_orphans()

    def _remove_orphans(self) -> None:
        """Shards written but never journaled, and temporary files, from a crashed session."""
        known = {line["file"] for line in self.shards}
        for line_dir in {Path(f).parent for f in known} | {Path(".")}:
            folder = self.dir / line_dir
            for p in folder.glob("shard-*") if folder.is_dir() else ():
                rel = str(p.relative_to(self.dir))
                if rel not in known:
                    p.unlink()

    def write_shard(self, rel_path: str, write: Callable[[Path], None], record: dict[str, Any]) -> None:
        """Write one shard atomically, then journal it. `record` must hold "index" (input
        indexes of its items)."""
        path = self.dir / rel_path
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + TMP_SUFFIX)
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        if self.fault is not None:
            self.fault(tmp)
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        if self._journal is None:
            self._journal = open(self.dir / JOURNAL, "a")
        self._journal.write(json.dumps({"file": rel_path, **record}) + "\n")
        self._journal.flush()
        os.fsync(self._journal.fileno())

    def shard_name(self, k: int, suffix: str) -> str:
        """A shard file name unique across sessions of this run."""
        return f"shard-{self.session:03d}-{k:05d}{suffix}"

    # -- status -----------------------------------------------------------------
    def _save(self) -> None:
        _write_json_atomic(self.dir / RUN_FILE, {"fingerprint": self.fingerprint, "status": self.status,
                                                 "sessions": self.session + 1})

    def abandon(self) -> None:
        """A first session refused before any work: the directory holds no run after all."""
        if self.session == 0 and self._journal is None:
            (self.dir / RUN_FILE).unlink(missing_ok=True)

    def close(self, status: str) -> None:
        """Record how this session ended (finished, interrupted, stopped: ...)."""
        if self._journal is not None:
            self._journal.close()
            self._journal = None
        self.status = status
        self._save()


def read_journal(run_dir: Path) -> list[dict]:
    """The committed shards of a run directory, in commit order (a torn last line ignored)."""
    path = Path(run_dir) / JOURNAL
    lines = []
    if path.exists():
        with open(path, "rb") as f:
            for raw in f:
                if not raw.endswith(b"\n"):
                    break
                try:
                    lines.append(json.loads(raw))
                except ValueError:
                    break
    return lines
