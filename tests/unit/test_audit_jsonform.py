"""The audit readers' JSON (gatewayd.audit.jsonform) is msgspec's, read and written with
the standard library: ``loads`` refuses exactly what ``msgspec.json.decode`` refuses and
returns what it returns, ``dumps`` writes what ``msgspec.json.encode`` writes, byte for
byte. msgspec, the writer's codec, is the oracle."""

from __future__ import annotations

import math
import random
import struct
import sys
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gatewayd.audit.jsonform import JsonFormError, dumps, loads
from gatewayd.audit.line import parse_object
from tests.hypothesis_counts import examples

_DECODER = msgspec.json.Decoder()


def msgspec_verdict(content: bytes) -> tuple[bool, Any]:
    """What msgspec's decoder makes of ``content``: (accepted, value)."""
    try:
        return True, _DECODER.decode(content)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return False, None


def jsonform_verdict(content: bytes) -> tuple[bool, Any]:
    try:
        return True, loads(content)
    except JsonFormError:
        return False, None


def assert_same_reading(content: bytes) -> None:
    theirs, ours = msgspec_verdict(content), jsonform_verdict(content)
    assert ours[0] == theirs[0], (content[:200], theirs, ours)
    if theirs[0]:
        # Same value, compared by its encoding (so that -0.0 and 0.0 differ, and a
        # float is not equal to an int of its value).
        assert msgspec.json.encode(ours[1]) == msgspec.json.encode(theirs[1]), content[:200]


# Texts at each edge the two decoders could read differently.
TRICKY: list[bytes] = [
    *(b"null", b"true", b"false", b"0", b"-0", b"1", b"-1", b"01", b"1.", b".5", b"+1"),
    *(b"1.0", b"-0.0", b"1e2", b"1E2", b"1e+2", b"1e-2", b"0.1e1", b"1e400", b"-1e400"),
    *(b"1e-400", b"NaN", b"Infinity", b"-Infinity", b"nan", b"inf", b"[NaN]"),
    *(b"18446744073709551615", b"18446744073709551616", b"-9223372036854775809"),
    b"1" * 4300,
    b"1" * 4301,
    b"-" + b"1" * 4299,
    b"-" + b"1" * 4300,
    b"1" * 4300 + b".5",
    b"1" * 5000 + b"e-4990",
    b"1e" + b"1" * 5000,
    b"0." + b"1" * 5000,
    *(b'""', b'"x"', b'"\\u00e9"', b'"\\u00E9"', b'"\\U00e9"', b'"\\x41"', b'"\\/"'),
    *(b'"\\ud800"', b'"\\uDBFF"', b'"\\udc00"', b'"\\ud800x"', b'"\\ud83d\\ude00"'),
    *(b'"\\ud83d\\u0041"', b'"\\\\ud800"', b'{"\\ud800":1}', b'["a","\\udfff"]'),
    *('"é"'.encode(), '"\u2028"'.encode(), '"\U0001f600"'.encode(), '"\ufeff"'.encode()),
    *(b'"\x01"', b'"\x1f"', b'"\x7f"', b'"\t"', b'"\xff"', b'"\xc3"', b'"\xc0\x80"'),
    *(b'"\xed\xa0\x80"', b'"\xf4\x90\x80\x80"', b"\xef\xbb\xbf{}", b"\xff\xfe{\x00}\x00"),
    *(b"{}", b"[]", b" {} ", b"{} x", b"{,}", b"[1,]", b'{"a":1,}', b'{"a" 1}', b"{'a':1}"),
    *(b'{"a":1,"a":2}', b'{"a":{"b":1,"b":[2]}}', b"[1,[2,[3]]]", b"", b" ", b"\n"),
    *(b"[" * 100 + b"]" * 100, b"[" * 3000 + b"]" * 3000, b"[" * 3000),
    b'{"a":' * 150 + b"1" + b"}" * 150,
    b'{"a":' * 3000 + b"1" + b"}" * 3000,
]
# Bytes worth putting somewhere in a document: JSON's syntax, number and escape
# characters, control characters, and UTF-8 that is not.
INTERESTING_BYTES = b'"\\{}[],:0-+eE.nNtfu \x00\x01\x1f\x7f\x80\xc3\xed\xff'


@pytest.mark.parametrize("content", TRICKY, ids=lambda c: repr(c[:24]))
def test_loads_reads_each_tricky_text_as_msgspec_does(content: bytes) -> None:
    assert_same_reading(content)


def test_the_corpus_holds_both_verdicts_at_each_edge() -> None:
    # The corpus is worth something only if both sides of the edges are in it.
    verdicts = {content: msgspec_verdict(content)[0] for content in TRICKY}
    assert verdicts[b"1" * 4300] and not verdicts[b"1" * 4301]
    assert verdicts[b"-" + b"1" * 4299] and not verdicts[b"-" + b"1" * 4300]
    assert verdicts[b'"\\ud83d\\ude00"'] and not verdicts[b'"\\ud800"']
    assert verdicts[b"[" * 100 + b"]" * 100] and not verdicts[b"[" * 3000 + b"]" * 3000]
    assert verdicts[b'"\x7f"'] and not verdicts[b'"\x01"'] and not verdicts[b'"\xff"']


@settings(max_examples=examples(400), deadline=None)
@given(
    seed=st.sampled_from([*TRICKY[:60], b'{"a":[1,2.5,"x",{"b":null}],"c":true}']),
    edits=st.lists(
        st.tuples(
            st.integers(0, 10_000), st.sampled_from(list(INTERESTING_BYTES)), st.integers(0, 2)
        ),
        max_size=3,
    ),
)
def test_loads_reads_mutated_texts_as_msgspec_does(
    seed: bytes, edits: list[tuple[int, int, int]]
) -> None:
    content = bytearray(seed)
    for where, byte, how in edits:
        at = where % (len(content) + 1)
        if how == 0:
            content[at:at] = bytes([byte])  # insert
        elif at < len(content):
            content[at : at + 1] = b"" if how == 1 else bytes([byte])  # delete, replace
    assert_same_reading(bytes(content))


_json_scalar = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
_json = st.recursive(
    _json_scalar,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=16,
)


@settings(max_examples=examples(300), deadline=None)
@given(value=_json)
def test_dumps_writes_what_msgspec_writes_and_loads_reads_it_back(value: Any) -> None:
    try:
        encoded = msgspec.json.encode(value)
    except UnicodeEncodeError:  # a lone surrogate: no UTF-8 writer can write it
        return
    assert dumps(value).encode() == encoded
    assert_same_reading(encoded)


def test_dumps_writes_every_float_as_msgspec_does() -> None:
    # Python's repr and msgspec part at the exponent: 1e+16 / 1e16, 1e-05 / 0.00001,
    # 2.5e-07 / 2.5e-7. Every power of ten, each side of each edge, and random bits.
    rng = random.Random(21)
    values = [0.0, -0.0, 5e-324, 2.2250738585072014e-308, 1.7976931348623157e308]
    for exponent in range(-320, 308):
        for mantissa in (1.0, 1.5, 9.999999999999999, 1.2345678901234567):
            value = mantissa * 10.0**exponent
            values += [value, -value, math.nextafter(value, 0), math.nextafter(value, math.inf)]
    values += [rng.uniform(-1, 1) * 10.0 ** rng.randint(-9, 20) for _ in range(20_000)]
    bits = (
        struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))[0] for _ in range(20_000)
    )
    values += [v for v in bits if math.isfinite(v)]
    # In a document, beside strings that look like what the rewrite looks for.
    document = {"floats": values, "e+16": "1e+16", "x": ['"1e-05"', "\\", "2.5e-07"]}
    assert dumps(document).encode() == msgspec.json.encode(document)


def test_dumps_writes_every_character_as_msgspec_does() -> None:
    text = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000)
    assert dumps({text: [text]}).encode() == msgspec.json.encode({text: [text]})


@pytest.mark.parametrize(
    "line",
    [
        b'{"seq":1,"detail":{"a":"\xff"}}',  # not UTF-8: msgspec raised UnicodeDecodeError
        b'{"seq":1,"x":"\\ud800"}',  # no terminal can be sent a lone surrogate
        b'{"seq":NaN}',
        b'{"seq":1e400}',
        b"[" * 5000,
        b"[1]",
        b'"text"',
    ],
)
def test_parse_object_calls_no_object_what_is_none_and_never_raises(line: bytes) -> None:
    assert parse_object(line) is None


def test_parse_object_reads_an_object_as_msgspec_does() -> None:
    line = b'{"seq":1,"a":{"b":[1,2.5e-7,"\\u00e9",null]},"a":2}'
    assert parse_object(line) == _DECODER.decode(line) == {"seq": 1, "a": 2}


def test_loads_past_the_interpreter_s_digit_limit_refuses_as_msgspec_does() -> None:
    limit = sys.get_int_max_str_digits()
    try:
        sys.set_int_max_str_digits(1000)
        for content in (b"1" * 1000, b"1" * 1001, b"[" + b"1" * 2000 + b"]"):
            assert_same_reading(content)
    finally:
        sys.set_int_max_str_digits(limit)


def test_dumps_looks_for_a_float_only_at_a_number_s_start() -> None:
    # Tried at every digit, the search for floats to respell is quadratic in an
    # integer's length: a caller's 4,000-digit argument (argsSummary keeps it) made
    # `audit verify` and `show` spend most of a second on its entry.
    import re

    from gatewayd.audit.jsonform import _STRING_OR_EXPONENT

    pattern = re.compile(_STRING_OR_EXPONENT)
    assert pattern.match("12e-07", 0) is not None
    assert pattern.match("12e-07", 1) is None  # inside the number
    assert pattern.match("1.5e-07", 2) is None
    big = {"n": int("9" * 4000), "s": "safe-mode", "f": 2.5e-7, "m": [-1e-05, 1e16]}
    assert dumps(big) == msgspec.json.encode(big).decode()
