"""The wire protocol between cogni-tool and gatewayd, sans-IO.

This module turns bytes into typed events and typed messages into bytes. It never
touches a socket, a clock or trio: the server feeds it whatever ``recv`` returned and
writes whatever it hands back, so every parsing rule is tested without I/O.

A frame is a 4-byte big-endian unsigned length followed by that many bytes of
UTF-8 JSON (decoded with msgspec into a frozen Struct). Garbage either decodes or
becomes a :class:`FrameError` event carrying one :class:`ErrorCode`; nothing else
escapes :meth:`FrameDecoder.next_event`.
"""

from __future__ import annotations

import enum
import re
import struct
from typing import Any, Final

import msgspec

from gatewayd import error_codes, frame_limits, strictjson
from gatewayd.frame_limits import DEFAULT_MAX_FRAME_BYTES, MIN_FRAME_BYTES

# The error codes and the bound of an id live in modules free of msgspec (the errors,
# the policy and the command line use them without the wire codec); named here as ever.
ErrorCode = error_codes.ErrorCode
Fault = error_codes.Fault
FAULT_OF: Final = error_codes.FAULT_OF
MAX_ID_CHARS: Final = frame_limits.MAX_ID_CHARS

PROTOCOL_VERSION: Final = 1

HEADER: Final = struct.Struct(">I")
HEADER_BYTES: Final = HEADER.size

# Identifiers are echoed into audit lines and error messages: keep them short and
# printable so a hostile caller cannot smuggle control characters or megabytes there
# (MAX_ID_CHARS, in gatewayd.frame_limits).
_ID_RE: Final = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
TOOL_NAME_RE: Final = re.compile(r"[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)*")


class Request(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One tool call from the sandbox."""

    v: int
    runId: str
    toolCallId: str
    tool: str
    args: dict[str, Any] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.v != PROTOCOL_VERSION:
            raise ValueError(f"unsupported protocol version {self.v}; this gateway speaks v=1")
        if not _ID_RE.fullmatch(self.toolCallId):
            raise ValueError("toolCallId must be 1-128 characters of letters, digits and ._:@/+=-")
        if not _ID_RE.fullmatch(self.runId):
            raise ValueError("runId must be 1-128 characters of letters, digits and ._:@/+=-")
        if len(self.tool) > MAX_ID_CHARS or not TOOL_NAME_RE.fullmatch(self.tool):
            raise ValueError(
                "tool must be a dotted lowercase name such as 'fs.read' (at most 128 chars)"
            )


class Response(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The answer to one request; ``toolCallId`` says which (responses may come out of order)."""

    v: int  # no default: omit_defaults would leave it out of the frame
    toolCallId: str | None
    ok: bool
    value: Any = None
    errorCode: ErrorCode | None = None
    safeMessage: str | None = None

    def __post_init__(self) -> None:
        if self.ok and self.errorCode is not None:
            raise ValueError("a successful response carries no error code")
        if not self.ok and (self.errorCode is None or not self.safeMessage):
            raise ValueError("an error response needs an error code and a safe message")


def ok_response(tool_call_id: str, value: Any) -> Response:
    """A successful response carrying ``value``."""
    return Response(v=PROTOCOL_VERSION, toolCallId=tool_call_id, ok=True, value=value)


def error_response(tool_call_id: str | None, code: ErrorCode, message: str) -> Response:
    """An error response; ``message`` must already be safe to show to the sandbox."""
    return Response(
        v=PROTOCOL_VERSION, toolCallId=tool_call_id, ok=False, errorCode=code, safeMessage=message
    )


# --- events produced by the decoder -------------------------------------------------


class RequestReceived(msgspec.Struct, frozen=True, kw_only=True):
    """A well-formed request."""

    request: Request
    frame_bytes: int


class FrameError(msgspec.Struct, frozen=True, kw_only=True):
    """A frame that could not become a request.

    ``fatal`` means the byte stream can no longer be trusted (we do not know where
    the next frame starts), so the connection must be closed after the error
    response is sent. ``tool_call_id`` is echoed when it could be recovered.
    """

    code: ErrorCode
    message: str
    tool_call_id: str | None
    fatal: bool
    raw: bytes = b""


class _NeedData(enum.Enum):
    NEED_DATA = "need_data"


NEED_DATA: Final = _NeedData.NEED_DATA

Event = RequestReceived | FrameError | _NeedData


class _IdOnly(msgspec.Struct):
    toolCallId: str


class _WireRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A request as parsed, before :class:`Request`'s checks; ``args`` is UNSET when
    the body has no such key, so the number of keys parsed is known (see
    :func:`_decode_once`)."""

    v: int
    runId: str
    toolCallId: str
    tool: str
    args: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET


# The keys of a request other than ``args``: all required (forbid_unknown_fields).
_REQUIRED_KEYS: Final = 4

_request_decoder: Final = msgspec.json.Decoder(Request)
_wire_decoder: Final = msgspec.json.Decoder(_WireRequest)
_id_decoder: Final = msgspec.json.Decoder(_IdOnly)
_encoder: Final = msgspec.json.Encoder()


def _recover_id(body: bytes) -> str | None:
    """Best effort: the toolCallId of a request that failed validation, if it is sane."""
    try:
        tcid = _id_decoder.decode(body).toolCallId
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError):
        return None
    return tcid if _ID_RE.fullmatch(tcid) else None


class FrameDecoder:
    """Incremental decoder for one connection's inbound byte stream.

    Feed bytes with :meth:`receive_data` and pull events with :meth:`next_event`
    until it returns :data:`NEED_DATA`. After a fatal :class:`FrameError` the
    decoder is closed: further calls return the same error again.
    """

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        if max_frame_bytes < MIN_FRAME_BYTES:
            raise ValueError(f"max_frame_bytes below {MIN_FRAME_BYTES} cannot hold a request")
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()
        self._closed: FrameError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received and not yet consumed (a partial frame)."""
        return len(self._buf)

    def receive_data(self, data: bytes) -> None:
        """Append bytes read from the peer."""
        if self._closed is None:
            self._buf += data

    def next_event(self) -> Event:
        """The next complete event, or NEED_DATA."""
        if self._closed is not None:
            return self._closed
        if len(self._buf) < HEADER_BYTES:
            return NEED_DATA
        (length,) = HEADER.unpack_from(self._buf)
        if length > self.max_frame_bytes:
            self._closed = FrameError(
                code=ErrorCode.TOO_LARGE,
                message=(
                    f"frame of {length} bytes exceeds the limit of {self.max_frame_bytes} "
                    "bytes; the connection will be closed"
                ),
                tool_call_id=None,
                fatal=True,
            )
            self._buf.clear()
            return self._closed
        end = HEADER_BYTES + length
        if len(self._buf) < end:
            return NEED_DATA
        body = bytes(self._buf[HEADER_BYTES:end])
        del self._buf[:end]
        return decode_body(body)


def decode_body(body: bytes) -> RequestReceived | FrameError:
    """Decode one frame body into a request or a non-fatal error.

    The body must first pass gatewayd's JSON discipline (:mod:`gatewayd.strictjson`: no
    key twice in an object, nesting bounded, no NaN): msgspec alone would keep the
    last of two ``"tool"`` keys without a word.
    """
    request = _decode_once(body)
    if request is not None:
        return RequestReceived(request=request, frame_bytes=len(body))
    # Refused by the one-parse path, or not provably within the discipline there: the
    # full check, in order, for the exact reason.
    try:
        strictjson.check(body)
        request = _request_decoder.decode(body)
    except strictjson.JsonInputError as exc:  # also bounds the depth msgspec recurses to
        return _bad_request(f"frame body is not acceptable JSON: {exc}", body, _recover_id(body))
    except msgspec.ValidationError as exc:
        return _bad_request(f"malformed request: {exc}", body, _recover_id(body))
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        # What json reads and msgspec does not (a lone surrogate escape in a string).
        return _bad_request(f"frame body is not valid JSON: {exc}", body, None)
    return RequestReceived(request=request, frame_bytes=len(body))


def _decode_once(body: bytes) -> Request | None:
    """The request in ``body`` from one msgspec parse, when that parse also proves what
    :func:`strictjson.check` would: nesting within bounds (checked first, so msgspec
    never recurses deep), no key twice in one object (the keys parsed are as many as the
    body's colons outside strings, :func:`strictjson.keys_in`), no NaN or infinity and
    no over-long integer (msgspec refuses those itself). None for anything else, having
    decided nothing: :func:`decode_body` then takes the two-step path, which accepts
    exactly the same bodies and words every refusal.

    Why not strictjson alone and a conversion: its parse runs a Python hook per object
    and is several times msgspec's cost, on every call.
    """
    if strictjson.nests_deeper(body):
        return None
    try:
        wire = _wire_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError):
        return None
    if isinstance(wire.args, msgspec.UnsetType):
        args: dict[str, Any] = {}
        parsed = _REQUIRED_KEYS
    else:
        args = wire.args
        parsed = _REQUIRED_KEYS + 1 + _keys_within(args)
    # A plain count first: with no colon inside a string it is already the exact one.
    if body.count(b":") != parsed and strictjson.keys_in(body) != parsed:
        return None  # a key twice somewhere (or so it may be): the full check words it
    try:
        return Request(
            v=wire.v, runId=wire.runId, toolCallId=wire.toolCallId, tool=wire.tool, args=args
        )
    except ValueError:
        return None  # Request's own checks: decoding again words the refusal the same


def _keys_within(value: dict[str, Any]) -> int:
    """The keys of ``value`` and of every object nested in it; iterative (the depth is
    bounded before this runs, but a wide document stays a loop)."""
    count = 0
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            count += len(item)
            stack.extend(v for v in item.values() if isinstance(v, dict | list))
        elif isinstance(item, list):
            stack.extend(v for v in item if isinstance(v, dict | list))
    return count


def _bad_request(message: str, body: bytes, tool_call_id: str | None) -> FrameError:
    return FrameError(
        code=ErrorCode.BAD_REQUEST,
        message=message,
        tool_call_id=tool_call_id,
        fatal=False,
        raw=body,
    )


def encode_frame(body: bytes) -> bytes:
    """Prefix ``body`` with its length."""
    return HEADER.pack(len(body)) + body


def encode_response(response: Response) -> bytes:
    """One framed response."""
    return encode_frame(_encoder.encode(response))


def encode_request(request: Request) -> bytes:
    """One framed request (for tests, benchmarks and Python callers on the host)."""
    return encode_frame(_encoder.encode(request))


def encode_json(value: Any) -> bytes:
    """msgspec JSON encoding shared by the server (so sizes are measured the same way)."""
    return _encoder.encode(value)
