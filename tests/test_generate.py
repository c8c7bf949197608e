"""generate: greedy text through Forge's continuous-batching decoder, token for token what
one-prompt-at-a-time `generate` gives, in every batching mode, at any step budget and in every
family it runs; sampling the same in any batch; stop strings, per-row limits, the step budget in
the ledger, the states of the generated tokens, kill -9 and resume.

The reference shares nothing with Forge but the model's files: each row is tokenized with
`AutoTokenizer` (a prefix with special tokens, the prompt after it without; a prompt alone with
them) and run alone through `model.generate(ids, do_sample=False, max_new_tokens=N)`: no padding,
the model's own end-of-sequence token (generation stops there, the token kept).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import embedded_model_dir, plan_forge

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from forge.errors import ForgeError  # noqa: E402
from forge.io.results import load  # noqa: E402
from forge.testing import MODES, run_function  # noqa: E402

N = 8  # max_new_tokens of the runs
N_LONG = 12  # the longer greedy run per-row limits are cut from
TOL = 1e-4
SMALL_BUDGET, LARGE_BUDGET = 128, 1024


def limits(budget: int = SMALL_BUDGET) -> list[str]:
    """Steps of `budget` tokens; max_seq_len covers an item's geometry (a ~75-token prompt + N_LONG)."""
    return [
        "devices=auto",
        f"devices.limits.max_batch_tokens={budget}",
        "devices.limits.max_seq_len=128",
        f"budget.tokens_per_step={budget}",
        f"max_new_tokens={N}",
    ]


def _rows() -> list[dict]:
    """12 embedded prompts: 11 under 3 few-shot prefixes (4, 4, 3) and one without a prefix."""
    from forge.functions.assets import ASSETS_DIR

    rows = [json.loads(line) for line in open(Path(ASSETS_DIR) / "prompts.jsonl")]
    prefixes = list(dict.fromkeys(r["prefix"] for r in rows if r.get("prefix")))[:3]
    out = [r for r in rows if r.get("prefix") in prefixes][:12]
    out[-1] = {"id": out[-1]["id"], "prompt": out[-1]["prompt"]}
    return out


ROWS = _rows()


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prompt_ids(tok, row: dict) -> list[int]:
    if row.get("prefix"):
        return tok(row["prefix"])["input_ids"] + tok(row["prompt"], add_special_tokens=False)["input_ids"]
    return tok(row["prompt"])["input_ids"]


def greedy(model, ids: list[int], n: int) -> list[int]:
    """One prompt alone through `generate`: its new tokens (ending at EOS when the model emits it)."""
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n)
    return out[0, len(ids) :].tolist()


class Reference:
    """A model dir's tokenizer and model, and each row's greedy tokens (computed once per length)."""

    def __init__(self, path: Path):
        self.path = path
        self.tok = transformers.AutoTokenizer.from_pretrained(str(path))
        self.model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        self._runs: dict[tuple[str, int], list[int]] = {}

    def prompt(self, row: dict) -> list[int]:
        return prompt_ids(self.tok, row)

    def new_tokens(self, row: dict, n: int = N) -> list[int]:
        key = (row["id"], n)
        if key not in self._runs:
            self._runs[key] = greedy(self.model, self.prompt(row), n)
        return self._runs[key]

    def divergence(self, row: dict, got: list[int], want: list[int]) -> str:
        """Where `got` leaves the greedy tokens, and the reference's top-2 logit gap there."""
        at = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        ids = torch.tensor([self.prompt(row) + want[:at]])
        with torch.inference_mode():
            top = self.model(input_ids=ids).logits[0, -1].topk(2).values
        gap = (top[0] - top[1]).item()
        return f"first differing token {at}: got {got[at : at + 3]}, want {want[at : at + 3]}; logit gap {gap:.3g}"

    def check(self, run_dir: Path, rows: list[dict], n: int = N) -> None:
        """Every row of `rows` committed once, its tokens the greedy ones, its figures consistent."""
        res = load(run_dir)
        by_id = {r["id"]: r for r in rows}
        assert sorted(res.ids) == sorted(by_id), (res.ids, list(by_id))
        for k, rid in enumerate(res.ids):
            row, got = by_id[rid], res.columns["generated_ids"][k].tolist()
            want = self.new_tokens(row, n)
            assert got == want, f"{run_dir.name} {rid}: {self.divergence(row, got, want)}"
            assert res.columns["num_prompt_tokens"][k] == len(self.prompt(row)), rid
            assert res.columns["num_generated_tokens"][k] == len(want), rid
            assert res.columns["text"][k] == self.tok.decode(want, skip_special_tokens=True), rid
            eos = want[-1] in _eos_ids(self.model)
            assert res.columns["finish_reason"][k] == ("eos" if eos else "length"), rid


def _eos_ids(model) -> set[int]:
    ids = model.generation_config.eos_token_id
    return set(ids if isinstance(ids, list) else [] if ids is None else [ids])


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("generate")
    _write(root / "rows.jsonl", ROWS)
    return root


@pytest.fixture(scope="module")
def embedded(work) -> Reference:
    """The embedded model (weights from its seed) with its tokenizer, in one directory."""
    return Reference(embedded_model_dir(work / "embedded-model"))


@pytest.fixture(scope="module")
def base(work):
    """One run on the embedded default (batching=token) under steps of SMALL_BUDGET tokens."""
    report = run_function("generate", work / "rows.jsonl", work / "base", limits())
    return report, load(work / "base")


# -- greedy equality -----------------------------------------------------------------------------


def test_greedy_equals_one_prompt_at_a_time(work, base, embedded):
    report, _ = base
    assert report["items"]["completed"] == len(ROWS) and report["balanced"], report.get("failures")
    assert report["path"].startswith("llama: continuous batching")
    embedded.check(work / "base", ROWS)


CASES = [(mode, budget) for mode in MODES for budget in (SMALL_BUDGET, LARGE_BUDGET)]


@pytest.mark.slow
@pytest.mark.parametrize("mode,budget", CASES, ids=[f"{m}-{b}" for m, b in CASES])
def test_greedy_in_every_batching_mode_and_budget(work, embedded, mode, budget):
    """Item batches, prefix groups with and without the cache, packed rows, memory-sized and merged
    batches; a small budget splits prompts' prefill across steps, a large one takes them whole."""
    run = work / f"mode-{mode}-{budget}"
    # memory: beside the weights, a step of `budget` tokens' activations (the KV model, Generate.cost_model)
    room = ["devices.cpu_memory_gb=0.08"] if mode == "memory" else []
    report = run_function("generate", work / "rows.jsonl", run, [*limits(budget), *MODES[mode], *room])
    assert report["items"]["completed"] == len(ROWS) and report["balanced"], report.get("failures")
    assert "tree rows" not in report["layouts"]  # the engine takes prompts: prefix groups are never merged
    embedded.check(run, ROWS)
    gen = report["outputs"]["generation"]
    assert gen["tokens_per_step_budget"] == budget and 0 < gen["largest_step_tokens"] <= budget, gen
    assert sum(gen["steps_by_tokens"].values()) == gen["steps"]
    # the ledger's prefix tokens not run: the decoder's, held from an earlier batch or computed once for several
    tokens = report["tokens"]
    assert tokens["cache_hit"] + tokens["prefix_shared"] == gen["prefill_tokens_shared"] > 0, (tokens, gen)
    if mode == "item":  # whole prompts in several batches: later ones find prefixes the worker stored
        assert report["batches"] > 1 and gen["prefix_cache_hits"] > 0 and tokens["cache_hit"] > 0, (tokens, gen)
    # each distinct prefix computed once on the device, by the decoder (or split off a batch), and said so;
    # the plan (no model) predicts the same sharing
    prefixes = report["prefixes"]
    assert prefixes["computed"] == prefixes["distinct"] == 3, prefixes
    assert set(prefixes["computed_in"]) == ({"split-prefix batches"} if mode == "token-packed" else {"engine"})
    plan = plan_forge("function=generate", f"input.path={work / 'rows.jsonl'}", *limits(budget), *MODES[mode], *room)
    assert plan["prefixes"] == prefixes
    assert [plan["tokens"][k] for k in ("cache_hit", "prefix_shared")] == [tokens["cache_hit"], tokens["prefix_shared"]]


# -- families ------------------------------------------------------------------------------------

FAMILY_NAMES = [
    "llama",
    "qwen2",
    "phi3",
    "mistral-window",
    "gemma2",
    "gemma3",
    "gpt_oss",
    "mixtral",
    "gpt2",
    "gpt_neox",
    "opt",
    "falcon",
    "falcon-alibi",
    "stablelm",
    "bloom",
    "deepseek_v3",
]
_FAMILIES: dict[str, Reference] = {}


def family(name: str, root: Path) -> Reference:
    """A tiny random-weight model of the family (tests/test_fidelity.py's), built once per module."""
    if name not in _FAMILIES:
        from test_fidelity import _config, _save

        path, _ = _save(_config(name), root / f"family-{name}")
        _FAMILIES[name] = Reference(path)
    return _FAMILIES[name]


_COMPOSED: dict[tuple, object] = {}


def run_model(run_dir: Path, model_dir: Path, rows: Path, *overrides: str):
    """`forge run function=generate model=hf model.name=DIR` in this process (composed once per overrides)."""
    from forge.cli.build import build_spec
    from forge.cli.compose import compose
    from forge.driver.engine import execute
    from forge.pluginmanager import make_plugin_manager

    key = (str(rows), overrides)
    if key not in _COMPOSED:
        _COMPOSED[key] = compose(
            ["function=generate", "model=hf", "model.name=DIR", f"input.path={rows}", "runtime.executor=inprocess"]
            + [*limits(), *overrides]
        )
    cfg = copy.deepcopy(_COMPOSED[key])
    cfg.model.name = str(model_dir)
    return execute(build_spec(cfg, run_dir), make_plugin_manager())


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_greedy_equals_one_prompt_at_a_time_in_each_family(work, name):
    ref = family(name, work)
    report = run_model(work / f"run-{name}", ref.path, work / "rows.jsonl")
    assert report["items"]["completed"] == len(ROWS) and report["items"]["failed"] == 0, report.get("failures")
    assert report["balanced"]
    ref.check(work / f"run-{name}", ROWS)


def test_a_cache_class_of_the_models_own_is_refused_and_the_scan_is_kept_for_later_runs(tmp_path, monkeypatch):
    """The scan of the model's code for a cache class of its own imports that code (about 1 s the
    driver otherwise never spends): its answer is kept with the class's facts, so a later run
    neither imports the module nor asks again, and gives the same verdict."""
    import sys
    import types

    from forge.runtime.decoder import fit

    monkeypatch.setenv("FORGE_CACHE", str(tmp_path))
    module = types.ModuleType("forge_test_own_cache")
    module.OwnCache = type("OwnCache", (transformers.DynamicCache,), {"__module__": module.__name__})
    monkeypatch.setitem(sys.modules, module.__name__, module)
    llama = "transformers.models.llama.modeling_llama"
    assert "keeps its own cache (OwnCache)" in fit.decoder_refusal(transformers.LlamaConfig(), module.__name__)
    assert fit.decoder_refusal(transformers.LlamaConfig(), llama) is None
    monkeypatch.delitem(sys.modules, module.__name__)

    def scan(name):
        raise AssertionError(f"{name} scanned again")

    monkeypatch.setattr(fit, "_own", scan)
    assert "keeps its own cache (OwnCache)" in fit.decoder_refusal(transformers.LlamaConfig(), module.__name__)
    assert fit.decoder_refusal(transformers.LlamaConfig(), llama) is None
    # another transformers version or config class scans afresh
    with pytest.raises(AssertionError, match="scanned again"):
        fit.decoder_refusal(transformers.MistralConfig(), "transformers.models.mistral.modeling_mistral")


def test_a_model_whose_cache_is_not_keys_and_values_is_refused_before_work(work):
    """A recurrent state, KV shared across layers, a cache class of the model's own: one line each;
    transformer decoders of every kind above go through."""
    from forge.runtime.decoder.fit import decoder_refusal

    assert "linear_attention" in decoder_refusal(transformers.MambaConfig())
    assert "DummyLayer" in decoder_refusal(transformers.Gemma3nTextConfig())
    assert "encoder-decoder" in decoder_refusal(transformers.T5Config())
    assert decoder_refusal(transformers.LlamaConfig(), "transformers.models.llama.modeling_llama") is None
    assert decoder_refusal(transformers.GptOssConfig()) is None
    cfg = transformers.MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=2048, state_size=4)
    path, _ = __import__("test_fidelity")._save(cfg, work / "family-mamba")
    with pytest.raises(ForgeError, match="generate cannot run mamba: .*linear_attention") as err:
        run_model(work / "refused-mamba", path, work / "rows.jsonl")
    assert "\n" not in str(err.value)
    assert not (work / "refused-mamba" / "report.json").exists()


@pytest.mark.slow
def test_eos_ends_a_row_and_eos_false_runs_on(work, embedded):
    """The embedded model with a second EOS id, a token its greedy text emits: rows stop at it (kept,
    finish_reason eos) as `generate` does; `eos=false` runs every row to its limit."""
    import shutil

    path = work / "embedded-eos"
    shutil.copytree(embedded.path, path)
    first = [embedded.new_tokens(r) for r in ROWS]
    held = [(sum(t in ids[1:] for ids in first), t) for t in sorted({t for ids in first for t in ids[1:]})]
    token = max(h for h in held if h[0] < len(ROWS))[1]  # a token some rows emit (not first) and others never
    config = transformers.GenerationConfig.from_model_config(embedded.model.config)
    config.eos_token_id = [int(embedded.model.config.eos_token_id), int(token)]
    config.save_pretrained(path)
    ref = Reference(path)
    report = run_model(work / "eos-on", path, work / "rows.jsonl")
    assert report["items"]["completed"] == len(ROWS)
    ref.check(work / "eos-on", ROWS)
    res = load(work / "eos-on")
    reasons = list(res.columns["finish_reason"])
    assert "eos" in reasons and "length" in reasons, reasons  # some rows stopped early, some ran on
    report = run_model(work / "eos-off", path, work / "rows.jsonl", "eos=false")
    off = load(work / "eos-off")
    for k, rid in enumerate(off.ids):
        row = next(r for r in ROWS if r["id"] == rid)
        assert off.columns["generated_ids"][k].tolist() == embedded.new_tokens(row), rid  # no EOS: N tokens
        assert off.columns["finish_reason"][k] == "length"


# -- stop strings and per-row limits -------------------------------------------------------------


def _stop_string(texts: list[str]) -> str:
    """An alphanumeric piece some texts hold after their first character and others lack."""
    pieces = {t[i : i + k] for t in texts for k in (3, 2, 1) for i in range(1, len(t) - k + 1)}
    pieces = {p for p in pieces if p.isalnum() and p.isascii()}
    best = [(sum(p in t for t in texts), len(p), p) for p in sorted(pieces)]
    best = [b for b in best if 0 < b[0] < len(texts)]
    assert best, texts
    return max(best)[2]


def _cut(tok, ids: list[int], stops: list[str]) -> tuple[list[int], str, bool]:
    """Independently of Forge: the text before the first stop string, and the fewest ids whose text holds it."""
    text = tok.decode(ids, skip_special_tokens=True)
    hits = [text.find(s) for s in stops if s in text]
    if not hits:
        return ids, text, False
    at = min(hits)
    stop = next(s for s in stops if text.find(s) == at)
    k = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k], skip_special_tokens=True))
    return ids[:k], text[:at], True


@pytest.mark.slow
def test_stop_strings_and_per_row_max_new_tokens(work, base, embedded):
    _, res = base
    texts = {rid: str(t) for rid, t in zip(res.ids, res.columns["text"])}
    stop = _stop_string(list(texts.values()))
    holders = [r for r in ROWS if stop in texts[r["id"]]][:2]
    assert len(holders) == 2, (stop, texts)
    rows = [dict(r) for r in holders + [r for r in ROWS if r not in holders]]
    rows[0]["stop"], rows[1]["stop"] = stop, ["never in a text", stop]  # a string, a list
    rows[2]["max_new_tokens"], rows[3]["max_new_tokens"], rows[4]["max_new_tokens"] = 1, 3, N_LONG  # [5]: N
    rows[6]["max_new_tokens"], rows[7]["max_new_tokens"], rows[8]["max_new_tokens"] = 0, "x", True
    rows[9]["stop"] = 5
    rows[10]["stop"], rows[11]["max_new_tokens"] = None, None  # null: not given (a column other rows set)
    report = run_function("generate", _write(work / "limits.jsonl", rows), work / "limits", limits())
    items = report["items"]
    assert items["received"] == 12 and items["failed"] == 4 and items["completed"] == 8, items
    assert report["balanced"], report.get("imbalance")
    reasons = {f["id"]: f["reason"] for f in report["failures"]}
    assert "'max_new_tokens' is 0; give a positive integer" in reasons[rows[6]["id"]]
    assert "'max_new_tokens' is 'x'" in reasons[rows[7]["id"]]
    assert "'max_new_tokens' is True" in reasons[rows[8]["id"]]
    assert "'stop' is 5; give a non-empty string or a list" in reasons[rows[9]["id"]]
    got = load(work / "limits")
    assert sorted(got.ids) == sorted(r["id"] for r in rows if r["id"] not in reasons)
    for k, rid in enumerate(got.ids):
        row = next(r for r in rows if r["id"] == rid)
        col = got.columns
        ids, text, why = col["generated_ids"][k].tolist(), col["text"][k], col["finish_reason"][k]
        n = row.get("max_new_tokens") or N
        longer = embedded.new_tokens(row, N_LONG)
        if row.get("stop"):
            stops = [row["stop"]] if isinstance(row["stop"], str) else row["stop"]
            want_ids, want_text, stopped = _cut(embedded.tok, longer[:n], stops)
            assert stopped and why == "stop" and (ids, text) == (want_ids, want_text), (rid, ids, text)
            assert text == texts[rid][: texts[rid].find(stop)] and stop not in text
        else:  # the first n tokens of the longer greedy run
            assert ids == longer[:n] and got.columns["num_generated_tokens"][k] == n and why == "length", rid
            assert text == embedded.tok.decode(longer[:n], skip_special_tokens=True)


@pytest.mark.slow
def test_a_config_stop_applies_to_every_row(work, base, embedded):
    _, res = base
    texts = {rid: str(t) for rid, t in zip(res.ids, res.columns["text"])}
    stop = _stop_string(list(texts.values()))
    report = run_function("generate", work / "rows.jsonl", work / "config-stop", [*limits(), f"stop=['{stop}']"])
    assert report["items"]["completed"] == len(ROWS)
    got = load(work / "config-stop")
    stopped = 0
    for k, rid in enumerate(got.ids):
        row = next(r for r in ROWS if r["id"] == rid)
        want_ids, want_text, hit = _cut(embedded.tok, embedded.new_tokens(row), [stop])
        assert got.columns["generated_ids"][k].tolist() == want_ids and got.columns["text"][k] == want_text, rid
        assert got.columns["finish_reason"][k] == ("stop" if hit else "length"), rid
        assert got.columns["num_generated_tokens"][k] == len(want_ids)
        stopped += hit
    assert 0 < stopped < len(ROWS)


# -- the step budget in the report ---------------------------------------------------------------


def test_prompt_ids_run_as_given_and_bad_ones_fail_alone(work, embedded):
    """A row's `prompt_ids` are its prompt (no special tokens added, as lm-eval's --model forge
    gives a context it cut): the greedy tokens of those ids; a bad list fails its row alone."""
    whole = embedded.prompt(ROWS[0])
    rows = [
        {"id": "cut", "prompt": "named only", "prompt_ids": whole[-20:]},  # a context cut from the left
        {"id": "whole", "prompt": "x", "prompt_ids": whole},
        {"id": "empty", "prompt": "x", "prompt_ids": []},
        {"id": "text", "prompt": "x", "prompt_ids": "1 2 3"},
        {"id": "vocab", "prompt": "x", "prompt_ids": [1, 10**9]},
        {"id": "prefix", "prompt": "x", "prompt_ids": [1, 2], "prefix": "a"},
        {"id": "blank", "prompt": "", "prompt_ids": whole[-20:]},  # the prompt only names the row: may be empty
        {"id": "noids", "prompt": "  "},  # then it is the text, and must say something
    ]
    report = run_function("generate", _write(work / "ids.jsonl", rows), work / "ids", limits())
    reasons = {f["id"]: f["reason"] for f in report["failures"]}
    assert sorted(reasons) == ["empty", "noids", "prefix", "text", "vocab"], reasons
    assert "has an empty 'prompt'" in reasons["noids"] and "or 'prompt_ids'" in reasons["noids"]
    assert "'prompt_ids' must be a non-empty list of token ids" in reasons["vocab"]
    assert "has both 'prompt_ids' and 'prefix'" in reasons["prefix"]
    got = load(work / "ids")
    for k, rid in enumerate(got.ids):
        ids = whole[-20:] if rid in ("cut", "blank") else whole
        assert got.columns["generated_ids"][k].tolist() == greedy(embedded.model, ids, N), rid
        assert got.columns["num_prompt_tokens"][k] == len(ids), rid


def test_no_step_over_the_budget(base):
    report, res = base
    gen = report["outputs"]["generation"]
    assert gen["tokens_per_step_budget"] == SMALL_BUDGET  # the device's max_batch_tokens
    assert SMALL_BUDGET // 2 < gen["largest_step_tokens"] <= SMALL_BUDGET  # prefill split across full steps
    assert sum(gen["steps_by_tokens"].values()) == gen["steps"] > N
    assert all(int(b[2:]) <= SMALL_BUDGET for b in gen["steps_by_tokens"])
    assert gen["prompt_tokens"] == int(res.columns["num_prompt_tokens"].sum())
    assert gen["generated_tokens"] == int(res.columns["num_generated_tokens"].sum()) == N * len(ROWS)
    assert gen["prefill_tokens_computed"] + gen["prefill_tokens_shared"] == gen["prompt_tokens"]
    tokens = report["tokens"]  # an item's geometry: its prompt plus its max_new_tokens
    assert tokens["received"] == gen["prompt_tokens"] + N * len(ROWS) and report["balanced"]
    # the ledger holds every decoder step to the step budget it got from the config (forge.vocab.geometry.StepBudget)
    steps = report["steps"]["cpu"]
    assert steps["tokens_per_step_budget"] == SMALL_BUDGET and steps["engine_steps"], steps
    assert steps["steps"] == gen["steps"] and steps["largest_step_tokens"] == gen["largest_step_tokens"], steps
    assert steps["over_budget"] == 0


def test_histogram_and_stop_cut_helpers():
    from forge.functions.assets import embedded_model_source
    from forge.runtime.decoder.finish import cut_at_stop, step_histogram

    assert step_histogram([1, 2, 3, 64, 65, 128, 128], 128) == {"<=1": 1, "<=2": 1, "<=4": 1, "<=64": 1, "<=128": 3}
    tok = transformers.AutoTokenizer.from_pretrained(str(embedded_model_source()))
    ids = tok("Answer: True, because it is.", add_special_tokens=False)["input_ids"]
    got = cut_at_stop(tok, ids, (",", "because"))
    assert got == _cut(tok, ids, [",", "because"]) and got[1] == "Answer: True" and got[2]
    assert cut_at_stop(tok, ids, ("never",)) == (ids, tok.decode(ids), False)


# -- states of the generated tokens --------------------------------------------------------------


def _plain_states(ref: Reference, ids: list[int], layers: list[int], mlp_layer: int | None = None) -> dict:
    """hidden_states[L] (and layer `mlp_layer`'s MLP output) of a plain forward over `ids`."""
    seen = {}
    handle = None
    if mlp_layer is not None:
        mlp = ref.model.model.layers[mlp_layer].mlp
        handle = mlp.register_forward_hook(lambda m, i, o: seen.__setitem__("mlp", o))
    try:
        with torch.inference_mode():
            out = ref.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    finally:
        if handle is not None:
            handle.remove()
    states = {f"layer_{L}": out.hidden_states[L][0] for L in layers}
    if mlp_layer is not None:
        states[f"mlp_out.{mlp_layer}"] = seen["mlp"][0]
    return states


@pytest.mark.slow
def test_generated_states_equal_a_plain_forward_over_the_final_sequence(work, embedded):
    run = work / "states"
    report = run_function("generate", work / "rows.jsonl", run, [*limits(), "layers=[1,3]", "capture=[mlp_out.2]"])
    assert report["items"]["completed"] == len(ROWS)
    embedded.check(run, ROWS)
    res = load(run)
    for k, rid in enumerate(res.ids):
        row = next(r for r in ROWS if r["id"] == rid)
        prompt, new = embedded.prompt(row), res.columns["generated_ids"][k].tolist()
        want = _plain_states(embedded, prompt + new, [1, 3], mlp_layer=2)
        for name, w in want.items():
            got = res.columns[name][k]
            assert got.dtype == np.float32 and got.shape == (len(new), w.shape[-1]), (name, got.shape)
            diff = np.abs(got - w[len(prompt) :].numpy()).max()
            assert diff < TOL, (rid, name, diff)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["token-cache", "item"])
def test_states_of_all_start_at_the_prefix_end(work, embedded, mode):
    """In a split-prefix mode and with whole prompts per row alike: from the prefix's end on."""
    run = work / f"states-all-{mode}"
    overrides = [*limits(), *MODES[mode], "layers=[1]", "states_of=all"]
    report = run_function("generate", work / "rows.jsonl", run, overrides)
    assert report["items"]["completed"] == len(ROWS)
    res = load(run)
    for k, rid in enumerate(res.ids):
        row = next(r for r in ROWS if r["id"] == rid)
        prompt, new = embedded.prompt(row), res.columns["generated_ids"][k].tolist()
        start = len(embedded.tok(row["prefix"])["input_ids"]) if row.get("prefix") else 0
        want = _plain_states(embedded, prompt + new, [1])["layer_1"][start:].numpy()
        got = res.columns["layer_1"][k]
        assert got.shape == want.shape and np.abs(got - want).max() < TOL, (rid, got.shape, want.shape)


# -- kill -9 and resume --------------------------------------------------------------------------


@pytest.mark.slow
def test_kill9_and_resume_give_every_id_once_with_the_clean_text(tmp_path, faults):
    from test_aggregate import forge_run_killed

    from conftest import run_forge

    n = 24
    args = [
        "function=generate",
        f"input.limit={n}",
        "max_new_tokens=4",
        "devices=auto",
        "devices.limits.max_batch_tokens=256",
        "devices.limits.max_seq_len=128",
        "budget.tokens_per_step=256",
        "batching.window=8",
        "shard_size=4",
    ]
    clean = run_forge(tmp_path / "clean", *args, "runtime.executor=inprocess")
    assert clean["items"]["completed"] == n
    args.append("runtime.executor=process")
    committed = forge_run_killed(tmp_path / "killed", *args, faults=faults)
    assert 0 < committed < n
    report = run_forge(tmp_path / "killed", *args, "resume=true")
    assert report["items"]["resumed"] == committed and report["items"]["completed"] == n
    got, want = load(tmp_path / "killed"), load(tmp_path / "clean")
    assert len(got.ids) == len(set(got.ids)) == n and got.ids == want.ids  # every id once, in input order
    for name in ("text", "finish_reason", "num_generated_tokens"):
        assert list(got.columns[name]) == list(want.columns[name]), name
    assert [a.tolist() for a in got.columns["generated_ids"]] == [a.tolist() for a in want.columns["generated_ids"]]


@pytest.mark.slow
def test_rows_committed_in_parts_while_their_batch_decodes_are_the_same(work, embedded):
    """A few sequences decoding at once, the rest waiting, and rows handed on in parts of two as
    they finish: the tokens are those of one prompt at a time, and the parts' prefix tokens add up
    to what the decoder shared."""
    run = work / "parts"
    report = run_function("generate", work / "rows.jsonl", run, [*limits(), "max_running=3", "shard_size=2"])
    assert report["items"]["completed"] == len(ROWS) and report["balanced"], report.get("failures")
    assert report["batches"] == 1  # one batch, committed in parts
    embedded.check(run, ROWS)
    tokens, gen = report["tokens"], report["outputs"]["generation"]
    assert tokens["cache_hit"] + tokens["prefix_shared"] == gen["prefill_tokens_shared"] > 0, (tokens, gen)


@pytest.mark.slow
def test_a_kill_keeps_the_rows_that_finished_while_their_batch_decoded(tmp_path, faults):
    """One batch of 24 prompts, 4 decoding at once: rows are committed in parts of shard_size as they
    finish, while the rest of the batch decodes. A kill -9 at the third shard keeps the first two, and
    resume gives what an uninterrupted run gives."""
    from test_aggregate import forge_run_killed

    from conftest import run_forge

    n = 24
    args = [
        "function=generate",
        f"input.limit={n}",
        "max_new_tokens=4",
        "devices=auto",
        "devices.limits.max_batch_tokens=256",
        "devices.limits.max_seq_len=128",
        "budget.tokens_per_step=256",
        "batch_steps=64",  # every prompt in one batch
        "max_running=4",
        "shard_size=4",
    ]
    clean = run_forge(tmp_path / "clean", *args, "runtime.executor=inprocess")
    assert clean["items"]["completed"] == n and clean["batches"] == 1 and clean["balanced"], clean
    args.append("runtime.executor=process")
    committed = forge_run_killed(tmp_path / "killed", *args, faults=faults)
    assert 8 <= committed < n  # two parts of the one batch were committed before the kill
    report = run_forge(tmp_path / "killed", *args, "resume=true")
    assert report["items"]["resumed"] == committed and report["items"]["completed"] == n and report["balanced"]
    got, want = load(tmp_path / "killed"), load(tmp_path / "clean")
    assert got.ids == want.ids and list(got.columns["text"]) == list(want.columns["text"])
    assert [a.tolist() for a in got.columns["generated_ids"]] == [a.tolist() for a in want.columns["generated_ids"]]


# -- reading the results; the README's command ----------------------------------------------------


def test_load_reads_every_field(base):
    _, res = base
    assert res.ids == [r["id"] for r in ROWS]
    assert res.columns["num_prompt_tokens"].dtype == np.int32 and res.columns["num_generated_tokens"].dtype == np.int32
    assert all(a.dtype == np.int32 and a.ndim == 1 for a in res.columns["generated_ids"])
    assert all(isinstance(t, str) for t in res.columns["text"])
    assert set(res.columns["finish_reason"]) <= {"length", "stop", "eos"}
    table = res.table()
    assert set(table.column_names) >= {"generated_ids", "text", "finish_reason", "num_prompt_tokens"}


@pytest.mark.slow
def test_the_readme_command_runs_on_the_embedded_default(tmp_path):
    from typer.testing import CliRunner

    from forge.cli.app import app

    out = tmp_path / "run"
    args = ["run", "function=generate", "input.limit=3", "max_new_tokens=4", f"output_dir={out}"]
    result = CliRunner().invoke(app, [*args, "runtime.executor=inprocess"])
    assert result.exit_code == 0, result.output
    res = load(out)
    assert res.ids == ["g0001", "g0002", "g0003"]
    assert list(res.columns["num_generated_tokens"]) == [4, 4, 4]
    assert "generate" in result.output and "finished" in result.output


# -- sampling ------------------------------------------------------------------------------------

SAMPLED = ["sampling.temperature=0.9", "sampling.top_k=50", "sampling.top_p=0.95"]


@pytest.mark.slow
def test_a_sampled_row_is_the_same_in_any_batch_and_budget_and_its_seed_decides_it(work):
    """Each row draws from its own stream (seed, id): a small budget in prefix groups and a large
    one in item batches give every row the same tokens; another seed gives other tokens."""

    def tokens(name: str, extra: list[str]) -> dict:
        report = run_function("generate", work / "rows.jsonl", work / name, extra)
        assert report["items"]["completed"] == len(ROWS) and report["balanced"], report.get("failures")
        assert report["path"].endswith("sampled")
        res = load(work / name)
        return {i: res.columns["generated_ids"][k].tolist() for k, i in enumerate(res.ids)}

    a = tokens("sample-a", [*limits(SMALL_BUDGET), *SAMPLED, "sampling.seed=7", *MODES["token-cache"]])
    b = tokens("sample-b", [*limits(LARGE_BUDGET), *SAMPLED, "sampling.seed=7", *MODES["item"]])
    c = tokens("sample-c", [*limits(SMALL_BUDGET), *SAMPLED, "sampling.seed=8"])
    assert a == b
    assert sum(a[i] != c[i] for i in a) >= len(ROWS) // 2  # the seed, not the batch, decides


def test_sampling_streams_and_draws():
    from forge.runtime.decoder.sampling import Sampling

    s = Sampling(temperature=1.0, top_p=1.0, top_k=2, seed=3)
    logits = torch.tensor([0.0, 5.0, 4.0, -1.0])
    draws = [s.draw(logits, s.stream("row-1")) for _ in range(3)]
    assert draws == [s.draw(logits, s.stream("row-1")) for _ in range(3)]  # the stream is (seed, key) alone
    rng = s.stream("row-2")
    assert {s.draw(logits, rng) for _ in range(200)} == {1, 2}  # top_k=2: only the two best
    nucleus = Sampling(temperature=1.0, top_p=0.5, top_k=0, seed=0)
    rng = nucleus.stream("row-3")
    assert {nucleus.draw(logits, rng) for _ in range(50)} == {1}  # the best alone holds 73% > 0.5
    with pytest.raises(ForgeError, match="sampling.top_p"):
        run_function("generate", Path("unused.jsonl"), Path("unused"), ["sampling.top_p=1.5"])


def test_shared_prefix_attention_gives_the_plain_slots_tokens_and_reads_each_prefix_once(embedded):
    """The decode steps' split softmax (forge.runtime.forward.shared_prefix) against the same decoder
    with every token in its slot: the same greedy tokens, the prefixes' KV stacked once per step."""
    from forge.runtime.decoder.engine import Decoder, Sequence
    from forge.runtime.forward import shared_prefix

    def seqs():
        out = []
        for k, row in enumerate(ROWS):
            ids = embedded.prompt(row)
            p = len(embedded.tok(row["prefix"])["input_ids"]) if row.get("prefix") else 0
            out.append(Sequence(k, ids, p, N, (), None))
        return out

    plain, shared = seqs(), seqs()
    Decoder(copy.deepcopy(embedded.model), embedded.tok, 256, {2}, 3, shared_attention=False).generate(plain)
    steps = []
    original = shared_prefix.stack
    shared_prefix.stack = lambda prefixes, **kw: steps.append(len(prefixes)) or original(prefixes, **kw)
    try:
        decoder = Decoder(copy.deepcopy(embedded.model), embedded.tok, 256, {2}, 3)
        assert decoder.shared_attention
        figures = decoder.generate(shared)
    finally:
        shared_prefix.stack = original
    assert [s.out for s in shared] == [s.out for s in plain] == [embedded.new_tokens(r) for r in ROWS]
    assert steps and max(steps) == 3  # the three prefixes, stacked when the set read changed
    assert sum(s.prefix_kv is not None for s in shared) == len(ROWS) - 1  # all but the row without one
    # rows of their own tokens: what the decoder allocated for keys and values, close to what they needed
    assert 0 < figures.kv_held_peak_bytes < figures.kv_peak_bytes <= 1.25 * figures.kv_held_peak_bytes, figures


def test_shared_prefix_attention_is_kept_off_attention_it_cannot_split():
    from forge.runtime.decoder.engine import Decoder

    def model(cfg, attn="eager"):
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)

    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64)
    window = model(transformers.MistralConfig(**small, sliding_window=8), "sdpa")
    assert not Decoder(window, None, 8, {2}, 0).shared_attention  # its attention: not split (shared_prefix.eligible)
    assert not Decoder(model(transformers.LlamaConfig(**small)), None, 8, {2}, 0).shared_attention  # not sdpa
    assert Decoder(model(transformers.LlamaConfig(**small), "sdpa"), None, 8, {2}, 0).shared_attention


def _sequences(ref: Reference, rows: list[dict], n: int = N) -> list:
    from forge.runtime.decoder.engine import Sequence

    out = []
    for k, row in enumerate(rows):
        p = len(ref.tok(row["prefix"])["input_ids"]) if row.get("prefix") else 0
        out.append(Sequence(k, ref.prompt(row), p, n, (), None))
    return out


def test_a_small_prefix_store_is_bounded_and_gives_the_same_tokens(embedded):
    """The decoder's stored prefixes (its `PrefixCache`) stay within `prefix_tokens` (a worker's: the run's
    batching.cache_tokens): with one prompt a block, a bound that holds one prefix keeps one at a time,
    where an unbounded store keeps all three; the tokens are the greedy ones of one prompt at a time
    either way, batch after batch."""
    from forge.runtime.decoder.engine import Decoder

    lens = sorted(len(embedded.tok(p)["input_ids"]) for p in {r["prefix"] for r in ROWS if r.get("prefix")})
    small = lens[-1]  # the longest prefix; no two together
    assert lens[0] + lens[1] > small
    held = {}
    for bound in (small, 1 << 20):
        decoder = Decoder(copy.deepcopy(embedded.model), embedded.tok, 256, {2}, 3, prefix_tokens=bound, max_running=1)
        put, most = decoder.prefixes.put, []

        def counting(key, entry, keep=(), put=put, store=decoder.prefixes, most=most):
            put(key, entry, keep)
            most.append((len(store), sum(len(k[1]) for k in store.keys())))

        decoder.prefixes.put = counting
        for half in (ROWS[::2], ROWS[1::2]):  # two batches: the second finds what the first stored
            seqs = _sequences(embedded, half)
            decoder.generate(seqs)
            assert [s.out for s in seqs] == [embedded.new_tokens(r) for r in half], bound
        held[bound] = max(n for n, _ in most)
        assert all(tokens <= bound for _, tokens in most), (bound, most)
    assert held == {small: 1, 1 << 20: 3}


def test_a_prefix_store_keeps_the_running_blocks_prefixes_over_its_bound():
    """A block's prefixes are not put out by each other (its prompts start after them), whatever the
    bound; the next put that keeps none of them does."""
    from forge.runtime.forward.prefix_cache import PrefixCache, PrefixEntry

    def kv(n):
        return PrefixEntry([(torch.zeros(1, 2, n, 4), torch.zeros(1, 2, n, 4))], n)

    a, b, c = (None, (1, 2, 3)), (None, (4, 5, 6)), (None, (7, 8))
    store = PrefixCache(4)
    store.put(a, kv(3))
    store.put(b, kv(3), keep={a, b})
    assert list(store.keys()) == [a, b]  # over the bound: both kept
    store.put(c, kv(2))
    assert list(store.keys()) == [c] and store.bytes == 2 * 2 * 2 * 4 * 4
    assert not store.put(("iv-1", (1, 2, 3, 4, 5)), kv(5))  # longer than the whole bound: not kept
    assert store.peek(("iv-1", (7, 8))) is None and store.peek(c) is not None  # a steered key is its own


@pytest.mark.slow
def test_the_runs_cache_tokens_bounds_each_workers_prefix_store(work, embedded, monkeypatch):
    """batching.cache_tokens reaches the generate worker's decoder as its prefix store's bound (the
    packer does not split generate's batches by prefix, so the scheduler's own cache model is off)."""
    from forge.runtime.decoder import worker

    bounds = []

    class Recording(worker.Decoder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            bounds.append(self.prefixes.capacity_tokens)

    monkeypatch.setattr(worker, "Decoder", Recording)
    run_function("generate", work / "rows.jsonl", work / "cache-tokens", [*limits(), "batching.cache_tokens=40"])
    assert bounds == [40]
    embedded.check(work / "cache-tokens", ROWS)


# -- the KV budget: admission within it, preemption and recompute past it ------------------------


@pytest.mark.slow
@pytest.mark.parametrize("shared", [True, False])
def test_a_kv_budget_is_never_exceeded_and_preempted_rows_are_recomputed_exactly(embedded, shared):
    """A KV budget: blocks are admitted within it, running sequences that outgrow it are preempted
    (their slots freed, their tokens recomputed when a block takes them again), the slots' buffers
    never hold more than the budget, and every row's tokens are still the greedy ones of one prompt
    at a time. Short prompts and long generations make every budget here preempt: a block of them is
    admitted on its prompts' KV, then grows past what the budget holds."""
    from forge.runtime.decoder.engine import Decoder, Sequence

    n = 48
    rows = ROWS[:3] + [{"id": f"short-{k}", "prompt": r["prompt"][:24]} for k, r in enumerate(ROWS[3:])]

    def seqs():
        out = []
        for k, row in enumerate(rows):
            p = len(embedded.tok(row["prefix"])["input_ids"]) if row.get("prefix") else 0
            out.append(Sequence(k, embedded.prompt(row), p, n, (), None))
        return out

    free = Decoder(copy.deepcopy(embedded.model), embedded.tok, 256, {2}, 3, shared_attention=shared)
    assert free.generate(seqs()).preempted == 0
    column = 4 * 2 * 4 * 64 * 4  # the embedded model: 4 layers, keys and values, 4 heads of 64, float32
    longest = max(len(embedded.prompt(r)) for r in rows) + n
    for sequences in (2.5, 3):  # budgets of a few longest sequences' KV, beside the prefix stored
        budget = int(sequences * longest * column) + 600_000
        decoder = Decoder(copy.deepcopy(embedded.model), embedded.tok, 256, {2}, 3, shared_attention=shared,
                          kv_bytes=budget)  # fmt: skip
        got = seqs()
        figures = decoder.generate(got)
        assert [s.out for s in got] == [embedded.new_tokens(r, n) for r in rows], sequences
        assert figures.preempted > 0 and figures.recomputed_tokens > 0, (sequences, figures.preempted)
        assert decoder.prefixes.bytes < figures.kv_peak_bytes <= budget, (figures.kv_peak_bytes, budget)
        assert max(figures.steps) <= 256

    with pytest.raises(RuntimeError, match="does not hold one sequence"):
        Decoder(embedded.model, embedded.tok, 256, {2}, 3, kv_bytes=longest * column // 2).generate(seqs())


@pytest.mark.slow
def test_memory_mode_sizes_batches_by_their_kv_and_the_decoder_keeps_within_it(work, embedded):
    """batching=memory prices a generate batch by the KV its sequences hold (prompt + max_new_tokens)
    beside the weights and one step's activations; each worker's decoder keeps its keys and values
    within the device's budget less those: the greedy tokens are unchanged."""
    tight = [*limits(), "batching=memory", "devices.cpu_memory_gb=0.026"]  # about 3 MB of KV beside 23 MB
    report = run_function("generate", work / "rows.jsonl", work / "memory-kv", tight)
    assert report["items"]["completed"] == len(ROWS) and report["balanced"], report.get("failures")
    gen = report["outputs"]["generation"]
    assert gen["kv_budget_bytes"] is not None and 0 < gen["kv_peak_bytes"] <= gen["kv_budget_bytes"], gen
    assert report["batches"] > 1  # a batch holds the KV of a few rows only
    (device,) = report["devices"]
    assert device["predicted_peak_bytes"] <= device["memory_budget_bytes"]
    embedded.check(work / "memory-kv", ROWS)


@pytest.mark.slow
def test_a_device_groups_worker_generates_the_same_tokens(work, embedded):
    """A model read by a device group's plan (forge.runtime.placement.device_map) through accelerate's dispatch
    (forge.runtime.placement.dispatch: hooks on every block, token ids on the embeddings' device), with layers
    offloaded to disk: the plan keeps room on the card for a step and one row's KV beside the layers
    it holds, the decoder's keys and values stay within what is left, the tokens are those of one
    prompt at a time, and no offload folder is left when the run ends."""
    import glob
    import tempfile

    from typer.testing import CliRunner

    from forge.cli.app import app

    before = set(glob.glob(str(Path(tempfile.gettempdir()) / "forge-offload-*")))
    group = "devices.inventory=[{name: g, devices: [cpu], memory_gb: 0.016, split: {offload: disk}}]"
    overrides = [*limits(), "devices.discover=false", group]
    plan = CliRunner().invoke(
        app, ["plan", "function=generate", f"input.path={work / 'rows.jsonl'}", *overrides, "--json"]
    )
    assert plan.exit_code == 0, plan.output
    placed = json.loads(plan.output)["placements"]["g"]
    assert placed["offload"] == "disk" and placed["offloaded_bytes"] > 0, placed
    report = run_function("generate", work / "rows.jsonl", work / "group", overrides)
    assert report["items"]["completed"] == len(ROWS) and report["balanced"], report.get("failures")
    embedded.check(work / "group", ROWS)
    gen = report["outputs"]["generation"]
    assert 0 < gen["kv_peak_bytes"] <= gen["kv_budget_bytes"], gen
    assert set(glob.glob(str(Path(tempfile.gettempdir()) / "forge-offload-*"))) <= before


def test_the_guides_generative_function_adds_fields_of_its_own_from_each_rows_text(tmp_path, monkeypatch):
    """docs/functions.md's `Answer`, as the guide shows it: `finished(text, label)` gives each row's
    num_words and matched beside the base's fields, from its generated text and its prompt's label."""
    import re

    import forge

    guide = (Path(__file__).resolve().parents[1] / "docs" / "functions.md").read_text()
    section = guide[guide.index("### Generative functions") :]
    code = re.search(r"```text\n(.*?)```", section, re.S).group(1)
    (tmp_path / "answer_fn.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    from answer_fn import Answer

    rows = [{"id": "a", "question": "Is the sky blue?", "answer": "yes"}, {"id": "b", "question": "Two plus two?"}]
    got = forge.run(Answer, rows, overrides=["max_new_tokens=6"])
    table = {r["id"]: r for r in got.table().to_pylist()}
    assert set(table) == {"a", "b"} and got.report["balanced"]
    for rid, row in table.items():
        assert row["num_words"] == len(row["text"].split())
        gold = {"a": "yes", "b": None}[rid]
        assert row["matched"] == (gold is not None and gold in row["text"].lower())
