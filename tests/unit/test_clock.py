"""time.now: the host's clock in UTC, as ISO 8601 and epoch milliseconds."""

from __future__ import annotations

import time
from datetime import UTC, datetime

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gatewayd.tools.clock import TIME_NOW, NowArgs, iso_utc, now_value
from gatewayd.tools.registry import ToolContext

# Up to the year 9999: what an ISO 8601 four-digit year can show.
MAX_EPOCH_NS = 253_402_300_799_999_999_999


async def test_time_now_returns_the_host_time_in_utc() -> None:
    before = time.time_ns() // 1_000_000
    ctx = ToolContext(run_id="run-1", grants=(), max_output_bytes=1 << 20)
    result = await TIME_NOW.runner.run(NowArgs(), ctx)
    after = time.time_ns() // 1_000_000
    assert set(result) == {"iso", "epochMs", "timezone"}
    assert result["timezone"] == "UTC"
    assert before <= result["epochMs"] <= after
    assert result["iso"].endswith("Z")


def test_now_value_formats_a_known_moment() -> None:
    assert now_value(1_767_323_045_678_901_234) == {
        "iso": "2026-01-02T03:04:05.678Z",
        "epochMs": 1_767_323_045_678,
        "timezone": "UTC",
    }


def test_milliseconds_just_below_a_second_do_not_round_into_the_next() -> None:
    assert iso_utc(1_767_323_045_999_999_999) == "2026-01-02T03:04:05.999Z"


@given(st.integers(min_value=0, max_value=MAX_EPOCH_NS))
def test_iso_and_epoch_ms_name_the_same_millisecond(epoch_ns: int) -> None:
    value = now_value(epoch_ns)
    parsed = datetime.strptime(value["iso"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
    assert parsed.timestamp() * 1000 == pytest.approx(value["epochMs"], abs=0.5)
    assert len(value["iso"]) == len("2026-01-02T03:04:05.678Z")


def test_time_now_takes_no_arguments() -> None:
    assert msgspec.convert({}, NowArgs) == NowArgs()
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.convert({"tz": "Europe/Paris"}, NowArgs)


def test_calls_in_one_second_and_across_seconds_format_as_each_moment_alone() -> None:
    # The date up to the second is formatted once per second and kept: every moment,
    # in order, back in time (a clock that steps back) and across a day and a year,
    # still reads as the uncached formula says.
    moments = [
        1_767_323_045_000_000_000,
        1_767_323_045_999_999_999,
        1_767_323_046_000_000_000,
        1_767_323_044_500_000_000,
        1_767_225_599_999_000_000,  # 2025-12-31T23:59:59.999
        1_767_225_600_000_000_000,  # 2026-01-01T00:00:00.000
        *(1_767_323_045_000_000_000 + i * 250_000_000 for i in range(12)),
    ]
    for ns in moments:
        seconds, millis = divmod(ns // 1_000_000, 1000)
        expected = time.strftime("%Y-%m-%dT%H:%M:%S.", time.gmtime(seconds)) + f"{millis:03d}Z"
        assert iso_utc(ns) == expected
