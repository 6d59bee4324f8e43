"""gatewayd's MCP client session with one server, over the server's stdio byte streams.

The protocol itself is the official MCP SDK's (``mcp.client.session.ClientSession``:
``initialize`` with version negotiation, ``notifications/initialized``, ``tools/list``,
``tools/call``, and a ``notifications/cancelled`` sent for a call given up on). The SDK
runs on anyio, which runs on trio, gatewayd's loop, so it is used as it is. What this
module adds is the transport: the SDK's own stdio transport starts the process itself
and reads its output without bound, and gatewayd's servers run in a sandbox whose pipes
gatewayd holds, and must not be able to make gatewayd hold a message of any size:

* one message from the server is at most :data:`MAX_MESSAGE_BYTES`; a longer line (or
  output with no newline past it) is a flood: the session fails, saying so;
* a server that writes more than :data:`MAX_INVALID_LINES` lines that are not JSON-RPC
  fails the session the same way (stdout is the protocol's, nothing else's);
* memory stays bounded otherwise too: the next chunk is read only once the last
  message is taken by the session (backpressure), so a fast server waits.

A failed session stays failed (:attr:`McpSession.failure` says why); the supervisor
(:mod:`gatewayd.mcp.servers`) stops the instance and starts a fresh one for the next
call. The session's tool list is cached, and marked stale when the server sends
``notifications/tools/list_changed``: the next :meth:`McpSession.tools` reads it again.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Mapping
from contextlib import asynccontextmanager
from typing import Any, Final, TypeVar

import anyio
import mcp_types as types
import trio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from jsonschema.protocols import Validator
from mcp.client.session import ClientSession
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage
from referencing import Registry

from gatewayd.mcp.remote import RemoteResult, RemoteTool
from gatewayd.mcp.schemas import SchemaRefused, bounded_validator, regex_budget

# One JSON-RPC message from a server: a tools/list of hundreds of tools with schemas, or
# a call's result of a few MiB of text, fits; past it the server is flooding, and
# gatewayd would otherwise hold whatever it writes before the newline.
MAX_MESSAGE_BYTES: Final = 8 << 20
# How much is read from the server's stdout at once (one pipe's worth).
READ_CHUNK: Final = 64 << 10
# Lines on stdout that are not JSON-RPC: a stray print is tolerated a few times (some
# servers log one line at start); more is a server that is not speaking the protocol.
MAX_INVALID_LINES: Final = 16
# tools/list: pages followed and tools kept. A server offering more is refused: every
# tool is a gateway tool an operator pins and a reviewer reads.
MAX_LIST_PAGES: Final = 64
MAX_TOOLS: Final = 1024
# How much of the SDK's complaint about an answer a message quotes (its first line).
MAX_SHOWN_PROBLEM_CHARS: Final = 200
# How gatewayd introduces itself in initialize.
CLIENT_INFO: Final = types.Implementation(name="cogni-gatewayd", version="0.1.0")

R = TypeVar("R")


class SessionFailed(Exception):
    """The session cannot be used any more (the server exited, flooded its stdout, or
    stopped speaking the protocol); ``str(exc)`` says which."""


class CallTimedOut(Exception):
    """A request got no answer in time; a ``notifications/cancelled`` was sent for it."""


class ServerError(Exception):
    """The server answered a request with a JSON-RPC error (an unknown tool, bad
    arguments), or with an answer the SDK refuses (structured content that does not fit
    the tool's output schema): ``str(exc)`` says which."""


class McpSession:
    """One initialized session with one server. Made by :func:`open_session`.

    Thread safety: trio task safe; calls from several tasks run concurrently (each
    request has its own id)."""

    def __init__(self, session: ClientSession, name: str) -> None:
        self._session = session
        self._name = name
        self.failure: str | None = None
        self.failed = trio.Event()
        self._tools: tuple[RemoteTool, ...] | None = None
        # Bumped by each notifications/tools/list_changed: a list read while it changed
        # is read again.
        self._tools_generation = 0
        self.protocol_version: str | None = None
        # The requests waiting for an answer: a failure cancels them at once (a scope
        # each, not a watcher task each: a task per call cost more than the rest of it).
        self._waiting: set[trio.CancelScope] = set()

    def fail(self, why: str) -> None:
        """Mark the session failed (the first reason is kept)."""
        if self.failure is None:
            self.failure = why
        self.failed.set()
        for scope in self._waiting:
            scope.cancel()

    async def initialize(self) -> None:
        """The handshake: ``initialize`` (the SDK negotiates the version), then
        ``notifications/initialized``.

        Error handling: SessionFailed; ServerError when the server refuses it."""
        result = await self._request(self._session.initialize())
        self.protocol_version = result.protocol_version

    async def tools(self) -> tuple[RemoteTool, ...]:
        """The server's tools, every page (cached until the server says they changed).

        Error handling: SessionFailed (also for a server with more than MAX_TOOLS tools or
        MAX_LIST_PAGES pages); ServerError."""
        while self._tools is None:
            generation = self._tools_generation
            found: list[RemoteTool] = []
            cursor: str | None = None
            for _ in range(MAX_LIST_PAGES):
                params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
                page = await self._request(self._session.list_tools(params=params))
                found.extend(_remote_tool(tool) for tool in page.tools)
                if len(found) > MAX_TOOLS:
                    raise SessionFailed(
                        f"MCP server {self._name!r} lists more than {MAX_TOOLS} tools"
                    )
                cursor = page.next_cursor
                if not cursor:
                    break
            else:
                raise SessionFailed(
                    f"MCP server {self._name!r}'s tools/list goes on past {MAX_LIST_PAGES} pages"
                )
            if generation == self._tools_generation:
                self._tools = tuple(found)
        return self._tools

    async def call(
        self, tool: str, arguments: Mapping[str, Any], timeout_s: float = math.inf
    ) -> RemoteResult:
        """One ``tools/call``. Cancelling it (or ``timeout_s`` passing) sends the server
        a ``notifications/cancelled`` for it.

        Error handling: CallTimedOut after ``timeout_s``; SessionFailed; ServerError for
        a JSON-RPC error answer."""
        with trio.move_on_after(timeout_s):
            result = await self._request(self._session.call_tool(tool, dict(arguments)))
            return RemoteResult(
                content=[
                    block.model_dump(mode="json", by_alias=True, exclude_none=True)
                    for block in result.content
                ],
                structured=(
                    result.structured_content
                    if isinstance(result.structured_content, dict)
                    else None
                ),
                is_error=result.is_error,
            )
        raise CallTimedOut(f"MCP server {self._name!r} did not answer within {timeout_s:g} s")

    async def ping(self) -> None:
        """A ``ping`` round trip. Error handling: SessionFailed; ServerError."""
        await self._request(self._session.send_ping())

    async def _request(self, pending: Awaitable[R]) -> R:
        """Await one SDK request, translating its errors; a session that fails while
        the request waits answers at once, whatever the SDK would wait for."""
        if self.failure is not None:
            pending.close()  # type: ignore[attr-defined]  # a coroutine never awaited
            raise SessionFailed(self.failure)
        outcome: list[R] = []
        error: str | None = None
        with trio.CancelScope() as waiting:
            self._waiting.add(waiting)
            try:
                outcome.append(await pending)
            except MCPError as exc:
                if exc.code == types.CONNECTION_CLOSED:  # the transport's end, not an answer
                    self.fail(f"MCP server {self._name!r}: the connection closed ({exc.message})")
                error = exc.message
            except RuntimeError as exc:
                # The SDK's checks of an answer: structured content that does not fit the
                # tool's output schema, a protocol version it does not speak.
                error = str(exc)
            except ValueError as exc:
                # An answer the SDK's types refuse (pydantic's ValidationError): a content
                # block of a type MCP does not have, a field missing. The server's fault,
                # named by the first line (one problem per field can run to pages).
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                error = f"an answer that does not follow MCP ({first[:MAX_SHOWN_PROBLEM_CHARS]})"
            finally:
                self._waiting.discard(waiting)
        if self.failure is not None:
            raise SessionFailed(self.failure)
        if error is not None:
            raise ServerError(error)
        return outcome[0]

    def _tools_changed(self) -> None:
        self._tools_generation += 1
        self._tools = None


@asynccontextmanager
async def open_session(
    to_server: trio.abc.SendStream, from_server: trio.abc.ReceiveStream, *, name: str
) -> AsyncIterator[McpSession]:
    """A session over the server's stdin (``to_server``) and stdout (``from_server``),
    not yet initialized. Leaving it stops the session's tasks; the streams are the
    caller's to close.

    Resource handling: two tasks (the bounded reader, the writer) and the SDK's own,
    all in a nursery of this context."""
    reader_in: MemoryObjectSendStream[SessionMessage | Exception]
    reader_out: MemoryObjectReceiveStream[SessionMessage | Exception]
    writer_in: MemoryObjectSendStream[SessionMessage]
    writer_out: MemoryObjectReceiveStream[SessionMessage]
    # Unbuffered: a message is read from the pipe only once the session takes the last.
    reader_in, reader_out = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    writer_in, writer_out = anyio.create_memory_object_stream[SessionMessage](0)
    async with trio.open_nursery() as nursery, _over(reader_out, writer_in, name) as session:
        nursery.start_soon(_read, from_server, reader_in, session, name)
        nursery.start_soon(_write, writer_out, to_server, session, name)
        try:
            yield session
        finally:
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def open_remote_session(url: str, *, name: str) -> AsyncIterator[McpSession]:
    """A session with a remote server over MCP's streamable HTTP transport (the SDK's
    own client: its SSE events are bounded by the SDK, its plain JSON answers are not;
    it follows only redirects that stay on the server's origin), not yet initialized.

    Error handling: the transport's errors surface as SessionFailed or ServerError from
    the session's requests."""
    from mcp.client.streamable_http import streamable_http_client

    async with (
        streamable_http_client(url) as (read, write),
        _over(read, write, name, fail_on_transport_error=True) as session,
    ):
        yield session


class _BoundedClientSession(ClientSession):
    """The SDK's session, checking a result's structured content against the tool's
    output schema with bounded regular expressions (:mod:`gatewayd.mcp.schemas`): the
    schema and the content are both the server's, and the SDK's own check matches
    jsonschema's ``pattern`` with ``re``, which a hostile pair of them keeps busy for
    hours on gatewayd's event loop."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Each tool's output schema (as last listed) and its bounded validator.
        self._bounded: dict[str, tuple[dict[str, Any], Validator]] = {}

    async def validate_tool_result(self, name: str, result: types.CallToolResult) -> None:
        with regex_budget():
            await super().validate_tool_result(name, result)

    def _output_schema_validator(self, name: str, output_schema: dict[str, Any]) -> Validator:
        # The SDK's own builds jsonschema's unbounded validator; same registry (none).
        cached = self._bounded.get(name)
        if cached is not None and cached[0] == output_schema:
            return cached[1]
        try:
            validator = bounded_validator(output_schema, registry=Registry())
        except SchemaRefused as exc:
            raise RuntimeError(f"Invalid schema for tool {name}: {exc}") from None
        self._bounded[name] = (output_schema, validator)
        return validator


@asynccontextmanager
async def _over(
    read: Any, write: Any, name: str, *, fail_on_transport_error: bool = False
) -> AsyncIterator[McpSession]:
    """The SDK's session over its two message streams, as an :class:`McpSession`."""
    holder: list[McpSession] = []

    async def on_message(message: Any) -> None:
        if not holder:
            return
        if isinstance(message, types.ToolListChangedNotification):
            holder[0]._tools_changed()
        elif isinstance(message, Exception) and fail_on_transport_error:
            # The HTTP transport reports a broken connection as a message.
            holder[0].fail(f"MCP server {name!r}: {message}")

    client = _BoundedClientSession(read, write, message_handler=on_message, client_info=CLIENT_INFO)
    async with client:
        session = McpSession(client, name)
        holder.append(session)
        yield session


async def _read(
    source: trio.abc.ReceiveStream,
    sink: MemoryObjectSendStream[SessionMessage | Exception],
    session: McpSession,
    name: str,
) -> None:
    """The server's stdout, one bounded line at a time, into the SDK's session."""
    buffer = bytearray()
    scanned = 0  # bytes of buffer known to hold no newline
    invalid = 0
    async with sink:
        while True:
            try:
                chunk = await source.receive_some(READ_CHUNK)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                chunk = b""
            if not chunk:
                session.fail(f"MCP server {name!r} closed its stdout (it exited or was stopped)")
                return
            buffer += chunk
            while (newline := buffer.find(b"\n", scanned)) >= 0:
                line = bytes(buffer[:newline])
                del buffer[: newline + 1]
                scanned = 0
                if len(line) > MAX_MESSAGE_BYTES:
                    break  # reported below, as a line with no newline yet
                if not line.strip():
                    continue
                try:
                    message = types.jsonrpc_message_adapter.validate_json(line, by_name=False)
                except ValueError:
                    invalid += 1
                    if invalid > MAX_INVALID_LINES:
                        session.fail(
                            f"MCP server {name!r} wrote more than {MAX_INVALID_LINES} lines "
                            "that are not JSON-RPC messages on its stdout; it was stopped"
                        )
                        return
                    continue
                try:
                    await sink.send(SessionMessage(message))
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    return
            scanned = len(buffer)
            if len(buffer) > MAX_MESSAGE_BYTES:
                session.fail(
                    f"MCP server {name!r} flooded its stdout: a message longer than "
                    f"{MAX_MESSAGE_BYTES} bytes (MAX_MESSAGE_BYTES); it was stopped"
                )
                return


async def _write(
    source: MemoryObjectReceiveStream[SessionMessage],
    sink: trio.abc.SendStream,
    session: McpSession,
    name: str,
) -> None:
    """The SDK's messages to the server's stdin, one line each."""
    async with source:
        async for message in source:
            data = message.message.model_dump_json(by_alias=True, exclude_unset=True)
            try:
                await sink.send_all(data.encode() + b"\n")
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                session.fail(f"MCP server {name!r} stopped reading its stdin (it exited)")
                return


def _remote_tool(tool: types.Tool) -> RemoteTool:
    return RemoteTool(
        name=tool.name,
        description=tool.description or "",
        input_schema=dict(tool.input_schema),
        title=tool.title,
    )
