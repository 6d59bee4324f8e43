"""The tools.allow grammar's wildcards, table-driven: what each pattern matches, which
patterns validate, and that tools.list, dispatch and the review use the same matcher."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gatewayd.policy import tool_matches
from gatewayd.policy.review_section import ReviewSection, tool_glob_matches
from gatewayd.policy.section import _check_tool_pattern, tool_pattern_matches


@pytest.mark.parametrize(
    ("pattern", "tool", "matches"),
    [
        ("app_*", "app_note_taker", True),
        ("app_*", "app_x", True),
        ("app_*", "app_", False),  # nothing after the prefix
        ("app_*", "apps.x", False),
        ("app_*", "application", False),
        ("app_*", "app", False),
        ("app_*", "app_x.y", False),  # the wildcard stays in one segment
        ("app_*", "xapp_note", False),
        ("app_note_*", "app_note_taker", True),
        ("app_note_*", "app_notes", False),
        ("fs.read_*", "fs.read_many", True),
        ("fs.read_*", "fs.read", False),
        ("fs.*", "fs.read", True),
        ("fs.*", "fs_read", False),
        ("app_note_taker", "app_note_taker", True),
        ("app_note_taker", "app_note_taker2", False),
    ],
)
def test_what_each_pattern_matches(pattern: str, tool: str, matches: bool) -> None:
    _check_tool_pattern(pattern)  # every pattern in the table is valid
    assert tool_pattern_matches(pattern, tool) is matches
    # dispatch and tools.list (decide.tool_matches) and the review's tools use one matcher
    assert tool_matches(pattern, tool) is matches
    assert tool_glob_matches(pattern, tool) is matches


@pytest.mark.parametrize(
    ("value", "hint"),
    [
        ("*", "no pattern allows every tool"),
        ("_*", "no pattern allows every tool"),
        (".*", "no pattern allows every tool"),
        ("app*", "did you mean 'app.*' (the app family) or 'app_*'"),
        ("app_note*", "'app_note_*'"),
        ("App_*", "did you mean 'app_*'? (tool names are lowercase)"),
        ("app_**", "'app_*'"),
        ("*_app", ""),
        ("app_*.x", ""),
        ("app-*", ""),
    ],
)
def test_broad_or_malformed_patterns_are_refused_with_a_hint(value: str, hint: str) -> None:
    with pytest.raises(ValueError) as caught:
        _check_tool_pattern(value)
    message = str(caught.value)
    assert "nor a prefix wildcard such as 'app_*'" in message
    assert hint in message


def test_review_tools_accept_the_prefix_wildcard_and_review_app_tools() -> None:
    section = ReviewSection.model_validate({"mode": "llm", "model": "m", "tools": ["app_*"]})
    assert section.reviews("app_note_taker")
    assert not section.reviews("fs.read")
    with pytest.raises(ValidationError):
        ReviewSection.model_validate({"mode": "llm", "model": "m", "tools": ["app*"]})
