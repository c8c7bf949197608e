"""score: log-likelihoods equal a one-prompt-at-a-time transformers computation in every mode,
lm-eval's tokenization at the context/continuation boundary, acc/acc_norm, greedy, bad rows,
resume and the ledger.

The reference here is written independently of Forge: lm-eval's encode_pair with the
tokenizer, then `model(ids).logits` of context + continuation (its last token dropped, cut
from the left at max_length), float32 log_softmax gathered at the continuation's tokens.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pa = pytest.importorskip("pyarrow")

from conftest import compose, plan_forge, run_forge  # noqa: E402
from forge.errors import ForgeError  # noqa: E402

TOL = 1e-4
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
BASE = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=2048,
    max_position_embeddings=256,
    num_key_value_heads=2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=3,
    initializer_range=0.2,
)
FAMILIES = {
    "qwen2": ("Qwen2Config", dict()),
    "gpt2": ("GPT2Config", dict(n_embd=32, n_layer=2, n_head=4, n_positions=256)),
    "bloom": ("BloomConfig", dict(n_layer=2, n_head=4)),
}
APART = "batching.merge_groups=false"  # prefix groups kept apart: the split-prefix and cache paths run
MODES = {
    "item": ["batching=item", "batching.batch_size=5"],
    "token-cache": ["batching=token", "batching.merge_groups=false"],
    "token-nocache": ["batching=token", "batching.prefix_cache=false"],
    "token-packed": ["batching=token", "batching.packing=packed", "batching.packed_row_tokens=64", APART],
    "token-packed-nocache": [
        "batching=token",
        "batching.packing=packed",
        "batching.packed_row_tokens=96",
        "batching.prefix_cache=false",
    ],
    "memory": ["batching=memory", "devices.cpu_memory_gb=0.05", APART],
    "token-merged": ["batching=token"],  # the default: questions merged into tree rows
}
SMALL = [
    "devices=auto",
    "devices.limits.max_batch_tokens=512",
    "devices.limits.max_seq_len=256",
    "budget.tokens_per_step=512",
    "runtime.executor=inprocess",
    "function=score",
]
# (model, mode, extra overrides): every mode on the embedded Llama, the prefix paths on the others
CASES = [("embedded", m, ()) for m in MODES] + [
    ("embedded", "token-cache", ("max_length=40",)),
    ("qwen2", "token-cache", ()),
    ("qwen2", "token-packed", ()),
    ("qwen2", "item", ()),
    ("gpt2", "token-cache", ("add_special_tokens=false",)),
    ("gpt2", "token-packed", ("add_special_tokens=false",)),
    ("gpt2", "memory", ("add_special_tokens=false",)),
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


# -- an lm-eval reference, independent of Forge's code --------------------------------------


def lm_eval_pair(tok, context: str, continuation: str, special: bool) -> tuple[list[int], list[int]]:
    """lm-eval's TemplateLM.loglikelihood + _encode_pair (the empty context is the BOS)."""
    if context == "":
        return [tok.bos_token_id], tok(continuation, add_special_tokens=False)["input_ids"]
    n = len(context) - len(context.rstrip())
    if n:
        continuation, context = context[-n:] + continuation, context[:-n]
    whole = tok(context + continuation, add_special_tokens=special)["input_ids"]
    ctx = tok(context, add_special_tokens=special)["input_ids"]
    if not ctx:  # a whitespace-only context without BOS: lm-eval has no token to predict from; Forge uses BOS
        return [tok.bos_token_id], tok(continuation, add_special_tokens=False)["input_ids"]
    return ctx, whole[len(ctx) :]


def reference(model, tok, rows: list[dict], special: bool, max_length: int, delimiter: str = " ") -> dict:
    """{item id: (loglik, num_tokens, greedy)} from one forward pass per item."""
    out = {}
    for index, row in enumerate(rows):
        qid = str(row.get("id", index))
        if "choices" in row:
            pairs = [(f"{qid}/{k}", delimiter + c) for k, c in enumerate(row["choices"])]
        else:
            pairs = [(qid, row["continuation"])]
        for iid, cont_text in pairs:
            ctx, cont = lm_eval_pair(tok, row["context"], cont_text, special)
            inp = torch.tensor((ctx + cont)[-(max_length + 1) :][:-1]).view(1, -1)
            with torch.inference_mode():
                logits = model(input_ids=inp, use_cache=False).logits[0, -len(cont) :]
            logp = torch.log_softmax(logits.float(), dim=-1)
            tgt = torch.tensor(cont)
            out[iid] = (float(logp.gather(1, tgt[:, None]).sum()), len(cont), bool((logp.argmax(-1) == tgt).all()))
    return out


# -- inputs and models ---------------------------------------------------------------------------


def _rows() -> list[dict]:
    """6 multiple-choice questions from the embedded set (contexts cut to their last question),
    and plain rows with tricky boundaries: trailing spaces, tabs and newlines, an empty context,
    a whitespace-only context, non-ASCII text, and two rows sharing one context."""
    from forge.functions.assets import ASSETS_DIR

    mc = [json.loads(line) for line in open(ASSETS_DIR / "multiple_choice.jsonl")][:6]
    rows = []
    for r in mc:
        last = r["context"].rsplit("\n\n", 1)[-1]
        rows.append({**r, "context": ("Answer each question.\n\n" if int(r["id"][1:]) % 2 else "") + last})
    rows += [
        {"id": "space", "context": "The capital of France is ", "continuation": "Paris."},
        {"id": "spaces", "context": "Question: two spaces  ", "continuation": "and more"},
        {"id": "tab", "context": "A tab\t", "continuation": "follows"},
        {"id": "newline", "context": "Line one\n", "continuation": "Line two"},
        {"id": "lead", "context": "The colour of snow is", "continuation": " white"},
        {"id": "same-context", "context": "The colour of snow is", "continuation": " black"},
        {"id": "empty", "context": "", "continuation": "Hello there"},
        {"id": "blank", "context": "   ", "continuation": "x"},
        {"id": "unicode", "context": "Zürich liegt in der ", "continuation": "Schweiz — ja"},
        {"id": 7, "context": "Numbers: one two three", "continuation": " four five six seven eight"},
    ]
    return rows


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("score")
    rows = _rows()
    path = root / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, path, rows


def _build(name: str, root: Path) -> Path:
    cls_name, kwargs = FAMILIES[name]
    cfg = getattr(transformers, cls_name)(**{**BASE, **kwargs})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    path = root / name
    model.save_pretrained(path)
    from forge.functions.assets import embedded_model_source

    for f in TOKENIZER_FILES:
        shutil.copy(embedded_model_source() / f, path / f)
    return path


_MODELS: dict[str, tuple[str, object]] = {}


def _model(name: str, root: Path):
    """(model.name for Forge, loaded model) built once per module."""
    if name not in _MODELS:
        if name == "embedded":
            from forge.functions.assets import embedded_model_source, materialize_model

            source, path = "embedded:tiny-llama", materialize_model(embedded_model_source())
        else:
            source = path = str(_build(name, root))
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        _MODELS[name] = (source, model)
    return _MODELS[name]


def _tok():
    from forge.functions.assets import embedded_model_source

    return transformers.AutoTokenizer.from_pretrained(embedded_model_source())


_COMPOSED: dict[tuple, object] = {}


def _run(tmp_path, source, rows_path, mode, *extra):
    from forge.cli.build import build_spec
    from forge.driver.engine import execute
    from forge.pluginmanager import make_plugin_manager

    key = (mode, extra)
    if key not in _COMPOSED:
        _COMPOSED[key] = compose(*SMALL, *MODES[mode], "model=hf", "model.name=DIR", f"input.path={rows_path}", *extra)
    cfg = copy.deepcopy(_COMPOSED[key])
    cfg.model.name = source
    return execute(build_spec(cfg, tmp_path), make_plugin_manager())


def _scores(run_dir) -> dict:
    from forge.functions.score import load_scores

    t = load_scores(run_dir).to_pylist()
    return {r["id"]: r for r in t}


# -- fidelity ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,mode,extra", CASES, ids=["-".join((n, m, *e)) for n, m, e in CASES])
def test_loglik_equals_one_prompt_forward(tmp_path, data, name, mode, extra):
    root, rows_path, rows = data
    source, model = _model(name, root)
    special = "add_special_tokens=false" not in extra
    max_length = next((int(e.split("=")[1]) for e in extra if e.startswith("max_length=")), 256)
    want = reference(model, _tok(), rows, special, max_length)
    report = _run(tmp_path, source, rows_path, mode, *extra)
    assert report["items"] == {**report["items"], "received": len(want), "completed": len(want), "failed": 0}
    assert report["balanced"], report["imbalance"]
    got = _scores(tmp_path)
    assert set(got) == set(want)
    for iid, (loglik, count, greedy) in want.items():
        row = got[iid]
        assert row["num_tokens"] == count, iid
        assert abs(row["loglik"] - loglik) < TOL, (iid, row["loglik"], loglik, mode)
        assert row["greedy"] == greedy, iid
    if "max_length=40" in extra:
        assert any(r["truncated"] > 0 for r in got.values())  # the cut really happened
    if mode in ("token-cache", "memory"):
        assert report["tokens"]["cache_hit"] > 0  # choices of a question share their context's KV


def test_boundary_tokenization_follows_lm_eval():
    from forge.functions.score import _Encoder

    tok = _tok()
    enc = _Encoder(tok, add_special_tokens=True)
    # hand-checked with this tokenizer: "Answer: Paris" -> [<s>, Answer, :, ' Paris' as 964 373]
    assert tok("Answer: Paris")["input_ids"] == [1, 394, 1807, 29, 964, 373]
    assert enc.pair("Answer: ", "Paris") == ([1, 394, 1807, 29], [964, 373])  # the space moved
    assert enc.pair("Answer:", " Paris") == ([1, 394, 1807, 29], [964, 373])
    for context, continuation in [
        ("two spaces  ", "x"),
        ("tab\t", "y"),
        ("nl\n", "z"),
        ("a \n ", "b c"),
        ("Zürich ", "liegt"),
        ("", "Hello"),
        ("   ", "x"),
    ]:
        assert enc.pair(context, continuation) == tuple(lm_eval_pair(tok, context, continuation, True))
    plain = _Encoder(tok, add_special_tokens=False)
    assert plain.pair("Answer: ", "Paris") == ([394, 1807, 29], [964, 373])  # no BOS
    # the batched form (what the run uses) gives each pair exactly what `pair` gives
    cases = [
        ("Answer: ", "Paris"),
        ("Answer:", " Paris"),
        ("two spaces  ", "x"),
        ("tab\t", "y"),
        ("", "Hello"),
        ("   ", "x"),
        ("Zürich ", "liegt"),
        ("Answer:", " Rome"),
    ]
    for encoder in (enc, plain):
        assert encoder.pairs(cases) == [encoder.pair(c, t) for c, t in cases]
    assert enc.pairs([]) == []


def test_acc_and_acc_norm_by_hand():
    from forge.functions.score import accuracy, question_table

    rows = [  # (question, choice, num_choices, gold, loglik, num_bytes)
        ("a", 0, 2, 1, -4.0, 2),
        ("a", 1, 2, 1, -4.5, 9),  # acc: 0 (-4 > -4.5); acc_norm: 1 (-0.5 > -2)
        ("b", 0, 3, 0, -1.0, 4),
        ("b", 1, 3, 0, -2.0, 4),
        ("b", 2, 3, 0, -1.0, 4),  # tie: the first wins
        ("c", 0, 2, 0, -9.0, 1),  # one of two choices: incomplete, no answer
        ("plain", -1, 1, None, -3.0, 5),  # a plain row: no question
    ]
    names = ("question", "choice", "num_choices", "gold", "loglik", "num_bytes")
    table = pa.table({n: [r[i] for r in rows] for i, n in enumerate(names)})
    q = {r["question"]: r for r in question_table(table).to_pylist()}
    assert set(q) == {"a", "b"}
    assert (q["a"]["pred"], q["a"]["pred_norm"], q["a"]["acc"], q["a"]["acc_norm"]) == (0, 1, 0.0, 1.0)
    assert (q["b"]["pred"], q["b"]["pred_norm"], q["b"]["acc"], q["b"]["acc_norm"]) == (0, 0, 1.0, 1.0)
    assert accuracy(question_table(table)) == {"questions": 2, "acc": 0.5, "acc_norm": 1.0}


def test_greedy_flag(tmp_path):
    """A continuation made of the model's own argmax tokens is greedy; another one is not."""
    from forge.functions.score import _Encoder

    tok = _tok()
    _, model = _model("embedded", tmp_path)
    enc = _Encoder(tok, True)
    greedy_row = None
    for context in (
        "The capital of France is",
        "Question: What colour is snow?\nAnswer:",
        "One two three",
        "Hello",
        "A B C D",
    ):
        ids = enc.enc(context)
        with torch.inference_mode():
            nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        text = tok.decode([nxt])
        ctx, cont = enc.pair(context, text)
        if cont == [nxt]:
            greedy_row = {"id": "greedy", "context": context, "continuation": text}
            break
    assert greedy_row is not None, "no context whose greedy token round-trips through the tokenizer"
    rows = [greedy_row, {"id": "other", "context": greedy_row["context"], "continuation": " zebra zebra"}]
    path = tmp_path / "g.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = run_forge(tmp_path / "run", "function=score", f"input.path={path}")
    assert report["items"]["completed"] == 2
    got = _scores(tmp_path / "run")
    assert got["greedy"]["greedy"] is True and got["other"]["greedy"] is False
    assert got["greedy"]["loglik"] > got["other"]["loglik"]


def test_bad_rows_fail_with_reasons_and_the_run_goes_on(tmp_path):
    lines = [
        json.dumps({"id": "ok", "context": "The sky is", "continuation": " blue"}),
        json.dumps({"id": "no-cont", "context": "The sky is"}),
        json.dumps({"id": "gold-high", "context": "Pick:", "choices": ["a", "b"], "gold": 2}),
        json.dumps({"id": "gold-bool", "context": "Pick:", "choices": ["a", "b"], "gold": True}),
        json.dumps({"id": "both", "context": "x", "continuation": "y", "choices": ["a"]}),
        json.dumps({"id": "no-context", "continuation": "y"}),
        json.dumps({"id": "empty-choice", "context": "Pick:", "choices": ["a", ""], "gold": 0}),
        "{not json",
        json.dumps({"id": "mc", "context": "Pick one:", "choices": ["red", "green"], "gold": 1}),
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    report = run_forge(tmp_path / "run", "function=score", f"input.path={path}")
    assert report["status"] == "finished" and report["balanced"], report.get("imbalance")
    assert report["items"]["completed"] == 3  # ok, mc/0, mc/1
    assert report["items"]["failed"] == 7
    reasons = {f["id"]: f["reason"] for f in report["failures"]}
    assert "has no 'continuation'" in reasons["no-cont"]
    assert "'gold' is 2, not a choice index 0..1" in reasons["gold-high"]
    assert "'gold' is True" in reasons["gold-bool"]
    assert "both 'continuation' and 'choices'" in reasons["both"]
    assert "has no 'context'" in reasons["no-context"]
    assert "non-empty strings" in reasons["empty-choice"]
    assert any("invalid JSON" in r for r in reasons.values())
    assert all("\n" not in r for r in reasons.values())
    assert set(_scores(tmp_path / "run")) == {"ok", "mc/0", "mc/1"}
    assert report["outputs"]["accuracy"]["questions"] == 1


def test_resume_commits_each_item_once(tmp_path, data):
    """A run cut after its first shard, resumed, gives the full run's table, each id once."""
    _, rows_path, rows = data
    full = tmp_path / "full"
    args = ("function=score", f"input.path={rows_path}", "shard_size=8", "batching=token", APART)
    report = run_forge(full, *args)
    n = report["items"]["completed"]
    journal = (full / "commits.jsonl").read_text().splitlines()
    assert len(journal) > 2
    part = tmp_path / "part"
    shutil.copytree(full, part)
    (part / "commits.jsonl").write_text(journal[0] + "\n")  # as if killed after the first commit
    resumed = run_forge(part, *args, "resume=true")
    assert resumed["items"]["resumed"] == len(json.loads(journal[0])["index"])
    assert resumed["items"]["completed"] == n and resumed["balanced"]
    from forge.functions.score import load_scores

    a, b = load_scores(full), load_scores(part)
    assert b.num_rows == n and len(set(b.column("id").to_pylist())) == n
    assert a.column("id").to_pylist() == b.column("id").to_pylist()
    diff = max(abs(x - y) for x, y in zip(a.column("loglik").to_pylist(), b.column("loglik").to_pylist()))
    assert diff < TOL
    with pytest.raises(ForgeError, match="resume refused: target_delimiter"):
        run_forge(part, *args, "resume=true", "target_delimiter=_")


def test_embedded_default_plan_and_refusals(tmp_path):
    report = plan_forge("function=score", "input.limit=40")
    assert report["function"] == "score" and report["balanced"]
    assert report["items"]["received"] == 160  # 40 questions x 4 choices
    assert report["prefix_reuse_rate"] > 0.5  # each question's context computed once for its 4 choices
    with pytest.raises(ForgeError, match="too_long=truncate"):
        plan_forge("function=score", "too_long=truncate")
    # a mode the model cannot run exactly is refused before work, with probe_gen's reason
    path = tmp_path / "bloom"
    cls_name, kwargs = FAMILIES["bloom"]
    getattr(transformers, cls_name)(**{**BASE, **kwargs}).save_pretrained(path)
    from forge.functions.assets import embedded_model_source

    for f in TOKENIZER_FILES:
        shutil.copy(embedded_model_source() / f, path / f)
    with pytest.raises(ForgeError, match="ALiBi"):
        plan_forge("function=score", "model=hf", f"model.name={path}", "batching.packing=packed")


def test_parquet_rows(tmp_path):
    """Parquet input: choices as a list column; a file without 'context' is refused before work."""
    import pyarrow.parquet as pq

    rows = [
        {"id": "q1", "context": "Pick a colour:", "choices": ["red", "green", "blue"], "gold": 2, "continuation": None},
        {"id": "p1", "context": "The sky is", "choices": None, "gold": None, "continuation": " blue"},
    ]
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    report = plan_forge("function=score", f"input.path={path}")
    assert report["items"]["received"] == 4 and report["items"]["failed"] == 0
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": ["x"]}), bad)
    with pytest.raises(ForgeError, match="no 'context' column"):
        plan_forge("function=score", f"input.path={bad}")
