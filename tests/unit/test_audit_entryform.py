"""`gatewayd audit verify` checks each entry without msgspec (gatewayd.audit.entryform):
it must call an entry gatewayd's exactly when the reader it replaced did. That reader is
the oracle here: msgspec's decode into the writer's own schema (``entry.AuditEntry``),
encoded again and compared byte for byte, then the prev, time and event checks.

Bodies the writer made are mutated (bytes inserted, deleted, replaced; a field's value
swapped for a tricky one, a field added, dropped, repeated or moved, the separators
spaced) and both readers must give one verdict: the types, required and unknown
fields, lengths, patterns, ranges, duplicate keys, NaN and infinities, big integers,
text that is not UTF-8, lone surrogates, deep nesting, key order and JSON's form.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gatewayd.audit import entryform
from gatewayd.audit.entry import AuditEntry, build_body, format_time
from gatewayd.audit.entryform import EntryFormatError, EntryKind, decode_body
from gatewayd.audit.line import is_hash_hex
from gatewayd.error_codes import ErrorCode
from tests.hypothesis_counts import examples

_ORACLE = msgspec.json.Decoder(AuditEntry)
_ENCODER = msgspec.json.Encoder()
_TIME_RE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")
FIXED_NS = 1_795_354_801_123_456_789
HEX = "0123456789abcdef" * 4
DIGEST = "sha256:" + "ab" * 32


def msgspec_accepts(body: bytes) -> bool:
    """The reader before entryform: whether gatewayd could have written ``body``. (It
    raised UnicodeDecodeError on text that is not UTF-8, a crash of `audit verify`;
    refusing is the verdict it meant.)"""
    try:
        entry = _ORACLE.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return False
    return (
        _ENCODER.encode(entry) == body
        and is_hash_hex(entry.prev)
        and _TIME_RE.fullmatch(entry.time) is not None
        and (entry.kind is EntryKind.EVENT) == (entry.event is not None)
    )


def entryform_accepts(body: bytes) -> bool:
    try:
        entry = decode_body(body)
    except EntryFormatError:
        return False
    assert _ENCODER.encode(entry.as_dict()) == body  # what it read is what was written
    return True


def assert_one_verdict(body: bytes) -> None:
    assert entryform_accepts(body) == msgspec_accepts(body), body[:400]


def body_of(kind: str, fields: dict[str, Any], seq: int = 7) -> bytes:
    return build_body(seq, format_time(FIXED_NS), kind, fields, HEX)


# Values (as JSON text) at the edges of each field's type and bounds, and of JSON.
_TEXT = [
    *(b"null", b"true", b"false", b"0", b"-0", b"1", b"-1", b"2", b"1.0", b"-0.0", b"0.0"),
    *(b"5", b"5.0", b"1e2", b"1E2", b"100.0", b"1e400", b"-1e400", b"NaN", b"Infinity"),
    *(b"1e16", b"1e+16", b"0.00001", b"1e-05", b"1e-5", b"2.5e-7", b"2.5e-07"),
    *(b"1000000000000.0", b"1000000000000.0001", b"1e12", b"999999999999.9999"),
    *(b"18446744073709551615", b"18446744073709551616", b"-9223372036854775809"),
    *(b"1" * 4300, b"1" * 4301, b"-" + b"1" * 4299, b"-" + b"1" * 4300),
    *(b'""', b'"x"', b'"r"', b'" "', b'"\\n"', b'"\\u0000"', b'"\\u00e9"', b'"\\/"'),
    *(b'"' + b"r" * 128 + b'"', b'"' + b"r" * 129 + b'"', b'"' + b"d" * 500 + b'"'),
    b'"' + b"d" * 501 + b'"',
    ('"' + "\U0001f600" * 128 + '"').encode(),
    ('"' + "\U0001f600" * 129 + '"').encode(),
    *(b'"\\ud800"', b'"\\ud83d\\ude00"', '"\U0001f600"'.encode(), b'"\xff"', b'"\xc3"'),
    *(b'"\x01"', b'"\x7f"', '"\u2028"'.encode(), b'"\\u007f"'),
    *(b'"call"', b'"result"', b'"event"', b'"Call"', b'"calls"', b'"allow"', b'"deny"'),
    *(b'"maybe"', b'"tool_failed"', b'"policy_denied"', b'"nope"', b'"Tool_failed"'),
    *(b'"run_created"', b'"x"', b'"e' + b"e" * 63 + b'"', b'"e' + b"e" * 64 + b'"'),
    *(b'"run_created\\n"', b'"run_created\\n\\n"', b'"Run Created"', b'"_x"', b'"9x"'),
    *(b'"' + DIGEST.encode() + b'"', b'"' + DIGEST.encode() + b'\\n"'),
    *(b'"' + DIGEST.upper().encode() + b'"', b'"md5:abc"', b'"sha256:' + b"ab" * 31 + b'"'),
    *(b'"' + HEX.encode() + b'"', b'"' + HEX.upper().encode() + b'"', b'"' + b"g" * 64 + b'"'),
    *(
        b'"' + HEX[:63].encode() + b'"',
        b'"' + HEX.encode() + b'0"',
        b'"' + HEX[:63].encode() + b'\\n"',
    ),
    *(b'"2026-11-22T13:40:01.123456Z"', b'"2026-11-22T13:40:01.123456Z\\n"'),
    *(
        b'"2026-11-22T13:40:01Z"',
        b'"2026-11-22 13:40:01.123456Z"',
        b'"\\u0032026-11-22T13:40:01.123456Z"',
    ),
    *(b'{"pid":1,"uid":2,"gid":3}', b'{"uid":2,"pid":1,"gid":3}', b'{"pid":1,"uid":2}'),
    *(
        b'{"pid":1,"uid":2,"gid":3,"x":4}',
        b'{"pid":1,"uid":2,"gid":true}',
        b'{"pid":1.0,"uid":2,"gid":3}',
    ),
    *(
        b'{"pid":1,"uid":2,"gid":3,"gid":3}',
        b'{"pid":1,"uid":2,"gid":null}',
        b'{"pid":-1,"uid":2,"gid":3}',
    ),
    *(b"{}", b"[]", b'{"a":1}', b'{"a":1,"a":1}', b'{"a":{"b":[1,2.5,"x",null,true]}}'),
    *(b'{"a":NaN}', b'{"a":1e400}', b'{"a":1E2}', b'{"a":100.0}', b'{"a":1e16}', b'{"a":1e+16}'),
    *(b'{"a":0.00001}', b'{"a":1e-05}', b'{"a":"\\ud800"}', b'{"\\ud800":1}', b'{"a":"\xff"}'),
    *(b'{"a":' + b"1" * 4301 + b"}", b'{"a": 1}', b'{ "a":1}', b'{"a":-0}', b'{"a":"\\u00e9"}'),
    *(b'{"a":' + b"[" * 100 + b"]" * 100 + b"}", b'{"a":' + b"[" * 3000 + b"]" * 3000 + b"}"),
    b'{"a":' + b'{"b":' * 150 + b"1" + b"}" * 150 + b"}",
    b'{"a":' + b'{"b":' * 3000 + b"1" + b"}" * 3000 + b"}",
]
_KEYS = [*AuditEntry.__struct_fields__, "hash", "color", "Seq", ""]
INTERESTING_BYTES = b'"\\{}[],:0-+eE.nNtfu \x00\x01\x1f\x7f\x80\xc3\xed\xff'

_ids = st.text(min_size=1, max_size=128) | st.sampled_from(["r", "r" * 128, "\U0001f600" * 128])
_json_scalar = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
_json_value = st.recursive(
    _json_scalar,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


def _maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.none() | strategy


@st.composite
def written_bodies(draw: st.DrawFn) -> bytes:
    """A body as the writer makes it."""
    kind = draw(st.sampled_from(["call", "result", "event"]))
    fields: dict[str, Any] = {
        "runId": draw(_maybe(_ids)),
        "toolCallId": draw(_maybe(_ids)),
        "tool": draw(_maybe(_ids)),
        "argsDigest": draw(_maybe(st.just(DIGEST))),
        "argsSummary": draw(_maybe(st.dictionaries(st.text(max_size=6), _json_value, max_size=3))),
        "decision": draw(_maybe(st.sampled_from(["allow", "deny"]))),
        "errorCode": draw(_maybe(st.sampled_from(sorted(ErrorCode)))),
        "safeMessage": draw(_maybe(st.text(max_size=40))),
        "durationMs": draw(_maybe(st.floats(min_value=0, max_value=1e12))),
        "outputDigest": draw(_maybe(st.just(DIGEST))),
        "outputBytes": draw(_maybe(st.integers(min_value=0, max_value=2**70))),
        "peer": draw(
            _maybe(st.fixed_dictionaries({k: st.integers() for k in ("pid", "uid", "gid")}))
        ),
        "detail": draw(_maybe(st.dictionaries(st.text(max_size=6), _json_value, max_size=3))),
        "review": draw(_maybe(st.dictionaries(st.text(max_size=6), _json_value, max_size=2))),
        "degraded": draw(_maybe(st.text(min_size=1, max_size=20))),
        "event": draw(st.from_regex(r"[a-z][a-z0-9_]{0,63}", fullmatch=True))
        if kind == "event"
        else None,
    }
    seq = draw(st.integers(min_value=1, max_value=2**70))
    return build_body(seq, format_time(draw(st.integers(0, 2**62))), kind, fields, HEX)


def _pairs(body: bytes) -> list[tuple[bytes, bytes]]:
    """A written body's keys and value texts, in order (each value's text is its
    compact encoding, as in the body)."""
    return [
        (msgspec.json.encode(key), msgspec.json.encode(value))
        for key, value in json.loads(body).items()
    ]


def _join(pairs: list[tuple[bytes, bytes]], colon: bytes = b":", comma: bytes = b",") -> bytes:
    return b"{" + comma.join(key + colon + value for key, value in pairs) + b"}"


def mutated(body: bytes, rng: random.Random) -> bytes:
    """``body`` with up to three edits of its fields, then up to two of its bytes."""
    pairs = _pairs(body)
    colon, comma = b":", b","
    for _ in range(rng.randint(0, 3)):
        what = rng.choice(["value", "value", "add", "drop", "repeat", "move", "space"])
        at = rng.randrange(len(pairs)) if pairs else 0
        if what == "value" and pairs:
            pairs[at] = (pairs[at][0], rng.choice(_TEXT))
        elif what == "add":
            key = msgspec.json.encode(rng.choice(_KEYS))
            pairs.insert(rng.randint(0, len(pairs)), (key, rng.choice(_TEXT)))
        elif what == "drop" and pairs:
            del pairs[at]
        elif what == "repeat" and pairs:
            pairs.insert(rng.randint(0, len(pairs)), pairs[at])
        elif what == "move" and pairs:
            pairs.insert(rng.randint(0, len(pairs) - 1), pairs.pop(at))
        elif what == "space":
            colon, comma = rng.choice([(b": ", b","), (b":", b", "), (b":", b"\n,")])
    out = bytearray(_join(pairs, colon, comma))
    for _ in range(rng.choice([0, 0, 1, 2])):
        at = rng.randint(0, len(out))
        byte = bytes([rng.choice(INTERESTING_BYTES)])
        how = rng.choice(["insert", "delete", "replace"])
        if how == "insert":
            out[at:at] = byte
        elif at < len(out):
            out[at : at + 1] = b"" if how == "delete" else byte
    return bytes(out)


@settings(max_examples=examples(150), deadline=None)
@given(body=written_bodies())
def test_every_body_the_writer_makes_is_read_as_gatewayd_s(body: bytes) -> None:
    assert msgspec_accepts(body)
    assert entryform_accepts(body)


@settings(max_examples=examples(200), deadline=None)
@given(body=written_bodies(), seed=st.integers(0, 2**32))
def test_a_mutated_body_gets_the_verdict_the_writer_s_schema_gives_it(
    body: bytes, seed: int
) -> None:
    # Many mutants of each written body (drawing each from hypothesis costs more than
    # checking it); the verdicts must agree on every one.
    rng = random.Random(seed)
    for _ in range(40):
        assert_one_verdict(mutated(body, rng))


def _with_field(key: str, text: bytes) -> bytes:
    """A written body with ``key`` holding ``text``, in its place in the schema's order
    (after seq, for a key the schema does not have)."""
    kind = "event" if key in ("event", "kind") else "result"
    pairs = _pairs(body_of(kind, {"event": "run_created"} if kind == "event" else {}))
    encoded = msgspec.json.encode(key)
    order = list(AuditEntry.__struct_fields__)
    place = order.index(key) if key in order else 1
    kept = [(k, v) for k, v in pairs if k != encoded]
    index = sum(1 for k, _ in kept if json.loads(k) in order[:place])
    return _join([*kept[:index], (encoded, text), *kept[index:]])


def test_each_tricky_value_in_each_field_gets_one_verdict() -> None:
    differ = [
        (key, text[:60])
        for key in _KEYS
        for text in _TEXT
        if entryform_accepts(body := _with_field(key, text)) != msgspec_accepts(body)
    ]
    assert differ == []


def test_the_corpus_holds_both_verdicts_for_every_field() -> None:
    # The equivalence means something only if each field is both accepted and refused.
    seen = {
        key: {msgspec_accepts(_with_field(key, text)) for text in _TEXT}
        for key in AuditEntry.__struct_fields__
    }
    assert {key: verdicts for key, verdicts in seen.items() if verdicts != {True, False}} == {}


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (
            b'{"seq":1,"time":"t","kind":"call","detail":{"a":"\xff"},"prev":"'
            + HEX.encode()
            + b'"}',
            "not UTF-8",
        ),
        (b"[1]", "not an object"),
        (
            b'{"seq":1,"time":"2026-11-22T13:40:01.123456Z","kind":"call"}',
            "missing required field 'prev'",
        ),
        (
            b'{"seq":true,"time":"t","kind":"call","prev":"' + HEX.encode() + b'"}',
            "seq: expected an integer",
        ),
        (
            b'{"seq":1,"time":"t","kind":"call","color":1,"prev":"' + HEX.encode() + b'"}',
            "unknown field 'color'",
        ),
        (
            b'{"seq":1,"time":"t","kind":"call","detail":' + b"[" * 5000 + b"]" * 5000 + b"}",
            "nests too deeply",
        ),
        (
            b'{"seq": 1,"time":"2026-11-22T13:40:01.123456Z","kind":"call","prev":"'
            + HEX.encode()
            + b'"}',
            "not in the form gatewayd writes",
        ),
    ],
)
def test_a_refusal_says_why(body: bytes, why: str) -> None:
    with pytest.raises(EntryFormatError, match=why):
        decode_body(body)
    assert not msgspec_accepts(body)


def test_a_read_entry_has_each_field_as_an_attribute() -> None:
    fields = {"runId": "r1", "durationMs": 2.5, "peer": {"pid": 1, "uid": 2, "gid": 3}}
    entry = decode_body(body_of("result", fields))
    assert (entry.seq, entry.kind, entry.runId, entry.durationMs) == (7, "result", "r1", 2.5)
    assert entry.peer == {"pid": 1, "uid": 2, "gid": 3}
    assert entry.tool is None and entry.detail is None  # absent
    assert entry.prev == HEX


def test_the_reader_s_schema_names_the_writer_s_fields_in_its_order() -> None:
    # The form check reads the key order from entryform's table: it must be the order
    # msgspec writes (the Struct's), every field, and the same ones required.
    fields = msgspec.structs.fields(AuditEntry)
    assert list(entryform._TYPES) == [f.encode_name for f in fields]
    assert list(entryform._REQUIRED) == [f.encode_name for f in fields if f.required]
