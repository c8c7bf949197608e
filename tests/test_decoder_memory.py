"""The decoder's peak-memory cuts change no figure: the stacked prefixes' part in groups of bounded
scores equals it all at once, a stack adopts its prefixes as views, and the heap release answers on
glibc (forge.runtime.forward.shared_prefix, forge.runtime.decoder.heap)."""

from __future__ import annotations

import platform

import pytest
import torch

from forge.runtime.decoder.heap import release_free_heap
from forge.runtime.forward import shared_prefix


def _prefixes(groups: int, heads: int, length: int, dim: int):
    pk, pv = torch.randn(groups, heads, length, dim), torch.randn(groups, heads, length, dim)
    valid = torch.zeros(groups, 1, 1, length, dtype=torch.bool)
    for g in range(groups):
        valid[g, ..., : g + 3] = True
    return pk, pv, valid


def test_prefix_part_in_groups_equals_all_at_once(monkeypatch):
    torch.manual_seed(0)
    groups, heads, queries, length, dim = 5, 2, 6, 7, 4
    qg = torch.randn(groups, heads, queries, dim)
    pk, pv, valid = _prefixes(groups, heads, length, dim)
    whole = shared_prefix._prefix_part(qg, pk, pv, valid, 0.5)
    monkeypatch.setattr(shared_prefix, "PREFIX_SCORE_BYTES", heads * queries * length * 4 * 2)  # 2 a time
    parts = shared_prefix._prefix_part(qg, pk, pv, valid, 0.5)
    for a, b in zip(whole, parts):
        assert torch.equal(a, b)
    s = torch.matmul(qg, pk.transpose(-1, -2)) * 0.5  # the plain formula
    s = s.masked_fill(~valid, float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    assert torch.equal(whole[0], m) and torch.allclose(whole[1], p.sum(-1, keepdim=True))
    assert torch.allclose(whole[2], torch.matmul(p, pv), atol=1e-6)


def test_stacked_attention_in_groups_equals_all_at_once(monkeypatch):
    """The whole attention call over stacked prefixes, rows reading three of them: the same bits
    whether the prefixes' scores go in one matmul or one prefix at a time."""
    torch.manual_seed(1)
    rows, heads, kv_heads, s, n, dim = 5, 4, 2, 3, 6, 8
    q = torch.randn(rows, heads, s, dim)
    k, v = torch.randn(rows, kv_heads, n, dim), torch.randn(rows, kv_heads, n, dim)
    pk, pv, valid = _prefixes(3, kv_heads, 7, dim)
    at = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    step = lambda: shared_prefix.Step(  # noqa: E731
        [(pk, pv)], valid, at([0, 1, 2, 3, 4]), at([0, 2, 2, 1, 0]), at([0, 0, 1, 0, 1]), 2
    )
    module = type("Layer", (), {"layer_idx": 0})()

    def call():
        shared_prefix.SHARED.step = step()
        try:
            return shared_prefix.attention(module, q, k, v, None)[0]
        finally:
            shared_prefix.SHARED.step = None

    whole = call()
    monkeypatch.setattr(shared_prefix, "PREFIX_SCORE_BYTES", 1)  # one prefix a time
    assert torch.equal(call(), whole)


def test_stack_adopts_its_prefixes_as_views():
    kvs = [[(torch.randn(1, 2, n, 4), torch.randn(1, 2, n, 4)) for _ in range(3)] for n in (3, 5)]
    want = [[(k.clone(), v.clone()) for k, v in kv] for kv in kvs]
    calls = []
    layers, valid = shared_prefix.stack(kvs, adopt=True, each_layer=lambda: calls.append(1))
    assert len(calls) == 3  # once a layer
    for kv, ref in zip(kvs, want):
        for i, ((k, v), (rk, rv)) in enumerate(zip(kv, ref)):
            assert torch.equal(k, rk) and torch.equal(v, rv)
            assert k.untyped_storage().data_ptr() == layers[i][0].untyped_storage().data_ptr()
    assert valid[0, 0, 0].tolist() == [True] * 3 + [False] * 2


def test_release_free_heap_answers(monkeypatch):
    assert release_free_heap() is (platform.libc_ver()[0] == "glibc")  # malloc_trim: glibc's alone
    from forge.vocab import libc

    monkeypatch.setattr(libc, "_libc", lambda: object())  # a C library without malloc_trim: nothing done
    assert release_free_heap() is False


@pytest.mark.slow
def test_the_plans_bound_holds_over_what_a_generate_worker_grew(tmp_path):
    """`forge plan function=generate` prints what a worker holds at most (weights, the keys and
    values of its prefixes and longest sequences, its largest step); a run's worker, a process of
    its own, grows from its size once loaded by no more than that, and by more than a third of it
    (the bound says something)."""
    from conftest import plan_forge, run_forge

    args = ("function=generate", "max_new_tokens=64")
    bound = plan_forge(*args)["devices"][0]["planned_peak_bytes"]
    device = run_forge(tmp_path, *args, "runtime.executor=process")["devices"][0]
    grew = device["resident_peak_bytes"] - device["resident_ready_bytes"]
    assert bound / 3 < grew <= bound, (grew, bound)
