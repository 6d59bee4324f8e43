"""One parse per request: the msgspec-only path of ``decode_body`` accepts exactly the
bodies the two-step path (strictjson's check, then msgspec) accepts, with the same
value, and leaves every refusal to that path so its words do not change."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gatewayd import protocol, strictjson
from gatewayd.protocol import FrameError, RequestReceived, decode_body
from tests.hypothesis_counts import examples

HEAD = b'"v":1,"runId":"run-1","toolCallId":"c-1","tool":"fs.read"'


def two_step(body: bytes) -> RequestReceived | FrameError:
    """The decoding every body got before the one-parse path: the reference."""
    try:
        strictjson.check(body)
        request = protocol._request_decoder.decode(body)
    except strictjson.JsonInputError as exc:
        return protocol._bad_request(
            f"frame body is not acceptable JSON: {exc}", body, protocol._recover_id(body)
        )
    except msgspec.ValidationError as exc:
        return protocol._bad_request(f"malformed request: {exc}", body, protocol._recover_id(body))
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        return protocol._bad_request(f"frame body is not valid JSON: {exc}", body, None)
    return RequestReceived(request=request, frame_bytes=len(body))


# Bodies an attacker would try against a parser that keeps the last of two keys, or
# counts keys by colons: duplicates at each level and in each place, colons and
# escaped quotes in strings, escaped key spellings, and what strictjson refuses.
ATTACKS = [
    b"{" + HEAD + b',"args":{}}',
    b"{" + HEAD + b"}",  # args absent
    b"{" + HEAD + b',"tool":"fs.write"}',  # a top-level key twice, args absent
    b"{" + HEAD + b',"tool":"fs.write","args":{}}',
    b"{" + HEAD + b',"args":{},"args":{"path":"x"}}',
    b"{" + HEAD + b',"args":{"path":"a","path":"b"}}',
    b"{" + HEAD + b',"args":{"o":{"k":1,"k":2}}}',
    b"{" + HEAD + b',"args":{"l":[{"k":1},{"k":1,"k":2}]}}',
    b"{" + HEAD + b',"args":{"path":"a:b:c","x":"\\":\\""}}',  # colons inside strings
    b"{" + HEAD + b',"args":{"a:b":1,"a:b":2}}',  # a duplicate key that holds a colon
    b"{" + HEAD + b',"args":{"\\u0070ath":"a","path":"b"}}',  # one key, two spellings
    b"{" + HEAD + b',"\\u0061rgs":{}}',
    b"{" + HEAD + b',"\\u0061rgs":{},"args":{"path":"x"}}',
    b'{"v":1,"runId":"run-1","toolCallId":"c:1","tool":"fs.read","args":{}}',
    b'{"v":1,"runId":"run-1","toolCallId":"c:1","toolCallId":"c:2","tool":"fs.read"}',
    b"{" + HEAD + b' , "args" : { "k" : 1 } }',  # whitespace around colons
    b"{" + HEAD + b',"args":{"n":NaN}}',
    b"{" + HEAD + b',"args":{"n":Infinity}}',
    b"{" + HEAD + b',"args":{"n":1e999}}',
    b"{" + HEAD + b',"args":{"n":' + b"9" * 4301 + b"}}",
    b"{" + HEAD + b',"args":{"n":' + b"9" * 4300 + b"}}",
    b"{" + HEAD + b',"args":{"s":"\\ud800"}}',  # a lone surrogate escape
    b"{" + HEAD + b',"args":{"s":"\xff"}}',  # not UTF-8
    b"\xef\xbb\xbf{" + HEAD + b"}",  # a byte order mark
    b"{" + HEAD + b',"args":{"d":' + b"[" * 64 + b"]" * 64 + b"}}",
    b"{" + HEAD + b',"args":{"d":' + b"[" * 70 + b"]" * 70 + b"}}",
    b"{" + HEAD + b',"args":{"d":' + b"[" * 5000 + b"]" * 5000 + b"}}",
    b"{" + HEAD + b',"args":{"d":"' + b"[" * 100 + b'"}}',  # brackets in a string
    b"{" + HEAD + b',"extra":1}',
    b'{"v":2,"runId":"run-1","toolCallId":"c-1","tool":"fs.read"}',
    b'{"v":1,"runId":"run-1","toolCallId":"bad id","tool":"fs.read"}',
    b'{"v":1,"runId":"run 1","toolCallId":"c-1","tool":"fs.read"}',
    b'{"v":1,"runId":"run-1","toolCallId":"c-1","tool":"Not.A.Tool"}',
    b'{"v":1,"runId":"run-1","toolCallId":"c-1","tool":"fs.read","args":[]}',
    b'{"v":true,"runId":"run-1","toolCallId":"c-1","tool":"fs.read"}',
    b"[]",
    b"",
    b"{" + HEAD + b',"args":{}} trailing',
]


@pytest.mark.parametrize("body", ATTACKS)
def test_every_body_decodes_as_the_two_step_path_decodes_it(body: bytes) -> None:
    assert decode_body(body) == two_step(body)


def test_a_key_twice_is_refused_with_strictjsons_words_at_every_level() -> None:
    for body in ATTACKS[2:8]:
        event = decode_body(body)
        assert isinstance(event, FrameError)
        assert event.code is protocol.ErrorCode.BAD_REQUEST
        assert "appears twice in one object" in event.message
        assert event.tool_call_id == "c-1"  # recovered, so the refusal names the call


def test_a_plain_request_is_parsed_once_without_strictjson(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_second_parse(_data: bytes | str, **_kw: Any) -> None:
        raise AssertionError("strictjson.check ran for a body the one parse proved")

    monkeypatch.setattr(strictjson, "check", no_second_parse)
    for body in (ATTACKS[0], ATTACKS[1], ATTACKS[8], ATTACKS[13], ATTACKS[15]):
        event = decode_body(body)
        assert isinstance(event, RequestReceived), body


def test_keys_in_counts_only_colons_outside_strings() -> None:
    assert strictjson.keys_in(b"[1,2]") == 0
    assert strictjson.keys_in(b'{"a":1,"b":{"c":"x:y"}}') == 3
    assert strictjson.keys_in(b'{"a\\":b":"\\"c:d"}') == 1
    assert not strictjson.nests_deeper(b"[" * 64 + b"]" * 64)
    assert strictjson.nests_deeper(b"[" * 65 + b"]" * 65)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet=':"\\ab{}[]\u00e9', max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.lists(st.tuples(st.sampled_from(["a", "b", "a:b", '"', "é"]), inner), max_size=4)
    ),
    max_leaves=12,
)


def _render(value: Any) -> str:
    """JSON text that may hold a key twice: objects are lists of (key, value) pairs."""
    if isinstance(value, list) and value and all(isinstance(v, tuple) for v in value):
        return "{" + ",".join(f"{json.dumps(k)}:{_render(v)}" for k, v in value) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_render(v) for v in value) + "]"
    return json.dumps(value)


@settings(max_examples=examples(300), deadline=None)
@given(args=st.lists(st.tuples(st.sampled_from(["a", "b", "a:b"]), JSON_VALUES), max_size=4))
def test_any_args_with_or_without_duplicates_decode_as_before(
    args: list[tuple[str, Any]],
) -> None:
    pairs = ",".join(f"{json.dumps(k)}:{_render(v)}" for k, v in args)
    data = ("{" + HEAD.decode() + ',"args":{' + pairs + "}}").encode()
    assert decode_body(data) == two_step(data)


# Fragments that change a valid body's meaning in the ways the key count could miss:
# a key again, a colon or quote inside or outside a string, an escape, a bracket.
FRAGMENTS = [b'"args":{},', b'"v":1,', b'"k":', b":", b'"', b"\\", b'\\"', b"{", b"}", b"[", b","]


@settings(max_examples=examples(500), deadline=None)
@given(
    edits=st.lists(
        st.tuples(st.integers(min_value=0, max_value=200), st.sampled_from(FRAGMENTS)),
        min_size=1,
        max_size=3,
    )
)
def test_a_body_with_fragments_spliced_in_decodes_as_before(edits: list[tuple[int, bytes]]) -> None:
    body = b"{" + HEAD + b',"args":{"path":"a:b","o":{"k":[1,{"q":"\\":"}]}}}'
    for at, fragment in edits:
        cut = at % (len(body) + 1)
        body = body[:cut] + fragment + body[cut:]
    assert decode_body(body) == two_step(body)
