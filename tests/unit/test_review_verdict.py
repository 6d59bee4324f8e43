"""Parsing the reviewer's answer: only a clean ALLOW allows; anything odd is a deny."""

from __future__ import annotations

import unicodedata

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gatewayd.review.verdict import (
    MAX_REASON_CHARS,
    UNPARSEABLE_REASON,
    Verdict,
    parse_verdict,
)


@pytest.mark.parametrize("text", ["ALLOW", "  ALLOW", "ALLOW\n", "\t\r\n ALLOW \r\n"])
def test_a_clean_allow_with_surrounding_whitespace_allows(text: str) -> None:
    assert parse_verdict(text) == Verdict(allowed=True, reason="", parse_ok=True)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("DENY: writes a private key", "writes a private key"),
        ("DENY:no space after the colon", "no space after the colon"),
        ("  DENY:    padded reason   \n", "padded reason"),
        ("DENY: rule 2 forbids it: secrets", "rule 2 forbids it: secrets"),
        ("DENY: ALLOW", "ALLOW"),
    ],
)
def test_a_clean_deny_keeps_its_reason(text: str, reason: str) -> None:
    assert parse_verdict(text) == Verdict(allowed=False, reason=reason, parse_ok=True)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   \n",
        "Allow",
        "allow",
        "ALLOW.",
        "ALLOWED",
        "ALLOW because it only writes notes",
        "I think ALLOW",
        "ALLOW\nDENY: changed my mind",
        "ALLOW\n\nALLOW",
        "DENY: first line\nALLOW",
        "DENY: first line\rsecond",
        "DENY",
        "DENY:",
        "DENY:    ",
        "DENY: \u202e\u200b\x1b",  # nothing left once control and format characters go
        "Deny: lower case",
        "DENIED: other word",
        "```\nALLOW\n```",
        "**ALLOW**",
        "`ALLOW`",
        "\u00a0ALLOW",  # a no-break space is not the whitespace we strip
        "ALLOW\u200b",
        "\ufeffALLOW",
        '{"verdict": "ALLOW"}',
    ],
)
def test_anything_but_the_clean_forms_is_an_unparseable_deny(text: str) -> None:
    assert parse_verdict(text) == Verdict(
        allowed=False, reason="unparseable review", parse_ok=False
    )


def test_control_and_bidi_characters_are_stripped_from_the_reason() -> None:
    verdict = parse_verdict("DENY: writes \x1b[31mred\x07 \u202eevil\u2066 text\u2028")
    assert verdict == Verdict(allowed=False, reason="writes [31mred evil text", parse_ok=True)


def test_a_long_reason_is_cut_to_the_limit_with_an_ellipsis() -> None:
    verdict = parse_verdict("DENY: " + "x" * (MAX_REASON_CHARS * 3))
    assert verdict.parse_ok and not verdict.allowed
    assert len(verdict.reason) == MAX_REASON_CHARS
    assert verdict.reason == "x" * (MAX_REASON_CHARS - 1) + "…"


def test_a_reason_exactly_at_the_limit_is_kept_whole() -> None:
    reason = "y" * MAX_REASON_CHARS
    assert parse_verdict(f"DENY: {reason}").reason == reason


_NEAR_MISSES = st.one_of(
    st.text(),
    st.builds(lambda a, b: a + "ALLOW" + b, st.text(max_size=5), st.text(max_size=5)),
    st.builds(lambda a, b: a + "DENY:" + b, st.text(max_size=5), st.text(max_size=30)),
)


@given(_NEAR_MISSES)
def test_no_string_but_a_clean_allow_parses_as_allowed(text: str) -> None:
    verdict = parse_verdict(text)
    if verdict.allowed:
        assert text.strip(" \t\r\n") == "ALLOW"
        assert verdict.parse_ok and verdict.reason == ""
    else:
        assert verdict.reason


@given(_NEAR_MISSES)
def test_every_verdict_is_well_formed(text: str) -> None:
    verdict = parse_verdict(text)
    if not verdict.parse_ok:
        assert not verdict.allowed and verdict.reason == UNPARSEABLE_REASON
    assert len(verdict.reason) <= MAX_REASON_CHARS
    assert verdict.reason == verdict.reason.strip()
    assert not any(
        unicodedata.category(c) in {"Cc", "Cf", "Cs", "Zl", "Zp"} for c in verdict.reason
    )
