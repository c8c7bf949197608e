"""Building a plugin manager: a fresh one per run or test, never a global.

(Not to be confused with the repository's `plugins/` folder, the built-in plugins, which
installs as `forge.builtin` and registers through the entry points this manager loads.)"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import pluggy

import forge.hookspecs as hookspecs
from forge.errors import ForgeError

ENTRY_POINT_GROUP = "forge"
#: plugins every manager made in this context registers besides the entry points: module names
#: (the `plugins` a command line lists, `forge.cli.compose.listed_plugins`) and plugin objects (a
#: function class `forge.run` was handed, `forge.inproc.functions`); set by `extra_plugins`
_EXTRA: ContextVar[tuple] = ContextVar("forge_extra_plugins", default=())


@contextmanager
def extra_plugins(*plugins: object) -> Iterator[None]:
    """Every plugin manager made inside the block also registers `plugins` (module names or
    plugin objects): the config is composed, and the function looked up, with them."""
    token = _EXTRA.set((*_EXTRA.get(), *plugins))
    try:
        yield
    finally:
        _EXTRA.reset(token)


def make_plugin_manager(
    load_entry_points: bool = True, extra: tuple = (), modules: tuple[str, ...] | list[str] = ()
) -> pluggy.PluginManager:
    """A plugin manager with Forge's hookspecs, the `forge` entry points, `extra` plugin
    objects and the plugin `modules` named by import path (the `plugins` config key)."""
    pm = pluggy.PluginManager("forge")
    pm.add_hookspecs(hookspecs)
    if load_entry_points:
        try:
            pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        except Exception as exc:  # noqa: BLE001  (an installed plugin that cannot import: say which, once)
            raise ForgeError(
                f"an installed plugin of the {ENTRY_POINT_GROUP!r} entry-point group cannot load "
                f"({type(exc).__name__}: {exc}); reinstall or uninstall its package"
            ) from None
    listed = _EXTRA.get()
    for plugin in (*extra, *(p for p in listed if not isinstance(p, str))):
        if not pm.is_registered(plugin):
            pm.register(plugin)
    for name in (*modules, *(p for p in listed if isinstance(p, str))):
        if pm.has_plugin(name):
            continue
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            from pathlib import Path

            here = Path(name.replace(".", "/") + ".py").exists()  # a local module, not on Python's path
            fix = "run with PYTHONPATH=. (the module is in this folder)" if here else "list importable module paths"
            raise ForgeError(f"plugins: cannot import {name!r} ({exc}); {fix}") from None
        pm.register(module, name=name)
    return pm


def _offers(pm: pluggy.PluginManager, hook: str, what: str) -> dict[str, tuple[object, str]]:
    """name -> (what one plugin offers under it, that plugin's name), from a hook that returns
    dicts; a name two plugins offer is an error naming both."""
    offers: dict[str, tuple[object, str]] = {}
    for impl in getattr(pm.hook, hook).get_hookimpls():
        for name, value in (impl.function() or {}).items():
            if name in offers and offers[name][1] != impl.plugin_name:
                raise ForgeError(
                    f"{what} {name!r} is offered by two plugins, {offers[name][1]!r} and "
                    f"{impl.plugin_name!r}; uninstall one, or rename its {what}"
                )
            offers[name] = (value, impl.plugin_name)
    return offers


def batching_modes(pm: pluggy.PluginManager) -> dict[str, tuple[object, str]]:
    """Every registered batching mode: name -> (factory, providing plugin's name)."""
    return _offers(pm, "forge_batching_modes", "batching mode")


def executors(pm: pluggy.PluginManager) -> dict[str, tuple[object, str]]:
    """Every registered executor: name -> (factory or "module:Class.factory", plugin's name)."""
    return _offers(pm, "forge_executors", "executor")


def functions(pm: pluggy.PluginManager) -> dict[str, tuple[object, str]]:
    """Every registered function: name -> (class or "module:Class" import path, plugin's name)."""
    return _offers(pm, "forge_functions", "function")


def trackers(pm: pluggy.PluginManager) -> dict[str, tuple[object, str]]:
    """Every registered tracker: name -> (factory or "module:Class" import path, plugin's name)."""
    return _offers(pm, "forge_trackers", "tracker")


def load_object(ref: object, what: str) -> object:
    """A class given itself or as an import path, "pkg.module:Class" or "pkg.module.Class"."""
    if not isinstance(ref, str):
        return ref
    module, sep, attr = ref.partition(":")
    if not sep:
        module, _, attr = ref.rpartition(".")
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ForgeError(
            f"{what}={ref!r}: cannot import it ({first}); pick a function with function=<name> (see `forge ls`)"
        ) from None
    return obj


def function_class(function_cfg: dict, pm: pluggy.PluginManager | None = None) -> type:
    """The class of the configured function: `function._target_` when the config names one,
    else the function a plugin registers under `function.name`."""
    target = function_cfg.get("_target_")
    name = function_cfg.get("name")
    if target:
        if not isinstance(target, str):
            raise ForgeError(f"config function._target_={target!r}: expected an import path")
        cls = load_object(target, "config function._target_")
        own = getattr(cls, "name", None)
        if name and isinstance(own, str) and own != name:
            raise ForgeError(
                f"function.name={name!r}, but function._target_={target} is the function {own!r}; "
                "pick a function with function=<name> (see `forge ls`)"
            )
        return cls
    if not name:
        raise ForgeError("function: no name and no _target_; pick one with function=<name> (see `forge ls`)")
    registered = functions(pm or make_plugin_manager())
    if name not in registered:
        raise ForgeError(
            f"function.name={name!r}: no installed plugin offers it and its config has no _target_; "
            f"installed functions: {', '.join(sorted(registered)) or 'none'} (see `forge ls`)"
        )
    ref, plugin = registered[name]
    return load_object(ref, f"function {name} (plugin {plugin})")


def config_searchpath(pm: pluggy.PluginManager) -> list[tuple[str, str]]:
    """(plugin name, config path) for every config directory plugins offer, in registration order."""
    paths = []
    for impl in pm.hook.forge_config_searchpath.get_hookimpls()[::-1]:  # pluggy lists last-registered first
        offered = impl.function()
        for path in [offered] if isinstance(offered, str) else (offered or []):
            paths.append((impl.plugin_name, str(path)))
    return paths
