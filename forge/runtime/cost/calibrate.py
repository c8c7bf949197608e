"""Calibrate a device's step time and per-step overhead, in token-equivalents.

Model: one step costs `a + b * padded_slots + c * scores` seconds, scores being the query x
key pairs attention computes (rows x padded_len^2 for rows of whole sequences). The packer
weighs padding against `batch_overhead_tokens = a / b`: the slots one step's fixed cost is
worth. We time row-per-sequence batches of the function's own items at several row counts,
at a short and a long length (so the size and the length change apart), fit a, b and c by
least squares (none negative), and report a / b per device, and the three as the `sim`
block of a simulated device with this device's speed (`forge plan`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from forge.errors import ForgeError
from forge.vocab.geometry import Batch, Device, Item


@dataclass(frozen=True)
class Calibration:
    device: str
    seconds_per_step: float  # a
    seconds_per_slot: float  # b
    overhead_tokens: int  # a / b, what batch_overhead_tokens should be
    points: list[tuple[int, float]]  # (padded slots, median seconds)
    seconds_per_score: float = 0.0  # c

    def sim_block(self) -> dict[str, float]:
        """The `sim` entry of a simulated device that runs like this one (conf/devices/*.yaml)."""
        return {
            "seconds_per_step": float(f"{self.seconds_per_step:.3e}"),
            "seconds_per_slot": float(f"{self.seconds_per_slot:.3e}"),
            "seconds_per_score": float(f"{self.seconds_per_score:.3e}"),
        }


def calibration_batches(
    items: list[Item], device: Device, sizes=(1, 2, 4, 8, 16, 32, 64, 128), at: float = 0.25
) -> list[Batch]:
    """Batches of the k shortest-spread items (similar lengths) from quantile `at` of the
    lengths up, k over `sizes`, within the limits."""
    lim = device.limits
    pool = sorted((it for it in items if it.num_tokens <= lim.max_seq_len), key=lambda it: it.num_tokens)
    if len(pool) < 2:
        raise ForgeError("calibration needs at least 2 items that fit the device; raise input.limit")
    start = min(int(len(pool) * at), max(0, len(pool) - max(sizes)))
    mid = pool[start : start + max(sizes)] or pool
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


def fit_step_time(slots: list[int], scores: list[int], seconds: list[float]) -> tuple[float, float, float]:
    """(a, b, c) of seconds = a + b x slots + c x scores, least squares, none negative (a term
    that comes out negative is dropped and the rest refitted)."""
    x = np.column_stack([np.ones(len(slots)), np.array(slots, float), np.array(scores, float)])
    y = np.array(seconds, float)
    scale = x.max(axis=0)
    active = [0, 1, 2]
    while True:
        coef = np.zeros(3)
        coef[active] = np.linalg.lstsq(x[:, active] / scale[active], y, rcond=None)[0] / scale[active]
        negative = [j for j in active if coef[j] < 0 and j != 1]
        if not negative:
            return max(coef[0], 0.0), max(coef[1], 1e-12), max(coef[2], 0.0)
        active.remove(negative[0])


def calibrate(worker, device: Device, items: list[Item], repeats: int = 3) -> Calibration:
    short = calibration_batches(items, device)
    try:
        long = [b for b in calibration_batches(items, device, at=0.75) if b.padded_len > short[0].padded_len]
    except ForgeError:
        long = []
    batches = short + (long if len(long) >= 2 else [])
    worker.run(batches[-1])  # warm up
    points, scores = [], []
    for batch in batches:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            worker.run(batch)
            times.append(time.perf_counter() - t0)
        points.append((batch.padded_slots, statistics.median(times)))
        scores.append(batch.num_rows * batch.padded_len * batch.padded_len)
    a = b = c = 0.0
    if len(batches) > len(short):  # two lengths: slots and scores apart
        a, b, c = fit_step_time([p[0] for p in points], scores, [p[1] for p in points])
    if b <= 1e-12:  # one length, or timings too noisy to tell slots from scores: the line alone
        (a, b), c = fit(points), 0.0
    return Calibration(device.name, a, b, int(round(a / b)), points, c)
