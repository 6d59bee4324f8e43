"""What one audit entry holds: the schema the writer seals, its limits, and the body's
encoding.

The entry is a frozen msgspec Struct whose field order *is* the on-disk key order
(``seq``, ``time``, ``kind``, the optional fields, ``prev``); fields that are None are
left out. :func:`build_body` validates the caller's fields (msgspec does it in C) and
returns the bytes the hash is taken over; a caller whose fields it built itself from
typed values (the dispatcher's call and result entries) may skip that validation, which
costs more than the rest of sealing an entry. Reading a body back is
:func:`gatewayd.audit.entryform.decode_body`, without msgspec (the readers start without
it); the bounds, patterns and enums of this schema are that module's.

No I/O and no clock: the time is passed in.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from functools import lru_cache
from typing import Annotated, Any, Final, TypedDict

import msgspec

from gatewayd.audit.entryform import (
    DIGEST_PATTERN,
    EVENT_NAME_PATTERN,
    MAX_DEGRADED_CHARS,
    MAX_DURATION_MS,
    Decision,
    EntryKind,
)
from gatewayd.audit.events import AuditEvent
from gatewayd.audit.line import HASH_SUFFIX_BYTES, MAX_LINE_BYTES
from gatewayd.protocol import MAX_ID_CHARS, ErrorCode

# The entry's enums are entryform's (the readers' module), and named here too.
__all__ = [
    "MAX_ARGS_SUMMARY_BYTES",
    "MAX_DETAIL_BYTES",
    "MAX_EVENT_CHARS",
    "MAX_SAFE_MESSAGE_CHARS",
    "AuditEntry",
    "Decision",
    "EntryFields",
    "EntryKind",
    "EventName",
    "Peer",
    "build_body",
    "format_time",
]

# With every field at its cap a line stays under half of MAX_LINE_BYTES, so that limit
# is a backstop, not something a caller can hit.
# A reviewer reads the message in a table; the full story is in the daemon log.
MAX_SAFE_MESSAGE_CHARS: Final = 500
# The caller already redacts and shortens the argument summary; this is the backstop.
MAX_ARGS_SUMMARY_BYTES: Final = 8 * 1024
# Event details (run specs, recovery facts) are small; anything larger is a bug.
MAX_DETAIL_BYTES: Final = 16 * 1024
# Event names are identifiers a reviewer filters on, not free text.
MAX_EVENT_CHARS: Final = 64
# The bounded strings gatewayd passes without having made them itself (ids it checked
# against the protocol, a run's reason for having no sandbox): their lengths are
# checked on the unchecked path too, as cheap as that is.
_BOUNDED_TEXT: Final = (
    ("runId", MAX_ID_CHARS),
    ("toolCallId", MAX_ID_CHARS),
    ("tool", MAX_ID_CHARS),
    ("degraded", MAX_DEGRADED_CHARS),
)
# A body this small cannot hold an oversize object, so the caps need no measuring.
_FAST_PATH_BYTES: Final = min(MAX_ARGS_SUMMARY_BYTES, MAX_DETAIL_BYTES)

Identifier = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
Digest = Annotated[str, msgspec.Meta(pattern=DIGEST_PATTERN)]
# Written by the chain itself; its hex form is checked when reading (decode_body).
HashHex = Annotated[str, msgspec.Meta(min_length=64, max_length=64)]
# Reading accepts any snake_case name (a log from another version still verifies);
# writing only a registered one (events.py).
EventName = Annotated[str, msgspec.Meta(pattern=EVENT_NAME_PATTERN)]
Duration = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_DURATION_MS)]
ByteCount = Annotated[int, msgspec.Meta(ge=0)]
Seq = Annotated[int, msgspec.Meta(ge=1)]


class Peer(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The credentials of the process on the other end of a run's socket."""

    pid: int
    uid: int
    gid: int


class AuditEntry(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=True
):
    """One entry, minus its hash. Field order is the key order on disk (entryform's
    schema, which reads it back, lists the same fields in the same order)."""

    seq: Seq
    time: str
    kind: EntryKind
    runId: Identifier | None = None
    toolCallId: Identifier | None = None
    tool: Identifier | None = None
    argsDigest: Digest | None = None
    argsSummary: dict[str, Any] | None = None
    decision: Decision | None = None
    errorCode: ErrorCode | None = None
    safeMessage: str | None = None
    durationMs: Duration | None = None
    outputDigest: Digest | None = None
    outputBytes: ByteCount | None = None
    peer: Peer | None = None
    event: EventName | None = None
    detail: dict[str, Any] | None = None
    # The rule review of a call: verdict, source (structured, cache, model, failed),
    # reason, model, latency, tokens, cache hit.
    review: dict[str, Any] | None = None
    # Set on every call of a run without the OS sandbox (require_os_sandbox: false):
    # why it has none. A reviewer filters on it.
    degraded: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_DEGRADED_CHARS)] | None = (
        None
    )
    prev: HashHex


class EntryFields(TypedDict, total=False):
    """The optional fields a caller may pass to ``record``/``append`` (None = absent)."""

    runId: str | None
    toolCallId: str | None
    tool: str | None
    argsDigest: str | None
    argsSummary: Mapping[str, Any] | None
    decision: str | None
    errorCode: str | None
    safeMessage: str | None
    durationMs: float | None
    outputDigest: str | None
    outputBytes: int | None
    peer: Peer | Mapping[str, int] | None
    event: AuditEvent | None  # a registered name only: the writer refuses any other
    detail: Mapping[str, Any] | None
    review: Mapping[str, Any] | None
    degraded: str | None


_encoder: Final = msgspec.json.Encoder()


@lru_cache(maxsize=4)
def _second_prefix(seconds: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))


def format_time(ns: int) -> str:
    """RFC 3339 UTC with microseconds, e.g. ``2026-11-22T13:40:01.123456Z``."""
    seconds, micros = divmod(ns // 1000, 1_000_000)
    return f"{_second_prefix(seconds)}.{micros:06d}Z"


def _omitted(name: str, encoded: bytes, cap: int) -> dict[str, Any]:
    """The marker that stands in for an oversize object: its size and digest survive."""
    return {
        "omitted": f"{name} of {len(encoded)} bytes is over the {cap}-byte cap",
        "bytes": len(encoded),
        "sha256": hashlib.sha256(encoded).hexdigest(),
    }


def _capped(entry: AuditEntry) -> AuditEntry:
    changes: dict[str, Any] = {}
    for name, value, cap in (
        ("argsSummary", entry.argsSummary, MAX_ARGS_SUMMARY_BYTES),
        ("detail", entry.detail, MAX_DETAIL_BYTES),
    ):
        if value is not None:
            encoded = _encoder.encode(value)
            if len(encoded) > cap:
                changes[name] = _omitted(name, encoded, cap)
    return msgspec.structs.replace(entry, **changes) if changes else entry


def build_body(
    seq: int,
    when: str,
    kind: str,
    fields: Mapping[str, Any],
    prev: str,
    *,
    checked: bool = True,
) -> bytes:
    """Validate one entry and return its compact JSON body (every key up to ``prev``).

    An oversize ``safeMessage`` is shortened; an oversize ``argsSummary`` or ``detail``
    is replaced by a marker holding its size and sha256, never dropped.

    ``checked=False``: the fields were built by gatewayd itself from typed values (ids
    the protocol has checked, digests and sizes it computed, its own enums, a
    :class:`Peer`, float durations, dict details), so their types and bounds are not
    checked again; what a caller can still get wrong is (the message's length, the
    caps, an unknown field, an event entry without its name). A value that cannot be
    encoded as it is gets the checked path.

    Error handling: ValueError naming the field and what it may hold (unknown field,
    wrong type, id too long, bad digest, unknown error code, event without name...).
    """
    message = fields.get("safeMessage")
    if type(message) is str and len(message) > MAX_SAFE_MESSAGE_CHARS:
        fields = {**fields, "safeMessage": message[: MAX_SAFE_MESSAGE_CHARS - 1] + "…"}
    if checked:
        try:
            entry = msgspec.convert(
                {"seq": seq, "time": when, "kind": kind, "prev": prev, **fields}, AuditEntry
            )
        except msgspec.ValidationError as exc:
            raise ValueError(f"invalid audit entry: {exc}") from None
        try:
            body = _encoder.encode(entry)
        except (TypeError, msgspec.EncodeError) as exc:  # a value of no JSON, in an object
            raise ValueError(f"invalid audit entry: {exc}") from None
    else:
        for name, limit in _BOUNDED_TEXT:
            value = fields.get(name)
            if value is not None and not (type(value) is str and 0 < len(value) <= limit):
                return build_body(seq, when, kind, fields, prev)  # it says what is wrong
        # A clock's difference: a clock stepped back, or one that gives ints, would write
        # a line verify refuses (NaN fails the comparison too).
        duration = fields.get("durationMs")
        if duration is not None and not (
            type(duration) is float and 0.0 <= duration <= MAX_DURATION_MS
        ):
            return build_body(seq, when, kind, fields, prev)
        try:
            entry = AuditEntry(seq=seq, time=when, kind=kind, prev=prev, **fields)  # type: ignore[arg-type]
            body = _encoder.encode(entry)
        except (TypeError, msgspec.EncodeError):  # an unknown field, or a value of no JSON
            return build_body(seq, when, kind, fields, prev)
    if (entry.kind == EntryKind.EVENT) != (entry.event is not None):
        raise ValueError("invalid audit entry: kind 'event' needs an event name, others none")
    if len(body) > _FAST_PATH_BYTES:
        body = _encoder.encode(_capped(entry))
    # Every field is capped above, so only a bug in this module could trip this.
    if len(body) + HASH_SUFFIX_BYTES > MAX_LINE_BYTES:
        raise ValueError(f"audit entry of {len(body)} bytes is over MAX_LINE_BYTES")
    return body
