"""One JSON discipline for every JSON document gatewayd reads from outside itself.

The run socket's frames, the control socket's bodies, replay files, run spec files, a
model's tool-call arguments and a forge's replies all pass here first. Python's ``json``
and msgspec both accept what a security boundary should not:

- a key given twice in one object (both keep the last one silently, so two readers of
  the same bytes, say a reviewer and a runner, could act on different values);
- nesting deep enough to exhaust a recursive decoder (a RecursionError, or a
  connection dropped without an answer);
- ``NaN``, ``Infinity`` and numbers that overflow to infinity (not JSON);
- an integer of thousands of digits (Python refuses past 4300 with a bare ValueError).

Neither library can refuse duplicate keys or cap depth, so this module does both on
top of ``json``'s C scanner: a depth check that never recurses, then one parse with a
pairs hook. Pure: bytes in, a value or :class:`JsonInputError` out; no I/O.

Messages name the problem and where (line and column, or the dotted path of a key),
never the document's content beyond a key name.
"""

from __future__ import annotations

import itertools
import json
import math
import operator
import re

# typing's flag without importing typing: client commands start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Final

# Deeper than anything gatewayd reads needs (a request with tool arguments nests about
# six levels, a model reply about eight); shallow enough that a recursive decoder
# after this check never comes near Python's recursion limit.
MAX_DEPTH: Final = 64
# Python's own guard against quadratic int() parsing (sys.get_int_max_str_digits()).
_INT_MAX_STR_DIGITS: Final = 4300

# A JSON string: the quotes and everything between them, escapes included (unrolled,
# so runs of plain characters are matched at C speed).
_STRING: Final = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# Every byte but the four brackets, removed to leave the document's bracket skeleton.
_NOT_BRACKETS: Final = bytes(b for b in range(256) if b not in b"[]{}")
# After translation an opener weighs 2 and a closer 0: depth after k brackets is the
# running sum minus k (see _max_depth).
_WEIGHTS: Final = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")


class JsonInputError(ValueError):
    """A document that breaks the discipline; ``str(exc)`` says what and where."""


def check(data: bytes | str, *, max_depth: int = MAX_DEPTH) -> None:
    """Refuse ``data`` unless it is one UTF-8 JSON value with no key twice in an
    object, nested at most ``max_depth`` levels, with no NaN or infinity.

    For callers that decode with a typed decoder (msgspec, pydantic) afterwards: those
    decoders see only documents this accepted.
    """
    _parse(data, max_depth)


def nests_deeper(raw: bytes, max_depth: int = MAX_DEPTH) -> bool:
    """Does ``raw`` nest brackets deeper than ``max_depth`` (outside strings)? The depth
    half of :func:`check`, for a typed decoder that enforces the rest itself (see
    :func:`keys_in`); two byte counts for a document with few brackets."""
    return _depth_over(raw, max_depth) is not None


def keys_in(raw: bytes) -> int:
    """How many object keys the valid JSON document ``raw`` holds, duplicates counted:
    its colons outside strings (in JSON a colon outside a string only ever separates a
    key from its value).

    With a decoder that keeps one value per key (msgspec), a document has no key twice
    in an object exactly when this equals the number of keys decoded: the duplicate
    check of :func:`check` without a second parse. Only meaningful for a document a
    JSON decoder accepted.
    """
    colons = raw.count(b":")
    return colons if colons == 0 else _STRING.sub(b"", raw).count(b":")


def loads(data: bytes | str, *, max_depth: int = MAX_DEPTH) -> Any:
    """The value of ``data`` under the discipline (see :func:`check`); no string in it
    holds a lone surrogate escape.

    Error handling: :class:`JsonInputError` naming the first problem.
    """
    value = _parse(data, max_depth)
    _refuse_lone_surrogates(value)
    return value


def _parse(data: bytes | str, max_depth: int) -> Any:
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    depth = _depth_over(raw, max_depth)
    if depth is not None:
        raise JsonInputError(
            f"the document nests {depth} levels deep; at most {max_depth} are accepted"
        )
    try:
        text = raw.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as exc:
        raise JsonInputError(f"not UTF-8 text (bad byte at offset {exc.start})") from None
    try:
        value = json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constant,
            parse_float=_finite_float,
        )
    except JsonInputError:
        raise
    except json.JSONDecodeError as exc:
        raise JsonInputError(
            f"not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}"
        ) from None
    except RecursionError:  # the depth check makes this unreachable; kept as a guard
        raise JsonInputError(f"the document nests more than {max_depth} levels deep") from None
    except ValueError as exc:  # int() past its digit limit
        if "digits" in str(exc):
            raise JsonInputError(f"an integer has more than {_INT_MAX_STR_DIGITS} digits") from None
        raise JsonInputError(f"not valid JSON: {exc}") from None
    return value


def _depth_over(raw: bytes, limit: int) -> int | None:
    """The deepest nesting of brackets outside strings when it is over ``limit``, else
    None; without recursion, in C-level iterators."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return None  # the common case: a document with few brackets cannot nest deeper
    skeleton = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS).translate(_WEIGHTS)
    if not skeleton:
        return None
    # After k brackets the depth is 2 * openers - k: the running sum of weights minus k.
    depth = max(map(operator.sub, itertools.accumulate(skeleton), itertools.count(1)))
    return depth if depth > limit else None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise JsonInputError(f"the key {_shown_key(key)} appears twice in one object")
            seen.add(key)
    return value


def _no_constant(name: str) -> Any:
    raise JsonInputError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonInputError("a number is too large to be represented (it overflows to infinity)")
    return value


def _shown_key(key: str) -> str:
    """A key for a message: quoted, printable, short."""
    shown = repr(key)
    return shown if len(shown) <= 42 else shown[:39] + "...'"


def _refuse_lone_surrogates(value: Any) -> None:
    """``json`` turns ``"\\ud800"`` into a string no UTF-8 encoder can write back; refuse
    it here rather than fail later in the audit log or a reply."""
    if holds_lone_surrogate(value):
        raise JsonInputError(
            "a string holds a lone UTF-16 surrogate escape (\\ud800-\\udfff), which is not text"
        )


def holds_lone_surrogate(value: Any) -> bool:
    """Whether a string in ``value`` (a key or a value, at any depth: what ``json``
    decoded) holds a lone UTF-16 surrogate. Iterative: ``value`` may nest as deep as
    the decoder went."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False
