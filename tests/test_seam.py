"""The function seam: generic result sinks and reader, functions and config directories offered
by plugins, and the installed layout (forge.functions, forge.builtin, forge.conf)."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from forge.errors import ForgeError
from forge.function import ResultColumns
from forge.hookspecs import hookimpl
from forge.io.results import Field, ResultSchema, load
from forge.io.sinks import open_sink
from forge.io.store import RunStore
from forge.pluginmanager import batching_modes, function_class, functions, make_plugin_manager
from forge.vocab.geometry import Batch, Item

ROOT = Path(__file__).resolve().parent.parent


def _batch(ids_and_index):
    return Batch(rows=[[Item(str(i), 3, index=k, meta=f"label-{i}")] for i, k in ids_and_index], padded_len=3)


# -- generic sinks and the reader -------------------------------------------------------


@pytest.mark.parametrize("fmt", ["parquet", "safetensors"])
def test_generic_sink_round_trip_in_input_order(tmp_path, fmt):
    schema = ResultSchema(
        fields=(Field("score", "float32"), Field("vec", "float32", (2,)), Field("n", "int64")),
        format=fmt,
        rows_per_shard=2,
        meta_key="labels",
        meta={"model": "m"},
    )
    store = RunStore(tmp_path, {"function": "t"})
    sink = open_sink(store, schema)
    # two batches committed out of input order; the second keeps only its item "b" (the other is a duplicate)
    sink.write(
        _batch([("c", 2), ("d", 3)]),
        ResultColumns(
            {"score": np.array([2.0, 3.0]), "n": np.array([20, 30]), "vec": np.array([[2, 2], [3, 3]], np.float32)}
        ),
        None,
    )
    sink.flush()
    sink.write(
        _batch([("a", 0), ("b", 1)]),
        ResultColumns(
            {"score": np.array([0.0, 1.0]), "n": np.array([0, 10]), "vec": np.array([[0, 0], [1, 1]], np.float32)}
        ),
        [False, True],
    )
    out = sink.close()
    store.close("finished")
    assert out["shards"] == 2 and out["rows"] == 3 and out["format"] == fmt
    res = load(tmp_path)
    assert res.ids == ["b", "c", "d"] and res.index.tolist() == [1, 2, 3]
    assert res.columns["score"].tolist() == [1.0, 2.0, 3.0] and res.columns["score"].dtype == np.float32
    assert res.columns["vec"].tolist() == [[1, 1], [2, 2], [3, 3]] and res.columns["n"].tolist() == [10, 20, 30]
    assert res.meta == ["label-b", "label-c", "label-d"] and res.info["model"] == "m"
    assert res.table().column("id").to_pylist() == ["b", "c", "d"]
    suffix = ".parquet" if fmt == "parquet" else ".safetensors"
    assert sorted(p.suffix for p in (tmp_path / "results").glob("shard-*")) == [suffix, suffix]


def test_parquet_sink_keeps_strings(tmp_path):
    schema = ResultSchema(fields=(Field("answer", "string"),))
    store = RunStore(tmp_path, {})
    sink = open_sink(store, schema)
    sink.write(_batch([("x", 0), ("y", 1)]), ResultColumns({"answer": ["yes", "no"]}), [False, True])
    sink.close()
    assert load(tmp_path).columns["answer"].tolist() == ["no"]


def test_sink_refuses_output_that_disagrees_with_its_schema(tmp_path):
    store = RunStore(tmp_path, {})
    sink = open_sink(store, ResultSchema(fields=(Field("vec", "float32", (4,)),)))
    with pytest.raises(ForgeError, match=r"'vec'.*shape \(2, 3\).*expected \(2, 4\)"):
        sink.write(_batch([("a", 0), ("b", 1)]), ResultColumns({"vec": np.zeros((2, 3), np.float32)}), None)
    with pytest.raises(ForgeError, match="'vec' missing from the worker's output"):
        sink.write(_batch([("a", 0), ("b", 1)]), ResultColumns({"other": np.zeros(2)}), None)
    with pytest.raises(ForgeError, match="tensors only"):
        ResultSchema(fields=(Field("s", "string"),), format="safetensors")
    with pytest.raises(ForgeError, match="'id'.*are Forge's own columns; rename them"):
        ResultSchema(fields=(Field("id", "int64"),))
    with pytest.raises(ForgeError, match=r"result fields \['a'\] are named twice"):
        ResultSchema(fields=(Field("a", "int64"), Field("a", "float32")))
    with pytest.raises(ForgeError, match="result field 'a': dtype 'float33' is not one numpy knows"):
        ResultSchema(fields=(Field("a", "float33"),))


def test_a_reduce_that_leaves_out_a_declared_field_says_which():
    from forge.runtime.forward.views import collect

    assert list(collect([{"a": 1, "b": 2}], ["a", "b"])) == ["a", "b"]
    with pytest.raises(ValueError, match="reduce returned no 'b', a field the function declares"):
        collect([{"a": 1, "b": 2}, {"a": 3}], ["a", "b"])


def test_a_reduce_that_returns_an_undeclared_value_says_which_instead_of_dropping_it():
    from forge.runtime.forward.views import collect

    with pytest.raises(ValueError, match="reduce returned 'c', which no field of the function declares"):
        collect([{"a": 1, "b": 2, "c": 3}], ["a", "b"])
    with pytest.raises(ValueError, match="reduce returned 'c'"):  # whichever item returns it
        collect([{"a": 1, "b": 2}, {"a": 3, "b": 4, "c": 5}], ["a", "b"])


def test_load_names_the_folders_when_a_run_has_several(tmp_path):
    store = RunStore(tmp_path, {})
    for folder in ("one", "two"):
        sink = open_sink(store, ResultSchema(fields=(Field("v", "int64"),), folder=folder))
        sink.write(_batch([("a", 0)]), ResultColumns({"v": np.array([1])}), None)
        sink.close()
    with pytest.raises(ForgeError, match="results in one, two"):
        load(tmp_path)
    assert load(tmp_path, "two").columns["v"].tolist() == [1]


# -- functions and modes offered by plugins ---------------------------------------------


class _Offers:
    """A plugin object offering what it is given."""

    def __init__(self, functions=None, modes=None, config=None):
        self._functions, self._modes, self._config = functions or {}, modes or {}, config

    @hookimpl
    def forge_functions(self):
        return self._functions

    @hookimpl
    def forge_batching_modes(self):
        return self._modes

    @hookimpl
    def forge_config_searchpath(self):
        return self._config


def test_builtin_function_registers_through_entry_points(pm):
    assert functions(pm)["probe_gen"] == ("forge.functions.probe_gen:ProbeGen", "functions")
    from forge.functions.probe_gen import ProbeGen

    assert function_class({"name": "probe_gen"}, pm) is ProbeGen  # no _target_: the registered class
    assert function_class({"_target_": "forge.functions.probe_gen.ProbeGen"}, pm) is ProbeGen
    with pytest.raises(ForgeError, match="function.name='x', but function._target_=.* is the function 'probe_gen'"):
        function_class({"name": "x", "_target_": "forge.functions.probe_gen.ProbeGen"}, pm)  # never ignored


def test_a_name_two_plugins_offer_is_an_error_naming_both():
    pm = make_plugin_manager(load_entry_points=False)
    pm.register(_Offers(functions={"f": "a:F"}, modes={"m": object}), name="first-plugin")
    pm.register(_Offers(functions={"f": "b:F"}, modes={"m": object}), name="second-plugin")
    for listing, what in ((functions, "function 'f'"), (batching_modes, "batching mode 'm'")):
        with pytest.raises(ForgeError, match=f"{what} is offered by two plugins, '.*-plugin' and '.*-plugin'") as exc:
            listing(pm)
        assert "first-plugin" in str(exc.value) and "second-plugin" in str(exc.value)


def test_unknown_function_name_lists_the_installed_ones(pm):
    with pytest.raises(ForgeError, match=r"function.name='nope'.*installed functions: .*probe_gen"):
        function_class({"name": "nope"}, pm)


def test_config_directory_offered_by_a_plugin_is_on_the_search_path(tmp_path, monkeypatch):
    """What `pip install` of a plugin package does: its config module joins Forge's search path,
    so its function composes with function=<name> and `forge ls` sees it."""
    import forge.pluginmanager
    from forge.cli.compose import compose, group_options

    (tmp_path / "function").mkdir()
    (tmp_path / "function" / "echo_fn.yaml").write_text("# @package _global_\nfunction:\n  name: echo_fn\n")
    (tmp_path / "batching").mkdir()
    (tmp_path / "batching" / "echo_mode.yaml").write_text("mode: item\nbatch_size: 3\n")
    real = forge.pluginmanager.make_plugin_manager

    def with_plugin(*args, **kwargs):
        pm = real(*args, **kwargs)
        pm.register(_Offers(config=f"file://{tmp_path}"), name="echo-plugin")
        return pm

    monkeypatch.setattr(forge.pluginmanager, "make_plugin_manager", with_plugin)
    assert "echo_fn" in group_options("function") and "probe_gen" in group_options("function")
    assert "echo_mode" in group_options("batching")
    cfg = compose(["function=echo_fn", "batching=echo_mode"])
    assert cfg.function.name == "echo_fn" and cfg.batching.batch_size == 3
    monkeypatch.setattr(forge.pluginmanager, "make_plugin_manager", real)
    assert "echo_fn" not in group_options("function")


# -- installed layout -------------------------------------------------------------------


@pytest.mark.slow
def test_the_editable_install_maps_the_subpackages_to_this_checkouts_folders(tmp_path):
    """setuptools' `package-dir` does the mapping (editable installs honour it), and importing
    forge changes no import machinery: no finder of Forge's own is left on sys.meta_path."""
    code = (
        "import sys; before = list(sys.meta_path); import forge; print(sys.meta_path == before); "
        "import forge.functions.probe_gen, forge.builtin.ledger, forge.conf, hydra_plugins.forge_searchpath as h; "
        "print(forge.functions.probe_gen.__file__); print(forge.builtin.ledger.__file__); "
        "print(forge.conf.__file__); print('functions' in sys.modules or 'plugins' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    lines = out.stdout.split()
    assert lines[0] == "True"  # `import forge` installs nothing
    assert lines[1:4] == [
        str(ROOT / "functions" / "probe_gen.py"),
        str(ROOT / "plugins" / "ledger.py"),
        str(ROOT / "conf" / "__init__.py"),
    ]
    assert lines[4] == "False"  # no generic top-level name imported
    assert not (ROOT / "forge" / "_layout.py").exists()


@pytest.mark.slow
def test_wheel_installs_everything_under_forge(tmp_path):
    """The wheel holds forge/functions (with its assets), forge/builtin, forge/conf (every
    YAML) and Forge's Hydra plugin, and no top-level functions/, plugins/ or conf/."""
    import importlib.util
    import shutil

    # the environment's setuptools when it has one (offline); else pip fetches the build backend
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    src = tmp_path / "src"  # a copy of what the build reads: no build/ left in the checkout, none reused
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("forge", "functions", "plugins", "conf", "hydra_plugins"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", str(tmp_path), str(src)],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("forge_tokens-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"forge", "hydra_plugins"}
    for path in (
        "forge/functions/probe_gen.py",
        "forge/functions/assets/statements.jsonl",
        "forge/functions/assets/tiny-llama/tokenizer.json",
        "forge/functions/assets/tiny-llama/config.json",
        "forge/builtin/ledger.py",
        "forge/builtin/functions.py",
        "forge/conf/config.yaml",
        "hydra_plugins/forge_searchpath/__init__.py",
    ):
        assert path in names, path
    for yaml in (ROOT / "conf").rglob("*.yaml"):
        assert f"forge/conf/{yaml.relative_to(ROOT / 'conf')}" in names, yaml
    for init in (ROOT / "forge").rglob("__init__.py"):  # every forge subpackage is listed in pyproject.toml
        assert f"forge/{init.relative_to(ROOT / 'forge')}" in names, init
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "forge.builtin.batching" in text and "forge.builtin.functions" in text and "plugins." not in text
    # installed from the wheel (not editable), the subpackages import from the installed forge/
    target = (tmp_path / "site").resolve()
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    code = (
        "import forge.functions.assets, forge.builtin.ledger, forge.conf; from forge.cli.build import conf_dir; "
        "print(forge.functions.assets.__file__); print(forge.builtin.ledger.__file__); print(conf_dir())"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path, env=env
    )
    assert [str(Path(p).resolve()) for p in out.stdout.split()] == [
        str(target / "forge" / "functions" / "assets" / "__init__.py"),
        str(target / "forge" / "builtin" / "ledger.py"),
        str(target / "forge" / "conf"),
    ]


def test_group_options_include_a_user_config_dir(tmp_path):
    from forge.cli.compose import group_options

    (tmp_path / "batching").mkdir()
    (tmp_path / "batching" / "mine.yaml").write_text("mode: item\n")
    assert {"item", "token", "memory", "mine"} <= set(group_options("batching", tmp_path))
    assert "mine" not in group_options("batching")


# -- the import map ---------------------------------------------------------------------

_INSTALLED_AS = {"forge": "forge", "functions": "forge.functions", "plugins": "forge.builtin"}
#: the floors below the public modules: what they import when imported, they never import
#: the CLI, the function-author API, the testing helpers, the functions or the built-in plugins
_LOWER = ("forge.core", "forge.io", "forge.config", "forge.runtime", "forge.batching", "forge.scheduling")
_LOWER += ("forge.executors",)
_UPPER = ("forge.cli", "forge.api", "forge.testing", "forge.functions", "forge.builtin")


def _import_map(lazy: bool = False) -> dict[str, set[str]]:
    """Module -> the package's modules it imports when it is imported (module level), or
    anywhere in it (`lazy`: imports inside functions too)."""
    import ast

    paths = {}
    for folder, package in _INSTALLED_AS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            paths[".".join([package, *parts[: -1 if parts[-1] == "__init__" else None]])] = path
    graph = {}
    for name, path in paths.items():
        found = set()
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for block in ast.walk(tree) if _is_type_checking(block) for n in ast.walk(block)}
        for node in (n for n in ast.walk(tree) if id(n) not in typing_only) if lazy else tree.body:
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        graph[name] = {m for m in found if m in paths and m != name}
    return graph


def _is_type_checking(node) -> bool:
    """An `if TYPE_CHECKING:` block: its imports are for type checkers, never run."""
    import ast

    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph (a path that comes back to its first module), or None."""
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return [*path, module, target]
            if target not in state and (found := visit(target, [*path, module])):
                return found
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module, [])):
            return found
    return None


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_import_map_has_no_cycles_and_no_arrows_back_up():
    graph = _import_map()
    assert {"forge.driver.engine", "forge.io.store", "forge.config.schema", "forge.cli.app"} <= set(graph)
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the check can fail
    upward = sorted(
        f"{m} -> {t}" for m, targets in graph.items() if _within(m, _LOWER) for t in targets if _within(t, _UPPER)
    )
    assert upward == []


def test_no_lower_floor_imports_upward_even_inside_a_function():
    """Imports inside functions too (type-checking-only blocks aside, which never run): no cycle,
    and no floor below the public modules reaches the CLI, forge.api, forge.testing, the
    functions or the built-in plugins (the runtime locates the embedded assets under functions/
    as data, without importing them)."""
    graph = _import_map(lazy=True)
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"
    upward = sorted(
        f"{m} -> {t}" for m, targets in graph.items() if _within(m, _LOWER) for t in targets if _within(t, _UPPER)
    )
    assert upward == []


def test_a_missing_results_folder_names_the_ones_the_run_has(tmp_path):
    from forge.io.results import read_info

    (tmp_path / "embeddings").mkdir()
    (tmp_path / "embeddings" / "meta.json").write_text("{}")
    with pytest.raises(ForgeError, match="no activations/meta.json; this run's results are in embeddings/"):
        read_info(tmp_path, "activations")
    with pytest.raises(ForgeError, match="is this a Forge run directory"):
        read_info(tmp_path / "embeddings", "activations")
