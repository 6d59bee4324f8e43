"""What a patch from a sandbox-written tree leaves out: the repository's ignore rules at
the base commit (evaluated by git in the host-private clone, never as the sandbox
rewrote them), the policy's cache list, and never a file the repository tracks.

Real git, real repositories on disk; the whole agent run is
tests/integration/test_agent_patch_scope.py's.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

import pytest

from gatewayd.agent.patches import PatchResult, patch_from_tree
from gatewayd.agent.repo import checkout_at
from gatewayd.workspace.session import WorkspaceDiff
from gatewayd.workspace.treediff import compare_trees
from tests.gitserver import git

BASE: Mapping[str, bytes] = {
    "app.py": b"print('app')\n",
    ".gitignore": b"build/\n*.log\n!keep.log\n",
    "sub/.gitignore": b"generated.txt\n",
    # Tracked although the rules (and the cache list) would exclude them: always kept.
    "vendor/__pycache__/pinned.pyc": b"\0pinned",
    "logs/tracked.log": b"tracked\n",
}
CACHE_REASON = "a cache or tool output ('{}' in the policy's patches.exclude)"


def patched_paths(patch: str) -> set[str]:
    return set(re.findall(r"^diff --git a/(\S+) b/", patch, flags=re.MULTILINE))


def make_patch(tmp_path: Path, mirror: Path, sha: str, ws: Path, **kwargs: object) -> PatchResult:
    """The patch of everything the workspace ``ws`` changed against a pristine checkout."""
    snap = tmp_path / "snap"
    if not snap.exists():
        checkout_at(mirror, sha, snap)
    diff = compare_trees(snap, ws, [""])

    def ours(rel: str) -> bool:  # as the agent loop leaves git's own metadata out
        return rel.split("/", 1)[0] != ".git"

    changes = WorkspaceDiff(
        unified="",
        added=[r for r in diff.added if ours(r)],
        removed=[r for r in diff.removed if ours(r)],
        modified=[r for r in diff.modified if ours(r)],
    )
    scratch = tmp_path / f"scratch-{len(os.listdir(tmp_path))}"
    return patch_from_tree(mirror, sha, ws, changes, message="m", scratch=scratch, **kwargs)  # type: ignore[arg-type]


def make_repo(
    tmp_path: Path, files: Mapping[str, bytes], links: Mapping[str, str] | None = None
) -> str:
    """A bare ``tmp_path/proj.git`` whose main holds ``files`` (added with ``--force``:
    tracked whatever the rules say) and symlinks ``links``; the commit's sha."""
    work, bare = tmp_path / "work", tmp_path / "proj.git"
    git("init", "--quiet", "--bare", "--initial-branch=main", str(bare))
    git("init", "--quiet", "--initial-branch=main", str(work))
    for rel, data in files.items():
        write(work, rel, data)
    for rel, target in (links or {}).items():
        (work / rel).symlink_to(target)
    git("add", "--all", "--force", cwd=work)
    git("commit", "--quiet", "-m", "base", cwd=work)
    git("push", "--quiet", str(bare), "HEAD:refs/heads/main", cwd=work)
    return git("rev-parse", "HEAD", cwd=work).decode().strip()


@pytest.fixture
def repo(tmp_path: Path) -> tuple[Path, str, Path]:
    """(mirror, base sha, workspace checked out at it)."""
    sha = make_repo(tmp_path, BASE)
    mirror, ws = tmp_path / "proj.git", tmp_path / "ws"
    checkout_at(mirror, sha, ws)
    return mirror, sha, ws


def write(root: Path, rel: str, data: bytes = b"x\n") -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_base_rules_and_caches_stay_out_and_the_intended_change_goes_in(
    tmp_path: Path, repo: tuple[Path, str, Path]
) -> None:
    mirror, sha, ws = repo
    write(ws, "app.py", b"print('fixed')\n")  # the intended change
    write(ws, "src/new.py", b"NEW = 1\n")  # and a new file
    write(ws, "keep.log")  # re-included by '!keep.log'
    write(ws, "build/lib/app.py")
    write(ws, "run.log")
    write(ws, "sub/generated.txt")
    write(ws, "__pycache__/app.cpython-311.pyc", b"\0bytecode")
    write(ws, "src/__pycache__/new.cpython-311.pyc", b"\0bytecode")
    write(ws, ".pytest_cache/v/cache/nodeids", b"[]")
    write(ws, ".pytest_cache/.gitignore", b"*\n")
    write(ws, "node_modules/left-pad/index.js")
    write(ws, "pkg.egg-info/PKG-INFO")
    write(ws, "vendor/__pycache__/pinned.pyc", b"\0changed")  # tracked: kept
    write(ws, "logs/tracked.log", b"changed\n")  # tracked: kept
    result = make_patch(tmp_path, mirror, sha, ws)
    assert patched_paths(result.patch) == {
        "app.py",
        "src/new.py",
        "keep.log",
        "vendor/__pycache__/pinned.pyc",
        "logs/tracked.log",
    }
    assert sorted(result.skipped) == sorted(
        [
            "build/lib/app.py: ignored by .gitignore",
            "run.log: ignored by .gitignore",
            "sub/generated.txt: ignored by .gitignore",
            "__pycache__/app.cpython-311.pyc: " + CACHE_REASON.format("__pycache__"),
            "src/__pycache__/new.cpython-311.pyc: " + CACHE_REASON.format("__pycache__"),
            ".pytest_cache/v/cache/nodeids: " + CACHE_REASON.format(".pytest_cache"),
            ".pytest_cache/.gitignore: " + CACHE_REASON.format(".pytest_cache"),
            "node_modules/left-pad/index.js: " + CACHE_REASON.format("node_modules"),
            "pkg.egg-info/PKG-INFO: " + CACHE_REASON.format("*.egg-info"),
        ]
    )


def test_a_gitignore_the_sandbox_rewrote_cannot_let_an_ignored_file_in(
    tmp_path: Path, repo: tuple[Path, str, Path]
) -> None:
    mirror, sha, ws = repo
    # The sandbox drops every rule, and re-includes what the base ignores.
    write(ws, ".gitignore", b"!build/\n!*.log\n!__pycache__\n")
    (ws / "sub" / ".gitignore").unlink()
    write(ws, "build/out.bin", b"\0binary")
    write(ws, "secret.log", b"token=1\n")
    write(ws, "sub/generated.txt")
    write(ws, "__pycache__/app.pyc", b"\0")
    result = make_patch(tmp_path, mirror, sha, ws)
    # The rule files are the repository's own, tracked: their change is in the patch...
    assert patched_paths(result.patch) == {".gitignore", "sub/.gitignore"}
    # ...but what the base commit's rules ignore stays out all the same.
    assert "build/out.bin: ignored by .gitignore" in result.skipped
    assert "secret.log: ignored by .gitignore" in result.skipped
    assert "sub/generated.txt: ignored by .gitignore" in result.skipped
    assert "__pycache__/app.pyc: " + CACHE_REASON.format("__pycache__") in result.skipped


def test_a_gitignore_the_run_adds_leaves_out_more_and_says_so(
    tmp_path: Path, repo: tuple[Path, str, Path]
) -> None:
    mirror, sha, ws = repo
    write(ws, "docs/.gitignore", b"*.tmp\n*.pyc\n")
    write(ws, "docs/draft.tmp")
    write(ws, "docs/guide.md")
    write(ws, "docs/old.pyc", b"\0")
    result = make_patch(tmp_path, mirror, sha, ws)
    assert patched_paths(result.patch) == {"docs/.gitignore", "docs/guide.md"}
    assert "docs/draft.tmp: ignored by .gitignore" in result.skipped
    # A cache the run's own rules ignore is told as ignored, as git would.
    assert "docs/old.pyc: ignored by .gitignore" in result.skipped


def test_the_policy_list_replaces_the_default(tmp_path: Path, repo: tuple[Path, str, Path]) -> None:
    mirror, sha, ws = repo
    write(ws, "dist/app.whl", b"\0wheel")
    write(ws, "__pycache__/app.pyc", b"\0")
    result = make_patch(tmp_path, mirror, sha, ws, exclude=("dist",))
    assert patched_paths(result.patch) == {"__pycache__/app.pyc"}
    assert result.skipped == ["dist/app.whl: " + CACHE_REASON.format("dist")]
    nothing = make_patch(tmp_path, mirror, sha, ws, exclude=())
    assert patched_paths(nothing.patch) == {"__pycache__/app.pyc", "dist/app.whl"}


@pytest.mark.parametrize(
    "name",
    [":!x.log", ":(top)y.log", ":(exclude)z.log", "*.log", "[ab].log", " spaced.log", "-n.log"],
)
def test_names_git_could_read_as_pathspec_magic_are_checked_as_names(
    tmp_path: Path, repo: tuple[Path, str, Path], name: str
) -> None:
    mirror, sha, ws = repo
    write(ws, name)
    write(ws, ":(top)plain.txt")
    result = make_patch(tmp_path, mirror, sha, ws)
    assert result.skipped == [f"{name}: ignored by .gitignore"]
    assert patched_paths(result.patch) == {":(top)plain.txt"}


def test_a_path_beyond_a_tracked_symlink_is_skipped_without_breaking_the_patch(
    tmp_path: Path,
) -> None:
    """git refuses to check a path beyond a symlink (and would fail the whole batch): a
    diff naming one (the sandbox swapped the link for a directory after the diff was
    taken) still gets its patch, the entry skipped."""
    sha = make_repo(tmp_path, {".gitignore": b"*.log\n", "sub/a.txt": b"a\n"}, {"lnk": "sub"})
    mirror, ws = tmp_path / "proj.git", tmp_path / "ws"
    checkout_at(mirror, sha, ws)
    (ws / "lnk").unlink()
    write(ws, "lnk/new.log")
    write(ws, "lnk/new.txt")
    write(ws, "app.py")
    changes = WorkspaceDiff(unified="", added=["app.py", "lnk/new.log", "lnk/new.txt"])
    result = patch_from_tree(mirror, sha, ws, changes, message="m", scratch=tmp_path / "s")
    assert patched_paths(result.patch) == {"app.py"}
    assert [s.split(":")[0] for s in result.skipped] == ["lnk/new.log", "lnk/new.txt"]
    assert all("a parent is a symlink" in s for s in result.skipped), result.skipped
