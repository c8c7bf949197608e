"""Read marks (forge.io.read_marks): a resumed run starts reading at the last mark its committed
start covers, not at the input's start; a marks file of another fingerprint, or a torn one, is
not trusted beyond what parses; the resumed run commits each item exactly once and its ledger
equals a clean run's (tests/test_datasets_input.py holds the kill -9 run over a streamed dataset)."""

import json
from pathlib import Path

import pytest

from conftest import run_forge, small_run
from forge.io.read_marks import NAME, ReadMarks

FP = {"function": "probe_gen", "input": {"sha256": "abc"}}


def _write(root: Path, positions: list[tuple[int, int]], tokens: list[int]) -> None:
    """Marks as a run writes them: the reader's positions, then admission's records."""
    marks = ReadMarks(root, FP)
    assert marks.seek(set()) is None
    for rows, records in positions:
        marks.position(rows, records)
    for n in tokens:
        marks.seen(n)
    marks.close()


def test_a_resume_starts_at_the_last_mark_its_committed_start_covers(tmp_path):
    tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    _write(tmp_path, [(0, 0), (4, 4), (8, 9), (12, 12)], tokens)  # rows 4-7 made 5 records
    lines = (tmp_path / NAME).read_text().splitlines()
    assert json.loads(lines[0]) == {"fingerprint": ReadMarks(tmp_path, FP).hash} and len(lines) == 4
    assert ReadMarks(tmp_path, FP).seek(set(range(3))) is None  # committed 0-2: no mark is covered
    rows, records, counts = ReadMarks(tmp_path, FP).seek({*range(9), 10})  # 9 is not committed
    assert (rows, records, counts.tolist()) == (8, 9, tokens[:9])
    assert ReadMarks(tmp_path, FP).seek(set(range(7)))[:2] == (4, 4)
    assert ReadMarks(tmp_path, {**FP, "function": "other"}).seek(set(range(12))) is None  # another run's marks


def test_a_torn_mark_or_a_record_that_is_no_item_ends_what_is_trusted(tmp_path):
    _write(tmp_path, [(4, 4), (8, 8)], [3, 3, 3, 3, 3, -1, 3, 3])  # record 5 failed: never committed
    assert ReadMarks(tmp_path, FP).seek(set(range(8)))[:2] == (4, 4)
    with open(tmp_path / NAME, "a") as f:
        f.write('{"rows": 12, "items": 1')  # a crash mid-write
    assert ReadMarks(tmp_path, FP).seek(set(range(8)))[:2] == (4, 4)


def test_marks_wait_for_admission_and_a_resumed_session_keeps_the_ones_before_its_start(tmp_path):
    marks = ReadMarks(tmp_path, FP)
    marks.seek(set())
    marks.position(4, 4)  # the reader runs ahead of admission: nothing written yet
    assert not (tmp_path / NAME).exists()
    for _ in range(4):
        marks.seen(2)
    marks.position(8, 8)
    marks.close()
    marks.seen(2)  # a reader still running after the run's end writes nothing more
    assert len((tmp_path / NAME).read_text().splitlines()) == 2
    again = ReadMarks(tmp_path, FP)
    assert again.seek(set(range(4)))[:2] == (4, 4)
    again.position(8, 8)
    for _ in range(4):
        again.seen(1)
    again.close()
    assert ReadMarks(tmp_path, FP).seek(set(range(8)))[2].tolist() == [2, 2, 2, 2, 1, 1, 1, 1]


N = 64  # enough items that the first shards cover a start (batches complete out of order)


@pytest.mark.slow
def test_a_resumed_run_reads_from_its_mark_and_equals_a_clean_run(tmp_path, faults, monkeypatch):
    from forge.io.inputs import InputFile

    monkeypatch.setenv("FORGE_READ_MARK_EVERY", "4")
    args = [*small_run(N), "shard_size=4", "runtime.commit_interval_s=0.01"]
    clean = run_forge(tmp_path / "clean", *args)
    faults(fail_commit=5)  # the fifth shard's commit fails: the run stops with four shards committed
    first = run_forge(tmp_path / "run", *args, "plugins=[faults]")
    assert first["status"] == "stopped"
    committed = [
        i for line in (tmp_path / "run" / "commits.jsonl").read_text().splitlines() for i in json.loads(line)["index"]
    ]
    starts: list[int] = []
    rows = InputFile.rows
    monkeypatch.setattr(InputFile, "rows", lambda self, start=0: (starts.append(start), rows(self, start))[1])
    faults()
    report = run_forge(tmp_path / "run", *args, "resume=true")
    assert report["status"] == "finished" and report["balanced"], report.get("imbalance")
    covered = next(p for p in range(N + 1) if p not in set(committed))  # items 0..covered-1 all committed
    assert covered >= 4 and starts[-1] == covered // 4 * 4, starts  # the run read from the last mark they cover
    assert report["items"]["resumed"] == len(committed)
    for group in ("items", "tokens"):
        for key in ("received", "completed"):
            assert report[group][key] == clean[group][key], (group, key)
    indexes = [
        i for line in (tmp_path / "run" / "commits.jsonl").read_text().splitlines() for i in json.loads(line)["index"]
    ]
    assert sorted(indexes) == list(range(N))  # each item committed exactly once, none skipped
    from forge.io.results import load

    assert list(load(tmp_path / "run").ids) == list(load(tmp_path / "clean").ids)


@pytest.mark.slow
def test_marks_of_another_input_are_not_used_and_the_resume_reads_from_the_start(tmp_path, faults, monkeypatch):
    from forge.io.inputs import InputFile

    monkeypatch.setenv("FORGE_READ_MARK_EVERY", "4")
    args = [*small_run(N), "shard_size=4", "runtime.commit_interval_s=0.01"]
    faults(fail_commit=5)
    assert run_forge(tmp_path / "run", *args, "plugins=[faults]")["status"] == "stopped"
    marks = (tmp_path / "run" / NAME).read_text().splitlines()
    assert len(marks) > 2
    (tmp_path / "run" / NAME).write_text("\n".join([json.dumps({"fingerprint": "another"}), *marks[1:]]) + "\n")
    starts: list[int] = []
    rows = InputFile.rows
    monkeypatch.setattr(InputFile, "rows", lambda self, start=0: (starts.append(start), rows(self, start))[1])
    faults()
    report = run_forge(tmp_path / "run", *args, "resume=true")
    assert report["status"] == "finished" and report["items"]["completed"] == N
    assert starts[-1] == 0  # the run read from the start (the first: the disk check's sample)
    indexes = [
        i for line in (tmp_path / "run" / "commits.jsonl").read_text().splitlines() for i in json.loads(line)["index"]
    ]
    assert sorted(indexes) == list(range(N))
