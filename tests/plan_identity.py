"""The batch sequences of `forge plan`, as one canonical text and its SHA-256 (the plan-identity guard).

    python -m tests.plan_identity            # print each case's digest
    python -m tests.plan_identity --write    # record them in tests/plan_identity.json

Each case plans a workload (the embedded default input through the config, as `forge plan`
composes it, or a heavy-tailed input over the 1:2 mix of simulated cards) and records every
batch the simulated executor is handed, in submission order: device, prefix key and length,
split prefix, packed, retry, seq, item ids per row, padded length and predicted cache hit;
then the virtual-time figures. Nothing depends on wall-clock time.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

DIGESTS = Path(__file__).resolve().parent / "plan_identity.json"
# the reference workload: the embedded default input, 600 rows, on two plain devices sized for
# the embedded model (conf/devices/sim_16g_32g.yaml: batching=memory binds on their budgets)
# The cases recorded before small prefix groups could merge (issue 20) keep prefix groups apart
# (`batching.merge_groups=false`), so their plans stay byte-identical; the `-merged` cases record
# the default, which merges them.
APART = "batching.merge_groups=false"
REFERENCE = {
    "ref-item": ["batching=item"],
    "ref-token": ["batching=token", APART],
    "ref-packed": ["batching=token", "batching.packing=packed", APART],
    "ref-memory": ["batching=memory", APART],
    "ref-nocache": ["batching=token", "batching.prefix_cache=false", APART],
    "ref-token-merged": ["batching=token"],
    "ref-packed-merged": ["batching=token", "batching.packing=packed"],
    "ref-memory-merged": ["batching=memory"],
}
# a heavy tail over the 1:2 mix (conf/devices/mix_16g_32g.yaml): (mode, options)
HEAVY = {
    "heavy-item": ("item", {"batch_size": 64}),
    "heavy-token": ("token", {"merge_groups": False}),
    "heavy-packed": ("token", {"packing": "packed", "merge_groups": False}),
    "heavy-memory": ("memory", {"merge_groups": False}),
    "heavy-nocache": ("token", {"prefix_cache": False, "merge_groups": False}),
    "heavy-memory-nocache": ("memory", {"prefix_cache": False, "merge_groups": False}),
    "heavy-memory-merged": ("memory", {}),
}
HEAVY_ITEMS = 2500


@contextmanager
def recording():
    """Every (device, batch) the simulated executor is handed, in order."""
    from forge.executors.sim import SimExecutor

    seen: list[tuple[str, Any]] = []
    submit = SimExecutor.submit

    def recorded(self, ticket, device, batch, timeout_s):
        seen.append((device.name, batch))
        return submit(self, ticket, device, batch, timeout_s)

    SimExecutor.submit = recorded
    try:
        yield seen
    finally:
        SimExecutor.submit = submit


def canonical(seen: list[tuple[str, Any]], report: dict[str, Any]) -> str:
    """One line per batch, then the plan's virtual-time figures."""
    lines = []
    for device, b in seen:
        rows = ";".join(",".join(it.id for it in row) for row in b.rows)
        lines.append(
            json.dumps(
                [
                    device,
                    b.prefix_key,
                    b.prefix_len,
                    b.split_prefix,
                    b.packed,
                    b.retry,
                    b.seq,
                    b.padded_len,
                    b.cache_hit,
                    rows,
                ]
            )
        )
    figures = {
        k: report[k]
        for k in ("batches", "tokens", "status", "end_splits", "attempts", "effective_limits")
        if k in report
    }
    # a ledger count added after a case was recorded appears only where it is not zero
    figures["tokens"] = {k: v for k, v in figures.get("tokens", {}).items() if k != "prefix_shared" or v}
    figures["virtual_time"] = report.get("virtual_time")
    figures["devices"] = [
        {k: d.get(k) for k in ("name", "batches", "tokens", "cache_misses", "virtual_busy", "virtual_finish", "oom")}
        for d in report["devices"]
    ]
    lines.append(json.dumps(figures, sort_keys=True, default=str))
    return "\n".join(lines) + "\n"


def _reference(overrides: list[str]) -> Callable[[], dict]:
    def run() -> dict:
        from forge.cli.build import build_spec
        from forge.cli.compose import compose
        from forge.driver.plan import plan
        from forge.pluginmanager import make_plugin_manager

        cfg = compose(["devices=sim_16g_32g", "input.limit=600", *overrides])
        return plan(build_spec(cfg, None), make_plugin_manager())

    return run


def _heavy(mode: str, options: dict) -> Callable[[], dict]:
    def run() -> dict:
        from benchmarks.scale.bench_mix import mix
        from benchmarks.workloads import heavy_tail
        from forge.driver.simulate import plan_geometry
        from tests.test_sim import COST_7B

        return plan_geometry(heavy_tail(HEAVY_ITEMS), mix(), mode, cost=COST_7B, options=options)

    return run


def cases() -> dict[str, Callable[[], dict]]:
    out = {name: _reference(o) for name, o in REFERENCE.items()}
    out.update({name: _heavy(mode, opts) for name, (mode, opts) in HEAVY.items()})
    return out


def digest(name: str) -> tuple[str, int]:
    """(SHA-256 of the case's canonical text, batches submitted)."""
    with recording() as seen:
        report = cases()[name]()
    text = canonical(seen, report)
    return hashlib.sha256(text.encode()).hexdigest(), len(seen)


def main(argv: list[str]) -> None:
    os.environ.setdefault("FORGE_CACHE", "/tmp/forge_cache")
    found = {}
    for name in cases():
        sha, n = digest(name)
        found[name] = {"sha256": sha, "batches": n}
        print(f"{name:22s} {n:6d} {sha}")
    if "--write" in argv:
        DIGESTS.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
