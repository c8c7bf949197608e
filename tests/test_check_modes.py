"""forge.testing.check_modes compares every row or says which it did not: a row a run skips (too
long for the limits) fails the check, naming the row and the limit, unless skips are allowed;
and the check says which layouts each mode's batches actually took."""

import pytest

from forge.testing import REFERENCE, ModeCheck, check_modes

PREFIX = "Answer true or false.\n"
ROWS = [
    {"id": "a", "text": "The sky is blue.", "prefix": PREFIX},
    {"id": "b", "text": "Snow is black.", "prefix": PREFIX},
    {"id": "c", "text": "Water is wet."},
    {"id": "d", "text": "Fire is cold.", "prefix": "Say yes or no.\n"},
]
LONG = {"id": "too-long", "text": "word " * 200, "prefix": PREFIX}  # over SMALL_LIMITS' max_seq_len=128
MODES = {
    "item": ["batching=item", "batching.batch_size=6"],
    "token-merged": ["batching=token", "batching.batch_overhead_tokens=100000"],
}


@pytest.mark.slow
def test_a_row_longer_than_the_limit_fails_the_check_by_name(tmp_path):
    with pytest.raises(AssertionError) as failed:
        check_modes("surprisal", [*ROWS, LONG], tmp_path, tol=1e-4, modes=MODES)
    message = str(failed.value)
    assert f"the {REFERENCE} run skipped 1 of 5 rows" in message
    assert "'too-long'" in message and "max_seq_len=128" in message and "allow_skipped=True" in message


@pytest.mark.slow
def test_allowed_skips_are_reported_and_the_layouts_that_ran_are_listed(tmp_path):
    check = check_modes("surprisal", [*ROWS, LONG], tmp_path, tol=1e-4, modes=MODES, allow_skipped=True)
    assert check.reference.ids == ["a", "b", "c", "d"] and set(check.worst) == set(MODES)
    assert set(check.skipped) == {REFERENCE, *MODES}
    assert all(list(rows) == ["too-long"] and "max_seq_len=128" in rows["too-long"] for rows in check.skipped.values())
    # what ran: whole rows one at a time and in item batches; merged prefix groups in tree rows
    assert check.layouts[REFERENCE] == {"rows": 4} and check.layouts["item"] == {"rows": 1}
    assert "tree rows" in check.layouts["token-merged"]
    summary = check.summary().splitlines()
    assert summary[0] == f"{REFERENCE}: 4 rows compared; rows x4"
    assert summary[1].startswith("item: rows x1; worst difference ")
    assert summary[2].startswith("token-merged: ") and "tree rows x" in summary[2]
    assert summary[3].startswith("every run skipped 1 row(s): 'too-long' (too_long (> max_seq_len=128))")


@pytest.mark.slow
def test_a_mode_that_skips_rows_the_reference_ran_fails_unless_allowed(tmp_path):
    rows = [*ROWS, {"id": "longer", "text": "word " * 12, "prefix": PREFIX}]  # 45 tokens: runs under 128
    short = {"short-rows": ["batching=token", "devices.limits.max_seq_len=32"]}
    with pytest.raises(AssertionError, match=r"the short-rows run skipped 1 of 5 rows.*'longer'.*max_seq_len=32"):
        check_modes("surprisal", rows, tmp_path / "strict", tol=1e-4, modes=short)
    check = check_modes("surprisal", rows, tmp_path / "allowed", tol=1e-4, modes=short, allow_skipped=True)
    assert len(check.reference) == 5 and len(check.results["short-rows"]) == 4  # compared on the four both ran
    assert list(check.skipped) == ["short-rows"] and check.worst["short-rows"] < 1e-4
    assert "short-rows skipped 1 row(s): 'longer'" in check.summary()


def test_the_summary_reads_mode_layouts_worst_difference_and_refusal():
    check = ModeCheck(reference=[object()] * 3)
    check.layouts = {
        REFERENCE: {"rows": 3},
        "token-cache": {"split-prefix rows": 1, "cache-hit rows": 2},
    }
    check.worst = {"token-cache": 2.5e-7}
    check.refused = {"token-packed": "batching.packing=packed is not exact for this model (eager attention)"}
    assert check.summary().splitlines() == [
        f"{REFERENCE}: 3 rows compared; rows x3",
        "token-cache: split-prefix rows x1, cache-hit rows x2; worst difference 2.5e-07",
        "token-packed: refused: batching.packing=packed is not exact for this model (eager attention)",
    ]
