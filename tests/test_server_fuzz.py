"""The warm server's accept loop against hostile clients: wrong types, huge lengths, truncated
frames, bad JSON, slow writers. It answers each bad request with an error, keeps serving, is
never held by a slow client, and removes its socket however it ends."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import socket
import struct
import tempfile
import time
from pathlib import Path

import pytest

from forge.cli import wire
from forge.cli.server import _Server
from forge.cli.server_control import ask

PING_TIMEOUT_S = 2.0  # a ping must be answered within this (the client gives up after it)


def _serve(address: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    _Server(listener, Path(address), idle_s=600, command=lambda: None).loop()


@pytest.fixture
def served():
    folder = Path(tempfile.mkdtemp(prefix="ffuzz"))
    folder.chmod(0o700)
    address = folder / "k.sock"
    process = multiprocessing.get_context("fork").Process(target=_serve, args=(str(address),), daemon=True)
    process.start()
    try:
        deadline = time.monotonic() + 30
        while ask(address) is None:
            assert process.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        yield address, process
    finally:
        if process.is_alive():
            os.kill(process.pid, signal.SIGKILL)
        process.join(10)
        for path in folder.iterdir():
            path.unlink()
        folder.rmdir()


def _frame(payload: bytes, length: int | None = None) -> bytes:
    return struct.pack(">I", len(payload) if length is None else length) + payload


def _hostile(rng: random.Random) -> tuple[bytes, list[int]]:
    """One bad request: its bytes and the descriptors sent with them."""
    kind = rng.randrange(9)
    if kind == 0:  # JSON that is not an object
        value = rng.choice([[1, 2], "run", 42, None, True, [{"op": "ping"}]])
        return _frame(json.dumps(value).encode()), []
    if kind == 1:  # a huge declared length
        return _frame(b"{}", rng.choice([2**31, 2**32 - 1, wire.MAX_REQUEST_BYTES + 1])), []
    if kind == 2:  # a truncated frame
        return _frame(b'{"op": "ping"}', 500)[: rng.randrange(1, 12)], []
    if kind == 3:  # bytes that are not JSON
        return _frame(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))), []
    if kind == 4:  # an op of the wrong type or unknown
        return _frame(json.dumps({"op": rng.choice([["run"], {"a": 1}, 7, "reboot", None])}).encode()), []
    if kind == 5:  # run without the streams, or with fields of the wrong types
        fields = {"op": "run", "cwd": rng.choice([1, "/"]), "env": rng.choice([[], {}]), "argv": "ls"}
        return _frame(json.dumps(fields).encode()), []
    if kind == 6:  # run with three descriptors but a bad body
        fds = [os.open(os.devnull, os.O_RDWR) for _ in range(3)]
        return _frame(json.dumps({"op": "run", "argv": [1, 2], "env": {"A": 1}}).encode()), fds
    if kind == 7:  # fewer than 4 bytes, then the end
        return b"\x00" * rng.randrange(0, 4), []
    return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))), []  # noise


def _send(address: Path, data: bytes, fds: list[int]) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2.0)
        sock.connect(str(address))
        try:
            if fds:
                socket.send_fds(sock, [data], fds)
            elif data:
                sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            sock.recv(65536)  # an error answer, or the end
        except OSError:
            pass
        finally:
            for fd in fds:
                os.close(fd)


def _slow_writer(address: Path) -> socket.socket:
    """A client that sends one byte of its request and then nothing more (for now)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(address))
    sock.sendall(b"\x00")
    return sock


def test_a_thousand_hostile_messages_never_stop_the_server_answering_ping(served):
    address, process = served
    rng = random.Random(48)
    slow = [_slow_writer(address) for _ in range(8)]  # held open through the whole run
    try:
        for k in range(1000):
            data, fds = _hostile(rng)
            _send(address, data, fds)
            if k % 100 == 0:
                slow.append(_slow_writer(address))
                slow[k // 100].send(b"\x00")  # trickles on
            state = wire.connect(address, timeout=PING_TIMEOUT_S)
            assert state is not None, f"no connection after message {k}"
            with state:
                wire.send_message(state, {"op": "ping"})
                answer, _ = wire.recv_message(state)
            assert answer["pid"] == process.pid and answer["running"] == 0, (k, answer)
    finally:
        for sock in slow:
            sock.close()
    assert process.is_alive()


def test_a_bad_request_gets_an_error_answer_not_a_dead_server(served):
    address, process = served
    for body in ([1, 2], "ping", {"op": "reboot"}):
        with wire.connect(address) as sock:
            sock.sendall(_frame(json.dumps(body).encode()))
            length = struct.unpack(">I", sock.recv(4))[0]
            answer = json.loads(sock.recv(length))
        assert answer["error"].startswith("bad request:"), answer
    assert ask(address)["pid"] == process.pid


def test_the_server_removes_its_socket_on_sigterm_and_on_an_error(served, monkeypatch):
    address, process = served
    os.kill(process.pid, signal.SIGTERM)
    process.join(10)
    assert process.exitcode == 0 and not address.exists()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(address))
    listener.listen()
    server = _Server(listener, address, idle_s=600, command=lambda: None)
    monkeypatch.setattr(server, "_reap", lambda: (_ for _ in ()).throw(RuntimeError("a bug in the loop")))
    try:
        with pytest.raises(RuntimeError, match="a bug in the loop"):
            server.loop()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert not address.exists()
