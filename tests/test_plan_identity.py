"""The plan-identity guard: `forge plan`'s batch sequences stay byte-identical across refactors.

Each case (item, token, packed, memory and no-cache modes, on the embedded default input and
on a heavy tail over the 1:2 mix; see `tests/plan_identity.py`) records every batch the
simulated executor is handed, in order (device, prefix, item ids per row, padded length,
predicted cache hit, ...), and compares the SHA-256 of that canonical text with the digest
recorded from the code before the scheduler was renovated (`tests/plan_identity.json`). A
change that alters any plan fails here; one that means to must re-record the digests
(`python -m tests.plan_identity --write`) and say why.
"""

import json

import pytest

from tests.plan_identity import DIGESTS, cases, digest

RECORDED = json.loads(DIGESTS.read_text())


def test_every_case_has_a_recorded_digest():
    assert set(RECORDED) == set(cases())


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_the_plan_is_byte_identical_to_the_recorded_one(name):
    sha, batches = digest(name)
    assert batches == RECORDED[name]["batches"]
    assert sha == RECORDED[name]["sha256"]
