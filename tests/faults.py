"""A test-only plugin that injects faults at the `forge_fault` points (never registered in
production). Configured by the FORGE_FAULTS environment variable (JSON), which worker
processes inherit; registered with `plugins=[faults]`.

    {"dir": "/tmp/x",                                   # marker files count faults across processes
     "kill": {"point": "before_forward" | "during_forward" | "after_forward", "every": 3, "times": 3},
     "chaos": {"share": 0.2, "times": 4, "seed": 1},    # kill at a random point on a share of batches
     "oom_above": 600,                                  # out of memory above this many padded slots
     "hang": {"seconds": 60, "times": 1, "nth": 2},     # the nth first-attempt batch sleeps
     "fail": "message",                                 # every batch raises RuntimeError(message)
     "fail_write": 1,                                   # the first N shard writes raise ENOSPC
     "fail_commit": 2,                                  # commit records from the Nth on raise EIO (shards in place)
     "kill_run_at_write": 3,                            # SIGKILL the whole process group at shard N
     "pause_at_commit": {"nth": 2, "until": "/tmp/go"}, # shard N in place, its record not written: the run
                                                        # waits (as if paused) until that file exists
     "sigterm_at_start": true,                          # SIGTERM to the run itself as it starts (start-up)
     "hold_mb": 200}                                    # the process running a batch holds 200 MiB more (once)
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import threading
import time
from pathlib import Path

from forge.hookspecs import hookimpl

#: what `hold_mb` holds, in the process that ran the batch (kept until it exits)
_HELD: list[bytearray] = []


def _config() -> dict:
    return json.loads(os.environ.get("FORGE_FAULTS", "{}"))


def _claim(name: str, times: int) -> bool:
    """Take one of `times` slots named `name`, across processes (marker files)."""
    folder = Path(_config()["dir"])
    for k in range(times):
        try:
            os.close(os.open(folder / f"{name}-{k}", os.O_CREAT | os.O_EXCL))
            return True
        except FileExistsError:
            continue
    return False


def _count(name: str) -> int:
    """A counter shared by processes: returns how many times it was taken before."""
    folder = Path(_config()["dir"])
    k = 0
    while True:
        try:
            os.close(os.open(folder / f"{name}-n{k}", os.O_CREAT | os.O_EXCL))
            return k
        except FileExistsError:
            k += 1


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


@hookimpl
def forge_run_start(run):
    if _config().get("sigterm_at_start") and not run.dry_run:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises here; without one the process has ended


@hookimpl
def forge_fault(point, device, batch):
    cfg = _config()
    if point == "write_shard":
        if cfg.get("fail_write") and _claim("fail_write", cfg["fail_write"]):
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")
        if cfg.get("kill_run_at_write") and _count("write") + 1 == cfg["kill_run_at_write"]:
            os.killpg(os.getpgrp(), signal.SIGKILL)  # the whole run tree, mid-write
        return
    if point == "commit_record":
        pause = cfg.get("pause_at_commit")
        if pause and _count("commit-seen") + 1 == pause["nth"]:
            deadline = time.monotonic() + pause.get("max_s", 120)
            while not os.path.exists(pause["until"]) and time.monotonic() < deadline:
                time.sleep(0.05)
        if cfg.get("fail_commit") and _count("commit") + 1 >= cfg["fail_commit"]:
            raise OSError(errno.EIO, "I/O error writing the commit record (simulated)")
        return
    if cfg.get("hold_mb") and point == "before_forward" and not _HELD:
        _HELD.append(bytearray(b"\1" * (cfg["hold_mb"] << 20)))  # written: resident, not only reserved
    if "fail" in cfg:
        raise RuntimeError(cfg["fail"])
    if cfg.get("oom_above") and batch.padded_slots > cfg["oom_above"]:
        import torch

        raise torch.OutOfMemoryError(f"simulated: out of memory at {batch.padded_slots} padded slots")
    if batch.retry:
        return  # first attempts only: re-runs must get through
    if "kill" in cfg:
        kill = cfg["kill"]
        at = kill["point"]
        if point == "before_forward" and at in ("before_forward", "during_forward"):
            if _count("kill-seen") % kill["every"] == kill["every"] - 1 and _claim("kill", kill["times"]):
                if at == "during_forward":
                    threading.Timer(0.002, _die).start()  # dies while the forward pass runs
                else:
                    _die()
        elif point == "after_forward" == at:
            if _count("kill-seen") % kill["every"] == kill["every"] - 1 and _claim("kill", kill["times"]):
                _die()
    if "chaos" in cfg and point in ("before_forward", "after_forward"):
        chaos = cfg["chaos"]
        rng = random.Random(f"{chaos.get('seed', 0)}-{_count('chaos-seen')}")
        if rng.random() < chaos["share"] and _claim("chaos", chaos["times"]):
            if rng.random() < 0.5:
                threading.Timer(0.002, _die).start()
            else:
                _die()
    if "hang" in cfg and point == "before_forward":
        hang = cfg["hang"]
        if _count("hang-seen") + 1 == hang.get("nth", 1) and _claim("hang", hang.get("times", 1)):
            time.sleep(hang["seconds"])


def corrupt_rows(rows: list[str], share: float, seed: int = 0) -> tuple[list[bytes], set[int]]:
    """JSONL lines with `share` of them corrupted in mixed ways; returns (lines, corrupted indexes)."""
    rng = random.Random(seed)
    bad = set(rng.sample(range(len(rows)), max(1, int(len(rows) * share))))
    kinds = [
        lambda r: r[: len(r) // 2].encode(),  # malformed JSON
        lambda r: r.encode()[:-3] + b"\xff\xfe" + r.encode()[-3:],  # invalid UTF-8
        lambda r: json.dumps({k: v for k, v in json.loads(r).items() if k != "text"}).encode(),  # no text
        lambda r: json.dumps({**json.loads(r), "text": ""}).encode(),  # empty text
        lambda r: json.dumps({**json.loads(r), "text": 12345}).encode(),  # wrong type
    ]
    out = [kinds[i % len(kinds)](r) if i in bad else r.encode() for i, r in enumerate(rows)]
    return out, bad
