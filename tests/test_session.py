"""forge.run and forge.Session: the command line's composition and results, in this process, with
the models a session loaded kept across its calls (docs/python-api.md)."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import forge
from forge.errors import ForgeError
from forge.hookspecs import hookimpl
from forge.io.results import load

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ROOT = Path(__file__).resolve().parent.parent
LOCAL = ROOT / "examples" / "local-plugin"
ROWS = [
    {
        "id": i,
        "text": f"Statement {i} is {'true' if i % 3 else 'false'}.",
        "prefix": "Q: true?\n" * (i % 2),
        "label": i % 2,
    }
    for i in range(24)
]


def cli(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "forge.cli.app", "run", *args], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.slow
def test_forge_run_equals_the_command_line_run_of_the_same_rows_exactly(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    overrides = ["layers=[1,3]", "pooling=mean"]
    done = cli(f"input.path={path}", f"output_dir={tmp_path / 'cli'}", *overrides)
    assert done.returncode == 0, done.stderr
    want = load(tmp_path / "cli")
    got = forge.run("probe_gen", ROWS, overrides=overrides)
    assert got.ids == want.ids == [str(r["id"]) for r in ROWS]
    assert got.meta == want.meta == [r["label"] for r in ROWS]
    for name, values in want.columns.items():
        assert torch.equal(got.tensors[name], torch.from_numpy(values)), name
    assert got.table().equals(want.table())
    assert got.report["status"] == "finished" and got.report["balanced"]
    assert not Path(got.run_dir).exists()  # its session's folder went with it


@pytest.mark.slow
def test_a_session_loads_the_weights_once_and_a_cut_model_is_whole_again_for_the_next_call():
    """layers=[1] cuts the decoder to two layers; the next call reads layer 4 of the same model."""
    with forge.Session(["pooling=last"]) as session:
        first = session.run("probe_gen", ROWS, overrides=["layers=[1]"])
        second = session.run("probe_gen", ROWS, overrides=["layers=[4]"])
        assert session.models.loads == 1 and len(session.models) == 1
        assert second.report["phases"]["worker_load_s"] is not None
    fresh = forge.run("probe_gen", ROWS, overrides=["pooling=last", "layers=[1,4]"])
    assert torch.equal(first.tensors["layer_1"], fresh.tensors["layer_1"])
    assert torch.equal(second.tensors["layer_4"], fresh.tensors["layer_4"])
    assert session.closed and len(session.models) == 0


@pytest.mark.slow
def test_a_call_reusing_the_last_composition_equals_a_fresh_one_and_a_yaml_edit_composes_again(tmp_path):
    """The second call differs only in its rows and run directory: the session reuses the first
    call's composed config (forge/inproc/composer.py) with the call's own input.path and
    output_dir, and its results equal a fresh run's. A config_dir YAML edited between calls is
    read again."""
    conf = tmp_path / "conf" / "function"
    conf.mkdir(parents=True)
    (conf / "mine.yaml").write_text("# @package _global_\ndefaults:\n  - probe_gen\n  - _self_\npooling: last\n")
    with forge.Session(config_dir=tmp_path / "conf") as session:
        session.run("mine", ROWS[:6], overrides=["layers=[2]"])
        kept = next(iter(session._composer._kept))
        second = session.run("mine", ROWS[6:], overrides=["layers=[2]"], output_dir=tmp_path / "second")
        assert next(iter(session._composer._kept)) is kept  # served from the kept composition
        assert second.run_dir == str(tmp_path / "second") and second.ids == [str(r["id"]) for r in ROWS[6:]]
        (conf / "mine.yaml").write_text("# @package _global_\ndefaults:\n  - probe_gen\n  - _self_\npooling: mean\n")
        third = session.run("mine", ROWS[6:], overrides=["layers=[2]"])
        assert next(iter(session._composer._kept)) != kept
    fresh = forge.run("probe_gen", ROWS[6:], overrides=["layers=[2]", "pooling=last"])
    assert torch.equal(second.tensors["layer_2"], fresh.tensors["layer_2"])
    mean = forge.run("probe_gen", ROWS[6:], overrides=["layers=[2]", "pooling=mean"])
    assert torch.equal(third.tensors["layer_2"], mean.tensors["layer_2"])
    assert not torch.equal(third.tensors["layer_2"], second.tensors["layer_2"])


def test_session_function_is_the_last_runs_own_or_built_as_a_run_builds_it():
    """`Session.function` hands back the function a run with those overrides builds: the last
    run's own instance when its overrides match (nothing composed again), a fresh build else."""
    with forge.Session(["pooling=last"]) as session:
        before = session.function("probe_gen", overrides=["layers=[1]"])
        assert before.layers == [1] and before.pooling == "last"
        session.run("probe_gen", ROWS[:4], overrides=["layers=[1]"])
        ran = session.function("probe_gen", overrides=["layers=[1]"])
        assert ran is not before and ran is session.function("probe_gen", overrides=["layers=[1]"])
        other = session.function("probe_gen", overrides=["layers=[2]"])
        assert other is not ran and other.layers == [2]
        with pytest.raises(ForgeError, match="layers"):
            session.function("probe_gen", overrides=["layers=oops"])
    with pytest.raises(ForgeError, match="closed"):
        session.function("probe_gen")


@pytest.mark.slow
def test_a_bad_override_raises_the_line_the_command_line_prints():
    from typer.testing import CliRunner

    from forge.cli.app import app

    printed = CliRunner().invoke(app, ["run", "batching=nope"])
    assert printed.exit_code == 2
    with forge.Session() as session, pytest.raises(ForgeError) as raised:
        session.run("probe_gen", ROWS, overrides=["batching=nope"])
    assert " ".join(printed.output.split()) == f"error: {raised.value}"
    with pytest.raises(ForgeError, match="layers"):
        forge.run("probe_gen", ROWS, overrides=["layers=[1,99]"])


def test_rows_that_are_not_dicts_are_one_line_and_the_session_folder_goes_on_close():
    session = forge.Session()
    with pytest.raises(ForgeError, match=r"rows\[1\]: a str"):
        session.run("probe_gen", [{"text": "a"}, "b"])
    with pytest.raises(ForgeError, match="rows: a dict"):
        session.run("probe_gen", {"text": "a"})
    with pytest.raises(ForgeError, match="overrides: a list"):
        session.run("probe_gen", [{"text": "a"}], overrides="layers=[1]")
    # a repeated id is named by the rows' own positions (1 and "1" are one id), not the session's file
    with pytest.raises(ForgeError, match=r"^rows\[0\] and rows\[2\] have the same id '1'; .*input.duplicate_ids=first"):
        session.run("probe_gen", [{"id": 1, "text": "a"}, {"text": "b"}, {"id": "1", "text": "c"}])
    folder = Path(session._dir)
    assert folder.is_dir()
    session.close()
    assert not folder.exists()
    with pytest.raises(ForgeError, match="closed"):
        session.run("probe_gen", [{"text": "a"}])


class _CtrlC:
    """Ctrl-C as a terminal or a notebook's interrupt sends it, once the first batch is done."""

    def __init__(self) -> None:
        self.__name__ = "ctrl-c"
        self.sent = 0

    @hookimpl
    def forge_batch_completed(self, run, batch, device, stats):
        if not self.sent:
            self.sent += 1
            signal.raise_signal(signal.SIGINT)


@pytest.mark.slow
def test_ctrl_c_stops_the_call_cleanly_and_the_session_runs_on(tmp_path):
    from forge.pluginmanager import extra_plugins

    rows = ROWS * 1  # many small batches: the stop comes before the end
    with forge.Session(["batching=item", "batching.batch_size=2", "layers=[1]"]) as session:
        with extra_plugins(_CtrlC()), pytest.raises(KeyboardInterrupt, match="interrupted by SIGINT"):
            session.run("probe_gen", rows, output_dir=tmp_path / "stopped")
        report = json.loads((tmp_path / "stopped" / "report.json").read_text())
        assert report["status"] == "interrupted" and 0 < report["items"]["completed"] < len(rows)
        again = session.run("probe_gen", rows, output_dir=tmp_path / "stopped", overrides=["resume=true"])
        assert len(again) == len(rows) and session.models.loads == 1
    assert (tmp_path / "stopped" / "report.json").exists()  # a given output_dir stays


@pytest.mark.slow
def test_a_function_class_runs_with_its_schema_defaults_in_process_and_from_the_command_line(tmp_path, monkeypatch):
    """No YAML anywhere: the class's config_schema gives layer=2, in both routes."""
    monkeypatch.syspath_prepend(str(LOCAL))
    from last_norm import LastNorm

    rows = [{"id": "a", "text": "one two"}, {"id": "b", "text": "three four five"}]
    got = forge.run(LastNorm, rows)
    assert got.report["config"]["layer"] == 2 and got.ids == ["a", "b"]
    deeper = forge.run(LastNorm, rows, overrides=["layer=3"])
    assert not torch.equal(deeper.tensors["norm"], got.tensors["norm"])
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {**__import__("os").environ, "PYTHONPATH": str(LOCAL)}
    done = cli(
        "plugins=[last_norm]", "function=last_norm", f"input.path={path}", f"output_dir={tmp_path / 'o'}", env=env
    )
    assert done.returncode == 0, done.stderr
    assert torch.equal(torch.from_numpy(load(tmp_path / "o").columns["norm"]), got.tensors["norm"])


@pytest.mark.slow
def test_a_script_that_starts_worker_processes_unguarded_is_told_to_guard_it(tmp_path):
    """multiprocessing runs the calling script again in each worker: unguarded, the worker starts
    the run again and dies; the error says what to do instead of only that a worker died."""
    script = tmp_path / "unguarded.py"
    call = 'forge.run("probe_gen", [{"text": "a b"}], overrides=["runtime.executor=process", "layers=[1]"])'
    script.write_text(f"import forge\n{call}\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert f'if {script} starts Forge at its top level, put that under `if __name__ == "__main__":`' in done.stderr
    script.write_text(f'import forge\nif __name__ == "__main__":\n    print(len({call}))\n')
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.split() == ["1"], done.stderr


def test_a_class_without_a_name_is_told():
    class Nameless(forge.CausalLMFunction):
        pass

    with pytest.raises(ForgeError, match="no `name`"):
        forge.run(Nameless, [{"text": "a"}])


@pytest.mark.slow
def test_the_python_api_guide_runs_as_written():
    """docs/python-api.md's Python blocks, in order, in one namespace: what a notebook would run."""
    import re

    guide = (ROOT / "docs" / "python-api.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", guide, flags=re.S)
    assert len(blocks) >= 4
    namespace: dict = {"__name__": "python_api_guide"}
    for block in blocks:
        exec(compile(block, "docs/python-api.md", "exec"), namespace)  # noqa: S102  (the guide's own code)
    assert namespace["session"].closed


@pytest.mark.slow
def test_rows_handed_in_again_resume_the_run_from_another_session(tmp_path):
    """Rows a session writes to a folder of its own are the same input in a later session when their
    content is: resume=true finishes the run there; other rows are refused, naming what changed."""
    out, rows = tmp_path / "run", ROWS[:8]
    first = forge.run("probe_gen", rows, overrides=["layers=[1]"], output_dir=out)
    again = forge.run("probe_gen", iter(rows), overrides=["layers=[1]", "resume=true"], output_dir=out)
    assert again.ids == first.ids and torch.equal(again.tensors["layer_1"], first.tensors["layer_1"])
    with pytest.raises(ForgeError, match=r"resume refused: input\.bytes: "):
        forge.run("probe_gen", rows[:7], overrides=["layers=[1]", "resume=true"], output_dir=out)


def test_rows_with_an_input_override_are_refused_in_one_line():
    with forge.Session() as session:
        for given in ("input.dataset=/somewhere", "input.path=rows.jsonl"):
            with pytest.raises(ForgeError, match=f"rows and {given} both give the run's input"):
                session.run("probe_gen", [{"text": "a b"}], overrides=[given])


@pytest.mark.slow
def test_a_results_folder_and_the_skipped_rows_outlive_forge_runs_directory():
    """forge.run without output_dir removes its run directory before it returns: every results
    folder is read by then, and rows skipped as too long are in result.skipped, with a warning
    that points at the caller's line."""
    rows = [{"id": "a", "text": "a b c", "prefix": "Q: "}, {"id": "b", "text": "d e", "prefix": "Q: "}]
    got = forge.run("probe_gen", rows, overrides=["layers=[1]", "pooling=none"])
    assert not Path(got.run_dir).exists() and set(got.folders) == {"activations", "prefix_states"}
    assert len(got.folder("prefix_states")) == 1  # the one prefix's states
    long = [{"id": "long", "text": "word " * 600}, {"id": "ok", "text": "two words"}]
    with pytest.warns(UserWarning, match=r"1 item\(s\) were skipped \(result\.skipped\), the first 'long'") as said:
        cut = forge.run("probe_gen", long, overrides=["layers=[1]", "devices.limits.max_seq_len=256"])
    assert said[0].filename == __file__
    assert cut.ids == ["ok"] and [s["id"] for s in cut.skipped] == ["long"]
    assert "max_seq_len" in cut.skipped[0]["reason"]


def test_rows_handed_in_are_named_by_their_place_in_the_list():
    """A row's failure names it rows[i], not a line of the session's file of the rows; an empty list is
    'rows is empty', not the file's path."""
    with pytest.raises(ForgeError, match="^rows is empty; it needs at least one row"):
        forge.run("probe_gen", [])
    rows = [{"id": "a", "text": "hi there"}, {"id": 1.5, "text": "x"}, {"id": "c", "text": "bye now"}]
    with pytest.warns(UserWarning, match=r"the first 'rows\[1\]': rows\[1\]: 'id' must be a string or an integer"):
        got = forge.run("probe_gen", rows, overrides=["layers=[1]"])
    assert got.ids == ["a", "c"] and [f["id"] for f in got.failures] == ["rows[1]"]
    assert "forge-session" not in got.failures[0]["reason"]


def test_a_run_that_stops_raises_with_what_it_committed():
    """One bad row of two fills max_failure_share: the run stops (as `forge run` exits 2), and the
    error carries the good row's results and the failure."""
    with pytest.warns(UserWarning, match="1 item"), pytest.raises(ForgeError, match="^stopped: 1 of the last 2") as err:
        forge.run("probe_gen", [{"id": "x"}, {"id": "y", "text": "ok then"}], overrides=["layers=[1]"])
    got = err.value.result
    assert got.ids == ["y"] and [f["id"] for f in got.failures] == ["x"] and got.tensors["layer_1"].shape[0] == 1
