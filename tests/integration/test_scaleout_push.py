"""The push_branch activity's git side, on a real local bare repository: the push is
create-only, a retry of a push that had already happened (its worker died before it
reported) finds the branch holding exactly its patches and pushes nothing, and every
refusal (another branch's commits, the default branch, a name outside cogni/) is never
retried."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError

from gatewayd.agent.repo import RepoCredentials
from gatewayd.scaleout.activities import ERROR_TYPE_PUSH_FAILED, push_branch_once
from gatewayd.scaleout.spec import ERROR_TYPE_PUSH_REFUSED, PushOutcome, PushRequest
from tests.gitserver import git, make_bare_repo

FILES = {"calc.py": b"def add(a, b):\n    return a - b\n"}


@pytest.fixture
def origin(tmp_path: Path) -> tuple[Path, str]:
    sha = make_bare_repo(tmp_path, "calc.git", FILES)
    return tmp_path / "calc.git", sha


def patch_of(origin: Path, sha: str, work: Path, text: bytes) -> str:
    """A ``git format-patch`` of one commit on ``sha`` setting calc.py to ``text``."""
    git("clone", "--quiet", str(origin), str(work))
    git("checkout", "--quiet", "--detach", sha, cwd=work)
    (work / "calc.py").write_bytes(text)
    git("commit", "--quiet", "-am", "Fix add()", cwd=work)
    return git("format-patch", "-1", "--binary", "--stdout", "--no-signature", cwd=work).decode()


@pytest.fixture
def patch(origin: tuple[Path, str], tmp_path: Path) -> str:
    return patch_of(*origin, tmp_path / "p1", b"def add(a, b):\n    return a + b\n")


def push(tmp_path: Path, request: PushRequest, name: str) -> PushOutcome:
    work = tmp_path / name
    work.mkdir()
    return push_branch_once(request, RepoCredentials(), work, "host-a")


def branch_head(origin: Path, branch: str) -> str:
    return git("--git-dir", str(origin), "rev-parse", f"refs/heads/{branch}").decode().strip()


def test_a_retried_push_finds_its_branch_and_pushes_nothing_twice(
    origin: tuple[Path, str], patch: str, tmp_path: Path
) -> None:
    bare, sha = origin
    request = PushRequest(str(bare), sha, [patch], "cogni/run1", "run1")
    first = push(tmp_path, request, "w1")
    assert not first.already and first.head_sha == branch_head(bare, "cogni/run1")
    again = push(tmp_path, request, "w2")
    assert again.already and again.head_sha == first.head_sha  # nothing new pushed
    assert branch_head(bare, "cogni/run1") == first.head_sha


def test_a_branch_holding_other_commits_is_refused_and_never_retried(
    origin: tuple[Path, str], patch: str, tmp_path: Path
) -> None:
    bare, sha = origin
    push(tmp_path, PushRequest(str(bare), sha, [patch], "cogni/taken", "r1"), "w1")
    other = patch_of(bare, sha, tmp_path / "p2", b"def add(a, b):\n    return b + a\n")
    with pytest.raises(ApplicationError) as caught:
        push(tmp_path, PushRequest(str(bare), sha, [other], "cogni/taken", "r2"), "w2")
    assert caught.value.type == ERROR_TYPE_PUSH_REFUSED and caught.value.non_retryable
    assert "already exists" in caught.value.message and "force-push" in caught.value.message


@pytest.mark.parametrize(
    "branch", ["main", "cogni/../main", "refs/heads/cogni/x", "cogni/x.lock", "cogni/"]
)
def test_a_branch_outside_cogni_is_refused_and_never_retried(
    origin: tuple[Path, str], patch: str, tmp_path: Path, branch: str
) -> None:
    bare, sha = origin
    with pytest.raises(ApplicationError) as caught:
        push(tmp_path, PushRequest(str(bare), sha, [patch], branch, "r"), "w")
    assert caught.value.type == ERROR_TYPE_PUSH_REFUSED and caught.value.non_retryable
    assert "cogni/" in caught.value.message
    assert branch_head(bare, "main") == sha


def test_the_default_branch_is_refused_even_under_cogni(tmp_path: Path) -> None:
    sha = make_bare_repo(tmp_path, "odd.git", FILES, branch="cogni/main")
    bare = tmp_path / "odd.git"
    patch = patch_of(bare, sha, tmp_path / "p", b"x = 1\n")
    with pytest.raises(ApplicationError) as caught:
        push(tmp_path, PushRequest(str(bare), sha, [patch], "cogni/main", "r"), "w")
    assert caught.value.type == ERROR_TYPE_PUSH_REFUSED and caught.value.non_retryable
    assert "default branch" in caught.value.message
    assert branch_head(bare, "cogni/main") == sha


def test_an_unreachable_remote_is_retried(patch: str, tmp_path: Path) -> None:
    request = PushRequest(str(tmp_path / "missing.git"), "a" * 40, [patch], "cogni/r", "r")
    with pytest.raises(ApplicationError) as caught:
        push(tmp_path, request, "w")
    assert caught.value.type == ERROR_TYPE_PUSH_FAILED and not caught.value.non_retryable
    assert "could not be pushed" in caught.value.message
