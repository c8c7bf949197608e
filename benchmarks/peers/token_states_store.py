"""`token-states read` and `token-states rss` (see benchmarks/peers/bench_token_states.py): reading a
`pooling=none` run's shards back, and peak memory against the number of stored tokens."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import harness, workloads

ROOT = harness.ROOT
SHARD_MB = 32  # rss: shards of 32 MiB (250k tokens of hidden 64, bfloat16), so 1M and 10M both cut several


# -- memory -------------------------------------------------------------------------------------
class TreeRSS:
    """Peak resident memory of a process and its descendants, sampled from /proc."""

    def __init__(self, pid: int, every_s: float = 0.2):
        self.pid, self.every_s = pid, every_s
        self.peak_total = self.peak_one = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _tree(self) -> list[int]:
        out, todo = [], [self.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            try:
                for task in os.listdir(f"/proc/{pid}/task"):
                    todo += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
            except OSError:
                pass
        return out

    def _watch(self) -> None:
        while not self._stop.is_set():
            sizes = []
            for pid in self._tree():
                try:
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                        if line.startswith("VmRSS:"):
                            sizes.append(int(line.split()[1]) * 1024)
                except OSError:
                    pass
            self.peak_total, self.peak_one = max(self.peak_total, sum(sizes)), max([self.peak_one, *sizes])
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _small_model(root: Path) -> Path:
    """A random-weight Llama of hidden 64 and 2 layers with the embedded tokenizer."""
    import torch
    import transformers

    from forge.functions.assets import embedded_model_source

    path = root / "llama-h64"
    if (path / "config.json").exists():
        return path
    cfg = transformers.LlamaConfig(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    for f in embedded_model_source().iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, path / f.name)
    return path


def _token_rows(path: Path, tokens: int, per_row: int = 198) -> None:
    """Rows of ~`per_row` own tokens (28 statements joined) after one of the embedded prefixes (cut to 120
    characters), `tokens` own tokens in all."""
    base = workloads.embedded_statements()
    texts = [r["text"] for r in base]
    prefixes = list(dict.fromkeys(r["prefix"] for r in base if r.get("prefix")))
    with path.open("w") as f:
        k = n = 0
        while n < tokens:
            text = " ".join(texts[(k + j) % len(texts)] for j in range(28))
            f.write(json.dumps({"id": k, "text": text, "prefix": prefixes[k % len(prefixes)][:120]}) + "\n")
            k += 1
            n += per_row


def forge_store(root: Path, tokens: int, out: Path, model: Path) -> dict:
    rows = root / f"rows-{tokens}.jsonl"
    if not rows.exists():
        _token_rows(rows, tokens)
    command = [
        sys.executable,
        "-m",
        "forge.cli.app",
        "run",
        "function=probe_gen",
        "pooling=none",
        "layers=[2]",
        "storage_dtype=bfloat16",
        "model=hf",
        f"model.name={model}",
        f"input.path={rows}",
        "devices=cpu",
        "batching=token",
        f"shard_mb={SHARD_MB}",
        f"output_dir={out}",
    ]
    t0 = time.perf_counter()
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    watch = TreeRSS(proc.pid)
    err = proc.communicate()[1]
    watch.stop()
    if proc.returncode:
        raise SystemExit(f"forge run failed: {err.strip().splitlines()[-1]}")
    report = json.loads((out / "report.json").read_text())
    stored = sum(int(_stored_tokens(s)) for s in out.glob("*/*.safetensors"))
    return {
        "tokens": stored,
        "wall_s": time.perf_counter() - t0,
        "peak_tree": watch.peak_total,
        "peak_one": watch.peak_one,
        "items": report["items"]["completed"],
    }


def _stored_tokens(shard: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(shard), "pt") as f:
        return f.get_slice("layer_2").get_shape()[0]


def rss(a) -> None:
    root = Path(a.work or tempfile.mkdtemp(prefix="bench-rss-"))
    model = _small_model(root)
    rep = harness.Report(a)
    lines = []
    for tokens in a.tokens:
        out = root / f"run-{tokens}"
        shutil.rmtree(out, ignore_errors=True)
        m = forge_store(root, tokens, out, model)
        harness.note(f"{tokens:,} tokens: {m['wall_s']:.1f} s, peak {m['peak_tree'] / 2**20:,.0f} MiB")
        lines.append(
            [f"{m['tokens']:,}", f"{m['items']:,}", f"{m['wall_s']:.1f}", f"{m['tokens'] / m['wall_s']:,.0f}"]
            + [f"{m['peak_tree'] / 2**20:,.0f} MiB", f"{m['peak_one'] / 2**20:,.0f} MiB"]
        )
        rep.data[str(tokens)] = m
        if not a.keep:
            shutil.rmtree(out, ignore_errors=True)
    header = ["stored tokens", "items", "wall s", "stored tokens/s", "peak RSS, process tree"]
    rep.table([*header, "peak RSS, largest process"], lines)
    rep.save()


# -- reading ------------------------------------------------------------------------------------
READ_LOOP = """
import sys, time, resource, torch
torch.set_num_threads(2)
run, how = sys.argv[1], sys.argv[2]
t0 = time.perf_counter(); n = 0
if how == "loader":
    from forge.data import token_states
    for batch in token_states(run, layer=2, batch_size=4096, shuffle_buffer=1 << 20, seed=0):
        n += len(batch)
else:  # every shard whole, concatenated, one permutation, then batches
    import glob
    from safetensors.torch import load_file
    states = torch.cat([load_file(p)["layer_2"] for p in sorted(glob.glob(run + "/activations/*.safetensors"))])
    states = states[torch.randperm(len(states), generator=torch.Generator().manual_seed(0))]
    for lo in range(0, len(states), 4096):
        n += len(states[lo:lo + 4096])
print(n, time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def read(a) -> None:
    root = Path(a.work or tempfile.mkdtemp(prefix="bench-read-"))
    model = _small_model(root)
    out = root / f"run-{a.tokens}"
    if not (out / "report.json").exists():
        shutil.rmtree(out, ignore_errors=True)
        forge_store(root, a.tokens, out, model)

    def reader(how: str):
        def run(r: int) -> dict:
            n, seconds, peak = harness.timed([sys.executable, "-c", READ_LOOP, str(out), how], cwd=ROOT).stdout.split()
            return {"tokens": int(n), "wall_s": float(seconds), "peak_rss": int(peak)}  # the reading alone

        return run

    trials = harness.interleave(
        {"forge.data.token_states": reader("loader"), "naive: load all, permute": reader("naive")}, a.rounds
    )
    rep = harness.Report(a)
    tokens = trials.samples["forge.data.token_states"][0]["tokens"]
    rep.text(f"{tokens:,} stored tokens (bfloat16, hidden 64), {a.rounds} rounds, medians", "")
    lines = [
        [name, f"{tokens / trials.median(name):,.0f}", f"{trials.median(name, 'peak_rss') / 2**20:,.0f} MiB"]
        for name in trials.names
    ]
    rep.table(["reader", "tokens/s", "peak RSS"], lines)
    rep.trials(trials)
    rep.save()
