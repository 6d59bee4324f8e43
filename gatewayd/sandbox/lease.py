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
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from gatewayd.atomicfile import write_atomically
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


def lend(
    trees: list[Path],
    user: HostUser,
    record_dir: Path,
    *,
    keep: Sequence[Path] = (),
    sandbox_owned: Callable[[int], bool] = lambda uid: False,
) -> Lease:
    """Lend every tree to ``user``; the lease is durable in ``record_dir`` first.

    ``keep`` are roots inside the trees that stay their owner's (read-only grants: lent,
    the run could rewrite them through another name of a parent directory it renamed).
    ``sandbox_owned`` says whether a uid belongs to a sandbox: a tree whose root a
    sandbox owns is another live run's (or a lost lease), and lending it again would
    record the wrong owner to give it back to.

    Error handling: :class:`LeaseError` when a root is not a real directory or is
    sandbox-owned; anything already lent is given back before it is raised.
    """
    lent: list[LentTree] = []
    for path in outermost(trees):
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise LeaseError(f"cannot lend {path} to the sandbox: {exc.strerror}") from exc
        if not stat.S_ISDIR(st.st_mode):
            raise LeaseError(f"cannot lend {path} to the sandbox: it is not a directory")
        if st.st_uid == user.uid or sandbox_owned(st.st_uid):
            raise LeaseError(
                f"{path} is owned by sandbox uid {st.st_uid}: another live run holds it, or "
                "a run's lease was not returned (gatewayd returns leftovers at start); one "
                "workspace serves one run at a time"
            )
        lent.append(LentTree(path=str(path), owner_uid=st.st_uid, owner_gid=st.st_gid))
    lease = Lease(uid=user.uid, gid=user.gid, trees=tuple(lent))
    write_atomically(record_dir / LEASE_FILE, lease.to_json().encode())
    skip = {str(path) for path in keep}
    try:
        for tree in lease.trees:
            _rechown(
                Path(tree.path),
                tree.owner_uid,
                tree.owner_gid,
                user.uid,
                user.gid,
                skip_hard_links=True,
                skip=skip,
            )
    except Exception as exc:
        give_back(lease)
        raise LeaseError(f"cannot lend the workspace to the sandbox: {exc}") from exc
    return lease


def give_back(lease: Lease) -> int:
    """Return every entry the lease's uid owns in its trees to the tree's owner; returns
    how many entries changed. Call only once no process of the uid is alive.

    Error handling: tries every tree, then raises :class:`LeaseError` naming each that
    could not be given back completely (the record stays for the next start)."""
    changed = 0
    failures: list[str] = []
    for tree in lease.trees:
        root = Path(tree.path)
        if not root.is_dir() or root.is_symlink():
            continue  # removed by the operator meanwhile: nothing to give back
        try:
            changed += _rechown(root, lease.uid, lease.gid, tree.owner_uid, tree.owner_gid)
        except Exception as exc:
            failures.append(f"{root}: {exc}")
    if failures:
        raise LeaseError("could not give back: " + "; ".join(failures))
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
    skip: Collection[str] = (),
) -> int:
    """chown every entry of ``root`` (root included) owned by ``from_uid`` to ``to_uid``;
    its group becomes ``to_gid`` only where it was ``from_gid``. ``skip_hard_links``
    leaves files with more than one link alone (when lending: another name of the same
    inode may lie outside the tree, e.g. /etc/passwd, and must never become the run's);
    ``skip`` are paths left alone with everything beneath them. Other file systems and
    mount points inside the tree are never entered (a bind mount there is not the tree)."""
    changed = 0
    mounts = mount_points_under(root)

    def move(name: str, dir_fd: int, st: os.stat_result) -> None:
        nonlocal changed
        if st.st_uid != from_uid:
            return
        if skip_hard_links and st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
            return
        gid = to_gid if st.st_gid == from_gid else _KEEP
        os.chown(name, to_uid, gid, dir_fd=dir_fd, follow_symlinks=False)
        changed += 1

    for dir_fd, name, st in _walk(root, mounts | set(skip)):
        if dir_fd < 0:  # the root itself
            if st.st_uid == from_uid:
                os.chown(root, to_uid, to_gid if st.st_gid == from_gid else _KEEP)
                changed += 1
            continue
        move(name, dir_fd, st)
    return changed


def _walk(root: Path, fences: set[str]) -> Iterator[tuple[int, str, os.stat_result]]:
    """Every entry of the tree at ``root``: ``(dir_fd, name, stat)``, the root first
    with ``dir_fd`` -1. Depth-first without recursion and with one directory open at a
    time (a tree thousands of levels deep, as a sandbox can make, neither overflows the
    stack nor the descriptor table): it descends by name with O_NOFOLLOW and climbs back
    by "..", checking each directory's (device, inode) both ways. Entries on another
    device, or at a path in ``fences`` (mount points, kept subtrees), are not entered;
    fenced paths are not yielded either. The tree must not change during the walk: the
    caller lends before the sandbox exists and gives back once its processes are gone.
    """
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(root, flags)
    try:
        top = os.fstat(fd)
        yield -1, "", top
        # One frame per directory on the current path: its identity, its path, and the
        # names still to visit.
        frames = [((top.st_dev, top.st_ino), str(root), os.listdir(fd))]
        while frames:
            _identity, path, names = frames[-1]
            if not names:
                frames.pop()
                if frames:  # climb back to the parent, and make sure it is the parent
                    parent = os.open("..", flags, dir_fd=fd)
                    os.close(fd)
                    fd = parent
                    st = os.fstat(fd)
                    if (st.st_dev, st.st_ino) != frames[-1][0]:
                        raise LeaseError(f"{frames[-1][1]} changed during the walk; stopped")
                continue
            name = names.pop()
            child_path = f"{path}/{name}"
            if child_path in fences:
                continue
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            yield fd, name, st
            if not stat.S_ISDIR(st.st_mode) or st.st_dev != top.st_dev:
                continue
            try:
                child = os.open(name, flags, dir_fd=fd)
            except OSError:
                continue  # replaced meanwhile (a symlink now): nothing to enter
            seen = os.fstat(child)
            if (seen.st_dev, seen.st_ino) != (st.st_dev, st.st_ino):
                os.close(child)
                continue
            os.close(fd)
            fd = child
            frames.append(((seen.st_dev, seen.st_ino), child_path, os.listdir(fd)))
    finally:
        os.close(fd)


def mount_points_under(root: Path) -> set[str]:
    """Mount points strictly inside ``root`` (from this process's mountinfo)."""
    prefix = str(root).rstrip("/") + "/"
    found: set[str] = set()
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as info:
            for line in info:
                fields = line.split(" ")
                if len(fields) > 4:
                    point = _unescape(fields[4])
                    if point.startswith(prefix):
                        found.add(point.rstrip("/"))
    except OSError:
        pass
    return found


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    return (
        field.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
    )
