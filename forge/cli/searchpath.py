"""Plugins' config directories on Hydra's search path.

Model: a plugin offers a config module through the `forge_config_searchpath` hook (e.g.
``"pkg://my_plugin.conf"`` holding `function/my_fn.yaml`); this Hydra `SearchPathPlugin`
appends every offered module after Forge's own `conf/`, so `forge run function=my_fn` composes
its YAML once the plugin's package is installed. Hydra finds the plugin class in the
`hydra_plugins` namespace package (`hydra_plugins/forge_searchpath`); Forge's CLI also
registers it directly (`register`), because setuptools' editable installs hide namespace
packages from Hydra's scan. It acts only on Forge's own config (other Hydra apps are left alone).
"""

from __future__ import annotations

from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

PROVIDER = "forge-plugin"  # search-path provider names: forge-plugin:<plugin name>


def _is_forge(search_path: ConfigSearchPath) -> bool:
    """Whether the primary config is Forge's (its conf/ directory, or the forge.conf module)."""
    from forge.cli.build import conf_dir

    ours = conf_dir()
    for entry in search_path.get_path():
        path = entry.path or ""
        if path == "pkg://forge.conf":
            return True
        if path.startswith("file://"):
            path = path[len("file://") :]
        if entry.provider == "main" and path and Path(path).resolve() == ours:
            return True
    return False


class ForgeSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        if not _is_forge(search_path):
            return
        from forge.pluginmanager import config_searchpath, make_plugin_manager

        known = {entry.path for entry in search_path.get_path()}
        for plugin, path in config_searchpath(make_plugin_manager()):
            if path not in known:
                search_path.append(provider=f"{PROVIDER}:{plugin}", path=path)
                known.add(path)


def register() -> None:
    """Make sure Hydra uses the plugin (a no-op when its namespace scan found it already), and
    knows the schemas Forge's YAML extends (`store_schemas`)."""
    from hydra.core.plugins import Plugins

    Plugins.instance().register(ForgeSearchPathPlugin)
    store_schemas()


def store_schemas() -> None:
    """Register the schemas Forge's YAML extends with Hydra's ConfigStore: the runtime group's
    options `schema_local` and `schema_ray` (conf/runtime/*.yaml), and `schema_input`, the
    `input` node of every function YAML (`- /schema_input@input` in its defaults list)."""
    from hydra.core.config_store import ConfigStore

    from forge.config.schema import RayRuntime, Runtime
    from forge.io.inputs import InputSpec

    store = ConfigStore.instance()
    store.store(group="runtime", name="schema_local", node=Runtime)
    store.store(group="runtime", name="schema_ray", node=RayRuntime)
    store.store(name="schema_input", node=InputSpec)
