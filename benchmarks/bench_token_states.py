"""Every token's activations: Forge `pooling=none` against the real tools, the loader against a
naive read, and peak memory against the number of stored tokens. Not a test.

    pip install -e '.[bench-token-states]'   # nnsight and SAELens (its own venv: SAELens pins transformer-lens < 4)
    python -m benchmarks.bench_token_states write [--rows 1000] [--layer 2] [--rounds 2]
    python -m benchmarks.bench_token_states read [--tokens 1000000] [--rounds 3]
    python -m benchmarks.bench_token_states rss [--tokens 1000000 10000000]

write: the first `--rows` few-shot rows of the embedded statements (real text: a long shared
prefix, a short statement), the embedded model, float32, 2 threads, each variant a fresh
process timed from its start to its end (imports, model load and writing included), rounds
interleaved A B C D, D C B A. Every variant stores the same thing as Forge with
`prefix_states=once`: each row's states after its prefix at `--layer`, plus each distinct
prefix's states once, as safetensors. The peers:
  - nnsight (`LanguageModel.trace`, `torch.no_grad`), 32 rows per batch in arrival order,
    right-padded with an attention mask, as its docs batch; the same token ids as Forge's;
  - SAELens `CacheActivationsRunner` on the same model (`model_class_name=AutoModelForCausalLM`),
    fed each row's prefix + statement as text. It caches fixed windows of the token stream
    (context_size 256), so it stores every token of every row, prefixes again each time: its
    stored tokens are not Forge's, and the table says how many it stored.
The table gives stored tokens per second and bytes written, and checks nnsight's states
against Forge's (largest difference).

read: a pooling=none run's shards (`--tokens` stored tokens) read by `forge.data.token_states`
(batches of 4096, 1M-token shuffle buffer, one process) against a naive read (every shard
loaded whole, concatenated, one permutation, then batches); tokens per second and peak RSS.

rss: a Forge pooling=none run storing `--tokens` tokens, on a random-weight 2-layer model of
hidden 64 (so 10M tokens take minutes on 2 cores), bfloat16 storage, `shard_mb=32`; the peak
RSS of the whole process tree (driver and worker, sampled every 0.2 s) and of its largest
process. The driver holds at most one shard's rows (and their copy while it is written).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULE = "benchmarks.bench_token_states"
SHARD_MB = 32  # rss: shards of 32 MiB (250k tokens of hidden 64, bfloat16), so 1M and 10M both cut several


# -- peers, each run as its own process --------------------------------------------------------
def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def nnsight_writer(rows_path: Path, out: Path, layer: int, batch_size: int = 32) -> None:
    """The user's loop: nnsight traces of 32 right-padded rows in arrival order, saving the
    layer's states; each row's own tokens kept, each prefix's states once; safetensors shards."""
    import torch
    import transformers
    from nnsight import LanguageModel
    from safetensors.torch import save_file

    from forge.functions.assets import embedded_model_source, materialize_model

    torch.set_num_threads(2)
    src = materialize_model(embedded_model_source())
    tok = transformers.AutoTokenizer.from_pretrained(src)
    lm = LanguageModel(
        transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval(), tokenizer=tok
    )
    rows = _rows(rows_path)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    seen: set[str] = set()
    own: list[torch.Tensor] = []
    prefixes: list[torch.Tensor] = []
    out.mkdir(parents=True, exist_ok=True)
    for lo in range(0, len(rows), batch_size):
        batch = rows[lo : lo + batch_size]
        seqs, plens = [], []
        for r in batch:
            pre = tok(r["prefix"])["input_ids"] if r.get("prefix") else []
            text = tok(r["text"], add_special_tokens=not pre)["input_ids"]
            seqs.append(pre + text)
            plens.append(len(pre))
        width = max(map(len, seqs))
        ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        with torch.no_grad():
            with lm.trace({"input_ids": ids, "attention_mask": mask}):
                output = lm.model.layers[layer - 1].output
                states = (output[0] if isinstance(output, tuple) else output).save()
        for r, s, p, h in zip(batch, seqs, plens, states):
            own.append(h[p : len(s)].clone())
            if p and r["prefix"] not in seen:
                seen.add(r["prefix"])
                prefixes.append(h[:p].clone())
    for name, parts in (("activations", own), ("prefix_states", prefixes)):
        offsets = torch.tensor([0, *torch.cumsum(torch.tensor([len(x) for x in parts]), 0).tolist()])
        save_file(
            {f"layer_{layer}": torch.cat(parts), f"layer_{layer}.offsets": offsets}, str(out / f"{name}.safetensors")
        )


def saelens_writer(rows_path: Path, out: Path, layer: int) -> None:
    """SAELens's activation cache runner on the same model and texts (prefix + statement)."""
    import torch
    import transformers
    from sae_lens import CacheActivationsRunner, CacheActivationsRunnerConfig

    from forge.functions.assets import embedded_model_source, materialize_model

    torch.set_num_threads(2)
    src = materialize_model(embedded_model_source())
    tok = transformers.AutoTokenizer.from_pretrained(src)
    rows = _rows(rows_path)
    texts = [(r.get("prefix") or "") + r["text"] for r in rows]
    tokens = sum(len(tok(t)["input_ids"]) for t in texts)
    data = out.parent / f"{out.name}-dataset"
    data.mkdir(parents=True, exist_ok=True)
    (data / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    context = 256
    cfg = CacheActivationsRunnerConfig(
        dataset_path=str(data),
        model_name=str(src),
        model_class_name="AutoModelForCausalLM",
        hook_name=f"model.layers.{layer - 1}",
        d_in=int(transformers.AutoConfig.from_pretrained(src).hidden_size),
        training_tokens=tokens // context * context,
        context_size=context,
        model_batch_size=32,
        new_cached_activations_path=str(out),
        device="cpu",
        buffer_size_gb=0.25,
        shuffle=False,
        streaming=False,
    )
    CacheActivationsRunner(cfg).run()


# -- measuring ----------------------------------------------------------------------------------
def _timed(command: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        return float("nan"), (proc.stdout + proc.stderr).strip().splitlines()[-1][:200]
    return wall, ""


def _stored(out: Path, layer: int) -> tuple[int, int]:
    """(stored tokens, bytes of the state shards) under `out`."""
    from safetensors import safe_open

    tokens = size = 0
    for shard in out.rglob("*.safetensors"):
        size += shard.stat().st_size
        with safe_open(str(shard), "pt") as f:
            tokens += int(f.get_slice(f"layer_{layer}").get_shape()[0])
    for arrow in out.rglob("*.arrow"):  # SAELens: a datasets Arrow table of [context, d_in] rows
        size += arrow.stat().st_size
    return tokens, size


def _saelens_tokens(out: Path) -> int:
    import datasets

    ds = datasets.load_from_disk(str(out))
    first = ds.column_names[0]
    return len(ds) * len(ds[0][first])


def _largest_difference(forge_out: Path, nnsight_out: Path, layer: int, rows: list[dict]) -> float:
    """Largest difference between Forge's stored states and the nnsight loop's, over every row."""
    import torch
    from safetensors.torch import load_file

    from forge.io.results import load

    position = {str(r["id"]) if "id" in r else f"#{i}": i for i, r in enumerate(rows)}
    res = load(forge_out, "activations")
    mine = load_file(str(nnsight_out / "activations.safetensors"))
    offsets = mine[f"layer_{layer}.offsets"].tolist()
    worst = 0.0
    for k, item in enumerate(res.ids):
        a, b = offsets[position[item]], offsets[position[item] + 1]
        got = torch.from_numpy(res.columns[f"layer_{layer}"][k])
        worst = max(worst, float((mine[f"layer_{layer}"][a:b] - got).abs().max()))
    return worst


def _row_tokens(rows: list[dict]) -> int:
    """Every row's prefix and statement tokens, by Forge's token rule."""
    import transformers

    from forge.functions.assets import embedded_model_source

    tok = transformers.AutoTokenizer.from_pretrained(embedded_model_source())
    total = 0
    for r in rows:
        pre = tok(r["prefix"])["input_ids"] if r.get("prefix") else []
        total += len(pre) + len(tok(r["text"], add_special_tokens=not pre)["input_ids"])
    return total


def write(a) -> None:
    import nnsight
    import sae_lens

    from forge.functions.assets import embedded_dataset_path

    tmp = Path(tempfile.mkdtemp(prefix="bench-token-states-"))
    rows = tmp / "rows.jsonl"
    rows.write_text("".join(line + "\n" for line in embedded_dataset_path().read_text().splitlines()[: a.rows]))
    forge = [
        sys.executable,
        "-m",
        "forge.cli.app",
        "run",
        "function=probe_gen",
        "pooling=none",
        f"layers=[{a.layer}]",
        "storage_dtype=float32",
        f"input.path={rows}",
        "devices=cpu",
    ]
    variants = {
        "Forge token, prefix cache": forge + ["batching=token"],
        "Forge packed rows <= 256, cache": forge
        + ["batching=token", "batching.packing=packed", "batching.packed_row_tokens=256"],
        f"nnsight {nnsight.__version__}, 32 rows, arrival order, no_grad": [sys.executable, "-m", MODULE, "nnsight"],
        f"SAELens {sae_lens.__version__} CacheActivationsRunner (context 256)": [
            sys.executable,
            "-m",
            MODULE,
            "saelens",
        ],
    }
    names = list(variants)
    walls: dict[str, list[float]] = {n: [] for n in names}
    notes: dict[str, str] = {}
    outs: dict[str, Path] = {}
    for r in range(a.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            out = tmp / f"{names.index(name)}-{r}"
            command = variants[name] + (
                [f"output_dir={out}"]
                if name.startswith("Forge")
                else ["--rows-path", str(rows), "--out", str(out), "--layer", str(a.layer)]
            )
            wall, error = _timed(command)
            walls[name].append(wall)
            if error:
                notes[name] = error
            outs[name] = out
            print(f"round {r}: {name}: {wall:.1f} s {error}", file=sys.stderr)
    nn_name = names[2]
    diff = (
        float("nan") if nn_name in notes else _largest_difference(outs[names[0]], outs[nn_name], a.layer, _rows(rows))
    )
    print(f"\n{a.rows} rows, layer {a.layer}, {a.rounds} rounds (medians of wall time, end to end)\n")
    covered = _row_tokens(_rows(rows))
    print(
        "| variant | wall s | stored tokens | bytes written | stored tokens/s | row tokens covered/s | "
        "x nnsight (covered/s) | largest difference |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    table = {}
    for name in names:
        wall = statistics.median(walls[name])
        tokens, size = (0, 0) if name in notes else _stored(outs[name], a.layer)
        if name.startswith("SAELens") and name not in notes:
            tokens = _saelens_tokens(outs[name])
        ok = wall == wall and wall > 0
        table[name] = (wall, tokens, size, tokens / wall if ok else 0.0, covered / wall if ok else 0.0)
    for name, (wall, tokens, size, rate, cover) in table.items():
        d = "0 (the reference)" if name.startswith("Forge token") else f"{diff:.2g}" if name == nn_name else "-"
        per_row = not name.startswith("SAELens")  # SAELens's windows run rows together: not per-prompt states
        ratio = f"{cover / table[nn_name][4]:.2f}" if per_row and table[nn_name][4] else "-"
        print(
            f"| {name} | {wall:.1f} | {tokens:,} | {size / 1e6:,.1f} MB | {rate:,.0f} | "
            f"{f'{cover:,.0f}' if per_row else '-'} | {ratio} | {d} |"
        )
    print(
        f"\nrow tokens covered: {covered:,} (every row's prefix and statement tokens: the states each "
        "per-prompt variant gives back, prefixes stored once)"
    )
    for name, why in notes.items():
        print(f"\n{name} failed: {why}")
    shutil.rmtree(tmp, ignore_errors=True)


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
    from forge.functions.assets import embedded_dataset_path

    base = _rows(embedded_dataset_path())
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
    print("| stored tokens | items | wall s | stored tokens/s | peak RSS, process tree | peak RSS, largest process |")
    print("| --- | --- | --- | --- | --- | --- |")
    for tokens in a.tokens:
        out = root / f"run-{tokens}"
        shutil.rmtree(out, ignore_errors=True)
        m = forge_store(root, tokens, out, model)
        print(
            f"| {m['tokens']:,} | {m['items']:,} | {m['wall_s']:.1f} | {m['tokens'] / m['wall_s']:,.0f} | "
            f"{m['peak_tree'] / 2**20:,.0f} MiB | {m['peak_one'] / 2**20:,.0f} MiB |",
            flush=True,
        )
        if not a.keep:
            shutil.rmtree(out, ignore_errors=True)


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
    seen: dict[str, list[tuple[int, float, int]]] = {"forge.data.token_states": [], "naive: load all, permute": []}
    names = list(seen)
    for r in range(a.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            how = "loader" if name.startswith("forge") else "naive"
            done = subprocess.run(
                [sys.executable, "-c", READ_LOOP, str(out), how], cwd=ROOT, capture_output=True, text=True, check=True
            ).stdout.split()
            seen[name].append((int(done[0]), float(done[1]), int(done[2])))
    print(f"\n{seen[names[0]][0][0]:,} stored tokens (bfloat16, hidden 64), {a.rounds} rounds, medians\n")
    print("| reader | tokens/s | peak RSS |")
    print("| --- | --- | --- |")
    for name in names:
        n = seen[name][0][0]
        print(
            f"| {name} | {statistics.median(n / s for _, s, _ in seen[name]):,.0f} | "
            f"{statistics.median(m for _, _, m in seen[name]) / 2**20:,.0f} MiB |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="part", required=True)
    w = sub.add_parser("write")
    w.add_argument("--rows", type=int, default=1000)
    w.add_argument("--layer", type=int, default=2)
    w.add_argument("--rounds", type=int, default=2)
    m = sub.add_parser("rss")
    m.add_argument("--tokens", type=int, nargs="+", default=[1_000_000, 10_000_000])
    m.add_argument("--work", default=None)
    m.add_argument("--keep", action="store_true")
    r = sub.add_parser("read")
    r.add_argument("--tokens", type=int, default=1_000_000)
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--work", default=None)
    for name in ("nnsight", "saelens"):
        p = sub.add_parser(name)
        p.add_argument("--rows-path", type=Path, required=True)
        p.add_argument("--out", type=Path, required=True)
        p.add_argument("--layer", type=int, default=2)
    a = ap.parse_args()
    if a.part == "nnsight":
        nnsight_writer(a.rows_path, a.out, a.layer)
    elif a.part == "saelens":
        saelens_writer(a.rows_path, a.out, a.layer)
    else:
        {"write": write, "rss": rss, "read": read}[a.part](a)


if __name__ == "__main__":
    main()
