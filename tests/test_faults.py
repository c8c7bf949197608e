"""Nothing lost: faults injected by the test-only `faults` plugin (tests/faults.py).

Every scenario ends with each input id committed exactly once or failed with its reason,
the ledger balanced, and no worker process left behind.
"""

import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from conftest import assert_same_output, clean_activations, forge_process, plan_forge, run_forge, small_run
from forge import load_activations
from forge.errors import ForgeError

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py
N = 48
# small batches, so a few dozen rows make many of them
FAST = small_run(N, "batching.merge_groups=false")  # the batch counts these faults are planned on
PROC = ["runtime.executor=process", "plugins=[faults]", "runtime.max_restarts=8", "runtime.max_in_flight=1"]
TESTS = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def no_workers_left():
    """No worker process outlives a test, even a failing one."""
    yield
    left = multiprocessing.active_children()
    for p in left:
        p.kill()
        p.join(5)
    assert not left, f"worker processes left behind: {left}"


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """ids -> activations of a clean in-process run, the reference every faulty run must equal."""
    return clean_activations(tmp_path_factory.mktemp("clean"), *FAST, n=N)


def same_output(run_dir, clean):
    assert_same_output(run_dir, clean, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("point", ["before_forward", "during_forward", "after_forward"])
def test_killed_workers_lose_nothing(tmp_path, faults, clean, point):
    faults(kill={"point": point, "every": 3, "times": 3})
    report = run_forge(tmp_path, *FAST, *PROC)
    assert report["status"] == "finished" and report["balanced"], report["imbalance"]
    assert report["restarts"]["cpu"] == 3 and report["attempts"]["lost"] >= 3
    assert report["items"]["completed"] == N and report["items"]["failed"] == 0
    assert report["tokens"]["retried"] > 0
    same_output(tmp_path, clean)


def test_chaos(tmp_path, faults, clean):
    faults(chaos={"share": 0.3, "times": 4, "seed": 7})
    report = run_forge(tmp_path, *FAST, *PROC, "runtime.max_in_flight=2")
    assert report["status"] == "finished" and report["balanced"], report["imbalance"]
    assert report["restarts"]["cpu"] >= 1
    same_output(tmp_path, clean)


@pytest.mark.slow
def test_kill9_of_the_whole_tree_then_resume(tmp_path, faults, clean):
    out = tmp_path / "run"
    faults(kill_run_at_write=3)  # SIGKILL to the whole process group while the 3rd shard is written
    args = [*FAST, *PROC, "shard_size=8", f"output_dir={out}"]
    proc = forge_process(*args, env=dict(os.environ))
    proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "report.json").exists()
    committed = sum(len(json.loads(line)["index"]) for line in (out / "commits.jsonl").read_text().splitlines())
    assert 16 <= committed < N  # two shards of at least 8 rows; the third was being written
    assert list((out / "activations").glob("*.tmp"))  # the torn shard, left as a temporary file
    faults()
    report = run_forge(out, *FAST, *PROC, "shard_size=8", "resume=true")
    assert report["status"] == "finished" and report["balanced"], report["imbalance"]
    assert report["items"]["resumed"] == committed and report["items"]["completed"] == N
    assert report["tokens"]["routed"] < report["tokens"]["received"]  # committed items were not recomputed
    assert not list((out / "activations").glob("*.tmp"))
    same_output(out, clean)


def test_resume_is_refused_when_results_would_differ(tmp_path):
    run_forge(tmp_path, *FAST, "runtime.executor=inprocess", "input.limit=8")
    with pytest.raises(ForgeError, match="already holds a run .* add resume=true"):
        run_forge(tmp_path, *FAST, "runtime.executor=inprocess", "input.limit=8")
    with pytest.raises(ForgeError, match=r"resume refused: layers: \[1, 4\] -> \[1, 2\]"):
        run_forge(tmp_path, *FAST, "runtime.executor=inprocess", "input.limit=8", "resume=true", "layers=[1,2]")
    with pytest.raises(ForgeError, match="resume refused: model.torch_dtype: 'float32' -> 'bfloat16'"):
        run_forge(
            tmp_path, *FAST, "runtime.executor=inprocess", "input.limit=8", "resume=true", "model.torch_dtype=bfloat16"
        )
    report = run_forge(tmp_path, *FAST, "runtime.executor=inprocess", "input.limit=8", "resume=true")
    assert report["items"]["resumed"] == 8 and report["tokens"]["routed"] == 0 and report["balanced"]


def test_out_of_memory_splits_and_lowers_the_budget(tmp_path, faults, clean):
    faults(oom_above=400)
    report = run_forge(tmp_path, *FAST, "runtime.executor=inprocess", "plugins=[faults]", "batching.prefix_cache=false")
    assert report["status"] == "finished" and report["balanced"], report["imbalance"]
    assert report["items"]["completed"] == N
    assert report["attempts"]["oom"] >= 1 and report["attempts"]["oom_splits"] >= 1
    assert report["effective_limits"]["cpu"]["max_batch_tokens"] < 1024
    same_output(tmp_path, clean)


@pytest.mark.slow
def test_an_item_out_of_memory_alone_fails_with_its_reason(tmp_path, faults):
    faults(oom_above=300)  # below the longest items' own length (350-token prefixes)
    report = run_forge(
        tmp_path,
        *FAST,
        "runtime.executor=inprocess",
        "plugins=[faults]",
        "batching.prefix_cache=false",
        "runtime.failure_window=1000",
    )
    assert report["status"] == "finished" and report["balanced"], report["imbalance"]
    assert 1 <= report["items"]["failed"] < N / 2
    assert report["items"]["completed"] + report["items"]["failed"] == N
    assert all("out of memory even alone on cpu" in f["reason"] for f in report["failures"])


@pytest.mark.slow
def test_a_hung_worker_is_replaced_and_its_batch_rerouted(tmp_path, faults, clean):
    faults(hang={"seconds": 300, "nth": 2})
    started = time.monotonic()
    report = run_forge(tmp_path, *FAST, *PROC, "runtime.batch_timeout_s=8", "runtime.kill_grace_s=1")
    assert time.monotonic() - started < 200  # not the 300 s the worker sleeps
    assert report["status"] == "finished" and report["balanced"], report["imbalance"]
    # (a loaded machine may time out a slow batch too; the hung one always does)
    assert report["attempts"]["timeout"] >= 1 and report["restarts"]["cpu"] >= 1
    same_output(tmp_path, clean)


@pytest.mark.slow
def test_a_late_result_is_committed_once_and_the_duplicate_discarded(tmp_path, faults, clean):
    faults(hang={"seconds": 16, "nth": 2})
    report = run_forge(tmp_path, *FAST, *PROC, "runtime.batch_timeout_s=8", "runtime.kill_grace_s=60")
    assert report["status"] == "finished" and report["balanced"], report["imbalance"]
    assert report["attempts"]["timeout"] >= 1 and report["attempts"]["late_results"] >= 1
    assert report["attempts"]["discarded"] >= 1 and report["tokens"]["discarded"] > 0
    assert report["restarts"]["cpu"] == 0
    same_output(tmp_path, clean)


def test_a_recurring_failure_stops_the_run_with_its_reason(tmp_path, faults):
    faults(fail="simulated recurring fault")
    report = run_forge(tmp_path, *FAST, "runtime.executor=inprocess", "plugins=[faults]", "runtime.failure_window=10")
    assert report["status"] == "stopped" and report["balanced"], report["imbalance"]
    assert "of the last 10 items failed with: RuntimeError: simulated recurring fault" in report["error"]
    assert report["items"]["unfinished"] > 0 and report["items"]["failed"] >= 5
    assert json.loads((tmp_path / "run.json").read_text())["status"] == "stopped"


def test_a_small_run_whose_every_item_failed_ends_failed_with_the_commonest_reason(tmp_path, faults):
    """Fewer items than the failure window: the window never fills, yet a run that completed
    nothing is not `finished`."""
    faults(fail="simulated model fault")
    report = run_forge(tmp_path, *FAST, "runtime.executor=inprocess", "plugins=[faults]", "runtime.failure_window=1000")
    assert report["status"] == "failed" and report["balanced"], report["imbalance"]
    assert report["items"]["completed"] == 0 and report["items"]["failed"] == N
    reason = f"every item failed ({N}); the commonest reason ({N}): RuntimeError: simulated model fault"
    assert reason in report["error"]
    assert json.loads((tmp_path / "run.json").read_text())["status"] == "failed"


@pytest.mark.slow
def test_a_full_disk_stops_the_run_and_resume_finishes_it(tmp_path, faults, clean):
    faults(fail_write=1)
    report = run_forge(tmp_path, *FAST, "runtime.executor=inprocess", "plugins=[faults]", "shard_size=16")
    assert report["status"] == "stopped" and "No space left on device" in report["error"]
    assert report["balanced"], report["imbalance"]
    assert report["items"]["completed"] < N
    faults()
    report = run_forge(tmp_path, *FAST, "runtime.executor=inprocess", "shard_size=16", "resume=true")
    assert report["status"] == "finished" and report["balanced"]
    same_output(tmp_path, clean)


@pytest.mark.slow
def test_ctrl_c_stops_gracefully_and_resume_finishes(tmp_path, faults, clean):
    out = tmp_path / "run"
    faults(hang={"seconds": 30, "nth": 4})  # a long batch to interrupt
    proc = forge_process(
        *FAST, *PROC, "shard_size=4", "runtime.commit_interval_s=0.1", f"output_dir={out}", env=dict(os.environ)
    )
    deadline = time.monotonic() + 120
    while not ((out / "commits.jsonl").exists() and (out / "commits.jsonl").read_text()):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read().decode()
        time.sleep(0.2)
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    text = proc.communicate(timeout=60)[0].decode()
    assert time.monotonic() - t0 < 20
    assert proc.returncode == 130, text
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "interrupted" and report["balanced"], report["imbalance"]
    assert "terminate called" not in text and "Traceback" not in text
    faults()
    report = run_forge(out, *FAST, *PROC, "shard_size=4", "resume=true")
    assert report["status"] == "finished" and report["balanced"] and report["items"]["resumed"] > 0
    same_output(out, clean)


@pytest.mark.slow
def test_one_percent_bad_rows_are_recorded_and_the_rest_complete(tmp_path):
    from faults import corrupt_rows
    from forge.functions.assets import embedded_dataset_path

    rows = embedded_dataset_path().read_text().splitlines()
    rows = [json.dumps({**json.loads(r), "id": f"{k}-{json.loads(r)['id']}"}) for k in range(2) for r in rows]
    lines, bad = corrupt_rows(rows, 0.01, seed=3)
    data = tmp_path / "in.jsonl"
    data.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "run"
    report = run_forge(
        out, "devices=cpu", f"input.path={data}", "layers=[1]", "runtime.executor=inprocess", "batching.packing=packed"
    )
    assert len(rows) == 5000 and len(bad) == 50
    assert report["balanced"], report["imbalance"]
    assert report["items"] == {
        "received": 5000,
        "completed": 4950,
        "failed": 50,
        "skipped": 0,
        "unfinished": 0,
        "resumed": 0,
    }
    failures = [json.loads(line) for line in (out / "failures.jsonl").read_text().splitlines()]
    assert len(failures) == 50 and all(f["reason"] for f in failures)
    # unreadable lines are named by line number, readable rows without usable text by their id
    assert {f["id"] for f in failures} == {f"line {i + 1}" if i % 5 < 2 else json.loads(rows[i])["id"] for i in bad}


@pytest.mark.slow
@pytest.mark.parametrize("packing,how", [("rows", "plan"), ("packed", "plan"), ("rows", "run"), ("packed", "run")])
def test_a_heavy_tail_never_stalls(tmp_path, packing, how):
    """Memory mode on two small simulated cards that cannot hold the longest items: every
    item is placed or failed at admission with its reason, and the run ends."""
    import random

    rng = random.Random(5)
    words = "the of and a to in is was he for it with as his on be at by".split()
    rows = [
        {
            "id": f"r{i}",
            "text": " ".join(rng.choice(words) for _ in range(int(rng.paretovariate(0.9) * 12) % 1900 + 10)),
        }
        for i in range(600)
    ]
    data = tmp_path / "tail.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    args = [
        "devices=sim_16g_32g",
        "batching=memory",
        f"batching.packing={packing}",
        f"input.path={data}",
        "layers=[1]",
        "batching.packed_row_tokens=256",
    ]
    n = 600 if how == "plan" else 150
    report = plan_forge(*args) if how == "plan" else run_forge(tmp_path / "run", *args, f"input.limit={n}")
    assert report["status"] == "finished" and report["balanced"], report["imbalance"]
    items = report["items"]
    assert items["completed"] + items["failed"] + items["skipped"] == n and items["unfinished"] == 0
    assert items["completed"] > 0.6 * n
    assert all("fits no device under batching=memory" in f["reason"] for f in report["failures"])


def test_a_worker_that_cannot_load_retires_its_device_with_the_reason(tmp_path):
    import shutil

    from forge.functions.assets import embedded_model_source, materialize_model

    model = tmp_path / "broken-model"
    shutil.copytree(materialize_model(embedded_model_source()), model)
    (model / "model.safetensors").write_bytes(b"not a safetensors file")
    report = run_forge(
        tmp_path / "run", *FAST, f"model.name={model}", "runtime.executor=process", "runtime.max_restarts=1"
    )
    assert report["status"] == "stopped" and report["balanced"], report["imbalance"]
    assert report["restarts"]["cpu"] == 1 and "cpu" in report["retired"]
    assert "could not load the model" in report["error"] and report["items"]["unfinished"] == N


def test_a_failure_that_would_always_recur_is_refused_before_work(tmp_path):
    """Packed rows under an attention implementation that cannot take their 4D mask would fail
    every batch: refused at once, with one line, and nothing written."""
    with pytest.raises(
        ForgeError, match="packed rows need a 4D mask, which flash_attention_2 attention does not take"
    ) as err:
        run_forge(tmp_path / "run", *FAST, "batching.packing=packed", "model.attn_implementation=flash_attention_2")
    assert "\n" not in str(err.value) and not (tmp_path / "run" / "report.json").exists()
    assert not (tmp_path / "run" / "run.json").exists()  # refused: the directory holds no run


@pytest.mark.slow
def test_large_batches_and_results_cross_the_pipes(tmp_path):
    """Batches and results far larger than a pipe's buffer: the driver's sends never wait on a
    worker that is itself waiting to send (a deadlock before the worker drained its pipe)."""
    out = tmp_path / "run"
    # the whole embedded input at the default limits (8,192-token batches; it hung before the fix)
    proc = forge_process("layers=[0,1,2,3,4]", "runtime.executor=process", f"output_dir={out}", env=dict(os.environ))
    text = proc.communicate(timeout=300)[0].decode()
    assert proc.returncode == 0, text
    report = json.loads((out / "report.json").read_text())
    assert report["balanced"] and report["items"]["completed"] == 2500
    ids, _, layers = load_activations(out)
    assert len(set(ids)) == 2500 and layers[4].shape == (2500, 256)


@pytest.mark.slow
def test_each_process_reports_its_own_resident_peak(tmp_path, faults):
    """report.json's resident peaks are each process's own: memory a worker holds shows in its
    device's figure, not in the run's own process's (`driver_resident_peak_bytes`)."""
    base = run_forge(tmp_path / "a", *FAST, *PROC)
    faults(hold_mb=256)
    held = run_forge(tmp_path / "b", *FAST, *PROC)
    worker = [r["devices"][0]["resident_peak_bytes"] for r in (base, held)]
    driver = [r["driver_resident_peak_bytes"] for r in (base, held)]
    assert worker[0] > 0 and driver[0] > 0
    assert worker[1] - worker[0] >= 250 << 20, worker
    ready = held["devices"][0]["resident_ready_bytes"]  # the model loaded, before the batch that held more
    assert 0 < ready and worker[1] - ready >= 250 << 20, (ready, worker)
    assert driver[1] - driver[0] < 64 << 20, driver
