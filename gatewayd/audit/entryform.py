"""What an entry gatewayd wrote looks like, and reading a body back: :func:`decode_body`
insists it is exactly what gatewayd would have written, so a line edited by hand, even
with a fresh hash, stands out.

Why its own module: the writer builds entries with msgspec (``entry.AuditEntry``, whose
field order is the key order on disk), but ``gatewayd audit verify`` reads them without
importing msgspec (a third of its start): with the standard library's json
(:mod:`gatewayd.audit.jsonform`) and the checks below, which are the schema's, field for
field: the types (a bool is no integer, an integer no float), the required fields and
no unknown one, the lengths, the patterns (matched as msgspec matches them: ``re.search``),
the ranges. What the schema does not say, the form does: the body must be the compact
encoding of what it decodes to, keys in the schema's order, absent fields left out. The
bounds and enums live here, and ``entry`` builds its schema from them.
tests/unit/test_audit_entryform.py feeds mutated lines to both and wants one verdict.

No I/O.
"""

from __future__ import annotations

import enum
import functools
import re

from gatewayd.audit.jsonform import JsonFormError, dumps, loads
from gatewayd.audit.line import is_hash_hex
from gatewayd.frame_limits import MAX_ID_CHARS

# typing's flag without importing typing: the readers start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Final

# Why a run has no OS sandbox: one sentence.
MAX_DEGRADED_CHARS: Final = 500
# A duration past ~31 years is a clock bug; NaN and infinity would not read back.
MAX_DURATION_MS: Final = 1e12
# An event name (snake_case; reading accepts any, writing only a registered one) and a
# digest, as the schema's patterns, which msgspec matches with re.search (so "$" also
# matches before a final newline).
EVENT_NAME_PATTERN: Final = r"^[a-z][a-z0-9_]{0,63}$"
DIGEST_PATTERN: Final = r"^sha256:[0-9a-f]{64}$"
_EVENT_NAME_RE: Final = re.compile(EVENT_NAME_PATTERN)
_DIGEST_RE: Final = re.compile(DIGEST_PATTERN)
_TIME_RE: Final = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")


class EntryKind(enum.StrEnum):
    """What an entry records."""

    CALL = "call"  # a call was decided (write-ahead: durable before it runs)
    RESULT = "result"  # a call finished, or was refused
    EVENT = "event"  # something happened to the daemon, a run or the log itself


class Decision(enum.StrEnum):
    ALLOW = "allow"
    DENY = "deny"


class EntryFormatError(ValueError):
    """Bytes that hash correctly but are not an entry gatewayd would have written."""


class Entry:
    """One entry read back by :func:`decode_body`: an attribute per field (the log's
    key), None where the line leaves it out. Field order is the schema's
    (``entry.AuditEntry``); ``peer`` is ``{"pid", "uid", "gid"}``."""

    seq: int
    time: str
    kind: str
    runId: str | None = None
    toolCallId: str | None = None
    tool: str | None = None
    argsDigest: str | None = None
    argsSummary: dict[str, Any] | None = None
    decision: str | None = None
    errorCode: str | None = None
    safeMessage: str | None = None
    durationMs: float | None = None
    outputDigest: str | None = None
    outputBytes: int | None = None
    peer: dict[str, int] | None = None
    event: str | None = None
    detail: dict[str, Any] | None = None
    review: dict[str, Any] | None = None
    degraded: str | None = None
    prev: str

    def __init__(self, fields: dict[str, Any]) -> None:
        self.__dict__ = fields  # the fields present; the class says None for the others

    def as_dict(self) -> dict[str, Any]:
        """The fields present, in the schema's order (the entry as written, less its hash)."""
        return self.__dict__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Entry) and self.__dict__ == other.__dict__

    __hash__ = None  # type: ignore[assignment]  # its dicts are not hashable either

    def __repr__(self) -> str:
        return f"Entry({self.__dict__!r})"


# The schema, field by field in the order gatewayd writes them (entry.AuditEntry says
# the same to msgspec): each field's JSON type, exactly (a bool is no integer, an
# integer no float), then the bounds in _bounds_problem. Every field but the required
# ones may be absent.
_TYPES: Final[dict[str, type]] = {
    "seq": int,
    "time": str,
    "kind": str,
    "runId": str,
    "toolCallId": str,
    "tool": str,
    "argsDigest": str,
    "argsSummary": dict,
    "decision": str,
    "errorCode": str,
    "safeMessage": str,
    "durationMs": float,
    "outputDigest": str,
    "outputBytes": int,
    "peer": dict,
    "event": str,
    "detail": dict,
    "review": dict,
    "degraded": str,
    "prev": str,
}
_REQUIRED: Final = ("seq", "time", "kind", "prev")
_KINDS: Final = frozenset(EntryKind)
_EVENT_KIND: Final = EntryKind.EVENT
_DECISIONS: Final = frozenset(Decision)
_IDS: Final = ("runId", "toolCallId", "tool")
_DIGESTS: Final = ("argsDigest", "outputDigest")
_PEER_KEYS: Final = ("pid", "uid", "gid")
_TYPE_NAMES: Final = {int: "an integer", str: "a string", float: "a float", dict: "an object"}


@functools.cache
def _error_codes() -> frozenset[str]:
    # Here: the error codes' enums cost a reader's start about 1 ms to build, and only
    # an entry with an error code needs them.
    from gatewayd.error_codes import ErrorCode

    return frozenset(ErrorCode)


def _bounds_problem(value: dict[str, Any]) -> str | None:
    """Which field of ``value`` (each of its schema's type) is out of its bounds, and
    what it may hold; None when none is. In one function, not one per field: verify
    runs it on every entry of a log."""
    if value["seq"] < 1:
        return "seq: expected an integer >= 1"
    if value["kind"] not in _KINDS:
        return f"kind: expected one of {sorted(_KINDS)}"
    if len(value["prev"]) != 64:
        return "prev: expected a string of 64 characters"
    for name in _IDS:
        field = value.get(name)
        if field is not None and not 0 < len(field) <= MAX_ID_CHARS:
            return f"{name}: expected a string of 1 to {MAX_ID_CHARS} characters"
    for name in _DIGESTS:
        field = value.get(name)
        if field is not None and not _DIGEST_RE.search(field):
            return f"{name}: expected a string matching {DIGEST_PATTERN!r}"
    field = value.get("decision")
    if field is not None and field not in _DECISIONS:
        return f"decision: expected one of {sorted(_DECISIONS)}"
    field = value.get("errorCode")
    if field is not None and field not in _error_codes():
        return f"errorCode: expected one of {sorted(_error_codes())}"
    field = value.get("durationMs")
    if field is not None and not 0.0 <= field <= MAX_DURATION_MS:
        return f"durationMs: expected a float from 0.0 to {MAX_DURATION_MS}"
    field = value.get("outputBytes")
    if field is not None and field < 0:
        return "outputBytes: expected an integer >= 0"
    field = value.get("peer")
    if field is not None and not (
        len(field) == len(_PEER_KEYS) and all(type(field.get(key)) is int for key in _PEER_KEYS)
    ):
        return "peer: expected an object of the integers pid, uid and gid"
    field = value.get("event")
    if field is not None and not _EVENT_NAME_RE.search(field):
        return f"event: expected a string matching {EVENT_NAME_PATTERN!r}"
    field = value.get("degraded")
    if field is not None and not 0 < len(field) <= MAX_DEGRADED_CHARS:
        return f"degraded: expected a string of 1 to {MAX_DEGRADED_CHARS} characters"
    return None


_ORDER: Final = {name: index for index, name in enumerate(_TYPES)}
# What each set of keys, in its order, says of a body: the schema's problem with it
# (an unknown or a missing field), "" when they are not in the order gatewayd writes
# them, or None. A log holds few such sets (one per kind of entry, about), so the
# answer is kept; a log of many is no reason to grow without bound.
_SHAPES: dict[tuple[str, ...], str | None] = {}
_MAX_SHAPES: Final = 512


def _shape(keys: tuple[str, ...]) -> str | None:
    if keys in _SHAPES:
        return _SHAPES[keys]
    unknown = set(keys) - _TYPES.keys()
    missing = [name for name in _REQUIRED if name not in keys]
    if unknown:
        found: str | None = f"unknown field {min(unknown)!r}"
    elif missing:
        found = f"missing required field {missing[0]!r}"
    else:
        places = [_ORDER[name] for name in keys]
        found = None if places == sorted(places) else ""
    if len(_SHAPES) >= _MAX_SHAPES:
        _SHAPES.clear()
    _SHAPES[keys] = found
    return found


def _schema_problem(value: dict[str, Any], shape: str | None) -> str | None:
    """What in a decoded body does not fit the schema, or None (nulls aside: a null
    optional field is an absent one written out, which the form check refuses)."""
    if shape:
        return shape
    for name, field in value.items():
        if type(field) is not _TYPES[name]:
            if field is None and name not in _REQUIRED:
                continue
            return f"{name}: expected {_TYPE_NAMES[_TYPES[name]]}"
    return _bounds_problem(value)


def decode_body(body: bytes) -> Entry:
    """Read a body back; raises EntryFormatError unless gatewayd could have written it."""
    try:
        text = body.decode("utf-8")
        value = loads(text)
    except UnicodeDecodeError as exc:
        message = f"it is not UTF-8 text: a bad byte at offset {exc.start}"
        raise EntryFormatError(message) from None
    except JsonFormError as exc:
        raise EntryFormatError(str(exc)) from None
    if type(value) is not dict:
        raise EntryFormatError("it does not fit the entry schema (it is not an object)")
    keys = tuple(value)
    shape = _SHAPES[keys] if keys in _SHAPES else _shape(keys)
    problem = _schema_problem(value, shape)
    if problem is not None:
        raise EntryFormatError(f"it does not fit the entry schema ({problem})")
    # The form gatewayd writes: the schema's key order (shape), absent fields left out
    # (a null is an absent field written out), the peer's keys in its order, compact
    # JSON. Anything else is not what gatewayd wrote, whatever it holds.
    peer = value.get("peer")
    try:
        same = (
            shape is None
            and None not in value.values()
            and (peer is None or tuple(peer) == _PEER_KEYS)
            and dumps(value) == text
        )
    except RecursionError:  # as deep as the decoder went, and no deeper
        raise EntryFormatError("it nests too deeply to be an entry") from None
    if not same:
        raise EntryFormatError("its JSON is not in the form gatewayd writes")
    # (On the dict, not the Entry, and a kind of no enum's attribute: verify checks
    # every entry of a log, and each lookup costs it.)
    if not is_hash_hex(value["prev"]):
        raise EntryFormatError("its prev is not 64 lowercase hex characters")
    if not _TIME_RE.fullmatch(value["time"]):
        raise EntryFormatError("its time is not RFC 3339 UTC with microseconds")
    if (value["kind"] == _EVENT_KIND) != ("event" in value):
        raise EntryFormatError("an event entry must name its event, and only event entries")
    return Entry(value)
