"""Lending a run's writable directories to its sandbox uid, and giving them back.

The sandbox runs as an unprivileged host uid of its own (:mod:`gatewayd.sandbox.uids`),
so it can write its workspace only if that uid owns it. At run start gatewayd *lends*
each writable tree: every entry owned by the tree root's owner is chowned to the run's
uid. At run end (or, after a crash, at the next daemon start) it *returns* the tree:
every entry the run's uid owns, whether lent or created by the run, goes back to the
original owner. Entries of other owners are never touched, so a tree with mixed owners
comes back as it was.

Crash safety: the lease is written (atomically, fsynced) into the run's private
directory before the first chown, so a daemon that dies mid-run leaves a record its
successor uses to give everything back (:func:`read_lease`, then :func:`give_back`).

Hard-linked files (more than one link) are not lent: another name of the inode may lie
outside the tree (a workspace holding a link to /etc/passwd), and lending it would give
the run a host file. The sandbox cannot make such links itself (link(2) fails across
mounts, and nothing outside its workspace is writable).

Safe against a hostile tree: the walk never follows a symlink (``os.fwalk`` with
``follow_symlinks=False`` opens each directory relative to its verified parent), and
ownership changes use ``lchown`` semantics. Returning happens only once every process
of the run's uid is gone, so nothing can swap entries under the walk.
Note: the kernel clears set-user-ID and set-group-ID bits on a chowned file; they are
not restored.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from gatewayd.errors import GatewayError
from gatewayd.sandbox.limits import HostUser

LEASE_FILE: Final = "lease.json"
_KEEP: Final = -1  # chown: leave this id as it is


class LeaseError(GatewayError):
    """A tree could not be lent (gatewayd refuses the run); the message says which and why."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LentTree:
    """One directory tree lent to ``Lease.uid``; ``owner`` is who gets it back."""

    path: str
    owner_uid: int
    owner_gid: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Lease:
    uid: int
    gid: int
    trees: tuple[LentTree, ...]

    def to_json(self) -> str:
        return json.dumps(
            {
                "uid": self.uid,
                "gid": self.gid,
                "trees": [
                    {"path": t.path, "ownerUid": t.owner_uid, "ownerGid": t.owner_gid}
                    for t in self.trees
                ],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Lease:
        raw = json.loads(text)
        return cls(
            uid=int(raw["uid"]),
            gid=int(raw["gid"]),
            trees=tuple(
                LentTree(
                    path=str(t["path"]), owner_uid=int(t["ownerUid"]), owner_gid=int(t["ownerGid"])
                )
                for t in raw["trees"]
            ),
        )


def outermost(paths: list[Path]) -> list[Path]:
    """``paths`` without those lying inside another one (a nested tree is lent with its
    parent), in a stable order."""
    unique = sorted(set(paths), key=lambda p: (len(p.parts), str(p)))
    kept: list[Path] = []
    for path in unique:
        if not any(path == k or k in path.parents for k in kept):
            kept.append(path)
    return kept


def lend(trees: list[Path], user: HostUser, record_dir: Path) -> Lease:
    """Lend every tree to ``user``; the lease is durable in ``record_dir`` first.

    Error handling: :class:`LeaseError` when a root is not a real directory; anything
    already lent is given back before it is raised.
    """
    lent: list[LentTree] = []
    for path in outermost(trees):
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise LeaseError(f"cannot lend {path} to the sandbox: {exc.strerror}") from exc
        if not stat.S_ISDIR(st.st_mode):
            raise LeaseError(f"cannot lend {path} to the sandbox: it is not a directory")
        if st.st_uid == user.uid:
            raise LeaseError(
                f"{path} is already owned by sandbox uid {user.uid}: a previous run's lease "
                "was not returned; restart gatewayd (it returns leftovers at start)"
            )
        lent.append(LentTree(path=str(path), owner_uid=st.st_uid, owner_gid=st.st_gid))
    lease = Lease(uid=user.uid, gid=user.gid, trees=tuple(lent))
    _write_record(record_dir / LEASE_FILE, lease.to_json())
    try:
        for tree in lease.trees:
            _rechown(
                Path(tree.path),
                tree.owner_uid,
                tree.owner_gid,
                user.uid,
                user.gid,
                skip_hard_links=True,
            )
    except OSError as exc:
        give_back(lease)
        raise LeaseError(f"cannot lend the workspace to the sandbox: {exc}") from exc
    return lease


def give_back(lease: Lease) -> int:
    """Return every entry the lease's uid owns in its trees to the tree's owner; returns
    how many entries changed. Call only once no process of the uid is alive."""
    changed = 0
    for tree in lease.trees:
        root = Path(tree.path)
        if not root.is_dir() or root.is_symlink():
            continue  # removed by the operator meanwhile: nothing to give back
        changed += _rechown(root, lease.uid, lease.gid, tree.owner_uid, tree.owner_gid)
    return changed


def read_lease(run_dir: Path) -> Lease | None:
    """The lease recorded in ``run_dir`` (a crashed daemon's leftover), or None."""
    record = run_dir / LEASE_FILE
    try:
        return Lease.from_json(record.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LeaseError(f"unreadable lease record {record}: {exc}") from exc


def _rechown(
    root: Path,
    from_uid: int,
    from_gid: int,
    to_uid: int,
    to_gid: int,
    *,
    skip_hard_links: bool = False,
) -> int:
    """chown every entry of ``root`` (root included) owned by ``from_uid`` to ``to_uid``;
    its group becomes ``to_gid`` only where it was ``from_gid``. ``skip_hard_links``
    leaves files with more than one link alone (when lending: another name of the same
    inode may lie outside the tree, e.g. /etc/passwd, and must never become the run's)."""
    changed = 0

    def move(name: str | Path, dir_fd: int | None) -> None:
        nonlocal changed
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if st.st_uid != from_uid:
            return
        if skip_hard_links and st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
            return
        gid = to_gid if st.st_gid == from_gid else _KEEP
        os.chown(name, to_uid, gid, dir_fd=dir_fd, follow_symlinks=False)
        changed += 1

    move(root, None)
    for _, dirs, files, dir_fd in os.fwalk(root, follow_symlinks=False):
        for name in (*dirs, *files):
            try:
                move(name, dir_fd)
            except FileNotFoundError:
                continue  # removed while we walked (only the host can, by then)
    return changed


def _write_record(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
