"""The token bucket, driven by a fake clock: every timing rule checked in zero wall time."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gatewayd.policy import TokenBucket


def take_all(bucket: TokenBucket, now: float) -> int:
    taken = 0
    while bucket.try_take(now):
        taken += 1
    return taken


def test_a_new_bucket_allows_a_full_burst_then_refuses() -> None:
    bucket = TokenBucket(rate=10, burst=5)
    assert take_all(bucket, 100.0) == 5
    assert not bucket.try_take(100.0)


def test_tokens_come_back_at_the_rate() -> None:
    bucket = TokenBucket(rate=10, burst=5)
    take_all(bucket, 0.0)
    assert not bucket.try_take(0.05)  # half a token
    assert bucket.try_take(0.1)
    assert not bucket.try_take(0.1)
    assert take_all(bucket, 0.4) == 3


def test_refill_never_exceeds_the_burst() -> None:
    bucket = TokenBucket(rate=10, burst=5)
    take_all(bucket, 0.0)
    assert take_all(bucket, 3600.0) == 5


def test_retry_after_is_zero_with_a_token_and_the_wait_without() -> None:
    bucket = TokenBucket(rate=4, burst=1)
    assert bucket.retry_after(0.0) == 0.0
    assert bucket.try_take(0.0)
    assert bucket.retry_after(0.0) == pytest.approx(0.25)
    assert bucket.retry_after(0.1) == pytest.approx(0.15)
    assert not bucket.try_take(0.2)
    assert bucket.try_take(0.25)


def test_retry_after_does_not_take_a_token() -> None:
    bucket = TokenBucket(rate=1, burst=1)
    for _ in range(3):
        assert bucket.retry_after(0.0) == 0.0
    assert bucket.try_take(0.0)


def test_a_refused_call_takes_nothing() -> None:
    bucket = TokenBucket(rate=1, burst=1)
    assert bucket.try_take(0.0)
    for _ in range(100):
        assert not bucket.try_take(0.5)
    assert bucket.try_take(1.0)


def test_a_clock_that_steps_back_adds_no_tokens() -> None:
    bucket = TokenBucket(rate=1, burst=2)
    take_all(bucket, 10.0)
    assert not bucket.try_take(5.0)
    assert not bucket.try_take(10.5)
    assert bucket.try_take(11.0)


def test_slow_rates_below_one_call_per_second_work() -> None:
    bucket = TokenBucket(rate=0.1, burst=1)
    assert bucket.try_take(0.0)
    assert bucket.retry_after(0.0) == pytest.approx(10.0)
    assert not bucket.try_take(9.99)
    assert bucket.try_take(10.0)


@pytest.mark.parametrize(
    ("rate", "burst", "says"),
    [
        (0, 1, "rate must be a finite number above 0, got 0"),
        (-1, 1, "rate must be a finite number above 0"),
        (math.inf, 1, "rate must be a finite number above 0, got inf"),
        (math.nan, 1, "rate must be a finite number above 0, got nan"),
        (1, 0, "burst must be at least 1, got 0"),
    ],
)
def test_nonsense_settings_are_refused(rate: float, burst: int, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        TokenBucket(rate=rate, burst=burst)


RATES = st.floats(min_value=0.01, max_value=10_000, allow_nan=False, allow_infinity=False)
BURSTS = st.integers(min_value=1, max_value=64)
STEPS = st.lists(st.floats(min_value=0, max_value=5, allow_nan=False), max_size=30)


@given(rate=RATES, burst=BURSTS, start=st.floats(min_value=0, max_value=1e6), steps=STEPS)
def test_waiting_exactly_retry_after_is_always_enough(
    rate: float, burst: int, start: float, steps: list[float]
) -> None:
    bucket = TokenBucket(rate=rate, burst=burst)
    now = start
    for step in steps:
        now += step
        bucket.try_take(now)
    take_all(bucket, now)
    wait = bucket.retry_after(now)
    assert 0 < wait <= 1 / rate + 1e-6  # at most one token's time (plus the early slack)
    assert bucket.try_take(now + wait)


@given(rate=RATES, burst=BURSTS, steps=STEPS)
def test_calls_granted_never_exceed_burst_plus_rate_times_elapsed(
    rate: float, burst: int, steps: list[float]
) -> None:
    bucket = TokenBucket(rate=rate, burst=burst)
    now, granted = 0.0, 0
    for step in steps:
        now += step
        granted += take_all(bucket, now)
        assert granted <= burst + rate * now + 1e-6
