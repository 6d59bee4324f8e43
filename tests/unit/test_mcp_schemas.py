"""JSON Schema checks with bounded regular expressions (gatewayd/mcp/schemas.py), as the
MCP tools' pinned input schemas apply them to an agent's arguments
(gatewayd/mcp/tools.py's decoder): a pattern that backtracks catastrophically, wherever
the schema matches patterns, holds the event loop for at most the budget, and the call
is invalid_args naming the pattern."""

from __future__ import annotations

import time
from typing import Any, Final

import pytest
import regex

from gatewayd import libraries
from gatewayd.errors import ArgumentsRejected
from gatewayd.mcp.schemas import (
    REGEX_BUDGET_S,
    RegexTooSlow,
    SchemaRefused,
    bounded_validator,
    check_patterns,
    pattern_weight,
    regex_budget,
    search,
)
from gatewayd.mcp.tools import decoder, schema_validator

# Backtracks catastrophically in re and in regex: ~seconds at 38 characters in re.
CATASTROPHIC: Final = "^(a|aa)+$"
HOSTILE: Final = "a" * 38 + "!"
# Time a refusal may take: the budget, and the slack of a loaded 2-core machine.
BOUND_S: Final = REGEX_BUDGET_S + 1.0

# Loaded as a daemon with schemas loads it at its start: the timed checks below are a
# call's, not the first import of jsonschema.
libraries.load(libraries.JSON_SCHEMA)


def decode(schema: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    return decoder("mcp.x.t", schema_validator(schema))(args)


@pytest.mark.parametrize(
    ("where", "schema", "args"),
    [
        (
            "pattern",
            {"type": "object", "properties": {"s": {"type": "string", "pattern": CATASTROPHIC}}},
            {"s": HOSTILE},
        ),
        (
            "patternProperties",
            {"type": "object", "patternProperties": {CATASTROPHIC: {}}},
            {HOSTILE: 1},
        ),
        (
            "additionalProperties",
            {
                "type": "object",
                "patternProperties": {CATASTROPHIC: {}},
                "additionalProperties": False,
            },
            {HOSTILE: 1},
        ),
        (
            "propertyNames",
            {"type": "object", "propertyNames": {"pattern": CATASTROPHIC}},
            {HOSTILE: 1},
        ),
        (
            "nested in anyOf and items",
            {
                "type": "object",
                "properties": {
                    "list": {
                        "type": "array",
                        "items": {"anyOf": [{"type": "integer"}, {"pattern": CATASTROPHIC}]},
                    }
                },
            },
            {"list": [HOSTILE]},
        ),
    ],
)
def test_a_backtracking_pattern_is_invalid_args_within_the_budget(
    where: str, schema: dict[str, Any], args: dict[str, Any]
) -> None:
    started = time.monotonic()
    with pytest.raises(ArgumentsRejected) as refused:
        decode(schema, args)
    assert time.monotonic() - started < BOUND_S, where
    message = str(refused.value)
    assert CATASTROPHIC in message and "took longer than" in message
    assert "shorter or simpler" in message


def test_the_budget_is_shared_by_every_match_of_one_check() -> None:
    """Many values each just under a per-match bound add up: one check, one budget."""
    schema = {
        "type": "object",
        "properties": {"l": {"type": "array", "items": {"pattern": CATASTROPHIC}}},
    }
    # Each takes tens of milliseconds; fifty of them, seconds.
    started = time.monotonic()
    with pytest.raises(ArgumentsRejected, match="took longer than"):
        decode(schema, {"l": ["a" * 27 + "!"] * 50})
    assert time.monotonic() - started < BOUND_S


@pytest.mark.parametrize(
    ("schema", "args", "says"),
    [
        (
            {"properties": {"s": {"pattern": "^[a-z]+$"}}},
            {"s": "Abc"},
            "'Abc' does not match '^[a-z]+$'",
        ),
        (
            {"patternProperties": {"^x_": {"type": "integer"}}},
            {"x_a": "no"},
            "at $.x_a: 'no' is not of type 'integer'",
        ),
        (
            {"patternProperties": {"^x_": {}}, "additionalProperties": False},
            {"y": 1},
            "'y' does not match any of the regexes: '^x_'",
        ),
        (
            {"properties": {"a": {}}, "additionalProperties": False},
            {"a": 1, "b": 2, "c": 3},
            "Additional properties are not allowed ('b', 'c' were unexpected)",
        ),
        (
            {"properties": {"a": {}}, "additionalProperties": {"type": "string"}},
            {"a": 1, "b": 2},
            "at $.b: 2 is not of type 'string'",
        ),
    ],
)
def test_the_bounded_keywords_judge_as_jsonschemas_own(
    schema: dict[str, Any], args: dict[str, Any], says: str
) -> None:
    with pytest.raises(ArgumentsRejected) as refused:
        decode({"type": "object", **schema}, args)
    assert says in str(refused.value)


def test_fitting_arguments_pass_the_bounded_keywords() -> None:
    schema = {
        "type": "object",
        "properties": {"s": {"pattern": CATASTROPHIC}},
        "patternProperties": {"^x_": {"type": "integer"}},
        "additionalProperties": False,
    }
    assert decode(schema, {"s": "a" * 60, "x_1": 1}) == {"s": "a" * 60, "x_1": 1}


def test_a_schema_matching_patterns_through_unevaluated_properties_is_refused() -> None:
    schema = {
        "type": "object",
        "allOf": [{"patternProperties": {"^x": {}}}],
        "unevaluatedProperties": False,
    }
    with pytest.raises(SchemaRefused, match="use additionalProperties instead"):
        schema_validator(schema)
    # Without patterns, unevaluatedProperties matches none: allowed.
    assert schema_validator({"type": "object", "unevaluatedProperties": False}) is not None


def test_a_pattern_regex_cannot_compile_is_refused_naming_it() -> None:
    with pytest.raises(SchemaRefused, match=r"the pattern '\(' is not a regular expression"):
        check_patterns({"properties": {"s": {"pattern": "("}}})
    with pytest.raises(SchemaRefused, match=r"the pattern '\[' is not"):
        check_patterns({"patternProperties": {"[": {}}})


def test_an_invalid_schema_is_refused_saying_so() -> None:
    with pytest.raises(SchemaRefused, match="not a valid JSON Schema"):
        bounded_validator({"type": 12})


def test_outside_a_budget_each_search_has_its_own_bound() -> None:
    started = time.monotonic()
    with pytest.raises(RegexTooSlow):
        search(CATASTROPHIC, "a" * 60 + "!")
    assert time.monotonic() - started < BOUND_S
    with regex_budget(0.0), pytest.raises(RegexTooSlow):
        search("a", "a")  # a spent budget refuses at once
    assert search("^a", "abc") and not search("^b", "abc")
    assert isinstance(regex.compile(CATASTROPHIC), regex.Pattern)


@pytest.mark.parametrize(
    "pattern",
    ["x{4294967294}", "((((a{100}){100}){100}){100})", "(?:a{1000}){1000}", "[a-z]{1001}"],
)
def test_a_pattern_that_would_compile_to_a_huge_program_is_refused_before_compiling(
    pattern: str,
) -> None:
    """``regex`` writes out a counted repeat's mandatory copies when it compiles:
    ``x{4294967294}`` takes all the memory there is. The weight is read from the parse
    alone, so the refusal is immediate."""
    started = time.monotonic()
    with pytest.raises(SchemaRefused, match=r"repeats more than 1000 items by count"):
        schema_validator({"type": "object", "properties": {"s": {"pattern": pattern}}})
    with pytest.raises(SchemaRefused, match="MAX_PATTERN_WEIGHT"):
        check_patterns({"patternProperties": {pattern: {}}})
    assert time.monotonic() - started < 1.0


@pytest.mark.parametrize(
    ("pattern", "weight"),
    [
        ("^[a-f0-9]{64}$", 66),
        ("^.{1,1000}$", 3),
        ("a{0,1000000}", 1),
        (r"^\d{4}-\d{2}-\d{2}$", 12),
        (r"^(?:[a-z]{1,63}\.){1,8}[a-z]{2,63}$", 6),
        ("(?>a{3})b++(?=c)|d", 6),
    ],
)
def test_real_patterns_weigh_little_and_are_accepted(pattern: str, weight: int) -> None:
    assert pattern_weight(pattern) == weight
    check_patterns({"properties": {"s": {"pattern": pattern}}})
