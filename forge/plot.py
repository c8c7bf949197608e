"""`forge plan --plot`: the batch geometry of two plans side by side, as a PNG.

Each row of each batch is a bar: prefix tokens dark, the items' own tokens blue (packed
rows alternate two blues), padding light grey. A split prefix is drawn once per batch, as a
dark bar above its rows, when the device had to compute it; a cache hit draws nothing.
Batches are separated by a white line. Both panels share one scale, so ink is compute.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

WHITE, PREFIX, TOKEN, TOKEN2, PAD = (1.0, 1.0, 1.0), (0.15, 0.15, 0.3), (0.25, 0.5, 0.85), (0.45, 0.7, 0.95), (0.85, 0.85, 0.85)


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
            img[y, x:x + n] = colour
            x += n
    return img


def plot_plans(reports, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    drawn = [(_rows(r["_batches"]), r) for r in reports]
    width = max(sum(n for n, _ in segs) for rows, _ in drawn for segs in rows if segs)
    height = max(len(rows) for rows, _ in drawn)
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
            f"{'-' if hit is None else f'{100 * hit:.1f}%'}", fontsize=11)
        ax.set_xlabel("token slots per row")
        ax.set_ylabel("rows (batches separated by white)")
    fig.legend(handles=[Patch(color=PREFIX, label="prefix (computed)"), Patch(color=TOKEN, label="item tokens"),
                        Patch(color=PAD, label="padding")], loc="lower center", ncol=3)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    path = Path(path)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
