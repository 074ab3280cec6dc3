"""common/backoff.py: the waits between retries, their cap, their jitter, and bad settings refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from common.backoff import Backoff


def test_the_wait_doubles_from_the_first_up_to_the_cap():
    backoff = Backoff(0.1, 1.0)
    assert [backoff.delay_s(k) for k in range(1, 7)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    assert backoff.delay_s(0) == backoff.delay_s(1) == pytest.approx(0.1)


def test_jitter_takes_up_to_its_share_off_the_wait():
    backoff = Backoff(1.0, 8.0, multiplier=3.0, jitter=0.5)
    assert backoff.delay_s(2, draw=0.0) == pytest.approx(3.0)
    assert backoff.delay_s(2, draw=0.999) == pytest.approx(3.0 * (1 - 0.5 * 0.999))
    assert backoff.delay_s(3, draw=0.5) == pytest.approx(8.0 * 0.75)


@given(st.floats(0, 100), st.floats(0, 1000), st.floats(1, 1000), st.integers(-5, 10**9), st.floats(0, 0.999))
def test_any_retry_waits_between_zero_and_the_cap_without_overflow(initial, extra, multiplier, retry, draw):
    backoff = Backoff(initial, initial + extra, multiplier, jitter=1.0)
    assert 0 <= backoff.delay_s(retry, draw) <= initial + extra


@pytest.mark.parametrize("kwargs", [{"initial_s": -1, "max_s": 1}, {"initial_s": 2, "max_s": 1},
                                    {"initial_s": 1, "max_s": 2, "multiplier": 0.5},
                                    {"initial_s": 1, "max_s": 2, "jitter": 1.5}])
def test_a_back_off_that_cannot_work_is_refused(kwargs):
    with pytest.raises(ValueError, match="back-off"):
        Backoff(**kwargs)
