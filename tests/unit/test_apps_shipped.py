"""Every example app shipped in apps/examples/ is valid, named like its folder, reads back
from its own rendering, and says what its documentation promises; docs/apps.md states
the numbers the code holds.

The folders are globbed, so an example added to apps/examples/ is tested here without
touching this file.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gatewayd.apps import discovery, manifest
from gatewayd.apps.discovery import DiscoveredApp, check_app_folder
from gatewayd.apps.manifest import parse_manifest, render_manifest
from gatewayd.policy.review_section import MAX_RULE_CHARS, MAX_RULES

EXAMPLES = Path(__file__).resolve().parents[2] / "apps" / "examples"
SHIPPED = sorted(path for path in EXAMPLES.iterdir() if path.is_dir())


def test_the_two_examples_the_docs_name_are_shipped() -> None:
    assert [path.name for path in SHIPPED] == ["note-taker", "repo-reviewer"]


@pytest.mark.parametrize("folder", SHIPPED, ids=lambda path: path.name)
def test_each_example_is_a_valid_app_named_like_its_folder(folder: Path) -> None:
    found = check_app_folder(folder)
    assert isinstance(found, DiscoveredApp), found
    assert found.id == folder.name
    app = found.manifest
    assert parse_manifest(render_manifest(app), "x") == app
    assert app.rules.allow and app.rules.deny


def _manifest(name: str) -> DiscoveredApp:
    found = check_app_folder(EXAMPLES / name)
    assert isinstance(found, DiscoveredApp)
    return found


def test_the_note_taker_keeps_its_notes_in_data_and_runs_nothing() -> None:
    rules = _manifest("note-taker").manifest.rules
    assert any("data/" in rule.text for rule in rules.allow)
    assert any("outside data/" in rule.text for rule in rules.deny)
    assert any("Running commands" in rule.text for rule in rules.deny)


def test_the_repo_reviewer_may_run_git_log_and_writes_nothing() -> None:
    rules = _manifest("repo-reviewer").manifest.rules
    assert any("git log" in rule.text for rule in rules.allow)
    assert any(
        rule.text.startswith("Writing, editing, creating or deleting") for rule in rules.deny
    )


# --- docs/apps.md states the numbers the code holds ----------------------------------------

DOC = EXAMPLES.parents[1] / "docs" / "apps.md"


def _limit_rows() -> dict[str, tuple[int, int]]:
    rows = re.findall(r"^\| `(\w+)`[^|]*\| ([\d,]+) \| ([\d,]+) \|$", DOC.read_text(), re.M)
    return {
        name: (int(low.replace(",", "")), int(high.replace(",", ""))) for name, low, high in rows
    }


def test_the_docs_state_each_limit_with_its_default_and_ceiling() -> None:
    assert _limit_rows() == {
        "turns": (manifest.DEFAULT_TURNS, manifest.MAX_TURNS),
        "tool_calls": (manifest.DEFAULT_TOOL_CALLS, manifest.MAX_TOOL_CALLS),
        "tokens": (manifest.DEFAULT_TOKENS, manifest.MAX_TOKENS),
        "wall_time_s": (int(manifest.DEFAULT_WALL_TIME_S), int(manifest.MAX_WALL_TIME_S)),
    }


def test_the_docs_state_the_caps() -> None:
    text = " ".join(DOC.read_text().split())
    assert f"at most {manifest.MAX_MANIFEST_BYTES // 1024} KiB (`MAX_MANIFEST_BYTES`" in text
    assert f"at most {manifest.MAX_SYSTEM_PROMPT_CHARS:,} characters" in text
    assert f"at most {MAX_RULES} rules each" in text
    assert f"({manifest.MAX_BULLET_LINES:,}: {MAX_RULES} rules on each side" in text
    assert f"of at most {MAX_RULE_CHARS} characters" in text
    assert f"At most {discovery.MAX_APPS} apps (`MAX_APPS`)" in text
    assert f"At most {discovery.MAX_APPS_DIR_ENTRIES} entries" in text
    assert f"1-{manifest.MAX_APP_ID_CHARS} lowercase letters" in text
    assert f"1-{manifest.MAX_TITLE_CHARS} characters, one line" in text
    assert f"1-{manifest.MAX_DESCRIPTION_CHARS} characters" in text
    assert f"`NAME` is 1-{manifest.MAX_ADDED_BY_CHARS} letters" in text
