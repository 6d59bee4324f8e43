"""APP.md at its real caps: the largest inputs that reach the Markdown parser.

Seconds each, so out of the fast lane; tests/unit/test_app_manifest.py holds the same
checks at a small size or under a small bullet-line bound.
"""

from __future__ import annotations

import pytest

from gatewayd.apps.manifest import MAX_BULLET_LINES, MAX_MANIFEST_BYTES
from tests.unit.test_app_manifest import (
    HOSTILE_FILLERS,
    assert_hostile_markdown_ends_in_an_answer,
    assert_rules_past_the_cap_are_counted_not_read,
)


@pytest.mark.parametrize("filler", HOSTILE_FILLERS)
def test_hostile_markdown_at_the_cap_ends_in_an_answer(filler: str) -> None:
    assert_hostile_markdown_ends_in_an_answer(filler, MAX_MANIFEST_BYTES)


@pytest.mark.parametrize("side", ["Allow", "Deny"])
def test_rules_past_the_cap_are_counted_not_read(side: str) -> None:
    assert_rules_past_the_cap_are_counted_not_read(side, MAX_BULLET_LINES)
