"""What a commit leaves out of a base, and what it flags for the person committing.

**Git metadata.** A run's delta may hold anything under the base's ``.git/``: a hook
(``.git/hooks/pre-commit``), a ``.git/config`` with ``core.fsmonitor`` or an alias, a
``.git`` file pointing elsewhere. Written into the base, each runs code on the host the
next time the operator runs git there. So by default a commit leaves out every
operation on a path with a ``.git`` component, at any depth (the base's own repository
and any nested one the run made or changed), and every removal or replacement of a
directory that holds a ``.git`` in the base (``rm -rf sub`` would delete a nested
repository's metadata); each is reported with its reason. The same holds for the
directory the base's ``.git/config`` names as ``core.hooksPath`` when it lies in the
base (husky's ``.husky``): git runs the hooks there. A component is compared without
case (a case-folding file system takes ``.GIT`` for ``.git``). Not seen: a hooks path
set outside the base's own config (the operator's global config, an ``include``). A
policy may opt in
(``workspace.commit_git_metadata``). Mode ``host`` cannot leave anything out: the run
wrote the base itself; its diff names the git metadata it wrote.

**Links leading out.** A symlink the run made whose target is absolute, climbs above
the workspace, or climbs back out of a name it goes through (``sub/..``: ``sub`` may
itself be a link) is committed like any other (git stores such links) but named, so
nobody commits one unseen. Judged from the link's own text: a link into another link
that leads out is named where that link is made, if the run made it.

Written here rather than taken from git: git's own rule (``verify_path``) refuses
``.git`` components only in what it checks out, not in a plain tree gatewayd copies, and
gatewayd must not run git on a base a sandbox wrote.
"""

from __future__ import annotations

import os
import posixpath
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from gatewayd.workspace.session import DIR_FLAGS, open_dirs

GIT_DIR_NAME: Final = ".git"
# The base's repository config, read for core.hooksPath; a larger one is not git's own
# (read whole, so the cap bounds the memory a planted one takes).
MAX_GIT_CONFIG_BYTES: Final = 1 << 20
# The operations whose path, when the base has a directory there, deletes that
# directory's content (overlay's journal format, which agentfs shares).
_DELETING_OPS: Final = frozenset({"remove", "replace_dir", "file"})

GIT_METADATA_REASON: Final = (
    "git metadata: a commit never writes a repository's .git (a hook or a config there "
    "runs code on the host the next time git runs in it); the policy's "
    "workspace.commit_git_metadata lets it"
)


@dataclass(frozen=True, slots=True)
class HeldBack:
    """What a commit leaves out: ``paths`` maps each topmost path left out to its reason
    (what the diff and the commit answer name); ``ops`` is every operation path left out
    (beneath those too: what the journal drops)."""

    paths: dict[str, str] = field(default_factory=dict)
    ops: frozenset[str] = frozenset()


def is_git_metadata(rel: str) -> bool:
    """Does the relative path ``rel`` name a ``.git`` entry or anything beneath one (in
    any case: see the module doc)?"""
    return any(part.casefold() == GIT_DIR_NAME for part in rel.rstrip("/").split("/"))


def hooks_directory(base: Path) -> str | None:
    """The base's ``core.hooksPath`` from its ``.git/config``, relative to ``base``, when
    it names a directory inside the base; None otherwise. Read without following a
    symlink; a config over :data:`MAX_GIT_CONFIG_BYTES` or unreadable counts as none."""
    try:
        parent = open_dirs(base, [GIT_DIR_NAME])
    except OSError:
        return None
    try:
        fd = os.open("config", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    except OSError:
        return None
    finally:
        os.close(parent)
    try:
        data = os.read(fd, MAX_GIT_CONFIG_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_GIT_CONFIG_BYTES:
        return None
    section, value = "", None
    for raw in data.decode("utf-8", "replace").splitlines():
        line = raw.strip()
        if line.startswith("["):
            section = line[1:].split("]", 1)[0].strip().casefold()
        elif section == "core" and "=" in line:
            key, _, rest = line.partition("=")
            if key.strip().casefold() == "hookspath":
                value = rest.strip().strip('"')  # the last one wins, as in git
    if not value or value.startswith("~"):
        return None
    if value.startswith("/"):
        inside = posixpath.relpath(posixpath.normpath(value), os.fsdecode(base))
    else:  # relative to the working tree's top, where git runs hooks
        inside = posixpath.normpath(value)
    if inside == ".." or inside.startswith("../"):
        return None  # outside the base: no commit writes there
    return inside  # "." too: git then runs hooks from the tree's top


def git_metadata_beneath(base: Path, rel: str) -> str | None:
    """The first ``.git`` entry (relative to ``base``) inside the directory ``base/rel``;
    None when ``base/rel`` is not a directory or holds none. No symlink is followed."""
    *dirs, name = rel.split("/")
    try:
        parent = open_dirs(base, dirs)
    except OSError:
        return None
    try:
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except OSError:
            return None
        if not stat.S_ISDIR(st.st_mode):
            return None
        top = os.open(name, DIR_FLAGS, dir_fd=parent)
    finally:
        os.close(parent)
    try:
        for dirpath, dirnames, filenames, _fd in os.fwalk(".", dir_fd=top, follow_symlinks=False):
            if GIT_DIR_NAME in dirnames or GIT_DIR_NAME in filenames:
                return posixpath.normpath(f"{rel}/{dirpath}/{GIT_DIR_NAME}")
    finally:
        os.close(top)
    return None


def _beneath(rel: str, tops: Iterable[str]) -> str | None:
    for top in tops:
        if rel.startswith(f"{top}/"):
            return top
    return None


def held_back(base: Path, ops: Sequence[Sequence[str]]) -> HeldBack:
    """What a commit of ``ops`` (parent before child) into ``base`` leaves out by
    default: see the module doc."""
    paths: dict[str, str] = {}
    left: set[str] = set()
    hooks = hooks_directory(base)
    for op, rel in ops:
        if _beneath(rel, paths) is not None:
            left.add(rel)
        elif is_git_metadata(rel):
            paths[rel] = GIT_METADATA_REASON
            left.add(rel)
        elif hooks is not None and (
            hooks in (".", rel)
            or rel.startswith(f"{hooks}/")
            # Replacing a directory above it (by a link, say) changes what git runs too.
            or (hooks.startswith(f"{rel}/") and op in _DELETING_OPS)
        ):
            paths[rel] = (
                f"the repository's hooks directory ({hooks}: core.hooksPath in the base's "
                ".git/config); git runs what is there, so a commit never writes it unless "
                "the policy's workspace.commit_git_metadata lets it"
            )
            left.add(rel)
        elif op in _DELETING_OPS and (found := git_metadata_beneath(base, rel)) is not None:
            paths[rel] = (
                f"the run removed or replaced this directory, which holds the repository "
                f"metadata {found} in the base; it is left as it is (a commit never deletes "
                "git metadata unless the policy's workspace.commit_git_metadata lets it)"
            )
            left.add(rel)
    return HeldBack(paths=paths, ops=frozenset(left))


def link_leads_out(rel: str, target: str) -> str | None:
    """Why the symlink at ``rel`` (relative to the workspace) pointing at ``target``
    leads out of the workspace, or None when its text keeps it inside."""
    if target.startswith("/"):
        return "absolute target"
    depth = len(rel.split("/")) - 1  # the directories the link sits in
    named = 0  # names the target itself goes through (each may be a link)
    for part in target.split("/"):
        if part in ("", "."):
            continue
        if part != "..":
            named += 1
        elif named:
            return "climbs back out of a name it goes through, which may itself be a link"
        elif depth:
            depth -= 1
        else:
            return "climbs above the workspace"
    return None
