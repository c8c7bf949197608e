"""The typed schema of Forge's config, and the one check every entry point runs.

`validate(cfg)` merges a composed config onto `OmegaConf.structured(schema)`, so OmegaConf
itself refuses wrong types and unknown keys, then checks values (positive sizes, shares,
choices) from each field's metadata (set by the field helpers of `forge.config.checks`). Every
failure is one ForgeError line that names the full key, the bad value and what is valid. The
function picked by `function._target_` declares its own root keys (`Function.config_schema`,
a dataclass), the batching mode picked by `batching.mode` its own `batching` keys (its packer's
`config_schema`, `forge.config.modes`), the runtime picked by `runtime.executor` its own
`runtime` keys; the core declares the rest here.

Each dataclass is the one home of its keys' defaults: the YAML files extend it (their defaults
lists name the nodes `forge.cli.searchpath` registers from it) and set only what differs, and
a field's comment is its documentation (`forge.config.docs` writes docs/configuration.md).

Hydra's own node (`hydra`) is never validated.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, DictConfig, ListConfig, Node, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)
from omegaconf.nodes import BooleanNode, FloatNode, IntegerNode, StringNode

from forge.config.checks import (  # one_of, positive: functions' schemas too
    CHECK,
    check_bools,
    non_negative,
    one_of,
    positive,
    share,
    show,
    unwrap_optional,
)
from forge.config.modes import Batching
from forge.config.trackers import check_trackers
from forge.config.unknown_key import explain_unknown_key, unknown_key_line
from forge.errors import ForgeError

# -- the core's keys -----------------------------------------------------------------


@dataclass
class FunctionRef:
    name: str = MISSING  # the function's name; a plugin registers its class under it (forge_functions)
    _target_: str | None = None  # import path of the class; unset: the class registered under `name`


@dataclass
class Budget:
    # caps padded token slots per batch: min(this, each device's max_batch_tokens); null: no cap
    tokens_per_step: int | None = positive(8192)
    # stop admitting once this many tokens were received (a resume counts earlier sessions'); the rest are skipped
    max_tokens: int | None = positive(None)


@dataclass
class DeviceLimits:
    """What one device takes in one step (`forge.vocab.geometry.Limits`); null: not set here."""

    max_batch_tokens: int | None = positive(None)  # padded token slots per step: rows x padded length
    max_rows: int | None = positive(None)  # sequences (or packed rows) per step
    max_seq_len: int | None = positive(None)  # longest sequence, prefix included, a row may hold
    pad_multiple: int | None = positive(None)  # padded length is rounded up to a multiple of this (null: 1)


@dataclass
class Devices:
    """Where batches run: every local device found, or an inventory by name (docs/devices.md)."""

    discover: bool = True  # with no inventory: every local CUDA device, or the CPU when there is none
    limits: DeviceLimits | None = None  # limits of discovered devices, and defaults for inventory entries
    memory_fraction: float = share(0.9)  # share of each CUDA device's free memory that batching=memory may plan for
    cpu_memory_gb: float | None = positive(None)  # the CPU's budget for batching=memory (null: memory_fraction of RAM)
    # devices by name: name, device (or devices: a group), limits, memory_gb, batch_overhead_tokens, sim, split
    # (checked by forge.config.devices)
    inventory: list[Any] = field(default_factory=list)
    split: str | None = None  # auto: every device discovered or listed holds one model together, as one group


@dataclass
class Runtime:
    """Where and how batches run, and how the run loop reacts to time and failure: the one
    home of every runtime setting and its default. conf/runtime/local.yaml extends it (its
    defaults list names `schema_local`, registered by `forge.cli.searchpath.store_schemas`) and only selects;
    core code gets an instance of it (`forge.cli.build.build_runtime`)."""

    executor: str = "process"  # a registered executor (forge_executors): process | inprocess | ray
    max_in_flight: int = positive(2)  # batches queued per worker (one runs while the next waits)
    batch_timeout_s: float | None = positive(None)  # null: derived per batch from its size and the device's rate
    timeout_floor_s: float = positive(60.0)  # a derived timeout is never shorter
    timeout_factor: float = positive(10.0)  # derived timeout = factor x padded slots / measured slots per second
    startup_timeout_s: float = positive(600.0)  # a worker that has not loaded its model by then is replaced
    kill_grace_s: float = non_negative(5.0)  # a timed-out worker may still answer this long before it is killed
    max_restarts: int = non_negative(3)  # worker restarts per device before the device is retired
    max_attempts: int = positive(3)  # runs of an item lost with its worker (crash, hang) before it fails
    commit_interval_s: float = positive(30.0)  # results buffered for a shard are written at least this often
    failure_window: int = positive(200)  # the last items (and input records) looked at for a recurring failure
    max_failure_share: float = share(0.5)  # stop once one reason holds this share of the window
    # on a stop (Ctrl-C, a recurring failure), how long batches in flight may finish
    drain_s: float = non_negative(10.0)
    # read and tokenize the input on a thread, ahead of the run (forge.core.read_ahead); false: on
    # the run's own thread, for a function whose rows() or prompts() must run there
    read_ahead: bool = True
    # a CPU device's worker keeps the memory it frees (forge.executors.cpu_process): 10-30% less
    # busy time measured, its resident memory near its peak; false: the C library's own behaviour
    keep_freed_memory: bool = True


@dataclass
class RayRuntime(Runtime):
    """conf/runtime/ray.yaml (`schema_ray`): one Ray actor per device, on a cluster or a local
    Ray instance."""

    executor: str = "ray"
    address: str | None = None  # null: start a local instance; "auto" or an address: join a cluster
    num_cpus: int | None = positive(None)  # CPUs of a local instance (null: all)
    cpus_per_actor: float = positive(1.0)  # CPUs each device's actor reserves (and torch threads of a CPU actor)


RUNTIMES = {"ray": RayRuntime}  # runtime.executor -> its schema; any other value: Runtime (local)


@dataclass
class CoreConfig:
    """Root keys the core reads. The function's own keys come from its `config_schema`."""

    function: FunctionRef = field(default_factory=FunctionRef)  # the function to run (function=<name> picks one)
    budget: Budget = field(default_factory=Budget)
    # items longer than a device's max_seq_len: skip | truncate (cut from the right; refused by
    # functions that score targets) | error
    too_long: str = one_of("skip", "skip", "truncate", "error")
    # the run directory, a local path or an fsspec URL (s3://, gs://, memory://): conf/config.yaml
    # makes a fresh one under outputs/
    output_dir: str = MISSING
    batching: Batching = field(default_factory=Batching)  # how batches are cut (batching=<mode> picks a mode)
    devices: Devices = field(default_factory=Devices)
    runtime: Runtime = field(default_factory=Runtime)  # where batches run (runtime=local or runtime=ray)
    resume: bool = False  # true: finish the run in output_dir, skipping what it committed
    check_disk: bool = True  # refuse, before any work, a local output_dir without room for the results
    fail_fast: bool = False  # true: stop at the first bad input row instead of recording it
    plugins: list[str] = field(default_factory=list)  # extra plugin modules to register (import paths), like pytest -p
    # trackers the run logs to: trackers=[tensorboard,mlflow,wandb,trackio] selects any of them (each
    # a conf/trackers/ option), trackers.<name>.<key> sets one (forge.config.trackers; docs/trackers.md)
    trackers: dict[str, Any] = field(default_factory=dict)


def schema_for(function_schema: type | None, runtime_schema: type = Runtime, batching_schema: type = Batching) -> type:
    """The root schema: the core's keys (with the chosen runtime's and batching mode's) plus the
    function's (a dataclass of root keys)."""
    chosen = {"runtime": runtime_schema, "batching": batching_schema}
    own = {name: tp for name, tp in chosen.items() if tp is not {"runtime": Runtime, "batching": Batching}[name]}
    core: type = CoreConfig
    if own:  # a subclass whose nodes are the chosen schemas (a redeclared field keeps its place)
        body: dict[str, Any] = {name: field(default_factory=tp) for name, tp in own.items()}
        core = dataclass(type("CoreConfig", (CoreConfig,), {"__annotations__": own, **body}))
    if function_schema is None:
        return core
    clash = {f.name for f in dataclasses.fields(function_schema)} & {f.name for f in dataclasses.fields(core)}
    if clash:
        raise ForgeError(f"{function_schema.__qualname__} declares core key(s) {sorted(clash)}; rename them")
    return dataclass(type("Config", (function_schema, core), {}))


def runtime_schema(cfg: DictConfig) -> type:
    """The runtime group's schema, chosen by its `executor` key."""
    executor = OmegaConf.select(cfg, "runtime.executor", default=None, throw_on_missing=False)
    return RUNTIMES.get(executor, Runtime) if isinstance(executor, str) else Runtime


def batching_schema(cfg: DictConfig, modes: Mapping[str, type]) -> type:
    """The batching node's schema, chosen by its `mode` key among `modes` (mode -> its schema)."""
    mode = OmegaConf.select(cfg, "batching.mode", default=None, throw_on_missing=False)
    if not isinstance(mode, str):
        return Batching  # unset or not a string: the base schema says so, naming the key
    if mode not in modes:
        raise ForgeError(
            f"config batching.mode={show(mode)}: choose one of: {', '.join(sorted(modes))} "
            "(plugins add more through forge_batching_modes)"
        )
    return modes[mode]


# -- validation ---------------------------------------------------------------------


def validate(
    cfg: DictConfig,
    fn_schema: type | None,
    executors: Iterable[str],
    modes: Mapping[str, type],
    resolve: bool = True,
) -> dict[str, Any]:
    """The config as plain typed containers, or one ForgeError line naming what is wrong.

    `fn_schema` is the dataclass of root keys the configured function declares (None: its keys
    go unchecked); `executors`, the names `runtime.executor` may take; `modes`, each batching
    mode's schema (its packer's `config_schema`). The edge looks them up in the plugins'
    registries (`forge.cli.build.to_plain`). `resolve=False` checks without resolving
    interpolations (values that are interpolations are then checked only for their type once
    resolved, by a later `validate`)."""
    cfg = _without_hydra(cfg)
    check_function_package(cfg)
    choices = {"runtime": RUNTIMES, "batching": modes}
    schema_cls = schema_for(fn_schema, runtime_schema(cfg), batching_schema(cfg, modes))
    schema = _structured(schema_cls, typed_root=fn_schema is not None)
    try:
        merged = OmegaConf.merge(schema, cfg)
        plain = OmegaConf.to_container(merged, resolve=resolve, throw_on_missing=True)
    except MissingMandatoryValue as exc:
        raise ForgeError(f"{exc.full_key} must be set: add {exc.full_key}=<value> to the command line") from None
    except OmegaConfBaseException as exc:
        raise ForgeError(_explain(exc, schema_cls, cfg, choices)) from None
    check_bools(schema_cls, cfg)
    _check_values(schema_cls, plain, "")
    _check_executor((plain.get("runtime") or {}).get("executor"), executors)
    check_trackers(plain.get("trackers"))
    return plain


def check_function_package(cfg: DictConfig) -> None:
    """A function's YAML without `# @package _global_` as its first line lands under `function:`,
    where every root key (budget, input, ...) is unknown: say that, not the first unknown key."""
    if line := _package_line(cfg):
        raise ForgeError(line)


def _package_line(root: DictConfig) -> str | None:
    node = root._get_node("function") if "function" in root else None
    if not (isinstance(node, DictConfig) and not node._is_none() and "function" in node):
        return None
    nested = ", ".join(f"function.{k}" for k in node if k not in ("name", "_target_"))
    return (
        f"config: the function's YAML put its keys under function: ({nested}); make `# @package _global_` "
        "its first line, so that they (function, input, budget, ...) sit at the root (docs/functions.md)"
    )


def _check_executor(name, offered: Iterable[str]) -> None:
    """runtime.executor must name an executor a plugin registers (forge_executors)."""
    if name is not None and name not in offered:
        raise ForgeError(
            f"config runtime.executor={show(name)}: choose one of: {', '.join(sorted(offered))} "
            "(plugins add more through forge_executors)"
        )


def explain_compose_error(exc: BaseException, modes: Mapping[str, type]) -> str | None:
    """One line for a key Hydra found nowhere to override, or a value it refused while composing
    onto a typed node (the runtime group extends its schema), in the words `validate` uses; None
    if it is another error. `modes`: each batching mode's schema, for the hint of a key another
    mode has."""
    cause = exc.__cause__
    key = getattr(cause, "full_key", None)
    node = getattr(cause, "parent_node", None)
    if isinstance(node, DictConfig) and (line := _package_line(node._get_root())):
        return line
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and key:
        return explain_unknown_key(key, cause, {"runtime": RUNTIMES, "batching": modes})
    if isinstance(cause, ValidationError) and key:
        expected = NODE_TYPES.get(type(cause.child_node)) if cause.child_node is not None else None
        if expected:
            return f"config {key}={show(_raw(cause.value))}: expected {expected}"
    return None


def _structured(schema_cls: type, typed_root: bool = True) -> DictConfig:
    """The schema as an OmegaConf node (for a function without a schema, its root keys untyped)."""
    schema = OmegaConf.structured(schema_cls)
    if not typed_root:
        for name in schema:
            if isinstance(schema._get_node(name), DictConfig):
                OmegaConf.set_struct(schema[name], True)
        OmegaConf.set_struct(schema, False)
    return schema


def _without_hydra(cfg: DictConfig) -> DictConfig:
    if "hydra" not in cfg:
        return cfg
    return OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])


def _check_values(schema_cls: type, plain: dict, prefix: str) -> None:
    hints = typing.get_type_hints(schema_cls)
    if prefix:  # a typed node: Hydra lets `+key=` through to it
        valid = [f.name for f in dataclasses.fields(schema_cls)]
        unknown = [k for k in plain if k not in valid]
        if unknown:
            raise ForgeError(unknown_key_line(f"{prefix}{unknown[0]}", valid))
    for f in dataclasses.fields(schema_cls):
        value = plain.get(f.name)
        key = f"{prefix}{f.name}"
        if value is None or (isinstance(value, str) and "${" in value):
            continue
        check: Callable | None = f.metadata.get(CHECK)
        problem = check(value) if check else None
        if problem:
            raise ForgeError(f"config {key}={show(value)}: {problem}")
        inner = unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(inner) and isinstance(value, dict):
            _check_values(inner, value, f"{key}.")


NODE_TYPES = {
    IntegerNode: "an integer",
    FloatNode: "a number",
    BooleanNode: "true or false",
    StringNode: "a string",
    ListConfig: "a list",
}
PLAIN_TYPES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _explain(exc: OmegaConfBaseException, schema_cls: type, cfg: DictConfig, choices: Mapping) -> str:
    """One line for an OmegaConf error: the full key, the bad value and what is valid."""
    key = exc.full_key or ""
    if not key:  # a merge error at a node's root names no key: find the root key that fails
        key = _failing_key(schema_cls, cfg) or ""
        if key and (expected := _expected(_field_type(schema_cls, key))):
            value = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
            return f"config {key}={show(_raw(value))}: expected {expected}"
        return f"config{' ' + key if key else ''}: {str(exc).splitlines()[0]}"
    if isinstance(exc, ConfigKeyError):
        return explain_unknown_key(key, exc, choices)
    value, interpolation = _raw(getattr(exc, "value", None)), "Interpolation" in type(exc).__name__
    if interpolation and value is None:  # a ${...} that resolves to nothing: say why
        return f"config {key}: {str(exc).splitlines()[0]}; fix the ${{...}} reference or give a value"
    if isinstance(exc, ValidationError) or interpolation:
        node = NODE_TYPES.get(type(exc.child_node)) if exc.child_node is not None else None
        if expected := node or _expected(_field_type(schema_cls, key)):
            null_ok = "" if value is not None else " (null is not allowed here)"
            return f"config {key}={show(value)}: expected {expected}{null_ok}"
    return f"config {key}: {str(exc).splitlines()[0]}"


def _raw(value):
    if isinstance(value, (DictConfig, ListConfig)):
        return None if value._is_none() else OmegaConf.to_container(value, resolve=False)
    if isinstance(value, Node):
        return value._value()
    return value


def _failing_key(schema_cls: type, cfg: DictConfig) -> str | None:
    """The deepest dotted key whose value alone fails to merge onto the schema."""
    for key in cfg:
        try:
            OmegaConf.merge(_structured(schema_cls), {key: cfg._get_node(key)})
        except OmegaConfBaseException:
            inner, node = _field_type(schema_cls, str(key)), cfg._get_node(key)
            if dataclasses.is_dataclass(inner) and isinstance(node, DictConfig):
                deeper = _failing_key(inner, node)
                if deeper:
                    return f"{key}.{deeper}"
            return str(key)
    return None


def _field_type(schema_cls: type, key: str):
    """The declared type at a dotted key like `devices.limits.max_rows` or `layers[1]`."""
    tp: Any = schema_cls
    for part in re.findall(r"[^.\[\]]+", key):
        tp = unwrap_optional(tp)
        if dataclasses.is_dataclass(tp):
            hints = typing.get_type_hints(tp)
            if part not in hints:
                return None
            tp = hints[part]
        elif typing.get_origin(tp) is list and part.isdigit():
            tp = typing.get_args(tp)[0] if typing.get_args(tp) else Any
        else:
            return None
    return unwrap_optional(tp)


def _expected(tp) -> str | None:
    if tp is None:
        return None
    tp = unwrap_optional(tp)
    if tp in PLAIN_TYPES:
        return PLAIN_TYPES[tp]
    if typing.get_origin(tp) is list:
        return "a list"
    if dataclasses.is_dataclass(tp):
        return f"a mapping with keys {', '.join(f.name for f in dataclasses.fields(tp))}"
    return None
