"""Nothing in a run directory is opened through a link, and no file Forge did not write is
truncated: a directory prepared by someone else (a shared scratch path) is refused by name."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from forge.cli.app import app
from forge.errors import ForgeError
from forge.io.location import LocalLocation
from forge.io.store import RunStore

SECRET = b"the victim's own file\n"


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "outside" / "precious.txt"
    path.parent.mkdir()
    path.write_bytes(SECRET)
    return path


def _prepared(tmp_path, name: str, target) -> os.PathLike:
    run = tmp_path / "shared-scratch" / "run"
    run.mkdir(parents=True)
    os.symlink(target, run / name)
    return run


@pytest.mark.parametrize("name", ["lock.json", "pending.jsonl", "run.json.tmp", "run.json"])
def test_a_link_a_start_would_write_through_is_refused_by_name(tmp_path, victim, name):
    run = _prepared(tmp_path, name, victim)
    with pytest.raises(ForgeError, match=f"{name} is a symbolic link"):
        RunStore(run, {"f": 1})
    assert victim.read_bytes() == SECRET
    assert os.path.islink(run / name) and sorted(os.listdir(run)) == [name]


def test_a_linked_sessions_folder_is_refused_and_nothing_lands_in_its_target(tmp_path, victim):
    run = _prepared(tmp_path, "sessions", victim.parent)
    with pytest.raises(ForgeError, match="sessions is a symbolic link"):
        RunStore(run, {"f": 1})
    assert os.listdir(victim.parent) == ["precious.txt"]


def test_the_command_refuses_a_linked_lock_in_one_line_and_truncates_nothing(tmp_path, victim):
    run = _prepared(tmp_path, "lock.json", victim)
    result = CliRunner().invoke(app, ["run", "input.limit=4", f"output_dir={run}"])
    assert result.exit_code == 2, result.output
    assert "lock.json is a symbolic link" in result.output and len(result.output.strip().splitlines()) == 1
    assert victim.read_bytes() == SECRET
    assert sorted(os.listdir(run)) == ["lock.json"]  # no .hydra/, no run.json


@pytest.mark.parametrize("content", [b"my notes, not a lock\n", b'{"key": "value"}', b"[1, 2]"])
def test_a_users_plain_file_named_lock_json_is_refused_never_truncated(tmp_path, content):
    run = tmp_path / "run"
    run.mkdir()
    (run / "lock.json").write_bytes(content)
    with pytest.raises(ForgeError, match="lock.json was not written by Forge"):
        RunStore(run, {"f": 1})
    assert (run / "lock.json").read_bytes() == content


def test_a_hard_link_named_lock_json_is_refused(tmp_path, victim):
    run = tmp_path / "run"
    run.mkdir()
    victim.write_bytes(json.dumps({"host": "h", "pid": 1, "started": "s"}).encode())  # looks like a lock
    before = victim.read_bytes()
    os.link(victim, run / "lock.json")
    with pytest.raises(ForgeError, match="other names link to it"):
        RunStore(run, {"f": 1})
    assert victim.read_bytes() == before


def test_a_lock_left_by_a_refused_start_is_still_taken(tmp_path):
    run = tmp_path / "run"
    for content in (b"", json.dumps({"host": "h", "pid": 1, "started": "s"}).encode()):
        run.mkdir()
        (run / "lock.json").write_bytes(content)
        store = RunStore(run, {"f": 1})
        store.close("finished")
        assert json.loads((run / "run.json").read_bytes())["status"] == "finished"
        for path in sorted(run.rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        run.rmdir()


def test_a_link_planted_in_a_run_is_refused_on_resume(tmp_path, victim):
    run = tmp_path / "run"
    RunStore(run, {"f": 1}).close("interrupted")
    (run / "commits.jsonl").unlink(missing_ok=True)
    os.symlink(victim, run / "commits.jsonl")
    with pytest.raises(ForgeError, match="commits.jsonl is a symbolic link"):
        RunStore(run, {"f": 1}, resume=True)
    assert victim.read_bytes() == SECRET


def test_no_write_of_a_local_location_goes_through_a_linked_folder(tmp_path, victim):
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(victim.parent, run / "activations")
    where = LocalLocation(run)
    for write in (
        lambda: where.write_bytes("activations/meta.json", b"{}"),
        lambda: where.create("activations/x.json", b"{}"),
        lambda: where.staging("activations/shard.safetensors"),
        lambda: where.read_bytes("activations/precious.txt"),
    ):
        with pytest.raises(ForgeError, match="activations is a symbolic link"):
            write()
    assert os.listdir(victim.parent) == ["precious.txt"] and victim.read_bytes() == SECRET


def test_a_file_replaced_whole_replaces_a_link_itself_not_its_target(tmp_path, victim):
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(victim, run / "report.json")
    LocalLocation(run).write_bytes("report.json", b"{}")
    assert not os.path.islink(run / "report.json") and (run / "report.json").read_bytes() == b"{}"
    assert victim.read_bytes() == SECRET
