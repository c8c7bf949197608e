"""Forge `generate` against transformers and lm-eval generation, side by side in one process (issue 37).

    python -m benchmarks generate [--shape short|long] [--limit 500] [--max-new-tokens 64] [--rounds 2]

The embedded prompts of `--shape` (gen_shapes.py: short as they are, long with 300-400-token
prefixes and ~50 own tokens; the first `--limit` of 500, behind 40 prefixes) on the embedded model,
greedy, `--max-new-tokens` each, float32 on the CPU, Forge's token ids for every way. Ways, on one loaded model:
1. transformers `model.generate`, one prompt at a time, no padding: the exactness reference;
2. `model.generate` in left-padded batches of `--batch-size`, prompts sorted longest first (lm-eval's way);
3. transformers `model.generate_batch` (continuous batching), its default configuration;
4. lm-eval `HFLM(pretrained=model, tokenizer=..., batch_size=...).generate_until`, `until` empty;
5. Forge `forge run function=generate` in-process (`forge.testing.run_function`); each `--forge`
   adds a variant with those overrides.

Per way, medians over interleaved rounds: output tokens/s and ms per output token over its wall
time (Forge: the whole run, compose, load and writing included; its engine's own figure below);
padding (pad slots / rows x final width; Forge: of its prefill and decode slots); prefill computed
/ prompt tokens (padded: pad slots counted; Forge: its steps' tokens less the decode tokens, as
its ledger counts them; generate_batch: not counted); this process's peak RSS while it ran
(sampled every 10 ms; rough); outputs equal to the one-at-a-time ids (cut after the first EOS).
The floor (benchmarks/floor.py): each distinct prefix once, every suffix and every generated token
but the last, no padding, at the best rates measured, plus their reads of the keys before them; no
LM head: a loose lower bound.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import floor, harness, workloads
from benchmarks.peers import gen_shapes
from benchmarks.peers.gen_cold import PeakRss

ONE = "transformers generate, one at a time"
PADDED = "generate, left-padded batches, sorted"
CB = "transformers generate_batch, defaults"
LMEVAL = "lm-eval HFLM generate_until"
FORGE = "Forge generate"
DEFAULT_MODEL = "embedded:tiny-llama"


@dataclass
class Work:
    """The prompts (Forge's token ids), the loaded model and what every way shares."""

    rows_path: Path
    run_dir: Path
    row_ids: list[str]
    ids: list[list[int]]  # prompt token ids by Forge's token rule
    prefix: list[tuple[str, int]]  # (prefix key, prefix length) per prompt
    contexts: list[str]  # prefix + prompt text: lm-eval's request, mapped back to `ids`
    model: Any
    tokenizer: Any
    model_dir: str
    model_name: str  # --model, as given
    eos: set[int]
    pad: int
    max_new: int
    batch: int
    reference: list[list[int]] | None = None  # the one-at-a-time outputs, once way 1 has run

    def config(self):
        from transformers import GenerationConfig

        eos = sorted(self.eos) or None
        return GenerationConfig(do_sample=False, max_new_tokens=self.max_new, eos_token_id=eos, pad_token_id=self.pad)

    def cut(self, ids) -> list[int]:
        """The generated ids up to and including the first EOS, at most `max_new`."""
        out = [int(t) for t in list(ids)[: self.max_new]]
        return next((out[: k + 1] for k, t in enumerate(out) if t in self.eos), out)


def load(a) -> Work:
    import torch
    from transformers import AutoModelForCausalLM

    from forge.api import InputSpec, ModelSpec
    from forge.functions.generate import Generate, GenerateConfig
    from forge.runtime.model.spec import resolve_input

    work = Path(tempfile.mkdtemp(prefix="bench-generate-"))
    lines = resolve_input("embedded:prompts").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    spec = {"model": ModelSpec(name=a.model), "input": InputSpec(path=str(resolve_input("embedded:prompts")))}
    rows = gen_shapes.rows(a.shape, rows, Generate(GenerateConfig(**spec)).tokenizer)[: a.limit]
    path = workloads.write_jsonl(work / "prompts.jsonl", rows)
    spec["input"] = InputSpec(path=str(path))
    fn = Generate(GenerateConfig(**spec, max_new_tokens=a.max_new_tokens))
    records = {str(r.id): r for r in fn.records()}
    assert len(records) == len(rows), (len(records), len(rows))
    model = fn.hf.load(AutoModelForCausalLM, "cpu", fn.caps.attn)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    recs = [records[str(r["id"])] for r in rows]
    torch.set_num_threads(a.threads)
    prompts = [[int(t) for t in r.tokens] for r in recs], [(str(r.prefix_key), int(r.prefix_len)) for r in recs]
    texts = [(r.get("prefix") or "") + r["prompt"] for r in rows]
    return Work(path, work / "run", [str(r["id"]) for r in rows], *prompts, texts, model, fn.tokenizer,
                str(fn.hf.loaded_from), a.model, eos, int(fn.hf.pad_token_id), a.max_new_tokens,
                a.batch_size)  # fmt: skip


def left_pad(seqs: list[list[int]], pad: int):
    import torch

    width = max(map(len, seqs))
    ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
    return ids, mask


def one_at_a_time(w: Work) -> dict:
    import torch

    outs, config = [], w.config()
    with torch.inference_mode():
        for ids in w.ids:
            x = torch.tensor([ids])
            y = w.model.generate(x, attention_mask=torch.ones_like(x), generation_config=config)
            outs.append(w.cut(y[0, len(ids) :].tolist()))
    return {"outputs": outs, "prefill": sum(map(len, w.ids))}


def padded(w: Work) -> dict:
    import torch

    order = sorted(range(len(w.ids)), key=lambda i: -len(w.ids[i]))  # lm-eval's Collator: longest first
    outs: list[Any] = [None] * len(w.ids)
    slots = prefill = 0
    config = w.config()
    with torch.inference_mode():
        for start in range(0, len(order), w.batch):
            part = order[start : start + w.batch]
            x, mask = left_pad([w.ids[i] for i in part], w.pad)
            y = w.model.generate(x, attention_mask=mask, generation_config=config)
            for row, i in enumerate(part):
                outs[i] = w.cut(y[row, x.shape[1] :].tolist())
            slots, prefill = slots + y.numel(), prefill + x.numel()
    useful = sum(len(p) + len(o) for p, o in zip(w.ids, outs))
    return {"outputs": outs, "prefill": prefill, "pad_slots": slots - useful, "slots": slots}


def continuous(w: Work) -> dict:
    import torch

    with torch.inference_mode():
        got = w.model.generate_batch([list(i) for i in w.ids], generation_config=w.config())
    outs = [w.cut(o.generated_tokens) for o in got.values()]  # in the inputs' order
    assert len(outs) == len(w.ids), f"generate_batch returned {len(outs)} of {len(w.ids)}"
    return {"outputs": outs, "prefill": None}  # its steps are its own: prefill not counted


def hflm(w: Work):
    """lm-eval's HFLM on the loaded model, its tokenizing replaced by Forge's ids."""
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=w.model, tokenizer=w.tokenizer, batch_size=w.batch, device="cpu")
    ids_of = dict(zip(w.contexts, w.ids))
    lm.tok_encode = lambda string, *args, **kwargs: ids_of[string]
    lm.tok_batch_encode = lambda strings, *args, **kwargs: left_pad([ids_of[s] for s in strings], w.pad)
    return lm


def lm_eval(w: Work, lm) -> dict:
    from lm_eval.api.instance import Instance

    got: dict[tuple, list[int]] = {}
    figures = {"slots": 0, "prefill": 0}
    generate = type(lm)._model_generate.__get__(lm)

    def record(context, max_length, stop, **kwargs):
        y = generate(context, max_length, stop, **kwargs)
        mask = kwargs["attention_mask"].bool()
        for row in range(y.shape[0]):
            got[tuple(context[row][mask[row]].tolist())] = w.cut(y[row, context.shape[1] :].tolist())
        figures["slots"] += y.numel()
        figures["prefill"] += context.numel()
        return y

    lm._model_generate = record
    kwargs = {"until": [], "max_gen_toks": w.max_new, "do_sample": False}
    requests = [Instance("generate_until", {}, (c, dict(kwargs)), k) for k, c in enumerate(w.contexts)]
    lm.generate_until(requests, disable_tqdm=True)
    outs = [got[tuple(ids)] for ids in w.ids]
    useful = sum(len(p) + len(o) for p, o in zip(w.ids, outs))
    return {"outputs": outs, "pad_slots": figures["slots"] - useful, **figures}


def forge(w: Work, overrides: list[str]) -> dict:
    from forge.io.results import load as load_results
    from forge.testing import run_function

    shutil.rmtree(w.run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    # the model every other way runs
    model = [] if w.model_name == DEFAULT_MODEL else ["model=hf", f"model.name={w.model_name}"]
    report = run_function("generate", w.rows_path, w.run_dir, [f"max_new_tokens={w.max_new}", *model, *overrides])
    wall = time.perf_counter() - t0
    rep = report.as_dict()
    assert rep["status"] == "finished" and rep["balanced"], (rep["status"], rep["imbalance"])
    res = load_results(w.run_dir)
    by_id = dict(zip(map(str, res.ids), res.columns["generated_ids"]))
    g = rep["outputs"]["generation"]
    return {
        "wall_s": wall,
        "outputs": [w.cut(by_id[i]) for i in w.row_ids],
        "prefill": g["prefill_tokens_computed"],
        "pad_slots": g["prefill_pad_slots"],  # of slots: prefill computed, its pads, decode tokens (all but the last)
        "slots": g["prefill_tokens_computed"] + g["prefill_pad_slots"] + g["generated_tokens"] - len(w.ids),
        **{"engine_tok_s": g["output_tokens_per_s"], "engine_ms": g["ms_per_output_token"], "steps": g["steps"]},
        **{"batches": rep["batches"], "cache_hit": rep["tokens"]["cache_hit"]},
    }


def warm_forge(w: Work) -> None:
    """One small Forge run before the rounds, outside every timing, as the peers' first calls are:
    what a process pays once (imports, Hydra's first compose), not what each run pays."""
    from forge.testing import run_function

    warm = w.rows_path.parent / "warm"
    warm.mkdir(parents=True, exist_ok=True)
    path = workloads.write_jsonl(warm / "rows.jsonl", [json.loads(x) for x in w.rows_path.read_text().splitlines()[:8]])
    model = [] if w.model_name == DEFAULT_MODEL else ["model=hf", f"model.name={w.model_name}"]
    run_function("generate", path, warm / "run", ["max_new_tokens=2", *model])
    shutil.rmtree(warm, ignore_errors=True)


def measured(w: Work, name: str, way) -> Any:
    """A harness variant: the way timed and sampled, its outputs compared with the reference's."""

    def run(r: int) -> dict:
        with PeakRss() as rss:
            t0 = time.perf_counter()
            sample = way()
            wall = time.perf_counter() - t0
        outs = sample.pop("outputs")
        if name == ONE:
            w.reference = outs
        sample.setdefault("wall_s", wall)
        generated = sum(map(len, outs))
        sample.update(generated=generated, tok_s=generated / sample["wall_s"])
        sample.update(peak_mib=rss.peak / 2**20, rise_mib=(rss.peak - rss.start) / 2**20)
        sample["equal"] = None if w.reference is None else sum(a == b for a, b in zip(outs, w.reference))
        return sample

    return run


def floor_of(w: Work, lengths: list[int], threads: int) -> dict:
    """The floor's seconds (benchmarks/floor.py) of the prompts and their generated tokens."""
    prefixes = {key: n for key, n in w.prefix if n > 0}
    segments = list(prefixes.values()) + [len(ids) - n for ids, (_, n) in zip(w.ids, w.prefix) if len(ids) > n]
    reads = [(n, len(ids) - n) for ids, (_, n) in zip(w.ids, w.prefix) if n > 0 and len(ids) > n]
    for ids, g in zip(w.ids, lengths):  # each generated token but the last is fed back, reading all before it
        segments += [1] * max(0, g - 1)
        reads += [(len(ids) + k, 1) for k in range(max(0, g - 1))]
    dense = floor.Dense(w.model_dir, "causal", threads)
    rates = floor.measure(dense, floor.shapes(segments))
    read_rates = floor.measure_reads(dense.config, floor.representatives(p for p, _ in reads))
    fl = floor.floors(segments, rates, reads, read_rates)
    fl.update(prefixes=len(prefixes), prefix_tokens=sum(prefixes.values()), decode=sum(max(0, g - 1) for g in lengths))
    return fl


HEADER = (
    "way|median wall s|output tok/s|ms / output token|x best peer (tok/s)|padding (pad slots / slots)|"
    "prefill computed / prompt tokens|peak RSS MiB (rise)|floor / wall|= one-at-a-time"
).split("|")


def rows(w: Work, trials: harness.Trials, fl: dict | None, best_peer: str | None) -> list[list[str]]:
    prompt = sum(map(len, w.ids))
    lines = []
    for name in trials.names:
        wall, tok_s, last = trials.median(name), trials.median(name, "tok_s"), trials.last(name)
        ratio = f"{tok_s / trials.median(best_peer, 'tok_s'):.2f}" if best_peer else "-"
        pad = f"{last['pad_slots'] / last['slots']:.1%}" if last.get("slots") else "0 (no padded batches)"
        peak, rise, equal = (trials.values(name, k) for k in ("peak_mib", "rise_mib", "equal"))
        lines.append(
            [name, f"{wall:.2f}", f"{tok_s:,.1f}", f"{1000 / tok_s:.2f}", ratio, pad]
            + [f"{last['prefill']:,} / {prompt:,}" if last.get("prefill") is not None else "-"]
            + [f"{max(peak):,.0f} (+{max(rise):,.0f})"]
            + [f"{fl['by_shape_s'] / wall:.3f}" if fl else "-", f"{min(equal)} of {len(w.ids)}" if equal else "-"]
        )
    return lines


def report(a, w: Work, trials: harness.Trials, fl: dict | None, forges: list[str]) -> None:
    import torch

    rep = harness.Report(a)
    peers = [n for n in trials.names if n not in forges]
    best_peer = max(peers, key=lambda n: trials.median(n, "tok_s")) if peers else None
    prompt = sum(map(len, w.ids))
    tools = ["torch", "transformers"] + (["lm_eval"] if LMEVAL in trials.names else [])
    versions = {t: importlib.metadata.version(t.replace("_", "-")) for t in tools}
    rep.text(
        f"{len(w.ids)} {a.shape} prompts ({prompt:,} prompt tokens), max_new_tokens {w.max_new}, greedy, "
        f"model {a.model}; "
        f"torch threads {torch.get_num_threads()}; {a.rounds} rounds; load average {os.getloadavg()[0]:.1f}; "
        f"versions {versions}"
    )
    if fl:
        rep.text(
            f"CPU floor (benchmarks/floor.py): {fl['tokens']:,} tokens ({fl['prefix_tokens']:,} of {fl['prefixes']} "
            f"distinct prefixes once, every suffix, {fl['decode']:,} decode tokens; no padding): "
            f"{fl['by_shape_s']:.2f} s by shape ({fl['no_reads_s']:.2f} s of forwards, {fl['reads_s']:.2f} s of "
            f"reads of the keys before each token), {fl['any_shape_s']:.2f} s at the best rate of any shape "
            f"({fl['best_rate']:,.0f} tok/s); the LM head not counted"
        )
    rep.text("")
    rep.table(HEADER, rows(w, trials, fl, best_peer))
    for name in forges:
        last = trials.last(name)
        rep.text(
            "",
            f"{name}: {last['batches']} batches, {last['steps']:,} engine steps, cache hits {last['cache_hit']:,} "
            f"tokens; the engine alone (report.json): {trials.median(name, 'engine_tok_s'):,.1f} output tok/s, "
            f"{trials.median(name, 'engine_ms'):.2f} ms per output token.",
        )
        if best_peer:
            ratio = trials.median(name, "tok_s") / trials.median(best_peer, "tok_s")
            engine = trials.median(name, "engine_tok_s") / trials.median(best_peer, "tok_s")
            rep.text(
                f"Forge / best peer ({best_peer}), output tokens/s: {ratio:.2f}x over the whole run, "
                f"{engine:.2f}x for the engine alone."
            )
    rep.data["floor"] = fl
    rep.trials(trials)
    rep.save()


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__, rounds=2, threads=2, only=None)
    ap.add_argument("--shape", choices=gen_shapes.SHAPES, default="short", help="prompt shape (default: short)")
    ap.add_argument("--limit", type=int, default=500, help="the first N prompts of the shape (default: all 500)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt (default: 64)")
    ap.add_argument("--batch-size", type=int, default=32, help="batch of the padded ways (default: 32)")
    ap.add_argument("--model", default=DEFAULT_MODEL, help=f"model.name (default: {DEFAULT_MODEL})")
    ap.add_argument("--forge", action="append", help="a Forge variant's overrides, space-separated (repeatable)")
    ap.add_argument("--no-floor", action="store_true", help="skip the floor's measurements")
    a = ap.parse_args(argv)
    import torch

    w = load(a)
    variants: dict[str, Any] = {ONE: lambda: one_at_a_time(w), PADDED: lambda: padded(w)}
    variants[CB] = lambda: continuous(w)
    try:
        lm = hflm(w)
        variants[LMEVAL] = lambda: lm_eval(w, lm)
    except ImportError as exc:  # not installed: the row is skipped, said so
        harness.note(f"lm-eval skipped: {exc} (pip install lm-eval)")
    forges = []
    for extra in a.forge or [""]:
        name = f"{FORGE} ({extra})" if extra else FORGE
        variants[name] = lambda extra=extra: forge(w, extra.split())
        forges.append(name)
    chosen = harness.pick(variants, a.only)
    w.model.generate(torch.tensor([w.ids[0]]), generation_config=w.config())  # first-call costs, before the rounds
    if any(n in chosen for n in forges):
        warm_forge(w)  # Forge's too: its modules imported, Hydra's first compose
    trials = harness.interleave({n: measured(w, n, v) for n, v in chosen.items()}, a.rounds)
    lengths = [len(o) for o in w.reference] if w.reference else [w.max_new] * len(w.ids)
    fl = None if a.no_floor else floor_of(w, lengths, a.threads)
    report(a, w, trials, fl, [n for n in forges if n in chosen])
    shutil.rmtree(w.rows_path.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
