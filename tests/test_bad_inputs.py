"""Inputs that used to end in a traceback or a silent exit (issue 34): another user's Hydra
staging folder in a shared temp dir, a Parquet file with two columns of one name, and SIGTERM
in the first second of `forge run`."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from forge.cli.app import app
from forge.errors import ForgeError
from forge.io import location
from forge.io.inputs import read_rows
from forge.io.location import hydra_dir, staging_problem

TESTS = Path(__file__).resolve().parent
FORGE = Path(sys.executable).with_name("forge")  # the console script: forge.cli.entry:main
SMALL = [
    "devices=auto",
    "devices.limits.max_batch_tokens=1024",
    "devices.limits.max_seq_len=512",
    "budget.tokens_per_step=1024",
    "layers=[1]",
    "input.limit=8",
    "runtime.executor=inprocess",
]


# -- Hydra's staging folder: this user's, private ---------------------------------------------


def test_a_staging_folder_must_be_ours_a_folder_and_closed_to_others(tmp_path):
    uid = os.getuid()
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    assert staging_problem(mine, uid) is None
    assert staging_problem(mine, uid + 1) == f"is owned by uid {uid}, not {uid + 1}"  # someone else's
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    assert staging_problem(shared, uid) == "is writable by others (mode 0777)"
    (tmp_path / "file").write_text("x")
    assert staging_problem(tmp_path / "file", uid) == "is not a folder"
    (tmp_path / "link").symlink_to(mine)  # a link could be swapped for one to anywhere
    assert staging_problem(tmp_path / "link", uid) == "is not a folder"
    assert staging_problem(tmp_path / "missing", uid).startswith("cannot be read")


def test_the_staging_root_is_per_user_and_a_bad_one_is_passed_over_with_a_note(tmp_path, capsys):
    uid = os.getuid()
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    root = location._staging_root("", str(fresh), uid)
    assert root == str(fresh / f"forge-hydra-{uid}") and staging_problem(root, uid) is None
    assert (os.stat(root).st_mode & 0o777) == 0o700
    assert capsys.readouterr().err == ""

    loose = tmp_path / "loose"
    (loose / f"forge-hydra-{uid}").mkdir(parents=True)
    (loose / f"forge-hydra-{uid}").chmod(0o777)
    (loose / "forge-hydra").mkdir(mode=0o755)  # the old shared name: never used now
    root = location._staging_root("", str(loose), uid)
    assert (
        Path(root).parent == loose and Path(root).name.startswith("forge-hydra-") and staging_problem(root, uid) is None
    )
    assert root not in (str(loose / f"forge-hydra-{uid}"), str(loose / "forge-hydra"))
    note = capsys.readouterr().err
    assert note.count("\n") == 1 and f"{loose / f'forge-hydra-{uid}'} is writable by others (mode 0777)" in note

    foreign = tmp_path / "foreign"  # as another user's folder looks: owned by a uid that is not ours
    (foreign / f"forge-hydra-{uid + 1}").mkdir(parents=True, mode=0o700)
    root = location._staging_root("", str(foreign), uid + 1)
    assert root != str(foreign / f"forge-hydra-{uid + 1}") and f"is owned by uid {uid}, not {uid + 1}" in (
        capsys.readouterr().err
    )

    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    assert location._staging_root(str(runtime), str(fresh), uid) == str(runtime / "forge-hydra")
    runtime.chmod(0o777)  # an $XDG_RUNTIME_DIR others may write to is not used
    assert location._staging_root(str(runtime), str(fresh), uid) == str(fresh / f"forge-hydra-{uid}")


def test_hydra_dir_is_one_answer_per_output_dir_in_a_process():
    assert hydra_dir("outputs/a") == hydra_dir("outputs/a") != hydra_dir("outputs/b")
    assert Path(hydra_dir("outputs/a")).parent.name != "forge-hydra"  # never the one name all users share
    assert staging_problem(Path(hydra_dir("outputs/a")).parent, os.getuid()) is None


@pytest.mark.slow
def test_forge_run_with_another_users_staging_folders_in_the_temp_dir(tmp_path):
    """The temp dir holds the old shared `forge-hydra` (someone else's where chown is possible)
    and, in place of this user's folder, a file: the run stages elsewhere, finishes, and cleans up."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    shared = temp / "forge-hydra"
    shared.mkdir(mode=0o755)
    if os.getuid() == 0:
        os.chown(shared, 65534, 65534)
    (temp / f"forge-hydra-{os.getuid()}").write_text("not a folder")
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"} | {"TMPDIR": str(temp)}
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "forge.cli.app", "run", f"output_dir={out}", *SMALL],
        cwd=TESTS,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert f"{temp / f'forge-hydra-{os.getuid()}'} is not a folder" in proc.stderr
    assert (out / "run.json").exists() and (out / ".hydra" / "config.yaml").exists()
    staged = sorted(p.name for p in temp.glob("forge-hydra*"))
    assert staged == ["forge-hydra", f"forge-hydra-{os.getuid()}"]  # the fresh folder went at the end


# -- Parquet: two columns of one name ----------------------------------------------------------


def _parquet(path: Path, names: list[str], columns: list[list]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_arrays([pa.array(c) for c in columns], names=names), path)
    return path


def _probe_gen(path):
    from forge.api import InputSpec, ModelSpec
    from forge.functions.probe_gen import ProbeGen, ProbeGenConfig

    return ProbeGen(
        ProbeGenConfig(model=ModelSpec(name="embedded:tiny-llama"), input=InputSpec(path=str(path)), layers=[1])
    )


@pytest.mark.parametrize(
    "names,line",
    [
        (["id", "text", "id"], "its Parquet schema has 2 columns named 'id'; rename or drop one of them"),
        (["text", "note", "note", "note"], "its Parquet schema has 3 columns named 'note'; rename or drop all but one"),
        (["text", "text", "x", "x"], "2 columns named 'text' (and 'x' too); rename or drop one of them"),
    ],
)
def test_repeated_parquet_column_names_are_one_line_before_any_work(tmp_path, names, line):
    path = _parquet(tmp_path / "in.parquet", names, [["a", "b"]] * len(names))
    for read in (_probe_gen, lambda p: list(read_rows(p))):  # a function's input, and the rows alone
        with pytest.raises(ForgeError) as info:
            read(path)
        assert str(info.value).startswith(f"input.path={path}: ") and line in str(info.value)
        assert "\n" not in str(info.value)


@pytest.mark.slow
def test_forge_run_on_a_parquet_file_with_two_id_columns(tmp_path):
    path = _parquet(tmp_path / "in.parquet", ["id", "text", "id"], [["1", "2"], ["a", "b"], ["3", "4"]])
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["run", f"output_dir={out}", f"input.path={path}", *SMALL])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "KeyError" not in result.output
    assert f"error: input.path={path}: its Parquet schema has 2 columns named 'id'" in result.output
    assert not (out / "run.json").exists()


# -- SIGTERM from the first moment of the command -------------------------------------------


def _catches_sigterm(pid: int) -> bool:
    """Whether the process has a handler for SIGTERM yet (/proc: its caught-signals mask)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def _group(pgid: int) -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.getpgid(int(entry.name)) == pgid:
                found.append(entry.name)
        except OSError:
            continue
    return found


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
@pytest.mark.parametrize(
    "at,signum", [(0.0, signal.SIGTERM), (0.3, signal.SIGTERM), (0.8, signal.SIGTERM), (0.3, signal.SIGINT)]
)
def test_a_stop_signal_in_the_first_second_is_one_line_and_status_130(tmp_path, at, signum):
    """0.0: the moment the entry point's handler is in place (before it, only the interpreter
    and `import forge` have run: nothing of the command exists to stop or report)."""
    out = tmp_path / "run"
    env = dict(os.environ, XDG_RUNTIME_DIR=str(tmp_path))  # no warm server: the command runs here
    started = time.monotonic()
    proc = subprocess.Popen(
        [str(FORGE), "run", "function=probe_gen", "batching=token", f"output_dir={out}"],
        cwd=TESTS,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    while not _catches_sigterm(proc.pid):
        assert proc.poll() is None and time.monotonic() - started < 60
        time.sleep(0.002)
    time.sleep(max(0.0, started + at - time.monotonic()))
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)  # the pipes close: no process of the command holds them
    name = signal.Signals(signum).name
    assert proc.returncode == 130, err
    assert err.decode().strip().splitlines() == [
        f"interrupted during start-up, before any work, by {name}: nothing was committed; run the command "
        "again (with resume=true if output_dir already holds the run)"
    ]
    deadline = time.monotonic() + 5
    while _group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _group(proc.pid)  # the fork server went with it, not seconds later
    assert not (out / "run.json").exists()
