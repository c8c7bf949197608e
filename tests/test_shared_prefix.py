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
    prefix = sp.SharedPrefix([(k_p, v_p)])
    module = types.SimpleNamespace(layer_idx=0)
    got, weights = sp.shared_prefix_attention(module, q, k, v, mask, scaling=0.3, forge_prefix=prefix)
    want = concatenated(q, k, v, k_p, v_p, mask, 0.3)
    assert weights is None and prefix.calls == 1 and got.shape == (B, S, heads, d)
    for row, n in enumerate(used):  # padding queries are never read
        assert torch.allclose(got[row, :n], want[row, :n], atol=1e-5), row
    bool_mask = mask == 0  # a boolean mask (True: seen) gives the same
    again, _ = sp.shared_prefix_attention(
        module, q, k, v, bool_mask, scaling=0.3, forge_prefix=sp.SharedPrefix([(k_p, v_p)])
    )
    assert torch.allclose(again, got, atol=1e-6)


def test_row_masks_are_causal_within_a_row_and_hide_its_padding():
    mask = sp.row_masks([3, 1], 3, torch.float32, torch.device("cpu"))
    seen = (mask == 0)[:, 0]
    assert seen[0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert seen[1].tolist() == [[True, False, False]] * 3  # padding queries see the real token only


def test_refuses_what_it_cannot_compute_exactly():
    q = torch.randn(1, 2, 3, 4)
    kv = [(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4))]
    mask = sp.row_masks([3], 3, torch.float32, torch.device("cpu"))
    module = types.SimpleNamespace(layer_idx=0)
    for extra in ({"softcap": 30.0}, {"sliding_window": 4}, {"s_aux": torch.zeros(2)}, {"dropout": 0.1}):
        with pytest.raises(sp.NotShareable):
            sp.shared_prefix_attention(module, q, q, q, mask, forge_prefix=sp.SharedPrefix(kv), **extra)
    with pytest.raises(sp.NotShareable, match="no shared prefix"):
        sp.shared_prefix_attention(module, q, q, q, mask)
    with pytest.raises(sp.NotShareable, match="layer_idx"):
        sp.shared_prefix_attention(object(), q, q, q, mask, forge_prefix=sp.SharedPrefix(kv))


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


def test_a_forward_that_refuses_the_prefix_keyword_keeps_the_cache_path_and_a_bug_is_raised():
    kv = [(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))]
    ids = torch.zeros(1, 1, dtype=torch.long)

    def no_extra_kwargs(input_ids, attention_mask, use_cache):
        raise AssertionError("not reached")

    def refuses(**kwargs):
        return no_extra_kwargs(**kwargs)  # TypeError: an unexpected keyword argument 'forge_prefix'

    base = _Base(refuses)
    assert sp.forward(base, kv, [1], input_ids=ids) is None
    assert base.config._attn_implementation == "sdpa"  # restored

    def buggy(**kwargs):
        kwargs["forge_prefix"].layer(0)
        raise TypeError("unsupported operand type(s)")  # inside the attention, after it took the prefix

    with pytest.raises(TypeError, match="unsupported operand"):
        sp.forward(_Base(buggy), kv, [1], input_ids=ids)

    def buggy_early(**kwargs):
        raise TypeError("unsupported operand type(s)")  # before taking the prefix, not about the keyword

    with pytest.raises(TypeError, match="unsupported operand"):
        sp.forward(_Base(buggy_early), kv, [1], input_ids=ids)
