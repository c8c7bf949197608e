"""`forge server`: a warm process per environment that runs `forge` commands as forked children.

A warm command must be the cold one: the same outputs, exit codes and error lines, Ctrl-C
reaching it and its workers, a kill -9 of the client taking the command with it (and resume
finishing it), and a different environment running cold. No process outlives the module.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import clean_activations, small_run
from forge.cli import entry, wire
from forge.cli.server import _Server
from forge.cli.server_control import ask

TESTS = Path(__file__).resolve().parent
FORGE = Path(sys.executable).with_name("forge")  # the console script: forge.cli.entry:main
N = 48
FAST = small_run(N, "batching.merge_groups=false")
PROC = ["runtime.executor=process", "plugins=[faults]", "runtime.max_in_flight=1"]

pytestmark = pytest.mark.skipif(not FORGE.exists(), reason="needs the installed `forge` console script")


HANG = {"seconds": 30, "times": 1, "nth": 4}  # the faults plugin's: a long batch to interrupt


def _env(runtime_dir: str, markers: Path) -> dict[str, str]:
    """The tests' environment: their own socket folder, tests/ importable (the faults plugin) and
    a fault plan that only runs with plugins=[faults]. The environment is part of a server's
    key, so a command sees the server only with exactly this one."""
    env = dict(os.environ)
    env.update(
        XDG_RUNTIME_DIR=runtime_dir,
        PYTHONPATH=str(TESTS),
        FORGE_FAULTS=json.dumps({"dir": str(markers), "hang": HANG}),
    )
    return env


def _forge(*args: str, env: dict, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(FORGE), *args], env=env, cwd=TESTS, capture_output=True, text=True, timeout=600, **kw)


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                out.append(int(name))
    return out


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def server():
    """A warm server for this module's environment, stopped after, with anything it left killed."""
    runtime_dir = tempfile.mkdtemp(prefix="fsrv")  # short: a Unix socket's path has about 100 bytes
    markers = Path(runtime_dir, "markers")
    markers.mkdir()
    env = _env(runtime_dir, markers)
    started = _forge("server", "start", "--idle-minutes", "10", env=env)
    assert started.returncode == 0, started.stdout + started.stderr
    assert "ready in" in started.stdout
    (address,) = Path(runtime_dir, f"forge-{os.getuid()}").glob("*.sock")
    state = ask(address)
    assert state is not None, started.stdout
    try:
        yield Served(env, address, state["pid"], markers, runtime_dir)
    finally:
        _forge("server", "stop", env=env)
        for pid in _children(state["pid"]):  # commands the stop could not wait for
            _kill_group(pid)
        try:
            os.kill(state["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
        shutil.rmtree(runtime_dir, ignore_errors=True)


class Served:
    def __init__(self, env, address, pid, markers, runtime_dir):
        self.env, self.address, self.pid, self.markers, self.runtime_dir = env, address, pid, markers, runtime_dir

    def cold_env(self) -> dict:
        """The same environment but another socket folder, where no server answers."""
        return {**self.env, "XDG_RUNTIME_DIR": tempfile.mkdtemp(prefix="fcold", dir=self.runtime_dir)}

    def fresh_faults(self) -> None:
        for marker in self.markers.iterdir():
            marker.unlink()


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return clean_activations(tmp_path_factory.mktemp("clean"), *FAST, n=N)


def _activations(run_dir: Path) -> dict:
    from forge import load_activations

    ids, _, layers = load_activations(run_dir)
    return {i: {layer: layers[layer][k] for layer in layers} for k, i in enumerate(ids)}


@pytest.mark.slow
def test_a_warm_run_writes_what_a_cold_run_writes(tmp_path, server):
    import torch

    served = ask(server.address)["served"]
    for name, env in (("warm", server.env), ("cold", server.cold_env())):
        done = _forge("run", *FAST, "runtime.executor=process", f"output_dir={tmp_path / name}", env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "finished" in done.stdout
    reports = {n: json.loads((tmp_path / n / "report.json").read_text()) for n in ("warm", "cold")}
    assert reports["warm"]["phases"]["warm_start"] is True
    assert reports["cold"]["phases"]["warm_start"] is False
    assert ask(server.address)["served"] == served + 1
    for n in ("warm", "cold"):
        assert reports[n]["balanced"] and reports[n]["items"]["completed"] == N
    warm, cold = _activations(tmp_path / "warm"), _activations(tmp_path / "cold")
    assert warm.keys() == cold.keys()
    for i in warm:
        for layer in warm[i]:
            assert torch.allclose(warm[i][layer], cold[i][layer], atol=1e-5, rtol=0), (i, layer)  # batches may differ


@pytest.mark.slow
def test_errors_and_exit_codes_are_the_cold_commands(tmp_path, server):
    served = ask(server.address)["served"]
    cold_env = server.cold_env()
    args = ["run", "batching=nope", f"output_dir={tmp_path / 'x'}"]
    warm, cold = _forge(*args, env=server.env), _forge(*args, env=cold_env)
    assert warm.returncode == cold.returncode == 2, warm.stderr
    assert warm.stderr.strip().splitlines()[-1] == cold.stderr.strip().splitlines()[-1]
    assert warm.stderr.startswith("error:"), warm.stderr
    plan = _forge("plan", "devices.limits.max_rows=0", env=server.env)
    assert plan.returncode == 2 and plan.stderr.startswith("error:") and "max_rows" in plan.stderr, plan.stderr
    assert ask(server.address)["served"] == served + 2
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_a_changed_environment_runs_cold(server):
    served = ask(server.address)["served"]
    other = {**server.env, "FORGE_SERVER_TEST_EXTRA": "1"}
    done = _forge("ls", env=other)
    assert done.returncode == 0 and "probe_gen" in done.stdout, done.stderr
    shown = _forge("server", "status", env=other)
    assert f"forge server {server.pid}: another environment" in shown.stdout
    assert ask(server.address)["served"] == served


HUNG = [*FAST, *PROC, "shard_size=4", "runtime.commit_interval_s=0.1", "runtime.drain_s=1"]


def _start_hung_run(out: Path, server: Served) -> subprocess.Popen:
    server.fresh_faults()
    proc = subprocess.Popen(
        [str(FORGE), "run", *HUNG, f"output_dir={out}"],
        env=server.env,
        cwd=TESTS,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 120
    commits = out / "commits.jsonl"
    while not (commits.exists() and commits.read_text() and (server.markers / "hang-0").exists()):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read().decode()  # type: ignore[union-attr]
        time.sleep(0.2)
    return proc  # some batches committed, a worker asleep in the next one


def _resume(out: Path, server: Served, clean: dict) -> None:
    from conftest import assert_same_output

    done = _forge("run", *HUNG, f"output_dir={out}", "resume=true", env=server.env)  # the hang was claimed
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["phases"]["warm_start"] is True
    assert report["status"] == "finished" and report["items"]["resumed"] > 0 and report["balanced"]
    assert_same_output(out, clean, atol=1e-5)


@pytest.mark.slow
def test_ctrl_c_reaches_the_warm_command_and_its_workers(tmp_path, server, clean):
    """A worker hangs in a batch: SIGINT to the client, as a terminal sends it, stops the run
    gracefully with exit 130; a warm resume finishes it with the clean run's output."""
    out = tmp_path / "run"
    proc = _start_hung_run(out, server)
    try:
        os.killpg(proc.pid, signal.SIGINT)
        text = proc.communicate(timeout=60)[0].decode()
    finally:
        proc.kill()
    report = json.loads((out / "report.json").read_text())
    assert proc.returncode == 130, text
    assert report["status"] == "interrupted" and report["balanced"], report["imbalance"]
    assert report["phases"]["warm_start"] is True
    assert "Traceback" not in text
    _resume(out, server, clean)


@pytest.mark.slow
def test_kill_9_of_the_client_takes_the_command_and_its_workers(tmp_path, server, clean):
    out = tmp_path / "run"
    before = set(_children(server.pid))
    proc = _start_hung_run(out, server)
    commands = [p for p in _children(server.pid) if p not in before]
    assert len(commands) == 1, commands
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 30
        while _group_alive(commands[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _group_alive(commands[0]), "the command's process group outlived its client"
        assert ask(server.address)["running"] == 0
    finally:
        _kill_group(commands[0])
    _resume(out, server, clean)


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


@pytest.mark.slow
def test_ctrl_z_stops_the_command_and_fg_resumes_it(tmp_path, server):
    """SIGTSTP to the client (a terminal's Ctrl-Z) stops it and the command's group; SIGCONT
    (fg, bg) resumes both, and the run finishes."""
    before = set(_children(server.pid))
    out = tmp_path / "run"
    proc = _start_hung_run(out, server)  # a worker asleep in a batch for 30 s: time to look
    (command,) = [p for p in _children(server.pid) if p not in before]
    try:
        os.kill(proc.pid, signal.SIGTSTP)
        deadline = time.monotonic() + 10
        while not (_state(proc.pid) == "T" and _state(command) == "T") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (_state(proc.pid), _state(command)) == ("T", "T")
        os.kill(proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while _state(command) == "T" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _state(command) != "T" and _state(proc.pid) != "T"
        os.kill(proc.pid, signal.SIGINT)  # not wait out the hang: Ctrl-C still works after fg
        text = proc.communicate(timeout=60)[0].decode()
    finally:
        proc.kill()
        _kill_group(command)
    assert proc.returncode == 130, text
    assert json.loads((out / "report.json").read_text())["status"] == "interrupted"


def test_status_and_a_second_start(server):
    shown = _forge("server", "status", env=server.env)
    assert f"forge server {server.pid}: this environment" in shown.stdout
    again = _forge("server", "start", env=server.env)
    assert again.returncode == 0 and f"forge server {server.pid} already runs" in again.stdout


# -- without a server process ----------------------------------------------------------------
def test_the_key_is_the_environment_less_what_a_shell_changes(monkeypatch):
    base = dict(os.environ)
    key = wire.server_key(base)
    assert wire.server_key({**base, "PWD": "/elsewhere", "SHLVL": "9"}) == key
    assert wire.server_key({**base, "OMP_NUM_THREADS": "7"}) != key
    assert wire.server_key(base, [*sys.path, "/nowhere"]) != key


def test_the_key_follows_forge_source(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("x = 1\n")
    before = wire._stamp(tmp_path, (".py",))
    (tmp_path / "a.py").write_text("x = 22\n")
    assert wire._stamp(tmp_path, (".py",)) != before


def test_an_idle_server_stops_and_removes_its_socket(tmp_path):
    address = Path(tempfile.mkdtemp(prefix="fidle")) / "k.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(address))
    listener.listen()
    server = _Server(listener, address, idle_s=0.3, command=lambda: None)
    t0 = time.monotonic()
    server.loop()
    assert time.monotonic() - t0 >= 0.3
    assert not address.exists()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_no_server_means_the_command_runs_here(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert entry.run_warm(["ls"]) is None


@pytest.mark.slow
def test_a_folder_others_can_open_is_never_used(tmp_path):
    folder = tmp_path / "shared"
    folder.mkdir(mode=0o700)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(folder / "k.sock"))
    listener.listen()
    with listener:
        assert wire.private(folder) and wire.connect(folder / "k.sock") is not None
        folder.chmod(0o755)  # as a folder someone else made in a shared temp dir could be
        assert not wire.private(folder) and wire.connect(folder / "k.sock") is None
