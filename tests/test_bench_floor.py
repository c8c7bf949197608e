"""The benchmarks' cache-aware floor (benchmarks/floor.py): which shapes it measures and how it
prices each segment; the measuring itself is the benchmark's."""

from __future__ import annotations

import pytest

from benchmarks import floor
from benchmarks.peers import cold_start


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


def test_each_suffix_reads_its_prefix_at_the_longest_measured_prefix_no_longer_than_its_own():
    read_rates = {160: 1_000.0, 350: 500.0}  # query tokens per second over a prefix that long
    assert floor.read_s([(160, 10)], read_rates) == pytest.approx(10 / 1_000.0)
    assert floor.read_s([(300, 10)], read_rates) == pytest.approx(10 / 1_000.0)  # 160's: a lower bound
    assert floor.read_s([(400, 10), (350, 5)], read_rates) == pytest.approx(15 / 500.0)
    assert floor.read_s([(100, 4)], read_rates) == pytest.approx(4 / 1_000.0)  # below every measured one
    rates = {(18, 448): 22_000.0, (910, 9): 20_000.0}
    plain = floor.floors([448, 9, 9], rates)
    read = floor.floors([448, 9, 9], rates, [(448, 9), (448, 9)], {448: 600.0})
    assert plain["reads_s"] == 0.0 and plain["by_shape_s"] == plain["no_reads_s"]
    assert read["no_reads_s"] == pytest.approx(plain["by_shape_s"])
    assert read["by_shape_s"] == pytest.approx(plain["by_shape_s"] + 18 / 600.0)
    assert read["any_shape_s"] == plain["any_shape_s"]  # the loose floor never counts the reads


def test_prefix_reads_are_measured_for_each_length_from_the_models_own_heads():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    rates = floor.measure_reads(cfg, [16, 64, 16])
    assert sorted(rates) == [16, 64] and all(r > 0 for r in rates.values())


def test_the_floor_at_another_moment_scales_with_the_probes_speed_then():
    assert floor.at_speed(8.0, probe_then=2_000.0, probe_now=1_000.0) == pytest.approx(16.0)  # half as fast now
    assert floor.at_speed(8.0, probe_then=2_000.0, probe_now=2_000.0) == pytest.approx(8.0)


# -- the cold start any exact tool pays (benchmarks/peers/cold_start.py) ---------------------------------


def test_a_cold_start_is_read_from_the_childs_moments_and_the_best_is_taken_phase_by_phase():
    got = cold_start.parse('noise\n{"imported": 102.5, "loaded": 102.75, "forward": 102.8}\n', spawned=100.0)
    assert (got.imports_s, got.load_s, got.ready_s) == pytest.approx((2.5, 0.25, 2.75))
    assert got.forward_s == pytest.approx(0.05)
    slow_imports, slow_load = cold_start.ColdStart(3.0, 0.2, 0.01), cold_start.ColdStart(2.6, 0.4, 0.02)
    best = cold_start.fastest([slow_imports, slow_load])
    assert (best.imports_s, best.load_s, best.forward_s) == (2.6, 0.2, 0.01)
    assert best.ready_s <= min(slow_imports.ready_s, slow_load.ready_s)  # never above any one start


def test_a_target_is_reachable_only_when_the_cold_start_and_the_floor_fit_the_time_it_allows():
    start = cold_start.ColdStart(imports_s=2.7, load_s=0.1, forward_s=0.01)
    allowed, least, ok = cold_start.Target(3.0).judge(peer_s=103.09, start=start, floor_s=34.59)
    assert allowed == pytest.approx(34.363, abs=1e-3) and least == pytest.approx(37.39) and not ok
    allowed, least, ok = cold_start.Target(2.0).judge(peer_s=14.84, start=start, floor_s=3.45)
    assert allowed == pytest.approx(7.42) and least == pytest.approx(6.25) and ok
    assert not cold_start.first_batch_reachable(start)  # 2.7 s of imports before the load
    assert cold_start.first_batch_reachable(cold_start.ColdStart(1.9, 0.3, 0.01))
    assert [cold_start.issue_target(f, n) for f, n in [("score", 200), ("score", 2000), ("probe_gen", 1000)]] == [
        2.0,
        3.0,
        3.0,
    ]
    assert (cold_start.issue_target("probe_gen", 3000), cold_start.issue_target("embed", 400)) == (5.0, 1.0)


@pytest.mark.slow
def test_the_cold_start_probe_runs_the_embedded_model_in_a_fresh_interpreter():
    import os

    from forge.functions.assets import embedded_model_source, materialize_model

    start = cold_start.measure(str(materialize_model(embedded_model_source())), "causal", 1, dict(os.environ))
    assert 0 < start.imports_s and 0 < start.load_s and 0 < start.forward_s
    assert start.ready_s == pytest.approx(start.imports_s + start.load_s)
