"""Checks at the edge of a run: devices this machine lacks, `~` in output_dir, a memory:// run
directory, and no library warning that Forge triggers on purpose."""

from __future__ import annotations

import os
import warnings

import pytest
from typer.testing import CliRunner

from forge.cli.app import app

FAST = ["input.limit=4", "runtime.executor=inprocess", "layers=[1]"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "inventory,message",
    [
        ('[{name: tpu0, device: "tpu:0"}]', "devices: tpu0 (tpu:0) is not a torch device name"),
        ('[{name: "cuda:7"}]', "devices: cuda:7 is not on this machine"),
        ('[{name: g, devices: [cpu, "cuda:9"], memory_gb: [1, 1]}]', "devices: g (cuda:9) is not on this machine"),
    ],
)
def test_a_device_this_machine_lacks_is_one_line_before_the_run_directory_exists(tmp_path, inventory, message):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.device_count() > 9:
        pytest.skip("a machine with ten GPUs has these")
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", *FAST, f"devices.inventory={inventory}", f"output_dir={out}"])
    assert result.exit_code == 2 and message in result.output, result.output
    assert "choose devices=auto" in result.output and len(result.output.strip().splitlines()) == 1
    assert not out.exists()


def test_a_tilde_in_output_dir_is_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["run", *FAST, "output_dir='~/runs/first'"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "home" / "runs" / "first" / "report.json").exists()
    assert not (tmp_path / "~").exists()


def test_a_memory_url_run_directory_gets_a_warning(tmp_path):
    result = CliRunner().invoke(app, ["run", *FAST, "output_dir=memory://forge-test-edges/run"])
    assert result.exit_code == 0, result.output
    assert "warning: output_dir=memory://forge-test-edges/run keeps the results in this process's memory" in (
        result.output
    )


@pytest.mark.slow
def test_planning_memory_gives_no_library_warning(tmp_path):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = CliRunner().invoke(app, ["plan", "batching=memory", "input.limit=64"])
    assert result.exit_code == 0, result.output
    shown = [str(w.message) for w in seen] + [result.output]
    assert not [s for s in shown if "module hierarchy tracking" in s or "Please file a bug" in s], shown


def test_an_offload_folder_a_killed_worker_left_is_removed_at_the_next_start(tmp_path):
    import subprocess
    import sys

    from forge.runtime.placement.dispatch import OFFLOAD_PREFIX, remove_stale_offload

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"{OFFLOAD_PREFIX}{int(dead.stdout)}-abc123"
    stale.mkdir()
    (stale / "layers.0.weight.dat").write_bytes(b"x")
    live = tmp_path / f"{OFFLOAD_PREFIX}{os.getpid()}-def456"  # this process's own: in use
    live.mkdir()
    other = tmp_path / f"{OFFLOAD_PREFIX}notapid"  # not a name Forge gives: never touched
    other.mkdir()
    assert remove_stale_offload(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and other.exists()
