"""JSON Schema validation whose regular expressions are bounded in time.

An MCP tool's schemas come from its server (the input schema the operator pinned, the
output schema as the server lists it) and the values checked against them from the run's
agent (arguments) or from the server (structured content), so either attacker can pair a
pattern that backtracks catastrophically (``^(a|aa)+$``) with a string that makes it run
for hours. jsonschema matches ``pattern`` and ``patternProperties`` with ``re.search``,
synchronously, on gatewayd's event loop: one such check would stall every run, and ``re``
can neither be interrupted nor given a deadline.

jsonschema has no hook for its regular-expression engine, so this module replaces, through
its public ``validators.extend``, the three keywords that match one (``pattern``,
``patternProperties``, and ``additionalProperties``, which asks ``patternProperties``)
with the same rules matched by the ``regex`` module (already a dependency), whose searches
take a timeout. Every match of one check shares one budget (:func:`regex_budget`); past
it the check fails with :class:`RegexTooSlow`. A pattern is compiled only once its
compiled size is known to be bounded (:func:`pattern_weight`). The one other keyword
that matches patterns, ``unevaluatedProperties`` (through the ``patternProperties`` of
the schemas it looks into), is not rewritten: a schema using both is refused
(:class:`SchemaRefused`); MCP tools' schemas do not combine them in practice.

jsonschema, referencing and regex are imported where a validator is built or applied:
what only refers to this module's errors or budget (the configuration's MCP declarations,
a client command) does not load them, and a daemon with schemas to check loads them
first, off its event loop (:mod:`gatewayd.libraries`).
"""

from __future__ import annotations

import contextvars
import functools
import re
import re._parser as _re_parser  # type: ignore[import-not-found]  # see pattern_weight
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from gatewayd.errors import ArgumentsRejected

if TYPE_CHECKING:
    import jsonschema.protocols
    from jsonschema.exceptions import ValidationError
    from referencing import Registry

# The time every regular-expression match of one check may take together: real
# patterns (a slug, a date, an identifier) match a call's arguments in microseconds; this
# is how long one hostile pair of pattern and string may hold gatewayd's event loop.
REGEX_BUDGET_S: Final = 0.25
# How many items one pattern may compile to. ``regex`` writes out the mandatory copies
# of a counted repeat when it compiles (``a{1000}`` is a thousand items,
# ``(?:a{1000}){1000}`` a million and a quarter GiB, ``x{4294967294}`` all memory), and
# keeps 500 compiled patterns cached: real patterns (a hash's 64 hex digits, a date)
# weigh tens, and 500 patterns of this weight hold about 70 MiB.
MAX_PATTERN_WEIGHT: Final = 1000
# How much of a pattern a message quotes (a pattern may be long; its start names it).
MAX_QUOTED_PATTERN_CHARS: Final = 80
# How much of one complaint about a call's arguments the caller reads: jsonschema quotes
# the offending value, which may be a whole argument.
MAX_COMPLAINT_CHARS: Final = 300


class SchemaRefused(ValueError):
    """An input schema that is not a JSON Schema jsonschema can apply within bounds."""


class RegexTooSlow(RuntimeError):
    """A check spent its regex budget; ``str(exc)`` names the pattern.

    A RuntimeError: the MCP SDK reports a failed check of structured content as one."""

    def __init__(self, pattern: str, budget_s: float) -> None:
        shown = pattern[:MAX_QUOTED_PATTERN_CHARS] + (
            "…" if len(pattern) > MAX_QUOTED_PATTERN_CHARS else ""
        )
        super().__init__(
            f"matching the schema's pattern {shown!r} took longer than {budget_s:g} s (the "
            "bound on a check's regular expressions); the value is refused: send a shorter "
            "or simpler one"
        )
        self.pattern = pattern


@dataclass(slots=True)
class _Budget:
    seconds: float
    # Set by the first match: time spent before it (a request the check waits for) is
    # not the regular expressions'.
    ends: float | None = None


_budget: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar(
    "gatewayd_mcp_regex_budget", default=None
)


@contextmanager
def regex_budget(seconds: float = REGEX_BUDGET_S) -> Iterator[None]:
    """Every match of the bounded validators inside shares ``seconds`` (outside one, each
    match gets ``REGEX_BUDGET_S`` of its own)."""
    token = _budget.set(_Budget(seconds))
    try:
        yield
    finally:
        _budget.reset(token)


def search(pattern: str, text: str) -> bool:
    """Whether ``pattern`` matches somewhere in ``text``, within the budget.

    Error handling: RegexTooSlow once the budget is spent; regex.error for a pattern that
    :func:`check_patterns` would have refused."""
    import regex  # loaded: a validator was made (check_patterns)

    budget = _budget.get() or _Budget(REGEX_BUDGET_S)
    now = time.monotonic()
    if budget.ends is None:
        budget.ends = now + budget.seconds
    left = budget.ends - now
    if left <= 0:
        raise RegexTooSlow(pattern, budget.seconds)
    try:
        return regex.search(pattern, text, timeout=left) is not None
    except TimeoutError:
        raise RegexTooSlow(pattern, budget.seconds) from None


# -- the keywords, as jsonschema's own (jsonschema/_keywords.py) with `search` ----------


def _pattern(validator: Any, pattern: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    from jsonschema.exceptions import ValidationError  # loaded: the validator is jsonschema's

    if validator.is_type(instance, "string") and not search(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(
    validator: Any, patterns: Any, instance: Any, schema: Any
) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties(
    validator: Any, additional: Any, instance: Any, schema: Any
) -> Iterator[ValidationError]:
    from jsonschema.exceptions import ValidationError  # loaded: the validator is jsonschema's

    if not validator.is_type(instance, "object"):
        return
    properties = schema.get("properties", {})
    patterns = list(schema.get("patternProperties", {}))
    extras = [
        key
        for key in instance
        if key not in properties and not any(search(pattern, key) for pattern in patterns)
    ]
    if validator.is_type(additional, "object"):
        for extra in extras:
            yield from validator.descend(instance[extra], additional, path=extra)
    elif not additional and extras:
        joined = ", ".join(repr(each) for each in sorted(extras, key=str))
        if patterns:
            verb = "does" if len(extras) == 1 else "do"
            listed = ", ".join(repr(each) for each in sorted(patterns))
            yield ValidationError(f"{joined} {verb} not match any of the regexes: {listed}")
        else:
            verb = "was" if len(extras) == 1 else "were"
            yield ValidationError(
                f"Additional properties are not allowed ({joined} {verb} unexpected)"
            )


_BOUNDED_KEYWORDS: Final = {
    "pattern": _pattern,
    "patternProperties": _pattern_properties,
    "additionalProperties": _additional_properties,
}


@functools.cache
def bounded_class(
    cls: type[jsonschema.protocols.Validator],
) -> type[jsonschema.protocols.Validator]:
    """``cls`` with its pattern-matching keywords bounded (one class per draft)."""
    import jsonschema.validators

    # (jsonschema's extend is untyped; its result is a validator class like cls.)
    extended: type[jsonschema.protocols.Validator] = jsonschema.validators.extend(  # type: ignore[no-untyped-call]
        cls, _BOUNDED_KEYWORDS
    )
    return extended


def bounded_validator(
    schema: dict[str, Any],
    *,
    default: type[jsonschema.protocols.Validator] | None = None,
    registry: Registry[Any] | None = None,
) -> jsonschema.protocols.Validator:
    """A validator of ``schema`` (its own ``$schema`` draft, else ``default``; None: the
    draft MCP specifies, 2020-12) whose regular expressions are bounded; ``registry``:
    where its ``$ref`` may resolve (None: jsonschema's default, which fetches nothing).

    Error handling: SchemaRefused saying what is wrong with the schema."""
    import jsonschema.validators
    from jsonschema.exceptions import SchemaError

    if default is None:
        default = jsonschema.validators.Draft202012Validator
    cls = jsonschema.validators.validator_for(schema, default=default)
    try:
        cls.check_schema(schema)
    except SchemaError as exc:
        raise SchemaRefused(f"not a valid JSON Schema: {exc.message[:300]}") from None
    check_patterns(schema)
    bounded = bounded_class(cls)
    if registry is None:
        return bounded(schema)
    return bounded(schema, registry=registry)


def check_patterns(schema: Any) -> None:
    """Every pattern of ``schema`` compiles for ``regex``, and no schema matches
    patterns through ``unevaluatedProperties`` (module doc).

    Error handling: SchemaRefused naming the pattern or the combination."""
    import regex

    keywords: set[str] = set()
    for key, value in _keyword_values(schema):
        keywords.add(key)
        if key == "pattern":
            patterns = [value]
        elif key == "patternProperties" and isinstance(value, Mapping):
            patterns = list(value)
        else:
            continue
        for pattern in patterns:
            if not isinstance(pattern, str):
                continue
            weight = pattern_weight(pattern)
            if weight > MAX_PATTERN_WEIGHT:
                raise SchemaRefused(
                    f"the pattern {pattern[:MAX_QUOTED_PATTERN_CHARS]!r} repeats more than "
                    f"{MAX_PATTERN_WEIGHT} items by count (MAX_PATTERN_WEIGHT); gatewayd "
                    "refuses to compile it"
                )
            try:
                regex.compile(pattern)
            except regex.error as exc:
                raise SchemaRefused(
                    f"the pattern {pattern[:MAX_QUOTED_PATTERN_CHARS]!r} is not a regular "
                    f"expression gatewayd can bound: {exc}"
                ) from None
    if {"unevaluatedProperties", "patternProperties"} <= keywords:
        raise SchemaRefused(
            "the schema uses both unevaluatedProperties and patternProperties, which gatewayd "
            "cannot check within a time bound; use additionalProperties instead"
        )


def pattern_weight(pattern: str) -> int:
    """How many items ``regex`` compiles ``pattern`` to, about (every counted repeat's
    mandatory copies multiplied out, as ``regex`` writes them), or a number past
    MAX_PATTERN_WEIGHT once it is known to be past it. It is read from the standard
    library's parse of the pattern (``re._parser``: the parser ``re.compile`` and
    jsonschema's check of a schema's patterns use; it expands nothing), as no public
    API of either engine tells a pattern's compiled size without compiling it.

    Error handling: SchemaRefused for a pattern the standard library cannot parse."""
    try:
        return _items_weight(_re_parser.parse(pattern))
    except (re.error, RecursionError, OverflowError) as exc:
        raise SchemaRefused(
            f"the pattern {pattern[:MAX_QUOTED_PATTERN_CHARS]!r} is not a regular expression "
            f"gatewayd can bound: {exc}"
        ) from None


_REPEATS: Final = frozenset({"MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"})


def _items_weight(items: Any) -> int:
    total = 0
    for op, arg in items:
        kind = str(op)
        if kind in _REPEATS:
            least, _most, body = arg
            total += max(least, 1) * _items_weight(body)
        elif kind == "SUBPATTERN":
            total += _items_weight(arg[-1])
        elif kind == "ATOMIC_GROUP":
            total += _items_weight(arg)
        elif kind in ("ASSERT", "ASSERT_NOT"):
            total += _items_weight(arg[1])
        elif kind == "BRANCH":
            total += sum(_items_weight(branch) for branch in arg[1])
        elif kind == "GROUPREF_EXISTS":
            total += sum(_items_weight(branch) for branch in arg[1:] if branch is not None)
        else:
            total += 1
        if total > MAX_PATTERN_WEIGHT:
            return total  # known to be too much: no need to multiply on
    return total


def _keyword_values(node: Any) -> Iterator[tuple[str, Any]]:
    """Every (key, value) of every object in ``node``, depth first (the schema's keywords,
    and some property names: harmless, a name is checked as a pattern only when its value
    is one)."""
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, Mapping):
            for key, value in current.items():
                yield str(key), value
                stack.append(value)
        elif isinstance(current, list):
            stack.extend(current)


def arguments_decoder(
    validator: jsonschema.protocols.Validator, unusable: Callable[[Exception], Exception]
) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    """A tool's ``decode`` (an MCP server's pinned tool, a tool folder's tool): its
    arguments, checked against ``validator`` within one :func:`regex_budget`.

    Error handling: ArgumentsRejected with the path and the reason of the complaint
    jsonschema judges most relevant (and how many there were), or saying the budget ran
    out; a schema that cannot be applied to them (a ``$ref`` outside it) raises what
    ``unusable`` makes of jsonschema's exception: the caller says whose fault it is."""
    # Bound now, where the validator is made: a call's check imports nothing.
    from jsonschema.exceptions import best_match

    def decode(args: Mapping[str, Any]) -> dict[str, Any]:
        value = dict(args)
        try:
            with regex_budget():
                errors = list(validator.iter_errors(value))
        except RegexTooSlow as exc:
            raise ArgumentsRejected(str(exc)) from None
        except Exception as exc:  # jsonschema's referencing errors, a bad pattern
            raise unusable(exc) from None
        best = best_match(errors)
        if best is not None:
            more = f" ({len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
            message = best.message
            if len(message) > MAX_COMPLAINT_CHARS:
                message = message[:MAX_COMPLAINT_CHARS] + "…"
            raise ArgumentsRejected(f"at {best.json_path}: {message}{more}")
        return value

    return decode
