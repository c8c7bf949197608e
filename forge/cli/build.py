"""The edge: the only place that reads Hydra config and instantiates from it.

Everything past `build_spec` takes plain typed arguments.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from forge.config.devices import resolve_devices
from forge.config.modes import Batching
from forge.config.nodes import instantiate
from forge.config.schema import RUNTIMES, Runtime, check_function_package, validate
from forge.driver.engine import RunSpec
from forge.errors import ForgeError
from forge.io.location import hydra_dir

# conf/config.yaml: Hydra's own files go to output_dir when it is local, else to a local staging folder
OmegaConf.register_new_resolver("forge_hydra_dir", hydra_dir, replace=True)


def conf_dir() -> Path:
    """The packaged config directory, `forge.conf` (the repository's conf/ in an editable install)."""
    import forge.conf

    return Path(forge.conf.__file__).resolve().parent


def to_plain(cfg: DictConfig) -> dict[str, Any]:
    """The composed config checked against its typed schema (forge.config.schema), with the
    configured function's own keys, the batching modes' and the registered executors, as plain
    containers. The plugin modules the config names (`plugins`) count: a mode or an executor
    may come from one."""
    from forge.pluginmanager import executors, make_plugin_manager

    listed = OmegaConf.select(cfg, "plugins", default=None, throw_on_missing=False)
    modules = [m for m in listed if isinstance(m, str)] if isinstance(listed, ListConfig) else []
    pm = make_plugin_manager(modules=modules)
    check_function_package(cfg)  # a function YAML without its header: said before its lookup fails
    return validate(cfg, function_schema(cfg, pm), executors(pm), mode_schemas(pm))


def mode_schemas(pm) -> dict[str, type]:
    """Each registered batching mode's schema: its factory's `config_schema` (`Batching` if none)."""
    from forge.pluginmanager import batching_modes

    return {name: getattr(factory, "config_schema", Batching) for name, (factory, _) in batching_modes(pm).items()}


def function_schema(cfg: DictConfig, pm=None) -> type | None:
    """The dataclass of root keys that the configured function declares, if any."""
    from forge.pluginmanager import function_class

    node = OmegaConf.select(cfg, "function", default=None, throw_on_missing=False)
    if not isinstance(node, DictConfig):
        raise ForgeError("function: no _target_; pick one with function=<name> (see `forge ls`)")
    ref = {k: OmegaConf.select(node, k, default=None, throw_on_missing=False) for k in ("_target_", "name")}
    return getattr(function_class(ref, pm), "config_schema", None)


def build_function(cfg: dict[str, Any]):
    """Instantiate the function from its typed config, an instance of its `config_schema` made
    from the validated root keys (a function that declares none reads no keys), and refuse a
    `too_long` policy it cannot honour."""
    from forge.pluginmanager import function_class, make_plugin_manager

    cls = function_class(cfg["function"], make_plugin_manager(modules=cfg.get("plugins") or ()))
    schema = getattr(cls, "config_schema", None)
    function = cls(instantiate(schema, cfg)) if schema is not None else cls()
    function.check_too_long(cfg["too_long"])
    return function


def build_spec(cfg: DictConfig, run_dir: Path | str | None) -> RunSpec:
    """A RunSpec from a composed config. Core classes never see the DictConfig."""
    plain = to_plain(cfg)
    budget, batching = plain["budget"], plain["batching"]
    tokens_per_step = budget["tokens_per_step"]
    devices = resolve_devices(plain["devices"])
    function = build_function(plain)
    devices, placements = place_groups(devices, function)
    capped = []
    for d in devices:
        try:
            capped.append(function.batch_device(d.with_step_budget(tokens_per_step)))
        except ForgeError:
            raise ForgeError(
                f"budget.tokens_per_step={tokens_per_step} is below device {d.name}'s max_seq_len="
                f"{d.limits.max_seq_len}: one full-length row would not fit; raise the budget or lower max_seq_len"
            ) from None
    return RunSpec(
        runtime=build_runtime(plain["runtime"]),
        resume=plain["resume"],
        fail_fast=plain["fail_fast"],
        check_disk=plain["check_disk"],
        plugins=tuple(plain["plugins"]),
        function=function,
        mode=batching["mode"],
        mode_options=dict(batching),  # every key of the mode's schema: create_packer builds its typed config
        devices=capped,
        placements=placements,
        window=batching["window"],
        # a mode without a prefix cache has neither key (its schema declares none)
        cache_tokens=batching["cache_tokens"] if batching.get("prefix_cache") else 0,
        too_long=plain["too_long"],
        max_tokens=budget["max_tokens"],
        run_dir=run_dir,
        config=plain,
    )


def build_runtime(runtime: dict[str, Any]) -> Runtime:
    """The runtime group's settings (validated plain values) as its schema's dataclass: the
    typed spec the engine, the loop and the executor read."""
    return RUNTIMES.get(runtime["executor"], Runtime)(**runtime)


def place_groups(devices: list, function) -> tuple[list, dict]:
    """Each device group placed for the function's model (`forge.runtime.placement.device_map`) and turned
    into the one consumer the packer sees (`forge.runtime.placement.group_device`); single devices as they are."""
    if not any(d.group for d in devices):
        return devices, {}
    if not hasattr(function, "config") or not hasattr(function, "forward"):
        raise ForgeError(
            f"devices: a device group holds a model function's model; function {function.name} has none "
            "to place: use single devices"
        )
    from forge.runtime.placement.device_map import placement_for
    from forge.runtime.placement.group_device import group_consumer

    out, placements = [], {}
    for d in devices:
        if d.group:
            placements[d.name] = placement_for(function, d)
            d = group_consumer(d, placements[d.name], function.cost_model())
        out.append(d)
    return out, placements
