"""The hash-line primitives, the entry schema and its caps, and the chain recipe. Pure."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gatewayd.audit import (
    GENESIS,
    MAX_ARGS_SUMMARY_BYTES,
    MAX_DETAIL_BYTES,
    MAX_LINE_BYTES,
    MAX_SAFE_MESSAGE_CHARS,
    ChainPosition,
    Peer,
    read_entries,
    verify_file,
)
from gatewayd.audit.chain import Chain, LineDefect, LineError, follows, read_line
from gatewayd.audit.entry import build_body, format_time
from gatewayd.audit.entryform import decode_body
from gatewayd.audit.line import GENESIS_HASH, HASH_SUFFIX_BYTES, LineFormatError, seal, unseal
from gatewayd.protocol import ErrorCode
from tests.hypothesis_counts import examples

# 2026-11-22T13:40:01.123456Z
FIXED_NS = 1_795_354_801_123_456_789
PEER = {"pid": 7, "uid": 1000, "gid": 1000}
DIGEST = "sha256:" + "ab" * 32


def fixed_clock() -> int:
    return FIXED_NS


# --- primitives ---------------------------------------------------------------------


def test_sealed_line_is_body_with_its_sha256_spliced_in_as_the_last_key() -> None:
    body = b'{"seq":1,"prev":"' + GENESIS_HASH.encode() + b'"}'
    line, digest = seal(body)
    expected = hashlib.sha256(body).hexdigest()
    assert digest == expected
    assert line == body[:-1] + b',"hash":"' + expected.encode() + b'"}\n'
    assert list(json.loads(line)) == ["seq", "prev", "hash"]
    assert unseal(line[:-1]) == (body, expected)
    assert len(line) - 1 - len(body) + 1 == HASH_SUFFIX_BYTES


@pytest.mark.parametrize(
    ("line", "why"),
    [
        (b"", "too short"),
        (b"[" + b"0" * 100 + b"]", "does not start with"),
        (b'{"seq":1,"hash":"' + b"a" * 64 + b'"]', 'does not end with ,"hash"'),
        (b'{"seq":1,"hash":"' + b"A" * 64 + b'"}', "not 64 lowercase hex"),
        (b'{"seq":1,"hash":"' + b"a" * 63 + b'"}', 'does not end with ,"hash"'),
    ],
)
def test_unseal_rejects_lines_without_the_sealed_shape(line: bytes, why: str) -> None:
    with pytest.raises(LineFormatError, match=why):
        unseal(line)


def test_seal_refuses_a_body_that_is_not_a_json_object() -> None:
    with pytest.raises(ValueError, match="compact JSON object"):
        seal(b"[1,2]")


def test_read_line_tells_a_tampered_line_from_a_broken_one() -> None:
    chain = Chain(clock=fixed_clock)
    _, _, line = chain.append("event", {"event": "audit_open"})
    content = line[:-1]
    assert read_line(content).entry.seq == 1
    edited = content.replace(b"audit_open", b"audit_opem")
    with pytest.raises(LineError) as tampered:
        read_line(edited)
    assert tampered.value.defect is LineDefect.TAMPERED
    with pytest.raises(LineError) as broken:
        read_line(content[:50])
    assert broken.value.defect is LineDefect.BROKEN


def test_rehashed_line_not_in_gatewayd_form_is_broken() -> None:
    """Someone who knows the recipe still has to write exactly what gatewayd writes."""
    spaced = b'{"seq": 1, "time": "2026-11-22T13:40:01.123456Z", "kind": "event", '
    spaced += b'"event": "audit_open", "prev": "' + GENESIS_HASH.encode() + b'"}'
    line, _ = seal(spaced)
    with pytest.raises(LineError, match="not in the form gatewayd writes") as info:
        read_line(line[:-1])
    assert info.value.defect is LineDefect.BROKEN


# --- entries ------------------------------------------------------------------------


def test_time_is_rfc3339_utc_with_microseconds() -> None:
    assert format_time(FIXED_NS) == "2026-11-22T13:40:01.123456Z"
    assert format_time(0) == "1970-01-01T00:00:00.000000Z"


def test_a_chain_writes_each_entry_time_as_format_time_across_seconds_and_back() -> None:
    # The chain formats only the microseconds of entries in the second of the last one.
    moments = [FIXED_NS, FIXED_NS + 1_000, FIXED_NS + 876_543_210, FIXED_NS + 876_543_211_000]
    moments += [FIXED_NS - 2_000_000_000, 0, 999, FIXED_NS]
    now = iter(moments)
    chain = Chain(clock=lambda: next(now))
    for ns in moments:
        _, _, line = chain.append("event", {"event": "audit_open"})
        assert json.loads(line)["time"] == format_time(ns)


def test_keys_are_in_the_documented_order_and_absent_fields_are_omitted() -> None:
    chain = Chain(clock=fixed_clock)
    fields: dict[str, Any] = {
        "detail": {"k": 1},
        "event": None,
        "peer": PEER,
        "outputBytes": 12,
        "outputDigest": DIGEST,
        "durationMs": 3,
        "safeMessage": "fine",
        "errorCode": ErrorCode.TOOL_FAILED,
        "decision": "deny",
        "argsSummary": {"path": "/w"},
        "argsDigest": DIGEST,
        "tool": "fs.read",
        "toolCallId": "c1",
        "runId": "r1",
    }
    _, _, line = chain.append("result", fields)
    decoded = json.loads(line)
    assert list(decoded) == [
        "seq", "time", "kind", "runId", "toolCallId", "tool", "argsDigest", "argsSummary",
        "decision", "errorCode", "safeMessage", "durationMs", "outputDigest", "outputBytes",
        "peer", "detail", "prev", "hash",
    ]  # fmt: skip
    assert decoded["durationMs"] == 3.0
    assert b'"durationMs":3.0' in line  # always a float, so it reads back byte for byte
    assert decoded["errorCode"] == "tool_failed"
    assert decoded["prev"] == GENESIS_HASH


def test_first_entry_is_seq_1_after_genesis_and_each_names_the_hash_before_it() -> None:
    chain = Chain(clock=fixed_clock)
    seq1, hash1, line1 = chain.append("event", {"event": "audit_open"})
    seq2, hash2, line2 = chain.append("call", {"tool": "fs.read", "decision": "allow"})
    assert (seq1, seq2) == (1, 2)
    first, second = read_line(line1[:-1]), read_line(line2[:-1])
    assert first.entry.prev == GENESIS_HASH
    assert second.entry.prev == hash1
    assert follows(GENESIS, first)
    assert follows(first.position, second)
    assert not follows(GENESIS, second)
    assert chain.position == ChainPosition(2, hash2)


def test_a_chain_resumes_after_a_given_position() -> None:
    chain = Chain(ChainPosition(41, "c" * 64), clock=fixed_clock)
    seq, _, line = chain.append("event", {"event": "audit_open"})
    assert seq == 42
    assert read_line(line[:-1]).entry.prev == "c" * 64


@pytest.mark.parametrize(
    ("kind", "fields", "message"),
    [
        ("calls", {}, "Invalid enum value 'calls'"),
        ("call", {"color": "red"}, "unknown field `color`"),
        ("event", {}, "kind 'event' needs an event name"),
        ("call", {"event": "run_created"}, "kind 'event' needs an event name"),
        ("event", {"event": "Run Created"}, "matching regex"),
        ("call", {"argsDigest": "md5:abc"}, "matching regex"),
        ("result", {"errorCode": "nope"}, "Invalid enum value 'nope'"),
        ("call", {"decision": "maybe"}, "Invalid enum value 'maybe'"),
        ("call", {"runId": "r" * 129}, "length <= 128"),
        ("call", {"toolCallId": ""}, "length >= 1"),
        ("result", {"durationMs": float("nan")}, "durationMs"),
        ("result", {"durationMs": -1.0}, ">= 0.0"),
        ("result", {"outputBytes": -1}, ">= 0"),
        ("result", {"outputBytes": True}, "got `bool`"),
        ("call", {"peer": {"pid": 1, "uid": 2}}, "missing required field `gid`"),
        ("call", {"argsSummary": ["not", "an", "object"]}, "Expected `object | null`"),
        ("event", {"event": "x", "detail": {1: "int key"}}, "Expected `str`"),
    ],
)
def test_invalid_fields_are_refused_naming_the_field_and_what_it_may_hold(
    kind: str, fields: dict[str, Any], message: str
) -> None:
    chain = Chain(clock=fixed_clock)
    with pytest.raises(ValueError, match="invalid audit entry") as info:
        chain.append(kind, fields)
    assert message in str(info.value)
    assert chain.position == GENESIS  # nothing was sealed


# What the dispatcher records unchecked: a call's two entries, built from typed values.
_UNCHECKED_CALL: dict[str, Any] = {
    "runId": "0123456789abcdef0123456789abcdef",
    "toolCallId": "c-1",
    "tool": "fs.read",
    "argsDigest": DIGEST,
    "argsSummary": {"path": "notes.md"},
    "decision": "allow",
    "peer": Peer(pid=7, uid=1000, gid=1000),
    "review": {"verdict": "allow"},
    "degraded": "no OS sandbox: off",
    "detail": {"approvalId": "a1"},
}
_UNCHECKED_RESULT: dict[str, Any] = {
    "runId": "0123456789abcdef0123456789abcdef",
    "toolCallId": "c-1",
    "tool": "fs.read",
    "errorCode": str(ErrorCode.TOOL_FAILED),
    "safeMessage": "x" * 5000,
    "durationMs": 0.25,
    "outputDigest": DIGEST,
    "outputBytes": 12,
}


@pytest.mark.parametrize(
    ("kind", "fields"), [("call", _UNCHECKED_CALL), ("result", _UNCHECKED_RESULT)]
)
def test_an_entry_built_unchecked_is_byte_for_byte_the_checked_one(
    kind: str, fields: dict[str, Any]
) -> None:
    when = format_time(FIXED_NS)
    body = build_body(1, when, kind, fields, GENESIS_HASH, checked=False)
    assert body == build_body(1, when, kind, fields, GENESIS_HASH)
    decode_body(body)  # and reads back as gatewayd's


@pytest.mark.parametrize(
    ("kind", "fields", "message"),
    [
        ("call", {"color": "red"}, "unknown field `color`"),
        ("call", {"runId": "r" * 129}, "length <= 128"),
        ("call", {"toolCallId": ""}, "length >= 1"),
        ("call", {"degraded": "d" * 501}, "length <= 500"),
        ("call", {"tool": 7}, "Expected `str | null`, got `int`"),
        ("call", {"event": "run_created"}, "kind 'event' needs an event name"),
        ("call", {"detail": {"at": object()}}, "unsupported"),
        # A clock that stepped back, went wrong, or gives ints.
        ("result", {"durationMs": -1.0}, "Expected `float` >= 0.0"),
        ("result", {"durationMs": float("nan")}, "Expected `float` >= 0.0"),
        ("result", {"durationMs": 2e12}, "Expected `float` <= 1000000000000.0"),
    ],
)
def test_what_a_caller_can_get_wrong_is_refused_unchecked_too(
    kind: str, fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match="invalid audit entry") as info:
        build_body(1, format_time(FIXED_NS), kind, fields, GENESIS_HASH, checked=False)
    assert message in str(info.value)


def test_an_int_duration_unchecked_is_written_as_the_checked_path_writes_it() -> None:
    # A clock that gives ints: encoded as it is, "5" would not read back as gatewayd's.
    when = format_time(FIXED_NS)
    body = build_body(1, when, "result", {"durationMs": 5}, GENESIS_HASH, checked=False)
    assert body == build_body(1, when, "result", {"durationMs": 5}, GENESIS_HASH)
    assert decode_body(body).durationMs == 5.0


def test_an_oversize_object_is_capped_unchecked_too() -> None:
    big = {"blob": "y" * (MAX_ARGS_SUMMARY_BYTES + 10)}
    when = format_time(FIXED_NS)
    body = build_body(1, when, "call", {"argsSummary": big}, GENESIS_HASH, checked=False)
    assert body == build_body(1, when, "call", {"argsSummary": big}, GENESIS_HASH)
    assert "omitted" in (decode_body(body).argsSummary or {})


def test_long_safe_message_is_cut_to_the_cap_with_a_visible_mark() -> None:
    body = build_body(1, format_time(FIXED_NS), "result", {"safeMessage": "x" * 5000}, GENESIS_HASH)
    message = decode_body(body).safeMessage
    assert message is not None
    assert len(message) == MAX_SAFE_MESSAGE_CHARS
    assert message.endswith("…")


@pytest.mark.parametrize(
    ("name", "kind", "extra", "cap"),
    [
        ("argsSummary", "call", {}, MAX_ARGS_SUMMARY_BYTES),
        ("detail", "event", {"event": "run_created"}, MAX_DETAIL_BYTES),
    ],
)
def test_oversize_object_is_replaced_by_a_marker_holding_its_size_and_digest(
    name: str, kind: str, extra: dict[str, Any], cap: int
) -> None:
    big = {"blob": "y" * (cap + 10)}
    encoded = msgspec.json.encode(big)
    body = build_body(1, format_time(FIXED_NS), kind, {name: big, **extra}, GENESIS_HASH)
    assert len(body) < MAX_LINE_BYTES
    marker = getattr(decode_body(body), name)
    assert marker == {
        "omitted": f"{name} of {len(encoded)} bytes is over the {cap}-byte cap",
        "bytes": len(encoded),
        "sha256": hashlib.sha256(encoded).hexdigest(),
    }
    small = {"blob": "y" * 100}
    body = build_body(1, format_time(FIXED_NS), kind, {name: small, **extra}, GENESIS_HASH)
    assert getattr(decode_body(body), name) == small  # under the cap: kept as is


def test_every_field_at_its_limit_still_fits_one_line() -> None:
    worst = "\x01" * 128  # control characters are escaped to 6 bytes each
    fields = {
        "runId": worst,
        "toolCallId": worst,
        "tool": worst,
        "argsDigest": DIGEST,
        "argsSummary": {"s": "\x01" * (MAX_ARGS_SUMMARY_BYTES // 6 - 3)},
        "decision": "deny",
        "errorCode": "internal",
        "safeMessage": "\x01" * 5000,
        "durationMs": 1e12,
        "outputDigest": DIGEST,
        "outputBytes": 2**63,
        "peer": PEER,
        "event": "e" * 64,
        "detail": {"s": "\x01" * (MAX_DETAIL_BYTES // 6 - 3)},
    }
    _, _, line = Chain(clock=fixed_clock).append("event", fields)
    assert len(line) <= MAX_LINE_BYTES


# --- properties ---------------------------------------------------------------------

_json_scalar = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
_json_value = st.recursive(
    _json_scalar,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_ids = st.text(min_size=1, max_size=128)
_digests = st.binary(max_size=8).map(lambda b: "sha256:" + hashlib.sha256(b).hexdigest())


def _maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.none() | strategy


@st.composite
def _records(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    kind = draw(st.sampled_from(["call", "result", "event"]))
    fields: dict[str, Any] = {
        "runId": draw(_maybe(_ids)),
        "toolCallId": draw(_maybe(_ids)),
        "tool": draw(_maybe(_ids)),
        "argsDigest": draw(_maybe(_digests)),
        "argsSummary": draw(_maybe(st.dictionaries(st.text(max_size=8), _json_value, max_size=4))),
        "decision": draw(_maybe(st.sampled_from(["allow", "deny"]))),
        "errorCode": draw(_maybe(st.sampled_from([c.value for c in ErrorCode]))),
        "safeMessage": draw(_maybe(st.text(max_size=600))),
        "durationMs": draw(_maybe(st.floats(min_value=0, max_value=1e12))),
        "outputDigest": draw(_maybe(_digests)),
        "outputBytes": draw(_maybe(st.integers(min_value=0, max_value=2**64))),
        "peer": draw(_maybe(st.fixed_dictionaries({k: st.integers() for k in PEER}))),
        "detail": draw(_maybe(st.dictionaries(st.text(max_size=8), _json_value, max_size=4))),
        "event": draw(st.from_regex(r"[a-z][a-z0-9_]{0,20}", fullmatch=True))
        if kind == "event"
        else None,
    }
    return kind, fields


@settings(
    max_examples=examples(40),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(records=st.lists(_records(), min_size=1, max_size=12), start=st.integers(0, 2**40))
def test_any_sequence_of_records_verifies_and_reads_back(
    tmp_path: Path, records: list[tuple[str, dict[str, Any]]], start: int
) -> None:
    clock_ns = iter(range(start, start + 10**12, 1_000_003))
    chain = Chain(clock=lambda: next(clock_ns))
    path = tmp_path / "prop.jsonl"
    path.write_bytes(b"".join(chain.append(kind, fields)[2] for kind, fields in records))
    report = verify_file(path)
    assert report.ok, report.render()
    assert report.entries == len(records)
    assert report.last_hash == chain.position.hash
    for (kind, fields), read in zip(records, read_entries(path), strict=True):
        assert read["kind"] == kind
        for name, value in fields.items():
            if value is None:
                assert name not in read
            elif name == "safeMessage":
                assert read[name] == (
                    value
                    if len(value) <= MAX_SAFE_MESSAGE_CHARS
                    else value[: MAX_SAFE_MESSAGE_CHARS - 1] + "…"
                )
            elif name == "durationMs":
                assert read[name] == float(value)
            else:
                assert read[name] == value


@given(detail=st.dictionaries(st.text(max_size=8), _json_value | st.floats(), max_size=6))
def test_any_json_detail_reads_back_byte_for_byte(detail: dict[str, Any]) -> None:
    """The canonical-form check in decode_body must accept everything gatewayd writes."""
    body = build_body(3, format_time(FIXED_NS), "event", {"event": "x", "detail": detail}, "d" * 64)
    entry = decode_body(body)
    assert entry.seq == 3
    assert msgspec.json.encode(entry.as_dict()) == body


def test_checks_survive_python_O(tmp_path: Path) -> None:
    """No check relies on assert: a tampered log still fails under ``python -O``."""
    chain = Chain(clock=fixed_clock)
    path = tmp_path / "audit.jsonl"
    lines = [chain.append("event", {"event": f"e{i}"})[2] for i in range(3)]
    path.write_bytes(b"".join(lines).replace(b'"e1"', b'"e2"'))
    script = (
        "import sys; from pathlib import Path; from gatewayd.audit import verify_file; "
        "r = verify_file(Path(sys.argv[1])); print(r.render()); sys.exit(0 if r.ok else 3)"
    )
    done = subprocess.run(
        [sys.executable, "-O", "-c", script, str(path)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert "line 2" in done.stdout
    assert "tampered" in done.stdout
