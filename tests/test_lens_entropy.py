"""logit_lens and token_entropy equal an independent one-row-at-a-time `transformers` computation,
in every batching mode.

The reference shares nothing with Forge's runtime but the items' token ids (taken from the
function's own `records()`, the token rule's): each item's whole sequence (prefix + text) runs
alone through `AutoModelForCausalLM` with `output_hidden_states=True`; the logit lens at decoder
layer L is `lm_head(norm(h))` on that layer's output (`hidden_states[L + 1]`, or, for the last
layer, whose `hidden_states` entry is already normed, the layer's output caught by a forward
hook), and the entropy is that of the full float32 next-token distribution at each own token.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from forge.io.results import load  # noqa: E402
from forge.testing import MODES, SMALL_LIMITS, run_function  # noqa: E402

TOL = 1e-4
TOP_K = 5
LAYERS = [0, 1, 2, 3]  # every decoder layer of the embedded tiny Llama (the default, layers=[])


def _rows() -> list[dict]:
    """17 rows: 12 texts of 1..3 statements after one prefix (more than a step holds, so the group
    spans batches: cache hits), 3 after another (a small group, merged into tree rows) and 2 without one."""
    from forge.functions.assets import embedded_dataset_path

    rows = [json.loads(line) for line in open(embedded_dataset_path())]
    short, mid = sorted({r["prefix"] for r in rows if r.get("prefix")}, key=len)[:2]  # 24 and 58 tokens
    texts = [r["text"] for r in rows[:40]]
    out = [{"id": f"m{j}", "text": " ".join(texts[j : j + 1 + j % 3]), "prefix": mid} for j in range(12)]
    out += [{"id": f"s{j}", "text": " ".join(texts[20 + j : 21 + j + j % 3]), "prefix": short} for j in range(3)]
    return out + [{"id": "np0", "text": texts[30]}, {"id": "np1", "text": " ".join(texts[31:33])}]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def rows_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("lens") / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    return path


@pytest.fixture(scope="module")
def reference(rows_path):
    """{item id: (own token ids, {layer: logprobs [own, vocab]}, entropy [own])}, one item at a time."""
    from forge.api import InputSpec, ModelSpec
    from forge.functions.assets import embedded_model_source, materialize_model
    from forge.functions.logit_lens import LogitLens, LogitLensConfig

    fn = LogitLens(LogitLensConfig(model=ModelSpec(name="embedded:tiny-llama"), input=InputSpec(path=str(rows_path))))
    assert fn.layers == LAYERS  # layers=[]: every decoder layer
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(materialize_model(embedded_model_source())), dtype=torch.float32
    ).eval()
    n = model.config.num_hidden_layers
    caught: list[torch.Tensor] = []
    hook = model.model.layers[n - 1].register_forward_hook(
        lambda module, args, out: caught.append(out[0] if isinstance(out, tuple) else out)
    )
    refs = {}
    try:
        for item in fn.records():
            caught.clear()
            ids = torch.tensor([list(item.tokens)])
            with torch.no_grad():
                out = model(input_ids=ids, output_hidden_states=True)
                states = {L: (out.hidden_states[L + 1] if L < n - 1 else caught[0])[0] for L in LAYERS}
                normed = model.model.norm(states[n - 1])
                assert torch.allclose(normed, out.hidden_states[n][0], atol=1e-6)  # hidden_states[N]: after the norm
                lens = {L: torch.log_softmax(model.lm_head(model.model.norm(h)).float(), -1) for L, h in states.items()}
                logp = torch.log_softmax(out.logits[0].float(), -1)
            own = slice(item.prefix_len, None)
            entropy = -(logp.exp() * logp).sum(-1)
            refs[item.id] = (list(item.tokens)[own], {L: v[own] for L, v in lens.items()}, entropy[own])
    finally:
        hook.remove()
    assert len(refs) == len(_rows())
    return refs


def _check_lens(res, reference, mode: str, layers: list[int] = LAYERS, top_k: int = TOP_K) -> None:
    assert res.ids == [r["id"] for r in _rows()], mode
    assert set(res.columns) == {"token_ids", *(f"top_{w}_{L}" for L in layers for w in ("ids", "logprobs"))}
    for k, rid in enumerate(res.ids):
        tokens, lens, _ = reference[rid]
        assert res.columns["token_ids"][k].tolist() == tokens, (mode, rid)
        for L in layers:
            ids, logprobs = res.columns[f"top_ids_{L}"][k], res.columns[f"top_logprobs_{L}"][k]
            assert ids.dtype == np.int32 and logprobs.dtype == np.float32
            want = lens[L].topk(top_k + 1, dim=-1)
            values, indices = want.values.numpy(), want.indices.numpy()
            assert ids.shape == logprobs.shape == (len(tokens), top_k), (mode, rid, L)
            assert np.abs(logprobs - values[:, :top_k]).max() < TOL, (mode, rid, L)
            gap = -np.diff(values, axis=1)  # gap[:, j]: rank j over rank j + 1
            above = np.concatenate([np.ones((len(tokens), 1), bool), gap[:, :-1] > TOL], axis=1)
            apart = (gap > TOL) & above  # rank j's id is told apart from both neighbours
            assert (ids[apart] == indices[:, :top_k][apart]).all(), (mode, rid, L)
            assert apart.mean() > 0.5  # most ranks are told apart (the comparison compares something)
            # each id's log-probability is the reference's at that token
            at = np.take_along_axis(lens[L].numpy(), ids.astype(np.int64), axis=1)
            assert np.abs(at - logprobs).max() < TOL, (mode, rid, L)


def _check_entropy(res, reference, mode: str) -> None:
    assert res.ids == [r["id"] for r in _rows()], mode
    for k, rid in enumerate(res.ids):
        tokens, _, entropy = reference[rid]
        got = res.columns["entropy"][k]
        assert got.dtype == np.float32 and got.shape == (len(tokens),), (mode, rid)
        assert np.abs(got - entropy.numpy()).max() < TOL, (mode, rid)
        assert abs(res.columns["mean_entropy"][k] - float(entropy.double().mean())) < TOL, (mode, rid)


CHECKS = {"logit_lens": _check_lens, "token_entropy": _check_entropy}
# what each mode must have run for these rows (so that every layout is compared)
LAYOUTS = {
    "item": {"rows"},
    "token-cache": {"split-prefix rows", "cache-hit rows"},
    "token-nocache": {"rows"},
    "token-packed": {"split-prefix packed rows", "packed rows"},
    "memory": {"split-prefix rows", "cache-hit rows"},
    "token-merged": {"tree rows"},
}


def _run(function: str, rows_path, run_dir, options) -> dict:
    report = run_function(function, rows_path, run_dir, [*SMALL_LIMITS, *options])
    assert report["items"]["completed"] == len(_rows()) and report["items"]["failed"] == 0, report.get("failures")
    assert report["balanced"], report.get("imbalance")
    return report


@pytest.mark.parametrize("function", list(CHECKS))
def test_smoke_one_mode(function, rows_path, reference, tmp_path):
    """Token batches with the prefix cache: split-prefix rows (the prefix run once) and cache hits."""
    report = _run(function, rows_path, tmp_path, MODES["token-cache"])
    assert report["function"] == function and report["batching"] == "token"
    assert set(report["layouts"]) >= {"split-prefix rows", "cache-hit rows"}, report["layouts"]
    CHECKS[function](load(tmp_path), reference, "token-cache")


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("function", list(CHECKS))
def test_every_mode_equals_transformers_one_row_at_a_time(function, mode, rows_path, reference, tmp_path, monkeypatch):
    from forge.runtime.model.spec import HFModel

    loads = []
    real_load = HFModel.load
    monkeypatch.setattr(HFModel, "load", lambda self, *a, **k: loads.append(a) or real_load(self, *a, **k))
    report = _run(function, rows_path, tmp_path, MODES[mode])
    assert report["batching"] == MODES[mode][0].partition("=")[2], report["batching"]  # the mode that ran
    assert len(loads) == len(report["devices"]) == 1, loads  # the model loaded once per worker (the head is its own)
    assert set(report["layouts"]) >= LAYOUTS[mode], report["layouts"]
    CHECKS[function](load(tmp_path), reference, mode)


def test_one_layer_with_its_own_top_k(rows_path, reference, tmp_path):
    """layers=[1] top_k=3: the lens at layer 1 alone is the reference's, 3 tokens per position."""
    _run("logit_lens", rows_path, tmp_path, [*MODES["token-cache"], "layers=[1]", "top_k=3"])
    _check_lens(load(tmp_path), reference, "layers=[1]", layers=[1], top_k=3)


def test_layers_out_of_range_are_refused_before_work(rows_path):
    from forge.api import ForgeError, InputSpec, ModelSpec
    from forge.functions.logit_lens import LogitLens, LogitLensConfig

    config = LogitLensConfig(model=ModelSpec(name="embedded:tiny-llama"), input=InputSpec(path=str(rows_path)))
    with pytest.raises(ForgeError, match=r"hook point 'resid_post.4': the model has layers 0..3"):
        LogitLens(dataclasses.replace(config, layers=[1, 4]))
    fn = LogitLens(dataclasses.replace(config, layers=[-1, 1, 1]))  # a negative layer counts from the last
    assert fn.layers == [-1, 1] and [f.name for f in fn.fields][1:3] == ["top_ids_-1", "top_logprobs_-1"]
    assert fn.forward.capture == ("resid_post.-1", "resid_post.1") and fn.forward.head
    with pytest.raises(ForgeError, match=r"top_k=5000 is more than the model's 2048 tokens; give top_k <= 2048"):
        LogitLens(dataclasses.replace(config, top_k=5000))  # refused before work, not failed per item


def test_top_k_must_be_positive(rows_path, tmp_path):
    from forge.api import ForgeError

    with pytest.raises(ForgeError, match=r"top_k=0: must be a positive integer"):
        run_function("logit_lens", rows_path, tmp_path / "run", ["top_k=0"])


def test_head_without_forward_head_fails_loudly(rows_path, tmp_path, monkeypatch):
    """A function that calls view.head without Forward(head=True): every item fails, naming the fix."""
    from forge.api import Forward
    from forge.functions import logit_lens
    from forge.runtime.forward.views import ItemView

    view = ItemView("a", 0, [1, 2], 0, {}, {}, torch.zeros(0, dtype=torch.long), None, None)
    with pytest.raises(ValueError, match=r"view.head needs Forward\(head=True\)"):
        view.head(torch.zeros(2, 256))
    monkeypatch.setattr(logit_lens, "Forward", lambda capture, head: Forward(capture=capture))  # no head
    report = run_function("logit_lens", rows_path, tmp_path, [*SMALL_LIMITS, *MODES["token-cache"]])
    assert report["items"]["failed"] == len(_rows()) and report["items"]["completed"] == 0
    assert all("view.head needs Forward(head=True)" in f["reason"] for f in report["failures"]), report["failures"]
