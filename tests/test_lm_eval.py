"""`lm_eval --model forge` against `--model hf` on the same tiny model, offline, on local task YAMLs:
log-likelihoods within 1e-4, the same greedy flags, generations and metrics (docs/lm-eval.md)."""

import json
import shutil
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
ROOT = Path(__file__).resolve().parent.parent
WORDS = "the a cat dog sat ran on under mat rug big small red blue and then".split()

TASKS = {
    "forge_mc": """
task: forge_mc
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}/mc.jsonl}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
metric_list: [{{metric: acc}}, {{metric: acc_norm}}]
""",
    "forge_ppl": """
task: forge_ppl
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}/ppl.jsonl}}}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list: [{{metric: word_perplexity}}, {{metric: byte_perplexity}}, {{metric: bits_per_byte}}]
""",
    "forge_gen": """
task: forge_gen
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}/gen.jsonl}}}}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs: {{until: [".", "\\n"], max_gen_toks: 12, do_sample: false}}
metric_list: [{{metric: exact_match}}]
""",
}

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def _words(k: int, n: int) -> str:
    return " ".join(WORDS[(k * 7 + i * 3) % len(WORDS)] for i in range(n))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from forge.runtime.model.embedded import materialize_model

    tmp = tmp_path_factory.mktemp("lm-eval")
    model = tmp / "model"
    shutil.copytree(materialize_model(ROOT / "functions" / "assets" / "tiny-llama", tmp / "cache"), model)
    config = json.loads((model / "tokenizer_config.json").read_text())  # a chat template, starting with BOS
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    data = tmp / "data"
    data.mkdir()
    mc = [
        {"question": _words(k, 6), "choices": [_words(k + c, 2 + c) for c in range(4)], "gold": k % 4}
        for k in range(12)
    ]
    ppl = [{"text": _words(k, 90 + 10 * k) + "."} for k in range(4)]  # longer than max_length=64 tokens
    gen = [{"prompt": _words(k, 5 + k), "answer": _words(k + 1, 2)} for k in range(6)]
    for name, rows in (("mc", mc), ("ppl", ppl), ("gen", gen)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = tmp / "tasks"
    tasks.mkdir()
    for name, text in TASKS.items():
        (tasks / f"{name}.yaml").write_text(text.format(data=data))
    return model, tasks


def _evaluate(model_name: str, model_args: str, tasks: Path, names=tuple(TASKS), **chat) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import forge.eval.lm  # noqa: F401  (registers "forge")

    return simple_evaluate(
        model=model_name,
        model_args=model_args,
        tasks=list(names),
        # only the local tasks: indexing lm-eval's own thousands of task files takes 7-20 s a call
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        log_samples=True,
        batch_size=4,
        **chat,
    )


@pytest.fixture(scope="module")
def both(setup):
    model, tasks = setup
    # logits_cache=False: lm-eval's logits cache serves a rolling window the log-likelihood of
    # another it groups with (-322.25 against a plain forward's -321.33 on such a window)
    hf = _evaluate("hf", f"pretrained={model},dtype=float32,max_length=64,device=cpu,logits_cache=False", tasks)
    forge = _evaluate("forge", f"model=hf,model.name={model},max_length=64,devices=cpu", tasks)
    return hf, forge


@pytest.mark.parametrize("task", list(TASKS))
def test_model_forge_equals_model_hf(both, task):
    _assert_equal(*both, task)


def test_chat_templated_few_shot_evaluations_equal_model_hf(setup):
    """--apply_chat_template --system_instruction --fewshot_as_multiturn: the same prompts (the
    template starts with the BOS text: neither adds a second), log-likelihoods and generations."""
    model, tasks = setup
    chat = {"apply_chat_template": True, "system_instruction": "Answer briefly.", "fewshot_as_multiturn": True}
    names = ("forge_mc", "forge_gen")
    args = f"pretrained={model},dtype=float32,max_length=256,device=cpu,logits_cache=False"  # nothing cut
    hf = _evaluate("hf", args, tasks, names, num_fewshot=2, limit=4, **chat)
    forge = _evaluate("forge", f"model=hf,model.name={model},max_length=256,devices=cpu", tasks, names, num_fewshot=2,
                      limit=4, **chat)  # fmt: skip
    prompt = forge["samples"]["forge_gen"][0]["arguments"][0][0]
    assert prompt.startswith("<s><|system|> Answer briefly.") and prompt.endswith("<|assistant|> ")
    assert forge["tokenizer_bos_token"] == hf["tokenizer_bos_token"] and forge["max_length"] == hf["max_length"]
    from forge.eval.lm import ForgeLM

    lm = ForgeLM(model="hf", **{"model.name": str(model)}, devices="cpu")
    assert lm.chat_template(True) == CHAT_TEMPLATE and lm.tokenizer_name == str(model).replace("/", "__")
    for task in names:
        _assert_equal(hf, forge, task)


def _assert_equal(hf: dict, forge: dict, task: str) -> None:
    want, got = hf["samples"][task], forge["samples"][task]
    assert len(want) == len(got) > 0
    for w, g in zip(want, got):
        for wr, gr in zip(w["resps"], g["resps"]):
            wr, gr = wr[0], gr[0]
            if isinstance(wr, str):
                assert gr == wr, (task, w["doc"])
            elif isinstance(wr, (list, tuple)):  # loglikelihood: (loglik, greedy)
                assert abs(float(gr[0]) - float(wr[0])) <= 1e-4 and bool(gr[1]) == bool(wr[1]), (task, wr, gr)
            else:  # loglikelihood_rolling: one float
                assert abs(float(gr) - float(wr)) <= 1e-4, (task, wr, gr)
    for metric, value in hf["results"][task].items():
        if isinstance(value, float) and "stderr" not in metric:
            assert forge["results"][task][metric] == pytest.approx(value, rel=1e-5, abs=1e-6), (task, metric)


def test_a_steered_evaluation_equals_transformers_with_the_same_forward_hook(setup, tmp_path):
    """`--model_args overrides=FILE.yaml`: an intervention list, commas and all, from a YAML file;
    lm-eval's hf model with the same vector added by a forward hook on layer 1 gives the same."""
    import numpy as np
    import torch
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from forge.eval.lm import ForgeLM

    model, _ = setup
    vector = np.random.default_rng(0).standard_normal(256).astype(np.float32)
    np.save(tmp_path / "direction.npy", vector)
    steer = f"intervene=[{{at: resid_post.1, op: add, vector: {tmp_path / 'direction.npy'}, scale: 2.0, span: all}}]"
    (tmp_path / "steer.yaml").write_text(f'- "{steer}"\n')
    pairs = [(_words(k, 5), " " + _words(k + 3, 1 + k % 3)) for k in range(8)] + [("", "the cat")]
    requests = [Instance("loglikelihood", {}, pair, n) for n, pair in enumerate(pairs)]
    args = f"model=hf,model.name={model},devices=cpu,overrides={tmp_path / 'steer.yaml'}"
    got = ForgeLM.create_from_arg_string(args).loglikelihood(requests)
    hf = HFLM(pretrained=str(model), device="cpu", dtype="float32", logits_cache=False)
    add = torch.from_numpy(vector) * 2.0

    def hook(module, inputs, output):
        if isinstance(output, tuple):
            return (output[0] + add, *output[1:])
        return output + add

    handle = hf.model.model.layers[1].register_forward_hook(hook)
    want = hf.loglikelihood(requests)
    handle.remove()
    plain = hf.loglikelihood(requests)
    for (g, g_greedy), (w, w_greedy) in zip(got, want):
        assert abs(g - w) <= 1e-4 and g_greedy == w_greedy, (g, w)
    assert max(abs(w - p) for (w, _), (p, _) in zip(want, plain)) > 0.1  # the steering changed them


def test_forge_eval_runs_lm_evals_command_line_with_model_forge(setup, tmp_path):
    import subprocess
    import sys

    model, tasks = setup
    done = subprocess.run(
        [sys.executable, "-m", "forge.eval", "--model", "forge", "--model_args",
         f"model=hf,model.name={model},devices=cpu", "--batch_size", "8", "--tasks", "forge_mc",
         "--include_path", str(tasks), "--limit", "3", "--output_path", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "forge_mc" in done.stdout and "acc" in done.stdout
    assert "the token budget" in done.stderr  # batch_size=8 is ignored, in one line
    assert list((tmp_path / "out").rglob("results_*.json"))


def test_an_evaluation_with_an_output_dir_resumes_what_it_committed(tmp_path):
    from lm_eval.api.instance import Instance

    from forge.eval.lm import ForgeLM

    requests = [Instance("loglikelihood", {}, ("The sky is", f" {word}"), n) for n, word in enumerate(("blue", "red"))]
    first = ForgeLM(output_dir=str(tmp_path)).loglikelihood(requests)
    again = ForgeLM(output_dir=str(tmp_path)).loglikelihood(requests)
    assert again == first
    report = json.loads((tmp_path / "loglikelihood" / "report.json").read_text())
    assert report["items"]["resumed"] == 2  # nothing computed twice


def test_contexts_longer_than_max_length_are_cut_as_hf_cuts_them(setup):
    """generate_until keeps a context's last max_length - max_gen_toks tokens, loglikelihood the
    last max_length + 1 of context + continuation: lm-eval's HF model's cuts (max_length=64)."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from forge.eval.lm import ForgeLM

    model, _ = setup
    until = {"until": ["."], "max_gen_toks": 12, "do_sample": False}
    contexts = [_words(k, 30 + 25 * k) for k in range(3)]  # about 32, 57 and 82 tokens: the last two are cut
    # and an empty and a blank context: HF generates after BOS alone (and after BOS and a space)
    generations = [Instance("generate_until", {}, (c, until), n) for n, c in enumerate([*contexts, "", " "])]
    pairs = [(c, " " + _words(k + 5, 3)) for k, c in enumerate(contexts)] + [(_words(9, 40), " " + _words(2, 40))]
    scored = [Instance("loglikelihood", {}, pair, n) for n, pair in enumerate(pairs)]
    hf = HFLM(pretrained=str(model), device="cpu", dtype="float32", max_length=64, batch_size=1, logits_cache=False)
    forge = ForgeLM(model="hf", **{"model.name": str(model)}, max_length=64, devices="cpu")
    assert len(hf.tok_encode(contexts[-1])) > 64 and len(hf.tok_encode(" ".join(pairs[-1]))) > 65
    assert forge.generate_until(generations) == hf.generate_until(generations)
    for (g, g_greedy), (w, w_greedy) in zip(forge.loglikelihood(scored), hf.loglikelihood(scored)):
        assert abs(g - w) <= 1e-4 and g_greedy == w_greedy, (g, w)
