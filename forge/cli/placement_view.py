"""A device group's placement in `forge plan`: a table per group, and its panel in `--plot`.

Per member: the decoder layers it holds, its weights, the room kept for a batch's activations
(the measured memory model's, `forge.runtime.placement.device_map`), and its budget; then what
`accelerate.infer_auto_device_map` would put on each device for the full model with the same
budgets, and what either offloads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.table import Table

GIB = 1 << 30
TOKEN, PAD = (0.25, 0.5, 0.85), (0.85, 0.85, 0.85)  # forge.cli.plot's blue and grey


def _gib(n: float) -> str:
    """Bytes in GiB (MiB below one GiB: a small model's blocks)."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / (1 << 20):.1f} MiB"


def placement_tables(report: Mapping[str, Any]) -> list[Table]:
    """One table per device group of the plan (none without a group)."""
    tables = []
    for name, p in (report.get("placements") or {}).items():
        title = f"device group {name}: {p['layers_run']} of {p['layers_total']} layers run"
        table = Table(title=title)
        for col in ("member", "layers", "weights", "room for batches", "budget", "accelerate (full model)"):
            table.add_column(col)
        theirs = p["accelerate"]
        for s in p["stages"]:
            span = "-" if s["layers"] is None else f"{s['layers'][0]}-{s['layers'][1]}"
            mine = theirs["bytes_per_device"].get(s["device"], 0)
            layers = theirs["layers_per_device"].get(s["device"], 0)
            left = s["budget_bytes"] - mine  # negative on a cpu member: accelerate's own CPU offload lands there
            room = f"{_gib(left)} left" if left >= 0 else f"{_gib(-left)} over (its CPU offload)"
            table.add_row(
                s["device"],
                span,
                _gib(s["weights_bytes"]),
                _gib(s["activation_bytes"]),
                _gib(s["budget_bytes"]),
                f"{layers} layers, {_gib(mine)}, {room}",
            )
        ours = f"{_gib(p['offloaded_bytes'])} to {p['offload']}" if p["offload"] else "nothing"
        off = {d: b for d, b in theirs["bytes_per_device"].items() if d in ("cpu", "disk")}
        accel = ", ".join(f"{_gib(b)} to {d}" for d, b in off.items()) or "nothing"
        table.caption = f"offloaded: {ours} (accelerate: {accel})"
        tables.append(table)
    return tables


def plot_placements(ax, report: Mapping[str, Any]) -> None:
    """Per member of each group, two bars (this plan, accelerate's): weights, room, the rest free."""
    room_colour, accel_colour = (0.55, 0.8, 0.55), (0.6, 0.6, 0.6)
    labels, y = [], 0
    for name, p in (report.get("placements") or {}).items():
        theirs = p["accelerate"]["bytes_per_device"]
        for s in p["stages"]:
            budget = s["budget_bytes"] / GIB
            w, r = s["weights_bytes"] / GIB, max(0, s["activation_bytes"]) / GIB
            ax.barh(y, w, color=TOKEN, height=0.35)
            ax.barh(y, r, left=w, color=room_colour, height=0.35)
            ax.barh(y, max(0.0, budget - w - r), left=w + r, color=PAD, height=0.35)
            a = theirs.get(s["device"], 0) / GIB
            ax.barh(y + 0.4, a, color=accel_colour, height=0.35)
            ax.barh(y + 0.4, max(0.0, budget - a), left=a, color=PAD, height=0.35)
            span = "no layers" if s["layers"] is None else f"layers {s['layers'][0]}-{s['layers'][1]}"
            labels.append((y + 0.2, f"{name} {s['device']}\n{span}"))
            y += 1
        off = {d: b / GIB for d, b in theirs.items() if d in ("cpu", "disk")}
        if off or p["offload"]:
            ax.barh(y, p["offloaded_bytes"] / GIB, color=TOKEN, height=0.35)
            ax.barh(y + 0.4, sum(off.values()), color=accel_colour, height=0.35)
            labels.append((y + 0.2, f"{name} offloaded"))
            y += 1
    ax.set_yticks([t for t, _ in labels])
    ax.set_yticklabels([s for _, s in labels], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("GiB (upper bar: this plan, weights blue, room for batches green; lower: accelerate's weights)")
    ax.set_title("device groups: placement by Forge's memory model vs accelerate.infer_auto_device_map", fontsize=11)
