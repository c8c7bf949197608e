"""What `forge server start|stop|status` call: ask a server its state, start this environment's
and wait until it is ready, stop one or all (`forge.cli.server` is the server itself)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from forge.cli.server import DEFAULT_IDLE_MINUTES
from forge.cli.wire import connect, private, recv_message, send_message, server_address, server_dir, server_key
from forge.vocab.procs import pid_alive


def ask(address: Path, op: str = "ping") -> dict | None:
    """The server's state at `address` (after `op`), or None when none answers there."""
    sock = connect(address)
    if sock is None:
        return None
    with sock:
        try:
            send_message(sock, {"op": op})
            return recv_message(sock)[0]
        except (OSError, ValueError):
            return None


def start(idle_s: float = DEFAULT_IDLE_MINUTES * 60, timeout_s: float = 600.0) -> tuple[dict, bool]:
    """Start this environment's server (or find it running) and wait until it is ready: its
    state and whether it was started now."""
    address = server_address()
    running = ask(address)
    if running is not None:
        return running, False
    address.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not private(address.parent):
        raise RuntimeError(f"{address.parent} is not a folder only this user can open (chmod 700 it, or remove it)")
    log = address.with_suffix(".log")
    code = "import sys; from forge.cli.entry import serve_here; serve_here(sys.argv[1:])"  # the program it runs
    args = [sys.executable, "-c", code, str(address), str(idle_s), json.dumps(sys.path)]
    with open(log, "w") as out:
        process = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd="/"
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = ask(address)
        if state is not None:
            return state, True
        if process.poll() is not None:
            tail = log.read_text().strip().splitlines()[-1:] or ["(no output)"]
            raise RuntimeError(f"forge server exited with {process.returncode} before it was ready: {tail[0]}")
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"forge server was not ready after {timeout_s:.0f} s; see {log}")


def stop(every: bool = False, timeout_s: float = 30.0) -> list[dict]:
    """Stop this environment's server (every one of this user's with `every`); they finish the
    commands they run first. The states of those stopped."""
    addresses = sorted(server_dir().glob("*.sock")) if every else [server_address()]
    stopped = [state for a in addresses if (state := ask(a, "stop")) is not None]
    deadline = time.monotonic() + timeout_s
    for state in stopped:
        while pid_alive(state["pid"]) and time.monotonic() < deadline:
            time.sleep(0.05)
    return stopped


def status() -> list[tuple[Path, dict, bool]]:
    """Every server of this user that answers: its socket, state and whether it serves the
    current environment."""
    mine = server_key()
    out = []
    for address in sorted(server_dir().glob("*.sock")):
        state = ask(address)
        if state is not None:
            out.append((address, state, address.stem == mine))
    return out
