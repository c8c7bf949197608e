"""Calibrate a device's per-step overhead, in token-equivalents.

Model: one step costs `a + b * padded_slots` seconds. The packer weighs padding against
`batch_overhead_tokens = a / b`: the slots one step's fixed cost is worth. We time
row-per-sequence batches of the function's own items at several row counts (same lengths,
so only the size changes), fit the line by least squares, and report a / b per device.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from forge.errors import ForgeError
from forge.geometry import Batch, Device, Item


@dataclass(frozen=True)
class Calibration:
    device: str
    seconds_per_step: float  # a
    seconds_per_slot: float  # b
    overhead_tokens: int  # a / b, what batch_overhead_tokens should be
    points: list[tuple[int, float]]  # (padded slots, median seconds)


def calibration_batches(items: list[Item], device: Device, sizes=(1, 2, 4, 8, 16, 32, 64, 128)) -> list[Batch]:
    """Batches of the k shortest-spread items (similar lengths), k over `sizes`, within the limits."""
    lim = device.limits
    pool = sorted((it for it in items if it.num_tokens <= lim.max_seq_len), key=lambda it: it.num_tokens)
    if len(pool) < 2:
        raise ForgeError("calibration needs at least 2 items that fit the device; raise input.limit")
    mid = pool[len(pool) // 4: len(pool) // 4 + max(sizes)] or pool
    batches = []
    for k in sizes:
        rows = mid[:k]
        padded = lim.pad(max(it.num_tokens for it in rows))
        if len(rows) < k or k > lim.max_rows or k * padded > lim.max_batch_tokens:
            break
        batches.append(Batch(rows=[[it] for it in rows], padded_len=padded))
    if len(batches) < 2:
        raise ForgeError(f"device {device.name}: its limits allow fewer than 2 batch sizes to time")
    return batches


def fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    b, a = np.polyfit(x, y, 1)
    return max(a, 0.0), max(b, 1e-12)


def calibrate(worker, device: Device, items: list[Item], repeats: int = 3) -> Calibration:
    batches = calibration_batches(items, device)
    worker.run(batches[-1])  # warm up
    points = []
    for batch in batches:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            worker.run(batch)
            times.append(time.perf_counter() - t0)
        points.append((batch.padded_slots, statistics.median(times)))
    a, b = fit(points)
    return Calibration(device.name, a, b, int(round(a / b)), points)
