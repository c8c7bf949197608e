"""runtime=ray: the same run on one Ray actor per device (a local Ray instance here).

The module starts its own local Ray instance (2 CPUs) and shuts it down at the end, even
when a test fails; no Ray process outlives the module. Skipped where Ray is not installed
(`pip install -e '.[ray]'`; CI installs it).
"""

import os
import re
import sys
import time
from importlib.util import find_spec
from pathlib import Path

import pytest

from conftest import assert_same_output, clean_activations, run_forge, small_run, spec_for
from forge.errors import ForgeError

N = 48
FAST = small_run(N)
RAY = ["runtime=ray", "runtime.cpus_per_actor=1"]
TESTS = Path(__file__).resolve().parent
needs_ray = pytest.mark.skipif(find_spec("ray") is None, reason="Ray is not installed: pip install -e '.[ray]'")


RAY_PROCESS = re.compile(r"raylet|gcs_server|ray::|default_worker\.py|/ray/(_private|dashboard|autoscaler)")


def _ray_processes() -> set[int]:
    """Live processes that are Ray's (GCS, raylet, workers, monitors), by command line."""
    found = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if state != "Z" and RAY_PROCESS.search(cmd):
            found.add(int(proc.name))
    return found


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance for this module; its workers import this checkout and tests/ (faults)."""
    import ray

    before = _ray_processes()  # not ours
    path = os.pathsep.join([str(TESTS.parent), str(TESTS)])
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    try:
        yield ray
    finally:
        ray.shutdown()
        deadline = time.monotonic() + 15
        while _ray_processes() - before and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _ray_processes() - before, f"Ray processes left behind: {_ray_processes() - before}"


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """ids -> activations of a clean in-process run: what every Ray run must equal."""
    return clean_activations(tmp_path_factory.mktemp("clean"), *FAST, n=N)


def same_output(run_dir, clean):
    assert_same_output(run_dir, clean, atol=1e-4)


def test_runtime_ray_without_ray_is_one_line(monkeypatch):
    from forge.driver.engine import make_executor
    from forge.pluginmanager import make_plugin_manager

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails
    spec = spec_for(*FAST, *RAY)
    with pytest.raises(ForgeError, match=r"^runtime=ray needs Ray, an optional extra: pip install -e '\.\[ray\]'$"):
        make_executor(spec, 0, make_plugin_manager())


def test_ray_schema_is_its_own():
    assert spec_for(*RAY, "runtime.address=auto").runtime.address == "auto"
    with pytest.raises(ForgeError, match="runtime.cpus_per_actor=0.0: must be a positive number"):
        spec_for(*RAY, "runtime.cpus_per_actor=0")
    with pytest.raises(
        ForgeError, match=r"unknown key 'address' in runtime; did you mean runtime=ray, which has runtime\.address\?"
    ):
        spec_for("runtime=local", "runtime.address=auto")  # local's keys stay local's


@pytest.mark.slow
@needs_ray
def test_same_results_as_in_process(tmp_path, ray_local, clean):
    url = f"file://{tmp_path}/run"  # output_dir as a URL (a local directory all the same)
    report = run_forge(url, *FAST, *RAY)
    assert report["status"] == "finished" and report["balanced"], report["imbalance"]
    assert (tmp_path / "run" / "commits.jsonl").exists() and (tmp_path / "run" / "report.json").exists()
    assert report["items"]["completed"] == N and report["items"]["failed"] == 0
    actor = report["ray"]["actors"]["cpu"]
    assert actor["torch_device"] == "cpu" and actor["limits"]["max_batch_tokens"] == 1024 and actor["threads"] == 1
    assert report["restarts"] == {"cpu": 0}
    same_output(url, clean)


@pytest.mark.slow
@needs_ray
def test_killed_and_hung_actors_lose_nothing(tmp_path, ray_local, faults, clean):
    # one actor SIGKILLed inside its forward pass, a later one hangs past its timeout; the
    # output goes to an object store (memory://: the driver writes, so it lives in this process)
    faults(kill={"point": "during_forward", "every": 3, "times": 1}, hang={"seconds": 120, "nth": 5})
    url = f"memory://{tmp_path.name}/run"
    report = run_forge(
        url,
        *FAST,
        *RAY,
        "plugins=[faults]",
        "runtime.max_restarts=4",
        "runtime.batch_timeout_s=4",
        "runtime.kill_grace_s=1",
    )
    assert report["status"] == "finished" and report["balanced"], report["imbalance"]
    assert report["restarts"]["cpu"] == 2, "one replacement after the kill, one after the hang"
    assert report["attempts"]["lost"] >= 1 and report["attempts"]["timeout"] == 1
    assert report["items"]["completed"] == N and report["items"]["failed"] == 0
    assert report["tokens"]["retried"] > 0
    same_output(url, clean)


@pytest.mark.slow
@needs_ray
def test_retired_after_max_restarts(tmp_path, ray_local, faults):
    faults(kill={"point": "before_forward", "every": 1, "times": 10})
    report = run_forge(tmp_path, *FAST, *RAY, "plugins=[faults]", "runtime.max_restarts=0")
    assert report["status"] == "stopped" and report["balanced"], report["imbalance"]
    assert report["restarts"]["cpu"] == 0 and "retired after 0 restarts" in report["retired"]["cpu"]


def test_a_device_group_asks_ray_for_one_gpu_per_cuda_member_and_sees_them_renumbered():
    """Ray shows an actor only the GPUs it was given, numbered from 0: a group on cuda:2 and cuda:5
    (and the CPU) asks for two and places its stages on cuda:0 and cuda:1 in order."""
    from forge.executors.ray import _as_seen_by_actor, _gpus
    from forge.vocab.geometry import Device, Limits, Member

    limits = Limits(1024, 8, 256)
    group = Device(
        "g", limits, torch_device="cuda:2",
        group=(Member("cuda:2", 1 << 30), Member("cuda:5", 1 << 30), Member("cpu", 1 << 30)),
    )  # fmt: skip
    assert _gpus(group) == 2
    seen = _as_seen_by_actor(group)
    assert [m.torch_device for m in seen.group] == ["cuda:0", "cuda:1", "cpu"] and seen.torch_device == "cuda:0"
    assert _gpus(Device("c", limits, torch_device="cuda:3")) == 1 and _gpus(Device("p", limits)) == 0
    assert _as_seen_by_actor(Device("c", limits, torch_device="cuda:3")).torch_device == "cuda:0"
