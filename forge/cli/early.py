"""What a cold `forge run` starts before anything else: its workers' fork server.

Model: on a cold start the first batch waits for the worker's imports of torch and
transformers (2.8-3.0 s on a 2-core Intel Xeon, 6.9-7.5 s on a slower CPU), not for the
command's own set-up. So the command starts the process executor's fork server
(`forge.executors.process.warm_up`) as soon as its arguments say
the run will use it, before the CLI itself is imported: the entry point (`forge.cli.entry`)
calls `start_workers` once no warm `forge server` took the command, and `forge.cli.app` calls
it again for a command run another way (a test's `CliRunner`); the second call is a no-op.

It also holds how a stop signal (SIGTERM, Ctrl-C) ends the command outside the run loop
(`catch_stop_signals`, `stopped_line`): the entry point installs the handler before anything
else, so a stop at any moment of start-up is one line naming the signal and exit status 130,
never a silent death (SIGTERM's default) nor a silent 130 (typer's for Ctrl-C while it parses);
the run loop (`forge.driver.engine`) handles both from its start, and hands them back at its end.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

#: the status a command stopped by a signal exits with, whichever signal (as a Ctrl-C'd run does)
STOPPED_STATUS = 130
#: the name of each stop signal that arrived (SIGTERM, SIGINT), latest last
STOPPED_BY: list[str] = []
#: the stop lines built for printing (`stopped_line`): a stop that ends with none was swallowed
REPORTED: list[str] = []
#: innermost last: True while a stop waits for the end of the block (`stops_wait`)
_WAITING: list[bool] = []
#: a stop that came while stops waited, raised when they no longer do
_PENDING: list[str] = []

#: what the worker needs besides torch and transformers, preloaded before the function is known
RUNTIME_MODULES = ("forge.api", "forge.runtime.forward.causal_lm", "forge.runtime.forward.views")


def start_workers(args: list[str]) -> bool:
    """Start the fork server when the overrides in `args` (a `forge run`'s, after `run`) leave the
    default executor (process) in place; True if it was started. A sweep, a config print or
    another executor skips it: `forge.cli.app` then decides once the config is composed."""
    for a in args:
        key, _, value = a.partition("=")
        if (
            a in ("-m", "--multirun", "--cfg", "-c", "--help")
            or (key, value) == ("runtime", "ray")
            or (key == "runtime.executor" and value != "process")
        ):
            return False
    from forge.executors.process import warm_up

    warm_up(RUNTIME_MODULES)
    return True


def catch_stop_signals() -> dict[int, Any]:
    """Make SIGTERM raise KeyboardInterrupt, as Ctrl-C does, and both remember which signal came;
    returns the handlers replaced (for `restore_signals`). A signal whose handler is not the
    default (ignored, as a background job's Ctrl-C is, or already caught) is left alone, and
    outside the main thread no handler can be set. Without it SIGTERM kills the command before
    the CLI's own handling exists: no line, status -15, and the fork server goes on importing
    torch, with the terminal's output, for seconds."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {
        signum: signal.signal(signum, _stop)
        for signum in (signal.SIGINT, signal.SIGTERM)
        if signal.getsignal(signum) in (signal.SIG_DFL, signal.default_int_handler)
    }


def restore_signals(previous: dict[int, Any]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def _stop(signum: int, frame: object) -> None:
    STOPPED_BY.append(signal.Signals(signum).name)
    if _WAITING and _WAITING[-1]:
        _PENDING.append(STOPPED_BY[-1])
        return
    raise KeyboardInterrupt


def _raise_pending() -> None:
    if _PENDING and not (_WAITING and _WAITING[-1]):
        _PENDING.clear()
        raise KeyboardInterrupt


@contextmanager
def stops_wait() -> Iterator[None]:
    """A stop signal inside the block takes effect as it ends (a KeyboardInterrupt then), unless
    the block failed: for Hydra's own code, whose `finally` clauses can turn a KeyboardInterrupt
    raised mid-compose into an unrelated error (an OmegaConf node half built). Composing takes
    well under a second; `stops_at_once` opens the task's body inside it."""
    _WAITING.append(True)
    try:
        yield
    finally:
        _WAITING.pop()
    _raise_pending()


@contextmanager
def stops_at_once() -> Iterator[None]:
    """Inside `stops_wait`: a stop raises at once again (one that waited raises on entry)."""
    _WAITING.append(False)
    try:
        _raise_pending()
        yield
    finally:
        _WAITING.pop()


def stopped_line(during: str = "during start-up, before any work", ran: bool = False) -> str:
    """The one line for a command stopped by a signal (its KeyboardInterrupt caught), naming the
    signal; `ran`: a run had returned before it came."""
    by = f", by {STOPPED_BY[-1]}" if STOPPED_BY else ""
    then = (
        "what it committed stays; run the command again with resume=true to finish what did not"
        if ran
        else "nothing was committed; run the command again (with resume=true if output_dir already holds the run)"
    )
    REPORTED.append(f"interrupted {during}{by}: {then}")
    return REPORTED[-1]


def stop_workers() -> None:
    """Stop this process's fork server (and the resource tracker started with it) at once, and
    reap them: when start-up was interrupted, it would otherwise finish importing torch (seconds)
    before it noticed, holding the terminal's output; at the command's end, tear itself down after
    the command exits. Either way no worker of it is left to lose."""
    forkserver = sys.modules.get("multiprocessing.forkserver")
    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if server is not None and pid is not None:
        with suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        with suppress(Exception):  # closes its pipe and reaps it
            server._stop()
    tracker = getattr(sys.modules.get("multiprocessing.resource_tracker"), "_resource_tracker", None)
    if tracker is not None and getattr(tracker, "_pid", None) is not None:
        with suppress(Exception):  # it ends once its pipe closes; reaped here, not left a zombie
            tracker._stop()
