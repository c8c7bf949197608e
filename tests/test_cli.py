"""The CLI through typer's CliRunner: run, plan, ls, errors, sweeps, user config dirs."""

import json

import pytest
from typer.testing import CliRunner

from forge.cli.app import app

SMALL = ["devices.limits.max_batch_tokens=2048", "devices.limits.max_seq_len=1024", "budget.tokens_per_step=2048"]


@pytest.fixture
def cli():
    return CliRunner()


@pytest.mark.parametrize("command", [[], ["run"], ["plan"], ["ls"]])
def test_help(cli, command):
    result = cli.invoke(app, [*command, "--help"])
    assert result.exit_code == 0
    assert "Usage" in result.output


def test_ls_lists_functions_modes_with_plugins_and_devices(cli):
    result = cli.invoke(app, ["ls"])
    assert result.exit_code == 0, result.output
    for word in ("probe_gen", "item", "token", "memory", "batching (forge.batching", "cpu", "8192"):
        assert word in result.output
    for name in ("tensorboard", "mlflow", "wandb", "trackio"):  # the trackers: nothing else names them
        assert name in result.output


def test_ls_lists_what_the_modules_named_by_plugins_offer(cli, tmp_path, monkeypatch):
    (tmp_path / "longest_mode.py").write_text(
        "from forge import hookimpl\nfrom forge.batching import ItemPacker\n\n\n"
        "class LongestFirst(ItemPacker):\n    pass\n\n\n"
        "@hookimpl\ndef forge_batching_modes():\n    return {'longest': LongestFirst}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    result = cli.invoke(app, ["ls", "plugins=[longest_mode]"])
    assert result.exit_code == 0, result.output
    assert "longest_mode (longest_mode.LongestFirst)" in result.output
    # selected without a YAML of its own: one line saying what to add
    result = cli.invoke(app, ["run", "plugins=[longest_mode]", "batching=longest"])
    assert result.exit_code == 2 and "plugin longest_mode registers the mode but no config selects it" in result.output
    assert "conf/batching/longest.yaml" in result.output


def test_plan_json(cli):
    result = cli.invoke(app, ["plan", "--json", "input.limit=200", *SMALL])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    for key in ("padding_waste", "cache_hit_rate", "batches", "tokens", "devices", "balanced"):
        assert key in plan
    assert {"received", "routed", "padding", "prefix", "cache_hit"} <= set(plan["tokens"])
    assert {"name", "batches", "tokens", "cache_misses"} <= set(plan["devices"][0])
    assert plan["items"]["completed"] == 200 and plan["balanced"]


def test_plan_human_summary_and_two_devices(cli):
    result = cli.invoke(app, ["plan", "devices=sim2", "input.limit=300"])
    assert result.exit_code == 0, result.output
    assert "sim0" in result.output and "sim1" in result.output and "padding waste" in result.output


def test_unknown_mode_is_one_clear_line(cli):
    result = cli.invoke(app, ["plan", "batching=bogus"])
    assert result.exit_code == 2
    assert "error:" in result.output and "item" in result.output and "token" in result.output
    assert "Traceback" not in result.output


@pytest.mark.slow
def test_run_writes_report_and_activations(cli, tmp_path):
    out = tmp_path / "run"
    result = cli.invoke(app, ["run", f"output_dir={out}", "input.limit=30", *SMALL])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["balanced"] and report["items"]["completed"] == 30
    assert (out / "commits.jsonl").exists() and (out / "run.json").exists()
    assert json.loads((out / "run.json").read_text())["status"] == "finished"
    for key in (
        "function",
        "batching",
        "model",
        "input",
        "config",
        "padding_waste",
        "cache_hit_rate",
        "devices",
        "wall_s",
        "useful_tokens_per_s",
        "driver_resident_peak_bytes",
    ):
        assert key in report
    assert "balanced" in result.output
    worker = report["devices"][0]["resident_peak_bytes"]  # the worker process's own, after its batches
    assert worker > 0 and f"cpu worker {worker / 2**20:,.0f} MiB" in result.output
    phases = report["phases"]  # where the time went, start-up included
    assert set(phases) == {
        "start_s",
        "compose_s",
        "setup_s",
        "open_s",
        "worker_start_s",
        "worker_load_s",
        "worker_ready_s",
        "first_batch_s",
        "drain_s",
        "read_tokenize_s",
        "read_wait_s",
        "commit_s",
        "total_s",
        "warm_start",
    }
    assert phases.pop("warm_start") is False  # this process ran it, not a forge server's child
    assert all(isinstance(v, (int, float)) and v >= 0 for v in phases.values()), phases
    assert phases["start_s"] + phases["open_s"] <= phases["first_batch_s"] <= phases["total_s"]
    # start-up in its two parts: to the composed config (0 here: a test runner, not the command,
    # started this process), then the function's set-up from it
    assert phases["compose_s"] + phases["setup_s"] == pytest.approx(phases["start_s"], abs=0.002)
    assert phases["setup_s"] > 0
    assert phases["worker_ready_s"] <= phases["first_batch_s"] and phases["read_tokenize_s"] > 0


def test_run_bad_input_is_one_clear_line(cli, tmp_path):
    result = cli.invoke(app, ["run", f"output_dir={tmp_path}", f"input.path={tmp_path}/missing.jsonl"])
    assert result.exit_code == 2
    assert "no such file" in result.output and "Traceback" not in result.output


@pytest.mark.slow
def test_run_on_an_input_of_only_bad_rows_stops_with_exit_code_2(cli, tmp_path):
    data = tmp_path / "in.jsonl"
    data.write_text('{"text": "broken\n' * 3)
    out = tmp_path / "run"
    result = cli.invoke(app, ["run", f"output_dir={out}", f"input.path={data}", *SMALL])
    assert result.exit_code == 2, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "stopped" and "failed with: invalid JSON" in report["error"]


def test_run_on_repeated_ids_is_refused_in_one_line_before_any_work(cli, tmp_path):
    data = tmp_path / "in.jsonl"
    data.write_text('{"id": 1, "text": "a"}\n{"id": "1", "text": "b"}\n{"text": "c"}\n{"id": "2", "text": "d"}\n')
    out = tmp_path / "run"
    result = cli.invoke(app, ["run", f"output_dir={out}", f"input.path={data}", *SMALL])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "1 id repeats, e.g. '1' at lines 1 and 2" in " ".join(result.output.split())
    assert not (out / "report.json").exists()


@pytest.mark.slow
def test_multirun_sweeps_modes(cli, tmp_path):
    result = cli.invoke(app, ["run", "-m", "batching=item,token", f"output_dir={tmp_path}", "input.limit=20", *SMALL])
    assert result.exit_code == 0, result.output
    reports = sorted(tmp_path.glob("*/report.json"))
    assert len(reports) == 2
    assert sorted(json.loads(p.read_text())["batching"] for p in reports) == ["item", "token"]


@pytest.mark.slow
def test_run_with_user_config_dir(cli, tmp_path):
    conf = tmp_path / "conf" / "devices"
    conf.mkdir(parents=True)
    (conf / "lab.yaml").write_text(
        "discover: false\ninventory:\n"
        "  - {name: lab0, device: cpu, limits: {max_batch_tokens: 2048, max_rows: 64, max_seq_len: 1024}}\n"
    )
    out = tmp_path / "run"
    result = cli.invoke(
        app, ["run", "--config-dir", str(tmp_path / "conf"), "devices=lab", f"output_dir={out}", "input.limit=10"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert [d["name"] for d in report["devices"]] == ["lab0"]
    result = cli.invoke(app, ["plan", "--config-dir", str(tmp_path / "conf"), "devices=lab", "input.limit=10"])
    assert result.exit_code == 0 and "lab0" in result.output


@pytest.mark.slow
def test_plan_plot_draws_item_beside_token(cli, tmp_path):
    png = tmp_path / "geometry.png"
    result = cli.invoke(app, ["plan", "--plot", str(png), "input.limit=120", *SMALL])
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_calibration_batches_and_fit():
    from forge.runtime.cost.calibrate import calibration_batches, fit
    from forge.vocab.geometry import Device, Item, Limits

    items = [Item(str(i), 20 + i % 3) for i in range(200)]
    batches = calibration_batches(items, Device("d", Limits(2048, 64, 64)))
    assert [b.num_rows for b in batches] == [1, 2, 4, 8, 16, 32, 64]
    assert all(b.padded_slots <= 2048 and b.padding >= 0 for b in batches)
    a, b = fit([(slots, 0.002 + 1e-6 * slots) for slots in (22, 88, 352, 1408)])
    assert abs(a / b - 2000) < 1e-6 * 2000


@pytest.mark.slow
def test_calibrate_command_runs(cli):
    result = cli.invoke(app, ["calibrate", "--items", "64", "input.limit=64", *SMALL])
    assert result.exit_code == 0, result.output
    assert "batch_overhead_tokens" in result.output and "cpu" in result.output
    # the printed inventory entry declares a simulated device as fast as the one measured
    import yaml

    from forge.config.devices import from_inventory

    entry = next(line for line in result.output.splitlines() if "sim: {seconds_per_step" in line)
    [device] = from_inventory(yaml.safe_load(entry), {"max_batch_tokens": 2048, "max_rows": 64, "max_seq_len": 1024})
    assert device.name == "sim-cpu" and device.sim.seconds_per_slot > 0 and device.sim.seconds_per_step >= 0


@pytest.mark.slow
def test_plan_compare_modes(cli):
    result = cli.invoke(app, ["plan", "--compare", "--json", "input.limit=150", *SMALL])
    assert result.exit_code == 0, result.output
    plans = json.loads(result.stdout)
    assert {"item", "token", "memory"} <= set(plans)  # and any mode an installed plugin adds
    assert all(p["balanced"] and p["items"]["completed"] == 150 for p in plans.values())
    assert plans["token"]["tokens"]["padded_slots"] < plans["item"]["tokens"]["padded_slots"]
    # token mode runs few prefixes again: its cache serves them, or (small groups merged) a tree
    # row runs each once for all its items
    assert plans["item"]["cache_hit_rate"] == 0 and plans["token"]["prefix_reuse_rate"] > 0.9


def test_run_unknown_mode_is_one_clear_line(cli, tmp_path):
    result = cli.invoke(app, ["run", "batching=bogus", f"output_dir={tmp_path}"])
    assert result.exit_code == 2
    assert "error:" in result.output and "item" in result.output and "token" in result.output
    assert not (tmp_path / "report.json").exists()


BAD_CONFIG = {
    "budget.tokens_per_step=abc": "error: config budget.tokens_per_step='abc': expected an integer",
    "batching.window=-5": "error: config batching.window=-5: must be a positive integer",
    "devices.limits.max_rows=0": "error: config devices.limits.max_rows=0: must be a positive integer",
    "+foo=1": "error: config: unknown key 'foo' at the root; valid keys: function, budget, too_long, output_dir, "
    "batching, devices, runtime, resume, check_disk, fail_fast, plugins, trackers, model, input, shard_size, "
    "intervene, layers, capture, pooling, "
    "storage_dtype, prefix_states, shard_mb",
}


def _one_error_line(result, want):
    assert result.exit_code == 2, result.output
    assert result.output.strip() == want  # one line, unwrapped, nothing else (no traceback, no Hydra log)


@pytest.mark.parametrize("override", list(BAD_CONFIG))
@pytest.mark.parametrize("sweep", [False, True])
def test_run_bad_config_is_one_line_before_any_work(cli, tmp_path, override, sweep):
    out = tmp_path / "out"
    args = ["run", *(["-m", "batching=item,token"] if sweep else []), override, f"output_dir={out}"]
    _one_error_line(cli.invoke(app, args), BAD_CONFIG[override])
    assert not out.exists()  # Hydra never started: no run directory, no report


def test_sweep_checks_every_swept_value_before_launching(cli, tmp_path):
    out = tmp_path / "out"
    result = cli.invoke(app, ["run", "-m", "budget.tokens_per_step=1024,abc", f"output_dir={out}", "input.limit=5"])
    _one_error_line(result, BAD_CONFIG["budget.tokens_per_step=abc"])
    assert not out.exists()  # the good value's job did not run either
    result = cli.invoke(app, ["run", "--multirun", "runtime.executor=process,thread", f"output_dir={out}"])
    _one_error_line(
        result,
        "error: config runtime.executor='thread': choose one of: inprocess, process, ray "
        "(plugins add more through forge_executors)",
    )
    assert not out.exists()


@pytest.mark.parametrize("override", list(BAD_CONFIG))
def test_plan_bad_config_is_one_line(cli, override):
    _one_error_line(cli.invoke(app, ["plan", override]), BAD_CONFIG[override])


@pytest.mark.slow
def test_run_refuses_simulated_devices_before_any_work_and_plan_takes_them(cli, tmp_path):
    out = tmp_path / "run"
    result = cli.invoke(app, ["run", "devices=mix_16g_32g", f"output_dir={out}"])
    assert result.exit_code == 2
    assert "`forge run` needs real devices: plan on simulated ones with `forge plan`" in result.output
    assert not out.exists()
    result = cli.invoke(app, ["plan", "--json", "devices=mix_16g_32g", "input.limit=100"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["virtual_time"]["unit"] == "s" and plan["balanced"]
    assert {d["name"] for d in plan["devices"]} == {"card16", "card32"}
    assert all(d["virtual_finish"] > 0 and 0 < d["busy_share"] <= 1 for d in plan["devices"])


def test_plan_states_what_a_per_token_run_will_write(cli):
    """forge plan sizes a pooling=none run before it runs: per layer, in total, per stored token."""
    args = ["plan", "pooling=none", "layers=[1,2]", "storage_dtype=float16", "input.limit=40", *SMALL]
    result = cli.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    sized = json.loads(result.stdout)["output_bytes"]
    assert sized["fields"]["layer_1"] == sized["fields"]["layer_2"] == sized["stored_tokens"] * 256 * 2
    assert sized["per_stored_token"] == pytest.approx(sized["total"] / sized["stored_tokens"])
    human = cli.invoke(app, args)
    assert human.exit_code == 0 and "will write" in human.output and "per stored token" in human.output


@pytest.mark.slow
def test_reading_ahead_or_not_gives_the_same_run_and_leaves_no_reading_thread(cli, tmp_path):
    import threading

    import numpy as np

    from forge import load_activations

    got = {}
    for ahead in ("true", "false"):
        out = tmp_path / ahead
        args = ["run", f"output_dir={out}", "input.limit=40", "runtime.executor=inprocess", *SMALL]
        result = cli.invoke(app, [*args, f"runtime.read_ahead={ahead}"])
        assert result.exit_code == 0, result.output
        report = json.loads((out / "report.json").read_text())
        assert report["balanced"] and report["items"]["completed"] == 40
        assert report["phases"]["read_tokenize_s"] > 0 and report["phases"]["read_wait_s"] >= 0
        got[ahead] = (report["batches"], load_activations(out))
    assert not any(t.name == "forge-read-ahead" for t in threading.enumerate())
    (batches_a, (ids_a, _, layers_a)), (batches_b, (ids_b, _, layers_b)) = got["true"], got["false"]
    assert batches_a == batches_b and list(ids_a) == list(ids_b)  # the same plan, the same items
    for layer in layers_a:
        assert np.array_equal(np.asarray(layers_a[layer]), np.asarray(layers_b[layer])), layer
