"""Capture at hook points across the fidelity matrix: every family x every batching mode.

probe_gen with ``capture=[attn_out.0, mlp_out.1]`` and ``pooling=none`` keeps each item's own
tokens' values at those points; they must equal a plain one-prompt-at-a-time transformers
forward pass with forward hooks on the same modules (found here by their names in the model,
independently of Forge's own lookup), within 1e-4, in every mode the family runs exactly.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")


import test_fidelity as fidelity  # noqa: E402

from conftest import compose  # noqa: E402
from forge.errors import ForgeError  # noqa: E402

FAMILIES, MODES, REFUSED, TOL, family = (
    fidelity.FAMILIES,
    fidelity.MODES,
    fidelity.REFUSED,
    fidelity.TOL,
    fidelity.family,
)
data, _one_thread = fidelity.data, fidelity._one_thread  # its module fixtures, shared

POINTS = ("attn_out.0", "mlp_out.1")
ATTN = r"(self_attn|attn|attention|self_attention)"
MLP = r"(mlp|feed_forward|block_sparse_moe|fc2)"
_REFS: dict[str, dict] = {}


def _module(model, kind: str, layer: int):
    """The module a point names, by its path: <...>.(layers|h).<layer>.<block>."""
    block = ATTN if kind == "attn_out" else MLP
    pattern = re.compile(rf"(^|\.)(layers|h)\.{layer}\.{block}$")
    found = [m for n, m in model.named_modules() if pattern.search(n)]
    assert len(found) == 1, (kind, layer, [n for n, _ in model.named_modules() if pattern.search(n)])
    return found[0]


def reference(name: str, data) -> dict:  # noqa: F811
    """{item id: {point: [own tokens, hidden]}} from one-prompt forward passes with hooks."""
    if name not in _REFS:
        path, _ = family(name, data)
        from forge.api import InputSpec, ModelSpec
        from forge.functions.probe_gen import ProbeGen, ProbeGenConfig

        fn = ProbeGen(ProbeGenConfig(model=ModelSpec(name=str(path)), input=InputSpec(path=str(data[1])), layers=[1]))
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        seen: dict[str, torch.Tensor] = {}
        for point in POINTS:
            kind, _, layer = point.partition(".")
            hook = (lambda key: lambda m, a, out: seen.__setitem__(key, out[0] if isinstance(out, tuple) else out))(
                point
            )
            _module(model, kind, int(layer)).register_forward_hook(hook)
        refs = {}
        with torch.inference_mode():
            for item in fn.records():
                model(input_ids=torch.as_tensor(item.tokens, dtype=torch.long)[None], use_cache=False)
                per_token = {p: v.reshape(-1, v.shape[-1]) for p, v in seen.items()}  # OPT's MLP: [tokens, hidden]
                refs[item.id] = {p: per_token[p][item.prefix_len :].clone() for p in POINTS}
        _REFS[name] = refs
    return _REFS[name]


_COMPOSED: dict[str, object] = {}


def _run(tmp_path, path, rows, mode):
    from forge.cli.build import build_spec
    from forge.driver.engine import execute
    from forge.pluginmanager import make_plugin_manager

    if mode not in _COMPOSED:
        _COMPOSED[mode] = compose(
            "devices=auto",
            "devices.limits.max_batch_tokens=256",
            "devices.limits.max_seq_len=128",
            "budget.tokens_per_step=256",
            *MODES[mode],
            "model=hf",
            "model.name=DIR",
            f"input.path={rows}",
            "layers=[1]",
            f"capture=[{','.join(POINTS)}]",
            "pooling=none",
            "prefix_states=none",
            "runtime.executor=inprocess",
        )
    cfg = copy.deepcopy(_COMPOSED[mode])
    cfg.model.name = str(path)
    return execute(build_spec(cfg, tmp_path), make_plugin_manager())


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(FAMILIES))
def test_capture_equals_plain_hooks_in_every_family_and_mode(tmp_path, data, name, mode):  # noqa: F811
    from forge.io.results import load

    path, _ = family(name, data)
    if (name, mode) in REFUSED:
        with pytest.raises(ForgeError, match=REFUSED[name, mode]):
            _run(tmp_path, path, data[1], mode)
        return
    report = _run(tmp_path, path, data[1], mode)
    refs = reference(name, data)
    assert report["items"]["completed"] == len(refs) and report["items"]["failed"] == 0, report.get("failures")
    res = load(tmp_path, "activations")
    for k, rid in enumerate(res.ids):
        for point in POINTS:
            got = torch.as_tensor(res.columns[point][k]).float()
            want = refs[rid][point]
            assert got.shape == want.shape, (name, mode, rid, point, got.shape, want.shape)
            diff = (got - want).abs().max().item() if want.numel() else 0.0
            assert diff < TOL, (name, mode, rid, point, diff, report["path"])


def test_capture_on_the_embedded_model_in_two_layouts(tmp_path, data):  # noqa: F811
    """Fast: the llama family, rows of whole prompts and a cached split prefix."""
    path, _ = family("llama", data)
    refs = reference("llama", data)
    from forge.io.results import load

    for mode in ("item", "token-cache"):
        report = _run(tmp_path / mode, path, data[1], mode)
        assert report["items"]["failed"] == 0
        res = load(tmp_path / mode, "activations")
        for k, rid in enumerate(res.ids):
            got = torch.as_tensor(res.columns["mlp_out.1"][k]).float()
            assert (got - refs[rid]["mlp_out.1"]).abs().max().item() < TOL, (mode, rid)
