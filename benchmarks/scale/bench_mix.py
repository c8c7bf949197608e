"""Mixed cards in virtual time: a 16 GB card and a 32 GB card twice as fast (`conf/devices/mix_16g_32g.yaml`).

    python -m benchmarks mix [--big 200000] [--tail 2000] [--run]

Every figure is a plan (`forge.driver.simulate.plan_geometry`: the scheduler, run loop, simulated
executor and ledger of `forge plan`) in virtual time, so it does not depend on this
machine's speed. The model is `examples/models/llama-2-7b` in bfloat16 (layers [1, 2, 4],
pooling last): its memory model is fitted from the config alone (`forge.runtime.cost.memory_fit`,
cached after the first use). Tables:

1. memory mode on the reference workload (`benchmarks/workloads.py`) and a large variant:
   busy share and finish time per device, finish skew, simulated out-of-memory errors;
2. item mode at the batch size that fits the large card, at the one that fits the small
   card, and memory mode, side by side: items/s, busy %, finish skew, out-of-memory errors;
3. heavy tails (`benchmarks.workloads.heavy_tail`: lengths from tens to thousands of tokens, a few over every device's
   max_seq_len) in rows and packed rows: every item placed or failed at admission with its
   reason, ledger balanced;
4. with `--run`: the same heavy tail, small, through `forge run` on two real CPU devices
   (`devices=sim_16g_32g`, the embedded model; wall time, this machine).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from benchmarks import harness
from benchmarks.workloads import heavy_tail, heavy_tail_rows, items as reference_items, write_jsonl
from forge.config.devices import resolve_devices
from forge.driver.simulate import plan_geometry
from forge.vocab.geometry import Item

ROOT = harness.ROOT
MODEL = ROOT / "examples" / "models" / "llama-2-7b"


def mix():
    return resolve_devices(OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "devices" / "mix_16g_32g.yaml")))


DEVICE_BYTES = {d.name: d.memory_bytes for d in mix()}


def cost_7b():
    from transformers import AutoConfig

    from forge.runtime.cost.memory_fit import Target, fitted_cost_model

    return fitted_cost_model(AutoConfig.from_pretrained(MODEL), Target(dtype="bfloat16", attn="sdpa", hidden_kept=3))


def summary(name: str, report: dict) -> dict:
    vt, dev = report["virtual_time"], {d["name"]: d for d in report["devices"]}
    items = report["items"]
    return {
        "case": name,
        "items": items["received"],
        "completed": items["completed"],
        "failed": items["failed"],
        "balanced": report["balanced"],
        "batches": report["batches"],
        "items_per_s": items["completed"] / vt["makespan"] if vt["makespan"] else 0.0,
        "busy16": dev["card16"]["busy_share"],
        "busy32": dev["card32"]["busy_share"],
        "finish16": dev["card16"]["virtual_finish"],
        "finish32": dev["card32"]["virtual_finish"],
        "skew": vt["finish_skew"],
        "oom": report["attempts"]["oom"],
        "mem16": dev["card16"].get("simulated_peak_bytes", 0) / DEVICE_BYTES["card16"],
        "mem32": dev["card32"].get("simulated_peak_bytes", 0) / DEVICE_BYTES["card32"],
        "skipped": items["skipped"],
        "skipped_reasons": "; ".join(report.get("skipped_reasons") or {}),
        "tokens16": dev["card16"]["tokens"],
        "tokens32": dev["card32"]["tokens"],
    }


def item_batch_size(cost, device, items: list[Item]) -> int:
    """The largest item-mode batch size whose batches of the longest items fit `device`'s memory
    (true peak: the measured model without its margin) and its token limit."""
    lim = device.limits
    longest = lim.pad(max(it.num_tokens for it in items))
    size = min(lim.max_rows, lim.max_batch_tokens // longest)
    while size > 1 and cost.true_bytes(size, longest) > device.memory_bytes:
        size -= 1
    return size


def table(rows: list[dict], cols: list[tuple[str, str]]) -> tuple[list[str], list[list[str]]]:
    """(header, cells) of `rows` under `cols`: (title, format of a row) each."""
    return [c for c, _ in cols], [[fmt.format(r) for _, fmt in cols] for r in rows]


BALANCE = [
    ("case", "{0[case]}"),
    ("items", "{0[items]:,}"),
    ("batches", "{0[batches]:,}"),
    ("items/s (virtual)", "{0[items_per_s]:,.1f}"),
    ("card16 busy", "{0[busy16]:.2%}"),
    ("card32 busy", "{0[busy32]:.2%}"),
    ("finish card16 / card32 (s)", "{0[finish16]:,.2f} / {0[finish32]:,.2f}"),
    ("finish skew", "{0[skew]:.2%}"),
    ("tokens card32 / card16", "{0[tokens32]:,} / {0[tokens16]:,}"),
    ("simulated OOM", "{0[oom]}"),
    ("balanced", "{0[balanced]}"),
]


ITEM_VS_MEMORY = [
    ("case", "{0[case]}"),
    ("items/s (virtual)", "{0[items_per_s]:,.1f}"),
    ("card16 busy", "{0[busy16]:.2%}"),
    ("card32 busy", "{0[busy32]:.2%}"),
    ("finish skew", "{0[skew]:.2%}"),
    ("simulated OOM", "{0[oom]}"),
    ("memory used card16 / card32", "{0[mem16]:.0%} / {0[mem32]:.0%}"),
    ("batches", "{0[batches]:,}"),
    ("completed", "{0[completed]:,}"),
    ("balanced", "{0[balanced]}"),
]
TAIL = [
    ("case", "{0[case]}"),
    ("completed", "{0[completed]:,}"),
    ("skipped at admission", "{0[skipped]:,}"),
    ("reason", "{0[skipped_reasons]}"),
    ("failed", "{0[failed]:,}"),
    ("card16 busy", "{0[busy16]:.2%}"),
    ("card32 busy", "{0[busy32]:.2%}"),
    ("finish skew", "{0[skew]:.2%}"),
    ("simulated OOM", "{0[oom]}"),
    ("balanced", "{0[balanced]}"),
]


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--big", type=int, default=200_000, help="items of the large reference variant")
    ap.add_argument("--tail", type=int, default=2000, help="items of the heavy-tailed input")
    ap.add_argument("--run", action="store_true", help="also run a small heavy tail with forge run (CPU)")
    args = ap.parse_args(argv)
    rep = harness.Report(args)
    devices, t0 = mix(), time.perf_counter()
    cost = cost_7b()
    rep.text(
        f"memory model of {MODEL.name} (bfloat16) ready in {time.perf_counter() - t0:.1f} s (imports included; "
        "fitted once, then cached)"
    )
    rows = []
    for n in (3000, args.big):
        t0 = time.perf_counter()
        rows.append(
            summary(f"reference, {n:,} items, memory", plan_geometry(reference_items(n), devices, "memory", cost=cost))
        )
        rows[-1]["case"] += f" (planned in {time.perf_counter() - t0:.1f} s)"
    rep.table(*table(rows, BALANCE), title="### 1:2 mix, memory mode")

    work = reference_items(3000)
    large, small = (item_batch_size(cost, d, work) for d in sorted(devices, key=lambda d: -d.memory_bytes))
    cases = [
        (f"item, batch_size={large} (fits card32)", "item", {"batch_size": large}),
        (f"item, batch_size={small} (fits card16)", "item", {"batch_size": small}),
        ("memory", "memory", {}),
    ]
    rows = [summary(name, plan_geometry(work, devices, mode, cost=cost, options=o)) for name, mode, o in cases]
    rep.table(*table(rows, ITEM_VS_MEMORY), title="### Item mode against memory mode, reference workload (3,000 items)")

    tail = heavy_tail(args.tail)
    options = {"packed_row_tokens": 1024}
    rows = [
        summary(
            f"heavy tail, {packing}",
            plan_geometry(tail, devices, "memory", cost=cost, options={**options, "packing": packing}),
        )
        for packing in ("rows", "packed")
    ]
    lengths = np.array([it.num_tokens for it in tail])
    title = (
        f"### Heavy tail ({len(tail):,} items, {lengths.min()}-{lengths.max()} tokens, median "
        f"{int(np.median(lengths))}; max_seq_len 4,096), memory mode"
    )
    rep.table(*table(rows, TAIL), title=title)
    if args.run:
        run_tail(rep)
    rep.save()


def run_tail(rep: harness.Report, n: int = 120) -> None:
    """The heavy tail through `forge run` on two CPU devices (the embedded model), small."""
    import tempfile

    from forge.cli.build import build_spec
    from forge.cli.compose import compose
    from forge.driver.engine import execute
    from forge.pluginmanager import make_plugin_manager

    with tempfile.TemporaryDirectory() as tmp:
        data = write_jsonl(Path(tmp) / "tail.jsonl", heavy_tail_rows(n))
        lines = []
        for packing in ("rows", "packed"):
            overrides = [
                "devices=sim_16g_32g",
                "batching=memory",
                f"batching.packing={packing}",
                f"input.path={data}",
                "layers=[1]",
                "batching.packed_row_tokens=256",
                "runtime.executor=inprocess",
            ]
            r = execute(build_spec(compose(overrides), Path(tmp) / packing), make_plugin_manager())
            lines.append(
                [
                    packing,
                    r["items"]["completed"],
                    r["items"]["failed"],
                    r["balanced"],
                    r["status"],
                    f"{r['wall_s']:.1f}",
                ]
            )
        title = f"### Heavy tail through forge run ({n} rows, devices=sim_16g_32g, embedded model, CPU)"
        header = ["packing", "completed", "failed at admission", "balanced", "status", "wall s"]
        rep.table(header, lines, title=title)


if __name__ == "__main__":
    main()
