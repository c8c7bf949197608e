"""`lm_eval --model forge` against `--model hf` on the same model, whole processes side by side (issue 45).

    pip install -e '.[eval]'
    python -m benchmarks.bench_lm_eval [--questions 500] [--prompts 50] [--rounds 2] [--sizes 1,8,32,auto]

Two local tasks (written to a temporary folder, no download): a multiple-choice task of
`--questions` questions, 4 choices each, under the same 5 few-shot examples (`num_fewshot: 5`,
`sampler: first_n`: every question shares that context), and a `generate_until` task of
`--prompts` prompts (`until: ["."]`, 16 tokens). The model is the embedded tiny Llama, saved as a
Hugging Face folder both tools load. Every variant is one process, `python -m forge.eval ...`
(`--model forge`: batches in its own process, the session's default, or in a worker process with
`runtime.executor=process`) or `python -m lm_eval ...` (`--model hf --batch_size N`, and `auto`), timed
from its start to its exit, 2 torch threads each; rounds interleaved (`benchmarks/harness.py`),
medians reported, with each hf variant's time over Forge's. The metrics of every variant are
printed beside them (they must agree). No floor is measured here. Not a test.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import ROOT, child_env, interleave, need, note, table, timed

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
    return " ".join(WORDS[(k * 7 + i * 3 + k // 5) % len(WORDS)] for i in range(n))


def write_tasks(folder: Path, questions: int, prompts: int) -> Path:
    data = folder / "data"
    data.mkdir()

    def mc(k: int) -> dict:
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

    def runner(name: str, cmd: list[str]):
        def run(round_: int) -> dict:
            where = out / f"{name.replace(' ', '_').replace('=', '')}-{round_}"
            child = timed([*cmd, "--output_path", str(where)], env=env, cwd=ROOT, log=out / f"{where.name}.log")
            results = json.loads(next(where.rglob("results_*.json")).read_text())["results"]
            metrics = {f"{t}/{m}": v for t, r in results.items() for m, v in r.items() if isinstance(v, float)}
            return {"wall_s": child.wall_s, "metrics": metrics}

        return run

    return {name: runner(name, cmd) for name, cmd in commands.items()}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=500)
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sizes", default="1,8,32,auto")
    a = ap.parse_args()
    need("lm_eval", extra="eval")
    from forge.runtime.model.embedded import materialize_model

    folder = Path(tempfile.mkdtemp(prefix="bench-lm-eval-"))
    model = materialize_model(ROOT / "functions" / "assets" / "tiny-llama", folder / "cache")
    tasks = write_tasks(folder, a.questions, a.prompts)
    trials = interleave(variants(model, tasks, folder, a.sizes.split(",")), a.rounds)
    forge = trials.median("forge")
    rows = []
    for name in trials.names:
        metrics = trials.last(name)["metrics"]
        shown = ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()) if "stderr" not in k)
        rows.append([name, f"{trials.median(name):.1f}", f"{trials.median(name) / forge:.2f}x", shown])
    print(table(["variant", "wall s (median)", "x Forge's time", "metrics (last round)"], rows))
    note(f"walls per round: {json.dumps({n: trials.values(n) for n in trials.names})}")


if __name__ == "__main__":
    main()
