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
