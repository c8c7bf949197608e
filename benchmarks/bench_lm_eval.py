"""`lm_eval --model forge` against `--model hf` on the same model, whole processes side by side (issue 45).

    pip install -e '.[eval]'
    python -m benchmarks.bench_lm_eval [--questions 500] [--prompts 50] [--rounds 2] [--sizes 1,8,32,auto] \
        [--shape short|mmlu]

Two local tasks (written to a temporary folder, no download): a multiple-choice task of
`--questions` questions, 4 choices each, under the same 5 few-shot examples (`num_fewshot: 5`,
`sampler: first_n`: every question shares that context), and a `generate_until` task of
`--prompts` prompts (`until: ["."]`, 16 tokens). The model is the embedded tiny Llama, saved as a
Hugging Face folder both tools load. Every variant is one process, `python -m forge.eval ...`
(`--model forge`: batches in its own process, the session's default, or in a worker process with
`runtime.executor=process`) or `python -m lm_eval ...` (`--model hf --batch_size N`, and `auto`), timed
from its start to its exit, 2 torch threads each; rounds interleaved (`benchmarks/harness.py`),
medians reported, with each hf variant's time over Forge's. The metrics of every variant are
printed beside them (they must agree). The least time any exact model needs here
(`benchmarks/lm_eval_floor.py`: lm-eval alone as `--model dummy`, a cold start, the compute
floor) is printed under the table, with the issue's ratios. `--only` picks variants by name.

`--shape` sets the multiple-choice questions' shape: `short` (the default: 8-word questions,
choices of 2-5 words scored as continuations; contexts of about 150 tokens) or `mmlu` (MMLU's:
a 30-word question with its four 6-word options listed as "A. ...", the continuations " A" to
" D"; 5-shot contexts of about 600 tokens, of which the 5 shots, about 500, are the same for
every question).
Not a test.
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
from pathlib import Path

from benchmarks import lm_eval_floor
from benchmarks.harness import ROOT, child_env, interleave, need, note, table, timed

DUMMY = "lm-eval alone (--model dummy)"
WORDS = "the a cat dog sat ran on under mat rug big small red blue and then".split()
TASKS = """
task: bench_mc
dataset_path: json
dataset_kwargs: {{data_files: {{train: {data}/train.jsonl, test: {data}/mc.jsonl}}}}
training_split: train
test_split: test
fewshot_split: train
num_fewshot: 5
fewshot_config: {{sampler: first_n}}
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
metric_list: [{{metric: acc}}, {{metric: acc_norm}}]
---
task: bench_gen
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}/gen.jsonl}}}}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs: {{until: ["."], max_gen_toks: 16, do_sample: false}}
metric_list: [{{metric: exact_match}}]
"""


def words(k: int, n: int) -> str:
    """`n` words drawn by seed `k`: distinct questions for distinct `k` (the tables before
    2026-12-04 19:20 UTC had 16 distinct question texts among their 500)."""
    pick = random.Random(k)
    return " ".join(pick.choice(WORDS) for _ in range(n))


SHAPES = ("short", "mmlu")
LETTERS = "ABCD"


def write_tasks(folder: Path, questions: int, prompts: int, shape: str = "short") -> Path:
    data = folder / "data"
    data.mkdir()

    def mc(k: int) -> dict:
        if shape == "mmlu":  # the options in the question, the letters scored (MMLU's doc_to_text)
            options = "".join(f"\n{letter}. {words(k + c, 6)}" for c, letter in enumerate(LETTERS))
            return {"question": words(k, 30) + options, "choices": [*LETTERS], "gold": k % 4}
        return {"question": words(k, 8), "choices": [words(k + c, 2 + c) for c in range(4)], "gold": k % 4}

    files = {
        "train": [mc(1000 + k) for k in range(10)],
        "mc": [mc(k) for k in range(questions)],
        "gen": [{"prompt": words(k, 6 + k % 5), "answer": words(k + 1, 2)} for k in range(prompts)],
    }
    for name, rows in files.items():
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = folder / "tasks"
    tasks.mkdir()
    for n, text in enumerate(TASKS.format(data=data).split("---")):
        (tasks / f"bench_{n}.yaml").write_text(text)
    return tasks


def variants(model: Path, tasks: Path, out: Path, sizes: list[str]) -> dict:
    common = ["--tasks", "bench_mc,bench_gen", "--include_path", str(tasks)]
    env = child_env(OMP_NUM_THREADS="2", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    forge_args = ["--model", "forge", "--model_args", f"model=hf,model.name={model},devices=cpu"]
    hf_args = ["--model", "hf", "--model_args", f"pretrained={model},dtype=float32", "--device", "cpu"]
    commands = {
        "forge": [sys.executable, "-m", "forge.eval", *forge_args, *common],  # in its process: the session's default
        "forge runtime.executor=process": [sys.executable, "-m", "forge.eval", *forge_args[:3],
                                           f"{forge_args[3]},runtime.executor=process", *common],
    }  # fmt: skip
    for size in sizes:
        commands[f"hf batch_size={size}"] = [sys.executable, "-m", "lm_eval", *hf_args, "--batch_size", size, *common]
    commands[DUMMY] = [sys.executable, "-m", "lm_eval", "--model", "dummy", *common]  # lm-eval's own work alone

    def runner(name: str, cmd: list[str]):
        def run(round_: int) -> dict:
            where = out / f"{name.replace(' ', '_').replace('=', '')}-{round_}"
            child = timed([*cmd, "--output_path", str(where)], env=env, cwd=ROOT, log=out / f"{where.name}.log")
            results = json.loads(next(where.rglob("results_*.json")).read_text())["results"]
            metrics = {f"{t}/{m}": v for t, r in results.items() for m, v in r.items() if isinstance(v, float)}
            return {"wall_s": child.wall_s, "metrics": metrics, "load": os.getloadavg()[0]}

        return run

    return {name: runner(name, cmd) for name, cmd in commands.items()}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=500)
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sizes", default="1,8,32,auto")
    ap.add_argument("--shape", choices=SHAPES, default="short", help="the questions' shape (see above)")
    ap.add_argument("--only", default=None, help="variants to run, by name, comma-separated (default: all)")
    a = ap.parse_args()
    need("lm_eval", extra="eval")
    from benchmarks.peers import cold_start
    from forge.runtime.model.embedded import materialize_model

    folder = Path(tempfile.mkdtemp(prefix="bench-lm-eval-"))
    model = materialize_model(ROOT / "functions" / "assets" / "tiny-llama", folder / "cache")
    tasks = write_tasks(folder, a.questions, a.prompts, a.shape)
    chosen = variants(model, tasks, folder, a.sizes.split(","))
    if a.only:
        chosen = {k: v for k, v in chosen.items() if k in a.only.split(",")}
    env = child_env(OMP_NUM_THREADS="2")
    starts = [cold_start.measure(str(model), "causal", 2, env)]
    trials = interleave(chosen, a.rounds)
    starts.append(cold_start.measure(str(model), "causal", 2, env))
    fl = lm_eval_floor.compute_floor(folder / "data", str(model), 2)
    report(trials, fl, cold_start.fastest(starts))


def report(trials, fl: dict, start) -> None:
    """The table (each variant's median, Forge over it), the floor and the ratios the issue asks."""
    forge = trials.median("forge")
    rows = []
    for name in trials.names:
        metrics = {} if name == DUMMY else trials.last(name)["metrics"]
        shown = ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()) if "stderr" not in k) or "-"
        walls = ", ".join(f"{w:.1f}" for w in trials.values(name))
        rows.append([name, f"{trials.median(name):.1f}", walls, f"{trials.median(name) / forge:.2f}x", shown])
    print(table(["variant", "wall s (median)", "walls by round", "x Forge's time", "metrics (last round)"], rows))
    own = trials.median(DUMMY) if DUMMY in trials.names else 0.0
    least = own + start.ready_s + fl["by_shape_s"]
    note(
        f"compute floor: {fl['tokens']:,} tokens ({fl['prefixes']} distinct contexts of {fl['prefix_tokens']:,} "
        f"tokens, their prefix tree's {fl['prefix_tree_tokens']:,} once; {fl['suffix_tokens']:,} continuation "
        f"tokens of {fl['requests']:,} requests; "
        f"{fl['prompt_tokens']:,} prompt tokens): {fl['by_shape_s']:.2f} s by shape ({fl['reads_s']:.2f} s of reads)"
    )
    note(
        f"least time of any exact model: lm-eval alone {own:.1f} s + cold start {start.ready_s:.2f} s "
        f"(imports {start.imports_s:.2f}, load {start.load_s:.2f}) + compute floor {fl['by_shape_s']:.2f} s "
        f"= {least:.1f} s; least / Forge's median: {least / forge:.2f} (the bar: at least 0.9)"
    )
    hf = [n for n in trials.names if n.startswith("hf ")]
    if hf:
        best = min(hf, key=trials.median)
        note(f"Forge vs best hf ({best}): {trials.median(best) / forge:.2f}x (bar 1.8x)")
        for name in hf:
            note(
                f"Forge vs {name}: {trials.median(name) / forge:.2f}x; "
                f"{name} over the least time: {trials.median(name) / least:.2f}x"
            )
    note(f"walls per round: {json.dumps({n: trials.values(n) for n in trials.names})}")
    note(f"load average per variant and round: {json.dumps({n: trials.values(n, 'load') for n in trials.names})}")


if __name__ == "__main__":
    main()
