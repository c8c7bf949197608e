"""Building a plugin manager: a fresh one per run or test, never a global."""

from __future__ import annotations

import importlib

import pluggy

from forge import hookspecs
from forge.errors import ForgeError

ENTRY_POINT_GROUP = "forge"


def make_plugin_manager(load_entry_points: bool = True, extra: tuple = (),
                        modules: tuple[str, ...] | list[str] = ()) -> pluggy.PluginManager:
    """A plugin manager with Forge's hookspecs, the `forge` entry points, `extra` plugin
    objects and the plugin `modules` named by import path (the `plugins` config key)."""
    pm = pluggy.PluginManager("forge")
    pm.add_hookspecs(hookspecs)
    if load_entry_points:
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    for plugin in extra:
        pm.register(plugin)
    for name in modules:
        if pm.has_plugin(name):
            continue
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise ForgeError(f"plugins: cannot import {name!r} ({exc}); list importable module paths") from None
        pm.register(module, name=name)
    return pm


def batching_modes(pm: pluggy.PluginManager) -> dict[str, tuple[object, str]]:
    """Every registered batching mode: name -> (factory, providing plugin's name)."""
    modes: dict[str, tuple[object, str]] = {}
    for impl in pm.hook.forge_batching_modes.get_hookimpls():
        for name, factory in (impl.function() or {}).items():
            modes[name] = (factory, impl.plugin_name)
    return modes
