"""gatewayd's own stdio MCP client (gatewayd/mcp/client.py) on the wire: a scripted
server on real trio streams sends each malformed answer, version and request a hostile
or broken server could, and the test reads what the client wrote back."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing
from trio.testing import MockClock

from gatewayd.mcp import client as client_module
from gatewayd.mcp.client import (
    MAX_INVALID_LINES,
    MAX_JSON_DEPTH,
    METHOD_NOT_FOUND,
    SUPPORTED_PROTOCOL_VERSIONS,
    CallTimedOut,
    McpSession,
    ServerError,
    SessionFailed,
    open_session,
)

TOOLS = [
    {"name": "echo", "inputSchema": {"type": "object"}},
    {
        "name": "shaped",
        "inputSchema": {"type": "object"},
        "outputSchema": {"type": "object", "required": ["n"]},
    },
]


class Server:
    """The server's ends of the two streams, one JSON line at a time."""

    def __init__(self, reads: trio.abc.ReceiveStream, writes: trio.abc.SendStream) -> None:
        self._reads = reads
        self._writes = writes
        self._buffer = b""

    async def receive(self) -> dict[str, Any]:
        with trio.fail_after(5):
            while b"\n" not in self._buffer:
                self._buffer += await self._reads.receive_some()
        line, self._buffer = self._buffer.split(b"\n", 1)
        message = json.loads(line)
        assert isinstance(message, dict)
        return message

    async def send(self, message: dict[str, Any] | bytes) -> None:
        line = message if isinstance(message, bytes) else json.dumps(message).encode()
        await self._writes.send_all(line + b"\n")

    async def answer(self, request: dict[str, Any], result: dict[str, Any]) -> None:
        await self.send({"jsonrpc": "2.0", "id": request["id"], "result": result})


def init_result(version: str) -> dict[str, Any]:
    return {
        "protocolVersion": version,
        "capabilities": {},
        "serverInfo": {"name": "s", "version": "1"},
    }


@asynccontextmanager
async def connected() -> AsyncIterator[tuple[McpSession, Server, trio.Nursery]]:
    """A session over memory streams, not initialized, and the server's side of it."""
    to_server_send, to_server_recv = trio.testing.memory_stream_one_way_pair()
    from_server_send, from_server_recv = trio.testing.memory_stream_one_way_pair()
    server = Server(to_server_recv, from_server_send)
    async with (
        trio.open_nursery() as nursery,
        open_session(to_server_send, from_server_recv, name="scripted") as session,
    ):
        yield session, server, nursery
        nursery.cancel_scope.cancel()


async def in_background(nursery: trio.Nursery, job: Callable[[], Any]) -> list[Any]:
    """Start ``job``; the returned list gets its result or its exception."""
    outcome: list[Any] = []

    async def run() -> None:
        try:
            outcome.append(await job())
        except Exception as exc:  # the test inspects it
            outcome.append(exc)

    nursery.start_soon(run)
    await trio.testing.wait_all_tasks_blocked()
    return outcome


async def settled(outcome: list[Any]) -> Any:
    with trio.fail_after(5):
        while not outcome:
            await trio.sleep(0.001)
    return outcome[0]


@asynccontextmanager
async def ready() -> AsyncIterator[tuple[McpSession, Server, trio.Nursery]]:
    """An initialized session with its tools listed."""
    async with connected() as (session, server, nursery):
        done = await in_background(nursery, session.initialize)
        await server.answer(await server.receive(), init_result(SUPPORTED_PROTOCOL_VERSIONS[0]))
        assert await settled(done) is None
        assert (await server.receive())["method"] == "notifications/initialized"
        listed = await in_background(nursery, session.tools)
        await server.answer(await server.receive(), {"tools": TOOLS})
        await settled(listed)
        yield session, server, nursery


async def call_answered(
    session: McpSession, server: Server, nursery: trio.Nursery, tool: str, answer: Any
) -> Any:
    """A call, the server's answer to it (a result dict, or raw bytes), the outcome."""
    outcome = await in_background(nursery, lambda: session.call(tool, {}))
    request = await server.receive()
    assert request["method"] == "tools/call" and request["params"]["name"] == tool
    if isinstance(answer, bytes):
        await server.send(answer.replace(b"ID", json.dumps(request["id"]).encode()))
    else:
        await server.answer(request, answer)
    return await settled(outcome)


# -- version negotiation -------------------------------------------------------------


async def test_the_newest_version_is_offered_and_an_older_supported_one_accepted() -> None:
    async with connected() as (session, server, nursery):
        done = await in_background(nursery, session.initialize)
        request = await server.receive()
        assert request["method"] == "initialize"
        assert request["params"]["protocolVersion"] == SUPPORTED_PROTOCOL_VERSIONS[0]
        # No client capability claimed: no sampling, roots or elicitation to ask for.
        assert request["params"]["capabilities"] == {}
        await server.answer(request, init_result("2024-11-05"))
        assert await settled(done) is None
        assert session.protocol_version == "2024-11-05"
        assert (await server.receive())["method"] == "notifications/initialized"


@pytest.mark.parametrize("version", ["1999-01-01", "2025-11-25x", "DRAFT-2026-v1"])
async def test_a_version_gatewayd_does_not_speak_fails_clearly(version: str) -> None:
    async with connected() as (session, server, nursery):
        done = await in_background(nursery, session.initialize)
        await server.answer(await server.receive(), init_result(version))
        error = await settled(done)
        assert isinstance(error, ServerError)
        assert f"Unsupported protocol version from the server: {version!r}" in str(error)
        assert "2025-11-25" in str(error)  # what gatewayd speaks
        assert session.protocol_version is None


@pytest.mark.parametrize(
    "result",
    [
        {},
        {"protocolVersion": 20251125, "capabilities": {}, "serverInfo": {}},
        init_result("x") | {"capabilities": []},
    ],
)
async def test_an_initialize_result_off_mcp_is_refused(result: dict[str, Any]) -> None:
    async with connected() as (session, server, nursery):
        done = await in_background(nursery, session.initialize)
        await server.answer(await server.receive(), result)
        error = await settled(done)
        assert isinstance(error, ServerError)
        assert "does not follow MCP" in str(error) and "protocolVersion" in str(error)


# -- requests from the server ----------------------------------------------------------


@pytest.mark.parametrize(
    "method",
    ["sampling/createMessage", "roots/list", "elicitation/create", "tools/call", "x/anything"],
)
async def test_a_request_from_the_server_is_refused_with_method_not_found(method: str) -> None:
    async with ready() as (_, server, _):
        await server.send({"jsonrpc": "2.0", "id": "srv-1", "method": method, "params": {}})
        reply = await server.receive()
        assert reply["id"] == "srv-1" and "result" not in reply
        assert reply["error"]["code"] == METHOD_NOT_FOUND
        assert method in reply["error"]["message"]


async def test_a_ping_from_the_server_is_answered() -> None:
    async with ready() as (_, server, _):
        await server.send({"jsonrpc": "2.0", "id": 7, "method": "ping"})
        assert await server.receive() == {"jsonrpc": "2.0", "id": 7, "result": {}}


# -- answers off MCP's shapes ----------------------------------------------------------


@pytest.mark.parametrize(
    ("result", "problem"),
    [
        ({"content": "hi"}, "content is not a list"),
        ({"content": ["hi"]}, "content.0: not an object"),
        ({"content": [{"type": "shell", "command": "rm -rf /"}]}, "type 'shell' is not one of"),
        ({"content": [{"text": "no type"}]}, "type 'None' is not one of"),
        ({"content": [{"type": "text"}]}, "a text block needs text"),
        ({"content": [{"type": "text", "text": 3}]}, "a text block needs text"),
        ({"content": [{"type": "image", "data": "aGk="}]}, "needs mimeType"),
        ({"content": [{"type": "audio", "mimeType": "audio/wav"}]}, "needs data"),
        ({"content": [{"type": "resource_link", "uri": "file:///x"}]}, "needs name"),
        ({"content": [{"type": "resource", "resource": {"uri": "u"}}]}, "a text or blob"),
        ({"content": [{"type": "resource"}]}, "needs a resource"),
        ({"content": [], "isError": "yes"}, "isError is not a boolean"),
        ({"content": [], "structuredContent": [1, 2]}, "structuredContent is not an object"),
    ],
)
async def test_a_call_result_off_mcps_shapes_is_a_server_error(
    result: dict[str, Any], problem: str
) -> None:
    async with ready() as (session, server, nursery):
        error = await call_answered(session, server, nursery, "echo", result)
        assert isinstance(error, ServerError)
        assert str(error).startswith("an answer that does not follow MCP (1 validation error")
        assert problem in str(error)
        # The session goes on.
        ok = await call_answered(session, server, nursery, "echo", {"content": []})
        assert ok.content == [] and session.failure is None


async def test_every_problem_is_counted_and_the_message_stays_short() -> None:
    blocks = [{"type": f"bad{i}" * 20} for i in range(50)]
    async with ready() as (session, server, nursery):
        error = await call_answered(session, server, nursery, "echo", {"content": blocks})
        assert isinstance(error, ServerError)
        assert "(50 validation errors: content.0:" in str(error)
        assert len(str(error)) < 300


async def test_a_result_with_an_output_schema_is_checked_against_it() -> None:
    async with ready() as (session, server, nursery):
        missing = await call_answered(session, server, nursery, "shaped", {"content": []})
        assert isinstance(missing, ServerError)
        assert "has an output schema but did not return structured content" in str(missing)
        off = {"content": [], "structuredContent": {"m": 1}}
        error = await call_answered(session, server, nursery, "shaped", off)
        assert isinstance(error, ServerError)
        assert "Invalid structured content returned by tool shaped: 'n' is a required" in str(error)
        fits = {"content": [], "structuredContent": {"n": 1}}
        assert (await call_answered(session, server, nursery, "shaped", fits)).structured == {
            "n": 1
        }
        # An error result is not checked (the SDK's rule too).
        failed = {"content": [{"type": "text", "text": "no"}], "isError": True}
        assert (await call_answered(session, server, nursery, "shaped", failed)).is_error


async def test_a_json_rpc_error_without_a_message_is_refused() -> None:
    async with ready() as (session, server, nursery):
        answer = b'{"jsonrpc": "2.0", "id": ID, "error": {"code": 1}}'
        error = await call_answered(session, server, nursery, "echo", answer)
        assert isinstance(error, ServerError) and "an error answer with no message" in str(error)


@pytest.mark.parametrize(
    ("tools", "problem"),
    [
        ([{"inputSchema": {}}], "tools.0: a tool needs a name"),
        ([{"name": "t"}], "needs an inputSchema object"),
        ([{"name": "t", "inputSchema": {}, "description": 5}], "description is not a string"),
        ([{"name": "t", "inputSchema": {}, "outputSchema": "x"}], "outputSchema is not an object"),
        ("all of them", "needs a list of tools"),
    ],
)
async def test_a_tool_list_off_mcp_is_refused(tools: Any, problem: str) -> None:
    async with connected() as (session, server, nursery):
        done = await in_background(nursery, session.initialize)
        await server.answer(await server.receive(), init_result("2025-06-18"))
        await settled(done)
        await server.receive()  # notifications/initialized
        listed = await in_background(nursery, session.tools)
        await server.answer(await server.receive(), {"tools": tools})
        error = await settled(listed)
        assert isinstance(error, ServerError)
        assert "does not follow MCP" in str(error) and problem in str(error)


# -- what is not an answer -------------------------------------------------------------


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(
    "line",
    [
        b"not json",
        b"\xff\xfe{}",  # not UTF-8
        b"[1, 2]",
        b'{"jsonrpc": "1.0", "id": ID, "result": {}}',
        b'{"id": ID, "result": {"content": []}}',  # no jsonrpc
        b'{"jsonrpc": "2.0", "id": ID}',  # neither result nor error
        b'{"jsonrpc": "2.0", "id": ID, "result": [1]}',
        b'{"jsonrpc": "2.0", "method": 5}',
        b'{"jsonrpc": "2.0", "id": [1], "method": "roots/list"}',
        # Nested past MAX_JSON_DEPTH yet within what the JSON parser takes.
        b'{"jsonrpc": "2.0", "id": ID, "result": {"content": [], "x": '
        + nested(MAX_JSON_DEPTH + 5)
        + b"}}",
        # Past what the parser takes at all.
        b'{"jsonrpc": "2.0", "id": ID, "result": {"x": ' + nested(100_000) + b"}}",
    ],
)
async def test_lines_that_are_no_json_rpc_answer_are_counted_then_fail_the_session(
    line: bytes, autojump_clock: MockClock
) -> None:
    # Virtual time (the session is all trio, over memory streams): the call's timeout
    # passes once every task waits, that is once the session has read the line.
    async with ready() as (session, server, nursery):
        outcome = await in_background(nursery, lambda: session.call("echo", {}, timeout_s=0.2))
        request = await server.receive()
        await server.send(line.replace(b"ID", json.dumps(request["id"]).encode()))
        assert isinstance(await settled(outcome), CallTimedOut)
        assert session.failure is None  # a few are tolerated
        for _ in range(MAX_INVALID_LINES):
            await server.send(line.replace(b"ID", b"1"))
        with trio.fail_after(5):
            await session.failed.wait()
        assert session.failure is not None and "not JSON-RPC" in session.failure
        with pytest.raises(SessionFailed, match="not JSON-RPC"):
            await session.ping()


async def test_answers_to_no_waiting_request_reach_no_other_call() -> None:
    async with ready() as (session, server, nursery):
        outcome = await in_background(nursery, lambda: session.call("echo", {}))
        request = await server.receive()
        text = {"content": [{"type": "text", "text": "forged"}]}
        for forged_id in (True, float(request["id"]), str(request["id"]), 987654, None):
            await server.send({"jsonrpc": "2.0", "id": forged_id, "result": text})
        await server.send({"jsonrpc": "2.0", "method": "notifications/progress", "params": {}})
        await trio.testing.wait_all_tasks_blocked()
        assert outcome == []
        await server.answer(request, {"content": [{"type": "text", "text": "mine"}]})
        await server.answer(request, text)  # a second answer: dropped
        assert (await settled(outcome)).content == [{"type": "text", "text": "mine"}]
        assert session.failure is None


# -- cancellation ----------------------------------------------------------------------


async def test_a_call_its_caller_cancels_sends_notifications_cancelled() -> None:
    async with ready() as (session, server, nursery):
        scopes: list[trio.CancelScope] = []

        async def caller() -> None:
            with trio.CancelScope() as scope:
                scopes.append(scope)
                await session.call("echo", {})

        nursery.start_soon(caller)
        request = await server.receive()
        scopes[0].cancel()
        notice = await server.receive()
        assert notice["method"] == "notifications/cancelled"
        assert notice["params"]["requestId"] == request["id"]
        assert session.failure is None


async def test_a_timed_out_call_sends_notifications_cancelled_and_goes_on() -> None:
    async with ready() as (session, server, nursery):
        outcome = await in_background(nursery, lambda: session.call("echo", {}, timeout_s=0.05))
        request = await server.receive()
        assert isinstance(await settled(outcome), CallTimedOut)
        notice = await server.receive()
        assert notice == {
            "jsonrpc": "2.0",
            "method": "notifications/cancelled",
            "params": {"requestId": request["id"], "reason": "gatewayd gave up on it"},
        }
        # The late answer is dropped; the next call gets its own.
        await server.answer(request, {"content": [{"type": "text", "text": "late"}]})
        ok = await call_answered(session, server, nursery, "echo", {"content": []})
        assert ok.content == [] and session.failure is None


async def test_a_message_longer_than_the_bound_fails_the_session(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(client_module, "MAX_MESSAGE_BYTES", 1000)
    async with ready() as (session, server, nursery):
        outcome = await in_background(nursery, lambda: session.call("echo", {}))
        request = await server.receive()
        await server.answer(request, {"content": [{"type": "text", "text": "x" * 2000}]})
        error = await settled(outcome)
        assert isinstance(error, SessionFailed) and "MAX_MESSAGE_BYTES" in str(error)


async def test_a_call_without_a_timeout_opens_no_deadline_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The supervisor holds the call's deadline: a call it makes without one adds no
    scope; with one, the call keeps its own (callers outside the supervisor)."""
    deadlines: list[float] = []
    move_on_after = trio.move_on_after

    def counted(seconds: float) -> trio.CancelScope:
        deadlines.append(seconds)
        return move_on_after(seconds)

    async with ready() as (session, server, nursery):
        monkeypatch.setattr(trio, "move_on_after", counted)
        ok = await call_answered(session, server, nursery, "echo", {"content": []})
        assert ok.content == [] and deadlines == []
        outcome = await in_background(nursery, lambda: session.call("echo", {}, timeout_s=5))
        await server.answer(await server.receive(), {"content": []})
        assert (await settled(outcome)).content == [] and deadlines == [5]
        # Cut off by its caller's deadline alone, the server is still told.
        with trio.move_on_after(0.05):
            await session.call("echo", {})
        assert (await server.receive())["method"] == "tools/call"
        notice = await server.receive()
        assert notice["method"] == "notifications/cancelled" and session.failure is None


# -- the cached tool list ----------------------------------------------------------------


async def test_the_listed_tools_are_read_without_a_request_until_they_change() -> None:
    async with connected() as (session, server, nursery):
        assert session.cached_tools() is None  # never listed
    async with ready() as (session, server, nursery):
        cached = session.cached_tools()
        assert cached is not None and [tool.name for tool in cached] == ["echo", "shaped"]
        assert await session.tools() is cached  # the same list, no request
        await server.send({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
        with trio.fail_after(5):
            while session.cached_tools() is not None:
                await trio.sleep(0.001)
        # Read again: the next listing asks the server.
        listed = await in_background(nursery, session.tools)
        request = await server.receive()
        assert request["method"] == "tools/list"
        await server.answer(request, {"tools": TOOLS[:1]})
        assert [tool.name for tool in await settled(listed)] == ["echo"]
        assert session.cached_tools() == await session.tools()


# -- requests written straight to a pipe (the server's stdin as gatewayd holds it) --


@asynccontextmanager
async def pipe_session() -> AsyncIterator[tuple[McpSession, int, trio.MemorySendChannel[bytes]]]:
    """A session whose requests go to a real pipe (its read end returned, for the test
    to read or close) and whose answers come from a memory stream."""
    import os

    read_end, write_end = os.pipe()
    to_server = trio.lowlevel.FdStream(write_end)
    answers_send, answers_recv = trio.testing.memory_stream_one_way_pair()
    lines_send, lines_recv = trio.open_memory_channel[bytes](16)

    async def pump() -> None:
        async for line in lines_recv:
            await answers_send.send_all(line)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump)
            async with open_session(to_server, answers_recv, name="piped") as session:
                yield session, read_end, lines_send
            nursery.cancel_scope.cancel()
    finally:
        await to_server.aclose()
        with contextlib.suppress(OSError):  # a test may have closed it already
            os.close(read_end)


def _read_line(fd: int) -> dict[str, Any]:
    import os

    data = b""
    while not data.endswith(b"\n"):
        data += os.read(fd, 65536)
    message: dict[str, Any] = json.loads(data)
    return message


async def test_a_request_to_a_pipe_is_one_whole_line_and_its_answer_comes_back() -> None:
    async with pipe_session() as (session, read_end, answers):
        async with trio.open_nursery() as nursery:
            got: list[Any] = []

            async def call() -> None:
                got.append(await session.call("echo", {"text": "hi"}, timeout_s=10))

            nursery.start_soon(call)
            await trio.sleep(0.05)
            request = await trio.to_thread.run_sync(_read_line, read_end)
            assert request["method"] == "tools/call"
            assert request["params"] == {"name": "echo", "arguments": {"text": "hi"}}
            answer = {"content": [{"type": "text", "text": "hi"}], "isError": False}
            reply = {"jsonrpc": "2.0", "id": request["id"], "result": answer}
            await answers.send(json.dumps(reply).encode() + b"\n")
            # A tool never listed: its output schema is learnt first, on the same pipe.
            listing = await trio.to_thread.run_sync(_read_line, read_end)
            assert listing["method"] == "tools/list"
            tools = {"jsonrpc": "2.0", "id": listing["id"], "result": {"tools": TOOLS}}
            await answers.send(json.dumps(tools).encode() + b"\n")
        assert got[0].content == [{"type": "text", "text": "hi"}]


async def test_a_server_that_closed_its_stdin_fails_the_session_saying_so() -> None:
    import os

    async with pipe_session() as (session, read_end, _answers):
        os.close(read_end)  # the server is gone: nobody reads its stdin
        with pytest.raises(SessionFailed, match="stopped reading its stdin"):
            await session.call("echo", {}, timeout_s=10)
        assert session.failure is not None


async def test_a_line_the_pipe_takes_in_part_is_finished_under_the_lock_or_fails_the_session() -> (
    None
):
    # A request bigger than the pipe's buffer: part goes at once, the rest waits for the
    # server to read. Given up on (the timeout), the line is cut off: the session fails.
    async with pipe_session() as (session, _read_end, _answers):
        big = {"text": "x" * (1 << 20)}
        with pytest.raises((CallTimedOut, SessionFailed)):
            await session.call("echo", big, timeout_s=0.2)
        assert session.failure is not None and "cut off" in session.failure
