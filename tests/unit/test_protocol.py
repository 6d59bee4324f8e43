"""The sans-IO protocol, without a socket: framing, validation, error events."""

from __future__ import annotations

import json
import struct

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gatewayd.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    NEED_DATA,
    ErrorCode,
    FrameDecoder,
    FrameError,
    Request,
    RequestReceived,
    Response,
    encode_frame,
    encode_request,
    encode_response,
    error_response,
    ok_response,
)
from tests.hypothesis_counts import examples

HEADER = struct.Struct(">I")
RUN = "a" * 32


def body(**over: object) -> bytes:
    obj = {"v": 1, "runId": RUN, "toolCallId": "c1", "tool": "fs.read", "args": {"path": "x"}}
    obj.update(over)
    return json.dumps({k: v for k, v in obj.items() if v is not ...}).encode()


def test_error_codes_are_exactly_the_closed_set() -> None:
    assert {c.value for c in ErrorCode} == {
        "bad_request",
        "too_large",
        "run_mismatch",
        "authz_denied",
        "unknown_tool",
        "policy_denied",
        "invalid_args",
        "review_denied",
        "rate_limited",
        "timeout",
        "tool_failed",
        "internal",
        "confirmation_required",
        "limit_exceeded",
        "approval_denied",
    }


def test_a_request_round_trips_through_the_decoder_byte_by_byte() -> None:
    req = Request(v=1, runId=RUN, toolCallId="c1", tool="fs.read", args={"path": "x"})
    data = encode_request(req)
    dec = FrameDecoder()
    for i in range(len(data)):
        assert dec.next_event() is NEED_DATA
        dec.receive_data(data[i : i + 1])
    event = dec.next_event()
    assert isinstance(event, RequestReceived) and event.request == req
    assert dec.next_event() is NEED_DATA


def test_several_frames_in_one_read_give_several_events() -> None:
    dec = FrameDecoder()
    dec.receive_data(encode_frame(body(toolCallId="a")) + encode_frame(body(toolCallId="b")))
    ids = []
    while (event := dec.next_event()) is not NEED_DATA:
        assert isinstance(event, RequestReceived)
        ids.append(event.request.toolCallId)
    assert ids == ["a", "b"]


@pytest.mark.parametrize(
    ("raw", "needle", "echoed"),
    [
        (b"{nope", "not valid JSON", None),
        (b"", "not valid JSON", None),
        (b"[]", "malformed request", None),
        (body(runId=...)[:-1] + b', "runId": "\xb2x"}', "not UTF-8", "c1"),
        (b'{"v": 1, "tool": "\xff"}', "not UTF-8 text", None),
        (body(v=2), "v=1", "c1"),
        (body(runId=...), "runId", "c1"),
        (body(tool="FS.READ"), "dotted lowercase", "c1"),
        (body(tool="a" * 200), "dotted lowercase", "c1"),
        (body(toolCallId="bad id\n"), "toolCallId", None),
        (body(toolCallId="x" * 129), "toolCallId", None),
        (body(args=[1]), "args", "c1"),
        (body(extra=1), "extra", "c1"),
        # The JSON discipline: a key twice (at the top, in args, deep in args), nesting
        # past the cap, numbers that are not JSON numbers.
        (body()[:-1] + b', "tool": "fs.write"}', "the key 'tool' appears twice", "c1"),
        (body()[:-1] + b', "runId": "other"}', "the key 'runId' appears twice", "c1"),
        (
            body(args={"path": "x"})[:-2] + b', "path": "/etc/shadow"}}',
            "'path' appears twice",
            "c1",
        ),
        (body(args={"a": [{"b": 1}]})[:-4] + b', "b": 2}]}}', "'b' appears twice", "c1"),
        (
            body(args={"a": "PLACE"}).replace(b'"PLACE"', b"[" * 100_000 + b"]" * 100_000),
            "nests 100002 levels",
            None,
        ),
        (
            body(args={"a": "PLACE"}).replace(b'"PLACE"', b'{"k":' * 65 + b"1" + b"}" * 65),
            "at most 64",
            "c1",
        ),
        (body(args={"a": "PLACE"}).replace(b'"PLACE"', b"[" * 200_000), "nests", None),
        (body(args={"n": "PLACE"}).replace(b'"PLACE"', b"NaN"), "NaN is not a JSON number", None),
        (body(args={"n": "PLACE"}).replace(b'"PLACE"', b"-Infinity"), "-Infinity is not", None),
        (body(args={"n": "PLACE"}).replace(b'"PLACE"', b"1e999"), "overflows to infinity", "c1"),
        (
            body(args={"n": "PLACE"}).replace(b'"PLACE"', b"9" * 100_000),
            "more than 4300 digits",
            "c1",
        ),
    ],
)
def test_malformed_bodies_are_bad_request_and_keep_the_stream(
    raw: bytes, needle: str, echoed: str | None
) -> None:
    dec = FrameDecoder()
    dec.receive_data(encode_frame(raw) + encode_frame(body(toolCallId="next")))
    event = dec.next_event()
    assert isinstance(event, FrameError)
    assert event.code is ErrorCode.BAD_REQUEST and not event.fatal
    assert needle in event.message
    assert event.tool_call_id == echoed
    follow = dec.next_event()
    assert isinstance(follow, RequestReceived) and follow.request.toolCallId == "next"


def test_an_oversize_frame_is_fatal_too_large_before_its_body_arrives() -> None:
    dec = FrameDecoder(max_frame_bytes=1000)
    dec.receive_data(HEADER.pack(1001))
    event = dec.next_event()
    assert isinstance(event, FrameError)
    assert event.code is ErrorCode.TOO_LARGE and event.fatal
    assert "1001" in event.message and "1000" in event.message
    dec.receive_data(body())
    assert dec.next_event() == event, "a closed decoder keeps reporting the fatal error"
    assert dec.buffered == 0


def test_default_max_frame_is_one_mebibyte_and_tiny_limits_are_refused() -> None:
    assert FrameDecoder().max_frame_bytes == DEFAULT_MAX_FRAME_BYTES == 1 << 20
    with pytest.raises(ValueError, match="64"):
        FrameDecoder(max_frame_bytes=10)


def test_responses_omit_absent_fields() -> None:
    ok = json.loads(encode_response(ok_response("c1", {"a": 1}))[4:])
    assert ok == {"v": 1, "toolCallId": "c1", "ok": True, "value": {"a": 1}}
    err = json.loads(encode_response(error_response("c1", ErrorCode.TIMEOUT, "slow"))[4:])
    assert err == {
        "v": 1,
        "toolCallId": "c1",
        "ok": False,
        "errorCode": "timeout",
        "safeMessage": "slow",
    }


def test_inconsistent_responses_cannot_be_built() -> None:
    with pytest.raises(ValueError, match="no error code"):
        Response(v=1, toolCallId="c", ok=True, errorCode=ErrorCode.INTERNAL)
    with pytest.raises(ValueError, match="needs an error code"):
        Response(v=1, toolCallId="c", ok=False)


@settings(max_examples=examples(500))
@given(st.binary(max_size=200), st.integers(min_value=64, max_value=4096))
def test_garbage_either_decodes_or_is_a_protocol_error(data: bytes, limit: int) -> None:
    dec = FrameDecoder(max_frame_bytes=limit)
    dec.receive_data(data)
    for _ in range(len(data) + 1):
        event = dec.next_event()
        if event is NEED_DATA:
            return
        assert isinstance(event, RequestReceived | FrameError)
        if isinstance(event, FrameError):
            assert event.code in (ErrorCode.BAD_REQUEST, ErrorCode.TOO_LARGE)
            if event.fatal:
                return


@given(st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5), max_size=5))
def test_any_args_object_is_carried_unchanged(args: dict[str, object]) -> None:
    req = Request(v=1, runId=RUN, toolCallId="c", tool="x.y", args=args)
    assert msgspec.json.decode(encode_request(req)[4:], type=Request).args == args


@pytest.mark.parametrize("opener", [b"[", b'{"a":'])
@pytest.mark.parametrize("where", ["unknown field", "args"])
def test_deep_nesting_is_a_bad_request_not_a_crash(opener: bytes, where: str) -> None:
    closer = b"]" if opener == b"[" else b"}"
    deep = opener * 50_000 + b"1" + closer * 50_000
    if where == "args":
        raw = body()[: -len(b'{"path": "x"}}')] + b'{"x": ' + deep + b"}}"
    else:
        raw = body()[:-1] + b', "deep": ' + deep + b"}"
    dec = FrameDecoder(max_frame_bytes=1 << 22)
    dec.receive_data(encode_frame(raw))
    event = dec.next_event()
    assert isinstance(event, FrameError)
    assert event.code is ErrorCode.BAD_REQUEST and not event.fatal
