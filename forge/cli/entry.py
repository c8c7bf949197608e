"""The `forge` command's entry point: hand the command to a warm `forge server` of this exact
environment when one runs, else run it here (`forge.cli.app`).

Light on purpose (the standard library, `forge.cli.wire` and `forge.driver.report`): on the warm
path this module is all the command imports. The server (`forge.cli.server`) forks a child
that *is* the command: it gets this process's arguments, working directory, environment and
stdin/stdout/stderr, so it writes to the terminal itself; this process forwards the signals a
terminal sends (Ctrl-C reaches the child and its workers, as it would reach a command run here)
and exits with the child's status. A server is found only for the same interpreter, `sys.path`,
installed packages, Forge source and environment variables (`forge.cli.wire.server_key`), so a
warm run imports what a cold one would; anything else runs cold, as if no server existed.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from forge.cli.wire import FORWARDED, connect, recv_message, send_message, server_address

#: subcommands that never go through a server (they manage it)
LOCAL_COMMANDS = frozenset({"server"})


# -- the warm path -------------------------------------------------------------------------
def run_warm(argv: list[str], address: Path | None = None) -> int | None:
    """Run `forge ARGV` in the server at `address` (this environment's by default) and return
    its exit code; None when no server took it (the caller runs the command itself)."""
    from forge.driver.report import process_started

    sock = connect(address or server_address())
    if sock is None:
        return None
    with sock:
        request = {
            "op": "run",
            "argv": [sys.argv[0], *argv],
            "cwd": os.getcwd(),
            "env": dict(os.environ),
            "path": list(sys.path),
            "umask": _umask(),
            "started": process_started(),
        }
        child: list[int] = []  # the command's pid (and process group), once the server forked it
        pending: list[int] = []  # signals that came before it
        previous = {signum: signal.getsignal(signum) for signum in FORWARDED}
        for signum in FORWARDED:
            signal.signal(signum, lambda s, _f: _forward(child[0], s) if child else pending.append(s))
        try:
            send_message(sock, request, [0, 1, 2])
            sock.settimeout(None)
            reply, _ = recv_message(sock)
        except (OSError, ValueError):
            reply = {}
        if "pid" not in reply:  # a server that stopped between connect and fork: nothing ran
            for forwarded, handler in previous.items():  # the command's own handling (main's), as it was
                signal.signal(forwarded, handler if handler is not None else signal.SIG_DFL)
            if pending:
                signal.raise_signal(pending[0])  # as if it came now: main's handler says so in one line
            return None
        child.append(int(reply["pid"]))
        for early_signal in pending:
            _forward(child[0], early_signal)
        signal.signal(signal.SIGTSTP, lambda _s, _f: _suspend(child[0]))
        signal.signal(signal.SIGCONT, lambda _s, _f: _forward(child[0], signal.SIGCONT))
        try:
            done, _ = recv_message(sock)
        except (OSError, ValueError):  # the server died under the command: it goes too, as it would have
            _forward(child[0], signal.SIGKILL)
            print(
                f"forge: the forge server stopped under this command (pid {child[0]}); it was killed", file=sys.stderr
            )
            return 1
    code = int(done["exit"])
    return code if code >= 0 else 128 - code  # killed by a signal: as a shell reports it


def _forward(child: int, signum: int) -> None:
    try:
        os.killpg(child, signum)
    except ProcessLookupError:
        pass


def _suspend(child: int) -> None:
    """Ctrl-Z: stop the command's group, then this process, as a shell's job stops; `fg` or `bg`
    (SIGCONT) resumes this process, which resumes the command."""
    _forward(child, signal.SIGTSTP)
    os.kill(os.getpid(), signal.SIGSTOP)  # stops here until SIGCONT (a SIGTSTP would not in an orphaned group)
    _forward(child, signal.SIGCONT)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def serve_here(argv: list[str]) -> None:  # pragma: no cover - the server process (forge.cli.server.start)
    """The server process: import the CLI, then serve commands with it (`ADDRESS IDLE_S SYS_PATH_JSON`)."""
    import json

    sys.path[:] = json.loads(argv[2])  # the starting command's, before any import of it
    from forge.cli.app import main as command
    from forge.cli.server import serve

    serve(Path(argv[0]), float(argv[1]), command)


def main() -> None:  # pragma: no cover - console entry point
    """`forge ...`: warm through this environment's server when one runs, else here. SIGTERM and
    Ctrl-C are caught from here on (`forge.cli.early.catch_stop_signals`): at any moment before
    the command's own handling, a stop is one line naming the signal, and status 130."""
    from forge.cli import early

    previous = early.catch_stop_signals()
    argv = sys.argv[1:]
    try:
        if argv and argv[0] not in LOCAL_COMMANDS and not argv[0].startswith("-"):
            code = run_warm(argv)
            if code is not None:
                sys.exit(code)
        if argv and argv[0] == "run":  # cold: the workers' imports start before the CLI's own
            early.start_workers(argv[1:])
        from forge.cli.app import main as run_here

        run_here()
    except KeyboardInterrupt:
        early.stop_workers()
        print(early.stopped_line(), file=sys.stderr, flush=True)
        os._exit(early.STOPPED_STATUS)  # nothing to tear down: no run began
    finally:  # reached only where main returns (a test calling it): the caller's handlers back
        early.restore_signals(previous)


if __name__ == "__main__":  # pragma: no cover
    main()
