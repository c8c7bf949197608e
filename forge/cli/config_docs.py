"""Write docs/configuration.md: every key of every config group, from its schema dataclass.

    python -m forge.cli.config_docs            # rewrite docs/configuration.md
    python -m forge.cli.config_docs --check    # exit 1 if it is stale

The sections are the core's schemas and those of the built-in functions and batching modes
(found through the built-in plugins, so that an installed third-party plugin changes nothing
here); `forge.config.docs` renders them. tests/test_docs.py fails when the file is stale.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from forge.config.docs import Section, render
from forge.config.modes import Batching
from forge.config.schema import CoreConfig, Devices, RayRuntime, Runtime
from forge.config.trackers import SETTINGS as TRACKER_SETTINGS
from forge.io.inputs import InputSpec

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
INTRO = """
Every key Forge reads, generated from the schema dataclasses that are the one home of each
default (`forge/config/`, `forge/io/inputs.py`, each function's `config_schema`, each batching
mode's). The YAML files under `conf/` extend these schemas and set only what differs; override
any key on the command line (`forge run batching.window=4096`). How the config is composed and
checked: [configuration-guide.md](configuration-guide.md).
"""


def sections() -> list[Section]:
    from forge.api import ModelFunctionConfig
    from forge.pluginmanager import batching_modes, functions, load_object, make_plugin_manager

    pm = make_plugin_manager(load_entry_points=False, modules=("forge.builtin.functions", "forge.builtin.batching"))
    out = [
        Section("Root keys (conf/config.yaml)", CoreConfig, skip=("batching", "devices", "runtime")),
        Section("devices", Devices, "devices."),
        Section("runtime=local", Runtime, "runtime."),
        Section("runtime=ray", RayRuntime, "runtime.", skip=_names(Runtime) - {"executor"}),
        Section("Every model function: model and input", ModelFunctionConfig, skip=("input",)),
        Section("input", InputSpec, "input."),
    ]
    for name, (ref, _) in functions(pm).items():
        schema = getattr(load_object(ref, f"function {name}"), "config_schema", None)
        if schema is not None:
            out.append(Section(f"function={name}", schema, skip=_names(ModelFunctionConfig), note=_sets(name)))
    for name, (factory, _) in batching_modes(pm).items():
        out.append(Section(f"batching={name}", getattr(factory, "config_schema", Batching), "batching."))
    for name, settings in TRACKER_SETTINGS.items():  # trackers=[...] picks any of them (docs/trackers.md)
        out.append(Section(f"trackers=[{name}]", settings, f"trackers.{name}."))
    return out


def _names(schema: type) -> set[str]:
    return {f.name for f in dataclasses.fields(schema)}


def _sets(function: str) -> str:
    """What the function's shipped YAML sets besides its name: its input, and what it changes."""
    import json

    import yaml

    from forge.cli.build import conf_dir

    data = yaml.safe_load((conf_dir() / "function" / f"{function}.yaml").read_text())
    values = _flat({k: v for k, v in data.items() if k not in ("defaults", "function")})
    shown = [f"`{k}={v if isinstance(v, str) else json.dumps(v)}`" for k, v in values.items()]
    return f"`conf/function/{function}.yaml` sets {', '.join(shown)}."


def _flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def text() -> str:
    return render(sections(), INTRO)


def main(argv: list[str]) -> int:
    fresh = text()
    if "--check" in argv:
        stale = not DOC.is_file() or DOC.read_text() != fresh
        print(f"{DOC}: {'stale; run python -m forge.cli.config_docs' if stale else 'up to date'}")
        return int(stale)
    DOC.write_text(fresh)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
