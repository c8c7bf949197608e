"""Batching never changes results: every mode equals a one-prompt-at-a-time forward pass."""

import json

import pytest
import torch

from conftest import SMALL, run_forge
from forge import load_activations

LAYERS = [0, 2, 4]
N = 150

MODES = {
    "item": ["batching=item", "batching.batch_size=16", "runtime.executor=process"],  # workers in processes
    "item-sorted": ["batching=item", "batching.order=length"],
    "token-rows-cache": ["batching=token"],
    "token-rows-nocache": ["batching=token", "batching.prefix_cache=false"],
    "token-packed": ["batching=token", "batching.packing=packed", "batching.packed_row_tokens=128"],
    "token-tiny-cache": ["batching=token", "batching.cache_tokens=100"],  # capacity misses
    "memory": ["batching=memory", "devices.cpu_memory_gb=0.03"],
}


@pytest.fixture(scope="module")
def reference():
    """ids -> {pooling: {layer: vector}} from plain one-prompt forward passes."""
    from transformers import AutoModelForCausalLM

    from forge.runtime.causal_lm import reference_pooled
    from forge.functions.assets import embedded_model_source, materialize_model
    from forge.functions.probe_gen import ProbeGen

    fn = ProbeGen(model={"name": "embedded:tiny-llama"}, input={"path": "embedded:statements", "limit": N},
                  layers=LAYERS)
    model = AutoModelForCausalLM.from_pretrained(materialize_model(embedded_model_source())).eval()
    ref = {}
    for item in fn.records():
        ref[item.id] = {p: reference_pooled(model, item.tokens, item.prefix_len, LAYERS, p) for p in ("last", "mean")}
    return ref


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("mode", list(MODES))
def test_activations_equal_one_prompt_forward(tmp_path, reference, mode, pooling):
    report = run_forge(tmp_path, *SMALL, *MODES[mode], f"input.limit={N}", f"pooling={pooling}",
                       f"layers=[{','.join(map(str, LAYERS))}]")
    assert report["balanced"], report["imbalance"]
    assert report["items"]["completed"] == N
    assert report["batches"] > 3  # really batched
    ids, labels, layers = load_activations(tmp_path)
    assert sorted(ids) == sorted(reference) and len(labels) == N
    assert set(layers) == set(LAYERS)
    for layer in LAYERS:
        want = torch.stack([reference[i][pooling][layer] for i in ids])
        got = layers[layer]
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=1e-4, rtol=0), (mode, pooling, layer, (got - want).abs().max())
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["balanced"] and saved["batching"] == MODES[mode][0].split("=")[1]


def test_ids_and_labels_follow_input_order(tmp_path):
    run_forge(tmp_path, *SMALL, "input.limit=40", "layers=[1]")
    ids, labels, layers = load_activations(tmp_path)
    rows = [json.loads(line) for line in open(_dataset())][:40]
    assert ids == [r["id"] for r in rows]
    assert labels == [r["label"] for r in rows]
    assert layers[1].shape == (40, 256)


def _dataset():
    from forge.functions.assets import embedded_dataset_path

    return embedded_dataset_path()
