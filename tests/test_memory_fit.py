"""The measured memory model: fitted on fake tensors, checked against the tracker's peaks."""

from __future__ import annotations

import json

import pytest

from forge.batching.cost import CostModel
from forge.runtime.cost import memory_fit
from forge.runtime.cost.memory_fit import DEFAULT_MARGIN, FIT_SHAPES, FakeModel, Shape, Target, fit, fitted_cost_model

# held out of the fit: rows x padded length x prefix (hit and miss)
SWEEP = (
    Shape(3, 48),
    Shape(12, 200),
    Shape(3, 200, 96),
    Shape(12, 48, 300, cached=False),
    Shape(6, 120, 40),
    Shape(1, 400, 600, cached=False),
)


def _configs():
    from transformers import AutoConfig, MistralConfig, Qwen2Config

    from forge.functions.assets import embedded_model_source

    return {
        "embedded-llama-float32": (AutoConfig.from_pretrained(embedded_model_source()), "float32"),
        "qwen2-bfloat16": (
            Qwen2Config(
                hidden_size=512,
                intermediate_size=1408,
                num_hidden_layers=3,
                num_attention_heads=8,
                num_key_value_heads=2,
                vocab_size=16000,
            ),
            "bfloat16",
        ),
        "mistral-bfloat16": (
            MistralConfig(
                hidden_size=512,
                intermediate_size=1792,
                num_hidden_layers=3,
                num_attention_heads=8,
                num_key_value_heads=2,
                vocab_size=16000,
                sliding_window=4096,
            ),
            "bfloat16",
        ),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_configs()))
def test_fit_tracks_measured_peak(name):
    config, dtype = _configs()[name]
    model = FakeModel(config, Target(dtype=dtype, attn="sdpa", hidden_kept=2, pooling="mean"))
    peaks = [model.peak(s) for s in FIT_SHAPES]
    raw = fit(FIT_SHAPES, peaks, model.weight_bytes, margin=0.0)
    planned = fit(FIT_SHAPES, peaks, model.weight_bytes)
    for shape in SWEEP:
        measured = model.peak(shape)
        args = (shape.rows, shape.padded_len, shape.prefix_len)
        assert abs(raw.step_bytes(*args) / measured - 1) <= 0.10, (shape, raw.step_bytes(*args), measured)
        assert raw.step_bytes(*args) >= measured * (1 - DEFAULT_MARGIN), shape
        assert planned.step_bytes(*args) >= measured, shape  # the margin covers the fit's error


def test_probe_gen_falls_back_to_shape_with_a_warning(monkeypatch):
    from forge.api import InputSpec, ModelSpec
    from forge.functions.probe_gen import ProbeGen, ProbeGenConfig

    fn = ProbeGen(
        ProbeGenConfig(
            model=ModelSpec(name="embedded:tiny-llama"), input=InputSpec(path="embedded:statements"), layers=[1, 4]
        )
    )

    def broken(*a, **k):
        raise RuntimeError("tracker exploded")

    monkeypatch.setattr(memory_fit, "fitted_cost_model", broken)
    cost = fn.cost_model()
    assert cost == fn.shape_cost_model()
    assert any("tracker exploded" in w for w in fn.warnings())


@pytest.mark.slow
def test_probe_gen_cost_model_is_measured_and_cached(monkeypatch):
    from forge.api import InputSpec, ModelSpec
    from forge.functions.probe_gen import ProbeGen, ProbeGenConfig

    def make():
        return ProbeGen(
            ProbeGenConfig(
                model=ModelSpec(name="embedded:tiny-llama"), input=InputSpec(path="embedded:statements"), layers=[4]
            )
        )

    fn = make()
    cost = fn.cost_model()
    kv = 4 * 2 * 4 * 64 * 4  # layers x (K, V) x kv heads x head dim x float32
    assert kv <= cost.kv_bytes_per_token < 2 * kv  # a row's cache, and GQA/attention transients over its keys
    assert cost.weight_bytes >= 4_200_000 * 4 and not fn.warnings()
    (path,) = memory_fit.cache_dir().glob(f"{memory_fit.config_hash(fn.config)}-float32-sdpa-h1-last-*.json")
    record = json.loads(path.read_text())
    assert len(record["sweep"]) == len(FIT_SHAPES) and record["target"]["dtype"] == "float32"

    def refuse(*a, **k):
        raise AssertionError("measured again despite the cached fit")

    monkeypatch.setattr(memory_fit, "FakeModel", refuse)
    assert make().cost_model() == cost
    with pytest.raises(AssertionError):  # another dtype is another fit
        fitted_cost_model(make().config, Target(dtype="bfloat16"))


def test_a_probe_of_early_layers_is_costed_on_the_layers_its_workers_keep(monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM

    from forge.api import InputSpec, ModelSpec
    from forge.batching.memory import MemoryPacker
    from forge.errors import ForgeError
    from forge.functions.probe_gen import ProbeGen, ProbeGenConfig
    from forge.runtime.forward.causal_lm import CausalLMRunner
    from forge.runtime.model.embedded import materialize_model
    from forge.vocab.geometry import Device, Limits

    def make(layers):
        return ProbeGen(
            ProbeGenConfig(
                model=ModelSpec(name="embedded:tiny-llama"), input=InputSpec(path="embedded:statements"), layers=layers
            )
        )

    early, whole = make([1]).cost_model(), make([4]).cost_model()  # 2 of the 4 layers run, and all 4
    with monkeypatch.context() as m:  # a later run knows the family's cut: no model is built for it
        m.setattr(memory_fit, "fake_model", lambda *a, **k: pytest.fail("built a model again"))
        assert make([1]).cost_model() == early
    model = AutoModelForCausalLM.from_pretrained(str(materialize_model(make([1]).hf.source)), dtype=torch.float32)
    full = memory_fit.state_bytes(model)
    runner = CausalLMRunner(model, layers=[1], stop_after_deepest=True, device="cpu")
    kept = memory_fit.state_bytes(model)  # what the worker moves to its device, once it has cut the decoder
    assert runner.layers_run == 2 and kept < full and runner.device.type == "cpu"
    assert kept <= early.weight_bytes < whole.weight_bytes and early.weight_bytes - kept == whole.weight_bytes - full
    assert early.kv_bytes_per_token < 0.6 * whole.kv_bytes_per_token  # half the layers hold a KV cache
    budget = whole.weight_bytes + 10**8  # one device: the kept layers leave more room, and each row holds less
    assert early.max_rows(budget, 16, prefix_len=512) > 1.2 * whole.max_rows(budget, 16, prefix_len=512)
    # a device too small for the whole model still probes its early layers
    small = Device(name="small", limits=Limits(8192, 64, 2048), memory_bytes=(kept + full) // 2)
    MemoryPacker(cost_model=early).check_device(small)
    with pytest.raises(ForgeError, match="raise its memory_gb"):
        MemoryPacker(cost_model=whole).check_device(small)


def test_max_rows_counts_the_prefix_once():
    cost = CostModel(
        weight_bytes=1000, bytes_per_token=10, bytes_per_score=0, kv_bytes_per_token=1, prefix_bytes_per_token=5
    )
    rows = cost.max_rows(10_000, 20, prefix_len=100)
    assert cost.step_bytes(rows, 20, 100) <= 10_000 < cost.step_bytes(rows + 1, 20, 100)


def test_memory_plan_reports_each_devices_largest_predicted_peak_within_its_budget():
    from conftest import plan_forge

    report = plan_forge(
        "devices=sim_16g_32g", "batching=memory", "batching.merge_groups=false", "input.limit=300", "layers=[1]"
    )
    assert report["status"] == "finished"
    peaks = {d["name"]: (d["predicted_peak_bytes"], d["memory_budget_bytes"]) for d in report["devices"]}
    assert set(peaks) == {"card16", "card32"}
    for peak, budget in peaks.values():
        assert 0 < peak <= budget
    assert peaks["card32"][0] > peaks["card16"][0]  # the larger card got larger batches


def test_cuda_budget_is_free_memory_times_the_fraction(monkeypatch):
    import torch

    from forge.config.devices import discover
    from forge.vocab.geometry import Limits

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: ((10 + i) << 30, 80 << 30))
    devices = discover(Limits(8192, 256, 2048), memory_fraction=0.5)
    assert [d.memory_bytes for d in devices] == [5 << 30, int(5.5 * (1 << 30))]
