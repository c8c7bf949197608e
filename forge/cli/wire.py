"""The warm server's shared ground: which server a command may use (`server_key`, the socket
it listens on) and the wire between the `forge` command and the server (length-prefixed JSON,
file descriptors passed with the first bytes). Standard library only: the `forge` command
imports it before anything else (`forge.cli.entry`)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path

#: environment variables a shell changes on its own; every other one is part of the server's key
VOLATILE_ENV = frozenset({"PWD", "OLDPWD", "SHLVL", "_"})
#: the signals a terminal or a job control sends a command, forwarded to the warm child's group
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


#: the start (time.time()) of the `forge` command a warm server's child runs; None in a cold one
CLIENT_STARTED: list[float] = []


def server_dir() -> Path:
    """Where this user's servers listen: a private folder under $XDG_RUNTIME_DIR or the temp dir."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"forge-{os.getuid()}"


def _stamp(root: Path, suffixes: tuple[str, ...]) -> list[tuple[str, int, int]]:
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        for name in sorted(files):
            if name.endswith(suffixes):
                st = os.stat(os.path.join(folder, name))
                out.append((os.path.join(folder, name), st.st_mtime_ns, st.st_size))
    return out


def server_key(env: dict[str, str] | None = None, path: list[str] | None = None) -> str:
    """What a server must share with a command to run it: the interpreter, `sys.path` and each
    path entry's modification time (an install or uninstall changes site-packages), the Forge
    package's and the built-in functions' source files, and every environment variable but
    `VOLATILE_ENV` (torch, transformers and Python read some of them at import)."""
    import importlib.util

    env = dict(os.environ if env is None else env)
    path = list(sys.path if path is None else path)
    h = hashlib.sha1()
    h.update(json.dumps([sys.executable, sys.version, path]).encode())
    for entry in path:
        try:
            h.update(str(os.stat(entry or ".").st_mtime_ns).encode())
        except OSError:
            h.update(b"-")
    roots = [Path(__file__).resolve().parents[1]]
    spec = importlib.util.find_spec("functions")
    if spec is not None and spec.submodule_search_locations:
        roots += [Path(p) for p in spec.submodule_search_locations]
    for root in roots:
        h.update(json.dumps(_stamp(root, (".py",))).encode())
    h.update(json.dumps(sorted((k, v) for k, v in env.items() if k not in VOLATILE_ENV)).encode())
    return h.hexdigest()[:16]


def server_address(key: str | None = None) -> Path:
    return server_dir() / f"{key or server_key()}.sock"


# -- the wire: a 4-byte length, then JSON ------------------------------------------------
def send_message(sock: socket.socket, message: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    frame = struct.pack(">I", len(data)) + data
    if fds:
        socket.send_fds(sock, [frame], fds)
    else:
        sock.sendall(frame)


def _read_exactly(sock: socket.socket, n: int, first: bytes = b"") -> bytes:
    data = bytearray(first)
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the other end closed the connection")
        data += chunk
    return bytes(data)


def recv_message(sock: socket.socket, max_fds: int = 0) -> tuple[dict, list[int]]:
    """One message and the file descriptors sent with it (on its first bytes)."""
    if max_fds:
        head, fds, _, _ = socket.recv_fds(sock, 4, max_fds)
    else:
        head, fds = sock.recv(4), []
    if not head:
        raise ConnectionError("the other end closed the connection")
    (n,) = struct.unpack(">I", _read_exactly(sock, 4, head))
    if n > MAX_REQUEST_BYTES:
        raise ValueError(f"a message of {n} bytes (at most {MAX_REQUEST_BYTES})")
    message = json.loads(_read_exactly(sock, n))
    if not isinstance(message, dict):
        raise ValueError(f"a message must be a JSON object, not {type(message).__name__}")
    return message, list(fds)


#: a client must send its whole request within this time, or it is dropped (a slow writer holds no one up)
READ_TIMEOUT_S = 10.0
#: the largest request (JSON) the server reads: a command's argv, environment and sys.path
MAX_REQUEST_BYTES = 1 << 22
#: what a "run" request must carry, and of which type
_RUN_FIELDS = {"cwd": str, "umask": int, "env": dict, "path": list, "argv": list, "started": (int, float)}


class RequestReader:
    """A client's request read as its bytes arrive: a 4-byte length, then that much JSON, the
    client's stdin/stdout/stderr passed with the first bytes."""

    def __init__(self, conn: socket.socket):
        self.conn, self.began = conn, time.monotonic()
        self.data = bytearray()
        self.fds: list[int] = []

    def step(self) -> dict | None:
        """Read what has arrived: the request once whole, else None. ValueError: a bad one."""
        try:
            chunk, fds, _, _ = socket.recv_fds(self.conn, 65536, 3)
        except BlockingIOError:
            return None
        self.fds += fds
        if len(self.fds) > 3:
            raise ValueError("more than 3 file descriptors")
        if not chunk:
            raise ConnectionError("the client closed its end before its request was whole")
        self.data += chunk
        if len(self.data) < 4:
            return None
        (n,) = struct.unpack(">I", self.data[:4])
        if n > MAX_REQUEST_BYTES:
            raise ValueError(f"a request of {n} bytes (at most {MAX_REQUEST_BYTES})")
        if len(self.data) < 4 + n:
            return None
        request = json.loads(bytes(self.data[4 : 4 + n]))
        if not isinstance(request, dict):
            raise ValueError(f"a request must be a JSON object, not {type(request).__name__}")
        return request


def run_request_problem(request: dict, fds: list[int]) -> str | None:
    """Why a "run" request cannot be run (None: it can)."""
    if len(fds) != 3:
        return f"bad request: run needs the client's 3 standard streams, got {len(fds)}"
    for field, kind in _RUN_FIELDS.items():
        if not isinstance(request.get(field), kind) or isinstance(request.get(field), bool):
            return f"bad request: run needs {field!r} of type {getattr(kind, '__name__', 'number')}"
    if not all(isinstance(v, str) for v in [*request["argv"], *request["path"], *request["env"].values()]):
        return "bad request: run's argv, path and env hold strings only"
    return None


def private(folder: Path) -> bool:
    """Whether `folder` is this user's and no one else's (a shared temp dir's folder someone
    else made could hold another user's socket, which must never get a command)."""
    try:
        st = os.stat(folder)
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & 0o077


def connect(address: Path, timeout: float = 2.0) -> socket.socket | None:
    """A connection to the server at `address`, or None when none listens there (or its folder
    is not private to this user)."""
    if not address.exists() or not private(address.parent):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(address))
    except OSError:
        sock.close()
        return None
    return sock
