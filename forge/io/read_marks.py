"""How far a run read its input: marks a resumed run seeks to instead of reading from the start.

    run_dir/read_marks.jsonl   {"fingerprint": SHA-256 of the run's fingerprint}, then one mark a line:
                               {"rows": R, "items": C, "tokens": [...]} (local run directories only)

A mark says: the first R input records (rows, read lines, dataset examples; a bad row counts
one) became records 0..C-1 of the function (`Item.index` and the rejected ones, in order), and
`tokens` holds the token count of each record since the previous mark as admission took it
(-1: not an item). Marks are facts about the input and the function, written as the reader
passes them (every `EVERY` rows, once admission has seen every record before them), ahead of
the commits and without fsync: a mark lost to a crash only means an earlier one is used.

On resume (`seek`), the committed item indices give P, the length of the run's fully committed
start (every record 0..P-1 committed: a failed or skipped record is never committed, so P stops
before it). The last mark with C <= P is where the reader starts: rows R on, records numbered
from C, and admission counts records 0..C-1 as received and resumed from their recorded token
counts, so the ledger equals a run that read them. A marks file of another fingerprint, or
none, gives no mark: the run reads from the start and skips the committed ids (the same
results, exactly once, either way).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np

from forge.errors import ForgeError
from forge.io import nofollow

NAME = "read_marks.jsonl"
EVERY = 1024  # input records between marks (FORGE_READ_MARK_EVERY: another count, e.g. in tests)


def mark_every() -> int:
    try:
        return max(1, int(os.environ.get("FORGE_READ_MARK_EVERY") or EVERY))
    except ValueError:
        return EVERY


def fingerprint_hash(fingerprint: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True, default=str).encode()).hexdigest()


class ReadMarks:
    """The marks of one session: read at its start (`seek`), written as it reads (`position`,
    called by the reader, and `seen`, called by admission; on their own threads)."""

    def __init__(self, root: Path, fingerprint: Mapping[str, Any]):
        self.root, self.hash = Path(root), fingerprint_hash(fingerprint)
        self.lock = threading.Lock()
        self.positions: list[tuple[int, int]] = []  # (rows, records) the reader passed, not yet written
        self.next = 0  # the record admission sees next
        self.tokens: list[int] = []  # token counts of records since the last mark written
        self.since = 0  # the record the last mark written ends at
        self.kept: list[str] = []  # lines to keep at the start of the file (header, marks up to the seek)
        self._file: IO[str] | None = None
        self.broken = self.closed = False

    def seek(self, committed: set[int] | frozenset) -> tuple[int, int, np.ndarray] | None:
        """(rows, records, token count of each record before it) where this session starts
        reading, or None: from the start. Call once, before reading."""
        marks = self._read()
        self.kept = [json.dumps({"fingerprint": self.hash})]
        p = 0
        while p in committed:
            p += 1
        best, counts, end = None, [], 0
        for mark in marks:
            if mark["items"] > p or len(mark["tokens"]) != mark["items"] - end or min(mark["tokens"], default=0) < 0:
                break
            counts.extend(mark["tokens"])
            end = mark["items"]
            best = (mark["rows"], end)
            self.kept.append(json.dumps(mark))
        if best is None:
            return None
        self.next = self.since = best[1]
        return best[0], best[1], np.asarray(counts, dtype=np.int64)

    def _read(self) -> list[dict]:
        try:
            lines = nofollow.read_bytes(self.root, NAME).splitlines()
        except (OSError, ForgeError):  # none, or a link (refused): no seeking
            return []
        try:
            if json.loads(lines[0]).get("fingerprint") != self.hash:
                return []  # another input or function: no seeking
        except (ValueError, IndexError, AttributeError):
            return []
        marks = []
        for raw in lines[1:]:
            try:
                mark = json.loads(raw)
                marks.append({"rows": int(mark["rows"]), "items": int(mark["items"]), "tokens": list(mark["tokens"])})
            except (ValueError, KeyError, TypeError):
                break  # a torn last line (a crash mid-write)
        return marks

    # -- writing: the reader's positions, admission's records

    def position(self, rows: int, records: int) -> None:
        """The reader passed `rows` input records; the next function record is `records`."""
        with self.lock:
            self.positions.append((rows, records))
            self._write_due()

    def seen(self, tokens: int) -> None:
        """Admission took the next record: an item of `tokens` tokens, or -1 for a failed or skipped one."""
        with self.lock:
            self.tokens.append(tokens)
            self.next += 1
            self._write_due()

    def _write_due(self) -> None:
        while self.positions and self.positions[0][1] <= self.next:
            rows, records = self.positions.pop(0)
            if records <= self.since:
                continue
            take = records - self.since
            mark = {"rows": rows, "items": records, "tokens": self.tokens[:take]}
            self.tokens, self.since = self.tokens[take:], records
            self._append(json.dumps(mark))

    def _append(self, line: str) -> None:
        if self.broken or self.closed:  # closed: a reader still running after the run's end writes nothing
            return
        try:
            if self._file is None:  # the first mark: the file begins (again) with what is kept
                flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                self._file = os.fdopen(nofollow.open_file(self.root, NAME, flags), "w")
                self._file.write("".join(k + "\n" for k in self.kept or [json.dumps({"fingerprint": self.hash})]))
            self._file.write(line + "\n")
            self._file.flush()
        except (OSError, ForgeError):  # marks only save reading: without them a resume reads from the start
            self.broken = True

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self._close_file()

    def _close_file(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None
