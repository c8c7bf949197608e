"""`score` against an IMITATION of lm-evaluation-harness's loglikelihood loop (not lm-eval itself).

The real peer is measured by `benchmarks/bench_peers.py score` (lm-eval's own `HFLM`, as a
subprocess, end to end): docs/benchmarks.md's table for `score` comes from there. Measured on
one quiet machine (issue 20), this imitation ran about 1.5x slower than real lm-eval, and it
times Forge in-process (no start-up), so a ratio from this script overstates Forge; keep it for
the engine-internal comparison only.

    python -m benchmarks.bench_score [--questions 2000] [--shots 10] [--batch-size 32] [--rounds 1] [--threads N]

Workload: questions built like the embedded multiple-choice set (`functions/assets/
build_multiple_choice.py`), each with a few-shot context of `--shots` solved questions (10: ~440
tokens with the embedded tokenizer) and 4 choices; the embedded 4-layer Llama, float32, one device.

* Forge: `forge run function=score batching=token` (prefix cache on, rows), through the real
  engine (admission, scheduler, run loop, sink writing Parquet shards), in-process executor.
* Baseline (an imitation written here), as lm-eval's HFLM `_loglikelihood_tokens` runs: the same
  requests (token ids from the same lm-eval tokenization), sorted by total length descending,
  fixed batches of `--batch-size`, right-padded, one full forward pass of context + continuation
  per request (no prefix reuse), log_softmax over the full logits, gathered at the continuation's positions.

Both give every request's loglik and greedy flag; the table compares them. Useful tokens are
the tokens each request reads (context + continuation - 1), the same count for both. Rounds run
interleaved, A B then B A, ..., and the ratio is of medians from this one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def workload(path: Path, n: int, shots: int) -> None:
    from forge.functions.assets.build_multiple_choice import questions

    rows = questions(n, shots=shots, seed=7)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def run_forge(rows: Path, out: Path, device: str) -> tuple[float, dict, dict]:
    """(wall seconds, {id: (loglik, greedy)}, report)."""
    from forge.cli.compose import compose
    from forge.config.build import build_spec
    from forge.core.engine import execute
    from forge.functions.score import load_scores
    from forge.pluginmanager import make_plugin_manager

    cfg = compose(
        [
            "function=score",
            f"input.path={rows}",
            "batching=token",
            "runtime.executor=inprocess",
            f"devices={device}",
            "shard_size=100000",
        ]
    )
    t0 = time.perf_counter()
    report = execute(build_spec(cfg, out), make_plugin_manager())
    wall = time.perf_counter() - t0
    table = load_scores(out).to_pylist()
    return wall, {r["id"]: (r["loglik"], r["greedy"]) for r in table}, report


def requests(rows: Path) -> list[tuple[str, list[int], list[int]]]:
    """(id, context ids, continuation ids) as lm-eval's encode_pair makes them (Forge's tokenizer
    rule is tested equal to it in tests/test_score.py)."""
    from forge.functions.score import Score

    fn = Score(model={"name": "embedded:tiny-llama"}, input={"path": str(rows)})
    out = []
    for item in fn.records():
        cont = list(item.meta.targets)
        ids = list(item.tokens) + [cont[-1]]
        out.append((item.id, ids[: len(ids) - len(cont)], cont))
    return out


def run_baseline(model, reqs, batch_size: int, device: str) -> tuple[float, dict]:
    """lm-eval's loop: sort by -len(context + continuation), fixed batches, full forward, full log_softmax."""
    t0 = time.perf_counter()
    order = sorted(
        range(len(reqs)), key=lambda i: (-(len(reqs[i][1]) + len(reqs[i][2])), tuple(reqs[i][1] + reqs[i][2]))
    )
    out = {}
    with torch.inference_mode():
        for lo in range(0, len(order), batch_size):
            chunk = [reqs[i] for i in order[lo : lo + batch_size]]
            inps = [(ctx + cont)[-2049:][:-1] for _, ctx, cont in chunk]
            width = max(len(x) for x in inps)
            ids = torch.zeros(len(inps), width, dtype=torch.long)
            for r, x in enumerate(inps):
                ids[r, : len(x)] = torch.tensor(x)
            logp = torch.log_softmax(model(input_ids=ids.to(device)).logits, dim=-1).cpu()
            for r, (rid, _, cont) in enumerate(chunk):
                n = len(inps[r])
                lp = logp[r, n - len(cont) : n]
                tgt = torch.tensor(cont)
                out[rid] = (float(lp.gather(1, tgt[:, None]).sum()), bool((lp.argmax(-1) == tgt).all()))
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=int, default=2000)
    ap.add_argument("--shots", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1, help="A B, then B A, ... (medians reported)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from forge.functions.assets import embedded_model_source, materialize_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tmp = Path(tempfile.mkdtemp(prefix="bench-score-"))
    rows = tmp / "mc.jsonl"
    workload(rows, args.questions, args.shots)
    reqs = requests(rows)
    useful = sum(len(ctx) + len(cont) - 1 for _, ctx, cont in reqs)
    ctx_lens = [len(ctx) for _, ctx, _ in reqs]
    print(
        f"{args.questions} questions x 4 choices = {len(reqs)} requests; context {np.mean(ctx_lens):.0f} tokens "
        f"(min {min(ctx_lens)}, max {max(ctx_lens)}); {useful:,} useful tokens; device {device}; "
        f"torch threads {torch.get_num_threads()}"
    )
    model = (
        AutoModelForCausalLM.from_pretrained(materialize_model(embedded_model_source()), dtype=torch.float32)
        .to(device)
        .eval()
    )
    times: dict[str, list[float]] = {"forge": [], "baseline": []}
    results: dict[str, dict] = {}
    report = None
    for r in range(args.rounds):
        for name in ("forge", "baseline") if r % 2 == 0 else ("baseline", "forge"):
            if name == "forge":
                wall, res, report = run_forge(rows, tmp / f"forge-{r}", "auto")
            else:
                wall, res = run_baseline(model, reqs, args.batch_size, device)
            times[name].append(wall)
            results[name] = res
            print(f"round {r + 1}: {name:8s} {wall:8.1f} s  {useful / wall:10,.0f} useful tok/s", flush=True)
    f, b = results["forge"], results["baseline"]
    diff = max(abs(f[i][0] - b[i][0]) for i in b)
    greedy_same = sum(f[i][1] == b[i][1] for i in b)
    med = {k: statistics.median(v) for k, v in times.items()}
    print()
    print(f"| strategy | wall s (median of {args.rounds}) | useful tok/s | ratio |")
    print("| --- | --- | --- | --- |")
    print(
        f"| imitation of lm-eval's loop (not lm-eval): sorted by length, batch {args.batch_size}, no prefix reuse | "
        f"{med['baseline']:.1f} | {useful / med['baseline']:,.0f} | 1.00 |"
    )
    print(
        f"| Forge score, batching=token, prefix cache | {med['forge']:.1f} | {useful / med['forge']:,.0f} | "
        f"{med['baseline'] / med['forge']:.2f} |"
    )
    print()
    print(
        f"same outputs: max |loglik difference| {diff:.2e} over {len(b)} requests; greedy flag equal on "
        f"{greedy_same}/{len(b)}; Forge report: {report['batches']} batches, cache hit rate "
        f"{report['cache_hit_rate']:.3f}, padding waste {report['padding_waste']:.4f}, acc "
        f"{report['outputs']['accuracy']['acc']}, acc_norm {report['outputs']['accuracy']['acc_norm']}"
    )


if __name__ == "__main__":
    main()
