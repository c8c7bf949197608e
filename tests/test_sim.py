"""Simulated devices in virtual time: declared step time and memory, simulated out-of-memory
errors handled like real ones, budgets respected, and unequal devices kept busy together."""

from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from forge.batching.cost import CostModel
from forge.config.devices import from_inventory, resolve_devices
from forge.driver.simulate import plan_geometry
from forge.errors import ForgeError
from forge.executors.base import Status
from forge.vocab.geometry import Device, Item, Limits, StepTime

CONF = Path(__file__).resolve().parent.parent / "conf" / "devices"
# The measured memory model of examples/models/llama-2-7b in bfloat16 (layers [1,2,4], pooling
# last), as `forge plan` fits it: numbers here so that tests do not fit a 7B model.
COST_7B = CostModel(
    weight_bytes=13476831232,
    bytes_per_token=112767.2,
    bytes_per_score=1.0667,
    kv_bytes_per_token=557400.4,
    prefix_bytes_per_token=548423.1,
    margin=0.05,
)


SMALL_CARD = 16 << 30


def inventory(name: str) -> list[Device]:
    return resolve_devices(OmegaConf.to_container(OmegaConf.load(CONF / f"{name}.yaml")))


def reference(n: int) -> list[Item]:
    from benchmarks.workloads import items

    return items(n)


def predicted(batch) -> int:
    return COST_7B.step_bytes(batch.num_rows, batch.padded_len, batch.prefix_len if batch.split_prefix else 0)


def test_a_sim_entry_declares_its_step_time_and_overhead():
    lim = {"max_batch_tokens": 4096, "max_rows": 64, "max_seq_len": 1024}
    [d] = from_inventory(
        [{"name": "g", "memory_gb": 16, "sim": {"seconds_per_step": 0.04, "seconds_per_slot": 2e-4}}], lim
    )
    assert d.sim == StepTime(0.04, 2e-4, 0.0) and d.batch_overhead_tokens == 200 and d.memory_bytes == 16 << 30
    assert d.sim.seconds(1000, 10**6) == pytest.approx(0.04 + 0.2)
    with pytest.raises(ForgeError, match=r"devices.inventory\[0\] \(g\).sim: unknown key\(s\) \['speed'\]"):
        from_inventory([{"name": "g", "sim": {"seconds_per_step": 0.1, "seconds_per_slot": 1e-4, "speed": 2}}], lim)
    with pytest.raises(ForgeError, match="missing seconds_per_slot"):
        from_inventory([{"name": "g", "sim": {"seconds_per_step": 0.1}}], lim)
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ForgeError, match="seconds_per_step must be a finite number >= 0"):
            from_inventory([{"name": "g", "sim": {"seconds_per_step": bad, "seconds_per_slot": 1e-4}}], lim)


@pytest.mark.parametrize(
    "key,value",
    [
        ("memory_gb", "lots"),
        ("memory_gb", ".nan"),
        ("memory_gb", float("nan")),
        ("memory_gb", float("-inf")),
        ("memory_gb", -3),
        ("memory_gb", True),
        ("batch_overhead_tokens", 1.5),
        ("batch_overhead_tokens", -1),
    ],
)
def test_every_inventory_field_is_typed_and_range_checked(key, value):
    lim = {"max_batch_tokens": 4096, "max_rows": 64, "max_seq_len": 1024}
    with pytest.raises(ForgeError, match=rf"^devices.inventory\[0\] \(g\).{key}=.*: must be a"):
        from_inventory([{"name": "g", key: value}], lim)


def test_an_inventory_written_as_a_mapping_is_one_line_naming_it(tmp_path):
    (tmp_path / "devices").mkdir()
    (tmp_path / "devices" / "mapped.yaml").write_text("discover: false\ninventory:\n  g: {memory_gb: 1}\n")
    from typer.testing import CliRunner

    from forge.cli.app import app

    result = CliRunner().invoke(app, ["plan", "--config-dir", str(tmp_path), "devices=mapped"])
    assert result.exit_code == 2 and "devices.inventory=" in result.output and "expected a list" in result.output
    with pytest.raises(ForgeError, match="devices.inventory must be a list"):
        from_inventory({"g": {"memory_gb": 1}}, None)


def test_simulated_and_plain_devices_do_not_mix_and_forge_run_refuses_simulated_ones(tmp_path):
    from forge.driver.engine import RunSpec, execute
    from forge.driver.simulate import GeometryFunction
    from forge.pluginmanager import make_plugin_manager

    lim = Limits(4096, 64, 1024)
    mixed = [Device("a", lim, sim=StepTime(0.01, 1e-4)), Device("b", lim)]
    with pytest.raises(ForgeError, match=r"a simulated \(sim:\) but b not"):
        plan_geometry(reference(50), mixed, "token")
    spec = RunSpec(
        function=GeometryFunction(reference(10)),
        mode="token",
        mode_options={},
        devices=inventory("mix_16g_32g"),
        run_dir=tmp_path / "run",
    )
    with pytest.raises(ForgeError, match="`forge run` needs real devices: plan on simulated ones with `forge plan`"):
        execute(spec, make_plugin_manager())
    assert not (tmp_path / "run" / "run.json").exists()


def test_the_one_to_two_mix_keeps_both_cards_busy_and_finishing_together():
    """The reference workload, memory mode, a 16 GB card and a 32 GB card twice as fast."""
    report = plan_geometry(reference(3000), inventory("mix_16g_32g"), "memory", cost=COST_7B)
    assert report["status"] == "finished" and report["balanced"], report.get("imbalance")
    assert report["items"]["completed"] == 3000
    vt = report["virtual_time"]
    assert vt["unit"] == "s" and vt["min_busy_share"] >= 0.95 and vt["finish_skew"] <= 0.05
    assert report["attempts"]["oom"] == 0
    dev = {d["name"]: d for d in report["devices"]}
    assert dev["card32"]["tokens"] > 1.6 * dev["card16"]["tokens"]  # twice as fast: about twice the work
    assert dev["card32"]["cache_misses"] > dev["card16"]["cache_misses"]  # and more prefix groups
    for d in dev.values():
        assert d["predicted_peak_bytes"] <= d["memory_budget_bytes"]


def test_per_device_batch_sizes_scale_with_the_budget():
    step = StepTime(0.02, 1e-4)
    lim = Limits(65536, 512, 4096, 8)
    devices = [Device(f"g{gb}", lim, memory_bytes=gb << 30, sim=step) for gb in (14, 16, 18)]
    report = plan_geometry(reference(1500), devices, "memory", cost=COST_7B, keep_batches=True)
    assert report["balanced"] and report["attempts"]["oom"] == 0
    peaks = [d["predicted_peak_bytes"] for d in report["devices"]]
    assert all(p <= d["memory_budget_bytes"] for p, d in zip(peaks, report["devices"]))
    assert peaks[0] < peaks[1] < peaks[2]
    slots = {d.name: [] for d in devices}
    for span in report.plan.timeline:
        slots[span.device].append(span.padded_slots)
    mean = [np.mean(slots[d.name]) for d in devices]
    assert mean[0] < mean[1] < mean[2]
    # rows the same prefix and length get on each device: more on a larger budget
    rows = [COST_7B.max_rows(d.memory_bytes, 64, 384) for d in devices]
    assert 0 < rows[0] < rows[1] < rows[2]


def test_no_batch_predicted_over_its_devices_budget_is_ever_routed(monkeypatch):
    """Batches lost on the large card go back; re-routed, none lands on the small card
    over its budget (they are re-padded, split or sent where they fit)."""
    import forge.driver.plan
    from forge import hookimpl
    from forge.executors.sim import SimExecutor
    from forge.pluginmanager import make_plugin_manager

    class LosesOnTheLargeCard(SimExecutor):
        """card32's worker dies on a few batches too large for card16 and takes 0.5 s to come
        back: meanwhile only card16 asks, and the lost batches wait first in line."""

        lost, down_until = 0, 0.0

        def submit(self, ticket, device, batch, timeout_s):
            if device.name == "card32" and self.lost < 6 and predicted(batch) > SMALL_CARD:
                type(self).lost += 1
                self.down_until = self.now + 0.5
                self._push(self.now + 0.01, ticket, device.name, 0.01, Status.LOST, None, "worker lost")
                return
            super().submit(ticket, device, batch, timeout_s)

        def free_slots(self, device):
            return 0 if device == "card32" and self.now < self.down_until else super().free_slots(device)

        def collect(self, wait_s):
            if not self._heap and self.now < self.down_until:  # nothing runs: time passes
                self.now = self.down_until
            return super().collect(wait_s)

    routed = []

    class Spy:
        @hookimpl
        def forge_batch_routed(self, run, batch, device):
            routed.append((device, batch))

    monkeypatch.setattr(forge.driver.plan, "SimExecutor", LosesOnTheLargeCard)
    pm = make_plugin_manager()
    pm.register(Spy())
    report = plan_geometry(reference(1500), inventory("mix_16g_32g"), "memory", cost=COST_7B, pm=pm)
    assert LosesOnTheLargeCard.lost == 6 and report["balanced"] and report["items"]["completed"] == 1500
    assert sum(1 for d, b in routed if b.retry) >= 6
    # what card16 ran meanwhile, and the lost batches: back on card32 whole, or split to fit card16
    assert any(d.name == "card16" for d, b in routed)
    for device, batch in routed:
        assert predicted(batch) <= device.memory_bytes, (device.name, batch.num_rows, batch.padded_len)


@pytest.mark.parametrize("packing", ["rows", "packed"])
def test_a_simulated_out_of_memory_error_splits_and_retries_with_nothing_lost(packing):
    """Item mode at the batch size that fits the large card runs the small one out of memory:
    the batch is split and retried, the small card's budget drops, every item completes."""
    mode, options = ("item", {"batch_size": 83}) if packing == "rows" else ("token", {"packing": "packed"})
    report = plan_geometry(
        reference(1200), inventory("mix_16g_32g"), mode, cost=COST_7B, options=options, keep_batches=True
    )
    assert report["status"] == "finished" and report["balanced"], report.get("imbalance")
    assert report["items"] == {
        "received": 1200,
        "completed": 1200,
        "failed": 0,
        "skipped": 0,
        "unfinished": 0,
        "resumed": 0,
    }
    dev = {d["name"]: d for d in report["devices"]}
    assert report["attempts"]["oom"] == dev["card16"]["oom"] > 0 and dev["card32"]["oom"] == 0
    assert report["attempts"]["oom_splits"] == report["attempts"]["oom"]
    assert "card16" in report["effective_limits"]
    assert report["tokens"]["retried"] > 0
    # what completed on the small card fits it; the failed attempts are on the timeline
    spans = [s for s in report.plan.timeline if s.device == "card16"]
    assert sum(s.status == "oom" for s in spans) == dev["card16"]["oom"]
    ids = [it.id for b in report.plan.kept_batches for it in b.items]
    assert len(ids) == len(set(ids)) == 1200


@pytest.mark.parametrize("packing", ["rows", "packed"])
def test_a_heavy_tail_over_the_mix_places_every_item_or_says_why(packing):
    """Lengths from tens to thousands of tokens, some longer than any card takes: each item
    completes or is skipped at admission with its reason; the ledger balances; both cards work."""
    from benchmarks.workloads import heavy_tail

    items = heavy_tail(600)
    too_long = sum(it.num_tokens > 4096 for it in items)
    report = plan_geometry(
        items, inventory("mix_16g_32g"), "memory", cost=COST_7B, options={"packing": packing, "packed_row_tokens": 1024}
    )
    assert report["status"] == "finished" and report["balanced"], report.get("imbalance")
    assert too_long > 0 and report["items"]["skipped"] == too_long
    assert report["items"]["completed"] + too_long == 600 and report["items"]["unfinished"] == 0
    assert list(report["skipped_reasons"]) == ["too_long (> max_seq_len=4096)"]
    assert report["attempts"]["oom"] == 0 and min(d["batches"] for d in report["devices"]) > 0


def test_the_end_of_the_backlog_is_split_so_devices_finish_together(monkeypatch):
    """Near the end, a batch is cut to what the device can finish by the common finish time,
    or waits for a faster card: the finish skew is no worse, and better where it mattered."""
    from forge.core.scheduler import Scheduler

    devices, skews = inventory("mix_16g_32g"), []
    fair_share = Scheduler._fair_share
    for n in (200, 2000):
        monkeypatch.setattr(Scheduler, "_fair_share", fair_share)
        split = plan_geometry(reference(n), devices, "memory", cost=COST_7B)
        monkeypatch.setattr(Scheduler, "_fair_share", lambda self, batch, device: batch)
        whole = plan_geometry(reference(n), devices, "memory", cost=COST_7B)
        assert split["balanced"] and split["items"]["completed"] == n and whole["end_splits"] == 0
        skews.append((split["virtual_time"]["finish_skew"], whole["virtual_time"]["finish_skew"]))
    assert all(s <= w and s <= 0.05 for s, w in skews) and any(s < 0.7 * w for s, w in skews), skews


def test_memory_fit_of_a_deep_model_extrapolates_from_two_shallow_depths_exactly():
    from transformers import LlamaConfig

    from forge.runtime.cost.memory_fit import FakeModel, Shape, Target, at_depth, measure_by_depth, scaling_depths

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    target = Target(dtype="bfloat16", hidden_kept=1)
    assert scaling_depths(config, target) == (2, 4)
    assert scaling_depths(config, Target(hidden_kept=3)) == (3, 5)  # every depth keeps 3 hidden states
    assert scaling_depths(at_depth(config, 6), target) is None  # shallow: measured whole
    shapes = (Shape(2, 32, 128), Shape(1, 64, 64, cached=False))
    whole = FakeModel(config, target)
    peaks, weights = measure_by_depth(config, target, (2, 4), shapes=shapes)
    assert weights == whole.weight_bytes
    assert peaks == [whole.peak(s) for s in shapes]


def test_a_deep_model_is_planned_from_its_config_alone(tmp_path):
    """No weights: a config and a tokenizer, a 1:2 mix of simulated cards, memory mode."""
    import json
    import shutil

    from conftest import plan_forge
    from forge.functions.assets import ASSETS_DIR

    model = tmp_path / "deep"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(ASSETS_DIR / "tiny-llama" / name, model / name)
    config = json.loads((ASSETS_DIR / "tiny-llama" / "config.json").read_text())
    config.update(
        num_hidden_layers=8,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
    )
    (model / "config.json").write_text(json.dumps(config))
    report = plan_forge(
        "model=hf",
        f"model.name={model}",
        "model.torch_dtype=bfloat16",
        "devices=mix_16g_32g",
        "batching=memory",
        "input.limit=200",
        "layers=[1]",
    )
    assert report["status"] == "finished" and report["balanced"] and report["items"]["completed"] == 200
    assert not list(model.glob("*.safetensors"))
    for d in report["devices"]:
        assert 0 < d["predicted_peak_bytes"] <= d["memory_budget_bytes"]
        assert d["virtual_finish"] > 0 and d["batches"] > 0 and d["tokens"] > 0
    assert report["virtual_time"]["unit"] == "s"
