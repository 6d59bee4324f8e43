"""A fake OpenAI-compatible model provider on loopback, for tests that drive litellm.

It is a real HTTP server (standard library ``ThreadingHTTPServer``) on 127.0.0.1 and an
ephemeral port, serving in a background thread so sync and trio tests can both use it.
It speaks just enough of the OpenAI API for litellm's ``openai/<model>`` route:

* ``POST /v1/chat/completions``: non-streaming, and ``"stream": true`` as SSE chunks
  ending with ``data: [DONE]``;
* ``GET /v1/models``;
* the chat routes of litellm's own handler for other providers (:data:`OTHER_CHAT_ROUTES`:
  Anthropic's ``.../messages``, Ollama's ``.../api/chat``), answered with the same scripted
  replies; a :class:`Text` there is still OpenAI-shaped, so they serve tests of replies
  that fail (:class:`HttpError`, :class:`Malformed`, :class:`Drop`, :class:`Huge`).

Each chat request is answered by the next scripted reply (:meth:`FakeProvider.script`),
or when none is queued by :attr:`FakeProvider.respond` (default: the text ``"ok"``). A
reply is one of :class:`Text`, :class:`HttpError`, :class:`Malformed`, :class:`Drop`,
:class:`Huge`, each with an optional delay before it is sent. Every request is recorded
(method, path, headers, decoded JSON body) in :attr:`FakeProvider.requests`, and how much
of each :class:`Huge` reply went out in :attr:`FakeProvider.huge_sent`.

Use it as ``with FakeProvider() as fake:`` or through the ``fake_provider`` fixture.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Final, Literal

import pytest

# How long close() waits for the serving thread; delayed replies are cut short by then.
SHUTDOWN_TIMEOUT_S: Final = 5.0
# A request body above this is a test bug, not a prompt.
MAX_BODY_BYTES: Final = 16 << 20
# Streamed text goes out in chunks of this many characters, so clients see several deltas.
STREAM_CHUNK_CHARS: Final = 4
# A trickling (gap_s) non-streaming answer goes out this many bytes at a time.
TRICKLE_PIECE_BYTES: Final = 16
# serve_forever notices shutdown() at this period: it bounds close(), paid by every test.
POLL_INTERVAL_S: Final = 0.01
# A Huge reply is made and sent this many bytes at a time: never whole in the fake's memory.
HUGE_PIECE_BYTES: Final = 1 << 20
# Where litellm's own handler posts a chat for providers other than OpenAI's: Anthropic
# (``anthropic/``) and Ollama (``ollama_chat/``), below whatever api_base says.
OTHER_CHAT_ROUTES: Final = ("/messages", "/api/chat")


@dataclass(frozen=True, kw_only=True)
class Call:
    """One function call in an answer (what a model asks the agent loop to run)."""

    name: str
    arguments: Mapping[str, Any] | str  # a str goes out as written (invalid JSON too)
    id: str = ""  # "" numbers it: call_<n> within its answer


@dataclass(frozen=True, kw_only=True)
class Text:
    """A normal answer: ``content`` with usage counts (``usage=False`` leaves usage out);
    with ``calls``, an answer asking for function calls (finish_reason tool_calls)."""

    content: str | None
    calls: tuple[Call, ...] = ()
    prompt_tokens: int = 11
    completion_tokens: int = 7
    usage: bool = True
    model: str | None = None  # reported model; None echoes the requested one
    delay_s: float = 0.0
    gap_s: float = 0.0  # pause between pieces of the body: a slow, trickling answer


@dataclass(frozen=True, kw_only=True)
class HttpError:
    """An HTTP error status with an OpenAI-style ``{"error": {...}}`` body."""

    status: int
    message: str = "fake provider error"
    type: str = "invalid_request_error"
    code: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    delay_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Malformed:
    """A body that is not what the client expects (by default: not JSON at all)."""

    body: bytes = b"{this is not json"
    status: int = 200
    content_type: str = "application/json"
    headers: Mapping[str, str] = field(default_factory=dict)  # e.g. a Content-Encoding
    delay_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Drop:
    """Read the request, then close the connection without a response."""

    delay_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Huge:
    """A chat completion of exactly ``size`` bytes, made and sent a piece at a time:
    its text is ``lead`` then ``pad`` (one byte JSON needs no escape for) repeated to fill
    it, e.g. ``lead="ALLOW", pad=b" "`` for a verdict padded with whitespace.

    Framing: ``"length"`` (a Content-Length), ``"chunked"`` (HTTP/1.1 chunked transfer
    coding: no length up front) or ``"close"`` (no length: the body ends when the
    connection closes). ``gzip``: sent with ``Content-Encoding: gzip`` (``size`` is the
    inflated size; on the wire it is about a thousandth of that), whatever the client
    asked for. ``status`` other than 200 makes it an error reply of that size.
    """

    size: int
    framing: Literal["length", "chunked", "close"] = "length"
    gzip: bool = False
    status: int = 200
    lead: str = ""
    pad: bytes = b"x"
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if len(self.pad) != 1 or not 0x20 <= self.pad[0] < 0x7F or self.pad in b'"\\':
            raise ValueError('pad must be one printable ASCII byte other than " and \\')
        if json.dumps(self.lead)[1:-1] != self.lead:
            raise ValueError("lead must be text JSON needs no escape for")

    def text(self, model: str) -> str:
        """The answer's text (``model``: the one the request named, echoed in the reply)."""
        prefix, suffix = _huge_frame(model)
        count = self.size - len(prefix) - len(suffix) - len(self.lead.encode())
        return self.lead + self.pad.decode() * count


@dataclass(frozen=True, kw_only=True)
class HugeSent:
    """What went out of one :class:`Huge` reply: the body's bytes on the wire, and whether
    all of them did (False: the client closed the connection before the end)."""

    wire_bytes: int
    finished: bool


Reply = Text | HttpError | Malformed | Drop | Huge


@dataclass(frozen=True, kw_only=True)
class RecordedRequest:
    """One request as the fake saw it; header names are lower-cased."""

    method: str
    path: str
    headers: Mapping[str, str]
    body: Any  # the decoded JSON, or None when the body was empty or not JSON

    @property
    def authorization(self) -> str | None:
        return self.headers.get("authorization")


def _ok(_request: Mapping[str, Any]) -> Reply:
    return Text(content="ok")


class FakeProvider:
    """The server; a context manager that starts it and shuts it down."""

    def __init__(self) -> None:
        self.respond: Callable[[Mapping[str, Any]], Reply] = _ok
        self._queue: collections.deque[Reply] = collections.deque()
        self._requests: list[RecordedRequest] = []
        self._huge_sent: list[HugeSent] = []
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._server = _Server(("127.0.0.1", 0), _Handler, self)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            args=(POLL_INTERVAL_S,),
            name="fake-provider",
            daemon=True,
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def api_base(self) -> str:
        """What a ModelAlias's ``api_base`` should be to reach this fake."""
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def requests(self) -> list[RecordedRequest]:
        """A snapshot of every request so far, oldest first."""
        with self._lock:
            return list(self._requests)

    @property
    def huge_sent(self) -> list[HugeSent]:
        """One entry per :class:`Huge` reply whose sending has ended, oldest first."""
        with self._lock:
            return list(self._huge_sent)

    def wait_huge_sent(
        self, count: int = 1, timeout_s: float = SHUTDOWN_TIMEOUT_S
    ) -> list[HugeSent]:
        """:attr:`huge_sent` once it holds ``count`` entries (the handler thread records
        one when its writes end, which may be just after the client gave up)."""
        deadline = time.monotonic() + timeout_s
        while len(sent := self.huge_sent) < count and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL_S)
        return sent

    @property
    def chat_requests(self) -> list[RecordedRequest]:
        return [r for r in self.requests if r.path.endswith("/chat/completions")]

    def script(self, *replies: Reply) -> None:
        """Queue replies for the next chat requests, in order."""
        with self._lock:
            self._queue.extend(replies)

    def reset(self) -> None:
        """Forget queued replies, recorded requests and a custom ``respond``."""
        with self._lock:
            self._queue.clear()
            self._requests.clear()
            self._huge_sent.clear()
            self.respond = _ok

    def __enter__(self) -> FakeProvider:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop serving: delayed replies end at once, then the listener closes."""
        self._closing.set()
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(SHUTDOWN_TIMEOUT_S)
        self._server.server_close()

    # --- used by the handler thread ------------------------------------------------

    def _record(self, request: RecordedRequest) -> None:
        with self._lock:
            self._requests.append(request)

    def _record_huge(self, sent: HugeSent) -> None:
        with self._lock:
            self._huge_sent.append(sent)

    def _next_reply(self, body: Mapping[str, Any]) -> Reply:
        with self._lock:
            if self._queue:
                return self._queue.popleft()
            respond = self.respond
        try:
            return respond(body)
        except Exception as exc:  # a test's respond() bug: make it visible to the client
            return HttpError(status=500, message=f"fake provider: respond() raised {exc!r}")

    def _sleep(self, seconds: float) -> bool:
        """Wait ``seconds``; False if the fake is closing meanwhile."""
        return not self._closing.wait(seconds) if seconds > 0 else True


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a handler stuck in a delay must not keep the process alive

    def __init__(
        self, address: tuple[str, int], handler: type[_Handler], fake: FakeProvider
    ) -> None:
        self.fake = fake
        super().__init__(address, handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return  # the client hung up (a timeout, a cancelled call): expected in tests
        super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    # HTTP/1.0: one request per connection, so a dropped or delayed reply never
    # touches a pooled connection another call would reuse.
    protocol_version = "HTTP/1.0"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep test output clean

    def _read_body(self) -> Any:
        length = min(int(self.headers.get("content-length") or 0), MAX_BODY_BYTES)
        raw = self.rfile.read(length) if length else b""
        try:
            return json.loads(raw) if raw else None
        except ValueError:
            return None

    def _record(self, body: Any) -> None:
        headers = {k.lower(): v for k, v in self.headers.items()}
        self.server.fake._record(
            RecordedRequest(method=self.command, path=self.path, headers=headers, body=body)
        )

    def _send(
        self,
        status: int,
        body: bytes,
        content_type: str = "application/json",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._record(None)
        if self.path.rstrip("/") == "/v1/models":
            models = {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}
            self._send(200, json.dumps(models).encode())
        else:
            self._send(404, _error_body(f"no route GET {self.path}", "not_found", None))

    def do_POST(self) -> None:
        body = self._read_body()
        self._record(body)
        if not self.path.rstrip("/").endswith(("/chat/completions", *OTHER_CHAT_ROUTES)):
            self._send(404, _error_body(f"no route POST {self.path}", "not_found", None))
            return
        if not isinstance(body, dict):
            self._send(400, _error_body("request body is not a JSON object", "bad_json", None))
            return
        fake = self.server.fake
        reply = fake._next_reply(body)
        if not fake._sleep(reply.delay_s):
            return
        match reply:
            case Drop():
                self.close_connection = True  # the handler closes without a status line
            case Malformed(body=raw, status=status, content_type=content_type):
                self._send(status, raw, content_type, reply.headers)
            case HttpError():
                self.send_response(reply.status)
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                payload = _error_body(reply.message, reply.type, reply.code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
            case Huge():
                self._huge(body, reply)
            case Text() if body.get("stream"):
                self._stream(body, reply)
            case Text():
                payload = json.dumps(_completion(body, reply)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                step = TRICKLE_PIECE_BYTES if reply.gap_s else len(payload)
                for start in range(0, len(payload), step):
                    if start and not fake._sleep(reply.gap_s):
                        return
                    self.wfile.write(payload[start : start + step])
                    self.wfile.flush()

    def _huge(self, request: Mapping[str, Any], reply: Huge) -> None:
        pieces = _huge_pieces(reply, str(request.get("model", "fake-model")))
        if reply.gzip:
            pieces = _gzipped(pieces)
        if reply.framing == "length":
            body = b"".join(pieces) if reply.gzip else None  # a gzip body is small
            length = len(body) if body is not None else reply.size
            pieces = iter([body]) if body is not None else pieces
        if reply.framing == "chunked":
            self.protocol_version = "HTTP/1.1"  # chunked needs it; this reply only
        self.send_response(reply.status)
        self.send_header("Content-Type", "application/json")
        if reply.gzip:
            self.send_header("Content-Encoding", "gzip")
        if reply.framing == "length":
            self.send_header("Content-Length", str(length))
        elif reply.framing == "chunked":
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        sent = 0
        try:
            for piece in pieces:
                if not piece:
                    continue  # an empty chunk would end a chunked body
                if reply.framing == "chunked":
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                else:
                    self.wfile.write(piece)
                sent += len(piece)
            if reply.framing == "chunked":
                self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except ConnectionError:  # the client stopped reading and closed: what caps do
            self.server.fake._record_huge(HugeSent(wire_bytes=sent, finished=False))
            return
        self.server.fake._record_huge(HugeSent(wire_bytes=sent, finished=True))

    def _stream(self, request: Mapping[str, Any], reply: Text) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()  # HTTP/1.0 without a length: the body ends when we close
        for n, chunk in enumerate(_chunks(request, reply)):
            if n and not self.server.fake._sleep(reply.gap_s):
                return
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")


def _error_body(message: str, type_: str, code: str | None) -> bytes:
    error = {"message": message, "type": type_, "param": None, "code": code}
    return json.dumps({"error": error}).encode()


def _usage(reply: Text) -> dict[str, int]:
    return {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
    }


def _completion(request: Mapping[str, Any], reply: Text) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.calls:
        message["tool_calls"] = [
            {
                "id": call.id or f"call_{n}",
                "type": "function",
                "function": {
                    "name": call.name,
                    "arguments": call.arguments
                    if isinstance(call.arguments, str)
                    else json.dumps(call.arguments),
                },
            }
            for n, call in enumerate(reply.calls)
        ]
    answer: dict[str, Any] = {
        "id": "chatcmpl-fake",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": reply.model or request.get("model", "fake-model"),
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": "tool_calls" if reply.calls else "stop",
            }
        ],
    }
    if reply.usage:
        answer["usage"] = _usage(reply)
    return answer


def _huge_frame(model: str) -> tuple[bytes, bytes]:
    """The completion's JSON before and after its text."""
    answer = _completion({"model": model}, Text(content="\x00"))
    before, after = json.dumps(answer).encode().split(b"\\u0000")
    return before, after


def _huge_pieces(reply: Huge, model: str) -> Iterator[bytes]:
    """The body, HUGE_PIECE_BYTES at a time."""
    prefix, suffix = _huge_frame(model)
    lead = reply.lead.encode()
    count = reply.size - len(prefix) - len(suffix) - len(lead)
    if count < 0:
        raise ValueError(f"a Huge reply needs at least {reply.size - count} bytes")
    yield prefix + lead
    for start in range(0, count, HUGE_PIECE_BYTES):
        yield reply.pad * min(HUGE_PIECE_BYTES, count - start)
    yield suffix


def _gzipped(pieces: Iterator[bytes]) -> Iterator[bytes]:
    gzip = zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS | 16)
    for piece in pieces:
        if out := gzip.compress(piece):
            yield out
    yield gzip.flush()


def _chunks(request: Mapping[str, Any], reply: Text) -> Iterator[dict[str, Any]]:
    base = {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": reply.model or request.get("model", "fake-model"),
    }
    text = reply.content or ""
    pieces = [text[i : i + STREAM_CHUNK_CHARS] for i in range(0, len(text), STREAM_CHUNK_CHARS)]
    for n, piece in enumerate(pieces or [""]):
        delta = {"role": "assistant", "content": piece} if n == 0 else {"content": piece}
        yield base | {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
    yield base | {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    options = request.get("stream_options") or {}
    if reply.usage and options.get("include_usage"):
        yield base | {"choices": [], "usage": _usage(reply)}


@pytest.fixture
def fake_provider() -> Iterator[FakeProvider]:
    """A started fake provider, closed after the test."""
    with FakeProvider() as fake:
        yield fake


@contextlib.contextmanager
def provider_with_key(env: str, key: str) -> Iterator[FakeProvider]:
    """A running FakeProvider, with ``key`` in this process's environment (gatewayd's,
    for in-process daemons) as ``env`` while it runs."""
    os.environ[env] = key
    try:
        with FakeProvider() as provider:
            yield provider
    finally:
        del os.environ[env]
