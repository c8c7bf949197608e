"""`forge server`: a warm process that has imported torch, transformers and Forge's runtime once,
so that `forge run` and `forge plan` start without paying those imports again (about 8 s of a
cold start on a 2-core CPU machine, against 0.3 s of loading the embedded model).

As Rails' Spring or Gradle's daemon: `forge server start` starts one server for the current
environment (`forge.cli.entry.server_key`), which imports `PRELOAD` and listens on a Unix socket
in a folder only its user can open. For each command the server forks a child that is the
command (`_command`): in its own process group, with the client's stdin/stdout/stderr, working
directory, environment and `sys.path`. The child forks multiprocessing's fork server from itself
(`forge.executors.warm_fork`), so the workers start warm too. The server reaps the child and
sends its exit status back; when the client dies first (kill -9), the server kills the
command's process group, as a dead driver's workers die. The server stops after `idle_s`
without a command, on `forge server stop`, or on SIGTERM (after the commands it runs).
"""

from __future__ import annotations

import importlib
import io
import os
import selectors
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from forge.cli.wire import (
    CLIENT_STARTED,
    FORWARDED,
    READ_TIMEOUT_S,
    RequestReader,
    connect,
    private,
    run_request_problem,
    send_message,
)

#: what the server imports once besides the CLI (`forge.cli.entry.serve_here`): the heavy
#: libraries a command needs and Forge's runtime, but nothing that reads plugins (their code is
#: imported fresh by each command); the CLI's consoles are made again in each command, for its
#: terminal (`_command`)
PRELOAD = (
    "numpy",
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.llama.modeling_llama",
    "forge.executors.fork_server_warm",
    "tokenizers",
    "safetensors",
    "pyarrow",
    "pyarrow.parquet",
    "fsspec",
    "pluggy",
    "hydra",
    "omegaconf",
    "typer",
    "rich",
    "forge.api",
    "forge.driver.engine",
    "forge.runtime.forward.causal_lm",
    "forge.runtime.forward.views",
    "forge.executors.process",
)
DEFAULT_IDLE_MINUTES = 30.0  # `forge server start --idle-minutes`


# -- the server process --------------------------------------------------------------------
def serve(address: Path, idle_s: float, command: Callable[[], None]) -> None:
    """Import `PRELOAD`, then answer at `address` until stopped or idle for `idle_s`, running each
    command as `command()` (the CLI's entry, which leaves through `quick_exit`) in a child."""
    began = time.monotonic()
    for name in PRELOAD:
        importlib.import_module(name)
    import gc

    import torch

    gc.collect()
    gc.freeze()  # what the imports made lives on: no command's full collection walks it again (0.3-0.5 s each here)
    if torch.cuda.is_initialized():  # a fork after CUDA's start cannot use CUDA
        raise SystemExit("forge server: CUDA was initialised while importing; cannot fork commands safely")
    listener = _bind(address)
    print(f"forge server {os.getpid()}: ready in {time.monotonic() - began:.1f} s at {address}", flush=True)
    _Server(listener, address, idle_s, command).loop()


def _bind(address: Path) -> socket.socket:
    address.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not private(address.parent):
        raise SystemExit(f"forge server: {address.parent} is not a folder only this user can open; not serving there")
    if connect(address) is not None:
        raise SystemExit(f"forge server: another server already answers at {address}")
    address.unlink(missing_ok=True)  # a dead server's socket
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(address))
    os.chmod(address, 0o600)
    listener.listen(64)
    return listener


class _Server:
    """One thread: the selector serves the listener, clients still sending their request
    (`RequestReader`: read as bytes arrive, dropped past `READ_TIMEOUT_S`, so a slow writer holds no
    one up) and clients whose command runs (their end closing kills it)."""

    def __init__(self, listener: socket.socket, address: Path, idle_s: float, command: Callable[[], None]):
        self.listener, self.address, self.idle_s, self.command = listener, address, idle_s, command
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, None)
        self.children: dict[int, socket.socket] = {}  # a running command's pid -> its client
        self.reading: dict[socket.socket, RequestReader] = {}  # clients whose request is not whole yet
        self.served = 0
        self.started = time.time()
        self.last_active = time.monotonic()
        self.stopping = False
        self.terminated = False  # SIGTERM: stop, after the commands running (the loop acts on it)
        self.bound = os.stat(address).st_ino if address.exists() else None  # the socket file that is ours
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "terminated", True))

    def loop(self) -> None:
        try:
            while not (self.stopping and not self.children):
                for key, _ in self.selector.select(timeout=0.1):
                    if isinstance(key.data, RequestReader):
                        self._read(key.data)
                    elif key.data is not None:
                        self._client_readable(key.data, key.fileobj)  # type: ignore[arg-type]
                    elif not self.stopping:
                        self._accept()
                self._reap()
                self._drop_slow()
                if self.terminated or (not self.children and time.monotonic() - self.last_active > self.idle_s):
                    self.stop()
        finally:
            self.stop()  # whatever ends the loop, the socket goes: later commands must not find a dead one
            for reading in list(self.reading.values()):
                self._forget(reading)
                reading.conn.close()
            self.selector.close()

    def stop(self) -> None:
        if not self.stopping:
            self.stopping = True
            self.selector.unregister(self.listener)
            self.listener.close()
            try:
                if self.bound is None or os.stat(self.address).st_ino == self.bound:
                    self.address.unlink()  # ours: a newer server's socket at this path is left alone
            except OSError:
                pass

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        conn.setblocking(False)
        reading = self.reading[conn] = RequestReader(conn)
        self.selector.register(conn, selectors.EVENT_READ, reading)

    def _read(self, reading: RequestReader) -> None:
        try:
            request = reading.step()
        except (OSError, ValueError) as exc:
            self._answer(reading, {"error": f"bad request: {exc}"})
            return
        if request is None:
            return  # not whole yet
        self.reading.pop(reading.conn)
        self.selector.unregister(reading.conn)
        conn, fds, op = reading.conn, reading.fds, request.get("op")
        if op == "run" and not self.stopping:
            problem = run_request_problem(request, fds)
            if problem is None:
                conn.setblocking(True)
                self._fork(conn, request, fds)
                return
            request = {"error": problem}
        elif op not in ("ping", "stop", "run"):
            request = {"error": f"bad request: unknown op {op!r} (ping, stop or run)"}
        for fd in fds:
            os.close(fd)
        if op == "stop":
            self.stop()
        self._reply(conn, {"error": request["error"]} if "error" in request else self.state())

    def _answer(self, reading: RequestReader, message: dict) -> None:
        """Answer a client whose request is bad, and forget it."""
        self._forget(reading)
        self._reply(reading.conn, message)

    def _forget(self, reading: RequestReader) -> None:
        self.reading.pop(reading.conn, None)
        self.selector.unregister(reading.conn)
        for fd in reading.fds:
            os.close(fd)
        reading.fds = []

    @staticmethod
    def _reply(conn: socket.socket, message: dict) -> None:
        try:
            conn.settimeout(1.0)  # a client that does not read its answer holds no one up
            send_message(conn, message)
        except OSError:
            pass
        finally:
            conn.close()

    def _drop_slow(self) -> None:
        now = time.monotonic()
        for reading in [r for r in self.reading.values() if now - r.began > READ_TIMEOUT_S]:
            self._forget(reading)
            reading.conn.close()

    def state(self) -> dict:
        return {"pid": os.getpid(), "started": self.started, "served": self.served, "running": len(self.children)}

    def _fork(self, conn: socket.socket, request: dict, fds: list[int]) -> None:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                self.selector.close()
                for sock in (self.listener, conn, *self.children.values()):
                    sock.close()
                code = _command(request, fds, self.command)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        try:
            os.setpgid(pid, pid)  # also done by the child: whichever runs first
        except OSError:
            pass
        for fd in fds:
            os.close(fd)
        self.served += 1
        self.last_active = time.monotonic()
        self.children[pid] = conn
        try:
            send_message(conn, {"pid": pid})
        except OSError:
            pass  # the client is gone already: _client_readable kills the command
        self.selector.register(conn, selectors.EVENT_READ, pid)

    def _client_readable(self, pid: int, conn: socket.socket) -> None:
        try:
            gone = conn.recv(1) == b""
        except OSError:
            gone = True
        if gone:  # the client died (kill -9): its command goes with it, as a dead driver's workers do
            self.selector.unregister(conn)
            _killpg(pid, signal.SIGKILL)

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            self.last_active = time.monotonic()
            try:
                send_message(conn, {"exit": os.waitstatus_to_exitcode(status)})
            except OSError:
                pass
            try:
                self.selector.unregister(conn)
            except (KeyError, ValueError):
                pass  # unregistered already when its client left
            conn.close()


def _killpg(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


# -- the command, in the forked child --------------------------------------------------------
def _command(request: dict, fds: list[int], command: Callable[[], None]) -> int:
    """Become the command the client ran: its group, streams, place and environment; then run
    `command` as the cold command would run the CLI."""
    os.setpgid(0, 0)  # its own group: the client's forwarded signals reach its workers too
    for signum in (*FORWARDED, signal.SIGCHLD):
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.umask(int(request["umask"]))
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[:] = request["path"]
    sys.argv = list(request["argv"])
    _reopen_streams()
    from forge.cli.summary import reset_consoles

    reset_consoles()
    import numpy as np

    np.random.seed()  # a cold command's legacy numpy generator is seeded afresh; so is this one's
    from forge.executors.warm_fork import fork_server_here

    CLIENT_STARTED[:] = [float(request["started"])]  # the command's start is the client's (report phases)
    fork_server_here()
    command()
    return 0


def _reopen_streams() -> None:
    """sys.stdin/stdout/stderr on the client's descriptors, buffered as Python buffers them for
    such descriptors (line-buffered on a terminal, unbuffered under PYTHONUNBUFFERED)."""
    encoding = sys.__stdout__.encoding if sys.__stdout__ else "utf-8"
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))

    def text(fd: int, mode: str, errors: str) -> io.TextIOWrapper:
        raw = open(fd, mode + "b", buffering=0 if unbuffered and mode == "w" else -1, closefd=False)
        tty = os.isatty(fd)
        return io.TextIOWrapper(
            raw,  # type: ignore[arg-type]
            encoding=encoding,
            errors=errors,
            line_buffering=mode == "w" and (tty or fd == 2),
            write_through=unbuffered and mode == "w",
        )

    sys.stdin = sys.__stdin__ = text(0, "r", "strict")
    sys.stdout = sys.__stdout__ = text(1, "w", "strict")
    sys.stderr = sys.__stderr__ = text(2, "w", "backslashreplace")
