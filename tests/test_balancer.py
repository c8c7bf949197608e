import math

from forge.scheduling.balancer import rows_within


def test_rows_within_interpolates_between_one_row_and_the_whole_batch():
    assert rows_within(room=0.5, one=1.0, whole=5.0, num_rows=5) == 0
    assert rows_within(room=1.0, one=1.0, whole=5.0, num_rows=5) == 1
    assert rows_within(room=3.5, one=1.0, whole=5.0, num_rows=5) == 3


def test_rows_within_always_leaves_a_row_to_go_back_when_room_is_a_rounding_error_short():
    # a case found by search where the plain formula rounds up to every row (CI saw the empty
    # rest of such a split fail in pad_to_limits)
    one, whole, n = 0.47712035719820345, 3.394447172433904, 63
    room = math.nextafter(whole, 0)
    assert 1 + int((room - one) / ((whole - one) / (n - 1))) == n
    assert rows_within(room, one, whole, n) == n - 1


def _two_cards(seconds_per_step: float):
    from forge.scheduling.balancer import Balancer
    from forge.vocab.geometry import Batch, Device, Item, Limits, StepTime

    sim = StepTime(seconds_per_step=seconds_per_step, seconds_per_slot=0.001)
    cards = [Device(name, Limits(8192, 64, 512), sim=sim) for name in ("a", "b")]
    balancer = Balancer(cards, holds=lambda name, batch: False)
    balancer.routed("b", 1800)  # b is busy for 1.8 s
    batch = Batch(rows=[[Item(str(i), 100)] for i in range(10)], padded_len=100)
    return balancer, cards[0], batch


def test_a_batch_that_overruns_the_common_finish_by_less_than_a_step_costs_stays_whole():
    # a: the batch takes 1 + 10 x 0.1 = 2.0 s whole; the common finish leaves it 1.5 s. Cut to
    # 5 rows (1.5 s), the other 5 would run on b after its 1.8 s: 3.3 s, against 2.0 s whole.
    balancer, a, batch = _two_cards(seconds_per_step=1.0)
    share = balancer.fair_share(batch, a, waiting_slots=500)
    assert share.keep == batch and share.back is None and balancer.end_splits == 0


def test_a_batch_that_overruns_by_more_than_a_step_costs_is_cut_to_the_devices_share():
    # a is busy for 1.0 s and b for 1.8 s: the batch (1.01 s whole) and the work in flight end
    # together at 1.9 s, which leaves a 0.9 s: 8 rows, the other 2 back for b
    balancer, a, batch = _two_cards(seconds_per_step=0.01)
    balancer.routed("a", 1000)
    share = balancer.fair_share(batch, a, waiting_slots=0)
    assert share.keep is not None and share.back is not None and balancer.end_splits == 1
    assert share.keep.num_rows == 8 and share.back.num_rows == 2
    assert [it.id for it in share.keep.items + share.back.items] == [it.id for it in batch.items]
