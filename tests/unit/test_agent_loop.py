"""The agent loop's pure parts: what of a workspace diff becomes the patch."""

from __future__ import annotations

import pytest

from gatewayd.agent.loop import _without_git_metadata, run_tools
from gatewayd.workspace import WorkspaceDiff


def test_the_top_level_git_directory_is_left_out_and_counted() -> None:
    diff = WorkspaceDiff(
        unified="",
        added=[".git/", ".git/hooks/pre-commit", "new.py", "sub/.git/config"],
        removed=[".git/index.lock", "old.py"],
        modified=[".git/index", "app.py", ".gitignore"],
        renamed=[(".git/x", "x"), ("y", ".git/y"), ("a", "b"), (".git/c", ".git/d")],
        binary=[".git/index", "logo.png"],
    )
    kept, left = _without_git_metadata(diff)
    # A nested .git stays in: the patch refuses it by name, and says so.
    assert kept.added == ["new.py", "sub/.git/config", "x"]
    assert kept.removed == ["old.py", "y"]
    assert kept.modified == ["app.py", ".gitignore"]
    assert kept.renamed == [("a", "b")]
    assert kept.binary == ["logo.png"]
    # 2 added + 1 removed + 1 modified + the 2 cross renames' .git sides + 2 sides of c->d
    assert left == 2 + 1 + 1 + 2 + 2


def test_a_diff_without_git_metadata_is_unchanged() -> None:
    diff = WorkspaceDiff(unified="x", added=["a"], modified=["b"], renamed=[("c", "d")])
    kept, left = _without_git_metadata(diff)
    assert left == 0
    assert (kept.added, kept.modified, kept.renamed, kept.unified) == (
        ["a"],
        ["b"],
        [("c", "d")],
        "x",
    )


OFFERED = ("fs.read", "fs.write", "sandbox.exec", "app.notes", "mcp.git.log")


def test_no_tool_ids_offer_every_tool_of_the_run() -> None:
    assert run_tools(OFFERED, ()) == OFFERED


def test_tool_ids_narrow_the_run_in_the_offered_order() -> None:
    assert run_tools(OFFERED, ("mcp.git.log", "fs.read")) == ("fs.read", "mcp.git.log")


def test_a_tool_id_the_run_does_not_offer_is_refused_naming_it_and_the_offered() -> None:
    with pytest.raises(ValueError) as caught:
        run_tools(OFFERED, ("fs.read", "net.raw", "app.missing"))
    message = str(caught.value)
    assert "tool ids app.missing, net.raw are not offered to this run" in message
    assert "offered: fs.read, fs.write, sandbox.exec, app.notes, mcp.git.log" in message
