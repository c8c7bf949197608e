"""One worker process per device: a crash, a hang or a sticky device error takes down a
worker, never the run.

Model: each device has a slot holding one worker process (the model loaded once), a pipe,
and a FIFO of batches sent to it; the head of the FIFO is the one running. `collect` waits
on every pipe and every process sentinel at once and turns what arrives into `Outcome`s:
results, errors, out-of-memory, a dead process (its batches come back LOST), a head past
its deadline (TIMEOUT; the worker gets no more work and is killed unless it answers within
`kill_grace_s`). A dead or killed worker is replaced up to `max_restarts` times per device;
then the device is retired and the others finish the work. The timing and replacement
bookkeeping is `forge.executors.base.SlotExecutor`'s, shared with the Ray executor.

The fork server the workers fork from can die too (kill -9, the out-of-memory killer). Its
workers run on: they are processes of their own, which it only reports the exits of, so from
then on a worker's pipe reaching end of file is its exit ("orphaned"), and killing one is a
signal to its pid. The next worker start gets a new fork server (`warm_fork`); if none will
start, the device is retired with the reason, as after too many restarts.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait as wait_any
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

from forge.executors.base import Outcome, Slot, SlotExecutor, Status, one_line
from forge.executors.warm_fork import forget_dead_fork_server
from forge.executors.worker import Ran, run_batch
from forge.vocab.geometry import Batch, Device
from forge.vocab.procs import resident_bytes, resident_peak_bytes

if TYPE_CHECKING:
    from forge.config.schema import Runtime

# Workers fork from a server process that imported torch and the function's module once, so a
# replacement starts in well under a second; fork from the driver would copy its threads and
# CUDA state.
_ctx = mp.get_context("forkserver")
#: what every worker needs, preloaded by the fork server whatever the function (the first, only
#: the fork server imports: its exit skips the interpreter's teardown of torch and transformers;
#: the last builds what each worker's model load would)
COMMON_MODULES = (
    "forge.executors.fork_server_exit",
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "forge.executors.fork_server_warm",
)
#: starts of one worker tried before its device is retired: the fork server died during one (a
#: new one starts on the next, once the dead one has exited)
START_TRIES = 4


def warm_up(modules: tuple[str, ...] = ()) -> None:
    """Start the fork server now: it imports torch, transformers and `modules` in its own
    process while the driver composes the config and sets up the function, instead of after
    (start-up overlaps on a second core). A no-op once it runs; `forge run` calls it as soon
    as it knows the run uses this executor."""
    from multiprocessing import forkserver

    _ctx.set_forkserver_preload([__name__, *COMMON_MODULES, *modules])
    forkserver.ensure_running()


@dataclass(kw_only=True)
class _Slot(Slot):
    process: BaseProcess
    conn: Connection
    load_error: str | None = None  # why the worker could not load its model
    orphaned: bool = False  # its fork server died: only its pipe's end of file tells of its exit


class ProcessExecutor(SlotExecutor[_Slot]):
    """The executor `runtime.executor=process` builds (a forge_executors factory)."""

    def __init__(self, function, cache_tokens: int, runtime: Runtime, *, plugins: tuple[str, ...] = (), hook=None):
        super().__init__(
            max_in_flight=runtime.max_in_flight,
            max_restarts=runtime.max_restarts,
            startup_timeout_s=runtime.startup_timeout_s,
            kill_grace_s=runtime.kill_grace_s,
        )
        self.function = function
        self.cache_tokens = cache_tokens
        self.plugins = tuple(plugins)  # registered in each worker: its fault points fire there, not via `hook`
        self.keep_freed_memory = runtime.keep_freed_memory  # a CPU worker's allocator (forge.executors.cpu_process)
        self._threads = 1

    # -- lifecycle --------------------------------------------------------------
    def start(self, devices: list[Device]) -> None:
        _ctx.set_forkserver_preload([__name__, *COMMON_MODULES, *self.function.worker_modules()])  # unless warmed up
        cpu_workers = sum(1 for d in devices if d.torch_device == "cpu")
        self._threads = max(1, (os.cpu_count() or 1) // max(1, cpu_workers))
        for device in devices:
            self.restarts[device.name] = 0
            self._spawn(device)

    def _spawn(self, device: Device) -> None:
        why = ""
        for attempt in range(START_TRIES):
            parent, child = _ctx.Pipe()  # a fresh pipe each try: a worker forked by a failed one must not share it
            process = _ctx.Process(
                target=worker_main,
                name=f"forge-worker-{device.name}",
                daemon=True,
                args=(
                    child,
                    self.function,
                    device,
                    self.cache_tokens,
                    self.plugins,
                    self._threads,
                    self.keep_freed_memory,
                    dict(os.environ),
                ),
            )
            asked = time.monotonic()  # start() waits for the fork server to finish its imports
            try:
                process.start()
            except (OSError, EOFError) as exc:  # the fork server died before it told the worker's pid
                parent.close()  # a worker it forked all the same finds its pipe closed and exits
                child.close()
                why = one_line(exc)
                time.sleep(0.1 * (attempt + 1))  # for the dead server to exit: the next start replaces it
                forget_dead_fork_server()
                continue
            child.close()
            self.slots[device.name] = _Slot(device=device, process=process, conn=parent, started=asked)
            return
        self.slots.pop(device.name, None)
        self.retired[device.name] = f"device {device.name} retired: its worker could not start: {why}"

    @staticmethod
    def _kill(slot: _Slot) -> None:
        if not slot.orphaned and not slot.process.is_alive() and _outlives_server(slot.process):
            slot.orphaned = True  # its fork server died unnoticed: process.kill() would skip it
        if slot.orphaned:  # its fork server is gone, and with it the exit status: its pipe tells
            if not _ended(slot.conn, 0.0) and slot.process.pid is not None:
                try:
                    os.kill(slot.process.pid, signal.SIGKILL)  # its pid is not reused while its pipe is open
                except ProcessLookupError:
                    pass
                _ended(slot.conn, 10.0)
        else:
            if slot.process.is_alive():
                slot.process.kill()
            slot.process.join(10)
        slot.conn.close()

    def close(self, grace_s: float = 5.0) -> None:
        for slot in self.slots.values():
            try:
                slot.conn.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + grace_s
        for slot in self.slots.values():
            slot.process.join(max(0.0, deadline - time.monotonic()))  # at once for an orphan: it reads "dead"
            if slot.orphaned or _outlives_server(slot.process):
                _ended(slot.conn, max(0.0, deadline - time.monotonic()))
            self._kill(slot)
        self.slots.clear()

    # -- work -------------------------------------------------------------------
    def submit(self, ticket: int, device: Device, batch: Batch, timeout_s: float | None) -> None:
        slot = self.slots[device.name]
        self._queue(slot, ticket, timeout_s)
        try:
            slot.conn.send((ticket, batch))
        except (OSError, ValueError) as exc:  # the worker died; its sentinel reports it
            self._replace(slot, f"worker of {device.name} lost: {one_line(exc)}")

    def collect(self, wait_s: float) -> list[Outcome]:
        if self._pending:
            wait_s = 0.0
        now = time.monotonic()
        deadline = now + wait_s
        for slot in self.slots.values():
            due = self._due(slot)
            if due is not None:
                deadline = min(deadline, due)
        waitables: dict[Connection | int, _Slot] = {}  # a worker's pipe, and its sentinel (a handle)
        for slot in self.slots.values():
            waitables[slot.conn] = slot
            if not slot.orphaned:  # an orphan's sentinel stays ready (end of file) for good
                waitables[slot.process.sentinel] = slot
        if waitables:
            wait_any(list(waitables), timeout=max(0.0, deadline - now))
        for slot in list(self.slots.values()):
            self._read(slot)
        now = time.monotonic()
        for slot in list(self.slots.values()):
            self._check_time(slot, now)
        out, self._pending = self._pending, []
        return out

    def _read(self, slot: _Slot) -> None:
        name = slot.device.name
        # asked before the pipe is read: a worker whose exit the fork server reported has closed its pipe by then
        alive = slot.orphaned or slot.process.is_alive()
        ended = False
        try:
            while slot.conn.poll():
                msg = slot.conn.recv()
                if msg[0] == "ready":
                    self._ready(slot, msg[1], msg[2])
                    self.resident_ready_bytes.setdefault(name, msg[3])
                    continue
                if msg[0] == "load_failed":
                    slot.load_error = msg[1]
                    continue
                kind, ticket, payload, seconds = msg[:4]
                if kind == Status.PARTIAL.value:  # the head runs on: it is still the one running
                    self._pending.append(Ran(Status.PARTIAL, payload, seconds).outcome(ticket, name))
                    continue
                if slot.queue and slot.queue[0][0] == ticket:
                    slot.queue.popleft()
                self._answered(slot)
                self._resident(name, msg[4])
                self._pending.append(Ran(Status(kind), payload, seconds).outcome(ticket, name))
        except (EOFError, OSError):
            ended = True
        if not alive and not ended and _outlives_server(slot.process):
            slot.orphaned = alive = True
            forget_dead_fork_server()  # reaped now; the next worker start runs a new one
        if alive and not (slot.orphaned and ended):
            return
        if slot.orphaned:
            why = "exit code unknown: its fork server had died"
        else:
            code = slot.process.exitcode
            why = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        self._replace(
            slot,
            f"worker of {name} could not load the model: {slot.load_error}"
            if slot.load_error
            else f"worker of {name} died ({why}){'' if slot.ready else _script_hint()}",
        )


def _script_hint() -> str:
    """For a worker that died before it was ready: multiprocessing runs the calling script again
    in every worker it starts from one (as `__mp_main__`), so a script that calls `forge.run` or
    a `Session` at its top level, unguarded, starts that run again inside the worker, which dies."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if getattr(main, "__spec__", None) is not None or not path or os.path.basename(path) == "forge":
        return ""  # `python -m ...`, a notebook, or the forge command: no script is run again
    return (
        f'; if {path} starts Forge at its top level, put that under `if __name__ == "__main__":` '
        "(each worker process runs the script again)"
    )


def _outlives_server(process: BaseProcess) -> bool:
    """Whether a worker reported dead lives on, its fork server dead: multiprocessing reads exit
    code 255 when the server's status pipe ends without one, yet the worker's pid still runs."""
    if process.exitcode != 255 or process.pid is None:
        return False
    try:
        os.kill(process.pid, 0)
    except ProcessLookupError:
        return False
    return True


def _ended(conn: Connection, timeout: float) -> bool:
    """Whether the worker at the other end of `conn` has exited (its end closed: end of file),
    waiting up to `timeout` seconds; what it still sends is dropped."""
    deadline = time.monotonic() + timeout
    while wait_any([conn], max(0.0, deadline - time.monotonic())):
        try:
            conn.recv_bytes()
        except (EOFError, OSError):
            return True
    return False


# ----------------------------------------------------------------------------- the worker process


def worker_main(
    conn,
    function,
    device: Device,
    cache_tokens: int,
    plugins: tuple[str, ...],
    threads: int,
    keep_freed_memory: bool,
    environ: dict[str, str],
) -> None:
    """A worker process: load the model once, then run batches until told to stop or the
    driver goes away (its pipe closes)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    os.environ.clear()  # the driver's environment now, not the fork server's from when it started
    os.environ.update(environ)
    from forge.pluginmanager import make_plugin_manager

    if device.torch_device == "cpu":
        from forge.executors.cpu_process import run_cpu_device

        run_cpu_device(threads, keep_freed_memory)
    inbox: queue.SimpleQueue = queue.SimpleQueue()  # filled from the start: the driver may send while we load
    threading.Thread(target=_read_into, args=(conn, inbox), daemon=True).start()
    t0 = time.perf_counter()
    try:
        hook = make_plugin_manager(load_entry_points=False, modules=plugins).hook
        worker = function.open_worker(device, cache_tokens)
    except Exception as exc:  # noqa: BLE001 - the driver says why the device cannot run
        _send(conn, ("load_failed", one_line(exc)))
        return
    _send(conn, ("ready", time.perf_counter() - t0, time.time(), resident_bytes()))
    while True:
        msg = inbox.get()
        if msg is None:
            break
        ticket, batch = msg
        emit = lambda part, t=ticket: _send(conn, ("partial", t, (part.positions, part.output), part.seconds))  # noqa: E731
        ran = run_batch(worker, hook, device, batch, emit)
        _send(conn, (ran.status.value, ticket, ran.payload, ran.seconds, resident_peak_bytes()))
        if ran.sticky:
            break  # this process is done: the driver sees it exit and starts another
    worker.close()


def _send(conn, msg) -> None:
    """Send to the driver. A closed pipe means nobody reads: the driver died, or gave up on this
    worker (one its dying fork server forked without telling the pid); the worker ends quietly."""
    try:
        conn.send(msg)
    except OSError:
        os._exit(0)


def _read_into(conn, inbox: queue.SimpleQueue) -> None:
    """Drain the pipe while the worker computes, so the driver's sends never wait on a worker
    that is itself waiting to send a result (both pipe buffers full: a deadlock)."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            # the driver is gone or gave up on this worker (it asks a worker to stop with None, and
            # closes the pipe only on one it killed or never knew the pid of): nothing to finish for
            os._exit(0)
        inbox.put(msg)
        if msg is None:
            return
