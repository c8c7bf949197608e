"""The import map of the `forge` package: which module imports which, the cycles among them, and
the arrows that run back up the house's floors. Checked by tests/test_import_map.py; run it for
the whole picture:

    python tests/import_map.py            # floors, cycles, upward arrows, the largest modules

Every import counts: top-level, inside a function (a deferred import is still a dependency) or
under `if TYPE_CHECKING:` (a type names what it depends on as surely as a call). The floors, bottom first: a
module may import its own floor and any floor below; an import of a floor above is an upward
arrow. `forge/__init__.py` re-exports and is left out.
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: installed names of the repository's top-level folders
FOLDERS = {"forge": "forge", "functions": "forge.functions", "plugins": "forge.builtin"}

#: the floors, bottom first; a module belongs to the first floor one of whose prefixes it starts with
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("ground", ("forge.errors", "forge.vocab")),  # the shared vocabulary: imports nothing of Forge above
    ("config", ("forge.config",)),  # the schema and its checks
    ("packing", ("forge.batching", "forge.scheduling")),  # packers and their collaborators: no torch
    ("io", ("forge.io",)),  # input rows, the run directory, results
    ("models", ("forge.runtime",)),  # transformers models: forward passes, caches, memory
    ("functions", ("forge.function", "forge.api", "forge.functions", "forge.data")),  # what a run computes
    ("plugins", ("forge.hookspecs", "forge.pluginmanager", "forge.tracker", "forge.executors", "forge.builtin")),
    ("loop", ("forge.core",)),  # the scheduler and the run loop
    ("driver", ("forge.driver",)),  # a run or a plan from a RunSpec, and its report
    (
        "cli",
        ("forge.cli", "forge.testing", "forge.inproc", "forge.eval"),
    ),  # the edge: Hydra config in, typed objects out
]


#: the rooms of the models floor (`forge/runtime/`), one per concern, bottom first: a runtime module
#: imports its own room and the rooms before it, never one after (no module sits in the package itself)
RUNTIME_ROOMS = ("model", "tokens", "hooks", "forward", "cost", "placement", "decoder")


def room_of(module: str) -> int | None:
    """The index of `module`'s room in RUNTIME_ROOMS (None: not a runtime module, or in none)."""
    parts = module.split(".")
    if parts[:2] != ["forge", "runtime"] or len(parts) < 3:
        return None
    return RUNTIME_ROOMS.index(parts[2]) if parts[2] in RUNTIME_ROOMS else None


def runtime_rooms(edges: dict[str, set[str]]) -> tuple[list[str], list[tuple[str, str]]]:
    """(runtime modules in no room, (source, target) arrows from a room to a later one): both empty."""
    loose = sorted(m for m in edges if m.startswith("forge.runtime.") and m.count(".") >= 2 and room_of(m) is None)
    against = []
    for source, targets in sorted(edges.items()):
        a = room_of(source)
        for target in sorted(targets):
            b = room_of(target)
            if a is not None and b is not None and b > a:
                against.append((source, target))
    return loose, against


#: what a built-in function (a module of `functions/`) may import of Forge: the author API, as a
#: plugin's function does (and `forge` itself, left out of the map); its embedded assets are data
FUNCTION_IMPORTS = ("forge.api", "forge.errors", "forge.functions")
FUNCTION_EXEMPT = ("forge.functions.assets",)


def past_the_api(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(function module, a Forge module it imports past `forge.api`): none, so a built-in is
    written as a plugin's function is."""
    out = []
    for module, targets in sorted(edges.items()):
        if not module.startswith("forge.functions") or module.startswith(FUNCTION_EXEMPT):
            continue
        for target in sorted(targets):
            if not any(target == p or target.startswith(p + ".") for p in FUNCTION_IMPORTS):
                out.append((module, target))
    return out


def floor_of(module: str) -> int | None:
    for k, (_, prefixes) in enumerate(FLOORS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return k
    return None


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    found.pop("forge", None)
    return found


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The forge modules `module` imports (a package's name resolves to its __init__)."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


@functools.cache
def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    edges = {m: imports_of(m, p, known) for m, p in mods.items()}
    # `from forge.batching import x` names the package; when x is a module, the edge is to it
    return {
        m: {t for t in targets if not (t in _packages(known) and any(u.startswith(t + ".") for u in targets))}
        for m, targets in edges.items()
    }


def _packages(known: set[str]) -> set[str]:
    return {m for m in known if any(o.startswith(m + ".") for o in known)}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            node, it = work[-1]
            advanced = False
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                    advanced = True
                    break
                if nxt in on:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    arrows = []
    for source, targets in sorted(edges.items()):
        a = floor_of(source)
        for target in sorted(targets):
            b = floor_of(target)
            if a is not None and b is not None and b > a:
                arrows.append((source, target))
    return arrows


def unplaced(edges: dict[str, set[str]]) -> list[str]:
    return sorted(m for m in edges if floor_of(m) is None)


def main() -> None:
    edges = graph()
    print("floors, bottom first:", " < ".join(name for name, _ in FLOORS))
    for component in cycles(edges):
        print("cycle:", " <-> ".join(component))
    for source, target in upward(edges):
        print(f"upward: {source} ({FLOORS[floor_of(source)][0]}) -> {target} ({FLOORS[floor_of(target)][0]})")
    for module in unplaced(edges):
        print("on no floor:", module)
    loose, against = runtime_rooms(edges)
    print("runtime rooms, bottom first:", " < ".join(RUNTIME_ROOMS))
    for module in loose:
        print("runtime module in no room:", module)
    for source, target in against:
        print(f"runtime arrow to a later room: {source} -> {target}")
    sizes = sorted(((len(p.read_text().splitlines()), m) for m, p in modules().items()), reverse=True)[:5]
    print("largest:", ", ".join(f"{m} {n}" for n, m in sizes))


if __name__ == "__main__":
    sys.exit(main())
