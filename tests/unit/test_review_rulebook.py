"""The rule book's look at the policy file: every reviewed call looks (one ``stat``),
so an edit by hand reaches the next one; a call answered at once may take rules looked
at a moment ago (``max_age_s``), and only that call."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from gatewayd.policyfile import load_policy
from gatewayd.review import rulebook
from gatewayd.review.rulebook import RuleBook

POLICY = """
version: 1
name: aged
tools:
  allow: [time.now]
require_os_sandbox: false
review:
  mode: llm
  model: reviewer
  tools: ["fs.*"]
  rules:
    deny:
      - Deleting anything
"""


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def looks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every look at a policy file's identity (its stat), by path."""
    seen: list[str] = []
    identity = rulebook._identity

    def counting(path: str) -> tuple[int, int, int]:
        seen.append(path)
        return identity(path)

    monkeypatch.setattr(rulebook, "_identity", counting)
    return seen


def _hand_edit(path: Path) -> None:
    path.write_text(path.read_text().replace('tools: ["fs.*"]', 'tools: ["fs.*", time.now]'))


def test_a_look_no_older_than_max_age_is_trusted_and_an_older_one_is_not(
    tmp_path: Path, looks: list[str]
) -> None:
    path = tmp_path / "aged.yaml"
    path.write_text(textwrap.dedent(POLICY))
    loaded = load_policy(path).review
    clock = Clock()
    book = RuleBook(clock=clock)
    section, _ = book.current(str(path), loaded, max_age_s=0.01)
    assert not section.reviews("time.now") and len(looks) == 1
    _hand_edit(path)
    for _ in range(5):  # within the age: the rules as last looked at, no stat
        section, _ = book.current(str(path), loaded, max_age_s=0.01)
        assert not section.reviews("time.now")
    assert len(looks) == 1
    clock.now += 0.011  # past it: looked at again, and the edit is in force
    section, _ = book.current(str(path), loaded, max_age_s=0.01)
    assert section.reviews("time.now") and len(looks) == 2


def test_without_max_age_every_ask_looks_and_sees_a_hand_edit_at_once(
    tmp_path: Path, looks: list[str]
) -> None:
    path = tmp_path / "aged.yaml"
    path.write_text(textwrap.dedent(POLICY))
    loaded = load_policy(path).review
    book = RuleBook(clock=Clock())  # the clock never moves: only a look sees the edit
    book.current(str(path), loaded, max_age_s=0.01)
    _hand_edit(path)
    section, _ = book.current(str(path), loaded)
    assert section.reviews("time.now")
    book.current(str(path), loaded)
    assert len(looks) == 3
