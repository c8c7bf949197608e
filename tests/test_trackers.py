"""Trackers (issue 47): what TensorBoard, MLflow, W&B and trackio hold after a run equals the
ledger in report.json, read back with each tracker's own reader; no network connection is
attempted; a resumed run continues the same tracker run; a tracker that fails, or is not
installed, is one warning and the run goes on; a third-party tracker registers the same way."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import trackers_read
from conftest import run_forge, small_run
from forge.hookspecs import hookimpl
from forge.pluginmanager import make_plugin_manager
from forge.tracker import Tracker

TESTS = Path(__file__).resolve().parent
ALL = ["tensorboard", "mlflow", "wandb", "trackio"]
installed = [name for name in ALL if importlib.util.find_spec(name) is not None]  # each imports as it is named

# Python processes started with this folder first on PYTHONPATH refuse every socket connection
# but a Unix socket's (wandb talks to its own service over one), and write what they refused
# to $FORGE_NET_LOG: the run, its fork server and its workers alike
GUARD = """
import os, socket
_connect, _connect_ex = socket.socket.connect, socket.socket.connect_ex
def _refuse(self, address):
    if self.family != socket.AF_UNIX:
        with open(os.environ["FORGE_NET_LOG"], "a") as log:
            log.write(f"{os.getpid()} {self.family.name} {address!r}\\n")
        raise OSError(101, f"network refused by the test: {address!r}")
def connect(self, address):
    _refuse(self, address)
    return _connect(self, address)
def connect_ex(self, address):
    _refuse(self, address)
    return _connect_ex(self, address)
socket.socket.connect, socket.socket.connect_ex = connect, connect_ex
"""


def guarded_env(folder: Path) -> dict[str, str]:
    (folder / "guard").mkdir(parents=True, exist_ok=True)
    (folder / "guard" / "sitecustomize.py").write_text(GUARD)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_", "TRACKIO_"))}
    path = os.pathsep.join(p for p in (str(folder / "guard"), env.get("PYTHONPATH")) if p)
    return {**env, "PYTHONPATH": path, "FORGE_NET_LOG": str(folder / "net.log"), "OMP_NUM_THREADS": "1"}


def forge_run(env: dict, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "forge.cli.app", "run", *overrides],
        cwd=TESTS,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def ledger(run_dir: Path) -> dict:
    report = json.loads((run_dir / "report.json").read_text())
    figures = {
        "items/completed": report["items"]["completed"],
        "tokens/completed": report["tokens"]["completed"],
        "tokens/padding": report["tokens"]["padding"],
    }
    return {**figures, "status": report["status"], "trackers": report.get("trackers")}


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """One run of 40 rows with every installed tracker on, sockets refused."""
    if not installed:
        pytest.skip("no tracker library installed (pip install -e '.[trackers]')")
    folder = tmp_path_factory.mktemp("tracked")
    env = guarded_env(folder)
    done = forge_run(env, *small_run(40), f"trackers=[{','.join(installed)}]", f"output_dir={folder / 'run'}")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return folder, done


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL)
def test_what_a_tracker_holds_equals_the_ledger(tracked, name):
    if name not in installed:
        pytest.skip(f"{name} is not installed")
    folder, _ = tracked
    want = ledger(folder / "run")
    assert want["status"] == "finished" and want["items/completed"] == 40
    assert want["trackers"][name] == "logged"
    got = trackers_read.READERS[name](folder / "run")
    assert {k: got[k] for k in ("items/completed", "tokens/completed", "tokens/padding", "status")} == {
        k: want[k] for k in ("items/completed", "tokens/completed", "tokens/padding", "status")
    }
    steps = got["steps"]  # one point per batch, at tokens completed so far
    assert len(steps) >= 2 and steps == sorted(steps) and steps[-1] == want["tokens/completed"]


@pytest.mark.slow
def test_no_network_connection_is_attempted_and_the_guard_would_see_one(tracked, tmp_path):
    folder, done = tracked
    assert not (folder / "net.log").exists(), (folder / "net.log").read_text()
    assert "warning" not in done.stderr
    assert "trackers" in done.stdout and "logged" in done.stdout  # the summary's row
    env = guarded_env(tmp_path)  # the guard is live: a connection is refused and written down
    probe = "import socket\ntry:\n    socket.create_connection(('127.0.0.1', 9), timeout=1)\nexcept OSError: pass"
    subprocess.run([sys.executable, "-c", probe], env=env, check=True, timeout=60)
    assert "AF_INET" in (tmp_path / "net.log").read_text()


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_tracker_runs(tmp_path):
    if not installed:
        pytest.skip("no tracker library installed")
    env = guarded_env(tmp_path)
    env["FORGE_FAULTS"] = json.dumps({"dir": str(tmp_path), "fail_commit": 2})
    run_dir = tmp_path / "run"
    args = [
        *small_run(40),
        f"trackers=[{','.join(installed)}]",
        f"output_dir={run_dir}",
        "runtime.commit_interval_s=0.01",
    ]
    first = forge_run(env, *args, "plugins=[faults]")
    assert ledger(run_dir)["status"] == "stopped", first.stdout[-2000:]
    ids = json.loads((run_dir / "trackers" / "ids.json").read_text())
    env.pop("FORGE_FAULTS")
    second = forge_run(env, *args, "resume=true")
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    want = ledger(run_dir)
    assert want["status"] == "finished" and want["items/completed"] == 40
    assert json.loads((run_dir / "trackers" / "ids.json").read_text()) == ids  # the same tracker runs
    for name in installed:
        got = trackers_read.READERS[name](run_dir)
        assert (got["items/completed"], got["tokens/completed"], got["status"]) == (
            40,
            want["tokens/completed"],
            "finished",
        ), name
        assert got["steps"][-1] == want["tokens/completed"], name
    if "tensorboard" in installed:  # the per-batch series go on from what the first session committed
        for tag, last in (("items/completed", 40), ("tokens/completed", want["tokens/completed"])):
            points = trackers_read.tensorboard_scalars(run_dir / "trackers" / "tensorboard", tag)
            series = [e.value for e in sorted(points, key=lambda e: (e.step, e.wall_time))]  # by tokens completed
            assert series == sorted(series) and series[-1] == last, (tag, series)
    if "wandb" in installed:
        got = trackers_read.wandb(run_dir)
        assert got["sessions"] == 2 and got["ids"] == {ids["wandb"]}
    if "mlflow" in installed:
        assert trackers_read.mlflow(run_dir)["mlflow_status"] == "FINISHED"
    if "trackio" in installed:
        assert trackers_read.trackio(run_dir)["names"] == {ids["trackio"]}
    assert not (tmp_path / "net.log").exists()


# -- a third-party tracker, and trackers that fail: in this process


class Recorder(Tracker):
    """A whole third-party tracker: it keeps what it is given, as JSON lines in its folder (it runs
    in the trackers' own process)."""

    def start(self, run):
        self.out = open(run.folder / "seen.jsonl", "a")
        self._keep(["start", run.name, run.params["function.name"], run.settings.project, run.resume_id])
        return "rec-1"

    def log(self, step, figures):
        self._keep(["log", step, figures["tokens/completed"]])

    def finish(self, step, totals, status):
        self._keep(["finish", step, totals["items/completed"], totals["tokens/padding"], status])
        self.out.close()

    def _keep(self, record):
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()


class Quiet(Tracker):
    def start(self, run):
        return None

    def log(self, step, figures):
        pass

    def finish(self, step, totals, status):
        pass


class Missing(Quiet):
    requires = "forge-tokens[nothing]"

    def start(self, run):
        raise ImportError("No module named 'nothing'")


class Broken(Quiet):
    def log(self, step, figures):
        raise RuntimeError("the tracker's server went away")


class Registry:
    @hookimpl
    def forge_trackers(self):
        return {"recorder": Recorder, "missing": Missing, "broken": Broken}


@pytest.mark.slow
def test_a_third_party_tracker_logs_and_failing_ones_are_one_warning_each(tmp_path, capfd):
    pm = make_plugin_manager(extra=(Registry(),))
    trackers = ["+trackers.recorder.project=mine", "+trackers.missing.project=x", "+trackers.broken.project=y"]
    report = run_forge(tmp_path / "run", *small_run(12), *trackers, pm=pm)
    assert report["status"] == "finished" and report["items"]["completed"] == 12
    lines = (tmp_path / "run" / "trackers" / "recorder" / "seen.jsonl").read_text().splitlines()
    seen = [tuple(json.loads(line)) for line in lines]
    assert seen[0] == ("start", "recorder", "probe_gen", "mine", None)
    steps = [s[1] for s in seen if s[0] == "log"]
    assert steps and steps == sorted(steps) and steps[-1] == report["tokens"]["completed"]
    assert seen[-1] == (
        "finish",
        report["tokens"]["completed"],
        12,
        report["tokens"]["padding"],
        "finished",
    )
    notes = report["trackers"]
    assert notes["recorder"] == "logged"
    assert "not installed" in notes["missing"] and "pip install 'forge-tokens[nothing]'" in notes["missing"]
    assert "failed (RuntimeError: the tracker's server went away)" in notes["broken"]
    err = capfd.readouterr().err  # the trackers' process writes its warnings to the same stderr
    assert err.count("forge: warning: tracker missing:") == 1 and err.count("forge: warning: tracker broken:") == 1
    assert json.loads((tmp_path / "run" / "trackers" / "ids.json").read_text())["recorder"] == "rec-1"


def test_an_unregistered_tracker_is_one_line_naming_the_registered_ones(tmp_path):
    from forge.errors import ForgeError

    with pytest.raises(ForgeError, match=r"trackers: 'nope' is not a registered tracker; choose among: .*mlflow"):
        run_forge(tmp_path / "run", *small_run(4), "+trackers.nope.project=x")


def test_a_bad_tracker_setting_is_one_line_naming_the_key():
    from conftest import spec_for
    from forge.errors import ForgeError

    with pytest.raises(ForgeError, match=r"config trackers\.wandb\.mode='sometimes': choose one of"):
        spec_for("trackers=[wandb]", "trackers.wandb.mode=sometimes")


def test_the_trackers_options_compose_with_their_defaults():
    from omegaconf import OmegaConf

    from conftest import compose

    cfg = OmegaConf.to_container(compose("trackers=[tensorboard,mlflow]", "trackers.mlflow.uri=http://host:5000"))
    assert cfg["trackers"] == {
        "tensorboard": {"project": "forge", "run_name": None, "log_dir": None},
        "mlflow": {"project": "forge", "run_name": None, "uri": "http://host:5000"},
    }
    assert OmegaConf.to_container(compose())["trackers"] == {}


# -- docs/trackers.md: its examples run, its files are the repository's

GUIDE = TESTS.parent / "docs" / "trackers.md"


@pytest.mark.slow
def test_the_guides_read_back_examples_give_the_ledger(tracked):
    import re

    folder, _ = tracked
    want = ledger(folder / "run")
    blocks = [b for b in re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S) if "completed = " in b]
    assert len(blocks) == 3  # tensorboard, mlflow, trackio
    for block in blocks:
        namespace = {"run": str(folder / "run")}
        exec(compile(block, str(GUIDE), "exec"), namespace)
        assert (namespace["completed"], namespace["status"]) == (want["tokens/completed"], "finished"), block[:60]


def test_the_guides_tracker_files_are_the_repositorys_byte_for_byte():
    import re

    marked = re.findall(r"<!-- file: (\S+) -->\n```(\w+)\n(.*?)```", GUIDE.read_text(), flags=re.S)
    assert {path for path, _, _ in marked} == {
        "examples/forge-plugin-example/forge_plugin_example/jsonl_tracker.py",
        "examples/forge-plugin-example/forge_plugin_example/conf/trackers/jsonl.yaml",
    }
    for path, _, block in marked:
        assert block == (TESTS.parent / path).read_text(), f"docs/trackers.md shows {path} as it is not"


@pytest.mark.slow
def test_a_run_directory_at_a_url_is_one_warning_per_tracker_and_the_run_goes_on(lease_url, capsys):
    pm = make_plugin_manager(extra=(Registry(),))
    report = run_forge(lease_url, *small_run(4), "+trackers.recorder.project=x", pm=pm)
    assert report["status"] == "finished" and report["items"]["completed"] == 4
    assert "trackers" not in report.plugins
    err = capsys.readouterr().err
    assert err.count("forge: warning: tracker recorder: the run directory memory://") == 1


@pytest.mark.slow
@pytest.mark.skipif("tensorboard" not in installed, reason="tensorboard is not installed")
def test_tensorboards_events_are_written_without_importing_torch(tmp_path):
    code = f"""
import sys
from pathlib import Path
from forge.builtin.tracker_tensorboard import TensorBoardTracker
from forge.config.trackers import TensorBoardSettings
from forge.tracker import TrackerRun
t = TensorBoardTracker()
params = {{"a": 1, "b": "x", "c": True}}
t.start(TrackerRun("tensorboard", Path({str(tmp_path)!r}), TensorBoardSettings(), "r", params, None))
t.log(10, {{"tokens/completed": 10}})
t.finish(10, {{"items/completed": 1}}, "finished")
print("torch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"
    from tensorboard.backend.event_processing import plugin_event_multiplexer
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = plugin_event_multiplexer.EventMultiplexer()
    events.AddRunsFromDirectory(str(tmp_path))
    events.Reload()
    (content,) = events.PluginRunToTagToContent("hparams").values()
    kinds = {plugin_data_pb2.HParamsPluginData.FromString(v).WhichOneof("data") for v in content.values()}
    assert kinds == {"experiment", "session_start_info", "session_end_info"}  # the HPARAMS tab's session
    assert [e.step for e in trackers_read.tensorboard_scalars(tmp_path, "tokens/completed")] == [10]
