"""Interventions (`intervene:`): steering, patching and ablation at hook points give what plain
`transformers` gives with the same PyTorch hook, in every batching mode.

The reference shares nothing with Forge's runtime but the items' token ids (the function's
`records()`: full sequence, prefix length, targets): it loads the model with
`AutoModelForCausalLM`, finds the module itself (`model.model.layers[L]` for the residual
stream, `.mlp` for mlp_in/mlp_out, `.self_attn` for attn_out), registers a forward hook there that
adds ``scale * vector`` (or writes the vector, or zeros) at the span's positions of the whole
sequence, and scores the targets with float32 log_softmax over the logits of one forward pass per
item. The model: a random-weight 3-layer Llama (hidden 32) saved with the embedded tokenizer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from forge.errors import ForgeError  # noqa: E402
from forge.io.results import load  # noqa: E402
from forge.runtime.hooks.interventions import load_interventions  # noqa: E402
from forge.testing import MODES, ONE_AT_A_TIME, SMALL_LIMITS, run_function  # noqa: E402

TOL = 1e-4
HIDDEN = 32
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
BASE = dict(
    hidden_size=HIDDEN,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    vocab_size=2048,
    max_position_embeddings=256,
    num_key_value_heads=2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=3,
    initializer_range=0.2,
)
# every mode of forge.testing, the one-item reference run, and rows attending to one copy of a
# cached prefix's keys (forge.runtime.forward.shared_prefix, asked at every shape: see `shared_prefix`)
ALL_MODES = {"one-at-a-time": ONE_AT_A_TIME, **MODES, "token-shared": MODES["token-cache"]}
STEER = {"at": "resid_post.1", "op": "add", "vector": "FILE", "scale": 4.0, "span": "all"}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


# -- the model, the vector and the rows ------------------------------------------------------


@dataclasses.dataclass
class Setup:
    root: Path
    model_dir: Path
    model: object  # the reference's AutoModelForCausalLM (float32, eval)
    vector: np.ndarray  # [HIDDEN] float32, also in root / "v.npy"
    score_rows: Path
    probe_rows: Path


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    return make_setup(tmp_path_factory.mktemp("interventions"))


def make_setup(root: Path) -> Setup:
    """The model (seed 0), the vector (seed 0) and the rows, written under `root`."""
    from forge.functions.assets import embedded_model_source

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**BASE)).eval()
    model_dir = root / "llama"
    model.save_pretrained(model_dir)
    for f in TOKENIZER_FILES:
        shutil.copy(embedded_model_source() / f, model_dir / f)
    vector = np.random.default_rng(0).standard_normal(HIDDEN).astype(np.float32)
    np.save(root / "v.npy", vector)
    score_rows, probe_rows = root / "score.jsonl", root / "probe.jsonl"
    score_rows.write_text("".join(json.dumps(r) + "\n" for r in _score_rows()))
    probe_rows.write_text("".join(json.dumps(r) + "\n" for r in _probe_rows()))
    return Setup(root, model_dir, model, vector, score_rows, probe_rows)


def _score_rows() -> list[dict]:
    """Four multiple-choice questions (a shared context per question), 16 plain rows under one
    context (more than one batch holds them: the prefix cache serves it), and two short rows
    (an empty context: no prefix; a one-word context)."""
    from forge.functions.assets import ASSETS_DIR, embedded_dataset_path

    mc = [json.loads(line) for line in open(ASSETS_DIR / "multiple_choice.jsonl")][:4]
    rows = [{**r, "context": r["context"].rsplit("\n\n", 1)[-1]} for r in mc]
    story = "Answer each question with one of the four options.\n\nSay something true:"
    texts = [json.loads(line)["text"] for line in open(embedded_dataset_path())][:20]
    rows += [{"id": f"s{k}", "context": story, "continuation": " " + " ".join(texts[k : k + 3])} for k in range(16)]
    rows += [
        {"id": "empty", "context": "", "continuation": "Hello there"},
        {"id": "one", "context": "Yes", "continuation": " no"},
    ]
    return rows


def _probe_rows() -> list[dict]:
    """Two few-shot prefixes (24 and 58 tokens) x 8 texts of one or two statements, and 2 without one."""
    from forge.functions.assets import embedded_dataset_path

    rows = [json.loads(line) for line in open(embedded_dataset_path())]
    short, mid = sorted((p for p in dict.fromkeys(r.get("prefix") for r in rows) if p), key=len)[:2]
    texts = [r["text"] for r in rows[:20]]
    out = [
        {"id": f"r{j}", "text": " ".join(texts[j : j + 1 + j % 2]), "prefix": short if j % 2 else mid, "label": j % 2}
        for j in range(16)
    ]
    return out + [{"id": "np0", "text": texts[17], "label": 0}, {"id": "np1", "text": texts[18], "label": 1}]


def _items(setup: Setup, function: str = "score", **options):
    """The function's items (no intervention: token ids, prefix lengths and targets do not depend on one)."""
    from forge.api import InputSpec, ModelSpec
    from forge.vocab.geometry import Item

    if function == "score":
        from forge.functions.score import Score as cls, ScoreConfig as cfg

        rows = setup.score_rows
    else:
        from forge.functions.probe_gen import ProbeGen as cls, ProbeGenConfig as cfg

        rows = setup.probe_rows
    if "intervene" in options:
        options["intervene"] = _resolved(options["intervene"], setup)
    fn = cls(cfg(model=ModelSpec(name=str(setup.model_dir)), input=InputSpec(path=str(rows)), **options))
    return fn, [it for it in fn.records() if isinstance(it, Item)]


# -- the reference: plain transformers with a PyTorch hook -------------------------------------


def _positions(span, n: int, prefix_len: int) -> list[int]:
    """The positions of a whole sequence of n tokens (prefix first) a span covers."""
    if span == "text":
        return list(range(prefix_len, n))
    if span == "prefix":
        return list(range(prefix_len))
    if span == "all":
        return list(range(n))
    if span == "last":
        return [n - 1] if n > prefix_len else []
    return sorted({p % n for p in span})  # (from the end where negative; past it: the item's failure)


def _vector_of(entry: dict, setup: Setup) -> np.ndarray | None:
    v = entry.get("vector")
    return setup.vector if v == "FILE" else None if v is None else np.asarray(v, np.float32)


def _register(model, entry: dict, vector: np.ndarray | None, positions: list[int]):
    """A forward hook (a pre-hook for inputs) on the module of `entry["at"]`, found independently."""
    kind, layer = entry["at"].rsplit(".", 1)
    block = model.model.layers[int(layer)]
    module = {"resid_pre": block, "resid_post": block, "attn_out": block.self_attn}.get(kind, block.mlp)
    dtype = next(model.parameters()).dtype
    vec = None if vector is None else torch.tensor(vector, dtype=dtype)
    op, scale = entry.get("op", "add"), float(entry.get("scale", 1.0))

    def change(h):
        h = h.clone()
        if op == "add":
            h[:, positions] = h[:, positions] + scale * vec
        elif op == "set":
            h[:, positions] = vec
        else:
            h[:, positions] = 0
        return h

    if kind in ("resid_pre", "mlp_in"):

        def pre(mod, args, kwargs):
            if args:
                return (change(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": change(kwargs["hidden_states"])}

        return module.register_forward_pre_hook(pre, with_kwargs=True)

    def post(mod, args, output):
        return (change(output[0]), *output[1:]) if isinstance(output, tuple) else change(output)

    return module.register_forward_hook(post)


def _forward(setup: Setup, item, entries: list[dict], **kwargs):
    ids = [int(t) for t in item.tokens]
    handles = [
        _register(setup.model, e, _vector_of(e, setup), _positions(e.get("span", "text"), len(ids), item.prefix_len))
        for e in entries
    ]
    try:
        with torch.inference_mode():
            return setup.model(input_ids=torch.tensor([ids]), use_cache=False, **kwargs)
    finally:
        for h in handles:
            h.remove()


def reference_loglik(setup: Setup, items, entries: list[dict]) -> dict[str, float]:
    """{item id: log-likelihood of its targets} from one hooked forward pass per item."""
    out = {}
    for item in items:
        logits = _forward(setup, item, entries).logits[0]
        start, targets = item.meta.target_start, torch.tensor(item.meta.targets)
        logp = torch.log_softmax(logits[start : start + len(targets)].float(), dim=-1)
        out[item.id] = float(logp.gather(1, targets[:, None]).sum())
    return out


# -- running Forge ---------------------------------------------------------------------------


def _flow(value) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    if isinstance(value, str):
        return "'" + value + "'"
    return repr(value)


def _resolved(entries: list[dict], setup: Setup) -> list[dict]:
    """The entries with vector "FILE" naming the vector's .npy file."""
    return [{**e, "vector": str(setup.root / "v.npy")} if e.get("vector") == "FILE" else e for e in entries]


def intervene(entries: list[dict], setup: Setup) -> str:
    """The command line's override: intervene=[{at: ..., op: ..., vector: ..., ...}, ...]."""
    parts = []
    for e in _resolved(entries, setup):
        parts.append("{" + ", ".join(f"{k}: {_flow(v)}" for k, v in e.items()) + "}")
    return "intervene=[" + ", ".join(parts) + "]"


def run(setup: Setup, run_dir: Path, mode: str, entries: list[dict], function: str = "score", *extra: str):
    rows = setup.score_rows if function == "score" else setup.probe_rows
    overrides = [*SMALL_LIMITS, *ALL_MODES[mode], "model=hf", f"model.name={setup.model_dir}", *extra]
    if entries:
        overrides.append(intervene(entries, setup))
    report = run_function(function, rows, run_dir, overrides)
    assert report["items"]["failed"] == 0 and report["items"]["skipped"] == 0, report.get("failures")
    assert report["balanced"], report.get("imbalance")
    return report


def _logliks(run_dir: Path) -> dict[str, float]:
    res = load(run_dir)
    return dict(zip(res.ids, res.columns["loglik"].tolist()))


def _close(got: dict[str, float], want: dict[str, float]) -> float:
    assert got.keys() == want.keys()
    worst = max(abs(got[k] - want[k]) for k in want)
    assert worst < TOL, {k: (got[k], want[k]) for k in want if abs(got[k] - want[k]) >= TOL}
    return worst


@pytest.fixture
def shared_prefix(monkeypatch):
    """Rows after a cached prefix attend to one copy of its keys at every shape; yields whether it ran."""
    from forge.runtime.forward import shared_prefix as sp

    ran: list[bool] = []
    forward = sp.forward
    monkeypatch.setattr(sp, "worth_sharing", lambda *a: True)
    monkeypatch.setattr(sp, "forward", lambda *a, **k: ran.append(forward(*a, **k)) or ran[-1])
    return ran


_REFS: dict = {}


def _reference_cached(setup: Setup, entries: list[dict]) -> dict[str, float]:
    key = json.dumps(entries)
    if key not in _REFS:
        _REFS[key] = reference_loglik(setup, _items(setup)[1], entries)
    return _REFS[key]


# -- 1. score, steered, equals the hooked reference --------------------------------------------

LAYOUTS = {  # layouts each mode's batches must have taken (forge.core.layouts)
    "one-at-a-time": {"rows"},
    "item": {"rows"},
    "token-cache": {"split-prefix rows", "cache-hit rows"},
    "token-nocache": {"rows"},
    "token-packed": {"split-prefix packed rows", "cache-hit packed rows", "packed rows"},
    "memory": {"split-prefix rows", "cache-hit rows"},
    "token-merged": {"tree rows", "cache-hit rows"},
    "token-shared": {"split-prefix rows", "cache-hit rows"},
}


@pytest.mark.parametrize(
    "mode", [pytest.param(m, marks=pytest.mark.slow) if m == "memory" else m for m in ALL_MODES]
)  # (memory: its first run measures the forward pass's memory, about 5 s)
def test_steered_score_equals_hooked_transformers_in_every_mode(setup, tmp_path, mode, request):
    ran = request.getfixturevalue("shared_prefix") if mode == "token-shared" else None
    report = run(setup, tmp_path, mode, [STEER])
    assert LAYOUTS[mode] <= set(report["layouts"]), report["layouts"]
    if ran is not None:
        assert ran and all(ran), ran
    want = _reference_cached(setup, [STEER])
    _close(_logliks(tmp_path), want)
    plain = _reference_cached(setup, [])
    assert min(abs(want[k] - plain[k]) for k in want) > 1e-3  # the steering changes every item


# ops x spans x points, in split-prefix rows with the cache and in tree rows
CASES = {
    "add-text-resid_post": [{"at": "resid_post.1", "op": "add", "vector": "FILE", "scale": 2.0, "span": "text"}],
    "add-prefix-mlp_out": [{"at": "mlp_out.0", "op": "add", "vector": "FILE", "scale": 3.0, "span": "prefix"}],
    "set-last-attn_out": [{"at": "attn_out.2", "op": "set", "vector": "FILE", "span": "last"}],
    "zero-positions-attn_out": [{"at": "attn_out.1", "op": "zero", "span": [0, 2, -1]}],
    "set-all-mlp_out": [{"at": "mlp_out.1", "op": "set", "vector": "FILE", "span": "all"}],
    "zero-prefix-resid_post": [{"at": "resid_post.0", "op": "zero", "span": "prefix"}],
    "add-positions-resid_pre": [
        {"at": "resid_pre.1", "op": "add", "vector": "FILE", "scale": -1.5, "span": [1, 3, -2]}
    ],
    "add-text-mlp_in": [{"at": "mlp_in.2", "op": "add", "vector": "FILE", "span": "text"}],
    "two-at-one-point": [
        {"at": "resid_post.1", "op": "add", "vector": "FILE", "scale": 2.0, "span": "all"},
        {"at": "resid_post.1", "op": "zero", "span": "last"},
        {"at": "mlp_out.2", "op": "set", "vector": "FILE", "span": [2, -1]},
    ],
}


@pytest.mark.parametrize("mode", ["token-cache", "token-merged"])
@pytest.mark.parametrize("case", list(CASES))
def test_ops_spans_and_points_equal_hooked_transformers(setup, tmp_path, case, mode):
    run(setup, tmp_path, mode, CASES[case])
    want = _reference_cached(setup, CASES[case])
    _close(_logliks(tmp_path), want)
    plain = _reference_cached(setup, [])
    assert max(abs(want[k] - plain[k]) for k in want) > 1e-3  # the case changes something


# -- 2. the prefix cache never serves an unsteered prefix to a steered item ---------------------


def test_prefix_keys_carry_interventions_that_reach_prefix_tokens(setup):
    _, plain = _items(setup)
    keys = [it.prefix_key for it in plain]
    assert sum(k is not None for k in keys) > 20
    for span, changes in (("text", False), ("last", False), ("prefix", True), ("all", True), ([3], True)):
        entry = {**STEER, "vector": setup.vector.tolist(), "span": span}
        fn, steered = _items(setup, intervene=[entry])
        got = [it.prefix_key for it in steered]
        assert [it.id for it in steered] == [it.id for it in plain]
        if not changes:  # only an item's own tokens change: its prefix's keys and values are the same
            assert got == keys and fn.interventions.key is None
            continue
        mark = fn.interventions.key
        assert mark and got == [None if k is None else f"{k}|{mark}" for k in keys], span
    # another vector, scale or point: another prefix
    marks = {
        _items(setup, intervene=[{**STEER, "vector": setup.vector.tolist(), **change}])[0].interventions.key
        for change in ({}, {"scale": 2.0}, {"at": "resid_post.0"}, {"vector": (2 * setup.vector).tolist()})
    }
    assert len(marks) == 4


def _split_batch(items, key: str | None = None):
    from forge.vocab.geometry import Batch

    P = items[0].prefix_len
    if key is not None:
        items = [dataclasses.replace(it, prefix_key=key) for it in items]
    width = max(it.num_tokens - P for it in items)
    return Batch(
        rows=[[it] for it in items], padded_len=width, prefix_key=items[0].prefix_key, prefix_len=P, split_prefix=True
    )


def test_one_device_cache_serves_a_steered_item_only_its_steered_prefix(setup):
    """One loaded model and one prefix cache: an unsteered batch fills the cache, then a runner
    with the interventions runs the same prefix's items (steered keys): a miss, then a hit of its
    own steered prefix, equal to the reference both times. Even under the unsteered items' prefix
    key, the cache's key (the interventions' tag, `forge.runtime.forward.prefix_cache.PrefixKey`)
    keeps the unsteered entry from a steered runner: a miss, and the steered results."""
    from forge.functions.score import Score
    from forge.runtime.forward.causal_lm import CausalLMRunner
    from forge.runtime.forward.views import CausalViews

    fn, steered_items = _items(setup, intervene=[STEER])
    _, plain_items = _items(setup)
    pick = [k for k, it in enumerate(plain_items) if it.id.startswith("s")][:5]
    plain_batch = _split_batch([plain_items[k] for k in pick])
    steered_batch = _split_batch([steered_items[k] for k in pick])
    assert plain_batch.prefix_key != steered_batch.prefix_key
    model = transformers.AutoModelForCausalLM.from_pretrained(setup.model_dir).eval()
    options = dict(layers=[], cache_tokens=4096, pad_token_id=3, allow_no_layers=True)
    plain = CausalLMRunner(model, **options)
    steered = CausalLMRunner(model, **options, interventions=fn.interventions)
    steered.cache = plain.cache  # one device: its cache outlives a function's hooks

    def logliks(runner, batch):
        out = CausalViews(runner, Score.forward).run(batch)
        return {v.id: float(v.logprobs.double().sum()) for v in out.views}, out.cache_hit

    want, unsteered = _reference_cached(setup, [STEER]), _reference_cached(setup, [])
    pick_ids = [plain_items[k].id for k in pick]
    got, hit = logliks(plain, plain_batch)
    assert not hit
    _close(got, {i: unsteered[i] for i in pick_ids})
    for expect_hit in (False, True):  # a miss (another key), then its own entry
        got, hit = logliks(steered, steered_batch)
        assert hit == expect_hit
        _close(got, {i: want[i] for i in pick_ids})
    got, hit = logliks(steered, _split_batch([steered_items[k] for k in pick], plain_batch.prefix_key))
    assert not hit
    _close(got, {i: want[i] for i in pick_ids})
    assert min(abs(want[i] - unsteered[i]) for i in pick_ids) > 1e-3  # what serving the plain entry would be off by
    assert len(plain.cache) == 3 and (None, plain_batch.prefix_key) in plain.cache


# -- 3. probe_gen: hidden states after an intervention --------------------------------------


def _states(setup: Setup, item, entries: list[dict], layer: int) -> torch.Tensor:
    """hidden_states[layer] of the item's own tokens: layer `layer - 1`'s output as what flows on,
    recorded by a hook registered after the interventions' (never transformers' own recording,
    whose hooks run before or after ours depending on which call installed them first)."""
    seen = {}
    ids = [int(t) for t in item.tokens]
    handles = [
        _register(setup.model, e, _vector_of(e, setup), _positions(e.get("span", "text"), len(ids), item.prefix_len))
        for e in entries
    ]
    record = lambda mod, args, out: seen.setdefault("h", out[0] if isinstance(out, tuple) else out)  # noqa: E731
    handles.append(setup.model.model.layers[layer - 1].register_forward_hook(record))
    try:
        with torch.inference_mode():
            setup.model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return seen["h"][0, item.prefix_len :]


PROBES = {  # mode, where, span, items whose layer-2 states change
    "text": ("token-merged", "resid_post.0", "text", 18),
    "prefix": ("token-cache", "resid_post.0", "prefix", 16),  # (the 2 rows without a prefix: unchanged)
    "positions": ("token-packed", "resid_post.0", [2, -1, -7], 18),  # (-7: in some items' prefixes)
    # at the layer read: hidden_states[2] is layer 1's output as it flows on, the intervention's included
    "same-layer": ("item", "resid_post.1", "all", 18),
    # hidden_states[2] is what layer 2 reads before resid_pre.2 changes it: not included (a worker
    # that keeps layers 0..1 for layers=[2] drops the hook; a capture at resid_pre.2 would show it)
    "resid_pre-of-the-next": ("token-merged", "resid_pre.2", "all", 0),
}


@pytest.mark.parametrize("case", list(PROBES))
def test_probe_gen_states_equal_hooked_transformers(setup, tmp_path, case):
    """Layer 2's states of every own token (pooling=none) after an intervention; span prefix in
    split-prefix rows with the prefix cache (smaller steps: a prefix's items take several
    batches, so the cache serves the steered prefix)."""
    mode, at, span, changes = PROBES[case]
    entry = {"at": at, "op": "add", "vector": "FILE", "scale": 3.0, "span": span}
    small = (
        ["devices.limits.max_seq_len=96", "devices.limits.max_batch_tokens=96", "budget.tokens_per_step=96"]
        if span == "prefix"
        else []
    )
    options = ["layers=[2]", "pooling=none", "prefix_states=none", *small]
    report = run(setup, tmp_path, mode, [entry], "probe_gen", *options)
    if span == "prefix":
        assert {"split-prefix rows", "cache-hit rows"} <= set(report["layouts"]), report["layouts"]
    res = load(tmp_path)
    _, items = _items(setup, "probe_gen", layers=[2])
    changed = 0
    for item in items:
        got = torch.from_numpy(res.columns["layer_2"][res.ids.index(item.id)])
        want, plain = _states(setup, item, [entry], 2), _states(setup, item, [], 2)
        assert got.shape == want.shape and (got - want).abs().max() < TOL, item.id
        changed += bool((want - plain).abs().max() > 1e-3)
    assert changed == changes


# -- 4. config errors: one line each, before any work ------------------------------------------

REFUSED = {
    "unknown-op": (
        "[{at: resid_post.1, op: mul, vector: [1.0]}]",
        "intervene[0].op='mul'; choose one of: add, set, zero",
    ),
    "no-vector": ("[{at: resid_post.1, op: add}]", "intervene[0].vector is missing: op=add needs a vector"),
    "bad-span": ("[{at: resid_post.1, op: zero, span: middle}]", "intervene[0].span='middle'; choose one of: text"),
    "row-scale-not-add": ("[{at: resid_post.1, op: set, vector: [1.0], scale: row.s}]", "a scale applies to op=add"),
    "no-point": ("[{op: zero}]", "intervene[0].at is missing"),
    "past-the-layers": ("[{at: mlp_out.3, op: zero}]", "intervene: hook point 'mlp_out.3': the model has layers 0..2"),
    "attention-pattern": ("[{at: attn_pattern.1, op: zero}]", "attention patterns are read, not changed"),
    "bad-layer": ("[{at: resid_post.x, op: zero}]", "the layer after resid_post. must be an integer"),
    "unknown-key": ("[{at: resid_post.1, op: zero, spn: text}]", "did you mean span?"),
    "no-file": ("[{at: resid_post.1, vector: 'NOFILE.npy'}]", "intervene[0].vector='NOFILE.npy': FileNotFoundError"),
    "bad-scale": ("[{at: resid_post.1, vector: [1.0], scale: big}]", "expected a number"),
    "matrix": ("[{at: resid_post.1, vector: [[1.0, 2.0]]}]", "need one finite vector (1-D), got shape (1, 2)"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_config_errors_are_one_line_before_any_work(setup, tmp_path, case):
    value, message = REFUSED[case]
    rows = setup.score_rows
    with pytest.raises(ForgeError) as err:
        run_function(
            "score", rows, tmp_path, [*SMALL_LIMITS, "model=hf", f"model.name={setup.model_dir}", f"intervene={value}"]
        )
    text = str(err.value)
    assert message in text and "\n" not in text, text
    assert not (tmp_path / "report.json").exists()


def test_a_vector_of_the_wrong_length_at_a_named_point_is_refused_at_construction(setup):
    """`Interventions.check_widths`: the hidden size is known from the config, before any work."""
    from forge.api import InputSpec, ModelSpec
    from forge.functions.score import Score, ScoreConfig

    for at in ("resid_post.1", "mlp_in.0", "attn_out.2", "resid_pre.2", "mlp_out.0"):
        cfg = ScoreConfig(
            model=ModelSpec(name=str(setup.model_dir)),
            input=InputSpec(path=str(setup.score_rows)),
            intervene=[{"at": "resid_post.0", "op": "zero"}, {"at": at, "vector": [1.0, 2.0]}],
        )
        with pytest.raises(ForgeError) as err:
            Score(cfg)  # CausalLMFunction checks the widths when it is built
        assert str(err.value) == (
            f"score: intervene[1] at {at!r}: its vector has 2 values, but the model's hidden size is {HIDDEN}"
        )
    load_interventions([{"at": "resid_post.0", "op": "zero"}]).check_widths(2, "score")  # no vector: no width
    module = load_interventions([{"at": "model.layers.1.mlp.down_proj", "vector": [1.0, 2.0]}])
    module.check_widths(HIDDEN, "score")  # a module path's width: known once it runs


@pytest.mark.parametrize("at", ["resid_post.1", "model.layers.1.mlp.down_proj"])
def test_a_vector_of_the_wrong_length_fails_before_work_or_fails_its_items(setup, tmp_path, at):
    """What `forge run` shows: a named point is refused before work; a module path's width is known
    only once it runs: every item fails with the reason, and the ledger balances."""
    base = [*SMALL_LIMITS, *MODES["token-cache"], "model=hf", f"model.name={setup.model_dir}"]
    try:
        report = run_function(
            "score", setup.score_rows, tmp_path, [*base, f"intervene=[{{at: {at}, vector: [1.0, 2.0]}}]"]
        )
    except ForgeError as exc:
        assert at == "resid_post.1" and "\n" not in str(exc), str(exc)
        assert str(exc).endswith("its vector has 2 values, but the model's hidden size is 32")
        assert not (tmp_path / "report.json").exists()
        return
    assert at != "resid_post.1", "a named point's width is checked before work"
    _failed_with(report, f"intervention at {at!r}: its vector has 2 values, the hook point's value has 32 per token")


def _failed_with(report, reason: str) -> None:
    items = report["items"]
    assert items["completed"] == 0 and items["failed"] == items["received"] == 34, items
    assert report["balanced"], report.get("imbalance")
    assert all(reason in f["reason"] for f in report["failures"]), report["failures"][:2]


def test_an_encoder_function_refuses_intervene(tmp_path):
    from transformers import BertConfig, BertModel, BertTokenizerFast

    words = ["the", "sky", "is", "blue"]
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt")).save_pretrained(tmp_path)
    config = BertConfig(vocab_size=9, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
    BertModel(config).save_pretrained(tmp_path)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "a", "text": "the sky is blue"}) + "\n")
    with pytest.raises(ForgeError) as err:
        run_function(
            "embed",
            rows,
            tmp_path / "run",
            ["model=hf", f"model.name={tmp_path}", "intervene=[{at: resid_post.0, op: zero}]"],
        )
    assert str(err.value) == "embed: capture and intervene run on causal LMs (a CausalLMFunction), not encoders"


# -- 5. vectors: .npy, .pt, .safetensors#key, a list --------------------------------------------


def test_vectors_from_files_and_lists(setup, tmp_path):
    from safetensors.numpy import save_file

    v = setup.vector
    np.save(tmp_path / "v.npy", v)
    torch.save(torch.from_numpy(v), tmp_path / "v.pt")
    save_file({"other": np.zeros(3, np.float32), "steer": v}, tmp_path / "dirs.safetensors")
    save_file({"only": v}, tmp_path / "one.safetensors")
    sources = [
        str(tmp_path / "v.npy"),
        str(tmp_path / "v.pt"),
        f"{tmp_path / 'dirs.safetensors'}#steer",
        str(tmp_path / "one.safetensors"),
        v.tolist(),
    ]
    got = [load_interventions([{"at": "resid_post.1", "vector": s}]).items[0].vector for s in sources]
    assert all(g == tuple(float(x) for x in v) for g in got)
    bad = {
        f"{tmp_path / 'dirs.safetensors'}#nope": "KeyError",
        str(tmp_path / "v.txt"): "use a .npy, .pt or .safetensors#key file",
        f"{tmp_path / 'dirs.safetensors'}#other": None,  # fine: 3 values (wrong only for this model)
    }
    for source, message in bad.items():
        if message is None:
            assert len(load_interventions([{"at": "resid_post.1", "vector": source}]).items[0].vector) == 3
            continue
        with pytest.raises(ForgeError, match=message) as err:
            load_interventions([{"at": "resid_post.1", "vector": source}])
        assert "\n" not in str(err.value) and str(err.value).startswith(f"intervene[0].vector={source!r}")


@pytest.mark.parametrize("source", ["safetensors", "list"])
def test_a_steered_run_reads_its_vector_from_any_source(setup, tmp_path, source):
    from safetensors.numpy import save_file

    if source == "safetensors":
        save_file({"other": np.zeros(3, np.float32), "steer": setup.vector}, tmp_path / "dirs.safetensors")
        vector = f"{tmp_path / 'dirs.safetensors'}#steer"
    else:
        vector = setup.vector.tolist()
    run(setup, tmp_path / "run", "token-merged", [{**STEER, "vector": vector}])
    _close(_logliks(tmp_path / "run"), _reference_cached(setup, [STEER]))


def test_probe_gen_refuses_stored_prefix_states_that_its_items_did_not_see(setup, tmp_path):
    """prefix_states=once runs each prefix as an item of its own, where span text/last/prefix would
    steer other tokens than the items' prefixes saw: refused before work, naming the fix."""
    entry = {"at": "resid_post.0", "op": "add", "vector": "FILE", "scale": 3.0, "span": "text"}
    with pytest.raises(ForgeError, match="set prefix_states=none"):
        run(setup, tmp_path, "token-merged", [entry], "probe_gen", "layers=[2]", "pooling=none")
    assert not (tmp_path / "report.json").exists()


# -- the command line and YAML -----------------------------------------------------------------


def _cli(*args: str):
    from typer.testing import CliRunner

    from forge.cli.app import app

    return CliRunner().invoke(app, ["run", *args, "runtime.executor=inprocess", *SMALL_LIMITS])


@pytest.mark.slow
def test_forge_run_takes_a_list_of_entries_on_the_command_line_and_in_yaml(setup, tmp_path):
    """`forge run function=score 'intervene=[{at: ..., op: add, vector: v.npy, scale: 4.0, span: all}]'`,
    and the same entries in a function YAML of a user config directory (`--config-dir`)."""
    vector = setup.root / "v.npy"
    line = f"intervene=[{{at: resid_post.1, op: add, vector: {vector}, scale: 4.0, span: all}}]"
    model = ["model=hf", f"model.name={setup.model_dir}", f"input.path={setup.score_rows}"]
    result = _cli("function=score", *model, line, f"output_dir={tmp_path / 'line'}")
    assert result.exit_code == 0, result.output
    (tmp_path / "conf" / "function").mkdir(parents=True)
    (tmp_path / "conf" / "function" / "steered.yaml").write_text(
        "# @package _global_\n"
        "defaults:\n  - score\n  - _self_\n\n"
        f"intervene:\n  - at: resid_post.1\n    op: add\n    vector: {vector}\n    scale: 4.0\n    span: all\n"
    )
    conf = ["--config-dir", str(tmp_path / "conf"), "function=steered"]
    result = _cli(*conf, *model, f"output_dir={tmp_path / 'yaml'}")
    assert result.exit_code == 0, result.output
    want = _reference_cached(setup, [STEER])
    for run_dir in (tmp_path / "line", tmp_path / "yaml"):
        _close(_logliks(run_dir), want)
        fingerprint = json.loads((run_dir / "run.json").read_text())["fingerprint"]
        digest = hashlib.sha256(setup.vector.astype(np.float64).tobytes()).hexdigest()
        want_entry = {"at": "resid_post.1", "op": "add", "scale": 4.0, "span": "all", "vector_sha256": digest}
        assert fingerprint["intervene"] == [want_entry]
    result = _cli("function=score", *model, "intervene=[{at: resid_post.1, op: mul}]", f"output_dir={tmp_path / 'bad'}")
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "error: intervene[0].op='mul'; choose one of: add, set, zero" in result.output


def test_a_resume_with_other_interventions_is_refused(setup, tmp_path):
    base = [*SMALL_LIMITS, "model=hf", f"model.name={setup.model_dir}", "input.limit=3"]
    run_function("score", setup.score_rows, tmp_path, [*base, "intervene=[{at: resid_post.1, op: zero}]"])
    with pytest.raises(ForgeError, match="resume refused: intervene: ") as err:
        run_function(
            "score",
            setup.score_rows,
            tmp_path,
            [*base, "resume=true", "intervene=[{at: resid_post.1, op: zero, span: all}]"],
        )
    assert "\n" not in str(err.value)
