"""``time.now``: the host's wall-clock time, because a sandbox's clock is not to be trusted."""

from __future__ import annotations

import time
from functools import lru_cache
from typing import Any

import msgspec

from gatewayd.tools.builtin import builtin_tool
from gatewayd.tools.registry import Tool, ToolContext


class NowArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """time.now takes no arguments."""


def iso_utc(epoch_ns: int) -> str:
    """``2026-01-02T03:04:05.678Z``: ISO 8601 in UTC, milliseconds, rounded down."""
    seconds, millis = divmod(epoch_ns // 1_000_000, 1000)
    return f"{_second_prefix(seconds)}{millis:03d}Z"


# Calls within one second share their date and time up to the second: formatted once
# (a few seconds kept, for a clock that steps back), not at every call.
@lru_cache(maxsize=4)
def _second_prefix(seconds: int) -> str:
    # Integer seconds: a float timestamp could round .9995 s up into the next second.
    # time.gmtime, not datetime: the same fields at a fraction of the cost.
    return time.strftime("%Y-%m-%dT%H:%M:%S.", time.gmtime(seconds))


def now_value(epoch_ns: int) -> dict[str, Any]:
    """The result for a moment given in nanoseconds since the epoch (millisecond precision)."""
    return {"iso": iso_utc(epoch_ns), "epochMs": epoch_ns // 1_000_000, "timezone": "UTC"}


def now_at_once(_args: NowArgs, _ctx: ToolContext) -> dict[str, Any]:
    """``{"iso": "2026-01-02T03:04:05.678Z", "epochMs": ..., "timezone": "UTC"}``."""
    return now_value(time.time_ns())


async def run_now(args: NowArgs, ctx: ToolContext) -> dict[str, Any]:
    """:func:`now_at_once`, awaited (the runner's way of calling it)."""
    return now_at_once(args, ctx)


TIME_NOW: Tool[NowArgs] = builtin_tool(
    name="time.now",
    summary="The current time on the host, in UTC (ISO 8601 and milliseconds since the epoch).",
    args_type=NowArgs,
    run=run_now,
    side_effects=False,
    immediate=now_at_once,
)
