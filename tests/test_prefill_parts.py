"""A block's prefill in parts (`forge.runtime.decoder.prefill.split`, `BlockPrefill`): the least work, and
the same keys, values and next-token logits as the block in one rectangle."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings, strategies as st

from forge.runtime.decoder.prefill import FORWARD_TOKENS, BlockPrefill, Prefill, split

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def work(rests: list[int], parts: list[list[int]], overhead: int = FORWARD_TOKENS) -> int:
    return sum(overhead + len(p) * max(rests[g] for g in p) for p in parts)


def runs(values: list[int]):
    """Every split of sorted `values` into contiguous runs."""
    for cuts in itertools.product([False, True], repeat=len(values) - 1):
        out, run = [], [values[0]]
        for v, cut in zip(values[1:], cuts):
            if cut:
                out.append(run)
                run = []
            run.append(v)
        yield out + [run]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 8).map(lambda x: x * x), min_size=1, max_size=60), st.integers(0, 64))
def test_split_covers_every_prompt_once_with_the_least_work(rests, overhead):
    parts = split(rests, overhead)
    assert sorted(g for p in parts for g in p) == list(range(len(rests)))
    bounds = [(min(rests[g] for g in p), max(rests[g] for g in p)) for p in parts]
    assert all(hi < lo for (_, hi), (lo, _) in zip(bounds, bounds[1:]))  # runs of the sorted values
    every = [[[g for g, r in enumerate(rests) if r in run] for run in split_] for split_ in runs(sorted(set(rests)))]
    assert work(rests, parts, overhead) == min(work(rests, candidate, overhead) for candidate in every)


def test_equal_rests_are_one_part_and_a_far_outlier_its_own():
    assert split([5] * 10) == [list(range(10))]
    parts = split([4] * 100 + [400])
    assert parts == [list(range(100)), [100]]


@pytest.fixture(scope="module")
def model():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=96, max_position_embeddings=256,
    )  # fmt: skip
    m = transformers.LlamaForCausalLM(config).double().eval()
    m.config._attn_implementation = "sdpa"
    return m


@pytest.mark.slow
def test_a_block_in_parts_gives_the_rectangles_kv_and_logits_with_less_work(model):
    """Prompts behind stored prefixes of different lengths, own lengths from 1 to 40 and a prompt
    with no prefix: each prompt's KV over its tokens and its next-token logits equal those of the
    block prefilled as one rectangle, and the parts compute fewer rows x columns."""
    g = torch.Generator().manual_seed(1)
    prefixes = {p: torch.randint(4, 96, (p,), generator=g).tolist() for p in (20, 27, 33)}
    stored = {}
    for p, ids in prefixes.items():
        fill = Prefill(model, [ids], 2, 0, [None])
        with torch.inference_mode():
            fill.run(10_000)
        stored[p] = [(k[None].clone(), v[None].clone()) for k, v in fill.kv(0)]
    prompts, kvs = [], []
    for k, own in enumerate([1, 2, 2, 3, 9, 9, 10, 11, 40, 40, 5, 7]):
        p = (20, 27, 33)[k % 3] if k != 11 else None
        tail = torch.randint(4, 96, (own,), generator=g).tolist()
        prompts.append((prefixes[p] if p else []) + tail)
        kvs.append(stored[p] if p else None)

    with torch.inference_mode():
        rect = Prefill(model, prompts, 2, 0, kvs)
        while not rect.finished:
            rect.run(64)  # chunked: at most 64 rows x columns a step
        block = BlockPrefill(model, prompts, 2, 0, kvs)
        while not block.finished:
            before = block.slots_run
            block.run(64)
            assert block.slots_run - before <= 64
    assert len(block.parts) > 1
    assert block.slots_run < len(prompts) * (rect.width - rect.p)
    own = sum(len(t) if kv is None else len(t) - kv[0][0].shape[2] for t, kv in zip(prompts, kvs))
    assert own <= block.tokens_run < int(rect.mask[:, rect.p :].sum())  # fewer prefix tokens recomputed
    assert rect.last_logits is not None
    for rows, part in block.parts:
        assert part.last_logits is not None
        for r, gi in enumerate(rows):
            torch.testing.assert_close(part.last_logits[r], rect.last_logits[gi], rtol=1e-10, atol=1e-10)
            for (k1, v1), (k2, v2) in zip(part.kv(r), rect.kv(gi)):
                torch.testing.assert_close(k1, k2, rtol=1e-10, atol=1e-10)
                torch.testing.assert_close(v1, v2, rtol=1e-10, atol=1e-10)
