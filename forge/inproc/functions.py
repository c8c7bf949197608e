"""A function class handed to `forge.run` (from a notebook cell or a local module), registered
for one call as an installed plugin would register it: under its `name`, through the
`forge_functions` hook, so its `config_schema` is the one home of its defaults (the `function`
option `forge.cli.searchpath.function_option` makes for it extends that schema, as a YAML would)."""

from __future__ import annotations

from forge.errors import ForgeError
from forge.hookspecs import hookimpl


class FunctionPlugin:
    """A plugin offering one function class under its name."""

    def __init__(self, cls: type) -> None:
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name:
            raise ForgeError(
                f"function class {cls.__qualname__}: no `name`; give it one (a class attribute, e.g. "
                f'name = "{cls.__name__.lower()}"), the name its config and results go by'
            )
        self.name, self.cls = name, cls
        self.__name__ = f"forge.run:{cls.__module__}.{cls.__qualname__}"  # the plugin's name in pluggy's errors

    @hookimpl
    def forge_functions(self) -> dict[str, type]:
        return {self.name: self.cls}


def function_plugin(function: object) -> tuple[str, FunctionPlugin | None]:
    """(the function's name, the plugin registering it or None) for what `forge.run` was handed:
    a registered function's name, or a function class."""
    if isinstance(function, str):
        if not function or "=" in function:
            raise ForgeError(f"function={function!r}: pass a function's name (see `forge ls`) or its class")
        return function, None
    if isinstance(function, type):
        plugin = FunctionPlugin(function)
        return plugin.name, plugin
    raise ForgeError(
        f"function={function!r}: pass a function's name (see `forge ls`) or its class, not a {type(function).__name__}"
    )
