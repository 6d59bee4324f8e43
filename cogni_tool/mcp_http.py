"""MCP's streamable HTTP transport at ``/mcp`` of ``cogni-tool serve``'s loopback listener.

The same sessions as ``cogni-tool mcp`` (:class:`cogni_tool.mcp_server.McpSession`:
initialize, tools/list with pagination, tools/call, cancellation, progress), framed as
the streamable HTTP transport frames them (MCP 2025-03-26 and later):

* ``POST /mcp`` carries one JSON-RPC message (or, in 2025-03-26, a batch). A body with
  requests is answered on the same response: ``application/json`` (the answer alone),
  or ``text/event-stream`` (the progress notifications of its calls, then the answer)
  when the client accepts it and asked for progress, or accepts nothing else. A body of
  notifications or responses only is answered ``202 Accepted``.
* ``initialize`` (without ``Mcp-Session-Id``) opens a session; its answer carries the
  session's ``Mcp-Session-Id``, which every later request must carry. An unknown id is
  ``404`` (the client then initializes again, as MCP says). ``DELETE /mcp`` ends one.
* ``MCP-Protocol-Version``, when sent, must be the session's negotiated version; without
  it the negotiated version applies (MCP: a server that knows the version from the
  handshake uses it).
* ``GET /mcp`` is ``405``: this server sends nothing unasked (no server-initiated
  requests or notifications), so it offers no stream of its own.
* ``Origin`` and ``Host`` must be loopback (DNS-rebinding protection, which MCP requires
  of servers on localhost): a web page elsewhere whose name a resolver points at
  127.0.0.1 is refused.

Written with the standard library (``http.server``, run by :mod:`cogni_tool.serve`), not
with the official SDK's server: cogni-tool runs on any bare ``python3`` in any sandbox
image, and the SDK's server brings starlette, anyio and pydantic. Conformance is checked
by the official Python and TypeScript SDK clients (tests/integration).

Trust: every process that can reach the listener is the run's own, so a session id is a
handle, not a secret between mutually distrusting clients; it is random all the same
(MCP asks for that), and every call still passes the gateway's checks.
"""

from __future__ import annotations

import collections
import json
import queue
import secrets
import threading
from urllib.parse import urlsplit

from cogni_tool import mcp_protocol as mcp
from cogni_tool.mcp_server import MAX_LINE_BYTES, ClientPool, McpSession

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from email.message import Message
    from typing import Any, Final

    from cogni_tool.mcp_protocol import Json
    from cogni_tool.mcp_server import GatewayClient

MCP_PATH: Final = "/mcp"
SESSION_HEADER: Final = "Mcp-Session-Id"
VERSION_HEADER: Final = "MCP-Protocol-Version"
ALLOWED: Final = "POST, DELETE"

# Sessions open at once. A client that exits without DELETE leaves its session behind;
# past this many, the least recently used idle one is ended (its client, if it comes
# back, gets 404 and initializes again, as MCP says) so forgotten sessions cannot pile up.
MAX_SESSIONS: Final = 64

# POSTs waiting for their answers at once, over all sessions: each holds a thread of the
# HTTP server. Calls at the gateway are bounded separately by the shared ClientPool.
MAX_OPEN_POSTS: Final = 64

# One POST body: one message, as one line of the stdio transport may be.
MAX_BODY_BYTES: Final = MAX_LINE_BYTES

# Random bytes of a session id (urlsafe base64: visible ASCII only, as MCP requires).
SESSION_ID_BYTES: Final = 24

# Where a browser page on this sandbox's own loopback may come from; any other Origin or
# Host is a page elsewhere that a resolver pointed here.
LOOPBACK_NAMES: Final = frozenset({"127.0.0.1", "localhost", "::1"})


class HttpAnswer:
    """What to write back: a status, headers, and a body or a stream of SSE events.

    ``close``: the connection must not be reused (its request body was left unread).
    """

    __slots__ = ("body", "close", "events", "headers", "status")

    def __init__(
        self,
        status: int,
        body: bytes = b"",
        *,
        headers: dict[str, str] | None = None,
        events: _Events | None = None,
        close: bool = False,
    ) -> None:
        self.status = status
        self.body = body
        self.headers = {} if headers is None else headers
        self.events = events
        self.close = close

    @property
    def content_type(self) -> str | None:
        if self.events is not None:
            return "text/event-stream"
        return "application/json" if self.body else None


def rpc_error(status: int, code: int, message: str, *, close: bool = False) -> HttpAnswer:
    """An HTTP error whose body is a JSON-RPC error (id null), saying what to do."""
    body = json.dumps(mcp.error_response(None, code, message)).encode()
    return HttpAnswer(status, body, close=close)


def sse_event(message: Any) -> bytes:
    """One SSE ``message`` event holding one JSON-RPC message (or a batch's array)."""
    return b"event: message\ndata: " + mcp.encode_message(message) + b"\n"


def accepts(header: str | None) -> tuple[bool, bool]:
    """Whether an Accept header allows JSON and SSE answers (no header: anything)."""
    if header is None:
        return True, True
    types = {part.split(";", 1)[0].strip().lower() for part in header.split(",")}
    anything = "*/*" in types
    json_ok = anything or bool(types & {"application/json", "application/*"})
    sse_ok = anything or bool(types & {"text/event-stream", "text/*"})
    return json_ok, sse_ok


def loopback_origin(origin: str) -> bool:
    """Whether an Origin header names a page on this machine's loopback."""
    try:
        parts = urlsplit(origin)
        host = parts.hostname
        parts.port  # noqa: B018  # raises ValueError for a port that is no number
    except ValueError:
        return False
    return (
        parts.scheme in ("http", "https")
        and host in LOOPBACK_NAMES
        and not parts.username
        and parts.path in ("", "/")
    )


def loopback_host(host: str, port: int | None) -> bool:
    """Whether a Host header names this listener (a loopback name, its port if any)."""
    parts = urlsplit("//" + host)
    try:
        named_port = parts.port
    except ValueError:
        return False
    return (
        parts.hostname in LOOPBACK_NAMES
        and not parts.username
        and (named_port is None or port is None or named_port == port)
    )


def _has_request(obj: Any) -> bool:
    items = obj if isinstance(obj, list) else [obj]
    return any(isinstance(m, dict) and "method" in m and "id" in m for m in items)


def _wants_progress(obj: Any) -> bool:
    items = obj if isinstance(obj, list) else [obj]
    return any(
        isinstance(m, dict)
        and isinstance(m.get("params"), dict)
        and mcp.progress_token(m["params"]) is not None
        for m in items
    )


class _Events:
    """A POST's SSE events, giving its slot back once: when they end, or when the writer
    closes them (the client went away, or the headers could not be written)."""

    def __init__(self, events: Iterator[bytes], slot: threading.BoundedSemaphore) -> None:
        self._events = events
        self._slot: threading.BoundedSemaphore | None = slot

    def __iter__(self) -> Iterator[bytes]:
        return self

    def __next__(self) -> bytes:
        try:
            return next(self._events)
        except StopIteration:
            self.close()
            raise

    def close(self) -> None:
        slot, self._slot = self._slot, None
        if slot is not None:
            slot.release()


class _Exchange:
    """One POST's answers as they come from the session's threads."""

    def __init__(self) -> None:
        self.messages: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()

    def notify(self, message: Json) -> None:
        self.messages.put((False, message))

    def reply(self, answer: Any) -> None:
        self.messages.put((True, answer))

    def answer(self) -> Any:
        """Wait for the answer; notifications before it are dropped (a JSON answer has
        no room for them)."""
        while True:
            final, message = self.messages.get()
            if final:
                return message

    def stream(self) -> Iterator[bytes]:
        while True:
            final, message = self.messages.get()
            if message is not None:
                yield sse_event(message)
            if final:
                return


class McpHttpEndpoint:
    """``/mcp`` of one listener: its sessions, sharing one pool of gateway connections.

    ``connect`` makes a gateway connection; ``port`` is the listener's (for the Host
    check). :meth:`handle` is called by the HTTP server's threads, several at once.

    Error handling: whatever a client sends is answered with an HTTP status and a JSON
    body saying what was wrong (a JSON-RPC error, id null, for transport-level refusals);
    a JSON-RPC message's own errors are answered by the session, as over stdio.
    """

    def __init__(
        self,
        connect: Callable[[], GatewayClient],
        *,
        port: int | None = None,
        max_sessions: int = MAX_SESSIONS,
        max_posts: int = MAX_OPEN_POSTS,
        max_body: int = MAX_BODY_BYTES,
    ) -> None:
        self._pool = ClientPool(connect)
        self._port = port
        self._max_sessions = max_sessions
        self._max_body = max_body
        self._posts = threading.BoundedSemaphore(max_posts)
        self._max_posts = max_posts
        self._lock = threading.Lock()
        self._sessions: collections.OrderedDict[str, McpSession] = collections.OrderedDict()

    def handle(self, method: str, headers: Message, read: Callable[[int], bytes]) -> HttpAnswer:
        """Answer one request to ``/mcp``; ``read(n)`` reads its body, only as far as used."""
        refused = self._check_sender(headers)
        if refused is not None:
            return refused
        if method == "POST":
            return self._post(headers, read)
        if method == "DELETE":
            return self._delete(headers)
        answer = rpc_error(
            405,
            mcp.INVALID_REQUEST,
            f"{method} {MCP_PATH} is not offered: this server sends nothing unasked, so it "
            "has no stream to GET; POST requests (their answers come on the POST's "
            "response) and DELETE to end a session",
            close=method not in ("GET", "HEAD"),
        )
        answer.headers["Allow"] = ALLOWED
        return answer

    def close(self) -> None:
        """End every session and close the gateway connections."""
        with self._lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
        for session in sessions:
            session.close()
        self._pool.close()

    # -- checks --

    def _check_sender(self, headers: Message) -> HttpAnswer | None:
        origin = headers.get("Origin")
        if origin is not None and not loopback_origin(origin):
            return rpc_error(
                403,
                mcp.INVALID_REQUEST,
                f"Origin {origin!r} is refused: only pages on this sandbox's loopback "
                "(http://127.0.0.1, http://localhost, http://[::1]) may use this server "
                "(protection against DNS rebinding); a client that is not a browser sends "
                "no Origin",
                close=True,
            )
        host = headers.get("Host")
        if host is not None and not loopback_host(host, self._port):
            return rpc_error(
                421,
                mcp.INVALID_REQUEST,
                f"Host {host!r} is refused: this server answers only as 127.0.0.1, "
                f"localhost or [::1]{'' if self._port is None else f' on port {self._port}'} "
                "(protection against DNS rebinding)",
                close=True,
            )
        return None

    def _read_body(self, headers: Message, read: Callable[[int], bytes]) -> Any:
        """The POST's JSON value, or the HttpAnswer refusing it."""
        if headers.get("Transfer-Encoding"):
            return rpc_error(
                411,
                mcp.INVALID_REQUEST,
                "send the body with a Content-Length (chunked transfer is not read here)",
                close=True,
            )
        kind = (headers.get("Content-Type") or "").split(";", 1)[0].strip().lower()
        if kind != "application/json":
            return rpc_error(
                415,
                mcp.INVALID_REQUEST,
                f"Content-Type {kind or 'none'!r} is refused: POST one JSON-RPC message as "
                "application/json",
                close=True,
            )
        try:
            length = int(headers.get("Content-Length") or "-1")
        except ValueError:
            length = -1
        if not 0 <= length <= self._max_body:
            return rpc_error(
                413,
                mcp.INVALID_REQUEST,
                f"the body must come with a Content-Length of at most {self._max_body} "
                f"bytes (one JSON-RPC message); got {headers.get('Content-Length')!r}",
                close=True,
            )
        raw = read(length)
        try:
            return mcp.decode_line(raw)
        except mcp.RpcError as exc:
            return rpc_error(400, exc.code, str(exc).replace("the line", "the body"))

    def _session(self, headers: Message, missing: str) -> McpSession | HttpAnswer:
        session_id = headers.get(SESSION_HEADER)
        with self._lock:
            session = self._sessions.get(session_id) if session_id is not None else None
            if session is not None:
                self._sessions.move_to_end(session_id)  # type: ignore[arg-type]  # not None
                return session
        if session_id is None:
            return rpc_error(
                400,
                mcp.INVALID_REQUEST,
                f"no {SESSION_HEADER} header: {missing}",
            )
        return rpc_error(
            404,
            mcp.INVALID_REQUEST,
            f"session {session_id!r} is not open here (ended by DELETE, ended for a newer "
            f"one past {self._max_sessions} open sessions, or cogni-tool serve restarted); "
            f"initialize again without {SESSION_HEADER}",
        )

    def _check_version(self, headers: Message, session: McpSession) -> HttpAnswer | None:
        sent = headers.get(VERSION_HEADER)
        if sent is None or sent == session.version:
            return None  # without the header, the version negotiated at initialize holds
        if sent not in mcp.SUPPORTED_VERSIONS:
            why = f"is not a version this server speaks ({', '.join(mcp.SUPPORTED_VERSIONS)})"
        else:
            why = f"is not this session's: it negotiated {session.version} at initialize"
        return rpc_error(
            400,
            mcp.INVALID_REQUEST,
            f"{VERSION_HEADER} {sent!r} {why}; send {session.version!r} or no header",
        )

    # -- methods --

    def _post(self, headers: Message, read: Callable[[int], bytes]) -> HttpAnswer:
        json_ok, sse_ok = accepts(headers.get("Accept"))
        if not (json_ok or sse_ok):
            return rpc_error(
                406,
                mcp.INVALID_REQUEST,
                f"Accept {headers.get('Accept')!r} allows neither application/json nor "
                "text/event-stream, the two ways this server answers",
                close=True,
            )
        obj = self._read_body(headers, read)
        if isinstance(obj, HttpAnswer):
            return obj
        opening = isinstance(obj, dict) and obj.get("method") == "initialize"
        if opening and headers.get(SESSION_HEADER) is None:
            return self._initialize(obj)
        found = self._session(
            headers,
            "send initialize first (without the header); every later request carries the "
            "session id its answer gave",
        )
        if isinstance(found, HttpAnswer):
            if isinstance(obj, dict) and isinstance(obj.get("method"), str):
                method = obj["method"]
                if method not in mcp.METHODS and "id" in obj:
                    # A probe for a method this server lacks (the SDKs try server/discover
                    # first): say so, and the client falls back to initialize.
                    found.body = json.dumps(
                        mcp.method_not_found(mcp.Request(obj["id"], method, {})).to_response()
                    ).encode()
            return found
        refused = self._check_version(headers, found)
        if refused is not None:
            return refused
        return self._exchange(found, obj, json_ok, sse_ok)

    def _initialize(self, obj: Any) -> HttpAnswer:
        session = McpSession(_unused_connect, _unused_write, pool=self._pool)
        exchange = _Exchange()
        session.receive(obj, exchange.reply, exchange.notify)
        answer = exchange.answer()  # initialize is answered at once, by the session itself
        body = json.dumps(answer).encode()
        if session.version is None:  # refused (bad params): no session is opened
            return HttpAnswer(200, body)
        session_id = secrets.token_urlsafe(SESSION_ID_BYTES)
        with self._lock:
            if len(self._sessions) >= self._max_sessions and not self._evict():
                return rpc_error(
                    503,
                    mcp.INTERNAL_ERROR,
                    f"all {self._max_sessions} sessions this server holds are answering "
                    f"requests; end one with DELETE {MCP_PATH}, or retry when they are done",
                )
            self._sessions[session_id] = session
        return HttpAnswer(200, body, headers={SESSION_HEADER: session_id})

    def _evict(self) -> bool:
        """End the least recently used idle session (the lock held); False if none is."""
        for session_id, session in self._sessions.items():
            if not session.busy:
                del self._sessions[session_id]
                session.close()
                return True
        return False

    def _exchange(self, session: McpSession, obj: Any, json_ok: bool, sse_ok: bool) -> HttpAnswer:
        if not _has_request(obj):
            # Notifications and responses: nothing to answer unless they are malformed.
            exchange = _Exchange()
            session.receive(obj, exchange.reply, exchange.notify)
            refused = exchange.answer()
            if refused is None:
                return HttpAnswer(202)
            return HttpAnswer(400, json.dumps(refused).encode())
        if not self._posts.acquire(blocking=False):
            return rpc_error(
                503,
                mcp.INTERNAL_ERROR,
                f"{self._max_posts} requests are already waiting for answers here (this "
                "server's limit); wait for some answers first",
            )
        exchange = _Exchange()
        try:
            session.receive(obj, exchange.reply, exchange.notify)
        except BaseException:
            self._posts.release()
            raise
        if sse_ok and (_wants_progress(obj) or not json_ok):
            return HttpAnswer(200, events=_Events(exchange.stream(), self._posts))
        try:
            answer = exchange.answer()
        finally:
            self._posts.release()
        if answer is None:  # cancelled by the client meanwhile: nothing to answer
            return HttpAnswer(202)
        return HttpAnswer(200, json.dumps(answer).encode())

    def _delete(self, headers: Message) -> HttpAnswer:
        found = self._session(headers, f"DELETE {MCP_PATH} ends the session it names")
        if isinstance(found, HttpAnswer):
            return found
        session_id = headers.get(SESSION_HEADER)
        with self._lock:
            self._sessions.pop(session_id, None)  # type: ignore[arg-type]  # found: not None
        # Calls still running finish and answer their POSTs; the pool is shared, and stays.
        found.close()
        return HttpAnswer(204)


def _unused_connect() -> GatewayClient:
    raise AssertionError("an HTTP session takes its connections from the endpoint's pool")


def _unused_write(data: bytes) -> None:
    """Never called: the HTTP transport hands each message's answers to its own POST
    (:meth:`McpSession.receive`); there is no session-wide stream to write to."""
