"""The cogni-tool client library: one persistent connection to the run's gateway socket.

Standard library only, and only modules that cost next to nothing to import: this file is
copied into sandbox images whose Python may be as old as 3.8 and is imported on every
``cogni-tool`` invocation, so its import time is the CLI's cold start. ``socket``,
``json``, ``struct`` and ``os`` are not imported: each pulls in pure-Python modules
(``enum``, ``re``, ``functools``, ``collections``, …) that together cost more than a
bare interpreter start. Their C halves do the same work: ``_socket`` for the connection,
:mod:`cogni_tool.json_codec` (``_json``) for JSON, ``int.to_bytes`` for the length prefix
and ``posix`` for the pid and the environment. Where a C module is missing (another
Python implementation), the public module stands in.

Wire format (the same as ``gatewayd/protocol.py``, re-implemented here because the
sandbox cannot import gatewayd): a frame is a 4-byte big-endian unsigned length and
that many bytes of UTF-8 JSON. A request is
``{"v":1,"runId":…,"toolCallId":…,"tool":…,"args":{…}}``; a response is
``{"v":1,"toolCallId":…,"ok":true,"value":…}`` or
``{"v":1,"toolCallId":…,"ok":false,"errorCode":…,"safeMessage":…}``. Responses carry
the toolCallId they answer and may come in any order; a response whose toolCallId is
null is about the connection itself (the server closes it afterwards).

Error handling: every failure is a :class:`CogniToolError`. Who caused it is in the
class — :class:`ClientError` (this process asked for something impossible; nothing was
sent), :class:`ConnectionFailed` (no gateway, or it went away), :class:`CallTimedOut`,
:class:`ProtocolError` (the gateway sent something this client cannot read) and
:class:`ToolError` (the gateway answered the call with an error code). ``code`` on each
names the failure and :data:`EXIT_CODES` maps it to the CLI's exit status.

Threads: a :class:`Client` is not thread-safe. Use one client per thread (each has its
own connection) or guard a shared one with a lock.
"""

from __future__ import annotations

import sys
import time

from cogni_tool.json_codec import decode as _decode_json
from cogni_tool.json_codec import encode as _encode_json

try:
    import _socket
except ImportError:  # a Python without the C socket module (tested by blocking it)
    import socket as _socket  # type: ignore[no-redef]

try:
    from posix import getpid as _getpid  # the C half of os, which costs 1.8 ms to import
except ImportError:  # pragma: no cover - not a POSIX system
    from os import getpid as _getpid

# Typing names are for mypy only: importing ``typing`` at run time costs cold-start time
# on every cogni-tool invocation. mypy treats any name ``TYPE_CHECKING`` as true.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any, Final

PROTOCOL_VERSION: Final = 1

SOCKET_ENV: Final = "COGNI_GATEWAY_SOCK"
RUN_ID_ENV: Final = "COGNI_RUN_ID"

# The gateway's own default request limit (gatewayd.frame_limits.DEFAULT_MAX_FRAME_BYTES).
# Checking it here turns an oversize request into a clear local error instead of a
# server-side too_large that also closes the connection.
DEFAULT_MAX_FRAME_BYTES: Final = 1 << 20

# Responses may be much larger than requests (a file page, a model answer), but a length
# prefix beyond this is a broken or hostile stream, not a reply: refuse it rather than
# try to allocate it.
MAX_RESPONSE_FRAME_BYTES: Final = 64 << 20

# Model and review calls can take tens of seconds; a minute bounds a hung gateway.
DEFAULT_TIMEOUT_SECONDS: Final = 60.0

# Longer timeouts overflow poll()'s and settimeout()'s clocks; None means "no limit".
MAX_TIMEOUT_SECONDS: Final = 7 * 24 * 3600.0

# The smallest frame limit that can still hold a request (the protocol's own floor).
MIN_MAX_FRAME_BYTES: Final = 64

# The frame's length prefix: 4 bytes, big-endian, unsigned.
_HEADER_BYTES: Final = 4

# One recv at most: large enough that big responses take few system calls.
_RECV_BYTES: Final = 256 * 1024

# How much of an unreadable frame to quote in a ProtocolError message.
_QUOTE_BYTES: Final = 80

# --- exit codes ------------------------------------------------------------------------

EXIT_OK: Final = 0
EXIT_USAGE: Final = 2
EXIT_NO_GATEWAY: Final = 3
EXIT_PROTOCOL: Final = 4
EXIT_UNKNOWN_ERROR_CODE: Final = 22

# The error codes the gateway sends (gatewayd.protocol.ErrorCode) and their exit codes.
WIRE_EXIT_CODES: Final = {
    "bad_request": 10,
    "too_large": 11,
    "run_mismatch": 12,
    "authz_denied": 13,
    "unknown_tool": 14,
    "policy_denied": 15,
    "invalid_args": 16,
    "review_denied": 17,
    "rate_limited": 18,
    "timeout": 19,
    "tool_failed": 20,
    "internal": 21,
    # Added after unknown_error_code (22): a number, once given, never changes.
    "confirmation_required": 23,
    "limit_exceeded": 24,
    "approval_denied": 25,
}

# Every ``code`` a CogniToolError can carry, and the CLI's exit status for it. Other
# programs depend on these numbers: only ever add to this table.
EXIT_CODES: Final = {
    "ok": EXIT_OK,
    "usage": EXIT_USAGE,
    "not_configured": EXIT_NO_GATEWAY,
    "connection_failed": EXIT_NO_GATEWAY,
    "protocol_error": EXIT_PROTOCOL,
    **WIRE_EXIT_CODES,
    "unknown_error_code": EXIT_UNKNOWN_ERROR_CODE,
}


def exit_code_for(error: CogniToolError) -> int:
    """The CLI exit status for ``error`` (22 for a wire error code this client does not know)."""
    if isinstance(error, ToolError):
        return WIRE_EXIT_CODES.get(error.code, EXIT_UNKNOWN_ERROR_CODE)
    return EXIT_CODES.get(error.code, EXIT_UNKNOWN_ERROR_CODE)


# --- exceptions ------------------------------------------------------------------------


class CogniToolError(Exception):
    """Base class of every cogni-tool failure. ``code`` names the failure."""

    code: str = "internal"

    @property
    def message(self) -> str:
        """The human sentence (``str(error)``)."""
        return str(self)


class ClientError(CogniToolError):
    """This process asked for something the client cannot do; nothing was sent."""

    code = "usage"


class NotConfigured(ClientError):
    """COGNI_GATEWAY_SOCK or COGNI_RUN_ID is missing: this is not inside a gatewayd run."""

    code = "not_configured"


class RequestTooLarge(ClientError):
    """A request frame would exceed the client's ``max_frame_bytes``; nothing was sent."""

    code = "too_large"


class ConnectionFailed(CogniToolError):
    """The gateway socket is missing, refuses connections or closed during a call."""

    code = "connection_failed"


class CallTimedOut(CogniToolError):
    """No answer within the client's timeout. The call may still run on the gateway."""

    code = "timeout"


class ProtocolError(CogniToolError):
    """The gateway sent bytes that are not a valid response frame."""

    code = "protocol_error"


class ToolError(CogniToolError):
    """The gateway answered a call with an error.

    ``code`` is the wire error code (e.g. ``policy_denied``), ``message`` the gateway's
    safe message, ``tool_call_id`` the call it answers (None for a connection-level error,
    which is given to every call that was waiting on that connection).
    """

    def __init__(self, code: str, message: str, tool_call_id: str | None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.safe_message = message
        self.tool_call_id = tool_call_id

    @property
    def message(self) -> str:
        """The gateway's safe message, without the code."""
        return self.safe_message

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.code, self.safe_message, self.tool_call_id))


# --- framing (pure: no sockets) --------------------------------------------------------


def encode_request(
    run_id: str, tool_call_id: str, tool: str, args: dict[str, Any], max_frame_bytes: int
) -> bytes:
    """One framed request, or :class:`ClientError` / :class:`RequestTooLarge`."""
    if not isinstance(tool, str):
        raise ClientError(f"tool must be a string such as 'fs.read', got {type(tool).__name__}")
    if not isinstance(args, dict):
        raise ClientError(
            f"args for {tool!r} must be a JSON object (a dict), got {type(args).__name__}"
        )
    request = {
        "v": PROTOCOL_VERSION,
        "runId": run_id,
        "toolCallId": tool_call_id,
        "tool": tool,
        "args": args,
    }
    try:
        body = _encode_json(request, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (TypeError, ValueError, RecursionError) as exc:
        # TypeError: not JSON (bytes, sets, objects); ValueError: NaN/Infinity, circular
        # references, or a lone surrogate that has no UTF-8 form; RecursionError: nested
        # deeper than Python's recursion limit.
        raise ClientError(
            f"args for {tool!r} cannot be sent as JSON: {exc}; use only objects, arrays, "
            "strings, finite numbers, true, false and null"
        ) from None
    if len(body) > max_frame_bytes:
        raise RequestTooLarge(
            f"the request for {tool!r} is {len(body)} bytes; this client sends at most "
            f"{max_frame_bytes} bytes per request (the gateway's frame limit), so nothing "
            "was sent: split the content into smaller calls"
        )
    return len(body).to_bytes(_HEADER_BYTES, "big") + body


class Reply:
    """One decoded response frame."""

    __slots__ = ("error_code", "ok", "safe_message", "tool_call_id", "value")

    def __init__(
        self,
        tool_call_id: str | None,
        ok: bool,
        value: Any = None,
        error_code: str = "",
        safe_message: str = "",
    ) -> None:
        self.tool_call_id = tool_call_id
        self.ok = ok
        self.value = value
        self.error_code = error_code
        self.safe_message = safe_message

    def to_error(self) -> ToolError:
        """The :class:`ToolError` this (failed) reply stands for."""
        return ToolError(self.error_code, self.safe_message, self.tool_call_id)


def _quote(body: bytes) -> str:
    snippet = body[:_QUOTE_BYTES]
    return repr(snippet) + ("..." if len(body) > _QUOTE_BYTES else "")


def decode_response(body: bytes) -> Reply:
    """Decode one response body, or raise :class:`ProtocolError` saying what was wrong."""
    try:
        obj = _decode_json(body.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ProtocolError(
            f"the gateway sent a frame that is not UTF-8 JSON ({exc}): {_quote(body)}"
        ) from None
    if not isinstance(obj, dict):
        raise ProtocolError(
            f"the gateway sent a JSON {type(obj).__name__} where a response object belongs: "
            f"{_quote(body)}"
        )
    version = obj.get("v")
    if version != PROTOCOL_VERSION or isinstance(version, bool):
        raise ProtocolError(
            f"the gateway answered with protocol version {version!r}; this cogni-tool "
            f"speaks v={PROTOCOL_VERSION} (update cogni-tool in the sandbox image)"
        )
    tool_call_id = obj.get("toolCallId")
    if tool_call_id is not None and not isinstance(tool_call_id, str):
        raise ProtocolError(f"the gateway sent a non-string toolCallId: {_quote(body)}")
    ok = obj.get("ok")
    if ok is True:
        # The gateway omits "value" when it is null.
        return Reply(tool_call_id, True, value=obj.get("value"))
    if ok is not False:
        raise ProtocolError(f"the gateway sent a response without a boolean 'ok': {_quote(body)}")
    code = obj.get("errorCode")
    message = obj.get("safeMessage")
    if not isinstance(code, str) or not code or not isinstance(message, str):
        raise ProtocolError(
            "the gateway sent an error response without a string errorCode and "
            f"safeMessage: {_quote(body)}"
        )
    return Reply(tool_call_id, False, error_code=code, safe_message=message)


class FrameReader:
    """Splits an inbound byte stream into frame bodies (pure; no sockets).

    :meth:`feed` bytes as they arrive and collect the complete bodies it returns. A length
    prefix over ``max_frame_bytes`` raises :class:`ProtocolError` as soon as the header is
    in, before any of the body is buffered.
    """

    def __init__(self, max_frame_bytes: int = MAX_RESPONSE_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()

    @property
    def buffered(self) -> int:
        """Bytes received that are not yet part of a complete frame."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[bytes]:
        """Append ``data``; return every frame body now complete, in order."""
        self._buf += data
        bodies: list[bytes] = []
        while len(self._buf) >= _HEADER_BYTES:
            length = int.from_bytes(self._buf[:_HEADER_BYTES], "big")
            if length > self.max_frame_bytes:
                raise ProtocolError(
                    f"the gateway announced a {length}-byte response frame; this client "
                    f"reads at most {self.max_frame_bytes} bytes per frame"
                )
            end = _HEADER_BYTES + length
            if len(self._buf) < end:
                break
            bodies.append(bytes(self._buf[_HEADER_BYTES:end]))
            del self._buf[:end]
        return bodies


# --- the client ------------------------------------------------------------------------


class _NothingDelivered(Exception):
    """The connection broke before one whole request frame was written: safe to resend."""


class Client:
    """A connection to the gateway of the run this process lives in.

    ``socket_path`` and ``run_id`` default to ``$COGNI_GATEWAY_SOCK`` and ``$COGNI_RUN_ID``.
    ``timeout`` bounds each :meth:`call` / :meth:`call_many` as a whole (None: wait
    forever). ``max_frame_bytes`` is the largest request frame this client will send.

    Resource handling: the socket is opened on the first call and reused by later calls.
    If the gateway closed it while it was idle, the next call opens a new one. A request
    is re-sent on a new connection only when the old one broke before that request was
    written in full, so a call that may have reached the gateway is never repeated.
    After a timeout, a protocol error or a failed connection the socket is closed (its
    state is unknown) and the next call starts a fresh one. Use ``with Client() as c:``
    or call :meth:`close`.

    Not thread-safe: use one Client per thread.
    """

    def __init__(
        self,
        socket_path: str | None = None,
        run_id: str | None = None,
        *,
        timeout: float | None = DEFAULT_TIMEOUT_SECONDS,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    ) -> None:
        if socket_path is None:
            socket_path = _required_env(SOCKET_ENV)
            self._socket_source = f"${SOCKET_ENV}"
        else:
            self._socket_source = "the socket_path argument"
        if run_id is None:
            run_id = _required_env(RUN_ID_ENV)
        if timeout is not None and not 0 < timeout <= MAX_TIMEOUT_SECONDS:
            raise ClientError(
                f"timeout must be a positive number of seconds up to {MAX_TIMEOUT_SECONDS:.0f}, "
                f"or None to wait forever; got {timeout!r}"
            )
        if max_frame_bytes < MIN_MAX_FRAME_BYTES:
            raise ClientError(
                f"max_frame_bytes must be at least {MIN_MAX_FRAME_BYTES}, got {max_frame_bytes}"
            )
        self.socket_path = socket_path
        self.run_id = run_id
        self.timeout = timeout
        self.max_frame_bytes = max_frame_bytes
        self._sock: _socket.socket | None = None
        self._id_prefix = f"{_getpid()}-"
        self._counter = 0

    # -- public API --

    def call(self, tool: str, args: dict[str, Any] | None = None) -> Any:
        """Call ``tool`` with ``args`` and return its value, or raise :class:`ToolError`.

        Error handling: :class:`ToolError` when the gateway refuses or the tool fails;
        :class:`ClientError` (nothing sent), :class:`ConnectionFailed`,
        :class:`CallTimedOut` or :class:`ProtocolError` otherwise.
        """
        (result,) = self.call_many([(tool, args)])
        if isinstance(result, ToolError):
            raise result
        return result

    def call_many(self, calls: Sequence[tuple[str, dict[str, Any] | None]]) -> list[Any]:
        """Send every call at once (pipelined) and return the results in request order.

        Each result is the tool's value, or a :class:`ToolError` instance (not raised) for
        a call the gateway answered with an error. Failures of the whole exchange
        (connection, timeout, protocol) raise and lose the batch's answers; every request
        is encoded and size-checked before anything is sent.
        """
        if not calls:
            return []
        frames: list[bytes] = []
        ids: list[str] = []
        for tool, args in calls:
            tool_call_id = self._next_id()
            frames.append(
                encode_request(
                    self.run_id,
                    tool_call_id,
                    tool,
                    {} if args is None else args,
                    self.max_frame_bytes,
                )
            )
            ids.append(tool_call_id)
        replies = self._exchange(frames, ids)
        return [replies[i].value if replies[i].ok else replies[i].to_error() for i in ids]

    def close(self) -> None:
        """Close the connection (idempotent; a later call reconnects)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals --

    def _next_id(self) -> str:
        self._counter += 1
        return f"{self._id_prefix}{self._counter}"

    def _deadline(self) -> float | None:
        return None if self.timeout is None else time.monotonic() + self.timeout

    def _exchange(self, frames: list[bytes], ids: list[str]) -> dict[str, Reply]:
        deadline = self._deadline()
        reused = self._sock is not None
        if self._sock is not None and _closed_while_idle(self._sock):
            self.close()
            reused = False
        try:
            if self._sock is None:
                self._sock = self._connect(deadline)
            try:
                return self._pump(self._sock, frames, ids, deadline)
            except _NothingDelivered:
                if not reused:
                    raise ConnectionFailed(
                        f"the gateway at {self.socket_path} (from {self._socket_source}) "
                        "closed the connection before the request was sent; is gatewayd "
                        "still serving this run?"
                    ) from None
                # The gateway closed the idle connection just as we reused it, and not
                # one request frame reached it whole: resend once on a new connection.
                self.close()
                self._sock = self._connect(deadline)
                try:
                    return self._pump(self._sock, frames, ids, deadline)
                except _NothingDelivered:
                    raise ConnectionFailed(
                        f"the gateway at {self.socket_path} (from {self._socket_source}) "
                        "closed two connections in a row before the request was sent; is "
                        "gatewayd still serving this run?"
                    ) from None
        except BaseException:
            # The stream's state is unknown (a late answer may still arrive): start over.
            self.close()
            raise

    def _connect(self, deadline: float | None) -> _socket.socket:
        where = f"{self.socket_path} (from {self._socket_source})"
        try:
            sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        except OSError as exc:
            raise ConnectionFailed(f"cannot create a unix socket to reach {where}: {exc}") from None
        try:
            sock.settimeout(_remaining(deadline, where))
            sock.connect(self.socket_path)
        except FileNotFoundError:
            sock.close()
            raise ConnectionFailed(
                f"no gateway socket at {where}: cogni-tool only works inside a gatewayd run "
                "whose socket is mounted there"
            ) from None
        except ConnectionRefusedError:
            sock.close()
            raise ConnectionFailed(
                f"the gateway socket at {where} refuses connections: gatewayd is not "
                "serving this run (the run may have ended)"
            ) from None
        except CallTimedOut:
            sock.close()
            raise
        except OSError as exc:
            sock.close()
            reason = exc.strerror or str(exc) or type(exc).__name__
            raise ConnectionFailed(
                f"cannot connect to the gateway socket at {where}: {reason}"
            ) from None
        return sock

    def _pump(
        self, sock: _socket.socket, frames: list[bytes], ids: list[str], deadline: float | None
    ) -> dict[str, Reply]:
        """Write ``frames`` and read until every id in ``ids`` has its reply.

        The requests go out without waiting; almost always the socket buffer takes them
        all at once, and then each read simply blocks (up to the deadline). Only when the
        buffer is full does it poll for both directions, reading answers while it waits
        to write more: a gateway that answers while it reads must not be left blocked on
        a full buffer of answers (the pipelining deadlock).
        """
        where = f"{self.socket_path} (from {self._socket_source})"
        out = memoryview(b"".join(frames))
        first_frame_end = len(frames[0])
        sent = 0
        reader = FrameReader()
        waiting = set(ids)
        replies: dict[str, Reply] = {}
        while waiting:
            if sent < len(out):
                sent = _send_some(sock, out, sent, first_frame_end, where)
            if sent < len(out) and not _wait_readable_or_writable(sock, deadline, where):
                continue  # writable again, or woke early: send on (or time out)
            data = _receive(sock, deadline, where, wait=sent == len(out))
            if data is None:
                continue  # nothing yet: the loop decides again (and times out)
            if not data:
                if sent < first_frame_end:
                    raise _NothingDelivered
                raise ConnectionFailed(
                    f"the gateway at {where} closed the connection before answering "
                    f"{len(waiting)} call(s); they may or may not have run"
                    + (" (it stopped mid-frame)" if reader.buffered else "")
                )
            for body in reader.feed(data):
                reply = decode_response(body)
                if reply.tool_call_id is None:
                    if reply.ok:
                        raise ProtocolError(
                            "the gateway sent a successful response without a toolCallId"
                        )
                    # About the connection, not one call (e.g. too_large): the gateway
                    # closes it, and we cannot tell which call caused it, so every call
                    # still waiting gets this answer.
                    for tool_call_id in waiting:
                        replies[tool_call_id] = reply
                    self.close()
                    return replies
                if reply.tool_call_id not in waiting:
                    known = reply.tool_call_id in replies
                    raise ProtocolError(
                        f"the gateway sent a {'second ' if known else ''}response for "
                        f"toolCallId {reply.tool_call_id!r}, which "
                        + ("was already answered" if known else "this client never sent")
                    )
                waiting.discard(reply.tool_call_id)
                replies[reply.tool_call_id] = reply
        if reader.buffered:
            # Part of a frame nobody asked for: the answers stand, the stream does not.
            self.close()
        return replies


def _send_some(
    sock: _socket.socket, out: memoryview, sent: int, first_frame_end: int, where: str
) -> int:
    """Send from ``out[sent:]`` what the socket takes without waiting; the new ``sent``."""
    sock.settimeout(0.0)
    try:
        while sent < len(out):
            sent += sock.send(out[sent:])
    except (BlockingIOError, InterruptedError):
        pass  # the buffer is full: the rest goes once the gateway has read some
    except OSError as exc:  # EPIPE, ECONNRESET: the gateway went away
        if sent < first_frame_end:
            raise _NothingDelivered from None
        raise ConnectionFailed(
            f"the connection to the gateway at {where} broke while sending "
            f"({exc.strerror or exc}); calls already sent may have run"
        ) from None
    return sent


def _wait_readable_or_writable(sock: _socket.socket, deadline: float | None, where: str) -> bool:
    """Wait until ``sock`` can be read or written; True when it can be read.

    :class:`CallTimedOut` once the deadline has passed.
    """
    # Imported here: only pipelined sends bigger than the socket buffer come this way,
    # and a single call should not pay for loading the module.
    import select

    remaining = _remaining(deadline, where)
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN | select.POLLOUT)
    events = poller.poll(None if remaining is None else max(1, int(remaining * 1000)))
    mask = 0
    for _, event in events:
        mask |= event
    # Hang-up and error count as readable: the read then sees the end of the stream.
    return bool(mask & (select.POLLIN | select.POLLHUP | select.POLLERR))


def _receive(sock: _socket.socket, deadline: float | None, where: str, wait: bool) -> bytes | None:
    """The next bytes from ``sock`` (b"" at the end of the stream), or None when there are
    none yet.

    With ``wait`` it blocks until bytes come or the deadline passes
    (:class:`CallTimedOut`); otherwise it only takes what is there.
    """
    sock.settimeout(_remaining(deadline, where) if wait else 0.0)
    try:
        return sock.recv(_RECV_BYTES)
    # _socket.timeout, not TimeoutError: before Python 3.10 they are different classes.
    except (BlockingIOError, InterruptedError, _socket.timeout):  # noqa: UP041
        return None  # the caller loops, and _remaining says when time is up
    except OSError:  # ECONNRESET: treat like the end of the stream
        return b""


def _getenv(name: str) -> str | None:
    """``os.environ.get(name)``, without importing os when nothing has done so yet.

    os.environ is a copy of ``posix.environ`` (bytes) made when os is imported, decoded
    as below; it changes only through os. So while os is not loaded, the same decoding
    of posix.environ gives the same answer.
    """
    os_module = sys.modules.get("os")
    if os_module is not None:
        environ: dict[str, str] = os_module.environ
        return environ.get(name)
    try:
        from posix import environ as environb  # built in: always loaded
    except ImportError:  # pragma: no cover - not a POSIX system
        import os

        return os.environ.get(name)
    encoding = sys.getfilesystemencoding()
    value = environb.get(name.encode(encoding, "surrogateescape"))
    return None if value is None else value.decode(encoding, "surrogateescape")


def _required_env(name: str) -> str:
    value = _getenv(name)
    if not value:
        state = "is empty" if value is not None else "is not set"
        raise NotConfigured(
            f"{name} {state}: cogni-tool only works inside a gatewayd run, which sets "
            f"{SOCKET_ENV} (the gateway socket) and {RUN_ID_ENV} (the run id)"
        )
    return value


def _remaining(deadline: float | None, where: str) -> float | None:
    """Seconds left before ``deadline`` (None: no deadline), or :class:`CallTimedOut`."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise CallTimedOut(
            f"no answer from the gateway at {where} within the client's timeout; the call "
            "may still run there (raise the timeout for slow tools)"
        )
    return left


def _closed_while_idle(sock: _socket.socket) -> bool:
    """True when an idle connection has anything to read: the gateway's close or stray bytes.

    Nothing was in flight, so either way the connection is of no further use.
    """
    sock.settimeout(0.0)
    try:
        # A peek takes nothing off the stream; only whether there is anything matters.
        sock.recv(1, _socket.MSG_PEEK)
    except (BlockingIOError, InterruptedError):
        return False  # nothing to read: still open and quiet
    except OSError:
        return True  # ECONNRESET
    return True
