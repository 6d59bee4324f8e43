"""Lending a run's writable directories to its sandbox uid, and giving them back.

The sandbox runs as an unprivileged host uid of its own (:mod:`gatewayd.sandbox.uids`),
so it can write its workspace only if that uid owns it. At run start gatewayd *lends*
each writable tree: every entry owned by the tree root's owner is chowned to the run's
uid. At run end (or, after a crash, at the next daemon start) it *returns* the tree:
every entry the run's uid owns, whether lent or created by the run, goes back to the
original owner. Entries of other owners are never touched, so a tree with mixed owners
comes back as it was.

Only what may be lent is lent (:mod:`gatewayd.sandbox.lendable`): every tree must lie
strictly beneath one of the roots the caller passes, and must not be (or show, through a
bind mount) a system tree; :func:`lend` checks this itself before the first chown, so
no caller can lend /usr.

Crash safety: the lease is written (atomically, fsynced) into the run's private
directory before the first chown, so a daemon that dies mid-run leaves a record its
successor uses to give everything back (:func:`read_lease`, then :func:`give_back`).

Entries that are never lent (they stay their owner's; the sandbox writes them only if
their mode lets others write):

- Hard-linked files (more than one link): another name of the inode may lie outside the
  tree (a workspace holding a link to /etc/passwd), and lending it would give the run a
  host file. The sandbox cannot make such links itself (link(2) fails across mounts, and
  nothing outside its workspace is writable).
- Set-user-ID and set-group-ID files, and files with capabilities (the
  ``security.capability`` attribute): the kernel clears all three when a non-directory
  changes owner, and giving the file back would not bring them back. Left alone, they
  keep their bits, owner and capabilities, and the run cannot rewrite them.
- Anything but directories, regular files and symlinks: a device node the run's uid
  owned would open a host device, a socket the run owned would connect it to a host
  service.

So after a run that changes nothing, every entry of a tree has exactly the owner, group,
mode (set-user-ID, set-group-ID and sticky bits included) and capabilities it had before:
a directory keeps its mode through a chown, and every other entry lent has no bit a
chown clears.

Safe against a hostile tree: the walk never follows a symlink (:func:`_walk` opens each
directory by name relative to its verified parent, with ``O_NOFOLLOW``), and ownership
changes use ``lchown`` semantics. Returning happens only once every process
of the run's uid is gone, so nothing can swap entries under the walk.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from gatewayd.atomicfile import write_atomically
from gatewayd.errors import GatewayError
from gatewayd.sandbox.lendable import PROC_SELF_MOUNTINFO, LendableRoots, parse_mountinfo
from gatewayd.sandbox.limits import HostUser

LEASE_FILE: Final = "lease.json"
_KEEP: Final = -1  # chown: leave this id as it is
# The extended attribute holding a file's capabilities; a chown removes it.
CAPABILITY_XATTR: Final = "security.capability"
# A file system without extended attributes, or a file without this one.
_NO_XATTR: Final = (errno.ENODATA, errno.ENOTSUP)


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
    roots: LendableRoots,
    keep: Sequence[Path] = (),
    sandbox_owned: Callable[[int], bool] = lambda uid: False,
) -> Lease:
    """Lend every tree to ``user``; the lease is durable in ``record_dir`` first.

    ``roots``: every tree must lie strictly beneath one of them and show no system tree
    (:meth:`LendableRoots.require`), checked here again whatever the caller checked.
    ``keep`` are roots inside the trees that stay their owner's (read-only grants: lent,
    the run could rewrite them through another name of a parent directory it renamed).
    ``sandbox_owned`` says whether a uid belongs to a sandbox: a tree whose root a
    sandbox owns is another live run's (or a lost lease), and lending it again would
    record the wrong owner to give it back to.

    Error handling: :class:`~gatewayd.sandbox.lendable.NotLendable` for a tree beneath
    no root, before anything is recorded or chowned; :class:`LeaseError` when a root is
    not a real directory, is sandbox-owned, or is replaced between the check and the
    lending; anything already lent is given back before it is raised.
    """
    lent: list[LentTree] = []
    checked: dict[str, tuple[int, int]] = {}
    for path in outermost(trees):
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise LeaseError(f"cannot lend {path} to the sandbox: {exc.strerror}") from exc
        if not stat.S_ISDIR(st.st_mode):
            raise LeaseError(f"cannot lend {path} to the sandbox: it is not a directory")
        checked[str(path)] = roots.require(path)
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
                lending=True,
                skip=skip,
                expect=checked[tree.path],
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
    lending: bool = False,
    skip: Collection[str] = (),
    expect: tuple[int, int] | None = None,
) -> int:
    """chown every entry of ``root`` (root included) owned by ``from_uid`` to ``to_uid``;
    its group becomes ``to_gid`` only where it was ``from_gid``. ``lending`` leaves alone
    what must never be lent (:func:`_never_lent`); ``skip`` are paths left alone with
    everything beneath them; ``expect`` is the (device, inode) ``root`` must still be.
    Other file systems and mount points inside the tree are never entered (a bind mount
    there is not the tree)."""
    changed = 0
    mounts = mount_points_under(root)

    def move(name: str, dir_fd: int, st: os.stat_result) -> None:
        nonlocal changed
        if st.st_uid != from_uid:
            return
        if lending and _never_lent(name, dir_fd, st):
            return
        gid = to_gid if st.st_gid == from_gid else _KEEP
        os.chown(name, to_uid, gid, dir_fd=dir_fd, follow_symlinks=False)
        changed += 1

    for dir_fd, name, st in _walk(root, mounts | set(skip), expect=expect):
        if dir_fd < 0:  # the root itself
            if st.st_uid == from_uid:
                os.chown(root, to_uid, to_gid if st.st_gid == from_gid else _KEEP)
                changed += 1
            continue
        move(name, dir_fd, st)
    return changed


def _never_lent(name: str, dir_fd: int, st: os.stat_result) -> bool:
    """An entry lending must leave its owner's: a hard-linked file, a set-user-ID or
    set-group-ID file, a file with capabilities (a chown clears all three, for good), or
    anything but a directory, a regular file or a symlink (a device node or socket the
    run's uid owned would reach the host)."""
    mode = st.st_mode
    if stat.S_ISDIR(mode) or stat.S_ISLNK(mode):
        return False
    if not stat.S_ISREG(mode):
        return True
    if st.st_nlink > 1 or mode & (stat.S_ISUID | stat.S_ISGID):
        return True
    try:
        # The directory by its descriptor, the name without following a symlink.
        os.getxattr(f"/proc/self/fd/{dir_fd}/{name}", CAPABILITY_XATTR, follow_symlinks=False)
    except OSError as exc:
        return exc.errno not in _NO_XATTR  # unreadable: keep it the owner's
    return True


def _walk(
    root: Path, fences: set[str], *, expect: tuple[int, int] | None = None
) -> Iterator[tuple[int, str, os.stat_result]]:
    """Every entry of the tree at ``root``: ``(dir_fd, name, stat)``, the root first
    with ``dir_fd`` -1. Depth-first without recursion and with one directory open at a
    time (a tree thousands of levels deep, as a sandbox can make, neither overflows the
    stack nor the descriptor table): it descends by name with O_NOFOLLOW and climbs back
    by "..", checking each directory's (device, inode) both ways. Entries on another
    device, or at a path in ``fences`` (mount points, kept subtrees), are not entered;
    fenced paths are not yielded either. ``expect``: the (device, inode) the root must
    be (the directory checked as lendable, not whatever its path names now). The tree
    must not change during the walk: the caller lends before the sandbox exists and
    gives back once its processes are gone.
    """
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(root, flags)
    try:
        top = os.fstat(fd)
        if expect is not None and (top.st_dev, top.st_ino) != expect:
            raise LeaseError(f"{root} was replaced after it was checked; nothing of it is lent")
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
    try:
        with open(PROC_SELF_MOUNTINFO, encoding="utf-8", errors="surrogateescape") as info:
            mounts = parse_mountinfo(info.read())
    except OSError:
        return set()
    return {m.point.rstrip("/") for m in mounts if m.point.startswith(prefix)}
