"""Rows after a cached prefix attend to one copy of its keys (forge.runtime.forward.shared_prefix): the
same numbers as attention over the keys concatenated per row, in chunks or not, with grouped
heads, and only where the rule says it pays (the whole-model checks are in test_fidelity)."""

from __future__ import annotations

import types

import pytest
import torch

from forge.runtime.forward import shared_prefix as sp

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def concatenated(q, k, v, k_p, v_p, mask, scale):
    """Attention over [prefix keys; row keys] copied to every row, as the cache path computes it."""
    B, H, S, _ = q.shape
    g = H // k.shape[1]
    keys = torch.cat([k_p.expand(B, -1, -1, -1), k], dim=2).repeat_interleave(g, dim=1)
    values = torch.cat([v_p.expand(B, -1, -1, -1), v], dim=2).repeat_interleave(g, dim=1)
    bias = torch.cat([torch.zeros(B, 1, S, k_p.shape[2]), mask], dim=-1)
    w = torch.softmax(q @ keys.transpose(-1, -2) * scale + bias, dim=-1)
    return (w @ values).transpose(1, 2)


def _call(q, k, v, mask, step, scaling=None, module=None, **extra):
    """The attention as transformers calls it, with `step` the pass's shared prefixes."""
    sp.SHARED.step = step
    try:
        return sp.attention(module or types.SimpleNamespace(layer_idx=0), q, k, v, mask, scaling=scaling, **extra)
    finally:
        sp.SHARED.step = None


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("chunk", [sp.CHUNK_SCORES, 1])  # 1: every row its own chunk
def test_equals_attention_over_concatenated_keys(heads, kv_heads, chunk, monkeypatch):
    monkeypatch.setattr(sp, "CHUNK_SCORES", chunk)
    torch.manual_seed(0)
    B, S, P, d = 5, 7, 11, 8
    q = torch.randn(B, heads, S, d)
    k, v = torch.randn(B, kv_heads, S, d), torch.randn(B, kv_heads, S, d)
    k_p, v_p = torch.randn(1, kv_heads, P, d), torch.randn(1, kv_heads, P, d)
    used = [7, 1, 4, 7, 2]
    mask = sp.row_masks(used, S, torch.float32, torch.device("cpu"))
    step = sp.one([(k_p, v_p)])
    got, weights = _call(q, k, v, mask, step, 0.3)
    want = concatenated(q, k, v, k_p, v_p, mask, 0.3)
    assert weights is None and step.calls == 1 and got.shape == (B, S, heads, d)
    for row, n in enumerate(used):  # padding queries are never read
        assert torch.allclose(got[row, :n], want[row, :n], atol=1e-5), row
    bool_mask = mask == 0  # a boolean mask (True: seen) gives the same
    again, _ = _call(q, k, v, bool_mask, sp.one([(k_p, v_p)]), 0.3)
    assert torch.allclose(again, got, atol=1e-6)
    # the decoder's layout of the same: the prefix stacked (here one of two), the rows that read it
    other = torch.randn(1, kv_heads, 3, d)
    layers, valid = sp.stack([[(other, other)], [(k_p, v_p)]])
    rows = torch.arange(B)
    stacked = sp.Step(layers, valid, rows, torch.ones(B, dtype=torch.long), rows, B)
    third, _ = _call(q, k, v, bool_mask, stacked, 0.3)
    assert torch.allclose(third, got, atol=1e-5)


def test_row_masks_are_causal_within_a_row_and_hide_its_padding():
    mask = sp.row_masks([3, 1], 3, torch.float32, torch.device("cpu"))
    seen = (mask == 0)[:, 0]
    assert seen[0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert seen[1].tolist() == [[True, False, False]] * 3  # padding queries see the real token only


def test_refuses_what_it_cannot_compute_exactly_and_is_sdpa_outside_its_passes():
    q = torch.randn(1, 2, 3, 4)
    kv = [(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4))]
    mask = sp.row_masks([3], 3, torch.float32, torch.device("cpu"))
    for extra in ({"softcap": 30.0}, {"sliding_window": 4}, {"s_aux": torch.zeros(2)}, {"dropout": 0.1}):
        with pytest.raises(sp.NotShareable):
            _call(q, q, q, mask, sp.one(kv), **extra)
    with pytest.raises(sp.NotShareable, match="layer_idx"):
        _call(q, q, q, mask, sp.one(kv), module=object())
    with pytest.raises(sp.NotShareable, match="head layout"):  # more key heads than the prefix holds
        _call(torch.randn(1, 4, 3, 4), torch.randn(1, 4, 3, 4), torch.randn(1, 4, 3, 4), None, sp.one(kv))
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = types.SimpleNamespace(layer_idx=0, is_causal=True)
    got, _ = _call(q, q, q, None, None, module=module)  # no step: sdpa itself
    want, _ = sdpa_attention_forward(module, q, q, q, None)
    assert torch.equal(got, want)


def test_it_is_taken_where_its_scores_are_smaller_than_the_copy_it_saves():
    kv = [(torch.zeros(1, 8, 100, 64), torch.zeros(1, 8, 100, 64))]  # 8 kv heads of 64: 512 values a key
    assert sp.worth_sharing(row_len=16, heads=32, key_values=kv)  # 512 scores a token
    assert not sp.worth_sharing(row_len=17, heads=32, key_values=kv)
    assert not sp.worth_sharing(row_len=16, heads=0, key_values=kv)  # heads unknown: not taken
    on_meta = [(torch.zeros(1, 8, 100, 64, device="meta"),) * 2]  # not a CPU: not measured there yet
    assert not sp.worth_sharing(row_len=16, heads=32, key_values=on_meta)


def test_a_transformers_without_the_interfaces_keeps_the_cache_path(monkeypatch):
    import sys

    monkeypatch.setattr(sp, "_registered", False)
    monkeypatch.setitem(sys.modules, "transformers.masking_utils", None)  # as on an older transformers
    assert sp.register() is False
    base = types.SimpleNamespace(config=types.SimpleNamespace(sub_configs={}))
    assert sp.forward(base, [], [1], input_ids=torch.zeros(1, 1, dtype=torch.long)) is None


class _Base(torch.nn.Module):
    """A stand-in base model: `forward` as given, on a config with an attention implementation."""

    def __init__(self, forward):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.config = types.SimpleNamespace(sub_configs={}, _attn_implementation="sdpa")
        self._forward = forward

    def forward(self, **kwargs):
        return self._forward(**kwargs)


def test_a_family_whose_layers_do_not_all_come_here_keeps_the_cache_path_and_a_bug_is_raised():
    kv = [(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))] * 2  # two layers
    ids = torch.zeros(1, 1, dtype=torch.long)
    seen = []

    def one_layer_comes(**kwargs):
        seen.append(kwargs["attention_mask"].shape)
        sp.SHARED.step.calls += 1  # one layer's attention of two came here
        return "out"

    base = _Base(one_layer_comes)
    assert sp.forward(base, kv, [1], input_ids=ids) is None and seen == [(1, 1, 1, 1)]
    assert base.config._attn_implementation == "sdpa" and sp.SHARED.step is None  # restored

    def every_layer_comes(**kwargs):
        assert base.config._attn_implementation == sp.NAME
        sp.SHARED.step.calls += 2
        return "out"

    base = _Base(every_layer_comes)
    assert sp.forward(base, kv, [1], input_ids=ids) == "out"

    def buggy(**kwargs):
        raise TypeError("unsupported operand type(s)")

    with pytest.raises(TypeError, match="unsupported operand"):
        sp.forward(_Base(buggy), kv, [1], input_ids=ids)
    assert sp.SHARED.step is None


def test_one_rule_keeps_it_off_attention_it_cannot_split():
    import transformers

    def model(cfg, attn="sdpa"):
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)

    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64)
    assert "sliding_window" in sp.eligible(model(transformers.MistralConfig(**small, sliding_window=8)))
    assert "softcapping" in sp.eligible(model(transformers.Gemma2Config(**small, head_dim=8), "eager"))
    assert sp.eligible(model(transformers.LlamaConfig(**small), "eager")) is None  # a forward switches per call
    eager = model(transformers.LlamaConfig(**small), "eager")
    assert "eager" in sp.install(eager)  # the decoder's: sdpa outside its passes, so not on an eager model
    assert eager.config._attn_implementation == "eager"
    plain = model(transformers.LlamaConfig(**small))
    assert sp.install(plain) is None and plain.config._attn_implementation == sp.NAME
