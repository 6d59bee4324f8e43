"""The policy's ``patches.exclude`` list: its default, its validation, and how an entry
matches a changed path (gatewayd/agent/patches.py's ``excluded_by``)."""

from __future__ import annotations

import pytest

from gatewayd.agent.patches import excluded_by
from gatewayd.policy import PolicyError, load_policy_text
from gatewayd.policy.patches_section import (
    DEFAULT_PATCH_EXCLUDE,
    MAX_EXCLUDE_PATTERN_CHARS,
    MAX_EXCLUDE_PATTERNS,
)


def policy(section: str) -> str:
    return f"version: 1\nname: p\n{section}"


def test_a_policy_without_the_section_leaves_out_the_well_known_caches() -> None:
    loaded = load_policy_text(policy(""), "p.yaml")
    assert loaded.patches.exclude == DEFAULT_PATCH_EXCLUDE
    for cache in ("__pycache__", "*.pyc", ".pytest_cache", "node_modules", ".venv", ".tox"):
        assert cache in DEFAULT_PATCH_EXCLUDE


def test_the_policy_list_replaces_the_default_and_may_be_empty() -> None:
    loaded = load_policy_text(policy("patches:\n  exclude: [dist, '*.o']\n"), "p.yaml")
    assert loaded.patches.exclude == ("dist", "*.o")
    empty = load_policy_text(policy("patches:\n  exclude: []\n"), "p.yaml")
    assert empty.patches.exclude == ()


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("build/out", "must be one name or a glob of one (no '/'"),
        ("/abs", "must be one name or a glob of one (no '/'"),
        ("..", "must be one name or a glob of one"),
        ("''", "must be 1 to 255 characters"),
        ("x" * (MAX_EXCLUDE_PATTERN_CHARS + 1), "must be 1 to 255 characters"),
    ],
)
def test_an_entry_that_is_not_one_name_is_refused_naming_the_field(
    entry: str, message: str
) -> None:
    with pytest.raises(PolicyError) as caught:
        load_policy_text(policy(f"patches:\n  exclude: [{entry}]\n"), "p.yaml")
    text = str(caught.value)
    assert "patches.exclude" in text and message in text, text


def test_a_list_longer_than_the_limit_is_refused() -> None:
    entries = ", ".join(f"n{i}" for i in range(MAX_EXCLUDE_PATTERNS + 1))
    with pytest.raises(PolicyError, match=r"patches\.exclude"):
        load_policy_text(policy(f"patches:\n  exclude: [{entries}]\n"), "p.yaml")


@pytest.mark.parametrize(
    ("rel", "expected"),
    [
        ("__pycache__/calc.cpython-311.pyc", "__pycache__"),
        ("src/pkg/__pycache__/m.pyc", "__pycache__"),
        ("lib/legacy.pyc", "*.pyc"),
        (".pytest_cache/v/cache/nodeids", ".pytest_cache"),
        ("web/node_modules/left-pad/index.js", "node_modules"),
        ("calc.egg-info/PKG-INFO", "*.egg-info"),
        ("src/calc.py", None),
        ("docs/pycache.md", None),  # a name, not a substring
        ("src/__PYCACHE__/x", None),  # case-sensitive
        ("notes.pyc.txt", None),
    ],
)
def test_an_entry_matches_any_component_of_the_path(rel: str, expected: str | None) -> None:
    assert excluded_by(rel, DEFAULT_PATCH_EXCLUDE) == expected


def test_globs_match_one_component_only() -> None:
    assert excluded_by("a/b/c.o", ("*.o",)) == "*.o"
    assert excluded_by("a/b/c.o", ("b*",)) == "b*"
    assert excluded_by("a/b/c.o", ("a/b",)) is None  # never '/': nothing matches it
    assert excluded_by("tmp1/x", ("tmp[0-9]",)) == "tmp[0-9]"
    assert excluded_by("anything", ()) is None
