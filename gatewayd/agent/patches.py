"""From the sandbox's tree to a new ``cogni/`` branch: one commit's patch made in a
host-private clone, then applied to a fresh clone and pushed.

The entries of the sandbox-written tree are read without following a symlink in any
component and copied into the clone without following one there either; git runs only
in host-private clones (:func:`~gatewayd.agent.repo.run_git`, whose threat model this
module shares). A push only ever creates a new branch under ``cogni/``.

All functions block; callers run them in a worker thread (``trio.to_thread``).
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import re
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

from gatewayd.agent.repo import (
    LOCAL_TIMEOUT_S,
    RepoCredentials,
    RepoError,
    check_sha,
    check_url,
    clone_at,
    has_control,
    ls_remote,
    require_commit,
    run_git,
    scrub,
)
from gatewayd.files import write_all
from gatewayd.policy.patches_section import DEFAULT_PATCH_EXCLUDE
from gatewayd.workspace.session import WorkspaceDiff, open_dirs
from gatewayd.workspace.treediff import open_parent

# A push is a network operation on a possibly large repository: minutes, not seconds.
PUSH_TIMEOUT_S: Final = 300.0
# What one patch may carry from the workspace (file contents and link targets).
MAX_PATCH_INPUT_BYTES: Final = 64 << 20
# A file is copied into the clone in pieces of this, so a large one never sits whole in
# memory.
COPY_CHUNK_BYTES: Final = 1 << 20
# What each entry costs the patch beyond its content: its paths in the headers and the
# stat line, and git's lines around them (format-patch repeats a path about 3 times).
PATCH_ENTRY_OVERHEAD_BYTES: Final = 128
MAX_PATCH_ENTRIES: Final = 20_000
# The result names at most this many skipped paths (then how many more there were).
MAX_SKIPPED_LISTED: Final = 100
# Lines git's mail parser reads as the start of a patch, a new mail or a header: in a
# commit message they would let the message carry a diff of its own through `git am`.
_MAIL_BREAK_RE: Final = re.compile(r"^(?:diff -|Index: |---|From |From:|Subject:|Date:)")
DEFAULT_AUTHOR: Final = ("cogni agent", "agent@cogni.invalid")
# Why a path the repository's ignore rules (at the base commit, or as the run changed
# them) exclude is left out; the same words for both, as git would say them.
IGNORED_REASON: Final = "ignored by .gitignore"
# Each path git checks is given as ``:(top)<path>``: the name after the magic is taken
# as it is, so a file named ``:!x`` or ``:(glob)*`` is a name, never pathspec magic
# (and check-ignore refuses the ``literal`` magic that would say so otherwise).
_TOP: Final = b":(top)"
# The only branches an agent run pushes: its own namespace on the forge, never main.
BRANCH_PREFIX: Final = "cogni/"
_BRANCH_RE: Final = re.compile(re.escape(BRANCH_PREFIX) + r"[A-Za-z0-9._-]+")

# The one commit as a patch `git am` takes back; the commit itself, with no hook and no
# signature.
_FORMAT_PATCH: Final = ("format-patch", "-1", "--binary", "--stdout", "--no-signature")
_COMMIT: Final = ("commit", "--quiet", "--no-verify", "--no-gpg-sign", "--cleanup=strip", "-m")


@dataclass(frozen=True)
class PatchResult:
    """``patch``: ``git format-patch`` output ("" when nothing changed);
    ``skipped``: ``"path: why"`` for every changed path that was not copied."""

    patch: str
    skipped: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PushResult:
    branch: str
    head_sha: str


# --- patches from a sandbox-written tree --------------------------------------------

EntryKind = Literal["file", "link"]


def _refusal(rel: str) -> str | None:
    """Why ``rel`` must not be copied into a commit, or None."""
    parts = rel.rstrip("/").split("/")
    if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        return "not a normalized relative path"
    for part in parts:
        # Also the names Windows and macOS git treat as .git ('.git.', '.git ', 'git~1').
        folded = part.casefold().rstrip(". ")
        if folded in (".git", "git~1"):
            return "a .git path: git metadata is never taken from the workspace"
    return None


def _read_entry(tree: Path, rel: str) -> tuple[EntryKind, bytes | int, bool] | None:
    """(kind, an open descriptor of the file or the link's target, executable) of
    ``tree/rel``; None if it is not a file or link. The caller closes the descriptor.
    No symlink is followed in any component (OSError: ELOOP/ENOTDIR)."""
    parent, name = open_parent(tree, rel)
    try:
        mode = os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode
        if stat.S_ISLNK(mode):
            return "link", os.fsencode(os.readlink(name, dir_fd=parent)), False
        if not stat.S_ISREG(mode):
            return None
        fd = os.open(
            name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent
        )
    finally:
        os.close(parent)
    # Mode and content from one descriptor: the sandbox may be swapping the file.
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        return None
    return "file", fd, bool(mode & stat.S_IXUSR)


def _write_entry(
    root: Path, rel: str, kind: EntryKind, data: bytes | int, executable: bool
) -> None:
    """Create ``root/rel`` (replacing a file, link or empty directory there) from
    ``data``: bytes, or a descriptor to copy from in chunks (any size, little memory)."""
    *dirs, name = rel.split("/")
    fd = open_dirs(root, dirs, create=True)
    try:
        try:
            existing = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            pass
        else:
            if stat.S_ISDIR(existing):
                os.rmdir(name, dir_fd=fd)  # OSError ENOTEMPTY: reported as skipped
            else:
                os.unlink(name, dir_fd=fd)
        if kind == "link":
            assert isinstance(data, bytes)
            os.symlink(os.fsdecode(data), name, dir_fd=fd)
            return
        mode = 0o755 if executable else 0o644
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        out = os.open(name, flags, mode, dir_fd=fd)
        try:
            if isinstance(data, int):
                while chunk := os.read(data, COPY_CHUNK_BYTES):
                    write_all(out, chunk)
            else:
                write_all(out, data)
            os.fchmod(out, mode)  # the umask must not drop the exec bit
        finally:
            os.close(out)
    finally:
        os.close(fd)


def _remove_entry(root: Path, rel: str) -> None:
    *dirs, name = rel.split("/")
    try:
        fd = open_dirs(root, dirs, create=False)
    except FileNotFoundError:
        return
    try:
        os.unlink(name, dir_fd=fd)
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)


def excluded_by(rel: str, patterns: Iterable[str]) -> str | None:
    """The first of ``patterns`` (the policy's ``patches.exclude``) that matches a
    component of ``rel``, or None; a shell glob of one name, case-sensitive."""
    parts = rel.split("/")
    for pattern in patterns:
        if any(fnmatch.fnmatchcase(part, pattern) for part in parts):
            return pattern
    return None


def _beyond_symlink(root: Path, rel: str, seen: dict[str, bool]) -> bool:
    """Whether a parent of ``rel`` in the host-private clone ``root`` is a symlink (git
    refuses to look beyond one; the entry cannot be written there either)."""
    parts = rel.split("/")[:-1]
    for depth in range(1, len(parts) + 1):
        prefix = "/".join(parts[:depth])
        if prefix not in seen:
            try:
                seen[prefix] = stat.S_ISLNK(os.lstat(root / prefix).st_mode)
            except OSError:
                seen[prefix] = False
        if seen[prefix]:
            return True
    return False


def _ignored(scratch: Path, paths: Sequence[str], timeout_s: float) -> set[str]:
    """Which of ``paths`` the ignore rules of the clone ``scratch`` exclude: its
    ``.gitignore`` files as they are in it now (no ``info/exclude``: clones are made
    without a template; no user or system excludes: ``run_git``'s configuration),
    evaluated by git itself. Tracked paths are never reported (check-ignore reads the
    clone's own index), so a tracked file is always kept."""
    if not paths:
        return set()
    seen: dict[str, bool] = {}
    asked = [rel for rel in paths if not _beyond_symlink(scratch, rel, seen)]
    if not asked:
        return set()
    out = run_git(
        ["-C", str(scratch), "check-ignore", "-z", "--stdin"],
        what="checking the repository's ignore rules",
        timeout_s=timeout_s,
        stdin=b"".join(_TOP + os.fsencode(rel) + b"\0" for rel in asked),
        ok_codes=(0, 1),  # 1: none of them is ignored
    ).stdout
    return {
        os.fsdecode(item.removeprefix(_TOP)) for item in out.split(b"\0") if item.startswith(_TOP)
    }


def _tracked(scratch: Path, timeout_s: float) -> set[str]:
    """The paths the clone ``scratch`` tracks (its index, at the base commit)."""
    out = run_git(
        ["-C", str(scratch), "ls-files", "-z"], what="listing tracked files", timeout_s=timeout_s
    ).stdout
    return {os.fsdecode(item) for item in out.split(b"\0") if item}


def _identity_env(author: tuple[str, str]) -> dict[str, str]:
    name, email = author
    if not name or not email or any(has_control(x) or "<" in x or ">" in x for x in author):
        raise RepoError(
            "the commit author must be a non-empty (name, email) without '<', '>' or "
            "control characters"
        )
    return {
        "GIT_AUTHOR_NAME": name,
        "GIT_AUTHOR_EMAIL": email,
        "GIT_COMMITTER_NAME": name,
        "GIT_COMMITTER_EMAIL": email,
    }


def patch_from_tree(
    mirror: Path,
    sha: str,
    tree: Path,
    changes: WorkspaceDiff,
    *,
    message: str,
    author: tuple[str, str] = DEFAULT_AUTHOR,
    scratch: Path,
    timeout_s: float = LOCAL_TIMEOUT_S,
    max_bytes: int = MAX_PATCH_INPUT_BYTES,
    exclude: Sequence[str] = DEFAULT_PATCH_EXCLUDE,
) -> PatchResult:
    """One commit's ``format-patch`` with the changed entries of the sandbox's ``tree``.

    A fresh clone of ``mirror`` at ``sha`` is made in ``scratch`` (host-private); the
    entries ``changes`` names are copied from ``tree`` into it - files by content and exec
    bit, symlinks as links, deletions as deletions - without following a symlink on
    either side. Paths with a ``.git`` component are refused and listed in ``skipped``,
    as are entries that vanished, could not be read without following a link, or that
    the ignore rules exclude. Directory entries (``dir/``) are implied by their files;
    an empty directory cannot be committed. The written entries total ``max_bytes`` at
    most: the sandbox chooses how much it writes, and the patch is held in memory and
    in the run's result; an entry past the budget is skipped, and says so.

    What the patch leaves out, unless the repository tracks the file (a tracked file is
    always kept): what the repository's ``.gitignore`` files *at the base commit*
    exclude, asked of git in the clone before anything of the sandbox's is copied in (a
    ``.gitignore`` the sandbox rewrote cannot let a file in), then what matches
    ``exclude`` (the policy's ``patches.exclude``: caches and tool output). The
    ``.gitignore`` files the run changed then apply too, as in any commit: they can
    only leave out more.
    """
    if not message.strip():
        raise RepoError("the commit message is empty: describe the change")
    message = mail_safe(message)
    identity = _identity_env(author)
    check_sha(sha)
    require_commit(mirror, sha, timeout_s)
    clone_at(mirror, sha, scratch, timeout_s, "scratch directory")

    skipped: list[str] = []
    removals = [*changes.removed, *(old for old, _ in changes.renamed)]
    writes = [*changes.added, *changes.modified, *(new for _, new in changes.renamed)]
    # Decided before any entry is copied: the clone holds the base commit's rules only.
    candidates = [r for r in set(writes) if _refusal(r) is None and not r.endswith("/")]
    tracked = _tracked(scratch, timeout_s)
    left_out = dict.fromkeys(_ignored(scratch, candidates, timeout_s), IGNORED_REASON)
    # Caches: their reason is told once the run's own .gitignore changes are in.
    caches = {
        rel: pattern
        for rel in candidates
        if rel not in tracked
        and rel not in left_out
        and (pattern := excluded_by(rel, exclude)) is not None
    }
    removed_dirs: list[str] = []
    budget, entries = max_bytes, 0
    # Removals first: a file replaced by a directory of the same name needs the room.
    for rel in sorted(set(removals)):
        if (why := _refusal(rel)) is not None:
            skipped.append(f"{rel}: {why}")
        elif rel.endswith("/"):
            removed_dirs.append(rel.rstrip("/"))
        else:
            try:
                _remove_entry(scratch, rel)
            except OSError as exc:
                skipped.append(f"{rel}: could not be deleted ({exc.strerror})")
    for rel in sorted(removed_dirs, key=lambda r: r.count("/"), reverse=True):
        # Left behind empty by the removals above; git does not track directories.
        with contextlib.suppress(OSError):
            _remove_entry_dir(scratch, rel)
    # Sorted: a parent link ('a -> /etc') is written before 'a/x' would go through it.
    for rel in sorted(set(writes)):
        if (why := _refusal(rel)) is not None:
            skipped.append(f"{rel}: {why}")
            continue
        if rel.endswith("/"):
            continue
        if rel in left_out:
            skipped.append(f"{rel}: {left_out[rel]}")
            continue
        if rel in caches:
            continue  # listed below
        try:
            entry = _read_entry(tree, rel)
        except FileNotFoundError:
            entry = None
        except OSError as exc:
            skipped.append(
                f"{rel}: not read, a parent in the workspace is a symlink or not a "
                f"directory ({exc.strerror})"
            )
            continue
        if entry is None:
            skipped.append(f"{rel}: no longer a file or symlink in the workspace")
            continue
        kind, data, executable = entry
        try:
            size = len(data) if isinstance(data, bytes) else os.fstat(data).st_size
            size += PATCH_ENTRY_OVERHEAD_BYTES + 3 * len(rel.encode())
            if entries >= MAX_PATCH_ENTRIES:
                skipped.append(f"{rel}: over the patch's limit of {MAX_PATCH_ENTRIES} files")
                continue
            if size > budget:
                skipped.append(
                    f"{rel}: {size} bytes, over what is left of the patch's "
                    f"{max_bytes}-byte limit ({budget} bytes)"
                )
                continue
            budget -= size
            entries += 1
            _write_entry(scratch, rel, kind, data, executable)
        except OSError as exc:
            skipped.append(
                f"{rel}: not written, a parent is a symlink or file, or a non-empty "
                f"directory is in the way ({exc.strerror})"
            )
        finally:
            if isinstance(data, int):
                os.close(data)

    # The run's own .gitignore changes are in the clone now: a cache they ignore says so.
    ignored_now = _ignored(scratch, sorted(caches), timeout_s)
    for rel in sorted(caches):
        why = (
            IGNORED_REASON
            if rel in ignored_now
            else f"a cache or tool output ('{caches[rel]}' in the policy's patches.exclude)"
        )
        skipped.append(f"{rel}: {why}")
    repo = ["-C", str(scratch)]
    run_git([*repo, "add", "--all", "--", "."], what="staging the changes", timeout_s=timeout_s)
    ignored = run_git(
        [*repo, "ls-files", "-z", "--others", "--ignored", "--exclude-standard"],
        what="listing ignored files",
        timeout_s=timeout_s,
    ).stdout
    for rel_bytes in sorted(filter(None, ignored.split(b"\0"))):
        skipped.append(f"{os.fsdecode(rel_bytes)}: ignored by .gitignore")
    staged = run_git(
        [*repo, "diff", "--cached", "--quiet"],
        what="checking for changes",
        timeout_s=timeout_s,
        ok_codes=(0, 1),
    )
    if staged.returncode == 0:
        return PatchResult(patch="", skipped=_capped(skipped))
    name, email = author
    run_git(
        [*repo, "-c", f"user.name={name}", "-c", f"user.email={email}", *_COMMIT, message],
        what="committing the changes",
        timeout_s=timeout_s,
        extra_env=identity,
    )
    patch = run_git(
        [*repo, *_FORMAT_PATCH, "HEAD"], what="writing the patch", timeout_s=timeout_s
    ).stdout
    # Text files need not be UTF-8; surrogateescape keeps their bytes for `git am`.
    return PatchResult(patch=patch.decode("utf-8", "surrogateescape"), skipped=_capped(skipped))


def mail_safe(message: str) -> str:
    """``message`` with every line git's mail parser would take for a patch, a mail
    separator or an in-body header indented by one space: a model's commit message
    must not carry a diff of its own into `git am` (nor change the author)."""
    lines = message.splitlines(keepends=True)
    return "".join(" " + line if _MAIL_BREAK_RE.match(line) else line for line in lines)


def _after_first_line(patch: bytes) -> bytes:
    """A patch without its ``From <commit> <date>`` line (the commit id differs after
    `git am`: its committer date is new)."""
    return patch.split(b"\n", 1)[1] if b"\n" in patch else b""


def _capped(skipped: list[str]) -> list[str]:
    if len(skipped) <= MAX_SKIPPED_LISTED:
        return skipped
    return [*skipped[:MAX_SKIPPED_LISTED], f"... and {len(skipped) - MAX_SKIPPED_LISTED} more"]


def _remove_entry_dir(root: Path, rel: str) -> None:
    *dirs, name = rel.split("/")
    fd = open_dirs(root, dirs, create=False)
    try:
        os.rmdir(name, dir_fd=fd)
    finally:
        os.close(fd)


# --- pushing ------------------------------------------------------------------------


def check_branch(branch: str) -> None:
    if not _BRANCH_RE.fullmatch(branch) or ".." in branch or branch.endswith((".", ".lock")):
        raise RepoError(
            f"branch {branch!r} is not allowed: agent runs push only to new branches named "
            f"{BRANCH_PREFIX}<name>, <name> made of letters, digits, '.', '_' and '-' "
            "(no '..', not ending in '.' or '.lock')"
        )


def push_branch_from_patches(
    repo_url: str,
    mirror: Path,
    base_sha: str,
    patches: Sequence[str],
    branch: str,
    *,
    credentials: RepoCredentials,
    scratch: Path,
    author: tuple[str, str] = DEFAULT_AUTHOR,
    timeout_s: float = PUSH_TIMEOUT_S,
) -> PushResult:
    """Apply ``patches`` (``git am``, hooks off) on ``base_sha`` in a fresh clone in
    ``scratch`` and push the result to the *new* branch ``branch`` of ``repo_url``.

    Refused: a branch outside ``cogni/``, the remote's default branch, a branch that
    already exists (no force push, ever), and an empty ``patches``.
    """
    check_url(repo_url, credentials)
    check_branch(branch)
    check_sha(base_sha)
    if not patches:
        raise RepoError("nothing to push: there are no patches (the run changed no file)")
    for index, patch in enumerate(patches, 1):
        if not patch.strip():
            raise RepoError(f"patch {index} of {len(patches)} is empty: nothing to apply")
    identity = _identity_env(author)
    ref = f"refs/heads/{branch}"
    default, refs = ls_remote(repo_url, credentials, ["HEAD", ref], timeout_s)
    if branch == default:
        raise RepoError(
            f"refusing to push to {branch!r}: it is the remote's default branch; "
            "pick another cogni/ branch name"
        )
    if ref in refs:
        raise RepoError(
            f"branch {branch!r} already exists on the remote (at {refs[ref][:12]}); agent "
            "runs never force-push or add to an existing branch: pick a new branch name"
        )
    require_commit(mirror, base_sha, timeout_s)
    clone_at(mirror, base_sha, scratch, timeout_s, "scratch directory")
    repo = ["-C", str(scratch)]
    for index, patch in enumerate(patches, 1):
        what = f"applying patch {index} of {len(patches)} on {base_sha[:12]}"
        raw = patch.encode("utf-8", "surrogateescape")
        run_git(
            [*repo, "am", "--quiet", "--no-gpg-sign", "--keep-cr"],
            what=what,
            timeout_s=timeout_s,
            stdin=raw,
            extra_env=identity,
        )
        # The commit must say exactly what the patch said: a message that git's mail
        # parser read as more patch (or a header) would show here as a difference.
        again = run_git([*repo, *_FORMAT_PATCH, "HEAD"], what=what, timeout_s=timeout_s).stdout
        if _after_first_line(again) != _after_first_line(raw):
            raise RepoError(
                f"patch {index} of {len(patches)} does not come out of `git am` as it went "
                "in (its message or headers hold what git reads as patch); nothing was "
                "pushed. Patches must be as patch_from_tree makes them"
            )
    head = run_git([*repo, "rev-parse", "HEAD"], what="reading the new head", timeout_s=timeout_s)
    # The empty lease means "the ref must not exist": creating the branch stays atomic
    # even if someone creates it between the check above and this push.
    target = [repo_url, f"HEAD:{ref}"]
    run_git(
        [*repo, "push", "--quiet", "--no-verify", f"--force-with-lease={ref}:", "--", *target],
        what=f"pushing {branch!r} to {scrub(repo_url, [])}",
        credentials=credentials,
        timeout_s=timeout_s,
    )
    return PushResult(branch=branch, head_sha=head.stdout.decode("ascii").strip())
