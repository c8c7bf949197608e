"""The edge: the only place that reads Hydra config and instantiates from it.

Everything past `build_spec` takes plain typed arguments.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from forge.config.devices import resolve_devices
from forge.config.schema import RUNTIMES, Runtime, validate
from forge.driver.engine import RunSpec
from forge.errors import ForgeError
from forge.io.location import hydra_dir
from forge.vocab.geometry import DEFAULT_WINDOW

# conf/config.yaml: Hydra's own files go to output_dir when it is local, else to a local staging folder
OmegaConf.register_new_resolver("forge_hydra_dir", hydra_dir, replace=True)

ENGINE_BATCHING_KEYS = ("mode", "window", "cache_tokens")
GB = 1 << 30


def conf_dir() -> Path:
    """The packaged config directory, `forge.conf` (the repository's conf/ in an editable install)."""
    import forge.conf

    return Path(forge.conf.__file__).resolve().parent


def to_plain(cfg: DictConfig) -> dict[str, Any]:
    """The composed config checked against its typed schema (forge.config.schema), with the
    configured function's own keys and the registered executors, as plain containers."""
    from forge.pluginmanager import executors, make_plugin_manager

    return validate(cfg, function_schema(cfg), executors(make_plugin_manager()))


def function_schema(cfg: DictConfig) -> type | None:
    """The dataclass of root keys that the configured function declares, if any."""
    from forge.pluginmanager import function_class

    node = OmegaConf.select(cfg, "function", default=None, throw_on_missing=False)
    if not isinstance(node, DictConfig):
        raise ForgeError("function: no _target_; pick one with function=<name> (see `forge ls`)")
    ref = {k: OmegaConf.select(node, k, default=None, throw_on_missing=False) for k in ("_target_", "name")}
    return getattr(function_class(ref), "config_schema", None)


def build_function(cfg: dict[str, Any]):
    """Instantiate the function: its constructor's parameters come from same-named config keys."""
    from forge.pluginmanager import function_class

    cls = function_class(cfg.get("function") or {})
    params = inspect.signature(cls).parameters
    kwargs = {name: cfg[name] for name in params if name in cfg}
    missing = [n for n, p in params.items() if p.default is p.empty and n not in kwargs]
    if missing:
        raise ForgeError(f"function {cfg['function'].get('name')}: config lacks {', '.join(missing)}")
    return cls(**kwargs)


def build_spec(cfg: DictConfig, run_dir: Path | None) -> RunSpec:
    """A RunSpec from a composed config. Core classes never see the DictConfig."""
    plain = to_plain(cfg)
    budget = plain.get("budget") or {}
    tokens_per_step = budget.get("tokens_per_step")
    devices = resolve_devices(plain.get("devices") or {})
    capped = []
    for d in devices:
        try:
            capped.append(_replace_limits(d, d.limits.capped(tokens_per_step)))
        except ForgeError:
            raise ForgeError(
                f"budget.tokens_per_step={tokens_per_step} is below device {d.name}'s max_seq_len="
                f"{d.limits.max_seq_len}: one full-length row would not fit; raise the budget or lower max_seq_len"
            ) from None
    batching = dict(plain["batching"])
    mode = batching.get("mode")
    options = {k: v for k, v in batching.items() if k not in ENGINE_BATCHING_KEYS}
    if options.get("prefix_cache") is None:
        options.pop("prefix_cache", None)  # not set: the mode's own default
    if "default_memory_gb" in options:
        gb = options.pop("default_memory_gb")
        options["default_memory_bytes"] = int(gb * GB) if gb else None
    cache_tokens = int(batching.get("cache_tokens") or 0) if batching.get("prefix_cache", False) else 0
    return RunSpec(
        runtime=build_runtime(plain.get("runtime") or {}),
        resume=bool(plain.get("resume", False)),
        fail_fast=bool(plain.get("fail_fast", False)),
        check_disk=bool(plain.get("check_disk", True)),
        plugins=tuple(plain.get("plugins") or ()),
        function=build_function(plain),
        mode=mode,
        mode_options=options,
        devices=capped,
        window=int(batching.get("window") or DEFAULT_WINDOW),
        cache_tokens=cache_tokens,
        too_long=plain.get("too_long", "skip"),
        max_tokens=budget.get("max_tokens"),
        run_dir=run_dir,
        config=plain,
    )


def build_runtime(runtime: dict[str, Any]) -> Runtime:
    """The runtime group's settings (validated plain values) as its schema's dataclass: the
    typed spec the engine, the loop and the executor read."""
    return RUNTIMES.get(runtime.get("executor"), Runtime)(**runtime)


def _replace_limits(device, limits):
    from dataclasses import replace

    return replace(device, limits=limits)
