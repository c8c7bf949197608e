"""The benchmarks' cache-aware floor (benchmarks/floor.py): which shapes it measures and how it
prices each segment; the measuring itself is the benchmark's."""

from __future__ import annotations

import pytest

from benchmarks import floor


def test_it_measures_quantiles_of_the_workloads_own_lengths_and_the_grid():
    assert floor.representatives([7, 7, 9, 340, 12, 24]) == [7, 9, 12, 24, 340]
    assert floor.representatives(range(1, 101)) == [1, 26, 51, 75, 100]
    assert floor.representatives([]) == []
    todo = floor.shapes([448, 448, 1])
    assert {(4, 448), (18, 448), (2048, 1), (8192, 1), (32, 64), (128, 64), (4, 512), (16, 512)} <= todo
    assert floor.shapes([5000]) >= {(1, 5000)}  # a segment longer than a step: one row


def test_a_segment_is_priced_at_the_nearest_shorter_length_or_packed_into_short_rows():
    by_length = {9: 20_000.0, 64: 35_000.0, 128: 30_000.0, 340: 25_000.0, 448: 22_000.0}
    assert floor.rate_for(448, by_length) == 22_000.0
    assert floor.rate_for(400, by_length) == 25_000.0  # between 340 and 448: 340's rate (the faster)
    assert floor.rate_for(9, by_length) == 35_000.0  # nine tokens may share 64-token rows
    assert floor.rate_for(100, by_length) == 35_000.0  # 64's rate, below it
    assert floor.rate_for(3, by_length) == 35_000.0  # shorter than any measured length


def test_both_floors_count_every_segment_once_and_the_shape_floor_is_never_below_the_other():
    rates = {(18, 448): 22_000.0, (4, 448): 21_000.0, (128, 64): 35_000.0, (910, 9): 20_000.0}
    got = floor.floors([448] * 10 + [9] * 100, rates)
    assert got["tokens"] == 448 * 10 + 9 * 100
    assert got["best_rate"] == 35_000.0
    assert got["any_shape_s"] == pytest.approx(got["tokens"] / 35_000.0)
    assert got["by_shape_s"] == pytest.approx(4480 / 22_000.0 + 900 / 35_000.0)
    assert got["by_shape_s"] >= got["any_shape_s"]
