"""`bench_peers`'s floor, measured around the rounds, and its result: the table and what this machine allows."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks import floor, harness
from benchmarks.peers import cold_start, outputs, realistic


class Floor:
    """The workload's cache-aware floor on this machine (`benchmarks/floor.py`), measured before the
    first round and after the last, the better kept per shape (the machine's speed drifts)."""

    def __init__(self, w: dict, model_dir: str, loader: str, threads: int):
        self.w, self.loader = w, loader
        self.todo = floor.shapes(w["segments"]) | {floor.PROBE}
        self.suffixes = [(s, e - s) for s, e in w["spans"] if s > 0]  # (prefix length, tokens)
        self.pasts = floor.representatives(p for p, _ in self.suffixes)
        self.dense = floor.Dense(model_dir, loader, threads)
        self.rates = floor.measure(self.dense, self.todo)
        self.reads = floor.measure_reads(self.dense.config, self.pasts) if self.pasts else {}

    def measure_again(self) -> None:
        self.rates = floor.best(self.rates, floor.measure(self.dense, self.todo))
        if self.pasts:
            self.reads = floor.best(self.reads, floor.measure_reads(self.dense.config, self.pasts))

    def floors(self) -> dict:
        fl = floor.floors(self.w["segments"], self.rates, self.suffixes, self.reads)
        assert fl["tokens"] == self.w["floor_tokens"], (fl["tokens"], self.w["floor_tokens"])
        return fl

    @property
    def probe_then(self) -> float:
        """The probe's rate when the floor was measured (the better pass)."""
        return self.rates[floor.PROBE]


def attention_share(model_dir: str, w: dict) -> str:
    """Attention's share of the FLOPs on the workload, for a Llama-style model ("" otherwise)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    if not w["spans"] or cfg.get("model_type") != "llama":
        return ""
    c = {k: cfg[k] for k in realistic.CONFIG if k in cfg}
    c.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    share, big = realistic.attention_share, realistic.LLAMA2_7B
    return (
        f"attention's share of FLOPs: {share(c, w['spans']):.1%} of what the floor computes, "
        f"{share(c, w['full_spans']):.1%} of every full sequence "
        f"(Llama-2-7B at the same lengths: {share(big, w['spans']):.1%} / {share(big, w['full_spans']):.1%})"
    )


HEADER = [
    "variant",
    "median wall s",
    "rounds s",
    "useful tok/s",
    "x best peer",
    "floor / wall",
    "largest output difference",
    "Forge: first batch at s",
    "Forge: device busy s, rounds",
    "Forge: machine speed, rounds",
    "Forge: floor / device busy, at each round's speed",
    "Forge: floor / device busy (best round)",
    "Forge: any-shape floor / device busy (best round)",
]


def _forge_cells(samples: list[dict], fl: dict, probe_then: float) -> list[str]:
    """A Forge variant's first batch, busy time, machine speed and floor ratios (see the module)."""
    by_shape, any_shape = fl["by_shape_s"], fl["any_shape_s"]
    # the floor at the speed the machine ran each round (PROBE timed before and after it)
    scaled = statistics.median(floor.at_speed(by_shape, probe_then, s["speed"]) / s["busy_s"] for s in samples)
    best_busy = min(s["busy_s"] for s in samples)  # the floor is the best of its measurements
    return [
        f"{statistics.median(s['first_batch_s'] for s in samples):.2f}",
        ", ".join(f"{s['busy_s']:.1f}" for s in samples),
        ", ".join(f"{s['speed'] / probe_then:.2f}" for s in samples),
        f"{scaled:.2f}",
        f"{by_shape / best_busy:.2f}",
        f"{any_shape / best_busy:.2f}",
    ]


def rows(a, w, fl, probe_then, trials: harness.Trials, kinds, outs, versions) -> list[list[str]]:
    best_peer = trials.fastest(n for n, kind in kinds.items() if kind == "peer")
    ref = outs[best_peer or trials.names[0]]
    lines = []
    for n in trials.names:
        med = trials.median(n)
        extra = "reference" if n == best_peer else outputs.difference(a.function, outs[n], ref, w)
        label = n + (f" ({versions[n].split(' ')[0]})" if n in versions else "")
        ratio = f"{trials.ratio(n, best_peer):.2f}" if best_peer else "-"
        forge = _forge_cells(trials.samples[n], fl, probe_then) if kinds[n] == "forge" else ["-"] * 6
        rounds = ", ".join(f"{t:.1f}" for t in trials.values(n))
        lines.append([label, f"{med:.2f}", rounds, f"{w['useful'] / med:,.0f}", ratio, f"{fl['by_shape_s'] / med:.2f}"])
        lines[-1] += [extra, *forge]
    return lines


def report(a, model, mp, w, floor_: Floor, trials: harness.Trials, kinds, outs, versions, starts) -> None:
    import torch

    fl = floor_.floors()
    rep = harness.Report(a)
    rep.text(
        "",
        f"{a.function}, model {model} ({mp}), {w['rows']:,} rows, {w['useful']:,} useful tokens, "
        f"floor {w['floor_tokens']:,} tokens: {fl['by_shape_s']:.2f} s by shape ({fl['no_reads_s']:.2f} s of "
        f"forwards, {fl['reads_s']:.2f} s of suffixes reading their prefixes at {len(floor_.reads)} prefix lengths), "
        f"{fl['any_shape_s']:.2f} s at the best rate of any shape ({fl['best_rate']:,.0f} tok/s; "
        f"{len(floor_.todo)} shapes, best of 2 measurements each, before the rounds and after); "
        f"{a.rounds} rounds; versions {dict(torch=torch.__version__, **versions)}",
    )
    share = attention_share(mp, w)
    if share:
        rep.text(share)
    rep.text("")
    rep.table(HEADER, rows(a, w, fl, floor_.probe_then, trials, kinds, outs, versions))
    best_peer = trials.fastest(n for n, kind in kinds.items() if kind == "peer")
    target = cold_start.Target(a.target or cold_start.issue_target(a.function, w["rows"]))  # score: rows are questions
    forge = [n for n, kind in kinds.items() if kind == "forge"]
    rep.text("", *targets(target, starts, fl["by_shape_s"], trials, best_peer, forge))
    rep.data["floor"] = fl
    rep.trials(trials)
    rep.save()


def targets(target, starts, floor_s, trials: harness.Trials, best_peer, forge) -> list[str]:
    """What this machine allows: the cold start any exact tool pays, the target's time against the
    least time any exact tool needs (that cold start + the floor), and the first-batch target."""
    best = cold_start.fastest(starts)
    lines = [
        f"Cold start here (a fresh interpreter: torch and the family's modeling code imported, the model loaded, "
        f"benchmarks/peers/cold_start.py; best of {len(starts)}, one before each round and one after): imports "
        f"{best.imports_s:.2f} s, load {best.load_s:.2f} s (ready at {best.ready_s:.2f} s), then one 8-token forward "
        f"{best.forward_s:.3f} s."
    ]
    if best_peer is not None:
        peer_s = trials.median(best_peer)
        allowed, least, ok = target.judge(peer_s, best, floor_s)
        fastest = trials.fastest(forge)
        lines.append(
            f"Target {target.ratio:g}x the best peer ({peer_s:.2f} s): it allows {allowed:.2f} s; any exact tool needs "
            f"at least {best.ready_s:.2f} + {floor_s:.2f} (the floor) = {least:.2f} s here: "
            + (
                f"reachable, {allowed - least:.2f} s to spare"
                if ok
                else f"NOT reachable, {least - allowed:.2f} s short"
            )
            + (f"; Forge's best median {trials.median(fastest):.2f} s ({fastest})." if fastest else ".")
        )
    verdict = (
        "reachable."
        if cold_start.first_batch_reachable(best)
        else "NOT reachable cold (`forge server` pays them once)."
    )
    lines.append(
        f"First batch within {cold_start.FIRST_BATCH_AFTER_LOAD_S:g} s of the model's load, cold: the imports before "
        f"the load take {best.imports_s:.2f} s: {verdict}"
    )
    return lines
