"""Hook points in item views, in every row layout: captures (an attention pattern too), logits
and the final head, equal to a plain one-prompt transformers forward pass with hooks.

A tiny Llama with eager attention runs the same items as rows of whole prompts, rows after a
split prefix (computed, then from the cache), packed rows and tree rows (prefix groups in the
row); each `ItemView` must give what the reference gives for the item's own tokens.
"""

from __future__ import annotations

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from forge.runtime.forward.causal_lm import CausalLMRunner  # noqa: E402
from forge.runtime.forward.request import Forward  # noqa: E402
from forge.runtime.forward.views import CausalViews  # noqa: E402
from forge.runtime.hooks.interventions import load_interventions  # noqa: E402
from forge.runtime.tokens.prompts import ItemMeta  # noqa: E402
from forge.vocab.geometry import Batch, Item  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py
TOL = 1e-4
VOCAB = 300
POINTS = ("attn_pattern.1", "resid_pre.1", "resid_post.2", "mlp_in.0", "attn_out.1")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        initializer_range=0.1,
        attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def _items(prefix_len: int, key: str, n: int = 5, first: int = 0) -> list[Item]:
    rng = random.Random(prefix_len * 7 + first)
    prefix = [rng.randrange(VOCAB) for _ in range(prefix_len)]
    out = []
    for j in range(n):
        tokens = prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
        start = max(prefix_len, 1)
        meta = ItemMeta(tuple(tokens[start:]), start - 1)
        out.append(Item(f"{key}-{j}", len(tokens), key if prefix_len else None, prefix_len, tokens, meta, first + j))
    return out


def _layouts(items: list[Item], other: list[Item]) -> dict[str, Batch]:
    P = items[0].prefix_len
    own = max(it.num_tokens - P for it in items)
    packed = [items[:3], items[3:]]
    width = max(sum(it.num_tokens - P for it in row) for row in packed)
    tree_rows = [items[:3] + other[:2], items[3:] + other[2:]]
    tree_width = max(
        sum(it.num_tokens - it.prefix_len for it in row) + sum({it.prefix_key: it.prefix_len for it in row}.values())
        for row in tree_rows
    )
    return {
        "rows": Batch([[it] for it in items], max(it.num_tokens for it in items) + 2),
        "split": Batch([[it] for it in items], own + 1, "a", P, split_prefix=True),
        "split (cache hit)": Batch([[it] for it in items], own + 1, "a", P, split_prefix=True),
        "packed": Batch(packed, width + 3, "a", P, split_prefix=True, packed=True),
        "tree": Batch(tree_rows, tree_width + 2, packed=True, tree=True),
    }


def _reference(model, item: Item, interventions=()):
    """{point: value} for the item's own tokens (an attention pattern: [heads, own, all]), and logits."""
    layers = model.model.layers
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        layers[1].self_attn.register_forward_hook(
            lambda m, a, o: seen.update({"attn_pattern.1": o[1], "attn_out.1": o[0]})
        ),
        layers[1].register_forward_pre_hook(lambda m, a: seen.update({"resid_pre.1": a[0]})),
        layers[0].mlp.register_forward_pre_hook(lambda m, a: seen.update({"mlp_in.0": a[0]})),
    ]
    for layer, vec, positions in interventions:  # add vec at resid_post.<layer> on those positions

        def steer(m, a, o, vec=vec, positions=positions):
            h = (o[0] if isinstance(o, tuple) else o).clone()
            h[0, positions] = h[0, positions] + vec
            return (h, *o[1:]) if isinstance(o, tuple) else h

        hooks.append(layers[layer].register_forward_hook(steer))
    hooks.append(
        layers[2].register_forward_hook(
            lambda m, a, o: seen.update({"resid_post.2": o[0] if isinstance(o, tuple) else o})
        )
    )
    try:
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([list(item.tokens)]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    P = item.prefix_len
    want = {p: (v[0][:, P:] if p.startswith("attn_pattern") else v[0, P:]) for p, v in seen.items()}
    return want, out.logits[0, P:].float()


@pytest.mark.parametrize("prefix_len", [pytest.param(0, marks=pytest.mark.slow), 7])
def test_captures_logits_and_head_in_every_layout(model, prefix_len):
    forward = Forward(capture=POINTS, logits="all", head=True)
    runner = CausalLMRunner(
        model, layers=[], cache_tokens=200, pad_token_id=0, allow_no_layers=True, captures=list(POINTS)
    )
    views = CausalViews(runner, forward)
    items, other = _items(prefix_len, "a"), _items(5, "b", n=4, first=100)
    refs = {it.id: _reference(model, it) for it in [*items, *other]}
    for name, batch in _layouts(items, other).items():
        if name == "tree" and not prefix_len:
            continue
        out = views.run(batch)
        for view, item in zip(out.views, batch.items):
            want, logits = refs[item.id]
            for point in POINTS:
                got = view.captured[point]
                assert got.shape == want[point].shape, (name, point, got.shape, want[point].shape)
                assert (got - want[point]).abs().max() < TOL, (name, point)
            assert (view.logits - logits).abs().max() < TOL, name
            final = view.head(view.captured["resid_post.2"])  # the final norm and head: the model's logits
            assert (final - logits).abs().max() < TOL, name


def test_logits_at_the_targets(model):
    views = CausalViews(
        CausalLMRunner(model, layers=[], pad_token_id=0, allow_no_layers=True), Forward(logits="targets")
    )
    items = _items(6, "a")
    out = views.run(_layouts(items, [])["split"])
    for view, item in zip(out.views, items):
        with torch.inference_mode():
            full = model(input_ids=torch.tensor([list(item.tokens)])).logits[0].float()
        start = item.meta.target_start
        want = full[start : start + len(item.meta.targets)]
        assert view.logits.shape == want.shape and (view.logits - want).abs().max() < TOL
        assert (view.logprobs - torch.log_softmax(want, -1).gather(1, view.targets[:, None])[:, 0]).abs().max() < TOL


@pytest.mark.slow
@pytest.mark.parametrize("span", ["text", "prefix", "all", "last", [0, 8]])
def test_an_intervention_is_the_same_in_every_layout(model, span):
    vec = torch.linspace(-1, 1, 32)
    ivs = load_interventions([{"at": "resid_post.0", "op": "add", "vector": vec.tolist(), "scale": 2.0, "span": span}])
    runner = CausalLMRunner(
        model,
        layers=[],
        cache_tokens=200,
        pad_token_id=0,
        allow_no_layers=True,
        captures=["resid_post.2"],
        interventions=ivs,
    )
    views = CausalViews(runner, Forward(capture=("resid_post.2",)))
    items, other = _items(7, "a"), _items(5, "b", n=4, first=100)
    for name, batch in _layouts(items, other).items():
        out = views.run(batch)
        moved = 0.0
        for view, item in zip(out.views, batch.items):
            n, P = item.num_tokens, item.prefix_len
            positions = (
                {
                    "text": list(range(P, n)),
                    "prefix": list(range(P)),
                    "all": list(range(n)),
                    "last": [n - 1] if n > P else [],
                }.get(span)
                if isinstance(span, str)
                else [p for p in span if p < n]
            )
            want, _ = _reference(model, item, [(0, 2.0 * vec, positions)])
            assert (view.captured["resid_post.2"] - want["resid_post.2"]).abs().max() < TOL, (name, span, item.id)
            plain, _ = _reference(model, item)
            moved += float((want["resid_post.2"] - plain["resid_post.2"]).abs().max())
        assert moved > 0.1, (name, span)  # the intervention changed what the items read


def test_an_attention_pattern_needs_eager_attention():
    from forge.errors import ForgeError
    from forge.runtime.hooks.points import check_points

    with pytest.raises(ForgeError, match="attn_implementation=eager"):
        check_points(["attn_pattern.0"], [], 2, "sdpa", "f")
    with pytest.raises(ForgeError, match="the model has layers 0..1"):
        check_points(["mlp_out.2"], [], 2, "eager", "f")
    with pytest.raises(ForgeError, match="read, not changed"):
        check_points([], load_interventions([{"at": "attn_pattern.0", "op": "zero"}]).items, 2, "eager", "f")


def test_a_module_outside_the_base_decoder_is_refused_before_work(model):
    """The LM head never runs in the base decoder's forward pass: capturing it is one line, not a
    KeyError per item; a module path inside the decoder passes."""
    from forge.errors import ForgeError
    from forge.runtime.hooks.points import check_points

    config = model.config
    with pytest.raises(ForgeError, match=r"hook point 'lm_head' is outside the base decoder 'model'") as err:
        check_points(["lm_head"], [], config.num_hidden_layers, "sdpa", "probe_gen", config)
    assert "\n" not in str(err.value)
    check_points(["model.norm", "model.layers.0.mlp"], [], config.num_hidden_layers, "sdpa", "probe_gen", config)
