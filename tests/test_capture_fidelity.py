"""Capture at hook points, per token: probe_gen ``capture=[attn_out.0, mlp_out.1] pooling=none``
equals plain transformers forward hooks on the same modules (found by their names, independently
of Forge's lookup) for every own token, within 1e-4. Every family x every mode checks the pooled
captures in tests/test_fidelity.py (`test_fidelity_float32`); here, every token's value, in the
layouts that place tokens differently: rows of whole prompts, a cached split prefix, packed and
tree rows."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import test_fidelity as fidelity  # noqa: E402

from conftest import compose  # noqa: E402

data = fidelity.data  # its module fixture, shared
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py
_COMPOSED: dict[str, object] = {}


def _run(tmp_path, path, rows, mode):
    from forge.cli.build import build_spec
    from forge.driver.engine import execute
    from forge.pluginmanager import make_plugin_manager

    if mode not in _COMPOSED:
        _COMPOSED[mode] = compose(
            *fidelity.SMALL[:-1],
            *fidelity.MODES[mode],
            "model=hf",
            "model.name=DIR",
            f"input.path={rows}",
            "layers=[1]",
            f"capture=[{','.join(fidelity.CAPTURE)}]",
            "pooling=none",
            "prefix_states=none",
            "runtime.executor=inprocess",
        )
    cfg = copy.deepcopy(_COMPOSED[mode])
    cfg.model.name = str(path)
    return execute(build_spec(cfg, tmp_path), make_plugin_manager())


@pytest.mark.parametrize(
    "name,mode",
    [
        ("llama", "item"),
        ("llama", "token-cache"),
        pytest.param("opt", "token-packed", marks=pytest.mark.slow),
        pytest.param("gemma2", "token-merged", marks=pytest.mark.slow),
    ],
)
def test_every_tokens_capture_equals_plain_hooks(tmp_path, data, name, mode):  # noqa: F811
    from forge.io.results import load

    path, _ = fidelity.family(name, data)
    refs = fidelity.capture_reference(name, data)
    report = _run(tmp_path, path, data[1], mode)
    assert report["items"]["completed"] == len(refs) and report["items"]["failed"] == 0, report.get("failures")
    res = load(tmp_path, "activations")
    for k, rid in enumerate(res.ids):
        for point in fidelity.CAPTURE:
            got, want = torch.as_tensor(res.columns[point][k]).float(), refs[rid][point]
            assert got.shape == want.shape, (name, mode, rid, point, got.shape, want.shape)
            assert (got - want).abs().max().item() < fidelity.TOL, (name, mode, rid, point)
