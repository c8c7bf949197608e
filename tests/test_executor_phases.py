"""A worker's start-up phases are the worker's own: a driver busy reading its input hears that
the worker is ready late, and the phases must not count that wait as the worker's."""

from __future__ import annotations

import time

import pytest

from forge.config.schema import Runtime
from forge.executors.base import Slot
from forge.executors.process import ProcessExecutor
from forge.vocab.geometry import Device, Limits

CPU = Device("cpu", Limits(max_batch_tokens=64, max_rows=4, max_seq_len=64))


def _executor() -> ProcessExecutor:
    runtime = Runtime(max_in_flight=2, max_restarts=0, startup_timeout_s=60.0, kill_grace_s=1.0)
    return ProcessExecutor(None, 0, runtime)


def test_ready_is_when_the_worker_said_so_not_when_the_driver_read_it():
    ex = _executor()
    slot = Slot(device=CPU, started=time.monotonic() - 5.0)  # asked for 5 s ago
    said = time.time() - 3.0  # the worker was ready 3 s ago; the driver reads it only now
    ex._ready(slot, 0.5, said)
    assert slot.ready and ex.ready_at["cpu"] == said
    assert ex.load_s["cpu"] == 0.5
    assert ex.worker_start_s["cpu"] == pytest.approx(5.0 - 3.0 - 0.5, abs=0.05)


def test_without_the_workers_time_ready_is_when_heard_and_a_later_clock_is_capped_at_now():
    ex = _executor()
    slot = Slot(device=CPU, started=time.monotonic() - 2.0)
    before = time.time()
    ex._ready(slot, 0.5)  # an executor whose workers do not say when (Ray's actors)
    assert before <= ex.ready_at["cpu"] <= time.time()
    assert ex.worker_start_s["cpu"] == pytest.approx(1.5, abs=0.05)
    later = _executor()
    later._ready(Slot(device=CPU, started=time.monotonic() - 2.0), 0.5, time.time() + 60)
    assert later.ready_at["cpu"] <= time.time()  # a worker's clock ahead of ours: never in the future


@pytest.mark.slow
def test_the_fork_server_builds_what_each_workers_model_load_would_before_it_forks():
    """transformers builds its checkpoint conversion table at a process's first `from_pretrained`
    (0.06 s of a worker's load here); the fork server's preloads build it once, so forked workers
    inherit it. If a transformers release drops the table, this says the warm-up no longer helps."""
    import subprocess
    import sys

    from forge.executors.process import COMMON_MODULES

    assert COMMON_MODULES[-1] == "forge.executors.fork_server_warm"  # after transformers
    code = (
        "import transformers.conversion_mapping as c\n"
        "assert c._checkpoint_conversion_mapping_cache is None\n"
        "import forge.executors.fork_server_warm\n"
        "assert c._checkpoint_conversion_mapping_cache is not None\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
