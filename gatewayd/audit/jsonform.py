"""The audit log's JSON read and written with the standard library, exactly as msgspec
reads and writes it.

Why its own module: the writer encodes entries with msgspec (DESIGN.md's codec for the
wire and the writer's hot path), but the log's readers (`gatewayd audit show|tail|
export|verify`) are short commands whose start is mostly imports, and msgspec's import
(with typing_extensions, inspect, uuid and decimal) was about a third of theirs. So
they read with :mod:`json`, held to msgspec's verdicts and its bytes:

- :func:`loads` refuses what ``msgspec.json.decode`` refuses: text that is not UTF-8,
  ``NaN`` and ``Infinity``, a number out of range (a float that overflows, an integer
  written with more than 4,300 characters), a lone UTF-16 surrogate escape, nesting past
  the interpreter's recursion limit; a key given twice keeps its last value, as there;
- :func:`dumps` writes what ``msgspec.json.encode`` writes, byte for byte (compact,
  non-ASCII as is, the same escapes and the same form of every float), so whether a
  line is in the form gatewayd writes is checked by encoding it again.

tests/unit/test_audit_jsonform.py holds both to msgspec. Pure: no I/O.
"""

from __future__ import annotations

import json
import re

try:  # json's C accelerator (CPython's own); without it, json's Python encoder
    from _json import make_encoder as _make_encoder
except ImportError:  # pragma: no cover - every CPython has it
    _make_encoder = None  # type: ignore[assignment,misc]

# typing's flag without importing typing: the readers start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Final

# msgspec refuses an integer written with more characters than this, its sign
# included (Python's int() limit, sys.get_int_max_str_digits(), counts only digits).
_MAX_INT_CHARS: Final = 4300
# The two patterns below are compiled at their first use (re's cache): few lines need
# them, and compiling costs a reader's start.
# A \uD800-\uDFFF escape, in either case: json decodes a lone one into a string no
# UTF-8 encoder can write back, where msgspec refuses it. (It may also be half of a
# pair, or follow an escaped backslash: then the strings are looked at, and pass.)
_SURROGATE_ESCAPE: Final = r"\\u[dD][89abcdefABCDEF]"
# In json's compact output, a whole string (so that no text inside one is taken for a
# number) or a float in Python's exponent form: 1e+16, 2.5e-07. A number is tried only
# at its start: tried at every digit of a long integer, the search is quadratic in it.
_STRING_OR_EXPONENT: Final = r'"[^"\\]*(?:\\.[^"\\]*)*"|(?<![\d.])(-?\d+(?:\.\d+)?)e([-+]\d+)'
_INFINITIES: Final = (float("inf"), float("-inf"))


class JsonFormError(ValueError):
    """Bytes msgspec's JSON decoder would refuse; ``str()`` says why ("it is not ...")."""


def _refuse_constant(name: str) -> Any:
    raise JsonFormError(f"it holds {name}, which is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in _INFINITIES:
        raise JsonFormError("it holds a number out of range: one that overflows to infinity")
    return value


def _bounded_int(text: str) -> int:
    if len(text) > _MAX_INT_CHARS:
        raise JsonFormError(f"it holds an integer out of range: over {_MAX_INT_CHARS} characters")
    return int(text)


_decoder: Final = json.JSONDecoder(parse_float=_finite_float, parse_constant=_refuse_constant)
# Only a text this long can hold an integer that long: the others skip the hook per int.
_long_decoder: Final = json.JSONDecoder(
    parse_float=_finite_float, parse_int=_bounded_int, parse_constant=_refuse_constant
)
_encoder: Final = json.JSONEncoder(
    ensure_ascii=False, check_circular=False, allow_nan=False, separators=(",", ":")
)


def _no_json(value: Any) -> Any:
    raise TypeError(f"a {type(value).__name__} is not a JSON value")


# The C encoder _encoder makes at every call, made once: making it costs about as much
# as encoding an entry, and `gatewayd audit verify` encodes every entry again.
_encode_once: Final = (
    None
    if _make_encoder is None
    else _make_encoder(
        None, _no_json, json.encoder.encode_basestring, None, ":", ",", False, False, False
    )
)


def loads(content: bytes | str) -> Any:
    """The JSON value of ``content`` (UTF-8 bytes, or their text), as
    ``msgspec.json.decode`` would return it.

    Error handling: :class:`JsonFormError` for anything msgspec would refuse.
    """
    if isinstance(content, str):
        text = content
    else:
        try:
            text = content.decode("utf-8")
        except UnicodeDecodeError as exc:
            message = f"it is not UTF-8 text: a bad byte at offset {exc.start}"
            raise JsonFormError(message) from None
    # JSON's whitespace around the value, as msgspec allows it; raw_decode (not decode,
    # whose own look for it costs a third of a line's decoding) reads what is left.
    stripped = text.strip(" \t\n\r")
    decoder = _long_decoder if len(stripped) > _MAX_INT_CHARS else _decoder
    try:
        value, end = decoder.raw_decode(stripped)
        if end != len(stripped):
            raise JsonFormError(f"it is not valid JSON: extra data at character {end}")
    except JsonFormError:
        raise
    except json.JSONDecodeError as exc:
        raise JsonFormError(f"it is not valid JSON: {exc.msg} at character {exc.pos}") from None
    except RecursionError:
        raise JsonFormError("it nests too deeply") from None
    except ValueError:  # int() past sys.get_int_max_str_digits()
        raise JsonFormError("it holds an integer out of range: too many digits") from None
    if "\\u" in text and re.search(_SURROGATE_ESCAPE, text):
        # Imported here: strictjson's import (its patterns) would cost every reader's
        # start, and few lines hold such an escape.
        from gatewayd.strictjson import holds_lone_surrogate

        if holds_lone_surrogate(value):
            raise JsonFormError("it holds a lone UTF-16 surrogate escape, which is not text")
    return value


def _msgspec_float(match: re.Match[str]) -> str:
    mantissa = match[1]
    if mantissa is None:
        return match[0]  # a string, as it is
    exponent = int(match[2])
    if exponent == -5:  # msgspec writes 1e-05 out: 0.00001
        sign = "-" if mantissa[0] == "-" else ""
        return sign + "0.0000" + mantissa.lstrip("-").replace(".", "")
    return f"{mantissa}e{exponent}"  # no '+', no leading zero: 1e16, 2.5e-7


def dumps(value: Any) -> str:
    """``value`` (of the kinds :func:`loads` returns) as ``msgspec.json.encode`` writes
    it, decoded: compact, non-ASCII as is, the same escapes, every float in the same
    form (Python's repr, but ``1e16`` for ``1e+16``, ``2.5e-7`` for ``2.5e-07``, and
    ``0.00001`` for ``1e-05``).

    Error handling: ValueError for a float that is not finite (msgspec would write
    ``null``; :func:`loads` never returns one); RecursionError past the recursion limit.
    """
    text = _encoder.encode(value) if _encode_once is None else "".join(_encode_once(value, 0))
    # Python writes every float in exponent form with a signed exponent: without "e+"
    # or "e-" anywhere, the text is msgspec's already.
    if "e+" in text or "e-" in text:
        text = re.sub(_STRING_OR_EXPONENT, _msgspec_float, text, flags=re.DOTALL)
    return text
