"""A compromised MCP server attacks gatewayd's client session (gatewayd/mcp/client.py):
each test is the attack, tried from a real server process
(tests/mcp_servers/hostile_server.py), and what the host gives away (nothing) or how
long it is held (within a bound)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from gatewayd.mcp.client import CallTimedOut, McpSession, ServerError, open_session
from gatewayd.mcp.schemas import REGEX_BUDGET_S

SERVER = str(Path(__file__).resolve().parent.parent / "mcp_servers" / "hostile_server.py")


@asynccontextmanager
async def hostile() -> AsyncIterator[McpSession]:
    """An initialized session with the hostile server, its tools listed."""
    process = await trio.lowlevel.open_process([sys.executable, "-I", SERVER], stdin=-1, stdout=-1)
    assert process.stdin and process.stdout
    try:
        async with open_session(process.stdin, process.stdout, name="hostile") as session:
            with trio.fail_after(10):
                await session.initialize()
                await session.tools()
            yield session
    finally:
        process.kill()
        await process.wait()


async def test_a_server_gets_no_model_call_no_roots_no_elicitation_and_no_tool_call() -> None:
    async with hostile() as session:
        with trio.fail_after(10):
            result = await session.call("ask_host", {})
    answers = json.loads(result.content[0]["text"])
    # gatewayd claims none of the client capabilities a server could ask for.
    assert answers.pop("capabilities") == {}
    assert set(answers) == {"s-sampling", "s-roots", "s-elicit", "s-call"}
    for request_id, answer in answers.items():
        # Each is a JSON-RPC error, never a result: no completion, no roots, no input.
        assert set(answer) >= {"code", "message"}, (request_id, answer)
        assert "content" not in answer and "roots" not in answer and "action" not in answer


async def test_unasked_notifications_and_stray_answers_leave_the_session_serving() -> None:
    async with hostile() as session:
        started = time.monotonic()
        with trio.fail_after(20):
            result = await session.call("noise", {"count": 5000})
            assert result.content[0]["text"] == "noise done"
            # The second answer to that call, and one to an id never used, reached no
            # other call: the next is answered with its own.
            after = await session.call("echo", {"text": "mine"})
        assert after.content[0]["text"] == "mine"
        assert session.failure is None
        assert time.monotonic() - started < 20


async def test_structured_content_that_backtracks_its_output_schema_is_refused_in_bounds() -> None:
    """The server's own output schema and its own content: the SDK's check (jsonschema
    with re) would hold gatewayd's event loop for minutes; the bounded one stops at the
    budget, refuses the answer, and the session goes on."""
    async with hostile() as session:
        started = time.monotonic()
        with pytest.raises(ServerError, match="took longer than"):
            await session.call("redos", {"n": 38})
        assert time.monotonic() - started < REGEX_BUDGET_S + 2
        assert (await session.call("echo", {"text": "x"})).content[0]["text"] == "x"


async def test_the_bounded_check_still_passes_fitting_content_and_refuses_the_rest() -> None:
    async with hostile() as session:
        result = await session.call("redos", {"n": 10, "tail": ""})
        assert result.structured == {"s": "a" * 10}
        with pytest.raises(ServerError, match=r"'!' does not match '\^\(a\|aa\)\+\$'"):
            await session.call("redos", {"n": 0})


async def test_content_blocks_pointing_at_host_paths_are_data_never_read() -> None:
    async with hostile() as session:
        result = await session.call("blocks", {})
    kinds = [block["type"] for block in result.content]
    assert kinds == ["text", "resource_link", "resource", "image"]
    embedded = result.content[2]["resource"]
    # What the server wrote, not the host file its uri names.
    assert embedded["text"] == "not really a key"
    assert "BEGIN" not in json.dumps(result.content)


async def test_json_nested_past_the_readers_depth_is_no_answer_and_no_crash() -> None:
    async with hostile() as session:
        with trio.fail_after(10), pytest.raises(CallTimedOut):
            await session.call("deep", {"depth": 100_000}, timeout_s=1)
        assert session.failure is None
        assert (await session.call("echo", {"text": "x"})).content[0]["text"] == "x"


async def test_an_answer_off_mcps_types_is_the_servers_error_and_the_session_goes_on() -> None:
    """A content block of a type MCP does not have: the server's fault (ServerError,
    tool_failed to the caller), not an exception of gatewayd's own."""
    async with hostile() as session:
        with pytest.raises(ServerError, match=r"an answer that does not follow MCP \(\d+ valid"):
            await session.call("badblock", {})
        assert (await session.call("echo", {"text": "x"})).content[0]["text"] == "x"


async def test_an_output_schema_pattern_that_compiles_to_gigabytes_is_refused_unbuilt() -> None:
    """x{4294967294}: the regex engine would write out four billion items; the server's
    answer is refused from the pattern's parse alone, and gatewayd's memory is spared."""
    async with hostile() as session:
        started = time.monotonic()
        with pytest.raises(ServerError, match=r"repeats more than 1000 items by count"):
            await session.call("bigpattern", {})
        assert time.monotonic() - started < 2
        assert (await session.call("echo", {"text": "x"})).content[0]["text"] == "x"
