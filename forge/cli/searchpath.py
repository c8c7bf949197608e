"""Plugins' config directories on Hydra's search path.

Model: a plugin offers a config module through the `forge_config_searchpath` hook (e.g.
``"pkg://my_plugin.conf"`` holding `function/my_fn.yaml`); this Hydra `SearchPathPlugin`
appends every offered module after Forge's own `conf/`, so `forge run function=my_fn` composes
its YAML once the plugin's package is installed. Hydra finds the plugin class in the
`hydra_plugins` namespace package (`hydra_plugins/forge_searchpath`); Forge's CLI also
registers it directly (`register`), because setuptools' editable installs hide namespace
packages from Hydra's scan. It acts only on Forge's own config (other Hydra apps are left alone).

The YAML files extend the schemas that hold every default (`forge.config.schema`): the core's
are stored in Hydra's ConfigStore (`store_schemas`); a function's and a batching mode's come from
the plugin that registers it, so `SchemaSource` serves them (`/schema_function/<name>`,
`/schema_batching/<mode>`), importing a function's module only when a YAML names its schema.
"""

from __future__ import annotations

from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.object_type import ObjectType
from hydra.plugins.config_source import ConfigResult, ConfigSource
from hydra.plugins.search_path_plugin import SearchPathPlugin

PROVIDER = "forge-plugin"  # search-path provider names: forge-plugin:<plugin name>
SCHEMAS = "forge-schema://registered"  # where SchemaSource answers (its scheme, and a path it ignores)
SCHEMA_GROUPS = ("schema_batching", "schema_function", "schema_tracker")  # the config groups SchemaSource serves
FUNCTION_GROUP = "function"  # SchemaSource also serves an option here for every registered function


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
        if SCHEMAS not in known:
            search_path.append(provider="forge-schema", path=SCHEMAS)


class SchemaSource(ConfigSource):
    """The config groups `schema_function` and `schema_batching`: one option per registered
    function or batching mode, the keys and defaults of its schema (`config_schema`) as a plain
    node (`forge.config.nodes.defaults_of`), a mode's with its `mode` set to its name. A function
    YAML extends its function's with `- /schema_function/<name>@_here_`; a batching YAML its
    mode's with `- /schema_batching/<mode>@_here_`."""

    def __init__(self, provider: str, path: str) -> None:
        super().__init__(provider=provider, path=path)
        self._pm = None
        self._registered: dict[str, dict[str, object]] = {}

    @staticmethod
    def scheme() -> str:
        return "forge-schema"

    def _registry(self) -> dict[str, dict[str, object]]:
        """group -> {name: what the plugins register under it}; read once, at the first lookup."""
        if self._pm is None:
            from forge.pluginmanager import batching_modes, functions, make_plugin_manager, trackers

            self._pm = make_plugin_manager()
            self._registered = {
                "schema_function": functions(self._pm),
                "schema_batching": batching_modes(self._pm),
                "schema_tracker": trackers(self._pm),
            }
        return self._registered

    def _split(self, config_path: str) -> tuple[str, str]:
        group, _, name = self._normalize_file_name(config_path.strip("/")).removesuffix(".yaml").partition("/")
        return group, name

    def load_config(self, config_path: str) -> ConfigResult:
        from omegaconf import OmegaConf

        from forge.cli.build import mode_schemas
        from forge.config.nodes import defaults_of
        from forge.pluginmanager import function_class, load_object

        group, name = self._split(config_path)
        self._registry()  # the plugin manager, made once
        where = f"{self.scheme()}://{self.path}"
        if group == FUNCTION_GROUP:  # a function with no YAML of its own: its schema and the input keys
            return ConfigResult(
                config=function_option(name), path=where, provider=self.provider, header={"package": "_global_"}
            )
        if group == "schema_function":
            schema = getattr(function_class({"name": name}, self._pm), "config_schema", None)
            node = OmegaConf.create(defaults_of(schema) if schema is not None else {})
        elif group == "schema_tracker":  # the tracker's settings (imports its module, never its library)
            ref, plugin = self._registered[group][name]
            schema = getattr(load_object(ref, f"tracker {name} (plugin {plugin})"), "config_schema", None)
            node = OmegaConf.create(defaults_of(schema) if schema is not None else {})
        else:  # the mode this option names, whichever mode's schema it shares (an ItemPacker subclass's)
            node = OmegaConf.create({**defaults_of(mode_schemas(self._pm)[name]), "mode": name})
        return ConfigResult(config=node, path=where, provider=self.provider, header={"package": None})

    def available(self) -> bool:
        return True

    def is_group(self, config_path: str) -> bool:
        return config_path.strip("/") in (*SCHEMA_GROUPS, FUNCTION_GROUP)

    def is_config(self, config_path: str) -> bool:
        group, name = self._split(config_path)
        group = "schema_function" if group == FUNCTION_GROUP else group
        return group in SCHEMA_GROUPS and name in self._registry()[group]

    def list(self, config_path: str, results_filter: ObjectType | None) -> list[str]:
        group = config_path.strip("/")
        if not group:  # the root holds the groups
            return [*SCHEMA_GROUPS, FUNCTION_GROUP] if results_filter != ObjectType.CONFIG else []
        group = "schema_function" if group == FUNCTION_GROUP else group
        if group not in SCHEMA_GROUPS or results_filter == ObjectType.GROUP:
            return []
        return sorted(self._registry()[group])


def function_option(name: str):
    """The `function` option of a registered function that has no YAML on the search path (one
    from `plugins=[module]`, or a class handed to `forge.run`): exactly what its YAML would say
    with nothing to restate, `function.name` and the defaults of its `config_schema` and of the
    `input` keys (`input.path` is then given on the command line)."""
    from omegaconf import OmegaConf

    return OmegaConf.create(
        {
            "defaults": [f"/schema_function/{name}@_here_", "/schema_input@input", "_self_"],
            "function": {"name": name},
        }
    )


def register() -> None:
    """Make sure Hydra uses the plugin (a no-op when its namespace scan found it already), and
    knows the schemas Forge's YAML extends (`store_schemas`)."""
    from hydra.core.plugins import Plugins

    Plugins.instance().register(ForgeSearchPathPlugin)
    Plugins.instance().register(SchemaSource)
    store_schemas()


def store_schemas() -> None:
    """Register the core's schemas Forge's YAML extends with Hydra's ConfigStore: `schema_core`,
    the root keys and their defaults (first in conf/config.yaml's defaults list), `schema_devices`
    (`- /schema_devices@_here_` in conf/devices/*.yaml), the runtime group's options
    `schema_local` and `schema_ray` (conf/runtime/*.yaml), and `schema_input`, the `input` node
    of every function YAML (`- /schema_input@input` in its defaults list)."""
    from hydra.core.config_store import ConfigStore

    from forge.config.nodes import defaults_of
    from forge.config.schema import CoreConfig, Devices, RayRuntime, Runtime
    from forge.io.inputs import InputSpec

    store = ConfigStore.instance()
    # plain, not typed: the root also holds the function's keys, which CoreConfig does not declare.
    # The nodes with a group of their own come from the option picked, which extends its schema:
    # a user's option that does not is composed as written (validate then fills in the defaults)
    grouped = ("batching", "devices", "runtime")
    store.store(name="schema_core", node={k: v for k, v in defaults_of(CoreConfig).items() if k not in grouped})
    store.store(name="schema_devices", node=defaults_of(Devices))
    store.store(group="runtime", name="schema_local", node=Runtime)
    store.store(group="runtime", name="schema_ray", node=RayRuntime)
    store.store(name="schema_input", node=InputSpec)
