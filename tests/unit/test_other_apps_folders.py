"""No run holds, or runs inside, another workspace's apps folder: the comparison by name
(pure) and by identity (real directories), for the run's workspace and every policy
path, and what the refusal says."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path, PurePosixPath

import pytest

from gatewayd.apps.workspaces import APPS_RECORD_FILE, AppsRecordError, recorded_workspaces
from gatewayd.hostpaths.otherapps import (
    OtherAppsFolderHeld,
    guard_apps_folders,
    other_workspaces,
    refuse_held_folders,
)
from gatewayd.policy.appsfolder import apps_folder_overlap
from gatewayd.policy.paths import PathGrant, PathMode
from gatewayd.protocol import ErrorCode

P = PurePosixPath


# --- by name ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("root", "relation"),
    [
        ("/srv/team/ws-a/apps", "lies in"),  # the folder itself
        ("/srv/team/ws-a/apps/notes/data", "lies in"),
        ("/srv/team/ws-a/APPS", "lies in"),  # a case-folding file system's other name
        ("/srv/team/ws-a/Apps/notes", "lies in"),
        ("/srv/team/ws-a/app\u017f", "lies in"),  # long s: casefolds to "apps"
        ("/srv/team/ws-a", "holds"),  # the workspace itself
        ("/srv/team", "holds"),
        ("/srv", "holds"),
        ("/", "holds"),
        ("/srv/team/ws-b", None),  # a sibling
        ("/srv/team/ws-a2", None),  # a name that merely starts the same
        ("/srv/team/ws-a/docs", None),  # beside the folder, in the same workspace
        ("/srv/team/ws-a/appsx", None),
        ("/srv/team/ws-a/docs/apps", None),  # an 'apps' deeper is no apps folder
        ("/srv/other", None),
    ],
)
def test_a_root_holds_lies_in_or_stays_apart_from_another_apps_folder(
    root: str, relation: str | None
) -> None:
    assert apps_folder_overlap(P(root), P("/srv/team/ws-a")) == relation


# --- by name and identity, on real directories -------------------------------------------


@pytest.fixture
def team(tmp_path: Path) -> Path:
    """``team/ws-a`` holds an app; ``team/ws-b`` and ``team/shared`` hold none."""
    team = tmp_path / "team"
    for name in ("ws-a/apps/notes/data", "ws-b", "shared/docs"):
        (team / name).mkdir(parents=True)
    (team / "ws-a" / "apps" / "notes" / "APP.md").write_text("---\nname: notes\n---\n")
    return team


def grant(name: str, root: Path, mode: PathMode = PathMode.RO) -> PathGrant:
    st = root.stat()
    return PathGrant(
        name=name,
        host_root=root,
        root_id=(st.st_dev, st.st_ino),
        holds_nested=False,
        visible_root=P(f"/data/{name}"),
        mode=mode,
    )


def held(roots: list[tuple[str, Path]], others: list[Path]) -> str:
    with pytest.raises(OtherAppsFolderHeld) as caught:
        refuse_held_folders(roots, others)
    assert caught.value.code is ErrorCode.BAD_REQUEST
    return str(caught.value)


def test_a_workspace_holding_another_is_refused_with_the_folder_and_the_fix(team: Path) -> None:
    a = team / "ws-a"
    message = held([("its workspace", team)], [a])
    assert message == (
        f"run refused: its workspace {team} holds {a / 'apps'}, another workspace's apps "
        "folder: no other run may hold it or run inside it. To start, name the directories "
        f"the run needs beside {a} instead (workspaces holding apps: apps-workspaces.json "
        "in gatewayd's state directory)"
    )


@pytest.mark.parametrize(
    "below", ["", "apps", "apps/notes", "apps/notes/data"], ids=["ws", "folder", "app", "data"]
)
def test_a_root_at_or_in_the_folder_or_at_its_workspace_is_refused(team: Path, below: str) -> None:
    a = team / "ws-a"
    root = a / below if below else a
    message = held([("its policy path 'x'", root)], [a])
    relation = "holds" if below == "" else "lies in"
    assert message.startswith(f"run refused: its policy path 'x' {root} {relation} {a / 'apps'}")
    if relation == "lies in":
        assert message.endswith(
            "To start, name a directory outside it (workspaces holding apps: "
            "apps-workspaces.json in gatewayd's state directory)"
        )


def test_siblings_and_roots_beside_the_folder_are_fine(team: Path) -> None:
    a = team / "ws-a"
    roots = [
        ("its workspace", team / "ws-b"),
        ("its policy path 'shared'", team / "shared"),
        ("its policy path 'docs'", team / "shared" / "docs"),
    ]
    refuse_held_folders(roots, [a])
    refuse_held_folders([("its workspace", team)], [])  # nothing recorded: nothing held


def test_a_recorded_workspace_whose_folder_is_gone_is_still_protected_by_name(
    team: Path,
) -> None:
    # An install may make the folder again while the run lives.
    a = team / "ws-a"
    (a / "apps" / "notes" / "APP.md").unlink()
    for path in ("apps/notes/data", "apps/notes", "apps"):
        (a / path).rmdir()
    assert "holds" in held([("its workspace", team)], [a])
    # And a recorded workspace that is gone altogether, through its nearest parent.
    assert "holds" in held([("its workspace", team)], [team / "gone" / "ws"])


def test_another_name_of_a_directory_is_caught_by_identity(team: Path, tmp_path: Path) -> None:
    # A bind mount shows ws-a under a name that shares nothing with it: by name the two
    # are apart, by (device, inode) the root *is* ws-a.
    alias = tmp_path / "alias"
    alias.mkdir()
    if subprocess.run(["mount", "--bind", str(team / "ws-a"), str(alias)]).returncode != 0:
        pytest.skip("cannot bind mount here")
    try:
        a = team / "ws-a"
        assert apps_folder_overlap(alias, a) is None
        assert held([("its policy path 'alias'", alias)], [a]).startswith(
            f"run refused: its policy path 'alias' {alias} holds {a / 'apps'}"
        )
        assert "lies in" in held([("its policy path 'x'", alias / "apps" / "notes")], [a])
        assert "lies in" in held([("its policy path 'x'", alias / "apps")], [a])
    finally:
        subprocess.run(["umount", str(alias)], check=True)


def test_a_symlinked_parent_in_the_record_is_followed_to_the_real_folder(
    team: Path, tmp_path: Path
) -> None:
    # The record holds a path that has become a symlink to the real team directory:
    # the folder an install there fills is the real one, and a root holding it is held.
    link = tmp_path / "link"
    link.symlink_to(team)
    assert "holds" in held([("its policy path 'team'", team)], [link / "ws-a"])


def test_the_run_s_own_workspace_is_no_other_by_name_or_identity(
    team: Path, tmp_path: Path
) -> None:
    a = team / "ws-a"
    link = tmp_path / "link-a"
    link.symlink_to(a)
    assert other_workspaces(a, [a, link, team / "ws-b"]) == (team / "ws-b",)


# --- guard_apps_folders: the record, then the refusal ------------------------------------


@pytest.fixture
def state(tmp_path: Path) -> Path:
    path = tmp_path / "state"
    path.mkdir()
    return path


def test_a_run_in_a_workspace_holding_apps_records_it_and_then_guards_it(
    team: Path, state: Path
) -> None:
    a = team / "ws-a"
    assert guard_apps_folders(state, a, [grant("home", team)]) == ()  # its own: covered
    assert recorded_workspaces(state) == (a,)
    # The next run, in a sibling, with the team directory read-only: refused.
    with pytest.raises(OtherAppsFolderHeld, match=r"its policy path 'home' .* holds"):
        guard_apps_folders(state, team / "ws-b", [grant("home", team)])
    # With only the directory it needs: fine, and told which folders to check for links.
    assert guard_apps_folders(state, team / "ws-b", [grant("shared", team / "shared")]) == (
        a / "apps",
    )


def test_a_workspace_without_apps_is_not_recorded(team: Path, state: Path) -> None:
    guard_apps_folders(state, team / "ws-b", [])
    assert not (state / APPS_RECORD_FILE).exists()


def test_a_writable_policy_path_is_refused_the_same(team: Path, state: Path) -> None:
    guard_apps_folders(state, team / "ws-a", [])
    with pytest.raises(OtherAppsFolderHeld, match=r"its policy path 'rw' .* holds"):
        guard_apps_folders(state, team / "ws-b", [grant("rw", team, PathMode.RW)])


def test_a_workspace_inside_another_s_apps_folder_is_refused(team: Path, state: Path) -> None:
    a = team / "ws-a"
    guard_apps_folders(state, a, [])
    data = a / "apps" / "notes" / "data"
    with pytest.raises(OtherAppsFolderHeld) as caught:
        guard_apps_folders(state, data, [])
    assert str(caught.value).startswith(
        f"run refused: its workspace {data} lies in {a / 'apps'}, another workspace's apps folder"
    )


def test_a_workspace_that_holds_apps_inside_another_workspace_is_refused_from_above(
    team: Path, state: Path
) -> None:
    # ws-a's app data is itself a workspace with apps: a run in ws-a covers its own apps
    # folder but holds the inner workspace's folder too, which it is refused.
    inner = team / "ws-a" / "apps" / "notes" / "data"
    (inner / "apps" / "x").mkdir(parents=True)
    (inner / "apps" / "x" / "APP.md").write_text("x\n")
    guard_apps_folders(state, inner, [])
    with pytest.raises(OtherAppsFolderHeld, match="holds"):
        guard_apps_folders(state, team / "ws-a", [])


def test_a_damaged_record_refuses_every_run(team: Path, state: Path) -> None:
    (state / APPS_RECORD_FILE).write_text(json.dumps({"version": 1, "workspaces": ["rel"]}))
    with pytest.raises(AppsRecordError, match="entry 0 is not an absolute path"):
        guard_apps_folders(state, team / "ws-b", [])


def test_the_record_is_compared_on_every_root_not_only_the_first(team: Path) -> None:
    a = team / "ws-a"
    roots = [("its workspace", team / "ws-b"), ("its policy path 'later'", team)]
    assert "its policy path 'later'" in held(roots, [a])
    assert os.path.isdir(a / "apps")
