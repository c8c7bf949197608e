"""CausalLMRunner equals a plain one-prompt-at-a-time forward pass, in every layout.

A tiny random Llama (float32, sdpa) is built in the test; every pooled vector is compared
with `reference_pooled` (one row, no padding, no cache) within 1e-4.
"""

from __future__ import annotations

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from forge.runtime.forward.causal_lm import CausalLMRunner  # noqa: E402
from forge.runtime.forward.prefix_cache import PrefixCache, PrefixEntry  # noqa: E402
from forge.runtime.forward.reference import reference_pooled  # noqa: E402
from forge.vocab.geometry import Batch, Item  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py
TOL = 1e-4
NUM_LAYERS = 3
LAYERS = [0, 1, NUM_LAYERS]
VOCAB = 300
PREFIX_LENS = {"p5": 5, "p17": 17, "p40": 40}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        initializer_range=0.1,  # larger than default so layer-0/1 states are far above TOL
        attn_implementation="sdpa",
    )
    m = transformers.LlamaForCausalLM(cfg).eval()
    assert m.config._attn_implementation == "sdpa"
    return m


def _make_items():
    rng = random.Random(1)
    items = {}
    for key, plen in PREFIX_LENS.items():
        prefix = [rng.randrange(VOCAB) for _ in range(plen)]
        group = []
        for j in range(7):
            suffix = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
            toks = prefix + suffix
            group.append(Item(id=f"{key}-{j}", num_tokens=len(toks), prefix_key=key, prefix_len=plen, tokens=toks))
        items[key] = group
    items[None] = [
        Item(id=f"np-{j}", num_tokens=n, tokens=[rng.randrange(VOCAB) for _ in range(n)])
        for j, n in enumerate(rng.randint(1, 30) for _ in range(7))
    ]
    return items


ITEMS = _make_items()


@pytest.fixture(scope="module")
def refs(model):
    out = {}
    for group in ITEMS.values():
        for it in group:
            for pooling in ("last", "mean"):
                out[it.id, pooling] = reference_pooled(model, it.tokens, it.prefix_len, LAYERS, pooling)
    return out


def _check(out, batch, refs, pooling) -> float:
    worst = 0.0
    items = batch.items
    for layer in LAYERS:
        got = out.pooled[layer]
        assert got.dtype == torch.float32 and got.device.type == "cpu"
        assert got.shape == (len(items), 64)
        want = torch.stack([refs[it.id, pooling][layer] for it in items])
        assert torch.isfinite(got).all()
        diff = (got - want).abs().max().item()
        assert diff < TOL, f"layer {layer} {pooling}: max abs diff {diff}"
        worst = max(worst, diff)
    return worst


def _pad(n: int, m: int = 8) -> int:
    return -(-n // m) * m


def batch_a(items):
    return Batch(rows=[[it] for it in items], padded_len=_pad(max(it.num_tokens for it in items)))


def batch_b(items, key):
    P = PREFIX_LENS.get(key, 0)
    return Batch(
        rows=[[it] for it in items],
        padded_len=max(it.num_tokens - P for it in items) + 3,
        prefix_key=key,
        prefix_len=P,
        split_prefix=True,
    )


def batch_c(items, key, row_cap=40):
    P = PREFIX_LENS.get(key, 0)
    rows, cur, used = [], [], 0
    for it in items:
        m = it.num_tokens - P
        if cur and used + m > row_cap:
            rows.append(cur)
            cur, used = [], 0
        cur.append(it)
        used += m
    rows.append(cur)
    width = max(sum(it.num_tokens - P for it in row) for row in rows)
    return Batch(rows=rows, padded_len=width + 5, prefix_key=key, prefix_len=P, split_prefix=True, packed=True)


@pytest.mark.slow
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_layout_a_row_per_sequence(model, refs, pooling):
    runner = CausalLMRunner(model, layers=LAYERS, pooling=pooling)
    assert runner.causal
    everything = [it for group in ITEMS.values() for it in group]  # mixed prefixes, padded rows
    out = runner.run(batch_a(everything))
    _check(out, batch_a(everything), refs, pooling)
    assert out.prefix_computed_tokens == 0 and out.cache_hit is False


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("cache_tokens", [0, 1000], ids=["nocache", "cache"])
def test_split_prefix_layouts(model, refs, pooling, packed, cache_tokens):
    runner = CausalLMRunner(model, layers=LAYERS, pooling=pooling, cache_tokens=cache_tokens)
    make = batch_c if packed else batch_b
    for key, group in ITEMS.items():
        P = PREFIX_LENS.get(key, 0)
        first = make(group[:4], key)
        out = runner.run(first)
        _check(out, first, refs, pooling)
        assert out.cache_hit is False and out.prefix_computed_tokens == P
        second = make(group[2:][::-1], key)  # other items, other order, other batch size
        out = runner.run(second)
        _check(out, second, refs, pooling)
        if cache_tokens and P:
            assert out.cache_hit is True and out.prefix_computed_tokens == 0
        else:
            assert out.cache_hit is False and out.prefix_computed_tokens == P
    if cache_tokens:
        assert runner.cache.hits == 3 and runner.cache.misses == 3 and runner.cache.evictions == 0
        assert runner.cache.tokens == sum(PREFIX_LENS.values())


@pytest.mark.slow
def test_packed_rows_without_split_prefix(model, refs):
    """Whole sequences (mixed prefixes) end to end in rows; mean skips each item's own prefix."""
    items = [ITEMS[k][j] for j in range(3) for k in ITEMS]
    rows = [items[i : i + 3] for i in range(0, len(items), 3)]
    width = max(sum(it.num_tokens for it in row) for row in rows)
    b = Batch(rows=rows, padded_len=width + 2, packed=True)
    for pooling in ("last", "mean"):
        runner = CausalLMRunner(model, layers=[0, 1, -1], pooling=pooling)
        out = runner.run(b)
        out.pooled[NUM_LAYERS] = out.pooled.pop(-1)
        _check(out, b, refs, pooling)


def test_packed_rows_really_hold_several_items():
    b = batch_c(ITEMS["p5"], "p5")
    assert any(len(row) > 1 for row in b.rows)
    assert b.padded_len >= max(sum(it.num_tokens - 5 for it in row) for row in b.rows)


def test_cache_entry_not_mutated_by_use(model, refs):
    runner = CausalLMRunner(model, layers=LAYERS, pooling="last", cache_tokens=100)
    group = ITEMS["p17"]
    results = []
    snapshot = None
    for size, packed in [(1, False), (4, False), (2, True), (7, True)]:
        b = (batch_c if packed else batch_b)(group[:size], "p17")
        out = runner.run(b)
        _check(out, b, refs, "last")
        results.append(out.cache_hit)
        entry = runner.cache.peek((None, "p17"))  # (no steering tag, the items' prefix key)
        if snapshot is None:
            snapshot = [(k.clone(), v.clone()) for k, v in entry.key_values]
        assert entry.length == 17
        for (k, v), (k0, v0) in zip(entry.key_values, snapshot):
            assert k.shape[0] == 1 and k.shape[-2] == 17
            assert torch.equal(k, k0) and torch.equal(v, v0)
    assert results == [False, True, True, True]


def test_lru_eviction_through_runner(model, refs):
    runner = CausalLMRunner(model, layers=LAYERS, pooling="mean", cache_tokens=50)  # 40 + 17 > 50
    seq = ["p40", "p17", "p40", "p5", "p5", "p40"]
    hits = []
    for key in seq:
        b = batch_b(ITEMS[key][:3], key)
        out = runner.run(b)
        _check(out, b, refs, "mean")
        hits.append(out.cache_hit)
        assert out.prefix_computed_tokens == (0 if out.cache_hit else PREFIX_LENS[key])
    # p40 | p17 evicts p40 | p40 evicts p17 | p5 fits (45) | p5 hit | p40 hit
    assert hits == [False, False, False, False, True, True]
    c = runner.cache
    assert (c.hits, c.misses, c.evictions) == (2, 4, 2)
    assert c.tokens == 45 and (None, "p40") in c and (None, "p5") in c and (None, "p17") not in c and len(c) == 2


def test_item_that_is_all_prefix(model):
    toks = ITEMS["p17"][0].tokens[:17]
    whole = Item(id="whole", num_tokens=17, prefix_key="p17", prefix_len=17, tokens=toks)
    other = ITEMS["p17"][1]
    runner = CausalLMRunner(model, layers=LAYERS, pooling="last", cache_tokens=100)
    for b in (batch_b([whole, other], "p17"), batch_c([other, whole], "p17"), batch_b([whole], "p17")):
        out = runner.run(b)
        for row_i, it in enumerate(b.items):
            ref = reference_pooled(model, it.tokens, 0, LAYERS, "last")
            for layer in LAYERS:
                assert (out.pooled[layer][row_i] - ref[layer]).abs().max() < TOL


def test_rejects_bad_batches(model):
    runner = CausalLMRunner(model, layers=LAYERS, pooling="last")
    a, b = ITEMS["p5"][0], ITEMS["p17"][0]
    with pytest.raises(ValueError, match="prefix_len"):
        runner.run(Batch(rows=[[a], [b]], padded_len=64, prefix_key="p5", prefix_len=5, split_prefix=True))
    with pytest.raises(ValueError, match="packed"):
        runner.run(Batch(rows=[[a, b]], padded_len=128))
    with pytest.raises(ValueError, match="padded_len"):
        runner.run(Batch(rows=[[a]], padded_len=a.num_tokens - 1))
    with pytest.raises(ValueError, match="out of range"):
        CausalLMRunner(model, layers=[NUM_LAYERS + 1])


def test_non_causal_models_refuse_split_prefix():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=VOCAB
    )
    bert = transformers.BertModel(cfg).eval()  # bidirectional encoder
    runner = CausalLMRunner(bert, layers=[0, 2], pooling="mean")
    assert runner.causal is False
    it = Item(id="x", num_tokens=6, prefix_key="k", prefix_len=3, tokens=[5, 6, 7, 8, 9, 10])
    with pytest.raises(ValueError, match="causal decoder"):
        runner.run(Batch(rows=[[it]], padded_len=8, prefix_key="k", prefix_len=3, split_prefix=True))

    t5 = transformers.T5ForConditionalGeneration(
        transformers.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16, vocab_size=VOCAB)
    ).eval()
    runner = CausalLMRunner(t5, layers=[0], pooling="last")
    assert runner.causal is False
    with pytest.raises(ValueError, match="causal decoder|encoder-decoder"):
        runner.run(Batch(rows=[[it]], padded_len=8, prefix_key="k", prefix_len=3, split_prefix=True))


def test_prefix_cache_lru_unit():
    def e(n):
        return PrefixEntry(key_values=[], length=n)

    c = PrefixCache(100)
    assert c.put("a", e(40)) and c.put("b", e(40))
    assert c.get("a") is not None  # a is now most recent
    assert c.put("c", e(40))  # evicts b
    assert "b" not in c and "a" in c and "c" in c and c.evictions == 1 and c.tokens == 80
    assert c.get("b") is None and (c.hits, c.misses) == (1, 1)
    assert not c.put("huge", e(101)) and "huge" not in c and len(c) == 2
    assert c.put("a", e(10)) and c.tokens == 50 and c.evictions == 1  # replace, not evict
    off = PrefixCache(0)
    assert not off.put("a", e(1)) and len(off) == 0 and off.get("a") is None and off.misses == 1


@pytest.mark.slow
def test_a_function_that_needs_hidden_states_alone_runs_no_layer_past_the_deepest(tmp_path, monkeypatch):
    """probe_gen at layer 1 of the embedded 4-layer model runs 2 layers and gives what a run that
    also asks for layer 4 (all 4 layers) gives at layer 1; score reads the LM head, so it runs all."""
    from conftest import SMALL, run_forge
    from forge import load_activations

    ran = []
    init = CausalLMRunner.__init__

    def spy(self, *a, **k):
        init(self, *a, **k)
        ran.append(self.layers_run)

    monkeypatch.setattr(CausalLMRunner, "__init__", spy)
    got = {}
    for layers in ("[1]", "[1,4]"):
        out = tmp_path / layers
        report = run_forge(out, *SMALL, "function=probe_gen", f"layers={layers}", "input.limit=60")
        assert report["items"]["completed"] == 60 and report["balanced"]
        ids, _, states = load_activations(out)
        got[layers] = dict(zip(ids, states[1]))
    assert ran == [2, 4]
    assert got["[1]"].keys() == got["[1,4]"].keys()
    assert max((got["[1]"][i] - got["[1,4]"][i]).abs().max().item() for i in got["[1]"]) < 1e-5
    ran.clear()
    report = run_forge(tmp_path / "score", *SMALL, "function=score", "input.limit=20")
    assert report["items"]["completed"] > 0 and ran == [4]
