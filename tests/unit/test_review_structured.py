"""Structured review rules: tool glob, path, domain, regex and numeric matchers, decided
in order before any model call."""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gatewayd.policy.review_section import StructuredRule
from gatewayd.review.structured import (
    StructuredDecision,
    compile_path_glob,
    compile_rules,
    decide_structured,
    path_glob_matches,
)


def _rules(*specs: dict[str, Any]) -> tuple[StructuredRule, ...]:
    return tuple(StructuredRule.model_validate(spec) for spec in specs)


def _matches(spec: dict[str, Any], args: dict[str, Any], tool: str = "fs.read") -> bool:
    return decide_structured(tool, args, _rules(spec)) is not None


# --- paths ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("glob", "path", "expected"),
    [
        ("/workspace/.git/**", "/workspace/.git/config", True),
        ("/workspace/.git/**", "/workspace/.git/objects/ab/cdef", True),
        ("/workspace/.git/**", "/workspace/.git", True),  # ** spans zero names too
        ("/workspace/.git/**", "/workspace/.gitignore", False),
        ("/workspace/.git/**", ".git/HEAD", True),  # relative to /workspace
        ("/workspace/.git/**", "src/../.git/HEAD", True),  # .. resolved as text
        ("/workspace/.git/**", "/workspace/./.git//HEAD", True),
        ("/etc/**", "../../etc/passwd", True),  # .. stops at /
        ("/workspace/*.md", "/workspace/notes.md", True),
        ("/workspace/*.md", "/workspace/sub/notes.md", False),  # * stays in one name
        ("/workspace/*.md", "/workspace/notes.md.txt", False),
        ("/workspace/**/*.md", "/workspace/notes.md", True),
        ("/workspace/**/*.md", "/workspace/a/b/c/notes.md", True),
        ("/workspace/**/*.md", "/workspace/a/b/notes.txt", False),
        ("/workspace/*", "/workspace", False),
        ("/workspace/*", "/workspace/x/y", False),
        ("/**", "/", True),
        ("/", "/", True),
        ("/", "/workspace", False),
        ("/workspace/a*b*c", "/workspace/abc", True),
        ("/workspace/a*b*c", "/workspace/aXbYc", True),
        ("/workspace/a*b*c", "/workspace/acb", False),
        ("/workspace/a*a", "/workspace/a", False),  # prefix and suffix may not overlap
        ("/workspace/a?c", "/workspace/abc", False),  # ? is literal
        ("/workspace/a?c", "/workspace/a?c", True),
        ("/workspace/[ab]", "/workspace/a", False),  # [ is literal
        ("/workspace/**/**/k", "/workspace/k", True),
        ("/workspace/**/x/**/y", "/workspace/x/x/q/y", True),
        ("/workspace/**/x/**/y", "/workspace/y/x", False),
        ("/workspace/../etc/*", "/etc/hosts", True),  # the glob is normalized as well
    ],
)
def test_path_globs_match_normalized_agent_paths(glob: str, path: str, expected: bool) -> None:
    assert path_glob_matches(compile_path_glob(glob), path) is expected
    assert _matches({"effect": "deny", "path": glob}, {"path": path}) is expected


def test_a_long_path_against_many_double_stars_is_decided() -> None:
    glob = compile_path_glob("/**/a/**/a/**/a/**/b")
    assert not path_glob_matches(glob, "/" + "/".join(["a"] * 3000))
    assert path_glob_matches(glob, "/" + "/".join(["a"] * 3000) + "/b")
    assert not path_glob_matches(compile_path_glob("/*a*a*a*a*b"), "/" + "a" * 4000)


def _reference(tokens: Sequence[str], parts: Sequence[str]) -> bool:
    """A plainly recursive glob matcher built from re, to check the linear scan against."""

    @functools.cache
    def go(t: int, p: int) -> bool:
        if t == len(tokens):
            return p == len(parts)
        if tokens[t] == "**":
            return go(t + 1, p) or (p < len(parts) and go(t, p + 1))
        pattern = ".*".join(re.escape(piece) for piece in tokens[t].split("*"))
        return (
            p < len(parts)
            and re.fullmatch(pattern, parts[p], re.S) is not None
            and go(t + 1, p + 1)
        )

    return go(0, 0)


@given(
    tokens=st.lists(
        st.sampled_from(["a", "b", "ab", "*", "**", "a*", "*b", "a*b", "*a*"]), max_size=6
    ),
    parts=st.lists(st.sampled_from(["a", "b", "ab", "ba", "aab", "bab"]), max_size=7),
)
def test_the_glob_scan_agrees_with_a_recursive_matcher(tokens: list[str], parts: list[str]) -> None:
    glob = compile_path_glob("/" + "/".join(tokens))
    assert path_glob_matches(glob, "/" + "/".join(parts)) is _reference(tokens, parts)


def test_a_deny_matches_when_any_path_does_and_an_allow_only_when_all_do() -> None:
    mixed = {"paths": ["/workspace/notes/a.md", "/workspace/.env"]}
    same = {"paths": ["/workspace/notes/a.md", "notes/b.md"]}
    assert _matches({"effect": "deny", "path": "/workspace/.env"}, mixed)
    assert not _matches({"effect": "allow", "path": "/workspace/notes/**"}, mixed)
    assert _matches({"effect": "allow", "path": "/workspace/notes/**"}, same)
    both = {"path": "/workspace/notes/a.md", "paths": ["/workspace/.env"]}
    assert not _matches({"effect": "allow", "path": "/workspace/notes/**"}, both)


def test_a_path_rule_does_not_match_a_call_without_path_arguments() -> None:
    assert not _matches({"effect": "deny", "path": "/**"}, {"content": "x"})
    assert not _matches({"effect": "allow", "path": "/**"}, {"content": "x"})
    assert not _matches({"effect": "allow", "path": "/**"}, {"paths": []})


@pytest.mark.parametrize(
    "args", [{"path": 5}, {"path": None}, {"paths": "/workspace/a"}, {"paths": ["a", 7]}]
)
def test_a_path_value_that_is_not_a_path_matches_denies_and_no_allow(args: dict[str, Any]) -> None:
    assert _matches({"effect": "deny", "path": "/nowhere/**"}, args)
    assert not _matches({"effect": "allow", "path": "/**"}, args)


# --- domains ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("domain", "args", "expected"),
    [
        ("example.org", {"url": "https://example.org/x"}, True),
        ("example.org", {"url": "https://EXAMPLE.Org./x?q=1"}, True),
        ("example.org", {"url": "https://user:pw@example.org:8443/p"}, True),
        ("example.org", {"url": "https://sub.example.org/"}, False),
        ("example.org", {"url": "https://example.org.evil.net/"}, False),
        ("*.example.org", {"url": "https://a.example.org"}, True),
        ("*.example.org", {"url": "https://a.b.example.org/x"}, True),
        ("*.example.org", {"url": "https://example.org"}, False),  # strict subdomains only
        ("*.example.org", {"url": "https://badexample.org"}, False),
        ("evil.org", {"url": "https://example.org@evil.org/"}, True),  # userinfo is not the host
        ("example.org", {"host": "Example.ORG."}, True),
        ("example.org", {"host": "example.org.."}, False),
        ("127.0.0.1", {"url": "http://127.0.0.1:8080/"}, True),
        ("example.org", {"uri": "https://example.org"}, False),  # only url and host are read
    ],
)
def test_domains_match_the_host_of_url_and_host_arguments(
    domain: str, args: dict[str, Any], expected: bool
) -> None:
    assert _matches({"effect": "allow", "domain": domain}, args, "http.fetch") is expected


@pytest.mark.parametrize(
    "args",
    [
        {"url": "https://example.org\\@evil.org/"},  # urllib and browsers disagree on the host
        {"url": "https://exämple.org/"},  # non-ASCII: IDNA flavours disagree; refused
        {"url": "https://example.org /"},
        {"url": "example.org/path"},  # no scheme, so no host
        {"url": "http://[::1/"},  # urllib raises on this
        {"url": "http://[::1]/"},  # an IPv6 literal is no host name a rule can spell
        {"url": 42},
        {"host": "example.org:443"},
        {"host": ["example.org"]},
    ],
)
def test_an_unreadable_host_matches_every_deny_and_no_allow(args: dict[str, Any]) -> None:
    assert _matches({"effect": "deny", "domain": "unrelated.net"}, args, "http.fetch")
    assert not _matches({"effect": "allow", "domain": "example.org"}, args, "http.fetch")


def test_url_and_host_together_deny_on_either_and_allow_only_on_both() -> None:
    args = {"url": "https://example.org/", "host": "evil.org"}
    assert _matches({"effect": "deny", "domain": "evil.org"}, args, "http.fetch")
    assert not _matches({"effect": "allow", "domain": "example.org"}, args, "http.fetch")
    agreeing = {"url": "https://a.example.org/", "host": "b.example.org"}
    assert _matches({"effect": "allow", "domain": "*.example.org"}, agreeing, "http.fetch")


# --- regex and numeric bounds --------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ({"content": "key: -----BEGIN PRIVATE KEY-----"}, True),  # search, not fullmatch
        ({"content": "nothing to see"}, False),
        ({"content": ["-----BEGIN PRIVATE KEY-----"]}, False),  # not a string
        ({"other": "-----BEGIN PRIVATE KEY-----"}, False),  # missing
    ],
)
def test_regex_searches_one_named_string_argument(args: dict[str, Any], expected: bool) -> None:
    spec = {"effect": "deny", "regex": {"field": "content", "pattern": r"BEGIN [A-Z ]*PRIVATE KEY"}}
    assert _matches(spec, args, "fs.write") is expected


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ({"limit": 5}, True),
        ({"limit": 100}, True),
        ({"limit": 99.5}, True),
        ({"limit": 101}, False),
        ({"limit": 2**80}, False),
        ({"limit": float("nan")}, False),
        ({"limit": True}, False),  # a bool is not a number
        ({"limit": "5"}, False),
        ({}, False),
    ],
)
def test_max_bounds_one_named_number(args: dict[str, Any], expected: bool) -> None:
    spec = {"effect": "allow", "skip_model": True, "max": {"field": "limit", "value": 100}}
    assert _matches(spec, args) is expected


def test_every_matcher_a_rule_gives_must_match() -> None:
    spec = {
        "effect": "allow",
        "tool": "fs.*",
        "path": "/workspace/**/*.md",
        "regex": {"field": "content", "pattern": "^# "},
    }
    assert _matches(spec, {"path": "a.md", "content": "# Title"}, "fs.write")
    assert not _matches(spec, {"path": "a.txt", "content": "# Title"}, "fs.write")
    assert not _matches(spec, {"path": "a.md", "content": "no title"}, "fs.write")
    assert not _matches(spec, {"path": "a.md", "content": "# Title"}, "time.now")


# --- decisions ----------------------------------------------------------------------


RULES = _rules(
    {
        "effect": "deny",
        "tool": "fs.*",
        "path": "/workspace/.git/**",
        "reason": "git internals are off limits",
    },
    {"effect": "allow", "tool": "time.now", "skip_model": True},
    {"effect": "deny", "tool": "fs.write"},
    {"effect": "allow", "tool": "*"},
)


@pytest.mark.parametrize(
    ("tool", "args", "expected"),
    [
        (
            "fs.read",
            {"path": ".git/config"},
            StructuredDecision(
                effect="deny", skip_model=False, reason="git internals are off limits", rule_index=0
            ),
        ),
        (
            "time.now",
            {},
            StructuredDecision(effect="allow", skip_model=True, reason="", rule_index=1),
        ),
        (
            "fs.write",
            {"path": "a.md"},
            StructuredDecision(
                effect="deny",
                skip_model=False,
                reason="the review policy's structured rule 3 denies this call of fs.write",
                rule_index=2,
            ),
        ),
        (
            "fs.read",
            {"path": "a.md"},
            StructuredDecision(effect="allow", skip_model=False, reason="", rule_index=3),
        ),
    ],
)
def test_the_first_matching_rule_decides_and_is_named(
    tool: str, args: dict[str, Any], expected: StructuredDecision
) -> None:
    assert decide_structured(tool, args, RULES) == expected
    assert decide_structured(tool, args, compile_rules(RULES)) == expected


def test_no_matching_rule_leaves_the_call_to_the_model() -> None:
    assert decide_structured("fs.read", {"path": "a.md"}, RULES[:3]) is None
    assert decide_structured("fs.read", {"path": "a.md"}, ()) is None


def test_a_default_deny_reason_shows_the_tool_name_safely() -> None:
    decision = decide_structured("fs.write\x1b[2J", {}, _rules({"effect": "deny"}))
    assert decision is not None
    assert (
        decision.reason
        == "the review policy's structured rule 1 denies this call of fs.write\\x1b[2J"
    )


def test_equal_rule_lists_are_compiled_once() -> None:
    assert compile_rules(RULES) is compile_rules(list(RULES))
    assert compile_rules(RULES) is not compile_rules(RULES[:2])
