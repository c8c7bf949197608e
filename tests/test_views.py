"""Item views are the same in every layout, and equal a plain one-prompt forward pass.

A tiny random Llama (float32, sdpa): each item's view (own tokens' hidden states at the kept
layers, the prefix's last state, its targets' log-probabilities) is compared with one forward
pass of the item alone (`transformers`, full logits) within 1e-4, with rows of whole sequences,
padded rows after a split-off prefix (prefix cache off and on: the second batch is a hit) and
packed rows.
"""

from __future__ import annotations

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from forge.runtime.forward.causal_lm import CausalLMRunner  # noqa: E402
from forge.runtime.forward.request import Forward  # noqa: E402
from forge.runtime.forward.views import CausalViews  # noqa: E402
from forge.runtime.tokens.prompts import ItemMeta  # noqa: E402
from forge.vocab.geometry import Batch, Item  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py
TOL = 1e-4
LAYERS = [0, 2, 3]
VOCAB = 300


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        initializer_range=0.1,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def _items(prefix_len: int, n: int = 6) -> list[Item]:
    rng = random.Random(prefix_len)
    prefix = [rng.randrange(VOCAB) for _ in range(prefix_len)]
    items = []
    for j in range(n):
        tokens = prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))]
        first = max(prefix_len, 1)
        meta = ItemMeta(tuple(tokens[first:]), first - 1, label=j % 2)
        items.append(Item(f"p{prefix_len}-{j}", len(tokens), "k" if prefix_len else None, prefix_len, tokens, meta, j))
    return items


def _reference(model, item: Item):
    ids = torch.tensor([list(item.tokens)])
    with torch.inference_mode():
        out = model(input_ids=ids, output_hidden_states=True)
    logp = torch.log_softmax(out.logits[0].float(), dim=-1)
    start = item.meta.target_start
    want = torch.stack([logp[start + k, t] for k, t in enumerate(item.meta.targets)])
    return {layer: out.hidden_states[layer][0] for layer in LAYERS}, want


def _layouts(items: list[Item]) -> dict[str, Batch]:
    P = items[0].prefix_len
    own = max(it.num_tokens - P for it in items)
    packed = [items[:3], items[3:]]
    width = max(sum(it.num_tokens - P for it in row) for row in packed)
    return {
        "rows": Batch([[it] for it in items], max(it.num_tokens for it in items) + 2),
        "split": Batch([[it] for it in items], own + 1, "k" if P else None, P, split_prefix=True),
        "packed": Batch(packed, width + 3, "k" if P else None, P, split_prefix=True, packed=True),
    }


@pytest.mark.slow
@pytest.mark.parametrize("prefix_len", [0, 9])
@pytest.mark.parametrize("cache_tokens", [0, 100], ids=["nocache", "cache"])
def test_a_view_is_the_same_in_every_layout(model, prefix_len, cache_tokens):
    views = CausalViews(
        CausalLMRunner(model, layers=LAYERS, cache_tokens=cache_tokens, pad_token_id=0), Forward(targets=True)
    )
    items = _items(prefix_len)
    refs = {it.id: _reference(model, it) for it in items}
    computed = 0
    for name, batch in [*_layouts(items).items(), ("split again", _layouts(items)["split"])]:
        out = views.run(batch)
        if batch.split_prefix and prefix_len:  # the first split batch computes the prefix; with a cache, only it
            hit = bool(cache_tokens and computed)
            assert out.cache_hit == hit and out.prefix_computed_tokens == (0 if hit else prefix_len), name
            computed += out.prefix_computed_tokens
        else:
            assert out.prefix_computed_tokens == 0 and not out.cache_hit
        for view, item in zip(out.views, batch.items):
            hidden, logprobs = refs[item.id]
            assert view.id == item.id and view.prefix_len == prefix_len and view.label == item.meta.label
            for layer in LAYERS:
                assert view.hidden[layer].shape == (item.num_tokens - prefix_len, 64)
                assert (view.hidden[layer] - hidden[layer][prefix_len:]).abs().max() < TOL, (name, layer)
                if prefix_len:
                    assert (view.prefix_state[layer] - hidden[layer][prefix_len - 1]).abs().max() < TOL, (name, layer)
                assert (view.last(layer) - hidden[layer][-1]).abs().max() < TOL
            assert view.logprobs.shape == logprobs.shape
            assert (view.logprobs - logprobs).abs().max() < TOL, name
            assert view.targets.tolist() == list(item.meta.targets)


def test_only_the_asked_layers_are_kept(model):
    views = CausalViews(CausalLMRunner(model, layers=[], pad_token_id=0, allow_no_layers=True), Forward(targets=True))
    out = views.run(_layouts(_items(5))["packed"])
    assert all(v.hidden == {} and v.logprobs is not None for v in out.views)
