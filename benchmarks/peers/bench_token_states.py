"""Every token's activations: Forge `pooling=none` against the real tools, the loader against a
naive read, and peak memory against the number of stored tokens. Not a test.

    pip install -e '.[bench-token-states]'   # nnsight and SAELens (its own venv: SAELens pins transformer-lens < 4)
    python -m benchmarks token-states write [--rows 1000] [--layer 2] [--rounds 2]
    python -m benchmarks token-states read [--tokens 1000000] [--rounds 3]
    python -m benchmarks token-states rss [--tokens 1000000 10000000]

write: the first `--rows` few-shot rows of the embedded statements (real text: a long shared
prefix, a short statement), the embedded model, float32, 2 threads, each variant a fresh
process timed from its start to its end (imports, model load and writing included), rounds
interleaved (the harness). Every variant stores the same thing as Forge with
`prefix_states=once`: each row's states after its prefix at `--layer`, plus each distinct
prefix's states once, as safetensors. The peers (`python -m benchmarks.peers.tools`):
  - `nnsight-states` (`LanguageModel.trace`, `torch.no_grad`), 32 rows per batch in arrival
    order, right-padded with an attention mask, as its docs batch; the same token ids as Forge's;
  - `saelens`: SAELens `CacheActivationsRunner` on the same model (`model_class_name=
    AutoModelForCausalLM`), fed each row's prefix + statement as text. It caches fixed windows
    of the token stream (context_size 256), so it stores every token of every row, prefixes
    again each time: its stored tokens are not Forge's, and the table says how many it stored.
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

import json
import shutil
import sys
import tempfile
from pathlib import Path

from benchmarks import harness, workloads


# -- writing ----------------------------------------------------------------------------------
def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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
    return sum(len(p) + len(t) for p, t in (workloads.probe_split(tok, r) for r in rows))


def _write_variants(a, rows: Path) -> dict[str, tuple[list[str], bool]]:
    """Each variant's command (without its output) and whether it is Forge's."""
    import nnsight
    import sae_lens

    from forge.functions.assets import embedded_model_source, materialize_model

    forge = [sys.executable, "-m", "forge.cli.app", "run", "function=probe_gen", "pooling=none", f"layers=[{a.layer}]"]
    forge += ["storage_dtype=float32", f"input.path={rows}", "devices=cpu", "batching=token"]
    model = str(materialize_model(embedded_model_source()))
    peer = [
        sys.executable,
        "-m",
        "benchmarks.peers.tools",
        "--rows",
        str(rows),
        "--model",
        model,
        "--layers",
        str(a.layer),
    ]
    return {
        "Forge token, prefix cache": (forge, True),
        "Forge packed rows <= 256, cache": (
            [*forge, "batching.packing=packed", "batching.packed_row_tokens=256"],
            True,
        ),
        f"nnsight {nnsight.__version__}, 32 rows, arrival order, no_grad": ([*peer, "nnsight-states"], False),
        f"SAELens {sae_lens.__version__} CacheActivationsRunner (context 256)": ([*peer, "saelens"], False),
    }


def write(a) -> None:
    harness.need("nnsight", "sae_lens", extra="bench-token-states")
    tmp = Path(tempfile.mkdtemp(prefix="bench-token-states-"))
    rows = workloads.write_jsonl(tmp / "rows.jsonl", workloads.statements(a.rows))
    commands = _write_variants(a, rows)
    names = list(commands)
    notes: dict[str, str] = {}
    outs = {name: tmp / str(k) for k, name in enumerate(names)}

    def variant(name: str):
        def run(r: int) -> float:
            cmd, forge = commands[name]
            shutil.rmtree(outs[name], ignore_errors=True)
            where = [f"output_dir={outs[name]}"] if forge else ["--out", str(outs[name])]
            child = harness.timed([*cmd, *where], check=False)
            if child.returncode:
                notes[name] = child.tail()[:200]
                return float("nan")
            return child.wall_s

        return run

    trials = harness.interleave({name: variant(name) for name in names}, a.rounds)
    _write_table(a, trials, rows, outs, notes)
    shutil.rmtree(tmp, ignore_errors=True)


def _write_table(a, trials: harness.Trials, rows: Path, outs: dict[str, Path], notes: dict[str, str]) -> None:
    names = trials.names
    nn_name = names[2]
    diff = (
        float("nan") if nn_name in notes else _largest_difference(outs[names[0]], outs[nn_name], a.layer, _rows(rows))
    )
    covered = _row_tokens(_rows(rows))
    got = {}
    for name in names:
        wall = trials.median(name)
        tokens, size = (0, 0) if name in notes else _stored(outs[name], a.layer)
        if name.startswith("SAELens") and name not in notes:
            tokens = _saelens_tokens(outs[name])
        ok = wall == wall and wall > 0
        got[name] = (wall, tokens, size, tokens / wall if ok else 0.0, covered / wall if ok else 0.0)
    lines = []
    for name, (wall, tokens, size, rate, cover) in got.items():
        d = "0 (the reference)" if name.startswith("Forge token") else f"{diff:.2g}" if name == nn_name else "-"
        per_row = not name.startswith("SAELens")  # SAELens's windows run rows together: not per-prompt states
        ratio = f"{cover / got[nn_name][4]:.2f}" if per_row and got[nn_name][4] else "-"
        lines.append(
            [name, f"{wall:.1f}", f"{tokens:,}", f"{size / 1e6:,.1f} MB", f"{rate:,.0f}"]
            + [f"{cover:,.0f}" if per_row else "-", ratio, d]
        )
    rep = harness.Report(a)
    rep.text(f"{a.rows} rows, layer {a.layer}, {a.rounds} rounds (medians of wall time, end to end)", "")
    header = ["variant", "wall s", "stored tokens", "bytes written", "stored tokens/s", "row tokens covered/s"]
    rep.table([*header, "x nnsight (covered/s)", "largest difference"], lines)
    rep.text(
        "",
        f"row tokens covered: {covered:,} (every row's prefix and statement tokens: the states each "
        "per-prompt variant gives back, prefixes stored once)",
    )
    rep.text(*(f"{name} failed: {why}" for name, why in notes.items()))
    rep.trials(trials)
    rep.save()


def main() -> None:
    from benchmarks.peers.token_states_store import read, rss

    ap = harness.parser(__doc__, out=False)
    sub = ap.add_subparsers(dest="part", required=True)
    w = harness.add_common(sub.add_parser("write", help="Forge against nnsight and SAELens"), rounds=2, rows=1000)
    w.add_argument("--layer", type=int, default=2)
    m = harness.add_common(sub.add_parser("rss", help="peak memory against stored tokens"))
    m.add_argument("--tokens", type=int, nargs="+", default=[1_000_000, 10_000_000])
    m.add_argument("--work", default=None, help="keep the model and runs here (default: a temp dir)")
    m.add_argument("--keep", action="store_true")
    r = harness.add_common(sub.add_parser("read", help="the loader against a naive read"), rounds=3)
    r.add_argument("--tokens", type=int, default=1_000_000)
    r.add_argument("--work", default=None, help="keep the model and the run here (default: a temp dir)")
    a = ap.parse_args()
    {"write": write, "rss": rss, "read": read}[a.part](a)


if __name__ == "__main__":
    main()
