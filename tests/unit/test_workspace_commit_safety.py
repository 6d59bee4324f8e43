"""What a commit of a kept session must never do, on real overlay mounts and real AgentFS
databases: write git metadata into the base (hooks and config run code on the host),
lose track of whether it was applied when it is killed part-way, or write a symlink
leading out of the workspace without naming it."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from gatewayd.workspace import WorkspaceError
from gatewayd.workspace.commit_rules import held_back, is_git_metadata, link_leads_out
from gatewayd.workspace.host import HostWorkspace
from gatewayd.workspace.store import (
    RunWorkspace,
    SessionInfo,
    WorkspaceConflict,
    WorkspaceStore,
    diff_json,
)
from tests.workspace_helpers import commit_in_child, tree, unmount_all_under

RUN = "c" * 32
KEEP_S = 3600
HOOK = "#!/bin/sh\ntouch /tmp/pwned\n"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="overlay mounts need root")


@pytest.fixture
def where(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    unmount_all_under(tmp_path)


@pytest.fixture(params=["overlay", "agentfs"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def make_repo(where: Path) -> Path:
    """A base that is a git repository (as a tree: no git needed), holding a vendored
    directory with its own repository inside."""
    base = where / "base"
    for rel, text in {
        ".git/HEAD": "ref: refs/heads/main\n",
        ".git/config": "[core]\n\tbare = false\n",
        ".git/index": "index v1\n",
        ".git/hooks/pre-commit.sample": "#!/bin/sh\n",
        "src/main.py": "print(1)\n",
        "README": "readme\n",
        "vendor/lib/.git/HEAD": "ref: refs/heads/main\n",
        "vendor/lib/code.c": "int x;\n",
    }.items():
        (base / rel).parent.mkdir(parents=True, exist_ok=True)
        (base / rel).write_text(text)
    return base


def open_run(
    store: WorkspaceStore, base: Path, mode: str, *, on_end: str = "keep", **kwargs: Any
) -> RunWorkspace:
    return store.open_session(
        RUN,
        base,
        mode,  # type: ignore[arg-type]
        on_end=on_end,  # type: ignore[arg-type]
        keep_for_s=KEEP_S,
        max_delta_bytes=None,
        **kwargs,
    )


def end(handle: RunWorkspace, store: WorkspaceStore) -> str:
    handle.session.sync()
    return store.end_of_run(handle.run_id)


def write(root: Path, rel: str, text: str, mode: int = 0o644) -> None:
    (root / rel).parent.mkdir(parents=True, exist_ok=True)
    (root / rel).write_text(text)
    os.chmod(root / rel, mode)


def run_plants_git_metadata(root: Path) -> None:
    """What a hostile run does to a repository it works in: a hook, a config that runs
    a program, a new nested repository with a hook, a ``.git`` file pointing elsewhere,
    a vendored repository removed; and one honest change."""
    write(root, ".git/hooks/pre-commit", HOOK, 0o755)
    write(root, ".git/config", "[core]\n\tfsmonitor = /tmp/evil\n")
    write(root, "nested/.git/hooks/post-checkout", HOOK, 0o755)
    write(root, "nested/file.txt", "kept\n")
    write(root, "pkg/.git", "gitdir: /tmp/evil\n")
    subprocess.run(["rm", "-rf", str(root / "vendor")], check=True)
    write(root, "src/main.py", "print(2)\n")


# --- git metadata ------------------------------------------------------------------


def test_a_commit_leaves_git_metadata_out_and_names_it(where: Path, mode: str) -> None:
    base = make_repo(where)
    git_before = tree(base / ".git")
    vendor_before = tree(base / "vendor")
    recorded: list[tuple[str, Mapping[str, Any]]] = []

    def record(event: object, run_id: str, detail: Mapping[str, Any]) -> None:
        recorded.append((str(event), detail))

    store = WorkspaceStore(where / "state", record=record)
    handle = open_run(store, base, mode)
    run_plants_git_metadata(handle.root)
    end(handle, store)

    # The diff shows every change, and marks what a commit leaves out, with why.
    preview = WorkspaceStore(where / "state").diff(RUN)
    assert ".git/hooks/pre-commit" in preview.added
    left = dict(preview.left_out)
    assert set(left) == {".git", "nested/.git", "pkg/.git", "vendor"}
    assert "git metadata" in left[".git"] and "commit_git_metadata" in left[".git"]
    assert "vendor/lib/.git" in left["vendor"] and "left as it is" in left["vendor"]
    wire = diff_json(preview)
    assert {"path": "pkg/.git", "reason": left["pkg/.git"]} in wire["leftOut"]
    assert ".git/hooks/pre-commit" in wire["gitMetadata"]

    committed = WorkspaceStore(where / "state", record=record).commit(RUN, by="test")
    assert tree(base / ".git") == git_before, "the base's .git was written"
    assert tree(base / "vendor") == vendor_before, "a vendored repository was deleted"
    assert not (base / "nested" / ".git").exists() and not (base / "pkg" / ".git").exists()
    assert (base / "pkg").is_dir(), "the directory the run made is written, empty"
    assert (base / "nested" / "file.txt").read_text() == "kept\n"
    assert (base / "src" / "main.py").read_text() == "print(2)\n"
    # The answer says what was left out and counts only what was written.
    assert dict(committed.left_out) == left
    assert not any(is_git_metadata(rel) for rel in committed.added + committed.modified)
    assert not any(rel.startswith("vendor") for rel in committed.removed)
    [(_event, detail)] = [entry for entry in recorded if entry[0] == "workspace_committed"]
    assert {item["path"] for item in detail["leftOut"]} == set(left)
    assert detail["added"] == len(committed.added)


def test_a_session_opened_to_commit_git_metadata_commits_it_from_any_process(
    where: Path, mode: str
) -> None:
    base = make_repo(where)
    store = WorkspaceStore(where / "state")
    handle = open_run(store, base, mode, commit_git_metadata=True)
    run_plants_git_metadata(handle.root)
    end(handle, store)
    # The choice is in the session's record, so another process's commit honours it.
    other = WorkspaceStore(where / "state")
    assert other.info(RUN).commit_git_metadata is True
    assert other.info(RUN).to_json()["commitGitMetadata"] is True
    assert other.diff(RUN).left_out == []
    other.commit(RUN)
    assert (base / ".git" / "hooks" / "pre-commit").read_text() == HOOK
    assert (base / "pkg" / ".git").exists() and not (base / "vendor").exists()


def test_a_record_without_the_choice_never_commits_git_metadata(where: Path) -> None:
    """A session record written before the field existed reads as the safe side."""
    record = SessionInfo(
        run_id=RUN,
        mode="overlay",
        base=where,
        state="kept",
        on_end="keep",
        keep_for_s=KEEP_S,
        keep_until=None,
        max_delta_bytes=None,
        created=0.0,
    ).to_record()
    old = record.replace(b', "commit_git_metadata": false', b"")
    assert b"commit_git_metadata" not in old
    assert SessionInfo.from_record(old).commit_git_metadata is False
    with pytest.raises(TypeError, match="is not a bool"):
        SessionInfo.from_record(record.replace(b"false", b'"yes"'))


def test_git_metadata_the_operator_changed_since_the_run_is_no_conflict(
    where: Path, mode: str
) -> None:
    """The run touched .git/index; the operator then ran git in the base (its index
    changed). The commit leaves .git out, so that change is not in its way."""
    base = make_repo(where)
    store = WorkspaceStore(where / "state")
    handle = open_run(store, base, mode)
    write(handle.root, ".git/index", "the run's index\n")
    write(handle.root, "src/main.py", "print(3)\n")
    end(handle, store)
    write(base, ".git/index", "the operator's index\n")
    store.commit(RUN)
    assert (base / ".git" / "index").read_text() == "the operator's index\n"
    assert (base / "src" / "main.py").read_text() == "print(3)\n"


def test_a_host_run_writes_git_metadata_itself_and_its_diff_names_it(where: Path) -> None:
    base = make_repo(where)
    store = WorkspaceStore(where / "state")
    handle = open_run(store, base, "host")
    write(handle.root, ".git/hooks/pre-commit", HOOK, 0o755)
    end(handle, store)
    wire = diff_json(store.diff(RUN))
    assert wire["gitMetadata"] == [".git/hooks/pre-commit"]
    assert wire["leftOut"] == [], "host mode cannot leave anything out; it says so instead"
    store.commit(RUN)
    assert (base / ".git" / "hooks" / "pre-commit").read_text() == HOOK


def test_the_host_backend_refuses_to_pretend_it_left_something_out(where: Path) -> None:
    base = make_repo(where)
    with HostWorkspace.create(base, where / "host-state") as session:
        with pytest.raises(WorkspaceError, match="mode host cannot leave paths out") as caught:
            session.commit(leave_out=frozenset({".git"}))
        assert "discard the session" in str(caught.value)
        assert session.is_open


@pytest.mark.parametrize(
    ("rel", "expected"),
    [
        (".git", True),
        (".git/hooks/pre-commit", True),
        ("a/b/.git", True),
        ("a/.git/config", True),
        (".git/", True),
        (".gitignore", False),
        ("a/.github/workflows/x.yml", False),
        ("a.git/x", False),
        ("src/git", False),
    ],
)
def test_what_counts_as_git_metadata(rel: str, expected: bool) -> None:
    assert is_git_metadata(rel) is expected


def test_held_back_follows_no_symlink_in_the_base(where: Path) -> None:
    """A removed directory that is a symlink in the base is not searched through it."""
    base = make_repo(where)
    (where / "elsewhere" / ".git").mkdir(parents=True)
    os.symlink(where / "elsewhere", base / "linked")
    held = held_back(base, [["remove", "linked"], ["replace_dir", "src"], ["file", "README"]])
    assert held.paths == {} and held.ops == frozenset()
    held = held_back(base, [["replace_dir", "vendor"], ["file", "vendor/lib/code.c"]])
    assert set(held.paths) == {"vendor"} and held.ops == {"vendor", "vendor/lib/code.c"}


# --- links leading out ------------------------------------------------------------


@pytest.mark.parametrize(
    ("rel", "target", "out"),
    [
        ("abs", "/etc/passwd", "absolute target"),
        ("up", "../x", "climbs above the workspace"),
        ("a/b/up", "../../../x", "climbs above the workspace"),
        ("a/b/ok", "../../README", None),
        ("a/ok", "./../README", None),
        ("via", "d/../../x", "climbs back out of a name"),
        ("via2", "d/../README", "climbs back out of a name"),
        ("plain", "src/main.py", None),
        ("dots", "...", None),
    ],
)
def test_which_links_lead_out(rel: str, target: str, out: str | None) -> None:
    reason = link_leads_out(rel, target)
    assert reason == out if out is None else reason is not None and out in reason


def test_links_leading_out_are_committed_and_named(where: Path, mode: str) -> None:
    base = make_repo(where)
    store = WorkspaceStore(where / "state")
    handle = open_run(store, base, mode, on_end="commit")
    os.symlink("/etc/shadow", handle.root / "abs")
    (handle.root / "sub").mkdir()
    os.symlink("../../outside", handle.root / "sub" / "climb")
    os.symlink("../README", handle.root / "sub" / "inside")
    handle.session.sync()
    preview = store.diff(RUN)
    expected = [("abs", "/etc/shadow"), ("sub/climb", "../../outside")]
    assert preview.links_out == expected
    assert diff_json(preview)["linksOut"] == [
        {"path": "abs", "target": "/etc/shadow"},
        {"path": "sub/climb", "target": "../../outside"},
    ]
    fate = end(handle, store)
    assert fate.startswith("committed")
    assert "links leading out of the workspace: abs -> /etc/shadow" in fate
    assert "sub/climb -> ../../outside" in fate and "inside" not in fate
    # Still committed: git allows such links; the point is that someone saw them.
    assert os.readlink(base / "abs") == "/etc/shadow"
    assert os.readlink(base / "sub" / "climb") == "../../outside"


# --- a commit killed at each step ----------------------------------------------------

# Where the commit dies (the name patched in the backend's module to die after, or
# instead of, the real step), whether the base was then wholly applied, and what
# recovery must say.
CRASH_POINTS = {
    # Before the journal is durable: nothing applied.
    "before-journal": ("write_atomically", "instead", False, "the commit never began; kept until"),
    # The journal written, one operation applied: replayed to its end.
    "journal-written": ("apply", "after", None, "finished the interrupted commit"),
    # All applied, the marker written, the journal still there: never applied again.
    "applied-marker-written": ("drop_journal", "instead", True, "commit had finished"),
    # The journal removed, the delta not yet: never applied again.
    "journal-removed": ("remove_delta", "instead", True, "commit had finished"),
}

# ``module``: the backend's; ``journal``: the commit steps both backends share
# (gatewayd/workspace/journal.py, imported in every child: tests/workspace_helpers.py).
_PATCHED = {
    "overlay": {
        "write_atomically": "module.write_atomically",
        "apply": "module.apply_operation",
        "drop_journal": "journal.drop_journal",
        "remove_delta": "module._remove_delta",
    },
    "agentfs": {
        "write_atomically": "module.write_atomically",
        "apply": "module._apply",
        "drop_journal": "journal.drop_journal",
        "remove_delta": "module._clear_state",
    },
}


@pytest.mark.parametrize("point", list(CRASH_POINTS))
def test_a_commit_killed_at_each_step_is_recovered_exactly(
    where: Path, mode: str, point: str
) -> None:
    """After the crash the operator edits a path the delta touches, before recovery:
    recovery must neither drop the delta of a commit that never applied (reporting it
    committed) nor apply again over the operator's edit one that had."""
    step, how, applied, outcome = CRASH_POINTS[point]
    name = _PATCHED[mode][step]
    base = make_repo(where)
    state = where / "state"
    store = WorkspaceStore(state)
    handle = open_run(store, base, mode)
    write(handle.root, "src/main.py", "print('run')\n")
    write(handle.root, "new.txt", "new\n")
    end(handle, store)
    die = (
        f"real = {name}\ndef dying(*args, **kwargs):\n    real(*args, **kwargs)\n    os._exit(9)\n"
        if how == "after"
        else "def dying(*args, **kwargs):\n    os._exit(9)\n"
    )
    child = commit_in_child(
        state,
        RUN,
        f"from gatewayd.workspace import {mode} as module\n{die}{name} = dying\n",
        capture_output=True,
    )
    assert child.returncode == 9, child.stderr.decode()[-2000:]
    assert store.info(RUN).state == "committing"
    if applied is not None:
        write(base, "src/main.py", "print('operator')\n")
    [line] = WorkspaceStore(state).recover()
    assert outcome in line
    if applied is False:
        # Kept, the delta whole; the operator's edit is now in the commit's way.
        assert store.info(RUN).state == "kept"
        with pytest.raises(WorkspaceConflict, match=r"src/main\.py"):
            store.commit(RUN)
        assert (base / "src" / "main.py").read_text() == "print('operator')\n"
        assert not (base / "new.txt").exists()
        return
    assert store.list() == [] and not handle.directory.exists()
    assert (base / "new.txt").read_text() == "new\n"
    assert (base / "src" / "main.py").read_text() == (
        "print('operator')\n" if applied else "print('run')\n"
    ), "recovery applied the journal again over the operator's edit"


def test_a_commit_killed_before_its_journal_whose_delta_is_then_lost_is_discarded(
    where: Path,
) -> None:
    """No journal, no marker, and the delta gone with its tmpfs (a reboot): the commit
    never applied anything, so the session is discarded, never reported committed."""
    base = make_repo(where)
    before = tree(base)
    state = where / "state"
    store = WorkspaceStore(state)
    handle = store.open_session(
        RUN, base, "overlay", on_end="keep", keep_for_s=KEEP_S, max_delta_bytes=1 << 20
    )
    write(handle.root, "src/main.py", "print('run')\n")
    end(handle, store)
    child = commit_in_child(state, RUN, "overlay.write_atomically = lambda *args: os._exit(9)\n")
    assert child.returncode == 9
    subprocess.run(["umount", str(handle.directory / "session" / "delta")], check=True)
    [line] = WorkspaceStore(state).recover()
    assert "never began and its delta is lost" in line and "discarded" in line
    assert store.list() == [] and tree(base) == before


@pytest.mark.parametrize(
    ("config", "hooks"),
    [
        ("[core]\n\thooksPath = .husky\n", ".husky"),
        ('[Core]\n\tHOOKSPATH = "tools/hooks"\n', "tools/hooks"),
        ("[core]\n\thooksPath = {base}/abs-hooks\n", "abs-hooks"),
        ("[core]\n\thooksPath = ../outside\n", None),
        ("[core]\n\thooksPath = ~/hooks\n", None),
        ('[remote "core"]\n\thooksPath = .husky\n', None),
        ("[core]\n\tbare = false\n", None),
    ],
)
def test_the_hooks_path_the_base_configures_is_read_safely(
    where: Path, config: str, hooks: str | None
) -> None:
    from gatewayd.workspace.commit_rules import hooks_directory

    base = make_repo(where)
    (base / ".git" / "config").write_text(config.format(base=base))
    assert hooks_directory(base) == hooks
    # A config that is a link is never followed.
    (base / ".git" / "config").unlink()
    (where / "elsewhere").write_text("[core]\n\thooksPath = .husky\n")
    os.symlink(where / "elsewhere", base / ".git" / "config")
    assert hooks_directory(base) is None


def test_a_commit_never_writes_the_configured_hooks_directory(where: Path, mode: str) -> None:
    """husky's setup: core.hooksPath = .husky; a hook written there runs like one in
    .git/hooks. Also a case-folded .GIT, which a case-insensitive file system takes
    for .git."""
    base = make_repo(where)
    (base / ".git" / "config").write_text("[core]\n\thooksPath = .husky\n")
    (base / ".husky").mkdir()
    (base / ".husky" / "pre-commit").write_text("npm test\n")
    store = WorkspaceStore(where / "state")
    handle = open_run(store, base, mode)
    write(handle.root, ".husky/pre-commit", HOOK, 0o755)
    write(handle.root, ".husky/post-merge", HOOK, 0o755)
    write(handle.root, "sub/.GIT/hooks/pre-commit", HOOK, 0o755)
    write(handle.root, "src/main.py", "print(4)\n")
    end(handle, store)
    committed = store.commit(RUN)
    left = dict(committed.left_out)
    assert set(left) == {".husky", "sub/.GIT"}
    assert "core.hooksPath" in left[".husky"] and "git metadata" in left["sub/.GIT"]
    assert (base / ".husky" / "pre-commit").read_text() == "npm test\n"
    assert not (base / ".husky" / "post-merge").exists()
    assert not (base / "sub" / ".GIT").exists()
    assert (base / "src" / "main.py").read_text() == "print(4)\n"
