"""Composing the config as `forge run` would, before Hydra runs: `compose`, a config group's
options on the whole search path (`group_options`), the jobs of a `-m` sweep
(`sweep_combinations`) and the checks `forge run` makes before any run directory exists
(`precheck`)."""

from __future__ import annotations

import sys
from pathlib import Path

from forge.errors import ForgeError

HYDRA_VALUE_FLAGS = ("--config-dir", "-cd")
MULTIRUN_FLAGS = ("-m", "--multirun")
MAX_SWEEP_CHECKS = 64  # sweeps with more combinations are checked one swept value at a time


def precheck(args: list[str]) -> None:
    """Compose and validate before Hydra runs (and before it makes a run directory), so a bad
    choice, key or value is one clear line. With -m, every combination of the sweep is checked
    (beyond MAX_SWEEP_CHECKS, every swept value). Hydra's other flags (--cfg, --info, ...) are
    left to Hydra."""
    from forge.cli.build import to_plain
    from forge.io.location import check_output_dir

    overrides, config_dir, multirun, i = [], None, False, 0
    while i < len(args):
        a = args[i]
        if a in HYDRA_VALUE_FLAGS and i + 1 < len(args):
            config_dir, i = Path(args[i + 1]), i + 2
            continue
        if a.startswith("--config-dir="):
            config_dir = Path(a.split("=", 1)[1])
        elif a in MULTIRUN_FLAGS:
            multirun = True
        elif a.startswith("-"):
            return
        else:
            overrides.append(a)
        i += 1
    from forge.io.store import check_run_dir, check_sweep_dir

    combinations = sweep_combinations(overrides, config_dir) if multirun else [overrides]
    for job, combination in enumerate(combinations):
        plain = to_plain(compose(combination, config_dir))
        check_devices(plain)
        output_dir = str(plain.get("output_dir", ""))
        check_output_dir(output_dir)
        if job == 0 and output_dir.startswith("memory://"):
            print(
                f"warning: output_dir={output_dir} keeps the results in this process's memory: they are gone "
                "when the command exits; give a local path or a store URL (s3://, gs://, ...) to keep them",
                file=sys.stderr,
            )
        if multirun:
            check_sweep_dir(output_dir)
        if not multirun or len(combinations) <= MAX_SWEEP_CHECKS:  # a reduced check names no job directory
            check_run_dir(f"{output_dir.rstrip('/')}/{job}" if multirun else output_dir, bool(plain.get("resume")))


def check_devices(plain: dict) -> None:
    """Simulated devices are refused before a run directory exists."""
    from forge.config.devices import resolve_devices

    if (plain.get("devices") or {}).get("inventory"):
        simulated = [d.name for d in resolve_devices(plain["devices"]) if d.sim is not None]
        if simulated:
            raise ForgeError(
                f"devices: {', '.join(simulated)} simulated (sim:); `forge run` needs real devices: "
                "plan on simulated ones with `forge plan` and the same overrides"
            )


def sweep_combinations(overrides: list[str], config_dir: Path | None = None) -> list[list[str]]:
    """The override lists a `-m` sweep runs (Hydra's basic sweeper: the product of every
    comma-separated, choice(), range() or glob() value), or, when there are more than
    MAX_SWEEP_CHECKS, each swept value with the others at their first value. Intervals
    (other sweepers' syntax) are left out: their jobs check themselves."""
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as exc:
        raise ForgeError(" ".join(str(exc).split())) from None
    choices = []
    for o in parsed:
        key = o.get_key_element()
        if not o.is_sweep_override():
            choices.append([o.input_line])
        elif o.value_type == ValueType.GLOB_CHOICE_SWEEP:
            options = group_options(o.key_or_group, config_dir)
            choices.append([f"{key}={v}" for v in o.value().filter(options)])
        elif o.is_discrete_sweep():
            choices.append([f"{key}={v}" for v in o.sweep_string_iterator()])
    total = 1
    for c in choices:
        total *= len(c)
    if total <= MAX_SWEEP_CHECKS:
        return [list(combo) for combo in itertools.product(*choices)]
    firsts = [c[0] for c in choices]
    return [firsts[:n] + [value] + firsts[n + 1 :] for n, c in enumerate(choices) for value in c]


def group_options(group: str, config_dir: Path | None = None) -> list[str]:
    """The options of a config group on Hydra's whole search path: Forge's conf/, installed
    plugins' config modules (forge.cli.searchpath) and `--config-dir`."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from forge.cli.build import conf_dir
    from forge.cli.searchpath import register

    register()
    overrides = [] if config_dir is None else [f"hydra.searchpath=[file://{Path(config_dir).resolve()}]"]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        options = (
            GlobalHydra.instance().config_loader().get_group_options(group, config_name="config", overrides=overrides)
        )
    return sorted(options)


def compose(overrides: list[str], config_dir: Path | None = None):
    """Compose the config as `forge run` would, with clear errors for bad choices."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    from forge.cli.build import conf_dir
    from forge.cli.searchpath import register
    from forge.pluginmanager import extra_plugins

    register()
    flags = [o for o in overrides if o.startswith("-")]
    if flags:
        raise ForgeError(f"unknown option(s) {' '.join(flags)}; see --help")
    _check_runtime_bools(overrides)
    if config_dir is not None:
        if not Path(config_dir).is_dir():
            raise ForgeError(f"--config-dir {config_dir}: no such directory")
        overrides = [*overrides, f"hydra.searchpath=[file://{Path(config_dir).resolve()}]"]
    GlobalHydra.instance().clear()
    try:
        with extra_plugins(*listed_plugins(overrides)), initialize_config_dir(str(conf_dir()), version_base="1.3"):
            try:
                return hydra_compose(config_name="config", overrides=list(overrides))
            except HydraException as exc:
                line = _missing_option(exc)
                if line is None:
                    raise
                raise ForgeError(line) from None
    except HydraException as exc:
        from forge.cli.build import mode_schemas
        from forge.config.schema import explain_compose_error
        from forge.pluginmanager import make_plugin_manager

        line = explain_compose_error(exc, mode_schemas(make_plugin_manager()))
        raise ForgeError(line or " ".join(str(exc).split())) from None


def _missing_option(exc: BaseException) -> str | None:
    """One line for a config group option that is nowhere (`function=nope`, `trackers=[nope]`),
    listing the group's options (its YAML files and what plugins register), without Hydra's
    search path; None for another error. Called while Hydra is initialized."""
    import re

    from hydra.core.global_hydra import GlobalHydra

    found = re.search(r"Could not (?:find|load) '([\w.-]+)/([^']+)'", str(exc))
    if found is None:
        return None
    group, name = found.groups()
    try:
        options = GlobalHydra.instance().config_loader().get_group_options(group)
    except Exception:  # noqa: BLE001 - no options to list: Hydra's own line then
        return None
    shown = [o for o in options if not o.startswith("schema_")]  # the schema nodes Forge registers
    if group == "batching":  # a plugin may register a mode and ship no config for it
        from forge.pluginmanager import batching_modes, make_plugin_manager

        offered = batching_modes(make_plugin_manager()).get(name)
        if offered is not None:
            return (
                f"batching={name}: plugin {offered[1]} registers the mode but no config selects it; add "
                f"conf/batching/{name}.yaml (docs/batching.md, Plugins)"
            )
    return f"{group}={name}: no such option ({group}/{name}); choose among: {', '.join(shown) or 'none'}"


def plugins_listed(overrides: list[str]):
    """A block in which every plugin manager registers the modules `plugins=[...]` lists."""
    from forge.pluginmanager import extra_plugins

    return extra_plugins(*listed_plugins(overrides))


def listed_plugins(overrides: list[str]) -> tuple[str, ...]:
    """The modules a `plugins=[a,b]` override lists: registered (`forge.pluginmanager.extra_plugins`)
    while the config is composed, so a function one of them offers composes without a YAML of its
    own (`forge.cli.searchpath.function_option`) and its schema gives every default."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    listed = [o for o in overrides if o.partition("=")[0].lstrip("+~") == "plugins" and "=" in o]
    if not listed:
        return ()
    try:
        value = OverridesParser.create().parse_overrides(listed[-1:])[0].value()
    except HydraException as exc:
        raise ForgeError(" ".join(str(exc).split())) from None
    if not isinstance(value, list) or not all(isinstance(n, str) and n for n in value):
        return ()  # not a list of names: the schema's check says so in its line
    return tuple(value)


def _check_runtime_bools(overrides: list[str]) -> None:
    """A runtime bool given anything but true or false on the command line. The runtime group is
    composed onto its typed schema, so Hydra turns `runtime.read_ahead=2` into true before
    `validate` could see the 2."""
    import dataclasses

    from forge.config.schema import RayRuntime

    bools = {f.name for f in dataclasses.fields(RayRuntime) if f.type in (bool, "bool")}
    for override in overrides:
        key, sep, value = override.lstrip("+~").partition("=")
        name = key.removeprefix("runtime.")
        if sep and key.startswith("runtime.") and name in bools and value.strip().lower() not in ("true", "false"):
            raise ForgeError(f"config {key}={value}: expected true or false")
