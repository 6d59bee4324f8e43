"""JSON text to Python values and back, exactly as the json module does it, without json.

``import json`` costs a cogni-tool call more than everything else it does: json imports
``re``, which imports ``enum``, ``functools``, ``collections`` and more (about 13 ms on top
of a 12 ms interpreter start). json's parsing and encoding are done by its C accelerator
``_json`` anyway; this module drives ``_json`` directly with the settings ``json.loads``
and ``json.dumps`` give it, so the values and the text are the json module's own (a test
compares them over random JSON values).

Invalid JSON is not the hot path: when the scanner refuses a text, the json module is
imported and parses it again, so the error is json's own ``JSONDecodeError`` (message,
line, column, character position). A Python without ``_json`` uses json throughout.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Final

try:
    from _json import encode_basestring as _c_encode_str
    from _json import encode_basestring_ascii as _c_encode_ascii
    from _json import make_encoder as _c_make_encoder
    from _json import make_scanner as _c_make_scanner
except ImportError:  # a Python without json's C accelerator: see _json_module()
    _c_make_encoder = None  # type: ignore[assignment,misc]
    _c_make_scanner = None  # type: ignore[assignment,misc]

# (item separator, key separator) of the wire: no spaces.
COMPACT: Final = (",", ":")

# JSON's insignificant whitespace (RFC 8259, section 2), as json.decoder.WHITESPACE.
_WHITESPACE: Final = " \t\n\r"

# What _scan_document returns for a text that is not exactly one JSON document.
_INVALID: Final = object()


def reject_constant(name: str) -> Any:
    """Refuse ``NaN``, ``Infinity`` and ``-Infinity``: Python's json reads them, JSON has none."""
    raise ValueError(f"{name} is not JSON; use only finite numbers")


class _StrictDecoder:
    """The attributes ``_json.make_scanner`` reads, as ``json.JSONDecoder()`` sets them,
    but with :func:`reject_constant` for NaN and Infinity."""

    strict = True  # control characters inside strings are errors, as in json.loads
    object_hook = None
    object_pairs_hook = None
    # float and int themselves, not wrappers: the scanner has a fast path for exactly these.
    parse_float = float
    parse_int = int
    parse_constant = staticmethod(reject_constant)


# The scanner keeps no state between calls (it clears its key memo after each), so one
# serves every decode.
_scan = None if _c_make_scanner is None else _c_make_scanner(_StrictDecoder())  # type: ignore[arg-type]


def decode(text: str) -> Any:
    """The value of the JSON document ``text``: ``json.loads(text)``, but NaN and Infinity
    are refused.

    Error handling: ValueError for anything that is not one JSON document — the json
    module's ``JSONDecodeError`` (with the position) for a syntax error, a ValueError
    from :func:`reject_constant`, or one for nesting deeper than Python's recursion limit.
    """
    try:
        value = _INVALID if _scan is None else _scan_document(_scan, text)
        if value is _INVALID:
            # Let json parse it again and say what is wrong, and where.
            value = _json_module().loads(text, parse_constant=reject_constant)
    except RecursionError:
        raise ValueError(
            "JSON nested too deeply: deeper than this Python's recursion limit"
        ) from None
    return value


def _scan_document(scan: _c_make_scanner, text: str) -> Any:
    """``text``'s value, or _INVALID when it is not exactly one JSON document."""
    # As json.JSONDecoder.decode: whitespace, one value, whitespace, and the end.
    start = len(text) - len(text.lstrip(_WHITESPACE))
    try:
        value, end = scan(text, start)
    except RecursionError:
        raise
    except Exception:
        # StopIteration(index) where a value is missing, ValueError from reject_constant,
        # JSONDecodeError, or on Python 3.11 a SystemError when json.decoder is not loaded.
        return _INVALID
    # ``rstrip`` returns ``text`` itself when there is no trailing whitespace: no copy.
    return value if end == len(text.rstrip(_WHITESPACE)) else _INVALID


def encode(
    value: object,
    *,
    ensure_ascii: bool,
    allow_nan: bool,
    separators: tuple[str, str] = COMPACT,
) -> str:
    """``json.dumps(value, ensure_ascii=…, allow_nan=…, separators=…)``, same text.

    Error handling, as json.dumps: TypeError for a value JSON has no form for (bytes, a
    set, a non-string key that is not a number, bool or None), ValueError for NaN or
    Infinity when ``allow_nan`` is false and for a circular reference, RecursionError for
    nesting deeper than Python's recursion limit.
    """
    if _c_make_encoder is None:
        return _json_module().dumps(  # type: ignore[no-any-return]
            value, ensure_ascii=ensure_ascii, allow_nan=allow_nan, separators=separators
        )
    item_separator, key_separator = separators
    # Arguments in json.encoder.JSONEncoder.iterencode's order: markers (a fresh dict, for
    # the circular-reference check; the encoder may leave entries in it after an error),
    # default, string encoder, indent (must be None here), key and item separators,
    # sort_keys, skipkeys, allow_nan.
    encoder = _c_make_encoder(
        {},
        _not_serializable,
        _c_encode_ascii if ensure_ascii else _c_encode_str,
        None,
        key_separator,
        item_separator,
        False,
        False,
        allow_nan,
    )
    return "".join(encoder(value, 0))


def _not_serializable(value: object) -> Any:
    # json.JSONEncoder.default, word for word.
    raise TypeError(f"Object of type {value.__class__.__name__} is not JSON serializable")


def _json_module() -> Any:
    import json

    return json
