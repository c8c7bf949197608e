"""multiprocessing's fork server forked from this process instead of started afresh.

The process executor's workers fork from multiprocessing's fork server, which a cold command
starts as a new interpreter that imports torch and transformers (seconds). A command that
`forge server` forked has those imports already; forking the fork server from it makes its
workers start warm as well. The fork server is the command's own child with the same
listening socket and "alive" pipe as one multiprocessing starts (Python 3.10-3.12's
`multiprocessing.forkserver`, whose private state this fills in), so everything after is
multiprocessing's: workers connect to it, and it exits when the command and its workers have.

A fork server can die (a kill -9, the out-of-memory killer). multiprocessing's `ensure_running`,
which every worker start calls, starts another once it has reaped the dead one, a cold one
(`forget_dead_fork_server` covers what it does not: a server that is no child of this process).
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Any


def fork_server_here() -> bool:
    """Fork multiprocessing's fork server from this process, which must have one thread of
    Python; False (nothing done: multiprocessing starts its own when asked) on a Python whose
    fork server keeps other state, or once one runs."""
    if not (3, 10) <= sys.version_info[:2] <= (3, 12):
        return False  # 3.13 added an authentication key to the fork server's handshake
    from multiprocessing import connection, forkserver, resource_tracker

    server: Any = forkserver._forkserver  # private: the state ensure_running would fill in
    unix_address: Any = connection.arbitrary_address  # type: ignore[attr-defined]
    if server._forkserver_pid is not None:
        return False
    with server._lock:
        resource_tracker.ensure_running()  # as ensure_running does: the workers share one tracker
        listener = socket.socket(socket.AF_UNIX)
        address = unix_address("AF_UNIX")
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the fork server: multiprocessing's own loop, until every client is gone
            try:
                os.close(alive_w)
                forkserver.main(listener.fileno(), alive_r, [])
            finally:
                os._exit(0)
        listener.close()
        os.close(alive_r)
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid
    return True


def forget_dead_fork_server() -> bool:
    """Forget this process's fork server if it has exited, as `ensure_running` does before it
    starts another: its "alive" pipe closed, its pid reaped. Also when the pid is no child of
    this process (reaped elsewhere), where `ensure_running`'s own check would raise instead.
    True if it was forgotten; False while it runs, or when none was started."""
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver  # private: the state ensure_running checks
    with server._lock:
        pid = server._forkserver_pid
        if pid is None:
            return False
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == 0:
                return False  # still running (or killed, and not yet exited)
        except ChildProcessError:
            pass
        os.close(server._forkserver_alive_fd)
        server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
    return True
