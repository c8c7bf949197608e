"""`forge plan --plot`: the batch geometry of two plans side by side, as a PNG.

Each row of each batch is a bar: prefix tokens dark, the items' own tokens blue (packed
rows alternate two blues), padding light grey. A split prefix is drawn once per batch, as a
dark bar above its rows, when the device had to compute it; a cache hit draws nothing.
Batches are separated by a white line. Both panels share one scale, so ink is compute.

Below them, the chosen plan's timeline in virtual time: one lane per device, each batch a
bar from its start to its end (pale: busy; white: idle) with an inner bar whose height is
its rows (out of the most rows any batch had), blue when it completed, red when it ran out
of memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from forge.driver.report import Report

WHITE, PREFIX, TOKEN, TOKEN2, PAD = (
    (1.0, 1.0, 1.0),
    (0.15, 0.15, 0.3),
    (0.25, 0.5, 0.85),
    (0.45, 0.7, 0.95),
    (0.85, 0.85, 0.85),
)


def _rows(batches) -> list[list[tuple[int, tuple]]]:
    """Each drawn row as (length, colour) segments."""
    out: list[list[tuple[int, tuple]]] = []
    for b in batches:
        if b.split_prefix and b.prefix_len and not b.cache_hit:
            out.append([(b.prefix_len, PREFIX)])
        off = b.prefix_len if b.split_prefix else 0
        for row in b.rows:
            segs, used = [], 0
            for j, it in enumerate(row):
                if b.tree:  # a tree row: each run of a prefix key draws its prefix once
                    if it.prefix_len and (j == 0 or row[j - 1].prefix_key != it.prefix_key):
                        segs.append((it.prefix_len, PREFIX))
                        used += it.prefix_len
                    segs.append((it.num_tokens - it.prefix_len, TOKEN if j % 2 == 0 else TOKEN2))
                    used += it.num_tokens - it.prefix_len
                    continue
                if not b.split_prefix and it.prefix_len:
                    segs.append((it.prefix_len, PREFIX))
                    segs.append((it.num_tokens - it.prefix_len, TOKEN))
                else:
                    segs.append((it.num_tokens - off, TOKEN if j % 2 == 0 else TOKEN2))
                used += it.num_tokens - off
            segs.append((b.padded_len - used, PAD))
            out.append(segs)
        out.append([])  # gap between batches
    return out


def _image(rows, width: int) -> np.ndarray:
    img = np.ones((max(1, len(rows)), width, 3))
    for y, segs in enumerate(rows):
        x = 0
        for n, colour in segs:
            img[y, x : x + n] = colour
            x += n
    return img


OOM, BUSY = (0.85, 0.2, 0.2), (0.8, 0.88, 0.97)


def plot_timeline(ax, report: Report) -> None:
    """Each device's lane: batches as bars over virtual time, height by rows; gaps are idle."""
    spans = report.plan.timeline
    names = [d["name"] for d in report["devices"]]
    most = max((s.rows for s in spans), default=1)
    for lane, name in enumerate(names):
        mine = [s for s in spans if s.device == name]
        if not mine:
            continue
        starts, widths = [s.start for s in mine], [s.end - s.start for s in mine]
        ax.bar(
            starts,
            [0.85] * len(mine),
            width=widths,
            bottom=lane - 0.425,
            align="edge",
            color=BUSY,
            edgecolor="white",
            linewidth=0.3,
        )  # busy: the whole lane
        ax.bar(
            starts,
            [-0.85 * s.rows / most for s in mine],
            width=widths,
            bottom=lane + 0.425,
            align="edge",
            color=[OOM if s.status == "oom" else TOKEN for s in mine],
            edgecolor="white",
            linewidth=0.3,
        )
    vt = report.get("virtual_time") or {}
    unit = "s" if vt.get("unit") == "s" else "token-equivalents"
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels([f"{d['name']}\n{100 * d.get('busy_share', 0):.1f}% busy" for d in report["devices"]])
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set_xlim(0, vt.get("makespan") or max((s.end for s in spans), default=1))
    ax.set_xlabel(f"virtual time ({unit})")
    ax.set_title(
        f"batching={report['batching']}: device timelines (bar height: rows of the batch, most {most}); "
        f"finish skew {100 * vt.get('finish_skew', 0):.1f}%",
        fontsize=11,
    )


def plot_plans(reports: Sequence[Report], path: Path, timeline: Report | None = None) -> Path:
    """The packing of each report side by side; below, `timeline`'s device timelines (a plan
    kept with its batches)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    drawn = [(_rows(r.plan.kept_batches), r) for r in reports]
    width = max(sum(n for n, _ in segs) for rows, _ in drawn for segs in rows if segs)
    height = max(len(rows) for rows, _ in drawn)
    if timeline is not None and timeline.plan.timeline:
        lanes = len(timeline["devices"])
        members = sum(len(p["stages"]) + 1 for p in (timeline.plan.placements or {}).values())
        ratios = (9, 0.6 * lanes + 1.2) + ((0.6 * members + 1.2,) if members else ())
        fig = plt.figure(figsize=(7 * len(drawn), sum(ratios)))
        grid = fig.add_gridspec(len(ratios), len(drawn), height_ratios=ratios)
        axes = [[fig.add_subplot(grid[0, i]) for i in range(len(drawn))]]
        plot_timeline(fig.add_subplot(grid[1, :]), timeline)
        if members:  # device groups: their placement beside accelerate's (forge.cli.placement_view)
            from forge.cli.placement_view import plot_placements

            plot_placements(fig.add_subplot(grid[2, :]), timeline)
    else:
        fig, axes = plt.subplots(1, len(drawn), figsize=(7 * len(drawn), 9), squeeze=False)
    for ax, (rows, r) in zip(axes[0], drawn):
        img = _image(rows, width)
        ax.imshow(img, aspect="auto", interpolation="nearest", extent=(0, width, len(rows), 0))
        ax.set_xlim(0, width)
        ax.set_ylim(height, 0)
        hit = r.get("cache_hit_rate")
        t = r["tokens"]
        ax.set_title(
            f"batching={r['batching']}: {r['batches']:,} batches, {t['padded_slots']:,} slots\n"
            f"padding {100 * r['padding_waste']:.2f}%, prefix cache hits "
            f"{'-' if hit is None else f'{100 * hit:.1f}%'}",
            fontsize=11,
        )
        ax.set_xlabel("token slots per row")
        ax.set_ylabel("rows (batches separated by white)")
    handles = [
        Patch(color=PREFIX, label="prefix (computed)"),
        Patch(color=TOKEN, label="item tokens / batch run"),
        Patch(color=PAD, label="padding"),
    ]
    if timeline is not None:
        handles += [Patch(color=BUSY, label="device busy"), Patch(color=OOM, label="simulated out of memory")]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles))
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    path = Path(path)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
