"""Every config group composes, and the edge turns it into plain typed objects."""

from pathlib import Path

import pytest
from omegaconf import DictConfig

from conftest import compose, spec_for
from forge.config import conf_dir
from forge.errors import ForgeError

GROUPS = {g: sorted(p.stem for p in (conf_dir() / g).glob("*.yaml")) for g in ("function", "batching", "devices", "model")}


def test_every_group_has_options():
    assert GROUPS["batching"] == ["item", "memory", "token"]
    assert "probe_gen" in GROUPS["function"] and "tiny_llama" in GROUPS["model"]
    assert {"auto", "cpu", "sim2"} <= set(GROUPS["devices"])


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_option_composes(group, option):
    cfg = compose(f"{group}={option}")
    assert isinstance(cfg, DictConfig)
    if group == "model" and option == "hf":
        with pytest.raises(ForgeError, match="model.name"):
            spec_for(f"{group}={option}")
        return
    spec = spec_for(f"{group}={option}")
    assert not any(isinstance(v, DictConfig) for v in vars(spec).values())  # core sees plain values
    assert spec.devices and all(d.limits.max_batch_tokens <= 8192 for d in spec.devices)  # budget caps
    if group == "batching":
        assert spec.mode == option


def test_budget_caps_device_limits():
    spec = spec_for("budget.tokens_per_step=4096")
    assert all(d.limits.max_batch_tokens == 4096 for d in spec.devices)
    with pytest.raises(ForgeError, match="budget.tokens_per_step=100 is below .* max_seq_len"):
        spec_for("budget.tokens_per_step=100")


def test_prefix_cache_switch():
    assert spec_for("batching=token").cache_tokens == 32768
    assert spec_for("batching=token", "batching.prefix_cache=false").cache_tokens == 0


def test_bad_choices_name_the_valid_ones():
    with pytest.raises(ForgeError, match="batching/bogus.*item.*memory.*token"):
        compose("batching=bogus")
    with pytest.raises(ForgeError, match="function/nope.*probe_gen"):
        compose("function=nope")
    with pytest.raises(ForgeError, match="pooling='max'; choose one of: last, mean"):
        spec_for("pooling=max")
    with pytest.raises(ForgeError, match=r"layers=\[9\]: the model has 4 layers"):
        spec_for("layers=[9]")


def test_bad_device_limits_say_which_limit():
    with pytest.raises(ForgeError, match="max_batch_tokens=512 is below max_seq_len=2048"):
        spec_for("devices.limits.max_batch_tokens=512", "budget.tokens_per_step=null")
    with pytest.raises(ForgeError, match="max_rows must be a positive integer"):
        spec_for("devices.limits.max_rows=0")


def test_inventory_from_a_user_config_dir(tmp_path: Path):
    from forge.cli import compose as cli_compose
    from forge.config import build_spec

    (tmp_path / "devices").mkdir()
    (tmp_path / "devices" / "lab.yaml").write_text(
        "discover: false\ninventory:\n"
        "  - {name: big, device: cpu, limits: {max_batch_tokens: 8192, max_rows: 64, max_seq_len: 1024, pad_multiple: 8}}\n"
        "  - {name: small, device: cpu, limits: {max_batch_tokens: 2048, max_rows: 16, max_seq_len: 1024}}\n"
    )
    spec = build_spec(cli_compose(["devices=lab"], tmp_path), None)
    assert [(d.name, d.limits.max_batch_tokens, d.limits.pad_multiple) for d in spec.devices] == [
        ("big", 8192, 8), ("small", 2048, 1)]


def test_a_non_causal_function_cannot_share_prefixes(pm):
    from forge.engine import prepare

    spec = spec_for("batching=token")
    assert spec.function.causal  # the embedded Llama is a causal decoder
    spec.function.causal = False
    with pytest.raises(ForgeError, match="not causal; set batching.prefix_cache=false"):
        prepare(spec, pm, dry_run=True)
    spec = spec_for("batching=token", "batching.prefix_cache=false")
    spec.function.causal = False
    prepare(spec, pm, dry_run=True)  # whole rows are fine


def test_memory_mode_checks_budgets_before_any_work(pm):
    from forge.engine import prepare

    spec = spec_for("batching=memory", "devices=cpu", "devices.inventory.0.memory_gb=0.001")
    with pytest.raises(ForgeError, match="device cpu has 0.001 GB, not more than the model's"):
        prepare(spec, pm, dry_run=True)
