"""`forge` and its fork server leave without the interpreter's teardown of torch and
transformers, but only after what Python runs at exit (forge.cli.exit.quick_exit,
forge.executors.fork_server_exit)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# an object torn down with its module: its __del__ prints only if the interpreter tears down
MARK = "class Mark:\n    def __del__(self):\n        print('torn down', flush=True)\nmark = Mark()\n"


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_quick_exit_joins_threads_runs_atexit_flushes_and_keeps_the_exit_code():
    code = MARK + textwrap.dedent(
        """
        import atexit, threading, time
        from forge.cli.exit import quick_exit
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
        atexit.register(lambda: print("atexit ran\\nunflushed", end=""))  # left in the buffer
        quick_exit(5)
        """
    )
    out = run(code)
    assert out.returncode == 5, out.stderr
    assert out.stdout.splitlines() == ["thread done", "atexit ran", "unflushed"]  # never "torn down"


def test_quick_exit_with_a_message_prints_it_and_exits_1_as_python_does():
    out = run("from forge.cli.exit import quick_exit\nquick_exit('error: the reason')")
    assert (out.returncode, out.stderr.strip()) == (1, "error: the reason")
    assert run("from forge.cli.exit import quick_exit\nquick_exit(None)").returncode == 0


def test_the_fork_server_exit_runs_the_other_atexit_handlers_then_skips_the_teardown():
    without = run(MARK + "import atexit\natexit.register(lambda: print('atexit ran', flush=True))\nraise SystemExit(3)")
    assert (without.returncode, without.stdout.split()) == (3, ["atexit", "ran", "torn", "down"])
    code = MARK + textwrap.dedent(
        """
        import atexit
        import forge.executors.fork_server_exit
        atexit.register(lambda: print("atexit ran", flush=True))
        raise SystemExit(3)
        """
    )
    out = run(code)
    assert (out.returncode, out.stdout.splitlines()) == (0, ["atexit ran"]), out.stderr


@pytest.mark.slow
def test_the_forge_command_exits_with_its_code_through_quick_exit(tmp_path):
    bad = subprocess.run(
        [sys.executable, "-m", "forge.cli.app", "run", "batching=nope", f"output_dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "batching" in bad.stderr + bad.stdout
    assert not (tmp_path / "run").exists()


def test_the_installed_forge_script_is_the_quick_exit_entry_point(monkeypatch):
    """`forge` is forge.cli.entry:main: a warm server's when one answers, else the app's `main`
    (which leaves through quick_exit) in this process."""
    from importlib.metadata import entry_points

    import forge.cli.app
    import forge.cli.early
    from forge.cli import entry

    (script,) = entry_points(group="console_scripts", name="forge")
    assert script.load() is entry.main
    ran, asked, started = [], [], []
    monkeypatch.setattr(forge.cli.app, "main", lambda: ran.append(sys.argv[1:]))
    monkeypatch.setattr(entry, "run_warm", lambda argv: asked.append(argv))  # None: no server took it
    monkeypatch.setattr(forge.cli.early, "start_workers", started.append)
    for argv in (["run", "x=1"], ["server", "status"], ["--help"]):
        monkeypatch.setattr(sys, "argv", ["forge", *argv])
        entry.main()
    assert ran == [["run", "x=1"], ["server", "status"], ["--help"]]
    assert asked == [["run", "x=1"]]  # forge server ... and flags never go to a server
    assert started == [["x=1"]]  # a cold run's workers start importing before the CLI does


def test_a_cold_run_starts_its_workers_fork_server_first_unless_its_overrides_say_otherwise(monkeypatch):
    import forge.executors.process
    from forge.cli.early import RUNTIME_MODULES, start_workers

    warmed = []
    monkeypatch.setattr(forge.executors.process, "warm_up", warmed.append)
    assert start_workers(["function=score", "batching=token"]) and warmed == [RUNTIME_MODULES]
    assert start_workers(["runtime=local", "runtime.executor=process"])
    for args in (["-m", "batching=item,token"], ["--cfg", "job"], ["runtime=ray"], ["runtime.executor=inprocess"]):
        assert not start_workers(args), args
    assert len(warmed) == 2


def test_a_stop_inside_stops_wait_takes_effect_as_the_block_ends_and_at_once_inside_stops_at_once():
    """Hydra's compose runs inside `stops_wait`: a KeyboardInterrupt raised in its `finally`
    clauses can come out as an unrelated OmegaConf error (exit 1, a traceback), not a stop."""
    script = textwrap.dedent(
        """
        import os, signal
        from forge.cli import early
        early.catch_stop_signals()
        seen = []
        try:
            with early.stops_wait():
                os.kill(os.getpid(), signal.SIGTERM)
                seen.append("went on")
                try:
                    with early.stops_at_once():
                        seen.append("not reached")
                except KeyboardInterrupt:
                    seen.append("raised on entry")
                os.kill(os.getpid(), signal.SIGTERM)
                seen.append("went on again")
        except KeyboardInterrupt:
            seen.append("raised at the end")
        try:
            with early.stops_wait():
                raise SystemExit(1)  # a block that failed keeps its own error
        except SystemExit:
            seen.append("own error")
        print(seen, early.STOPPED_BY)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        "['went on', 'raised on entry', 'went on again', 'raised at the end', 'own error'] ['SIGTERM', 'SIGTERM']"
    )
