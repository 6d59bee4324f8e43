"""The policy's ``approvals`` section: its validation (errors that name the field) and
which calls it marks, table-driven, including the spellings an agent could use to slip
past a pattern (the patterns are a convenience, and the docs say so: these pin down
exactly what they match)."""

from __future__ import annotations

from typing import Any

import pytest

from gatewayd.policy.approvals_section import (
    DEFAULT_APPROVAL_TIMEOUT_S,
    MAX_APPROVAL_TIMEOUT_S,
    ApprovalsSection,
    argument_text,
    required_approval,
)
from gatewayd.policy.model import PolicyError, load_policy_text

HEAD = "version: 1\nname: p\n"


def section(text: str) -> ApprovalsSection:
    return load_policy_text(HEAD + text, "p.yaml").approvals


def test_no_section_marks_nothing_and_has_the_default_timeout() -> None:
    approvals = load_policy_text(HEAD, "p.yaml").approvals
    assert approvals.required == () and approvals.timeout_s == DEFAULT_APPROVAL_TIMEOUT_S
    assert required_approval(approvals, "fs.write", {"path": "x"}) is None


MARKS = """
approvals:
  required:
    - {tool: sandbox.exec, args: {command: '\\bgit\\s+push\\b'}, reason: pushes leave}
    - {tool: "fs.*", args: {path: '\\.env$'}}
    - {tool: http.fetch, args: {method: '^(POST|PUT|DELETE)$'}}
    - {tool: model.chat}
  timeout_s: 42
"""


@pytest.mark.parametrize(
    ("tool", "args", "index"),
    [
        ("sandbox.exec", {"command": ["git", "push", "origin"]}, 1),
        ("sandbox.exec", {"command": ["sh", "-c", "cd x && git  push"]}, 1),
        ("sandbox.exec", {"command": "git push"}, 1),
        ("sandbox.exec", {"command": ["git", "status"]}, None),
        ("sandbox.exec", {"command": ["git", "pushy"]}, None),
        ("sandbox.exec", {}, None),  # the argument is absent: no pattern matches it
        ("sandbox.exec", {"command": None}, None),
        ("fs.write", {"path": "conf/.env", "content": "x"}, 2),
        ("fs.read", {"path": ".env"}, 2),
        ("fs.read", {"path": ".env.example"}, None),
        ("http.fetch", {"url": "https://x.org", "method": "POST"}, 3),
        ("http.fetch", {"url": "https://x.org", "method": "GET"}, None),
        ("model.chat", {"messages": []}, 4),  # no args: the whole tool
        ("time.now", {}, None),
    ],
)
def test_which_calls_wait(tool: str, args: dict[str, Any], index: int | None) -> None:
    found = required_approval(section(MARKS), tool, args)
    if index is None:
        assert found is None
    else:
        assert found is not None and found.index == index and found.timeout_s == 42


def test_the_first_matching_entry_is_named_with_its_reason() -> None:
    found = required_approval(section(MARKS), "sandbox.exec", {"command": ["git", "push"]})
    assert found is not None
    assert found.describe() == {
        "index": 1,
        "tool": "sandbox.exec",
        "args": {"command": "\\bgit\\s+push\\b"},
        "reason": "pushes leave",
    }


def test_every_pattern_of_an_entry_must_match() -> None:
    both = section("approvals: {required: [{tool: http.fetch, args: {url: 'corp', method: POST}}]}")
    assert required_approval(both, "http.fetch", {"url": "https://corp.x", "method": "POST"})
    assert not required_approval(both, "http.fetch", {"url": "https://corp.x", "method": "GET"})
    assert not required_approval(both, "http.fetch", {"url": "https://a.x", "method": "POST"})


def test_a_star_marks_every_tool_and_a_family_only_its_members() -> None:
    every = section("approvals: {required: [{tool: '*'}]}")
    assert required_approval(every, "time.now", {})
    family = section("approvals: {required: [{tool: 'fs.*'}]}")
    assert required_approval(family, "fs.list", {})
    assert not required_approval(family, "fsx.list", {})


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ("a b", "a b"),
        (["git", "push"], "git push"),
        (("a",), "a"),
        (7, "7"),
        (True, "true"),
        ({"b": 1, "a": [1, "x"]}, '{"a":[1,"x"],"b":1}'),  # canonical JSON: keys sorted
        ([1, "x"], '[1,"x"]'),
        (None, None),
    ],
)
def test_an_argument_is_read_as_text_one_way(value: Any, text: str | None) -> None:
    assert argument_text(value) == text


def test_a_pattern_on_a_nested_value_reads_its_json() -> None:
    nested = section("approvals: {required: [{tool: x.y, args: {headers: 'Authorization'}}]}")
    assert required_approval(nested, "x.y", {"headers": {"Authorization": "Bearer t"}})


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("approvals: {required: [{tool: 'Fs.Write'}]}", "approvals.required.0.tool"),
        ("approvals: {required: [{tool: x, args: {command: '('}}]}", "not a valid regular"),
        ("approvals: {required: [{tool: x, args: {'bad name': a}}]}", "plain identifier"),
        ("approvals: {required: [{tool: x, when: y}]}", "approvals.required.0.when"),
        ("approvals: {timeout_s: 0}", "approvals.timeout_s"),
        (f"approvals: {{timeout_s: {MAX_APPROVAL_TIMEOUT_S + 1}}}", "approvals.timeout_s"),
        ("approvals: {timeout_s: '5'}", "approvals.timeout_s"),
        ("approvals: {requird: []}", "did you mean 'required'"),
    ],
)
def test_a_bad_section_is_refused_naming_the_field(text: str, problem: str) -> None:
    with pytest.raises(PolicyError) as info:
        load_policy_text(HEAD + text, "p.yaml")
    assert problem in str(info.value)
