"""cogni_tool.json_codec gives the json module's values, text and errors, without json.

The json module is the reference: every property compares against it, over random JSON
values and random JSON-like text, both with json's C accelerator ``_json`` (the fast path)
and without it (the fallback for Pythons that lack it).
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cogni_tool import json_codec
from tests.hypothesis_counts import examples

REPO_ROOT = Path(__file__).resolve().parents[2]


def codec_without_c_accelerator() -> ModuleType:
    """A second copy of json_codec, loaded while ``import _json`` fails."""
    saved = sys.modules.get("_json")
    sys.modules["_json"] = None  # type: ignore[assignment]  # makes the import fail
    try:
        spec = importlib.util.spec_from_file_location("json_codec_without_c", json_codec.__file__)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            del sys.modules["_json"]
        else:
            sys.modules["_json"] = saved
    return module


PURE = codec_without_c_accelerator()
CODECS = pytest.mark.parametrize("codec", [json_codec, PURE], ids=["with-_json", "without-_json"])


def test_the_copy_without_c_accelerator_really_lacks_it() -> None:
    assert PURE._c_make_encoder is None
    assert PURE._scan is None
    assert json_codec._scan is not None  # and the real one has it


# Any text, and lone surrogates often: JSON escapes can carry them, UTF-8 cannot.
TEXT = st.text(st.one_of(st.characters(), st.sampled_from("\ud800\udbff\udc00\udfff")))


def json_values() -> st.SearchStrategy[Any]:
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),  # beyond 64 bits too
        st.integers(min_value=-(10**400), max_value=10**400),
        st.floats(allow_nan=False, allow_infinity=False),  # -0.0, subnormals, 1e308
        TEXT,
    )
    return st.recursive(
        scalars,
        lambda children: st.one_of(
            st.lists(children, max_size=5),
            st.dictionaries(TEXT.filter(lambda key: len(key) <= 8), children, max_size=5),
        ),
        max_leaves=25,
    )


SEPARATORS = st.sampled_from([(",", ":"), (", ", ": ")])


def reference_loads(text: str) -> Any:
    return json.loads(text, parse_constant=json_codec.reject_constant)


def same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values: types and float signs count (so 0 != 0.0, -0.0 != 0.0)."""
    return json.dumps(a) == json.dumps(b) and type(a) is type(b)


# --- encode ----------------------------------------------------------------------------


@CODECS
@settings(max_examples=examples(300), deadline=None)
@given(value=json_values(), ensure_ascii=st.booleans(), separators=SEPARATORS)
def test_encode_writes_the_same_text_as_json_dumps(
    codec: ModuleType, value: Any, ensure_ascii: bool, separators: tuple[str, str]
) -> None:
    expected = json.dumps(value, ensure_ascii=ensure_ascii, allow_nan=False, separators=separators)
    assert (
        codec.encode(value, ensure_ascii=ensure_ascii, allow_nan=False, separators=separators)
        == expected
    )


@CODECS
@pytest.mark.parametrize(
    "value",
    [
        {7: "int key", 2.5: "float key", True: "bool key", None: "null key"},
        [1e16, 1e-7, 5e-324, 1.7976931348623157e308, -0.0, 2**64, -(2**100)],
        '\u2028\u2029\x00\x1f\x7f"\\/',
        (1, (2, 3)),  # tuples are arrays
    ],
    ids=["non-string-keys", "number-edges", "escapes", "tuples"],
)
def test_encode_matches_json_dumps_on_edge_values(codec: ModuleType, value: Any) -> None:
    for ensure_ascii in (False, True):
        assert codec.encode(value, ensure_ascii=ensure_ascii, allow_nan=False) == json.dumps(
            value, ensure_ascii=ensure_ascii, allow_nan=False, separators=(",", ":")
        )


@CODECS
@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (float("nan"), ValueError, "Out of range float values are not JSON compliant"),
        ({"x": [float("-inf")]}, ValueError, "Out of range float values"),
        ({"data": b"bytes"}, TypeError, "Object of type bytes is not JSON serializable"),
        ({1, 2}, TypeError, "Object of type set is not JSON serializable"),
        ({(1, 2): 3}, TypeError, "keys must be str, int, float, bool or None, not tuple"),
    ],
)
def test_encode_refuses_what_json_dumps_refuses_with_its_message(
    codec: ModuleType, value: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as caught:
        codec.encode(value, ensure_ascii=False, allow_nan=False)
    with pytest.raises(error) as expected:
        json.dumps(value, allow_nan=False)
    assert message in str(caught.value)
    assert str(caught.value) == str(expected.value)


@CODECS
def test_encode_refuses_a_circular_reference(codec: ModuleType) -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(ValueError, match="Circular reference detected"):
        codec.encode({"a": loop}, ensure_ascii=False, allow_nan=False)
    # The encoder keeps no state: the next value encodes normally.
    assert codec.encode({"a": [1]}, ensure_ascii=False, allow_nan=False) == '{"a":[1]}'


@CODECS
def test_encode_writes_nan_and_infinity_only_when_allowed(codec: ModuleType) -> None:
    value = [float("nan"), float("inf"), float("-inf")]
    assert codec.encode(value, ensure_ascii=False, allow_nan=True) == "[NaN,Infinity,-Infinity]"


# --- decode ----------------------------------------------------------------------------


@CODECS
@settings(max_examples=examples(300), deadline=None)
@given(value=json_values(), separators=SEPARATORS, indent=st.sampled_from([None, 1, "\t"]))
def test_decode_reads_json_text_back_to_what_json_loads_reads(
    codec: ModuleType, value: Any, separators: tuple[str, str], indent: int | str | None
) -> None:
    text = json.dumps(value, separators=separators, indent=indent)
    decoded = codec.decode(text)
    assert same_json(decoded, json.loads(text))
    # And back to the very same text: floats, big ints and strings round-trip exactly.
    assert codec.encode(decoded, ensure_ascii=True, allow_nan=False, separators=(",", ":")) == (
        json.dumps(value, separators=(",", ":"))
    )


# Text that is often almost JSON: every way of being wrong gets tried.
JSONISH = st.text(alphabet=' \t\n\r{}[]",:0123456789.eE+-truefalsnNIiy\\u\x01\ufeffé', max_size=30)


@CODECS
@settings(max_examples=examples(1000), deadline=None)
@given(text=st.one_of(JSONISH, TEXT.filter(lambda text: len(text) <= 20)))
def test_decode_of_any_text_gives_json_loads_value_or_its_exact_error(
    codec: ModuleType, text: str
) -> None:
    expected_error: ValueError | None = None
    try:
        expected = reference_loads(text)
    except ValueError as exc:
        expected_error = exc
    if expected_error is None:
        assert same_json(codec.decode(text), expected)
        return
    with pytest.raises(ValueError) as caught:
        codec.decode(text)
    assert type(caught.value) is type(expected_error)
    assert str(caught.value) == str(expected_error)


@CODECS
@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"a" 1}', "Expecting ':' delimiter: line 1 column 6 (char 5)"),
        ("{'path': 'a'}", "Expecting property name enclosed in double quotes: line 1 column 2"),
        ("", "Expecting value: line 1 column 1 (char 0)"),
        ("[1,]", "Expecting value: line 1 column 4 (char 3)"),
        ('{"a": 1}\n{"b": 2}', "Extra data: line 2 column 1 (char 9)"),
        ('"tab\there"', "Invalid control character at: line 1 column 5 (char 4)"),
        ("\ufeff{}", "Unexpected UTF-8 BOM"),
        ('"abc', "Unterminated string starting at: line 1 column 1 (char 0)"),
        ('"\\ud83d', "Invalid \\uXXXX escape: line 1 column 3 (char 2)"),
        ("NaN", "NaN is not JSON; use only finite numbers"),
        ('{"n": -Infinity}', "-Infinity is not JSON; use only finite numbers"),
    ],
)
def test_decode_errors_say_what_is_wrong_and_where(
    codec: ModuleType, text: str, message: str
) -> None:
    with pytest.raises(ValueError) as caught:
        codec.decode(text)
    assert message in str(caught.value)


@CODECS
def test_decode_keeps_the_last_of_duplicate_keys_as_json_does(codec: ModuleType) -> None:
    assert codec.decode('{"a": 1, "b": 2, "a": 3}') == {"a": 3, "b": 2}


@CODECS
def test_decode_of_nesting_deeper_than_the_recursion_limit_is_a_value_error(
    codec: ModuleType,
) -> None:
    depth = sys.getrecursionlimit() + 100
    with pytest.raises(ValueError, match="nested too deeply"):
        codec.decode("[" * depth + "]" * depth)
    assert codec.decode("[" * 50 + "]" * 50) is not None  # ordinary nesting is fine


@CODECS
def test_decode_reads_huge_numbers_as_json_does(codec: ModuleType) -> None:
    assert codec.decode("1e400") == math.inf  # as json.loads: a float too big is infinite
    assert codec.decode("-12345678901234567890123") == -12345678901234567890123


def test_errors_have_json_messages_when_json_was_never_imported() -> None:
    # On Python 3.11, _json's own error path needs json.decoder already loaded (else a
    # SystemError); in a cogni-tool process it is not, and the message must still be json's.
    code = (
        "import sys\n"
        "from cogni_tool.json_codec import decode\n"
        "try:\n"
        "    decode('{\"a\" 1}')\n"
        "except ValueError as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-S", "-E", "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=30,
        check=True,
    )
    assert done.stdout == "JSONDecodeError Expecting ':' delimiter: line 1 column 6 (char 5)\n"
