"""gatewayd's MCP client session with one server: over the server's stdio byte streams
(a client of our own), or over MCP's streamable HTTP (the official SDK's).

Why our own client for stdio: every ``tools/call`` of a declared server passes here, and
the gateway may add at most 2 ms at p50 over a client calling the server directly. The
SDK's ``ClientSession`` per request (pydantic models both ways, anyio memory streams, a
request clock, tracing spans, a task per request) cost most of that budget: a call to
mcp-server-time through it took about 1.4 ms at p50 in-process where a plain line client
took 0.86 ms. The stdio protocol gatewayd needs is small (``initialize`` with version
negotiation, ``notifications/initialized``, ``tools/list``, ``tools/call``, ``ping``,
``notifications/cancelled``), so it is written here: one JSON line each way (msgspec),
a dict of waiting requests, one reader task. Remote servers keep the SDK
(:func:`open_remote_session`): its HTTP transport (sessions, SSE, redirects) is most of
that protocol, and a network round trip dwarfs the SDK's cost.

The stdio client holds what the server sends to bounds, since the server runs in a
sandbox and may be hostile:

* one message from the server is at most :data:`MAX_MESSAGE_BYTES`; a longer line (or
  output with no newline past it) is a flood: the session fails, saying so;
* a server that writes more than :data:`MAX_INVALID_LINES` lines that are not JSON-RPC
  (or JSON nested deeper than :data:`MAX_JSON_DEPTH`) fails the session the same way
  (stdout is the protocol's, nothing else's);
* the next chunk is read only once the last message is handled (backpressure);
* an answer to a request not waiting (a second answer, an id never used) is dropped;
  notifications other than ``tools/list_changed`` are dropped;
* a request from the server (``sampling/createMessage``, ``roots/list``,
  ``elicitation/create``, anything but ``ping``) is answered with JSON-RPC's "method
  not found" and never acted on: gatewayd claims no client capability;
* answers are checked to follow MCP's shapes (a result's content blocks, ``isError``,
  ``structuredContent``; a tool list's entries), else :class:`ServerError`; structured
  content is checked against the tool's output schema with bounded regular expressions
  (:mod:`gatewayd.mcp.schemas`).

A failed session stays failed (:attr:`McpSession.failure` says why); the supervisor
(:mod:`gatewayd.mcp.servers`) stops the instance and starts a fresh one for the next
call. The session's tool list is cached, and marked stale when the server sends
``notifications/tools/list_changed``: the next :meth:`McpSession.tools` reads it again.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import AsyncIterator, Awaitable, Mapping
from contextlib import asynccontextmanager
from typing import Any, Final, TypeVar

import mcp_types as types
import msgspec
import trio
from jsonschema.exceptions import best_match
from jsonschema.protocols import Validator
from mcp.client.session import ClientSession
from mcp.shared.exceptions import MCPError
from referencing import Registry
from referencing.exceptions import Unresolvable

from gatewayd.mcp.remote import RemoteResult, RemoteTool
from gatewayd.mcp.schemas import RegexTooSlow, SchemaRefused, bounded_validator, regex_budget

# One JSON-RPC message from a server: a tools/list of hundreds of tools with schemas, or
# a call's result of a few MiB of text, fits; past it the server is flooding, and
# gatewayd would otherwise hold whatever it writes before the newline.
MAX_MESSAGE_BYTES: Final = 8 << 20
# How much is read from the server's stdout at once (one pipe's worth).
READ_CHUNK: Final = 64 << 10
# Lines on stdout that are not JSON-RPC: a stray print is tolerated a few times (some
# servers log one line at start); more is a server that is not speaking the protocol.
MAX_INVALID_LINES: Final = 16
# Nesting of a message from a server: MCP's own shapes are a few levels deep, a tool's
# structured content a few more; deeper is refused like a line that is not JSON-RPC
# (the SDK's JSON parser stops at the same depth), so no later json.dumps of it (audit,
# the caller's answer) hits Python's recursion limit.
MAX_JSON_DEPTH: Final = 200
# tools/list: pages followed and tools kept. A server offering more is refused: every
# tool is a gateway tool an operator pins and a reviewer reads.
MAX_LIST_PAGES: Final = 64
MAX_TOOLS: Final = 1024
# How much of a complaint about an answer a message quotes.
MAX_SHOWN_PROBLEM_CHARS: Final = 200
# How long a notifications/cancelled may wait for the server's stdin: a server that
# does not read it gets none, rather than holding the caller's cancellation.
CANCEL_NOTICE_S: Final = 1.0
# How gatewayd introduces itself in initialize.
CLIENT_NAME: Final = "cogni-gatewayd"
CLIENT_VERSION: Final = "0.1.0"
CLIENT_INFO_SDK: Final = types.Implementation(name=CLIENT_NAME, version=CLIENT_VERSION)
# The protocol versions the stdio client speaks, newest first: the SDK's handshake
# versions (mcp.client.session.HANDSHAKE_PROTOCOL_VERSIONS), whose initialize, tools
# and cancellation messages are the same in each. The newest is offered; the server's
# answer is accepted if it is one of these.
SUPPORTED_PROTOCOL_VERSIONS: Final = ("2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05")
# JSON-RPC's "method not found", the answer to every request a server makes but ping.
METHOD_NOT_FOUND: Final = -32601
# MCP's content block types and the fields each must have as strings.
CONTENT_FIELDS: Final[Mapping[str, tuple[str, ...]]] = {
    "text": ("text",),
    "image": ("data", "mimeType"),
    "audio": ("data", "mimeType"),
    "resource_link": ("uri", "name"),
    "resource": (),  # its "resource" object is checked on its own
}

R = TypeVar("R")

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


class SessionFailed(Exception):
    """The session cannot be used any more (the server exited, flooded its stdout, or
    stopped speaking the protocol); ``str(exc)`` says which."""


class CallTimedOut(Exception):
    """A request got no answer in time; a ``notifications/cancelled`` was sent for it."""


class ServerError(Exception):
    """The server answered a request with a JSON-RPC error (an unknown tool, bad
    arguments), or with an answer gatewayd refuses (one off MCP's shapes, structured
    content that does not fit the tool's output schema): ``str(exc)`` says which."""


class McpSession:
    """One session with one server, not yet initialized. Made by :func:`open_session`
    (stdio) or :func:`open_remote_session` (HTTP).

    Thread safety: trio task safe; calls from several tasks run concurrently (each
    request has its own id)."""

    def __init__(self, name: str) -> None:
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
        """The handshake: ``initialize`` (negotiating the version), then
        ``notifications/initialized``.

        Error handling: SessionFailed; ServerError when the server refuses it or
        answers with a version gatewayd does not speak."""
        raise NotImplementedError

    def cached_tools(self) -> tuple[RemoteTool, ...] | None:
        """The server's tools as last read, while the server has not said they changed
        (None: to be read with :meth:`tools`). Never awaits: a call's pin check reads
        them without a request, a cancel scope or a schedule point."""
        return self._tools

    async def tools(self) -> tuple[RemoteTool, ...]:
        """The server's tools, every page (cached until the server says they changed).

        Error handling: SessionFailed (also for a server with more than MAX_TOOLS tools or
        MAX_LIST_PAGES pages); ServerError."""
        while self._tools is None:
            generation = self._tools_generation
            found: list[RemoteTool] = []
            cursor: str | None = None
            for _ in range(MAX_LIST_PAGES):
                page, cursor = await self._list_page(cursor)
                found.extend(page)
                if len(found) > MAX_TOOLS:
                    raise SessionFailed(
                        f"MCP server {self._name!r} lists more than {MAX_TOOLS} tools"
                    )
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
        a ``notifications/cancelled`` for it. With no ``timeout_s`` the call makes no
        deadline of its own: a caller that holds one already (the supervisor's) is the
        only cancel scope with a deadline on the call's path.

        Error handling: CallTimedOut after ``timeout_s``; SessionFailed; ServerError for
        a JSON-RPC error answer or one off MCP's shapes."""
        raise NotImplementedError

    async def ping(self) -> None:
        """A ``ping`` round trip. Error handling: SessionFailed; ServerError."""
        raise NotImplementedError

    async def _list_page(self, cursor: str | None) -> tuple[list[RemoteTool], str | None]:
        """One page of ``tools/list`` and the cursor of the next (None at the end)."""
        raise NotImplementedError

    def _tools_changed(self) -> None:
        self._tools_generation += 1
        self._tools = None

    def _timed_out(self, timeout_s: float) -> CallTimedOut:
        return CallTimedOut(f"MCP server {self._name!r} did not answer within {timeout_s:g} s")


class _Answer:
    """Where the reader puts the answer to one request."""

    __slots__ = ("error", "event", "result")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.result: dict[str, Any] | None = None
        self.error: str | None = None


class _StdioSession(McpSession):
    """The session over a server's stdin and stdout, the client of this module."""

    def __init__(self, to_server: trio.abc.SendStream, name: str) -> None:
        super().__init__(name)
        self._to_server = to_server
        # A pipe's stream is written to at once when nobody else is sending (_send).
        self._pipe = to_server if isinstance(to_server, trio.lowlevel.FdStream) else None
        # A stream takes one writer at a time; a message is one whole line.
        self._send_lock = trio.Lock()
        self._next_id = 1
        self._answers: dict[int, _Answer] = {}
        # Each listed tool's output schema (None: it has none), and its bounded
        # validator built once per schema.
        self._output_schemas: dict[str, dict[str, Any] | None] = {}
        self._validators: dict[str, tuple[dict[str, Any], Validator]] = {}

    async def initialize(self) -> None:
        params = {
            "protocolVersion": SUPPORTED_PROTOCOL_VERSIONS[0],
            "capabilities": {},  # none: a server may not sample, list roots or elicit
            "clientInfo": {"name": CLIENT_NAME, "version": CLIENT_VERSION},
        }
        result = await self._request("initialize", params)
        version = result.get("protocolVersion")
        if (
            not isinstance(version, str)
            or not isinstance(result.get("capabilities"), dict)
            or not isinstance(result.get("serverInfo"), dict)
        ):
            raise ServerError(
                _off_mcp(["initialize's result needs protocolVersion, capabilities, serverInfo"])
            )
        if version not in SUPPORTED_PROTOCOL_VERSIONS:
            raise ServerError(
                f"Unsupported protocol version from the server: {version[:40]!r} (gatewayd "
                f"speaks {', '.join(SUPPORTED_PROTOCOL_VERSIONS)})"
            )
        self.protocol_version = version
        await self._send({"jsonrpc": "2.0", "method": "notifications/initialized"})

    async def call(
        self, tool: str, arguments: Mapping[str, Any], timeout_s: float = math.inf
    ) -> RemoteResult:
        if timeout_s == math.inf:
            return await self._call(tool, arguments)
        with trio.move_on_after(timeout_s):
            return await self._call(tool, arguments)
        raise self._timed_out(timeout_s)

    async def _call(self, tool: str, arguments: Mapping[str, Any]) -> RemoteResult:
        answer = await self._request("tools/call", {"name": tool, "arguments": dict(arguments)})
        result = _call_result(answer)
        if not result.is_error:
            await self._check_structured(tool, answer, result.structured)
        return result

    async def ping(self) -> None:
        await self._request("ping", None)

    async def _list_page(self, cursor: str | None) -> tuple[list[RemoteTool], str | None]:
        result = await self._request("tools/list", {"cursor": cursor} if cursor else None)
        listed = result.get("tools")
        next_cursor = result.get("nextCursor")
        if not isinstance(listed, list) or not isinstance(next_cursor, str | None):
            raise ServerError(_off_mcp(["tools/list's result needs a list of tools"]))
        page: list[RemoteTool] = []
        for index, entry in enumerate(listed):
            problem = _tool_problem(entry)
            if problem:
                raise ServerError(_off_mcp([f"tools.{index}: {problem}"]))
            page.append(
                RemoteTool(
                    name=entry["name"],
                    description=entry.get("description") or "",
                    input_schema=entry["inputSchema"],
                    title=entry.get("title"),
                )
            )
            self._output_schemas[entry["name"]] = entry.get("outputSchema")
        return page, next_cursor

    async def _check_structured(
        self, tool: str, answer: dict[str, Any], structured: dict[str, Any] | None
    ) -> None:
        """The result's structured content against the tool's output schema, as the SDK
        checks it (its messages too), with bounded regular expressions: the schema and
        the content are both the server's, and jsonschema's ``pattern`` with ``re``
        could keep gatewayd's event loop busy for hours."""
        if tool not in self._output_schemas:
            await self.tools()  # a tool never listed: its schema is learnt first
        schema = self._output_schemas.get(tool)
        if schema is None:
            return
        if "structuredContent" not in answer:
            raise ServerError(
                f"Tool {tool} has an output schema but did not return structured content"
            )
        cached = self._validators.get(tool)
        if cached is not None and cached[0] is schema:
            validator = cached[1]
        else:
            try:
                validator = bounded_validator(schema, registry=Registry())
            except SchemaRefused as exc:
                raise ServerError(f"Invalid schema for tool {tool}: {exc}") from None
            self._validators[tool] = (schema, validator)
        try:
            with regex_budget():
                error = best_match(validator.iter_errors(structured))
        except Unresolvable as exc:
            raise ServerError(f"Invalid schema for tool {tool}: {exc}") from None
        except RegexTooSlow as exc:
            raise ServerError(str(exc)) from None
        if error is not None:
            raise ServerError(f"Invalid structured content returned by tool {tool}: {error}")

    async def _request(self, method: str, params: Mapping[str, Any] | None) -> dict[str, Any]:
        """One request and its result; a session that fails while it waits answers at
        once. Given up on (cancelled, timed out), the server is told with a
        ``notifications/cancelled``.

        Error handling: SessionFailed; ServerError for a JSON-RPC error answer."""
        if self.failure is not None:
            raise SessionFailed(self.failure)
        request_id = self._next_id
        self._next_id += 1
        answer = _Answer()
        self._answers[request_id] = answer
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id, "method": method}
        if params is not None:
            message["params"] = params
        answered = False
        try:
            with trio.CancelScope() as waiting:
                self._waiting.add(waiting)
                try:
                    await self._send(message)
                    await answer.event.wait()
                    answered = True
                finally:
                    self._waiting.discard(waiting)
        finally:
            del self._answers[request_id]
            if not answered and self.failure is None and method != "initialize":
                # MCP: initialize is never cancelled; the rest are, so the server can stop.
                await self._notify_cancelled(request_id)
        if self.failure is not None:
            raise SessionFailed(self.failure)
        if answer.error is not None:
            raise ServerError(answer.error)
        assert answer.result is not None  # set with the event when error is not
        return answer.result

    async def _notify_cancelled(self, request_id: int) -> None:
        notice = {
            "jsonrpc": "2.0",
            "method": "notifications/cancelled",
            "params": {"requestId": request_id, "reason": "gatewayd gave up on it"},
        }
        # A session failed on the way already says why; nothing more to tell.
        with (
            trio.CancelScope(shield=True),
            trio.move_on_after(CANCEL_NOTICE_S),
            contextlib.suppress(SessionFailed),
        ):
            await self._send(notice)

    async def _send(self, message: Mapping[str, Any]) -> None:
        """One message to the server's stdin, one line.

        Error handling: SessionFailed when the server stopped reading it, or when a
        cancellation cut a message off (the stream's framing is lost)."""
        data = _encode(message) + b"\n"
        if self._pipe is not None and not self._send_lock.locked():
            # The usual case: nobody else is sending and the line fits in the pipe. It is
            # written at once, without the lock's and send_all's two schedule points (a
            # request's wait for its answer is one anyway). Cancelled here, nothing was
            # written.
            await trio.lowlevel.checkpoint_if_cancelled()
            sent = self._write_nowait(self._pipe, data)
            if sent == len(data):
                return
            # The rest under the lock, taken before any await (so it is still free): no
            # other line can land in the middle of this one.
            self._send_lock.acquire_nowait()
            try:
                await self._send_all(data[sent:])
            finally:
                self._send_lock.release()
            return
        async with self._send_lock:
            # Cancelled here, nothing was written; cancelled inside send_all, part may be.
            await trio.lowlevel.checkpoint_if_cancelled()
            await self._send_all(data)

    def _write_nowait(self, pipe: trio.lowlevel.FdStream, data: bytes) -> int:
        """Write what the pipe takes now, without waiting; the bytes written.

        Error handling: SessionFailed when the server stopped reading (or the pipe is
        closed)."""
        fd = pipe.fileno()
        try:
            if fd < 0:  # closed: never write to a number that may be reused
                raise BrokenPipeError("the pipe to the server is closed")
            return os.write(fd, data)
        except BlockingIOError:
            return 0
        except OSError:  # EPIPE, EBADF: the server exited, or its pipe was closed
            self.fail(f"MCP server {self._name!r} stopped reading its stdin (it exited)")
            raise SessionFailed(self.failure) from None

    async def _send_all(self, data: bytes) -> None:
        """``data`` to the server's stdin, waiting for room (the caller holds the lock).

        Error handling: SessionFailed when the server stopped reading; a cancellation
        here may cut the line off, so it fails the session (the framing is lost)."""
        try:
            await self._to_server.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.fail(f"MCP server {self._name!r} stopped reading its stdin (it exited)")
            raise SessionFailed(self.failure) from None
        except trio.Cancelled:
            self.fail(
                f"MCP server {self._name!r} did not read its stdin; a message to it was "
                "cut off by a cancellation"
            )
            raise

    async def _read(self, source: trio.abc.ReceiveStream) -> None:
        """The server's stdout, one bounded line at a time, each handled before the next
        chunk is read."""
        buffer = bytearray()
        scanned = 0  # bytes of buffer known to hold no newline
        invalid = 0
        while True:
            try:
                chunk = await source.receive_some(READ_CHUNK)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                chunk = b""
            if not chunk:
                self.fail(f"MCP server {self._name!r} closed its stdout (it exited or was stopped)")
                return
            buffer += chunk
            while (newline := buffer.find(b"\n", scanned)) >= 0:
                line = bytes(buffer[:newline])
                del buffer[: newline + 1]
                scanned = 0
                if len(line) > MAX_MESSAGE_BYTES:  # it came whole in one chunk
                    self.fail(self._flooded())
                    return
                if not line.strip():
                    continue
                try:
                    handled = await self._received(line)
                except SessionFailed:
                    return
                if not handled:
                    invalid += 1
                    if invalid > MAX_INVALID_LINES:
                        self.fail(
                            f"MCP server {self._name!r} wrote more than {MAX_INVALID_LINES} "
                            "lines that are not JSON-RPC messages on its stdout; it was stopped"
                        )
                        return
            scanned = len(buffer)
            if len(buffer) > MAX_MESSAGE_BYTES:
                self.fail(self._flooded())
                return

    def _flooded(self) -> str:
        return (
            f"MCP server {self._name!r} flooded its stdout: a message longer than "
            f"{MAX_MESSAGE_BYTES} bytes (MAX_MESSAGE_BYTES); it was stopped"
        )

    async def _received(self, line: bytes) -> bool:
        """Handle one line from the server; False when it is not a JSON-RPC message.

        Error handling: SessionFailed when an answer to the server cannot be sent."""
        try:
            message = _decode(line)
        except (ValueError, RecursionError):  # msgspec.DecodeError is a ValueError
            return False
        if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
            return False
        # Nesting needs an opening bracket per level: few brackets, no walk (it is most).
        if line.count(b"[") + line.count(b"{") > MAX_JSON_DEPTH and _deeper_than(
            message, MAX_JSON_DEPTH
        ):
            return False
        method = message.get("method")
        request_id = message.get("id")
        if method is None:
            return self._answered(message, request_id)
        if not isinstance(method, str):
            return False
        if "id" not in message:
            if method == "notifications/tools/list_changed":
                self._tools_changed()
            return True  # other notifications (progress, logging, ...) ask nothing
        if type(request_id) not in (int, str):
            return False
        reply: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id}
        if method == "ping":
            reply["result"] = {}
        else:
            # Never acted on: no model call, no roots, no user input, no tool call.
            reply["error"] = {
                "code": METHOD_NOT_FOUND,
                "message": f"gatewayd offers MCP servers no {method[:100]!r}",
            }
        await self._send(reply)
        return True

    def _answered(self, message: dict[str, Any], request_id: object) -> bool:
        """A response: given to the request waiting for it; dropped when none is (an
        answer never asked for, a second answer)."""
        result = message.get("result")
        error = message.get("error")
        if not isinstance(result, dict) and not isinstance(error, dict):
            return False
        if type(request_id) is not int:  # gatewayd's ids are ints (not bools either)
            return True
        answer = self._answers.get(request_id)
        if answer is None or answer.event.is_set():
            return True
        if isinstance(result, dict):
            answer.result = result
        else:
            assert isinstance(error, dict)
            text = error.get("message")
            answer.error = (
                text if isinstance(text, str) else _off_mcp(["an error answer with no message"])
            )
        answer.event.set()
        return True


def _off_mcp(problems: list[str]) -> str:
    """The message for an answer off MCP's shapes, naming its first problems."""
    count = len(problems)
    shown = "; ".join(problems)[:MAX_SHOWN_PROBLEM_CHARS]
    return (
        f"an answer that does not follow MCP ({count} validation error"
        f"{'' if count == 1 else 's'}: {shown})"
    )


def _call_result(result: dict[str, Any]) -> RemoteResult:
    """A tools/call result as MCP shapes it (the content blocks' types and their string
    fields, isError a bool, structuredContent an object).

    Error handling: ServerError for one off those shapes."""
    problems: list[str] = []
    content = result.get("content")
    blocks: list[dict[str, Any]] = []
    if not isinstance(content, list):
        problems.append("content is not a list")
    else:
        for index, block in enumerate(content):
            problem = _block_problem(block)
            if problem:
                problems.append(f"content.{index}: {problem}")
            else:
                # As the SDK's models dumped them: a field set to null is no field.
                blocks.append({key: value for key, value in block.items() if value is not None})
    is_error = result.get("isError", False)
    if not isinstance(is_error, bool):
        problems.append("isError is not a boolean")
    structured = result.get("structuredContent")
    if structured is not None and not isinstance(structured, dict):
        problems.append("structuredContent is not an object")
    if problems:
        raise ServerError(_off_mcp(problems))
    return RemoteResult(content=blocks, structured=structured, is_error=is_error)


def _block_problem(block: object) -> str | None:
    if not isinstance(block, dict):
        return "not an object"
    kind = block.get("type")
    fields = CONTENT_FIELDS.get(kind) if isinstance(kind, str) else None
    if fields is None:
        return f"type {str(kind)[:40]!r} is not one of MCP's ({', '.join(CONTENT_FIELDS)})"
    for field in fields:
        if not isinstance(block.get(field), str):
            return f"a {kind} block needs {field} as a string"
    if kind == "resource":
        resource = block.get("resource")
        if not (
            isinstance(resource, dict)
            and isinstance(resource.get("uri"), str)
            and (isinstance(resource.get("text"), str) or isinstance(resource.get("blob"), str))
        ):
            return "a resource block needs a resource with a uri and a text or blob"
    return None


def _tool_problem(entry: object) -> str | None:
    if not isinstance(entry, dict):
        return "not an object"
    if not isinstance(entry.get("name"), str):
        return "a tool needs a name as a string"
    if not isinstance(entry.get("inputSchema"), dict):
        return "a tool needs an inputSchema object"
    for field in ("description", "title"):
        if not isinstance(entry.get(field), str | None):
            return f"a tool's {field} is not a string"
    if not isinstance(entry.get("outputSchema"), dict | None):
        return "a tool's outputSchema is not an object"
    return None


def _deeper_than(value: object, limit: int) -> bool:
    """Whether decoded JSON nests deeper than ``limit`` (without recursion)."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(item, dict):
            stack.extend(
                (child, depth + 1) for child in item.values() if isinstance(child, dict | list)
            )
        elif isinstance(item, list):
            stack.extend((child, depth + 1) for child in item if isinstance(child, dict | list))
    return False


@asynccontextmanager
async def open_session(
    to_server: trio.abc.SendStream, from_server: trio.abc.ReceiveStream, *, name: str
) -> AsyncIterator[McpSession]:
    """A session over the server's stdin (``to_server``) and stdout (``from_server``),
    not yet initialized. Leaving it stops the session's reader; the streams are the
    caller's to close.

    Resource handling: one task (the bounded reader) in a nursery of this context."""
    session = _StdioSession(to_server, name)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(session._read, from_server)
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
    holder: list[_SdkSession] = []

    async def on_message(message: Any) -> None:
        if not holder:
            return
        if isinstance(message, types.ToolListChangedNotification):
            holder[0]._tools_changed()
        elif isinstance(message, Exception) and fail_on_transport_error:
            # The HTTP transport reports a broken connection as a message.
            holder[0].fail(f"MCP server {name!r}: {message}")

    client = _BoundedClientSession(
        read, write, message_handler=on_message, client_info=CLIENT_INFO_SDK
    )
    async with client:
        session = _SdkSession(client, name)
        holder.append(session)
        yield session


class _SdkSession(McpSession):
    """A session driven by the SDK's ``ClientSession`` (remote servers)."""

    def __init__(self, session: ClientSession, name: str) -> None:
        super().__init__(name)
        self._session = session

    async def initialize(self) -> None:
        result = await self._request(self._session.initialize())
        self.protocol_version = result.protocol_version

    async def _list_page(self, cursor: str | None) -> tuple[list[RemoteTool], str | None]:
        params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
        page = await self._request(self._session.list_tools(params=params))
        return [_remote_tool(tool) for tool in page.tools], page.next_cursor

    async def call(
        self, tool: str, arguments: Mapping[str, Any], timeout_s: float = math.inf
    ) -> RemoteResult:
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
        raise self._timed_out(timeout_s)

    async def ping(self) -> None:
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


def _remote_tool(tool: types.Tool) -> RemoteTool:
    return RemoteTool(
        name=tool.name,
        description=tool.description or "",
        input_schema=dict(tool.input_schema),
        title=tool.title,
    )
