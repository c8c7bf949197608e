"""Mixed cards in virtual time: a 16 GB card and a 32 GB card twice as fast (`conf/devices/mix_16g_32g.yaml`).

    python -m benchmarks.bench_mix [--big 200000] [--run]

Every figure is a plan (`forge.core.simulate.plan_geometry`: the scheduler, run loop, simulated
executor and ledger of `forge plan`) in virtual time, so it does not depend on this
machine's speed. The model is `examples/models/llama-2-7b` in bfloat16 (layers [1, 2, 4],
pooling last): its memory model is fitted from the config alone (`forge.runtime.memory_fit`,
cached after the first use). Tables:

1. memory mode on the reference workload (`benchmarks/workloads.py`) and a large variant:
   busy share and finish time per device, finish skew, simulated out-of-memory errors;
2. item mode at the batch size that fits the large card, at the one that fits the small
   card, and memory mode, side by side: items/s, busy %, finish skew, out-of-memory errors;
3. heavy tails (lengths from tens to thousands of tokens, a few over every device's
   max_seq_len) in rows and packed rows: every item placed or failed at admission with its
   reason, ledger balanced;
4. with `--run`: the same heavy tail, small, through `forge run` on two real CPU devices
   (`devices=sim_16g_32g`, the embedded model; wall time, this machine).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from benchmarks.workloads import items as reference_items
from forge.config.devices import resolve_devices
from forge.core.geometry import Item
from forge.core.simulate import plan_geometry

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "examples" / "models" / "llama-2-7b"


def mix():
    return resolve_devices(OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "devices" / "mix_16g_32g.yaml")))


DEVICE_BYTES = {d.name: d.memory_bytes for d in mix()}


def cost_7b():
    from transformers import AutoConfig

    from forge.runtime.memory_fit import Target, fitted_cost_model

    return fitted_cost_model(AutoConfig.from_pretrained(MODEL), Target(dtype="bfloat16", attn="sdpa", hidden_kept=3))


def heavy_tail(n: int, seed: int = 5) -> list[Item]:
    """Suffix lengths Pareto-distributed from ~10 to over 5,000 tokens behind 5 prefixes of 23-353 tokens."""
    rng = np.random.default_rng(seed)
    prefix_lens = np.array([23, 80, 150, 240, 353])
    which = rng.integers(0, len(prefix_lens), n)
    suffix = np.minimum((rng.pareto(0.9, n) + 1) * 12, 6000).astype(int)
    return [
        Item(f"t{i}", int(prefix_lens[k] + s), f"p{k}", int(prefix_lens[k]))
        for i, (k, s) in enumerate(zip(which.tolist(), suffix.tolist()))
    ]


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


def table(rows: list[dict], cols: list[tuple[str, str]]) -> str:
    head = "| " + " | ".join(c for c, _ in cols) + " |\n| " + " | ".join("---" for _ in cols) + " |\n"
    return head + "".join("| " + " | ".join(fmt.format(r) for _, fmt in cols) + " |\n" for r in rows)


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--big", type=int, default=200_000, help="items of the large reference variant")
    parser.add_argument("--tail", type=int, default=2000, help="items of the heavy-tailed input")
    parser.add_argument("--run", action="store_true", help="also run a small heavy tail with forge run (CPU)")
    args = parser.parse_args()
    devices, t0 = mix(), time.perf_counter()
    cost = cost_7b()
    print(
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
    print("\n### 1:2 mix, memory mode\n")
    print(table(rows, BALANCE))

    work = reference_items(3000)
    large, small = (item_batch_size(cost, d, work) for d in sorted(devices, key=lambda d: -d.memory_bytes))
    cases = [
        (f"item, batch_size={large} (fits card32)", "item", {"batch_size": large}),
        (f"item, batch_size={small} (fits card16)", "item", {"batch_size": small}),
        ("memory", "memory", {}),
    ]
    rows = []
    for name, mode, options in cases:
        rows.append(summary(name, plan_geometry(work, devices, mode, cost=cost, options=options)))
    print("\n### Item mode against memory mode, reference workload (3,000 items)\n")
    print(
        table(
            rows,
            [
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
            ],
        )
    )

    rows = []
    tail = heavy_tail(args.tail)
    for packing in ("rows", "packed"):
        r = summary(
            f"heavy tail, {packing}",
            plan_geometry(tail, devices, "memory", cost=cost, options={"packing": packing, "packed_row_tokens": 1024}),
        )
        rows.append(r)
    lengths = np.array([it.num_tokens for it in tail])
    print(
        f"\n### Heavy tail ({len(tail):,} items, {lengths.min()}-{lengths.max()} tokens, median "
        f"{int(np.median(lengths))}; max_seq_len 4,096), memory mode\n"
    )
    print(
        table(
            rows,
            [
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
            ],
        )
    )
    if args.run:
        run_tail()


def run_tail(n: int = 120) -> None:
    """The heavy tail through `forge run` on two CPU devices (the embedded model), small."""
    import json
    import random
    import tempfile

    from forge.cli.compose import compose
    from forge.config.build import build_spec
    from forge.core.engine import execute
    from forge.pluginmanager import make_plugin_manager

    rng = random.Random(5)
    words = "the of and a to in is was he for it with as his on be at by".split()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "tail.jsonl"
        data.write_text(
            "".join(
                json.dumps(
                    {
                        "id": f"r{i}",
                        "text": " ".join(
                            rng.choice(words) for _ in range(int(rng.paretovariate(0.9) * 12) % 1900 + 10)
                        ),
                    }
                )
                + "\n"
                for i in range(n)
            )
        )
        print(f"\n### Heavy tail through forge run ({n} rows, devices=sim_16g_32g, embedded model, CPU)\n")
        print(
            "| packing | completed | failed at admission | balanced | status | wall s |\n"
            "| --- | --- | --- | --- | --- | --- |"
        )
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
            print(
                f"| {packing} | {r['items']['completed']} | {r['items']['failed']} | {r['balanced']} | {r['status']} "
                f"| {r['wall_s']:.1f} |"
            )


if __name__ == "__main__":
    main()
