"""gatewayd's MCP client session (gatewayd/mcp/client.py) against a real server process
(tests/mcp_servers/misbehaving_server.py, no sandbox: the session is what is tested here;
tests/integration/test_mcp_servers.py runs it sandboxed)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from gatewayd.mcp import client as client_module
from gatewayd.mcp.client import CallTimedOut, McpSession, ServerError, SessionFailed, open_session

SERVER = str(Path(__file__).resolve().parent.parent / "mcp_servers" / "misbehaving_server.py")


def server_tools() -> list[str]:
    """The tools the server offers, from its own table."""
    spec = importlib.util.spec_from_file_location("misbehaving_server", SERVER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.TOOLS)


@asynccontextmanager
async def session(*switches: str) -> AsyncIterator[tuple[McpSession, trio.Process, bytearray]]:
    """An initialized session with the server; its stderr collected."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-I", SERVER, *switches],
        stdin=-1,  # subprocess.PIPE
        stdout=-1,
        stderr=-1,
    )
    assert process.stdin and process.stdout and process.stderr
    stderr = bytearray()

    async def collect() -> None:
        assert process.stderr
        while chunk := await process.stderr.receive_some():
            stderr.extend(chunk)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect)
            async with open_session(process.stdin, process.stdout, name="misc") as s:
                with trio.fail_after(10):
                    await s.initialize()
                yield s, process, stderr
            nursery.cancel_scope.cancel()
    finally:
        process.kill()
        await process.wait()


async def test_the_handshake_negotiates_a_version_and_lists_every_page() -> None:
    async with session("--page-size", "2") as (s, _, _):
        assert s.protocol_version in ("2025-11-25", "2025-06-18")
        tools = await s.tools()
        assert sorted(t.name for t in tools) == sorted(server_tools())
        assert await s.tools() is tools  # cached
        result = await s.call("echo", {"text": "hi"})
        assert result.content == [{"type": "text", "text": "hi"}] and not result.is_error
        await s.ping()


async def test_a_timed_out_call_sends_notifications_cancelled() -> None:
    async with session() as (s, _, stderr):
        with pytest.raises(CallTimedOut) as timed_out:
            await s.call("ignore", {}, timeout_s=0.5)
        assert "within 0.5 s" in str(timed_out.value)
        with trio.fail_after(5):
            while b"cancelled " not in stderr:
                await trio.sleep(0.01)
        # The session goes on: the server answers the next call.
        assert (await s.call("echo", {"text": "after"})).content[0]["text"] == "after"


async def test_list_changed_makes_the_next_listing_fresh() -> None:
    async with session() as (s, _, _):
        first = {t.name: t.description for t in await s.tools()}
        await s.call("change", {})
        with trio.fail_after(5):
            while True:
                now = {t.name: t.description for t in await s.tools()}
                if now != first:
                    break
                await trio.sleep(0.01)
        assert "evil.example" in now["echo"]


async def test_a_json_rpc_error_is_a_server_error_and_the_session_goes_on() -> None:
    async with session() as (s, _, _):
        with pytest.raises(ServerError, match="Unknown tool: nope"):
            await s.call("nope", {})
        assert (await s.call("echo", {"text": "x"})).content[0]["text"] == "x"


async def test_a_line_past_the_bound_fails_the_session(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "MAX_MESSAGE_BYTES", 1 << 20)
    async with session() as (s, _, _):
        with trio.fail_after(10), pytest.raises(SessionFailed, match="flooded its stdout"):
            await s.call("flood", {"bytes": 4 << 20})
        assert s.failure is not None and "MAX_MESSAGE_BYTES" in s.failure
        # Failed for good: every later request answers at once with the same reason.
        with pytest.raises(SessionFailed, match="flooded"):
            await s.call("echo", {"text": "x"})


async def test_lines_that_are_not_json_rpc_fail_the_session_past_a_few() -> None:
    async with session() as (s, _, _):
        # A few stray lines are tolerated (MAX_INVALID_LINES)...
        assert (await s.call("garbage", {"lines": 3})).content[0]["text"] == "garbage written"
        # ...many are a server not speaking the protocol.
        with trio.fail_after(10), pytest.raises(SessionFailed, match="not JSON-RPC"):
            await s.call("garbage", {"lines": 100})


async def test_a_server_that_exits_fails_the_call_in_flight_at_once() -> None:
    async with session() as (s, _, _):
        with trio.fail_after(5), pytest.raises(SessionFailed, match="closed its stdout"):
            await s.call("crash", {})


async def test_more_tools_than_the_bound_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "MAX_TOOLS", 5)
    async with session("--page-size", "2") as (s, _, _):
        with pytest.raises(SessionFailed, match="more than 5 tools"):
            await s.tools()


async def test_structured_content_off_its_output_schema_is_a_server_error() -> None:
    async with session() as (s, _, _):
        await s.tools()  # the SDK checks against the schemas it was listed
        with pytest.raises(ServerError, match="Invalid structured content returned by tool"):
            await s.call("badshape", {})
        assert (await s.call("echo", {"text": "x"})).content[0]["text"] == "x"
