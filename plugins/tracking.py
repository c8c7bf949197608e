"""Trackers on the accounting hooks: the run's figures to TensorBoard, MLflow, W&B, trackio.

The trackers the config selects (`trackers=[...]`, `run.trackers`) are driven from the driver
process, where the ledger counts. The hooks only count and keep a dict per batch; a thread of the
driver sends what they kept down a pipe every half second (one message), to the trackers' own
process (`serve`), where a thread per tracker imports its library, starts it, logs and finishes
it, so a tracker's start-up and writes overlap the run instead of holding batches up or taking
the GIL from the run's threads. FORGE_TRACKERS_NICE=N lowers that process's priority (niceness
N; by default the run's own): its start-up then takes only what the run leaves idle, but on a
machine other work keeps busy it is starved and the run's end waits for it (docs/benchmarks.md).
Per batch it logs, at a step counted in tokens completed (items an earlier session committed
included): tokens, items, tokens/s, padding share, prefix reuse, and the device's own tokens
and busy seconds. At the end it logs report.json's totals and status (after the ledger added
them: `trylast`).

A tracker that is not installed, or whose start, log or finish raises, is one warning line on
stderr (and in report.json's `trackers`); the run goes on without it. Each tracker's id is kept
in `<run dir>/trackers/ids.json`, so `resume=true` continues the same tracker run.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections import defaultdict
from multiprocessing.connection import Connection
from pathlib import Path
from types import SimpleNamespace

from forge.hookspecs import hookimpl
from forge.io.location import local_path
from forge.pluginmanager import load_object
from forge.tracker import Tracker, TrackerRun, flat_params
from forge.vocab.column_batch import ItemColumns

NAME = "tracking"
IDS = "ids.json"  # <run dir>/trackers/ids.json: tracker name -> its run's id
END_WAIT_S = 120.0  # the most the end waits for trackers to finish their writes
EXIT_WAIT_S = 1.0  # then for their process to exit, before leaving that to this process's exit
SEND_EVERY_S = 0.5  # the driver sends the batches' points down the pipe at most this often, together
NICE = 0  # the niceness the trackers' process adds (FORGE_TRACKERS_NICE: another), before anything is imported
CHILD = (
    "import os, sys; os.nice(int(sys.argv[3])); "
    "from forge.builtin.tracking import serve; serve(int(sys.argv[1]), int(sys.argv[2]))"
)


def _metric_name(text: str) -> str:
    """A name every tracker takes (MLflow refuses ':' in `cuda:0`)."""
    return re.sub(r"[^A-Za-z0-9_./-]", "_", text)


class _Feed:
    """What the hooks count, in the driver, and the trackers' process they send it to."""

    def __init__(self, run, folder: Path, selected: dict):
        self.names = list(selected)
        self.started = time.perf_counter()
        self.step = 0  # tokens completed (resumed included): the x-axis
        self.session_tokens = 0
        self.items = 0
        self.sums: defaultdict[str, int] = defaultdict(int)  # padding, padded_slots, prefix, reused
        self.devices: defaultdict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # name -> [tokens, busy s]
        # a process of their own, a fresh interpreter that imports only this module (not the command's
        # main module, as a spawned multiprocessing child would): their imports and writes take no GIL
        # from the run's threads. Two pipes, pickled messages; at its end it answers with the notes
        theirs_in, to_them = os.pipe()  # (read end, write end)
        from_them, theirs_out = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # a plugin's classes import there
        nice = os.environ.get("FORGE_TRACKERS_NICE", str(NICE))
        self.process = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(theirs_in), str(theirs_out), nice],
            pass_fds=(theirs_in, theirs_out),
            env=env,
        )
        os.close(theirs_in)
        os.close(theirs_out)
        self.conn = Connection(to_them, readable=False)
        self.answer = Connection(from_them, writable=False)
        config = {k: v for k, v in (run.config or {}).items() if k != "hydra"}
        # the hooks only append to `points`; a thread of the driver sends them, the points of half a
        # second in one message, so a batch never waits on the pipe (full while the trackers start up)
        self.points: list[tuple[int, dict]] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        first = (config, str(run.run_dir), str(folder), selected)
        self.sender = threading.Thread(target=self._send_loop, args=(first,), name="forge-trackers-feed", daemon=True)
        self.sender.start()

    # -- the hooks' side: count and queue

    def batch(self, batch, device, stats) -> None:
        n = batch.num_tokens
        self.step += n
        self.session_tokens += n
        self.items += len(batch.items)
        s = self.sums
        s["padding"] += batch.padding
        s["padded_slots"] += stats.padded_slots
        s["prefix"] += batch.prefix_tokens
        s["reused"] += stats.cache_hit_tokens + stats.shared_tokens
        dev = self.devices[device.name]
        dev[0] += n
        dev[1] += stats.seconds
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        figures = {
            "tokens/completed": self.step,
            "items/completed": self.items,
            "tokens/per_s": self.session_tokens / elapsed,
            "tokens/padding_share": s["padding"] / s["padded_slots"] if s["padded_slots"] else 0.0,
            "tokens/prefix_reuse": s["reused"] / s["prefix"] if s["prefix"] else 0.0,
            "batch/tokens": n,
            "batch/padding_share": batch.padding / stats.padded_slots if stats.padded_slots else 0.0,
            "batch/tokens_per_s": n / stats.seconds if stats.seconds > 0 else 0.0,
            f"device/{_metric_name(device.name)}/tokens": dev[0],
            f"device/{_metric_name(device.name)}/busy_s": dev[1],
        }
        with self.lock:
            self.points.append((self.step, figures))

    def _send_loop(self, first) -> None:
        self._send(first)
        while not self.stopping.wait(SEND_EVERY_S):
            self._flush()

    def _flush(self) -> None:
        with self.lock:
            points, self.points = self.points, []
        if points:
            self._send(("log", None, points))

    def _send(self, message) -> None:
        try:
            self.conn.send(message)
        except (OSError, ValueError):  # the trackers' process is gone: end() says so
            pass

    def end(self, report: dict) -> dict[str, str]:
        totals = _totals(report)
        step = int((report.get("tokens") or {}).get("completed", self.step))
        self.stopping.set()
        self.sender.join(END_WAIT_S)  # it sent the config first; then the points it holds go, and the end
        if self.sender.is_alive():  # the pipe stayed full: the trackers' process reads no more
            return {
                name: _warn(name, f"its process read nothing for {END_WAIT_S:.0f} s; left behind")
                for name in self.names
            }
        self._flush()
        self._send(("end", step, (totals, str(report.get("status", "finished")))))
        try:
            if self.answer.poll(END_WAIT_S):
                notes = self.answer.recv()  # every tracker finished: what is left is the process's exit
                _reap(self.process)
                return notes
            what = f"still writing after {END_WAIT_S:.0f} s; left to finish"
        except (EOFError, OSError, subprocess.TimeoutExpired) as exc:
            what = f"its process ended early ({_line(exc) if str(exc) else 'no answer'})"
        return {name: _warn(name, what) for name in self.names}


def serve(fd_in: int, fd_out: int) -> None:
    """The trackers' process (`CHILD`): a thread per tracker, fed what the driver sends, until its end."""
    conn, answer = Connection(fd_in, writable=False), Connection(fd_out, readable=False)
    try:
        config, run_dir, folder, selected = conn.recv()
    except (EOFError, OSError):
        return
    writers = _Writers(config, run_dir, Path(folder), selected)
    while True:
        try:
            kind, step, payload = conn.recv()
        except (EOFError, OSError):  # the driver is gone
            kind, step, payload = "end", None, None
        for q in writers.queues.values():
            q.put((kind, step, payload))
        if kind == "end":
            notes = writers.wait()
            if step is not None:
                answer.send(notes)
            return


class _Writers:
    """In the trackers' process: each tracker on a thread of its own, so a slow one holds up no other."""

    def __init__(self, config: dict, run_dir: str, folder: Path, selected: dict):
        self.folder = folder
        self.notes: dict[str, str] = {}  # tracker -> "logged", or its warning
        self.ids = _read_ids(folder) if config.get("resume") else {}
        self.lock = threading.Lock()  # over `ids` and ids.json
        self.starting = threading.Lock()
        run = SimpleNamespace(config=config, run_dir=run_dir)
        params = flat_params(config)
        self.queues: dict[str, queue.SimpleQueue] = {name: queue.SimpleQueue() for name in selected}
        self.threads = [
            threading.Thread(target=self._work, args=(run, name, ref, params), name=f"forge-tracker-{name}")
            for name, ref in selected.items()
        ]
        for thread in self.threads:
            thread.start()

    def wait(self) -> dict[str, str]:
        deadline = time.monotonic() + END_WAIT_S
        for thread in self.threads:  # they finish side by side
            thread.join(max(deadline - time.monotonic(), 0.0))
        for name, thread in zip(self.queues, self.threads):
            if thread.is_alive():
                self.notes[name] = _warn(name, f"still writing after {END_WAIT_S:.0f} s; left to finish")
        return dict(self.notes)

    # -- a tracker's thread: start, log, finish

    def _work(self, run, name: str, ref: tuple, params: dict) -> None:
        with self.starting:  # one start at a time: two threads importing one package can see it half made
            tracker = self._start(run, name, ref, params)
        while True:
            kind, step, payload = self.queues[name].get()
            if tracker is not None:
                try:
                    if kind == "log":  # the points of a moment, in order
                        for at, figures in payload:
                            tracker.log(at, figures)
                    elif payload is not None:  # None: the driver is gone, nothing to finish with
                        tracker.finish(step, *payload)
                except Exception as exc:  # noqa: BLE001  (a tracker's failure never stops the run)
                    self.notes[name] = _warn(name, f"failed ({_line(exc)})")
                    tracker = None
            if kind == "end":
                return

    def _start(self, run, name: str, ref: tuple, params: dict) -> Tracker | None:
        tracker = None
        try:
            tracker = load_object(ref[0], f"tracker {name} (plugin {ref[1]})")()
            settings = _settings(tracker, (run.config.get("trackers") or {}).get(name) or {})
            folder = self.folder / name
            folder.mkdir(parents=True, exist_ok=True)
            run_name = settings.run_name or Path(str(run.run_dir)).name
            kept = tracker.start(TrackerRun(name, folder, settings, run_name, params, self.ids.get(name)))
        except ImportError as exc:
            need = getattr(tracker, "requires", "")
            hint = f"pip install '{need}'" if need else "install its package"
            self.notes[name] = _warn(name, f"not installed ({_line(exc)}); {hint}")
            return None
        except Exception as exc:  # noqa: BLE001  (a tracker that cannot start never stops the run)
            self.notes[name] = _warn(name, f"could not start ({_line(exc)})")
            return None
        self.notes[name] = "logged"
        if kept is not None:
            with self.lock:
                self.ids[name] = kept
                _write_ids(self.folder, self.ids)
        return tracker


def _settings(tracker: Tracker, values: dict):
    from forge.config.nodes import instantiate

    return instantiate(type(tracker).config_schema, values)


def _totals(report: dict) -> dict[str, float]:
    out: dict[str, float] = {}
    for group in ("items", "tokens"):
        for key, value in (report.get(group) or {}).items():
            out[f"{group}/{key}"] = value
    for key in ("padding_waste", "cache_hit_rate", "prefix_reuse_rate", "wall_s"):
        if isinstance(report.get(key), (int, float)):
            out[key] = report[key]
    return out


def _reap(process: subprocess.Popen) -> None:
    """Wait a moment for the trackers' process to exit (its interpreter's teardown, slow on a
    busy machine); else wait for it when this process exits, not at the run's end, so nothing
    outlives the command."""
    try:
        process.wait(EXIT_WAIT_S)
    except subprocess.TimeoutExpired:
        atexit.register(_wait_or_kill, process)


def _wait_or_kill(process: subprocess.Popen) -> None:
    try:
        process.wait(END_WAIT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def _warn(name: str, what: str) -> str:
    line = f"tracker {name}: {what}; the run goes on without it"
    print(f"forge: warning: {line}", file=sys.stderr, flush=True)
    return line


def _read_ids(folder: Path) -> dict:
    try:
        return json.loads((folder / IDS).read_text())
    except (OSError, ValueError):
        return {}


def _write_ids(folder: Path, ids: dict) -> None:
    try:
        (folder / IDS).write_text(json.dumps(ids, indent=1))
    except OSError as exc:
        print(f"forge: warning: trackers: {IDS} not written ({exc}); a resume starts new tracker runs", file=sys.stderr)


@hookimpl
def forge_run_start(run):
    if run.dry_run or not run.trackers:
        return
    root = local_path(run.run_dir) if run.run_dir is not None else None
    if root is None:
        for name in run.trackers:
            _warn(name, f"the run directory {run.run_dir} is not local, and trackers keep their files there")
        return
    folder = Path(root) / "trackers"
    folder.mkdir(parents=True, exist_ok=True)
    run.state[NAME] = _Feed(run, folder, dict(run.trackers))


@hookimpl
def forge_items_resumed(run, items):
    feed = run.state.get(NAME)
    if feed is not None:  # what earlier sessions committed: the series go on from it
        feed.step += items.total_tokens if isinstance(items, ItemColumns) else sum(it.num_tokens for it in items)
        feed.items += len(items)


@hookimpl
def forge_batch_completed(run, batch, device, stats):
    feed = run.state.get(NAME)
    if feed is not None:
        feed.batch(batch, device, stats)


@hookimpl(trylast=True)  # after the ledger put its totals in the report
def forge_run_end(run, report):
    feed = run.state.pop(NAME, None)
    if feed is not None:
        waited = time.perf_counter()
        report["trackers"] = feed.end(report)
        report["trackers_end_s"] = round(time.perf_counter() - waited, 3)  # the run's wait for their last writes
