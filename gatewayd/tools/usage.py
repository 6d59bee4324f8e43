"""``sandbox.usage``: what this run has used so far, and what it has left.

Its calls (answered with a value, or with an error code, counted by code), its wall
time (elapsed since it began serving, left before ``limits.maxRuntimeSec`` ends it), and
its model budget (requests and tokens spent, and left). Read from the live run gatewayd
keeps, never from anything the sandbox says; read-only.

A call is counted once it is answered, so the answer covers the calls finished before
this one (not itself).
"""

from __future__ import annotations

from typing import Any

import msgspec
import trio

from gatewayd.errors import ToolFailed
from gatewayd.tools.builtin import builtin_tool
from gatewayd.tools.registry import Tool, ToolContext


class UsageArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """sandbox.usage takes no arguments."""


def _seconds(value: float) -> float:
    return round(max(value, 0.0), 3)


async def run_usage(_args: UsageArgs, ctx: ToolContext) -> dict[str, Any]:
    run = ctx.run
    if run is None:
        raise ToolFailed("sandbox.usage describes a run's own use; this call has no run")
    now = trio.current_time()
    budget = run.model_budget
    max_runtime = run.spec.request.limits.maxRuntimeSec
    return {
        "calls": {
            "total": run.calls,
            "allowed": run.allowed,
            "denied": run.denied,
            "deniedByCode": dict(sorted(run.denied_by_code.items())),
        },
        "time": {
            "elapsedSec": None if run.serving_since is None else _seconds(now - run.serving_since),
            "remainingSec": None if run.deadline is None else _seconds(run.deadline - now),
            "maxRuntimeSec": max_runtime,
        },
        "model": {
            "requests": budget.requests,
            "maxRequests": budget.max_requests,
            "requestsLeft": max(budget.max_requests - budget.requests, 0),
            "tokens": budget.tokens,
            "maxTokens": budget.max_tokens,
            "tokensLeft": max(budget.max_tokens - budget.tokens, 0),
        },
    }


SANDBOX_USAGE: Tool[UsageArgs] = builtin_tool(
    name="sandbox.usage",
    summary=(
        "This run's use so far: calls (allowed, denied by code), wall time elapsed and "
        "left, model requests and tokens spent and left."
    ),
    args_type=UsageArgs,
    run=run_usage,
    side_effects=False,
)
