"""Device groups: the inventory's group entries, the placement planned from the memory model
(`forge.runtime.placement.device_map`), the group as one consumer, and accelerate's choice beside it."""

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st
from omegaconf import OmegaConf

from forge.batching.cost import CostModel
from forge.config.devices import from_inventory, resolve_devices
from forge.errors import ForgeError
from forge.runtime.cost.models import LOGIT_COPIES
from forge.runtime.placement.stages import best_split, fill, offload_split
from forge.vocab.geometry import Device, Limits, Member, StepTime

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30
LIMITS = {"max_batch_tokens": 65536, "max_rows": 512, "max_seq_len": 4096, "pad_multiple": 8}
# The measured memory models of examples/models/llama-2-70b in bfloat16 (pooling last, one hidden
# state kept), as `forge plan` fits them: cut after layer 40 (41 layers run) and whole. Numbers
# here so that tests do not fit a 70B model.
COST_70B_CUT41 = CostModel(
    weight_bytes=71212253184,
    bytes_per_token=221103.04,
    bytes_per_score=202.43,
    kv_bytes_per_token=209237.49,
    prefix_bytes_per_token=26681.35,
    margin=0.05,
)
COST_70B = CostModel(
    weight_bytes=137953296384,
    bytes_per_token=190974.21,
    bytes_per_score=420.61,
    kv_bytes_per_token=375626.23,
    prefix_bytes_per_token=115582.45,
    margin=0.05,
)


@pytest.fixture(scope="module")
def config_70b():
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(ROOT / "examples" / "models" / "llama-2-70b")


def function(config, layers=(40,), lm_head=False, cost=COST_70B_CUT41):
    """What placement_for reads of a forge ModelFunction: config, model spec, forward, cost model."""
    return SimpleNamespace(
        config=config,
        model=SimpleNamespace(torch_dtype="bfloat16", trust_remote_code=False),
        forward=SimpleNamespace(lm_head=lm_head, layers=tuple(layers), capture=(), head=False),
        cost_model=lambda: cost,
        step_bytes=lambda device: 0,  # a forward pass: its cost model prices the whole step
    )


def scoring_cost() -> CostModel:
    """The whole model's, plus what score keeps per token (its float32 logits), as cost_models adds it."""
    return replace(COST_70B, bytes_per_token=COST_70B.bytes_per_token + 32000 * (2 + 4 * LOGIT_COPIES))


def group(memory_gb, offload=None, n=2, sim=None) -> Device:
    entry = {"name": "pair", "devices": [f"cuda:{i}" for i in range(n)], "memory_gb": memory_gb, "sim": sim}
    if offload:
        entry["split"] = {"offload": offload}
    [device] = from_inventory([entry], LIMITS)
    return device


# ----------------------------------------------------------------------------- the inventory


def test_a_group_entry_lists_members_with_budgets_one_for_all_or_one_each():
    [d] = from_inventory([{"name": "pair", "devices": ["cuda:0", "cuda:1"], "memory_gb": [16, 32]}], LIMITS)
    assert d.group == (Member("cuda:0", 16 * GIB), Member("cuda:1", 32 * GIB)) and d.offload is None
    [d] = from_inventory([{"name": "pair", "devices": ["cuda:0", "cuda:1"], "memory_gb": 40, "split": {}}], LIMITS)
    assert [m.memory_bytes for m in d.group] == [40 * GIB, 40 * GIB] and d.memory_bytes is None
    [d] = from_inventory([{"name": "p", "devices": ["a", "b"], "split": {"offload": "disk"}}], LIMITS)
    assert d.offload == "disk"


@pytest.mark.parametrize(
    "entry,message",
    [
        ({"devices": "cuda:0"}, r"\(pair\)\.devices='cuda:0': must be a list of torch devices"),
        ({"devices": ["cuda:0", "cuda:0"]}, r"\(pair\)\.devices=.*listed twice"),
        ({"devices": ["cuda:0", "disk"]}, r"\(pair\)\.devices: disk is no member; allow it as split\.offload: disk"),
        ({"devices": ["cuda:0", "cuda:1"], "memory_gb": [40]}, r"\(pair\)\.memory_gb: 1 values for 2 devices"),
        ({"devices": ["cuda:0", "cuda:1"], "memory_gb": [40, -1]}, r"\(pair\)\.memory_gb=-1: must be a positive"),
        ({"devices": ["a", "b"], "split": {"offload": "gpu"}}, r"\(pair\)\.split\.offload='gpu': must be cpu, disk"),
        ({"devices": ["a", "b"], "split": {"speed": 1}}, r"\(pair\)\.split: unknown key\(s\) \['speed'\]"),
        ({"devices": ["a", "b"], "split": "auto"}, r"\(pair\)\.split='auto': must be a mapping"),
        ({"devices": ["a", "b"], "device": "cuda:0"}, r"\(pair\): give either device .* or devices"),
        ({"device": "cuda:0", "split": {"offload": "cpu"}}, r"\(pair\)\.split: only a device group splits"),
        (
            {"devices": ["a", "b"], "sim": [{"seconds_per_step": 0.1, "seconds_per_slot": 1e-4}, None]},
            r"\(pair\)\.sim: give every member a sim block or none",
        ),
    ],
)
def test_group_entries_are_checked_in_one_line_naming_the_key(entry, message):
    with pytest.raises(ForgeError, match=rf"^devices\.inventory\[0\] {message}") as err:
        from_inventory([{"name": "pair", **entry}], LIMITS)
    assert "\n" not in str(err.value)


def test_split_auto_makes_every_listed_device_one_group():
    cfg = {
        "discover": False,
        "limits": LIMITS,
        "inventory": [{"name": "a", "memory_gb": 16}, {"name": "b", "memory_gb": 32}],
    }
    [d] = resolve_devices({**cfg, "split": "auto"})
    assert d.name == "group" and [m.torch_device for m in d.group] == ["a", "b"]
    with pytest.raises(ForgeError, match=r"^devices\.split='yes': must be auto"):
        resolve_devices({**cfg, "split": "yes"})
    with pytest.raises(ForgeError, match=r"^devices\.split=auto: 1 device found; a group needs two or more"):
        resolve_devices({**cfg, "inventory": [{"name": "a"}], "split": "auto"})


def test_shipped_group_inventories_resolve():
    for name, members in (("pair_40g", 2), ("pair_80g", 2), ("trio_70b", 3)):
        [d] = resolve_devices(OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "devices" / f"{name}.yaml")))
        assert len(d.group) == members and all(m.sim is not None and m.memory_bytes for m in d.group)
    single, duo = resolve_devices(OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "devices" / "trio_13b.yaml")))
    assert not single.group and [m.memory_bytes for m in duo.group] == [16 * GIB, 32 * GIB]


# ----------------------------------------------------------------------------- stages (plain numbers)


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 50), min_size=1, max_size=30),
    budgets=st.lists(st.integers(1, 400), min_size=1, max_size=4),
    fixed=st.integers(0, 20),
    reserve=st.integers(0, 60),
)
def test_no_split_predicts_a_member_over_its_budget(sizes, budgets, fixed, reserve):
    best = best_split(sizes, budgets, fixed)
    if best is None:  # only when even no room at all would not hold every block
        assert sum(fill(sizes, budgets, fixed, 0)) < len(sizes)
    else:
        assert sum(best.counts) == len(sizes) and best.offloaded == 0
        for n, w, b in zip(best.counts, best.weights, budgets):
            assert n == 0 or w + fixed + best.tightest_room <= b
        # no split leaves its tightest stage more room: one more byte of room would not fit
        assert sum(fill(sizes, budgets, fixed, best.tightest_room + 1)) < len(sizes)
    off = offload_split(sizes, budgets, fixed, reserve)
    if off is not None:
        assert sum(off.counts) + off.offloaded == len(sizes)
        assert off.streamed_bytes >= max(sizes[sum(off.counts) :], default=0)
        for i, (n, w, b) in enumerate(zip(off.counts, off.weights, budgets)):
            streamed = off.streamed_bytes if i == 0 else 0
            assert (n == 0 and i > 0) or w + fixed + streamed + reserve <= b


# ----------------------------------------------------------------------------- the 70B on two 40 GB cards


@pytest.mark.slow
def test_70b_read_at_layer_40_fits_two_40gb_cards_with_nothing_offloaded(config_70b):
    from forge.runtime.placement.device_map import placement_for

    p = placement_for(function(config_70b), group(40))
    assert p.offload is None and p.offloaded_bytes == 0 and (p.layers_run, p.layers_total) == (41, 80)
    assert [s.layers for s in p.stages] == [(0, 19), (20, 40)]
    assert p.device_map["model.embed_tokens"] == "cuda:0" and p.device_map["model.layers.40"] == "cuda:1"
    assert p.device_map["model.layers.41"] == "disk" and "model.layers.41" in p.unused and "lm_head" in p.unused
    for s in p.stages:
        assert s.weights_bytes + s.activation_bytes <= s.budget_bytes == 40 * GIB
        assert s.activation_bytes >= p.activation_bytes > 4 * GIB
    # accelerate, given the same cards for the whole model, offloads half of it to the CPU
    assert p.accelerate.offloaded_bytes > 50 * GIB and p.accelerate.bytes_per_device["cuda:0"] > 36 * GIB
    assert "41 of 80 layers" in p.summary and "nothing offloaded" in p.summary and "\n" not in p.summary
    # the worker plans again on the device the packer saw (budget, limits, step time set): the same map
    from forge.runtime.placement.group_device import group_consumer

    sim = {"seconds_per_step": 0.0375, "seconds_per_slot": 7.5e-4, "seconds_per_score": 1.9e-8}
    consumer = group_consumer(group(40, sim=sim), p, COST_70B_CUT41)
    assert placement_for(function(config_70b), consumer).device_map == p.device_map
    # the plan in virtual time: the group drains the backlog, never over its budget
    from benchmarks.workloads import items
    from forge.driver.simulate import plan_geometry

    report = plan_geometry(items(400), [consumer], "memory", cost=COST_70B_CUT41)
    [d] = report["devices"]
    assert report["status"] == "finished" and d["oom"] == 0 and 0 < d["simulated_peak_bytes"] <= consumer.memory_bytes


@pytest.mark.slow
def test_the_whole_model_is_refused_in_one_line_unless_offload_is_allowed(config_70b):
    from forge.runtime.placement.device_map import placement_for

    score = function(config_70b, layers=(80,), lm_head=True, cost=scoring_cost())
    with pytest.raises(ForgeError) as err:
        placement_for(score, group(40))
    line = str(err.value)
    assert "\n" not in line and line.startswith("device group pair: the function needs the whole model and the LM head")
    assert "split.offload: cpu" in line and "would fit" in line
    p = placement_for(score, group(40, offload="cpu"))
    assert p.offload == "cpu" and p.offloaded_bytes > 60 * GIB and p.device_map["lm_head"] == "cpu"
    assert p.max_memory["cpu"] == p.offloaded_bytes and p.accelerate_max_memory().keys() == {0, 1, "cpu"}
    first = p.stages[0]
    assert first.weights_bytes + first.activation_bytes <= first.budget_bytes
    with pytest.raises(ForgeError) as err:  # offload allowed, cards too small for even one row: the hint says so
        placement_for(score, group(2, offload="disk"))
    line = str(err.value)
    assert "\n" not in line and "even with split.offload: disk, its first member has no room for one" in line
    assert "allow split.offload" not in line and "lower devices.limits.max_seq_len" in line


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(
    budgets=st.lists(st.integers(12, 90), min_size=2, max_size=4),
    deepest=st.integers(1, 80),
    offload=st.sampled_from([None, "cpu"]),
)
def test_a_group_never_admits_a_batch_over_a_stage_budget(config_70b, budgets, deepest, offload):
    """Any batch the memory packer admits against the group, and any token-mode batch within its
    limits, leaves every member's weights plus its activations within that member's budget."""
    from accelerate.utils import compute_module_sizes

    from forge.runtime.placement.device_map import activation_bound, meta_model, placement_for
    from forge.runtime.placement.group_device import group_consumer

    # the cut model's weights scale with its depth (a stand-in memory model, measured coefficients)
    cost = replace(COST_70B_CUT41, weight_bytes=int(COST_70B_CUT41.weight_bytes * (deepest + 1) / 41))
    device = group(budgets, offload=offload, n=len(budgets))
    try:
        p = placement_for(function(config_70b, layers=(deepest,), cost=cost), device)
    except ForgeError as exc:
        assert "\n" not in str(exc) and str(exc).startswith("device group pair: ")
        return
    sizes = compute_module_sizes(meta_model(config_70b, "bfloat16", False))
    consumer = group_consumer(device, p, cost)
    room = consumer.memory_bytes - cost.weight_bytes  # what the memory packer lets a batch's activations take
    assert room == p.activation_bytes
    assert activation_bound(cost, consumer.limits, consumer.limits.max_batch_tokens) <= room
    for i, s in enumerate(p.stages):
        held = sum(sizes[m] for m, d in p.device_map.items() if d == s.device)
        assert held == s.weights_bytes
        if s.weights_bytes or (i == 0 and p.offloaded_bytes):
            assert s.activation_bytes >= room >= 0 and s.weights_bytes + s.activation_bytes <= s.budget_bytes


def test_the_group_is_one_consumer_with_its_tightest_stage_and_a_pipelined_step_time():
    from forge.runtime.placement.device_map import AccelerateChoice, Placement, Stage
    from forge.runtime.placement.group_device import group_consumer

    a, b = StepTime(0.1, 2e-3, 5e-8), StepTime(0.05, 1e-3, 2.5e-8)
    device = Device("g", Limits(65536, 512, 4096, 8), group=(Member("x", 16 * GIB, a), Member("y", 32 * GIB, b)))
    stages = (
        Stage("x", (0, 9), 11, 10 * GIB, 5 * GIB, 16 * GIB),
        Stage("y", (10, 40), 32, 30 * GIB, 2 * GIB, 32 * GIB),
    )
    p = Placement({}, {}, stages, 2 * GIB, None, 0, (), 41, 80, 80 * GIB, 16384, AccelerateChoice({}, {}, 0), "")
    g = group_consumer(device, p, COST_70B_CUT41)
    assert g.memory_bytes == COST_70B_CUT41.weight_bytes + 2 * GIB and g.group == device.group
    assert g.limits.max_batch_tokens < 65536 and g.limits.max_seq_len == 4096
    # each stage runs its share of the whole model's weights on its member, plus the hand-over per token
    assert g.sim.seconds_per_step == pytest.approx(0.125 * 0.1 + 0.375 * 0.05)
    assert g.sim.seconds_per_slot == pytest.approx(0.125 * 2e-3 + 0.375 * 1e-3 + 16384 / 16e9)
    assert g.batch_overhead_tokens == g.sim.overhead_tokens
    # offloaded weights run on the first member and are streamed to it every step: slow, and priced so
    off = replace(p, offload="cpu", offloaded_bytes=40 * GIB)
    slow = group_consumer(replace(device, offload="cpu"), off, COST_70B_CUT41).sim
    assert slow.seconds_per_step == pytest.approx(g.sim.seconds_per_step + 0.5 * 0.1 + 40 * GIB / 16e9)
    disk = group_consumer(replace(device, offload="disk"), replace(off, offload="disk"), COST_70B_CUT41).sim
    assert disk.seconds_per_step == pytest.approx(g.sim.seconds_per_step + 0.5 * 0.1 + 40 * GIB / 2e9)


TINY_PAIR = """discover: false
limits: {max_batch_tokens: 4096, max_rows: 128, max_seq_len: 512, pad_multiple: 8}
inventory:
  - name: pair
    devices: [cuda:0, cuda:1]
    memory_gb: [0.02, 0.03]
    sim: {seconds_per_step: 0.01, seconds_per_slot: 1.0e-5}
"""


@pytest.mark.slow
def test_forge_plan_places_a_group_prints_it_and_draws_it(tmp_path):
    """The embedded model on a simulated pair of small cards, through the CLI: the plan carries
    the placement (--json), prints it beside accelerate's, and draws it (--plot)."""
    import json

    from typer.testing import CliRunner

    from forge.cli.app import app

    (tmp_path / "devices").mkdir()
    (tmp_path / "devices" / "tiny_pair.yaml").write_text(TINY_PAIR)
    args = ["plan", "--config-dir", str(tmp_path), "devices=tiny_pair", "batching=memory", "input.limit=200"]
    result = CliRunner().invoke(app, [*args, "--json", "--plot", str(tmp_path / "plan.png")])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    [device], placed = report["devices"], report["placements"]["pair"]
    assert report["status"] == "finished" and device["oom"] == 0
    assert device["memory_budget_bytes"] < (0.05 * GIB) and device["limits"]["max_batch_tokens"] <= 4096
    assert [s["budget_bytes"] for s in placed["stages"]] == [int(0.02 * GIB), int(0.03 * GIB)]
    assert placed["layers_run"] == placed["layers_total"] == 4 and placed["accelerate"]["bytes_per_device"]
    from rich.console import Console

    from forge.cli.placement_view import placement_tables

    console = Console(record=True, width=120)
    [table] = placement_tables(report)
    console.print(table)
    printed = console.export_text()
    assert "device group pair: 4 of 4 layers run" in printed and "accelerate (full model)" in printed
    assert (tmp_path / "plan.png").stat().st_size > 10_000
