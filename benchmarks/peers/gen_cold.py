"""The generate benchmark end to end, as a user runs each tool: one fresh process per run.

    python -m benchmarks generate-cold [--shape long] [--limit 200] [--max-new-tokens 32] [--rounds 1]

Each way is a new process timed from its spawn to its exit (imports, model load and tokenizing
included), with the peak of the summed resident memory of it and all its descendants (sampled
every 20 ms from /proc), and with --pss the peak of their summed proportional set size (PSS: each
page shared between them, a library's code or a worker's pages inherited from its fork server,
counted once in all, not once a process as summed RSS counts it; reading it slows a busy tree, so
a run with --pss is for its memory, not its times): Forge as `forge run
function=generate` (its default executor: a driver and a worker process), the peers as a small
script that loads the model with transformers and runs left-padded `model.generate` in sorted
batches, or lm-eval's `HFLM.generate_until`, on the same rows (prefix + prompt text). Exactness
is the in-process benchmark's (`python -m benchmarks generate`): the peers here tokenize the
joined text themselves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import harness, workloads

PAGE = os.sysconf("SC_PAGE_SIZE")

PEER = """
import json, sys, torch
way, rows, max_new, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
from transformers import AutoModelForCausalLM, AutoTokenizer
from forge.runtime.model.embedded import embedded_model_source, materialize_model
torch.set_num_threads(1)
d = str(materialize_model(embedded_model_source()))
texts = [(r.get("prefix") or "") + r["prompt"] for r in map(json.loads, open(rows))]
if way == "lm-eval":
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    lm = HFLM(pretrained=d, batch_size=batch, device="cpu", dtype="float32")
    kw = {"until": [], "max_gen_toks": max_new, "do_sample": False}
    reqs = [Instance("generate_until", {}, (t, dict(kw)), k) for k, t in enumerate(texts)]
    lm.generate_until(reqs, disable_tqdm=True)
else:
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(d)
    tok.padding_side = "left"
    texts.sort(key=lambda t: -len(tok(t)["input_ids"]))
    with torch.inference_mode():
        for k in range(0, len(texts), batch):
            x = tok(texts[k : k + batch], return_tensors="pt", padding=True)
            model.generate(**x, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id)
"""


class PeakRss:
    """This process's peak resident memory while the block runs (sampled every 10 ms)."""

    @staticmethod
    def now() -> int:
        return rss("self")

    def __enter__(self):
        self.start = self.peak = self.now()
        self.done, self.thread = threading.Event(), threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.done.wait(0.01):
            self.peak = max(self.peak, self.now())

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, self.now())


def rss(pid: int | str) -> int:
    """The resident bytes of process `pid` (0: gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except OSError:
        return 0


def children(pid: int) -> list[int]:
    """The processes `pid`'s threads started (none: gone)."""
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def tree(pid: int) -> list[int]:
    """`pid` and all its descendants."""
    out, todo = [], [pid]
    while todo:
        out.append(p := todo.pop())
        todo += children(p)
    return out


def pss(pid: int | str) -> int:
    """The proportional set size of process `pid` in bytes: its private pages, and each page it
    shares divided by the number of processes mapping it (0: gone; Linux 4.14+)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def tree_rss(pid: int) -> int:
    """The resident bytes of `pid` and all its descendants."""
    return sum(rss(p) for p in tree(pid))


def tree_memory(pid: int, with_pss: bool) -> tuple[int, int]:
    """(summed RSS, summed PSS, 0 unless `with_pss`) of `pid` and all its descendants, in bytes."""
    pids = tree(pid)
    return sum(rss(p) for p in pids), (sum(pss(p) for p in pids) if with_pss else 0)


#: reading smaps_rollup walks a process's page tables (up to 30-36 ms for one of Forge's on this
#: machine, measured while it ran): sampled beside the run it slowed Forge's tree of four processes,
#: two of them busy on two cores, by a third or more (long shape, 32 new tokens: 13.3-13.7 s every
#: 20 ms, 11.3 s every 0.5 s, against 9.1-10.1 s with RSS alone or no sampling), a one-process peer
#: not (its second core idle). So PSS is read only with --pss, and timings are then not comparable.


def timed(cmd: list[str], env: dict, with_pss: bool = False) -> dict:
    """One process run: its wall seconds from spawn to exit and the peaks of its tree's summed RSS
    and, `with_pss`, PSS (0: not read)."""
    peak, t0 = [0, 0], time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def sample() -> None:
        while proc.poll() is None:
            peak[:] = map(max, peak, tree_memory(proc.pid, with_pss))
            time.sleep(0.02)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    _, err = proc.communicate()
    wall = time.perf_counter() - t0
    thread.join()
    if proc.returncode:
        raise RuntimeError(f"{cmd[:4]} failed ({proc.returncode}): {err[-2000:]}")
    return {"wall_s": wall, "peak_mib": peak[0] / 2**20, "peak_pss_mib": peak[1] / 2**20}


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__, rounds=1, threads=1, only=None)
    ap.add_argument("--shape", default="long", help="short | long (default: long)")
    ap.add_argument("--limit", type=int, default=200, help="the first N prompts of the shape (default: 200)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=32, help="the peers' batch (default: 32)")
    ap.add_argument("--forge", default="", help="overrides for the Forge run, space-separated")
    ap.add_argument("--pss", action="store_true", help="sample each tree's PSS too (slows a busy tree: timings off)")
    a = ap.parse_args(argv)
    from benchmarks.peers import gen_shapes
    from forge.api import InputSpec, ModelSpec
    from forge.functions.generate import Generate, GenerateConfig
    from forge.runtime.model.spec import resolve_input

    src = resolve_input("embedded:prompts")
    base = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    tokenizer = Generate(GenerateConfig(model=ModelSpec(name="embedded:tiny-llama"), input=InputSpec(path=str(src))))
    work = Path(tempfile.mkdtemp(prefix="bench-generate-cold-"))
    rows = workloads.write_jsonl(work / "rows.jsonl", gen_shapes.rows(a.shape, base, tokenizer.tokenizer)[: a.limit])
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    n, b = str(a.max_new_tokens), str(a.batch_size)
    runs = iter(range(10**6))
    ways = {
        "generate, left-padded batches, sorted": lambda: timed(
            [sys.executable, "-c", PEER, "padded", str(rows), n, b], env, a.pss
        ),
        "lm-eval HFLM generate_until": lambda: timed(
            [sys.executable, "-c", PEER, "lm-eval", str(rows), n, b], env, a.pss
        ),
        "Forge generate (forge run)": lambda: timed(
            [
                "forge",
                "run",
                "function=generate",
                f"input.path={rows}",
                f"max_new_tokens={n}",
                f"output_dir={work / f'run{next(runs)}'}",
                *a.forge.split(),
            ],
            env,
            a.pss,
        ),  # fmt: skip
    }
    chosen = harness.pick(ways, a.only)
    trials = harness.interleave({k: lambda r, k=k: chosen[k]() for k in chosen}, a.rounds)
    rep = harness.Report(a)
    rep.text(f"{a.limit} {a.shape} prompts, max_new_tokens {n}, load average {os.getloadavg()[0]:.1f}")
    peers = [k for k in trials.names if not k.startswith("Forge")]
    best = min([float(trials.median(k)) for k in peers] or [0.0])
    table = [[k, f"{trials.median(k):.2f}", f"{max(trials.values(k, 'peak_mib')):,.0f}",
              f"{max(trials.values(k, 'peak_pss_mib')):,.0f}" if a.pss else "- (--pss)"]
             + [f"{best / trials.median(k):.2f}" if best else "-"] for k in trials.names]  # fmt: skip
    heads = [
        "way",
        "median wall s (spawn to exit)",
        "peak RSS MiB (tree, summed)",
        "peak PSS MiB (tree)",
        "x best peer",
    ]
    rep.table(heads, table)
    rep.trials(trials)
    rep.save()


if __name__ == "__main__":
    main()
