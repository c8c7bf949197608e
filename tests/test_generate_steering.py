"""Steered generation: `intervene:` in generate equals one-prompt-at-a-time `generate` with the same
forward hook, token for token, in every batching mode and in every family of the exactness matrix.

The reference shares nothing with Forge's decoder but the model's files and the layer a hook point
names: each row alone through `model.generate` (no padding), a plain forward hook on that decoder
layer adding ``scale * vector`` to its output at the positions the span covers (it counts the
positions itself: the prompt in the first pass, one token a pass after it).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

from conftest import embedded_model_dir

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_generate import FAMILY_NAMES, ROWS, N, Reference, _write, family, limits, run_model  # noqa: E402

from forge.errors import ForgeError  # noqa: E402
from forge.io.results import load  # noqa: E402
from forge.testing import MODES, run_function  # noqa: E402

LAYER, SCALE = 1, 4.0
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def covered(span: str, pos: torch.Tensor, prefix_len: int, prompt_len: int) -> torch.Tensor:
    """bool per position: where `span` adds the vector (generate's spans, over prompt and generated tokens)."""
    if span == "all":
        return torch.ones_like(pos, dtype=torch.bool)
    if span == "prefix":
        return pos < prefix_len
    if span == "text":
        return (pos >= prefix_len) & (pos < prompt_len)
    if span == "last":
        return pos == prompt_len - 1
    if span == "generated":
        return pos >= prompt_len
    if isinstance(span, list):  # positions from the first token, generated ones included
        return torch.isin(pos, torch.tensor(span))
    raise ValueError(span)


def steered_greedy(
    model, ids: list[int], prefix_len: int, n: int, vector: torch.Tensor, span: str, scale: float = SCALE
) -> list[int]:
    """One prompt alone through `generate`, a forward hook on decoder layer LAYER steering its output."""
    from forge.runtime.hooks.points import decoder_layers
    from forge.runtime.model.hf_compat import base_decoder, num_layers

    layer = decoder_layers(base_decoder(model), num_layers(model.config))[LAYER]
    seen = [0]

    def hook(module, args, output):
        h = output[0] if isinstance(output, tuple) else output
        pos = torch.arange(seen[0], seen[0] + h.shape[1])
        seen[0] += h.shape[1]
        m = covered(span, pos, prefix_len, len(ids)).to(h.dtype)[None, :, None]
        h = h + scale * vector.to(h.dtype) * m
        return (h, *output[1:]) if isinstance(output, tuple) else h

    return hooked_greedy(layer, hook, model, ids, n)


def hooked_greedy(layer, hook, model, ids: list[int], n: int) -> list[int]:
    """One prompt alone through `generate` with `hook` on `layer` (a plain PyTorch forward hook)."""
    handle = layer.register_forward_hook(hook)
    try:
        x = torch.tensor([ids])
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n)
    finally:
        handle.remove()
    return out[0, len(ids) :].tolist()


def prefix_len(ref: Reference, row: dict) -> int:
    return len(ref.tok(row["prefix"])["input_ids"]) if row.get("prefix") else 0


def vector_file(root: Path, width: int) -> tuple[Path, torch.Tensor]:
    rng = np.random.default_rng(5)
    v = rng.normal(size=width).astype(np.float32)
    path = root / f"steer-{width}.npy"
    np.save(path, v)
    return path, torch.from_numpy(v)


def steer(path: Path, span: str) -> str:
    return f"intervene=[{{at: resid_post.{LAYER}, op: add, vector: '{path}', scale: {SCALE}, span: {span}}}]"


def check(ref: Reference, run_dir: Path, vector: torch.Tensor, span: str) -> int:
    """Every row's tokens are the steered reference's; returns how many differ from the unsteered ones."""
    res = load(run_dir)
    by_id = {r["id"]: r for r in ROWS}
    assert sorted(res.ids) == sorted(by_id)
    changed = 0
    for k, rid in enumerate(res.ids):
        row = by_id[rid]
        want = steered_greedy(ref.model, ref.prompt(row), prefix_len(ref, row), N, vector, span)
        got = res.columns["generated_ids"][k].tolist()
        assert got == want, (run_dir.name, rid, got, want)
        changed += want != ref.new_tokens(row)
    return changed


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("steer")
    _write(root / "rows.jsonl", ROWS)
    return root


@pytest.fixture(scope="module")
def embedded(work) -> Reference:
    """The embedded model (its weights made from its seed) and tokenizer, in one directory."""
    return Reference(embedded_model_dir(work / "embedded-model"))


SPANS = ["all", "text", "prefix", "generated", "last"]


@pytest.mark.parametrize("span", SPANS)
def test_steered_greedy_equals_one_prompt_at_a_time_with_the_same_hook(work, embedded, span):
    path, vector = vector_file(work, int(embedded.model.config.hidden_size))
    run = work / f"steer-{span}"
    report = run_function("generate", work / "rows.jsonl", run, [*limits(), steer(path, span)])
    assert report["items"]["completed"] == len(ROWS) and report["balanced"], report.get("failures")
    assert check(embedded, run, vector, span) > 0  # the steering changes some rows' text


def test_positions_past_the_prompt_steer_the_generated_tokens_there(work, embedded):
    """A constant position counts from the sequence's first token, generated ones included: it may lie
    past a prompt (up to its max_new_tokens), and a position past that fails the row, naming both."""
    path, vector = vector_file(work, int(embedded.model.config.hidden_size))
    shortest = min(len(embedded.prompt(r)) for r in ROWS)
    positions = [1, shortest + 1]  # the second: a generated token of the shortest prompts
    run = work / "steer-positions"
    report = run_function("generate", work / "rows.jsonl", run, [*limits(), steer(path, str(positions))])
    assert report["items"]["completed"] == len(ROWS) and report["balanced"], report.get("failures")
    assert check(embedded, run, vector, positions) > 0
    longest = max(len(embedded.prompt(r)) for r in ROWS)
    far = work / "steer-far"
    over = [*limits(), steer(path, f"[{longest + N}]"), "runtime.max_failure_share=1"]
    report = run_function("generate", work / "rows.jsonl", far, over)
    assert report["items"]["failed"] == len(ROWS) and report["balanced"]
    reasons = [f["reason"] for f in report["failures"]]
    assert all("past the end of the prompt and its max_new_tokens" in r for r in reasons), reasons[:2]


def test_a_position_from_the_end_is_refused_in_one_line(work, embedded):
    path, _ = vector_file(work, int(embedded.model.config.hidden_size))
    with pytest.raises(ForgeError, match="counts from the end") as err:
        run_function("generate", work / "rows.jsonl", work / "steer-neg", [*limits(), steer(path, "[-1]")])
    assert "\n" not in str(err.value) and "span: last" in str(err.value)


CASES = [(mode, span) for mode in MODES for span in ("all", "generated")]


@pytest.mark.slow
@pytest.mark.parametrize("mode,span", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_steered_greedy_in_every_batching_mode(work, embedded, mode, span):
    path, vector = vector_file(work, int(embedded.model.config.hidden_size))
    run = work / f"steer-mode-{mode}-{span}"
    room = ["devices.cpu_memory_gb=0.08"] if mode == "memory" else []
    extra = ["max_running=3", "shard_size=2"] if mode == "item" else []  # waiting rows, parts committed
    report = run_function(
        "generate", work / "rows.jsonl", run, [*limits(), *MODES[mode], *room, *extra, steer(path, span)]
    )
    assert report["items"]["completed"] == len(ROWS) and report["balanced"], report.get("failures")
    assert check(embedded, run, vector, span) > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_steered_greedy_in_each_family(work, name):
    ref = family(name, work)
    width = int(ref.model.config.get_text_config().hidden_size)
    path, vector = vector_file(work, width)
    span = "all" if FAMILY_NAMES.index(name) % 2 == 0 else "generated"
    run = work / f"steer-{name}"
    report = run_model(run, ref.path, work / "rows.jsonl", steer(path, span))
    assert report["items"]["completed"] == len(ROWS) and report["items"]["failed"] == 0, report.get("failures")
    check(ref, run, vector, span)


def test_a_steered_prefix_is_never_served_from_an_unsteered_ones_cache(embedded):
    """One decoder's prefix store, filled by unsteered prompts, then read by a steered decoder: the
    steered prefixes are computed anew (none found stored) and the tokens are the steered ones; and
    back: an unsteered decoder never takes the steered prefixes."""
    from forge.runtime.decoder.engine import Decoder, Sequence
    from forge.runtime.hooks.interventions import load_interventions
    from forge.runtime.hooks.points import HookSet
    from forge.runtime.model.hf_compat import base_decoder, num_layers

    model = copy.deepcopy(embedded.model)
    rows = [r for r in ROWS if r.get("prefix")]
    width = int(model.config.hidden_size)
    vector = torch.from_numpy(np.random.default_rng(5).normal(size=width).astype(np.float32))

    def seqs():
        return [Sequence(k, embedded.prompt(r), prefix_len(embedded, r), N, (), None) for k, r in enumerate(rows)]

    ivs = load_interventions([{"at": f"resid_post.{LAYER}", "vector": vector.tolist(), "scale": SCALE, "span": "all"}])
    hooks = HookSet(model, base_decoder(model), num_layers(model.config), [], list(ivs.items))
    plain = Decoder(model, embedded.tok, 256, {2}, 3)
    hooks.close()  # the plain decoder runs the model without them
    plain.generate(seqs())
    assert len(plain.prefixes)
    hooks = HookSet(model, base_decoder(model), num_layers(model.config), [], list(ivs.items))
    steered = Decoder(model, embedded.tok, 256, {2}, 3, steer=(hooks, ivs.key))
    steered.prefixes = plain.prefixes  # the same store
    got = seqs()
    figures = steered.generate(got)
    assert figures.prefix_stored_tokens == 0 and figures.prefix_hits == 0
    for seq, row in zip(got, rows):
        assert seq.out == steered_greedy(
            embedded.model, embedded.prompt(row), prefix_len(embedded, row), N, vector, "all"
        )
    hooks.close()
    again = Decoder(model, embedded.tok, 256, {2}, 3)
    again.prefixes = steered.prefixes
    back = seqs()
    figures = again.generate(back)
    assert figures.prefix_stored_tokens == sum(s.prefix_len for s in back)  # the unsteered ones, kept
    assert [s.out for s in back] == [embedded.new_tokens(r) for r in rows]


def test_span_generated_is_for_generate_only_and_states_wait_for_their_own_steering(work):
    texts = _write(work / "texts.jsonl", [{"id": "a", "text": "one two three"}])
    zero = "intervene=[{at: mlp_out.1, op: zero, span: generated}]"
    with pytest.raises(ForgeError, match="span 'generated' is for generate only"):
        run_function("probe_gen", texts, work / "generated-span", [zero])
    with pytest.raises(ForgeError, match="intervene with layers or capture is not supported yet"):
        run_function("generate", work / "rows.jsonl", work / "steer-states", [*limits(), zero, "layers=[1]"])
    assert not (work / "steer-states" / "report.json").exists()


# -- per-row interventions: a sweep or patching pairs in one batched generate run ---------------------

SCALES = (0.0, 0.5, 1.0, 2.0)


def _ids(run_dir: Path) -> dict[str, list[int]]:
    res = load(run_dir)
    return {rid: res.columns["generated_ids"][k].tolist() for k, rid in enumerate(res.ids)}


def _sweep(work: Path) -> Path:
    return _write(work / "sweep.jsonl", [{**r, "scale": SCALES[k % 4], "dir": k % 3} for k, r in enumerate(ROWS)])


SWEEP_MODES = ["token-cache"] + [pytest.param(m, marks=pytest.mark.slow) for m in MODES if m != "token-cache"]
SWEEPS = [("token-cache", "generated"), ("token-cache", "all")] + [  # span all: every mode's prefixes changed
    pytest.param(m, "all", marks=pytest.mark.slow) for m in MODES if m != "token-cache"
]


@pytest.mark.parametrize("mode,span", SWEEPS)
def test_a_scale_per_row_equals_one_generate_run_per_constant_scale(work, embedded, mode, span):
    """Rows at scales 0, 0.5, 1, 2 in one run generate, token for token, what four runs at each
    constant scale generate for them; with span all, rows under one few-shot prefix at different
    scales each read their own prefix's keys and values (a prefix changed alike is shared)."""
    path, _ = vector_file(work, int(embedded.model.config.hidden_size))
    rows = _sweep(work)
    entry = f"{{at: resid_post.{LAYER}, op: add, vector: '{path}', span: {span}, scale: "
    extra = [*MODES[mode], *(["devices.cpu_memory_gb=0.08"] if mode == "memory" else [])]
    run = work / f"sweep-{mode}-{span}"
    report = run_function("generate", rows, run, [*limits(), *extra, f"intervene=[{entry}row.scale}}]"])
    assert report["items"]["completed"] == len(ROWS) and report["balanced"], report.get("failures")
    got = _ids(run)
    scale_of = {r["id"]: SCALES[k % 4] for k, r in enumerate(ROWS)}
    want = {}
    for s in SCALES:
        at = work / f"at-{mode}-{span}-{s}"
        run_function("generate", rows, at, [*limits(), *extra, f"intervene=[{entry}{s}}}]"])
        want[s] = _ids(at)
    assert {rid: want[scale_of[rid]][rid] for rid in got} == got
    assert len({tuple(want[s][ROWS[0]["id"]]) for s in SCALES}) > 1  # the scales steer differently


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_a_scale_per_row_in_each_family_equals_a_hooked_generate_per_row(work, name):
    """Rows at their own scales (span all: their prefixes too) in one run: each row's tokens are
    those of one-at-a-time `generate` with a plain hook at its scale, in every family of the matrix
    (shared-prefix attention and right-aligned slots alike)."""
    ref = family(name, work)
    path, vector = vector_file(work, int(ref.model.config.get_text_config().hidden_size))
    entry = f"{{at: resid_post.{LAYER}, op: add, vector: '{path}', scale: row.scale, span: all}}"
    run = work / f"sweep-{name}"
    report = run_model(run, ref.path, _sweep(work), f"intervene=[{entry}]")
    assert report["items"]["completed"] == len(ROWS) and report["items"]["failed"] == 0, report.get("failures")
    got = _ids(run)
    for k, row in enumerate(ROWS):
        ids, first = ref.prompt(row), prefix_len(ref, row)
        assert got[row["id"]] == steered_greedy(ref.model, ids, first, N, vector, "all", SCALES[k % 4]), row["id"]


def test_a_vector_per_row_from_a_table_equals_a_hooked_generate_per_row(work, embedded):
    """`index: row.dir` picks each row's vector from a [3, width] file: every row's tokens are those
    of one-at-a-time `generate` with a plain hook adding its own vector."""
    width = int(embedded.model.config.hidden_size)
    table = np.random.default_rng(9).normal(size=(3, width)).astype(np.float32)
    np.save(work / "table.npy", table)
    rows = _sweep(work)
    vectors = work / "table.npy"
    entry = f"{{at: resid_post.{LAYER}, op: add, vector: '{vectors}', index: row.dir, scale: {SCALE}, span: all}}"
    run = work / "table-run"
    report = run_function("generate", rows, run, [*limits(), f"intervene=[{entry}]"])
    assert report["items"]["completed"] == len(ROWS) and report["balanced"], report.get("failures")
    got = _ids(run)
    for k, row in enumerate(ROWS):
        vector = torch.from_numpy(table[k % 3])
        want = steered_greedy(embedded.model, embedded.prompt(row), prefix_len(embedded, row), N, vector, "all")
        assert got[row["id"]] == want, row["id"]


def patched_greedy(model, ids: list[int], source: list[int], at: list[int], src: list[int], n: int) -> list[int]:
    """One prompt alone through `generate`, a plain hook on decoder layer LAYER writing the source
    prompt's own output there (recorded by a hook on the source's run alone) at positions `at`."""
    from forge.runtime.hooks.points import decoder_layers
    from forge.runtime.model.hf_compat import base_decoder, num_layers

    layer = decoder_layers(base_decoder(model), num_layers(model.config))[LAYER]
    seen: dict = {}
    record = layer.register_forward_hook(lambda m, a, o: seen.update(v=(o[0] if isinstance(o, tuple) else o)[0]))
    with torch.inference_mode():
        model(input_ids=torch.tensor([source]), use_cache=False)
    record.remove()
    done = [0]

    def write(module, args, output):
        h = (output[0] if isinstance(output, tuple) else output).clone()
        for p, s in zip(at, src):
            if done[0] <= p < done[0] + h.shape[1]:
                h[0, p - done[0]] = seen["v"][s]
        done[0] += h.shape[1]
        return (h, *output[1:]) if isinstance(output, tuple) else h

    return hooked_greedy(layer, write, model, ids, n)


@pytest.mark.parametrize("mode", SWEEP_MODES)
def test_patching_pairs_in_one_generate_run_equal_one_at_a_time_patching_with_plain_hooks(work, embedded, mode):
    """Clean/corrupted pairs: each corrupted row's prompt takes its clean row's activation at its
    last prompt token (span last), or at positions its row names (a prefix token among them);
    one batched run generates what `generate` with plain hooks generates, one prompt at a time."""
    pairs = []
    for k, row in enumerate(ROWS[:8]):
        pairs.append({**row, "id": f"c{k}"})
        other = ROWS[(k + 4) % len(ROWS)]
        pairs.append({**other, "id": f"x{k}", "source": f"c{k}", "pos": [1, 3] if k % 2 else [2]})
    rows = _write(work / f"pairs-{mode}.jsonl", pairs)
    entries = (
        f"{{at: resid_post.{LAYER}, op: patch, source: row.source, span: last}}, "
        f"{{at: resid_post.{LAYER}, op: patch, source: row.source, span: row.pos}}"
    )
    extra = [*MODES[mode], *(["devices.cpu_memory_gb=0.08"] if mode == "memory" else [])]
    run = work / f"pairs-run-{mode}"
    report = run_function("generate", rows, run, [*limits(), *extra, f"intervene=[{entries}]"])
    assert report["items"]["completed"] == len(pairs) and report["balanced"], report.get("failures")
    got = _ids(run)
    by_id = {r["id"]: r for r in pairs}
    changed = 0
    for r in pairs:
        ids = embedded.prompt(r)
        if "source" not in r:  # a clean row: no source, not patched
            assert got[r["id"]] == embedded.new_tokens(r), r["id"]
            continue
        source = embedded.prompt(by_id[r["source"]])
        at, src = [len(ids) - 1, *r["pos"]], [len(source) - 1, *r["pos"]]
        want = patched_greedy(embedded.model, ids, source, at, src, N)
        assert got[r["id"]] == want, r["id"]
        changed += want != embedded.new_tokens(r)
    assert changed > 0


def test_per_row_positions_in_generate_count_from_the_first_token_and_never_from_the_end(work, embedded):
    """A row's positions may reach its generated tokens (up to its max_new_tokens); one past them, or
    one counted from the end, fails that row alone with the reason, and the counts balance."""
    path, vector = vector_file(work, int(embedded.model.config.hidden_size))
    shortest = min(len(embedded.prompt(r)) for r in ROWS)
    bad = {ROWS[0]["id"]: [-1], ROWS[1]["id"]: [len(embedded.prompt(ROWS[1])) + N]}
    rows = _write(
        work / "row-pos.jsonl", [{**r, "pos": bad.get(r["id"], [1, shortest + 1])} for r in ROWS]
    )  # fmt: skip
    entry = f"{{at: resid_post.{LAYER}, op: add, vector: '{path}', scale: {SCALE}, span: row.pos}}"
    run = work / "row-pos"
    report = run_function("generate", rows, run, [*limits(), f"intervene=[{entry}]", "runtime.max_failure_share=1"])
    assert report["items"]["completed"] == len(ROWS) - 2 and report["items"]["failed"] == 2, report["items"]
    assert report["balanced"]
    reasons = {f["id"]: f["reason"] for f in report["failures"]}
    assert "counts from the end, which a generation has not reached" in reasons[ROWS[0]["id"]]
    past = reasons[ROWS[1]["id"]]
    assert "past the end of the prompt and its max_new_tokens" in past and "..-1" not in past, past  # no from-end range
    got = _ids(run)
    for row in ROWS[2:]:
        want = steered_greedy(
            embedded.model, embedded.prompt(row), prefix_len(embedded, row), N, vector, [1, shortest + 1]
        )
        assert got[row["id"]] == want, row["id"]


def test_patching_generated_tokens_is_refused_before_any_work(work):
    entry = "intervene=[{at: resid_post.1, op: patch, source: row.source, span: generated}]"
    with pytest.raises(ForgeError, match="has nothing to patch from") as err:
        run_function("generate", work / "rows.jsonl", work / "patch-generated", [*limits(), entry])
    assert "\n" not in str(err.value)
    assert not (work / "patch-generated" / "report.json").exists()
