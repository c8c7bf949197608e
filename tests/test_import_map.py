"""The house's shape, measured by tests/import_map.py: no import cycle, at most three arrows that
run back up its floors, every module on a floor, and the size budgets (benchmarks included)."""

import ast
from pathlib import Path

import import_map

ROOT = Path(__file__).resolve().parent.parent
MAX_UPWARD = 3
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 80


def test_no_import_cycle():
    assert import_map.cycles(import_map.graph()) == []


def test_at_most_three_arrows_run_back_up():
    arrows = import_map.upward(import_map.graph())
    assert len(arrows) <= MAX_UPWARD, arrows


def test_every_module_stands_on_a_floor():
    assert import_map.unplaced(import_map.graph()) == []


def test_the_built_in_functions_import_forge_api_alone():
    assert import_map.past_the_api(import_map.graph()) == []
    made_up = {
        "forge.functions.x": {"forge.api", "forge.runtime.decoder.engine"},
        "forge.functions.assets.y": {"forge.runtime"},
    }
    assert import_map.past_the_api(made_up) == [("forge.functions.x", "forge.runtime.decoder.engine")]


def test_the_runtime_rooms_import_one_way_and_hold_every_runtime_module():
    """`forge/runtime/` is one subpackage per concern; each imports only itself and the rooms before it."""
    assert import_map.runtime_rooms(import_map.graph()) == ([], [])
    made_up = {
        "forge.runtime.model.spec": {"forge.runtime.forward.views"},
        "forge.runtime.stray": set(),
        "forge.runtime.decoder.engine": {"forge.runtime.model.hf_compat"},
    }
    assert import_map.runtime_rooms(made_up) == (
        ["forge.runtime.stray"],
        [("forge.runtime.model.spec", "forge.runtime.forward.views")],
    )


def test_generate_is_at_most_150_code_lines():
    from linecount import code_lines

    assert code_lines(ROOT / "functions" / "generate.py") <= 150


def test_the_map_sees_a_cycle_and_an_upward_arrow():
    """The checks above can fail: a made-up graph with both is caught."""
    edges = {"forge.errors": {"forge.cli.app"}, "forge.cli.app": {"forge.errors"}}
    assert import_map.cycles(edges) == [["forge.cli.app", "forge.errors"]]
    assert import_map.upward(edges) == [("forge.errors", "forge.cli.app")]


def test_no_module_over_400_lines_or_function_over_80_benchmarks_included():
    over = []
    for folder in ("forge", "functions", "plugins", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            name, source = str(path.relative_to(ROOT)), path.read_text()
            if len(source.splitlines()) > MAX_MODULE_LINES:
                over.append(name)
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                        over.append(f"{name}:{node.name}")
    assert over == [], f"over the budget of {MAX_MODULE_LINES} lines a module, {MAX_FUNCTION_LINES} a function"
