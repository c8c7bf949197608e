"""Per-row interventions (`intervene:` values ``row.<column>``, ``op: patch``, positions from the end):
one batched run of a sweep or of patching pairs equals one run per setting, or one-at-a-time
patching with plain PyTorch hooks, in every batching mode.

The reference shares nothing with Forge's runtime but the items' token ids (the function's own
`records()` without interventions): `tests/test_interventions.py`'s random-weight 3-layer Llama,
its hooks found by module path, and float32 log_softmax over one forward pass per item. A patch's
reference runs the source item alone with a hook that records the module's output, then the item
with a hook that writes the recorded values at the item's positions.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from forge.errors import ForgeError
from forge.io.results import load
from forge.testing import MODES, SMALL_LIMITS, run_function
from tests.test_interventions import ALL_MODES, LAYOUTS, Setup, _flow, _items, make_setup

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

SCALES = (0.0, 0.5, 1.0, 2.0)
QUICK = ("one-at-a-time", "token-cache", "token-merged")  # the rest are marked slow
MODE_PARAMS = [m if m in QUICK else pytest.param(m, marks=pytest.mark.slow) for m in ALL_MODES]
SLOW_MODES = [pytest.param(m, marks=pytest.mark.slow) for m in ALL_MODES]  # (five runs each: 5 s and more)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    return make_setup(tmp_path_factory.mktemp("row-interventions"))


@pytest.fixture
def shared(request, monkeypatch):
    """token-shared: rows after a cached prefix attend to one copy of its keys at every shape."""
    from forge.runtime.forward import shared_prefix as sp

    monkeypatch.setattr(sp, "worth_sharing", lambda *a: True)


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _entries(entries: list[dict], setup: Setup) -> str:
    """The command line's override for `entries` ("FILE": the setup's vector file)."""
    parts = []
    for e in entries:
        e = {k: str(setup.root / "v.npy") if v == "FILE" else v for k, v in e.items()}
        parts.append("{" + ", ".join(f"{k}: {_flow(v)}" for k, v in e.items()) + "}")
    return "intervene=[" + ", ".join(parts) + "]"


def _run(setup: Setup, rows: Path, run_dir: Path, mode: str, entries: list[dict], function="score", *extra, ok=True):
    overrides = [*SMALL_LIMITS, *ALL_MODES[mode], "model=hf", f"model.name={setup.model_dir}", *extra]
    report = run_function(function, rows, run_dir, [*overrides, _entries(entries, setup)])
    assert report["balanced"], report.get("imbalance")
    if ok:
        assert report["items"]["failed"] == 0 and report["items"]["skipped"] == 0, report.get("failures")
    return report


def _logliks(run_dir: Path) -> dict[str, float]:
    res = load(run_dir)
    ids = [q if c < 0 else f"{q}/{c}" for q, c in zip(res.columns["question"], res.columns["choice"].tolist())]
    return dict(zip(ids, res.columns["loglik"].tolist()))


# -- a sweep: each row its own scale or vector ----------------------------------------------------


def _sweep_rows(setup: Setup) -> Path:
    rows = [json.loads(line) for line in open(setup.score_rows)]
    return _write(
        setup.root / "sweep.jsonl",
        [{**r, "scale": SCALES[k % 4], "dir": k % 3} for k, r in enumerate(rows)],
    )


@pytest.mark.parametrize("mode", SLOW_MODES)
def test_a_scale_per_row_equals_one_run_per_constant_scale_exactly(setup, tmp_path, mode, request):
    """Rows at scales 0, 0.5, 1, 2 in one run give, bit for bit, what four runs at each constant
    scale give those rows (the items' geometry is the same in all five runs, so are the batches)."""
    if mode == "token-shared":
        request.getfixturevalue("shared")
    rows = _sweep_rows(setup)
    steer = {"at": "resid_post.1", "op": "add", "vector": "FILE", "span": "text"}
    report = _run(setup, rows, tmp_path / "sweep", mode, [{**steer, "scale": "row.scale"}])
    assert LAYOUTS[mode] <= set(report["layouts"]), report["layouts"]
    got = _logliks(tmp_path / "sweep")
    scale_of = {r["id"]: r["scale"] for r in map(json.loads, open(rows)) if "id" in r}
    want = {}
    for s in SCALES:
        _run(setup, rows, tmp_path / f"at-{s}", mode, [{**steer, "scale": s}])
        want[s] = _logliks(tmp_path / f"at-{s}")
    assert got.keys() == want[0.0].keys()
    for item, value in got.items():
        assert value == want[scale_of[item.split("/")[0]]][item], item
    assert len({want[s]["s0"] for s in SCALES}) == 4  # each scale changes the result


def test_one_batch_of_rows_at_their_own_scales_equals_a_batch_per_constant_scale_bit_for_bit(setup, tmp_path):
    """The quick loop's check, on one runner: a split-prefix batch of items at scales 0, 0.5, 1, 2
    gives each item what the same batch at its constant scale gives it."""
    from forge.api import InputSpec, ModelSpec
    from forge.functions.score import Score, ScoreConfig
    from forge.runtime.forward.causal_lm import CausalLMRunner
    from forge.runtime.forward.views import CausalViews
    from forge.vocab.geometry import Item
    from tests.test_interventions import _split_batch

    rows = _sweep_rows(setup)
    steer = {"at": "resid_post.1", "op": "add", "vector": str(setup.root / "v.npy"), "span": "text"}
    model = transformers.AutoModelForCausalLM.from_pretrained(setup.model_dir).eval()
    options = dict(layers=[], cache_tokens=4096, pad_token_id=3, allow_no_layers=True)

    def logliks(scale):
        cfg = ScoreConfig(model=ModelSpec(name=str(setup.model_dir)), input=InputSpec(path=str(rows)))
        fn = Score(dataclasses.replace(cfg, intervene=[{**steer, "scale": scale}]))
        items = [it for it in fn.records() if isinstance(it, Item) and it.id.startswith("s")][:8]
        runner = CausalLMRunner(model, **options, interventions=fn.interventions)
        out = CausalViews(runner, Score.forward).run(_split_batch(items))
        return {v.id: float(v.logprobs.double().sum()) for v in out.views}

    got = logliks("row.scale")
    assert len(got) == 8
    for k, s in enumerate(SCALES):
        want = logliks(s)
        assert all(got[i] == want[i] for i in got if int(i[1:]) % 4 == k)  # (row k of the sweep: scale k % 4)
    assert len({logliks(s)["s1"] for s in SCALES}) == 4


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["item", "token-packed"])
def test_a_vector_per_row_picked_from_a_table_equals_one_run_per_vector_exactly(setup, tmp_path, mode):
    table = np.random.default_rng(1).standard_normal((3, 32)).astype(np.float32)
    np.save(tmp_path / "dirs.npy", table)
    rows = _sweep_rows(setup)
    steer = {"at": "mlp_out.0", "op": "add", "scale": 2.0, "span": "text"}
    _run(setup, rows, tmp_path / "sweep", mode, [{**steer, "vector": str(tmp_path / "dirs.npy"), "index": "row.dir"}])
    got = _logliks(tmp_path / "sweep")
    dir_of = {r["id"]: r["dir"] for r in map(json.loads, open(rows)) if "id" in r}
    want = {}
    for k in range(3):
        _run(setup, rows, tmp_path / f"v{k}", mode, [{**steer, "vector": table[k].tolist()}])
        want[k] = _logliks(tmp_path / f"v{k}")
    for item, value in got.items():
        assert value == want[dir_of[item.split("/")[0]]][item], item


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["token-cache", "token-merged"])
def test_a_scale_per_row_that_reaches_the_prefix_equals_hooked_transformers(setup, tmp_path, mode):
    """span all: a prefix steered at each row's scale is that row's own (its prefix key says so),
    so rows under one prefix text at other scales never share its keys and values."""
    from tests.test_interventions import reference_loglik

    rows = _sweep_rows(setup)
    steer = {"at": "resid_post.0", "op": "add", "vector": "FILE", "span": "all"}
    small = ["devices.limits.max_seq_len=64", "devices.limits.max_batch_tokens=64", "budget.tokens_per_step=64"]
    report = _run(setup, rows, tmp_path / "sweep", mode, [{**steer, "scale": "row.scale"}], "score", *small)
    assert LAYOUTS[mode] <= set(report["layouts"]), report["layouts"]
    got = _logliks(tmp_path / "sweep")
    _, items = _items(setup)
    scale_of = {r["id"]: r["scale"] for r in map(json.loads, open(rows)) if "id" in r}
    for s in SCALES:
        mine = [it for it in items if scale_of[it.id.split("/")[0]] == s]
        want = reference_loglik(setup, mine, [{**steer, "scale": s}])
        assert max(abs(got[k] - v) for k, v in want.items()) < 1e-4, s


# -- patching: clean/corrupted pairs --------------------------------------------------------------

STORY = "Answer each question with one of the four options.\n\n"


def _pairs(setup: Setup) -> Path:
    """Six clean rows and six corrupted ones naming theirs as source: two prefixes, texts of other
    lengths within a pair, and the clean rows themselves unpatched (no source: missing, empty or null)."""
    from forge.functions.assets import embedded_dataset_path

    texts = [json.loads(line)["text"] for line in open(embedded_dataset_path())][:30]
    rows = []
    for k in range(6):
        context = STORY + ("Say something true:" if k % 2 else "Say something:")
        clean = {"id": f"c{k}", "context": context, "continuation": " " + texts[k]}
        if k % 3:  # an empty or null source column names no source, as a missing one does
            clean["source"] = "" if k % 3 == 1 else None
        rows.append(clean)
        rows.append(
            {
                "id": f"x{k}",
                "context": context,
                "continuation": " " + texts[10 + k] + (" " + texts[20 + k] if k % 3 == 0 else ""),
                "source": f"c{k}",
                "pos": [-1] if k % 2 else [1, -2, -1],  # position 1: a prefix token
            }
        )
    return _write(setup.root / "pairs.jsonl", rows)


def _module(model, at: str):
    kind, layer = at.rsplit(".", 1)
    block = model.model.layers[int(layer)]
    return {"resid_post": block, "attn_out": block.self_attn}.get(kind, block.mlp)


def _patched_reference(setup: Setup, items, entries: list[dict], rows: Path) -> dict[str, float]:
    """{item id: log-likelihood}: each corrupted item run once with plain forward hooks writing its
    clean source's activations (recorded by a hook on the source's own run) at its positions."""
    data = {r["id"]: r for r in map(json.loads, open(rows))}
    by_id = {it.id: it for it in items}
    model, out = setup.model, {}
    for item in items:
        row, handles, writes = data[item.id], [], []
        for e in entries if data[item.id].get("source") else []:  # the source's own run, with no hook writing
            source = by_id[row["source"]]
            seen: dict = {}
            record = _module(model, e["at"]).register_forward_hook(
                lambda m, a, o, seen=seen: seen.update(v=(o[0] if isinstance(o, tuple) else o)[0].clone())
            )
            with torch.inference_mode():
                model(input_ids=torch.tensor([[int(t) for t in source.tokens]]), use_cache=False)
            record.remove()
            span = row["pos"] if e["span"] == "row.pos" else e["span"]
            n, m = item.num_tokens, source.num_tokens
            if span == "last":
                at, src = [n - 1], [m - 1]
            else:
                at, src = [p % n for p in span], [p % m for p in span]
            writes.append((e["at"], at, seen["v"][src]))
        for point, at, value in writes:

            def write(mod, args, output, at=at, value=value):
                h = (output[0] if isinstance(output, tuple) else output).clone()
                h[0, at] = value
                return (h, *output[1:]) if isinstance(output, tuple) else h

            handles.append(_module(model, point).register_forward_hook(write))
        try:
            with torch.inference_mode():
                logits = model(input_ids=torch.tensor([[int(t) for t in item.tokens]]), use_cache=False).logits[0]
        finally:
            for h in handles:
                h.remove()
        start, targets = item.meta.target_start, torch.tensor(item.meta.targets)
        logp = torch.log_softmax(logits[start : start + len(targets)].float(), dim=-1)
        out[item.id] = float(logp.gather(1, targets[:, None]).sum())
    return out


PATCHES = [
    {"at": "resid_post.1", "op": "patch", "source": "row.source", "span": [-1]},
    {"at": "mlp_out.0", "op": "patch", "source": "row.source", "span": "row.pos"},
    {"at": "attn_out.2", "op": "patch", "source": "row.source", "span": "last"},
]


def _score_items(setup: Setup, rows: Path):
    from forge.api import InputSpec, ModelSpec
    from forge.functions.score import Score, ScoreConfig
    from forge.vocab.geometry import Item

    fn = Score(ScoreConfig(model=ModelSpec(name=str(setup.model_dir)), input=InputSpec(path=str(rows))))
    return [it for it in fn.records() if isinstance(it, Item)]


_WANT: dict = {}


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_patching_pairs_in_one_run_equals_one_at_a_time_patching_with_plain_hooks(setup, tmp_path, mode, request):
    if mode == "token-shared":
        request.getfixturevalue("shared")
    rows = _pairs(setup)
    small = ["devices.limits.max_seq_len=64", "devices.limits.max_batch_tokens=64", "budget.tokens_per_step=64"]
    report = _run(setup, rows, tmp_path, mode, PATCHES, "score", *small)
    packed = {"packed rows", "cache-hit packed rows"} if mode == "token-packed" else set()  # (every row has a prefix)
    assert LAYOUTS[mode] - packed <= set(report["layouts"]), report["layouts"]
    got = _logliks(tmp_path)
    if "want" not in _WANT:
        items = _score_items(setup, rows)
        _WANT["want"] = _patched_reference(setup, items, PATCHES, rows)
        _WANT["plain"] = _patched_reference(setup, items, [], rows)
    want, plain = _WANT["want"], _WANT["plain"]
    assert got.keys() == want.keys()
    worst = max(abs(got[k] - want[k]) for k in want)
    assert worst < 1e-5, {k: (got[k], want[k]) for k in want if abs(got[k] - want[k]) >= 1e-5}
    assert all(abs(want[k] - plain[k]) > 1e-3 for k in want if k.startswith("x"))  # every patch changes its row
    assert all(want[k] == plain[k] for k in want if k.startswith("c"))  # the sources run unpatched


def test_probe_gen_states_after_a_patch_equal_plain_hooks(setup, tmp_path):
    """Another function, the same machinery: layer-2 states of every own token after patching
    layer 0's output at each row's positions, in tree rows."""
    from forge.functions.assets import embedded_dataset_path

    texts = [json.loads(line)["text"] for line in open(embedded_dataset_path())][:8]
    rows = [{"id": f"c{k}", "text": texts[k], "prefix": STORY} for k in range(4)]
    rows += [{"id": f"x{k}", "text": texts[4 + k], "prefix": STORY, "source": f"c{k}", "pos": [-1]} for k in range(4)]
    path = _write(tmp_path / "rows.jsonl", rows)
    entry = {"at": "resid_post.0", "op": "patch", "source": "row.source", "span": "row.pos"}
    options = ["layers=[2]", "pooling=none", "prefix_states=none"]
    _run(setup, path, tmp_path / "run", "token-merged", [entry], "probe_gen", *options)
    res = load(tmp_path / "run")
    from forge.api import InputSpec, ModelSpec
    from forge.functions.probe_gen import ProbeGen, ProbeGenConfig
    from forge.vocab.geometry import Item

    fn = ProbeGen(
        ProbeGenConfig(model=ModelSpec(name=str(setup.model_dir)), input=InputSpec(path=str(path)), layers=[2])
    )
    items = {it.id: it for it in fn.records() if isinstance(it, Item)}
    for item in items.values():
        seen: dict = {}
        handles = []
        if item.id.startswith("x"):
            src = items["c" + item.id[1:]]
            rec = setup.model.model.layers[0].register_forward_hook(
                lambda m, a, o, seen=seen: seen.update(v=(o[0] if isinstance(o, tuple) else o).clone())
            )
            with torch.inference_mode():
                setup.model(input_ids=torch.tensor([[int(t) for t in src.tokens]]), use_cache=False)
            rec.remove()
            value = seen.pop("v")

            def write(m, a, o, value=value, n=src.num_tokens):
                h = (o[0] if isinstance(o, tuple) else o).clone()
                h[0, -1] = value[0, n - 1]
                return (h, *o[1:]) if isinstance(o, tuple) else h

            handles.append(setup.model.model.layers[0].register_forward_hook(write))
        handles.append(
            setup.model.model.layers[1].register_forward_hook(
                lambda m, a, o, seen=seen: seen.update(h=o[0] if isinstance(o, tuple) else o)
            )
        )
        try:
            with torch.inference_mode():
                setup.model(input_ids=torch.tensor([[int(t) for t in item.tokens]]), use_cache=False)
        finally:
            for h in handles:
                h.remove()
        want = seen["h"][0, item.prefix_len :]
        if handles[:-1]:  # patched: its last state is not the plain model's
            with torch.inference_mode():
                plain = setup.model(input_ids=torch.tensor([[int(t) for t in item.tokens]]), output_hidden_states=True)
            assert (want[-1] - plain.hidden_states[2][0, -1]).abs().max() > 1e-3
        got = torch.from_numpy(res.columns["layer_2"][res.ids.index(item.id)])
        assert got.shape == want.shape and (got - want).abs().max() < 1e-5, item.id


# -- positions past an item's end: the row's recorded failure -------------------------------------


def test_a_position_past_an_items_end_is_its_rows_recorded_failure_and_the_counts_balance(setup, tmp_path):
    """Before, such a position was silently ignored: a patching sweep over prompts of other lengths
    could patch nothing without a word. Now each such row fails, with the position and its length."""
    rows = [json.loads(line) for line in open(setup.score_rows)]
    rows = [{**r, "pos": -33 if k == 5 else 7} for k, r in enumerate(rows)]
    path = _write(tmp_path / "rows.jsonl", rows)
    entries = [
        {"at": "resid_post.1", "op": "zero", "span": [5]},
        {"at": "mlp_out.0", "op": "add", "vector": "FILE", "span": "row.pos"},
    ]
    report = _run(setup, path, tmp_path / "run", "token-cache", entries, ok=False)
    items = report["items"]
    failures = {f["id"]: f["reason"] for f in report["failures"]}
    assert items["received"] == items["completed"] + items["failed"] + items["skipped"], items
    assert items["failed"] == len(failures) > 0 and items["completed"] > 0, items
    _, all_items = _items(setup)
    for it in all_items:
        row_k = next(k for k, r in enumerate(rows) if r["id"] == it.id.split("/")[0])
        pos = -33 if row_k == 5 else 7
        n = it.num_tokens
        if n <= 5:
            assert "intervene[0].span: position 5 is past the end of the item" in failures[it.id]
            assert f"which has {n} tokens" in failures[it.id]
        elif not -n <= pos < n:
            assert failures[it.id].endswith(
                f"intervene[1].span ('pos'): position {pos} is past the end of the item, which has {n} tokens "
                f"(positions 0..{n - 1}, or -{n}..-1)"
            ), failures[it.id]
        else:
            assert it.id not in failures
    assert {"empty", "one"} <= failures.keys()  # the short items: 6 and 4 tokens


def test_a_row_without_its_column_or_with_a_bad_value_fails_alone(setup, tmp_path):
    rows = [
        {"id": "a", "context": "Yes", "continuation": " no", "scale": 2.0},
        {"id": "b", "context": "Yes", "continuation": " no"},
        {"id": "c", "context": "Yes", "continuation": " no", "scale": "big"},
        {"id": "d", "context": "Yes", "continuation": " maybe", "scale": 1, "source": "nobody"},
    ]
    path = _write(tmp_path / "rows.jsonl", rows)
    entries = [
        {"at": "resid_post.1", "op": "add", "vector": "FILE", "scale": "row.scale"},
        {"at": "resid_post.0", "op": "patch", "source": "row.source", "span": [-1]},
    ]
    report = _run(setup, path, tmp_path / "run", "token-cache", entries, ok=False)
    reasons = {f["id"]: f["reason"] for f in report["failures"]}
    assert report["items"]["completed"] == 1 and set(reasons) == {"b", "c", "d"}, reasons
    assert reasons["b"].endswith(
        "intervene[0].scale: the row has no 'scale' field (scale: row.scale); give every row one"
    )
    assert reasons["c"].endswith("intervene[0].scale: 'big' in 'scale' is not a finite number")
    assert "intervene[1].source: no row with id 'nobody' in the input" in reasons["d"]


# -- refused before any work, in one line ---------------------------------------------------------

REFUSED = {
    "source-with-add": ("[{at: resid_post.1, vector: [1.0], source: row.s}]", "intervene[0].source='row.s': a source"),
    "vector-with-patch": (
        "[{at: resid_post.1, op: patch, source: row.s, vector: [1.0]}]",
        "intervene[0].vector: op=patch takes the source row's own activation; drop the vector",
    ),
    "patch-without-source": ("[{at: resid_post.1, op: patch}]", "intervene[0].source is missing: op=patch needs"),
    "index-without-table": (
        "[{at: resid_post.1, vector: [1.0, 2.0], index: row.k}]",
        "index picks a row of a [k, width]",
    ),
    "table-without-index": ("[{at: resid_post.1, vector: [[1.0], [2.0]]}]", "need one finite vector (1-D)"),
    "index-with-zero": ("[{at: resid_post.1, op: zero, index: 1}]", "intervene[0].index=1: op=zero takes no vector"),
    "no-column": ("[{at: resid_post.1, vector: [1.0], scale: row.}]", "name the input column after row."),
    "no-source-anywhere": (
        "[{at: resid_post.1, op: patch, source: row.clean}]",
        "intervene: op=patch reads each row's source from 'clean', but no row names one",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_cannot_be_exact_or_is_misspelt_is_refused_before_any_work(setup, tmp_path, case):
    value, message = REFUSED[case]
    with pytest.raises(ForgeError) as err:
        run_function(
            "score",
            setup.score_rows,
            tmp_path,
            [*SMALL_LIMITS, *MODES["token-cache"], "model=hf", f"model.name={setup.model_dir}", f"intervene={value}"],
        )
    text = str(err.value)
    assert message in text and "\n" not in text, text
    assert not (tmp_path / "report.json").exists()


def test_probe_gen_refuses_stored_prefix_states_with_per_row_entries(setup, tmp_path):
    entry = {"at": "resid_post.0", "op": "add", "vector": "FILE", "scale": "row.label", "span": "all"}
    with pytest.raises(ForgeError, match="prefix_states=once stores each prefix run as an item of its own, which has"):
        _run(setup, setup.probe_rows, tmp_path, "token-merged", [entry], "probe_gen", "layers=[2]", "pooling=none")
    assert not (tmp_path / "report.json").exists()


def test_the_fingerprint_names_the_columns_read_per_row(setup):
    fn, _ = _items(setup, intervene=[{"at": "resid_post.1", "vector": "FILE", "scale": "row.scale"}])
    assert fn.interventions.fingerprint()[0]["per_row"] == {"scale": "scale"}
    other, _ = _items(setup, intervene=[{"at": "resid_post.1", "vector": "FILE", "scale": "row.other"}])
    assert other.fingerprint()["intervene"] != fn.fingerprint()["intervene"]


# -- every function over a causal LM ------------------------------------------------------------


def _columns_equal(got, want, rows: list[str]) -> None:
    for name, column in want.columns.items():
        for r in rows:
            a, b = got.columns[name][got.ids.index(r)], column[want.ids.index(r)]
            assert np.array_equal(np.asarray(a), np.asarray(b)), (name, r)


@pytest.mark.slow
@pytest.mark.parametrize(
    "function, options",
    [
        ("surprisal", []),
        ("logit_lens", ["layers=[1, 2]"]),
        ("token_entropy", []),
        ("probe_gen", ["layers=[2]", "pooling=mean"]),
        ("embed", []),
    ],
)
def test_every_function_takes_a_scale_per_row(setup, tmp_path, function, options):
    """The same rows at scales 0, 0.5, 1, 2 in one run and in four: every result field equal."""
    rows = [json.loads(line) for line in open(setup.probe_rows)]
    path = _write(tmp_path / "rows.jsonl", [{**r, "scale": SCALES[k % 4]} for k, r in enumerate(rows)])
    steer = {"at": "resid_post.0", "op": "add", "vector": "FILE", "span": "text"}
    _run(setup, path, tmp_path / "sweep", "token-merged", [{**steer, "scale": "row.scale"}], function, *options)
    got = load(tmp_path / "sweep")
    for s in SCALES:
        _run(setup, path, tmp_path / f"at-{s}", "token-merged", [{**steer, "scale": s}], function, *options)
        mine = [r["id"] for k, r in enumerate(rows) if SCALES[k % 4] == s]
        _columns_equal(got, load(tmp_path / f"at-{s}"), mine)


def test_a_rows_span_is_a_position_a_list_of_them_or_a_span_name(setup, tmp_path):
    """What each row's `pos` resolves to (`ItemMeta.steer`): positions of its own sequence."""
    from forge.api import InputSpec, ModelSpec
    from forge.functions.score import Score, ScoreConfig
    from forge.vocab.geometry import Item
    from forge.vocab.records import Rejected

    spans = {"a": 2, "b": [0, -1], "c": "last", "d": "text", "e": "middle", "f": [1, 2.5]}
    rows = [{"id": k, "context": "Yes and", "continuation": " no", "pos": v} for k, v in spans.items()]
    path = _write(tmp_path / "rows.jsonl", rows)
    entry = {"at": "resid_post.1", "op": "zero", "span": "row.pos"}
    fn = Score(
        ScoreConfig(model=ModelSpec(name=str(setup.model_dir)), input=InputSpec(path=str(path)), intervene=[entry])
    )
    made = {r.id if isinstance(r, Item) else r.record_id: r for r in fn.records()}
    item = made["a"]
    n, p = item.num_tokens, item.prefix_len
    got = {k: made[k].meta.steer[0].positions for k in "abcd"}
    assert got == {"a": (2,), "b": (0, n - 1), "c": (n - 1,), "d": tuple(range(p, n))}
    for k in "ef":
        assert isinstance(made[k], Rejected) and "intervene[0].span ('pos'): " in made[k].reason
        assert "is not a position (a whole number; negative counts from the end)" in made[k].reason


def test_one_source_for_every_row_is_its_id(setup, tmp_path):
    """`source: c` (not row.<column>): every row takes row c's activation, c itself included."""
    from forge.api import InputSpec, ModelSpec
    from forge.functions.score import Score, ScoreConfig
    from forge.vocab.geometry import Item

    rows = [{"id": k, "context": "Yes and", "continuation": t} for k, t in (("c", " no"), ("a", " maybe so"))]
    path = _write(tmp_path / "rows.jsonl", rows)
    entry = {"at": "resid_post.1", "op": "patch", "source": "c", "span": [-1]}
    fn = Score(
        ScoreConfig(model=ModelSpec(name=str(setup.model_dir)), input=InputSpec(path=str(path)), intervene=[entry])
    )
    items = {it.id: it for it in fn.records() if isinstance(it, Item)}
    c, a = items["c"], items["a"]
    for item in (c, a):
        got = item.meta.steer[0]
        assert list(got.source) == list(c.tokens) and got.positions == (item.num_tokens - 1,)
        assert got.source_positions == (c.num_tokens - 1,)
