import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest


def pytest_configure(config):
    """Tests send Ctrl-C to the commands they start, as a terminal does. Where pytest itself runs
    with SIGINT ignored (a background job of a shell without job control), every child would
    inherit that and rightly leave SIGINT alone; so pytest takes Python's default handler, which
    exec resets to the default disposition in its children."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session", autouse=True)
def _forge_cache(tmp_path_factory):
    """Weights of the embedded model are made once per test session, in a temp cache."""
    os.environ.setdefault("FORGE_CACHE", str(tmp_path_factory.mktemp("forge-cache")))
    os.environ["HF_HUB_OFFLINE"] = "1"
    yield


@pytest.fixture
def pm():
    """A fresh plugin manager with the built-in plugins, as `forge` builds one."""
    from forge.pluginmanager import make_plugin_manager

    return make_plugin_manager()


# Small limits so that a few hundred embedded rows make many batches.
SMALL = [
    "devices=auto",
    "devices.limits.max_batch_tokens=2048",
    "devices.limits.max_seq_len=1024",
    "budget.tokens_per_step=2048",
]


def embedded_model_dir(path: Path) -> Path:
    """The embedded model (its weights made from its seed) and its tokenizer, copied into one
    directory at `path`, as a local Hugging Face model a reference `transformers` run loads."""
    import shutil

    from forge.functions.assets import embedded_model_source, materialize_model

    shutil.copytree(materialize_model(embedded_model_source()), path)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(embedded_model_source() / f, path / f)
    return path


def small_run(n: int, *extra: str) -> list[str]:
    """Overrides for a run of `n` embedded rows in many small batches (1,024 tokens a step, a
    window of 16 items, layers 1 and 4), plus `extra`: what the tests of faults, Ray, output
    URLs and the warm server run."""
    return [
        "devices=auto",
        "devices.limits.max_batch_tokens=1024",
        "devices.limits.max_seq_len=512",
        "budget.tokens_per_step=1024",
        "layers=[1,4]",
        f"input.limit={n}",
        "batching.window=16",
        *extra,
    ]


def compose(*overrides):
    from forge.cli.compose import compose as _compose

    return _compose(list(overrides))


def spec_for(*overrides, run_dir: Path | None = None):
    from forge.cli.build import build_spec

    return build_spec(compose(*overrides), run_dir)


def run_forge(tmp_path: Path, *overrides, pm=None):
    """A run, in this process unless the overrides pick an executor (tests of isolation do)."""
    if not any(o.startswith(("runtime.executor=", "runtime=")) for o in overrides):
        overrides = ("runtime.executor=inprocess", *overrides)
    from forge.driver.engine import execute
    from forge.pluginmanager import make_plugin_manager

    spec = spec_for(*overrides, run_dir=tmp_path)
    return execute(spec, pm or make_plugin_manager(modules=spec.plugins))


def plan_forge(*overrides, pm=None, keep_batches=False):
    from forge.driver.plan import plan
    from forge.pluginmanager import make_plugin_manager

    return plan(spec_for(*overrides), pm or make_plugin_manager(), keep_batches=keep_batches)


@pytest.fixture
def faults(tmp_path_factory, monkeypatch):
    """Set the fault plan of tests/faults.py for this test (worker processes and Ray actors
    inherit FORGE_FAULTS from the driver). Its markers live outside tmp_path, which tests use
    as a run directory (Forge refuses a non-empty directory that is not a run)."""
    folder = tmp_path_factory.mktemp("fault-markers")

    def set_plan(**plan):
        monkeypatch.setenv("FORGE_FAULTS", json.dumps({"dir": str(folder), **plan}))

    set_plan()
    return set_plan


def clean_activations(out: Path, *overrides, n: int) -> dict:
    """ids -> {layer: activation} of a clean in-process run: what every faulty run must equal."""
    from forge import load_activations

    report = run_forge(out, *overrides, "runtime.executor=inprocess")
    assert report["balanced"] and report["items"]["completed"] == n
    ids, _, layers = load_activations(out)
    return {i: {layer: layers[layer][k] for layer in layers} for k, i in enumerate(ids)}


def assert_same_output(run_dir: Path, clean: dict, atol: float) -> None:
    """Every id of `clean` committed exactly once, with the same activations."""
    import torch

    from forge import load_activations

    ids, _, layers = load_activations(run_dir)
    assert len(ids) == len(set(ids)) == len(clean), "every id once"
    assert set(ids) == set(clean)
    for layer, got in layers.items():
        want = torch.stack([clean[i][layer] for i in ids])
        assert torch.allclose(got, want, atol=atol, rtol=0), (layer, (got - want).abs().max())


def forge_process(*args, env=None, **kw) -> subprocess.Popen:
    """`forge run` in its own process group, as a user's terminal would start it (stdout and
    stderr together, on a pipe)."""
    return subprocess.Popen(
        [sys.executable, "-m", "forge.cli.app", "run", *args],
        cwd=Path(__file__).resolve().parent,
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        **kw,
    )


@pytest.fixture
def short_lease(monkeypatch):
    """An object-store lease of 0.9 s (settled in 0.02 s), so a test can outlive one."""
    import forge.io.lock

    monkeypatch.setattr(forge.io.lock, "LEASE_TTL_S", 0.9)
    monkeypatch.setattr(forge.io.lock, "LEASE_SETTLE_S", 0.02)


@pytest.fixture
def lease_url():
    """A run directory on fsspec's in-memory object store (no locks: a lease), removed after."""
    import uuid

    import fsspec

    path = f"/forge-lease-{uuid.uuid4().hex[:8]}"
    yield f"memory://{path}/run"
    fs = fsspec.filesystem("memory")
    if fs.exists(path):
        fs.rm(path, recursive=True)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models on a shared 2-core machine: one torch thread is much faster than two contending
    (a module's tests ask for it with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
