"""sandbox.query and sandbox.usage outside a run's dispatch: a call made by gatewayd
itself has no run to describe, and says so (the answers through a real daemon are
tests/integration/test_sandbox_query.py's)."""

from __future__ import annotations

import pytest

from gatewayd.errors import ToolFailed
from gatewayd.tools.query import QueryArgs, run_query
from gatewayd.tools.registry import ToolContext
from gatewayd.tools.usage import UsageArgs, run_usage

NO_RUN = ToolContext(run_id="r", grants=(), max_output_bytes=10_000)


async def test_usage_without_a_run_is_tool_failed_saying_why() -> None:
    with pytest.raises(ToolFailed, match="describes a run's own use; this call has no run"):
        await run_usage(UsageArgs(), NO_RUN)


async def test_boundaries_without_a_run_is_tool_failed_saying_why() -> None:
    with pytest.raises(ToolFailed, match="boundaries describes a run; this call has none"):
        await run_query(QueryArgs(op="boundaries"), NO_RUN)


async def test_a_path_question_without_a_run_answers_from_the_grants_given() -> None:
    answer = await run_query(QueryArgs(op="can_read", path="/etc/passwd"), NO_RUN)
    assert answer["allowed"] is False
    assert answer["errorCode"] == "policy_denied"
    assert answer["reason"] == (
        "Cannot read '/etc/passwd': path is outside the readable paths.\nReadable paths: none"
    )
    assert answer["tools"] == []  # no dispatch, so no tool is known to be allowed
