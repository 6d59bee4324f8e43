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
bind mount) a system tree or hold gatewayd's own directories; :func:`lend` checks this
itself before the first chown, so no caller can lend /usr.

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

Safe against a hostile tree, and against whoever owns the directory that holds it: every
name may be swapped at any moment (``renameat2(RENAME_EXCHANGE)`` with a symlink to
/usr/bin/su, or with another directory), so no path is trusted after it was looked at.
Each tree is opened once (``O_PATH``, no symlink at its end); that descriptor is what is
judged lendable, compared with the directory the run's sandbox binds, recorded by its
(device, inode), walked and chowned. Every entry is opened by name relative to its
verified parent without following a symlink, judged by ``fstat`` of that descriptor and
chowned through it (``/proc/self/fd/N``), so the inode that changes owner is the one that
was judged, whatever its name leads to by then. Giving back walks the descriptor the run
held when there is one (a live run), and otherwise (a crashed daemon's record) opens the
recorded path and gives back nothing unless it is still the directory lent.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from gatewayd.errors import GatewayError
from gatewayd.files import fsync_dir, write_atomically
from gatewayd.sandbox.lendable import (
    PROC_SELF_MOUNTINFO,
    TREE_FLAGS,
    LendableRoots,
    mounts_of,
    open_tree,
)
from gatewayd.sandbox.limits import HostUser

LEASE_FILE: Final = "lease.json"
_KEEP: Final = -1  # chown: leave this id as it is
# The extended attribute holding a file's capabilities; a chown removes it.
CAPABILITY_XATTR: Final = "security.capability"
# A file system without extended attributes, or a file without this one.
_NO_XATTR: Final = (errno.ENODATA, errno.ENOTSUP)
# An entry of a tree, opened to be judged and changed: the inode its name leads to now,
# never through a symlink (a symlink is opened as itself), with no access to its data
# (a FIFO does not block, a device is not opened).
_ENTRY_FLAGS: Final = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
# A directory of a tree, opened to list it.
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

Identity = tuple[int, int]  # (st_dev, st_ino)


class LeaseError(GatewayError):
    """A tree could not be lent (gatewayd refuses the run) or given back (the record
    stays for the next start); the message says which and why."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LentTree:
    """One directory tree lent to ``Lease.uid``: ``owner`` is who gets it back, and
    (``device``, ``inode``) is the directory lent, whatever ``path`` leads to later."""

    path: str
    owner_uid: int
    owner_gid: int
    device: int
    inode: int

    @property
    def identity(self) -> Identity:
        return (self.device, self.inode)


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
                    {
                        "path": t.path,
                        "ownerUid": t.owner_uid,
                        "ownerGid": t.owner_gid,
                        "device": t.device,
                        "inode": t.inode,
                    }
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
                    path=str(t["path"]),
                    owner_uid=int(t["ownerUid"]),
                    owner_gid=int(t["ownerGid"]),
                    device=int(t["device"]),
                    inode=int(t["inode"]),
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
    keep: Collection[Identity] = (),
    pinned: Mapping[Path, Identity] | None = None,
    sandbox_owned: Callable[[int], bool] = lambda uid: False,
    sync_record_dir: bool = False,
    recorded: Lease | None = None,
) -> Lease:
    """Lend every tree to ``user``; the lease is durable in ``record_dir`` first.

    ``roots``: every tree must lie strictly beneath one of them, show no system tree and
    hold none of gatewayd's own directories (:meth:`LendableRoots.judge`), checked here
    again, on the descriptor that is then lent, whatever the caller checked.
    ``keep`` are the (device, inode) of directories inside the trees that stay their
    owner's with everything beneath them (read-only grants: lent, the run could
    rewrite them through another name of a parent directory it renamed).
    ``pinned``: the directory the run's sandbox binds for a tree, by the tree's path; the
    directory lent must be that one (its path may have been swapped in between).
    ``sandbox_owned`` says whether a uid belongs to a sandbox: a tree whose root a
    sandbox owns is another live run's (or a lost lease), and lending it again would
    record the wrong owner to give it back to. ``sync_record_dir``: ``record_dir`` is
    fsynced after the lease is recorded even when it lends no tree (the caller counts on
    that fsync for a record of its own written there just before). ``recorded``: the
    lease ``record_dir`` holds already (:func:`record_uid`, made while the run's session
    opened): not written again when it is the lease made here (one of no tree).

    Error handling: :class:`~gatewayd.sandbox.lendable.NotLendable` for a tree that may
    not be lent (beneath no root, a symlink, not a directory), before anything is
    recorded or chowned; :class:`LeaseError` when a tree is sandbox-owned, is not the
    directory pinned, or changes while it is lent; anything already lent is given back
    before it is raised.
    """
    opened: dict[str, int] = {}
    try:
        lent: list[LentTree] = []
        for path in outermost(trees):
            fd = open_tree(path, str(path))
            opened[str(path)] = fd
            identity = roots.judge(fd, path)
            want = (pinned or {}).get(path)
            if want is not None and want != identity:
                raise LeaseError(
                    f"{path} is no longer the directory the run's sandbox binds (device and "
                    f"inode {_show(want)}, now {_show(identity)}: it was replaced after the "
                    "run was created); nothing was lent"
                )
            st = os.fstat(fd)
            if st.st_uid == user.uid or sandbox_owned(st.st_uid):
                raise LeaseError(
                    f"{path} is owned by sandbox uid {st.st_uid}: another live run holds it, "
                    "or a run's lease was not returned (gatewayd returns leftovers at start); "
                    "one workspace serves one run at a time"
                )
            lent.append(
                LentTree(
                    path=str(path),
                    owner_uid=st.st_uid,
                    owner_gid=st.st_gid,
                    device=identity[0],
                    inode=identity[1],
                )
            )
        lease = Lease(uid=user.uid, gid=user.gid, trees=tuple(lent))
        if lease != recorded:
            _record(lease, record_dir, sync_dir=bool(lease.trees) or sync_record_dir)
        elif sync_record_dir:
            fsync_dir(record_dir)
        try:
            for tree in lease.trees:
                _rechown(
                    opened[tree.path],
                    tree.owner_uid,
                    tree.owner_gid,
                    user.uid,
                    user.gid,
                    lending=True,
                    fenced=keep,
                )
        except Exception as exc:
            give_back(lease, held=opened)
            raise LeaseError(f"cannot lend the workspace to the sandbox: {exc}") from exc
        return lease
    finally:
        for fd in opened.values():
            os.close(fd)


def record_uid(user: HostUser, record_dir: Path) -> Lease:
    """Record in ``record_dir`` the lease of no tree to ``user`` (blocking): before its
    sandbox lends anything, so a run's uid is named there early (a later :func:`lend` of
    trees records over it). Error handling: OSError as the system reports it."""
    lease = Lease(uid=user.uid, gid=user.gid, trees=())
    _record(lease, record_dir, sync_dir=False)
    return lease


def _record(lease: Lease, record_dir: Path, *, sync_dir: bool) -> None:
    # Whole whenever its name is there (the file is fsynced before the rename). A lease
    # of no tree records only the run's uid, whose processes the next start kills after
    # a crash of gatewayd (the page cache keeps the name); a power cut leaves no
    # process, so its name need not be durable: the caller says when it must be.
    write_atomically(record_dir / LEASE_FILE, lease.to_json().encode(), sync_dir=sync_dir)


def give_back(lease: Lease, *, held: Mapping[str, int] | None = None) -> int:
    """Return every entry the lease's uid owns in its trees to the tree's owner; returns
    how many entries changed. Call only once no process of the uid is alive.

    ``held``: descriptors of the trees (by their recorded path) the caller kept since it
    lent them, as a live run does: each is given back wherever it is now, and a tree
    deleted meanwhile has nothing to give back. A tree without one (a crashed daemon's
    record) is opened by its path, and given back only if that is still the directory
    lent (its device and inode), never through a symlink.

    Error handling: tries every tree, then raises :class:`LeaseError` naming each that
    could not be given back completely and why (the caller keeps the record for the
    next start)."""
    changed = 0
    failures: list[str] = []
    for tree in lease.trees:
        fd = (held or {}).get(tree.path)
        try:
            if fd is not None:
                changed += _give_back_held(lease, tree, fd)
            else:
                changed += _give_back_by_path(lease, tree)
        except Exception as exc:
            failures.append(f"{tree.path}: {exc}")
    if failures:
        raise LeaseError("could not give back: " + "; ".join(failures))
    return changed


def _give_back_held(lease: Lease, tree: LentTree, fd: int) -> int:
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != tree.identity:
        raise LeaseError(
            f"the descriptor held is not the directory lent (device and inode "
            f"{_show((st.st_dev, st.st_ino))}, lent {_show(tree.identity)})"
        )
    if st.st_nlink == 0:
        return 0  # deleted meanwhile: nothing left to give back
    return _rechown(fd, lease.uid, lease.gid, tree.owner_uid, tree.owner_gid)


def _give_back_by_path(lease: Lease, tree: LentTree) -> int:
    kept = (
        f"nothing of it was changed, and the lease record stays so the next start tries "
        f"again: put the directory lent back at {tree.path}, or, if it was deleted, "
        "remove the run's directory under STATE/runs"
    )
    try:
        fd = os.open(tree.path, TREE_FLAGS)  # a symlink is opened as itself, never followed
    except OSError as exc:
        raise LeaseError(
            f"it no longer leads to the directory lent ({exc.strerror}); {kept}"
        ) from exc
    try:
        st = os.fstat(fd)
        if stat.S_ISLNK(st.st_mode):
            raise LeaseError(f"it no longer leads to the directory lent (a symlink now); {kept}")
        if (st.st_dev, st.st_ino) != tree.identity:
            raise LeaseError(
                f"it leads to another directory than the one lent (device and inode "
                f"{_show((st.st_dev, st.st_ino))}, lent {_show(tree.identity)}); {kept}"
            )
        return _rechown(fd, lease.uid, lease.gid, tree.owner_uid, tree.owner_gid)
    finally:
        os.close(fd)


def _show(identity: Identity) -> str:
    return f"{identity[0]}:{identity[1]}"


def read_lease(run_dir: Path) -> Lease | None:
    """The lease recorded in ``run_dir`` (a crashed daemon's leftover), or None."""
    record = run_dir / LEASE_FILE
    try:
        return Lease.from_json(record.read_text())
    except FileNotFoundError:
        return None
    except KeyError as exc:
        raise LeaseError(
            f"unreadable lease record {record}: it has no {exc.args[0]!r} (written by an "
            "older gatewayd, or damaged), so nothing of it was given back: return its trees "
            f"to their owners by hand, then remove {run_dir}"
        ) from exc
    except (OSError, ValueError, TypeError) as exc:
        raise LeaseError(f"unreadable lease record {record}: {exc}") from exc


def _rechown(
    tree: int,
    from_uid: int,
    from_gid: int,
    to_uid: int,
    to_gid: int,
    *,
    lending: bool = False,
    fenced: Collection[Identity] = (),
) -> int:
    """chown every entry of the tree open at ``tree`` (an ``O_PATH`` descriptor of its
    root; the root included) owned by ``from_uid`` to ``to_uid``; its group becomes
    ``to_gid`` only where it was ``from_gid``. ``lending`` leaves alone what must never be
    lent (:func:`_never_lent`); ``fenced`` are directories (by device and inode) left
    alone with everything beneath them. Other file systems and mount points inside the
    tree are never entered (a bind mount there is not the tree). Every change goes
    through the descriptor the entry was judged by."""
    changed = 0
    base = _real_path(tree)
    for entry, st in _walk(tree, base, mount_points_under(Path(base)), set(fenced)):
        if st.st_uid != from_uid:
            continue
        if lending and _never_lent(entry, st):
            continue
        gid = to_gid if st.st_gid == from_gid else _KEEP
        # Through the descriptor: the inode judged, wherever its name leads by now. The
        # magic link is followed to the inode itself (a symlink's own, not its target's).
        os.chown(_through(entry), to_uid, gid)
        changed += 1
    return changed


def _real_path(fd: int) -> str:
    """Where the directory open at ``fd`` is now (the kernel's name for it).

    Error handling: :class:`LeaseError` without /proc, which lending and giving back
    need (every change goes through ``/proc/self/fd``)."""
    try:
        return os.readlink(_through(fd))
    except OSError as exc:
        raise LeaseError(
            f"cannot tell where the tree is ({_through(fd)}: {exc.strerror}): gatewayd "
            "changes a tree only through /proc/self/fd, so /proc must be mounted; nothing "
            "of it was changed"
        ) from exc


def _through(fd: int) -> str:
    """The path that leads to the inode open at ``fd``, whatever its name is now."""
    return f"/proc/self/fd/{fd}"


def _never_lent(entry: int, st: os.stat_result) -> bool:
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
        os.getxattr(_through(entry), CAPABILITY_XATTR)  # the regular file judged
    except OSError as exc:
        return exc.errno not in _NO_XATTR  # unreadable: keep it the owner's
    return True


def _walk(
    tree: int, base: str, mounts: set[str], fenced: set[Identity]
) -> Iterator[tuple[int, os.stat_result]]:
    """Every entry of the tree open at ``tree`` (an ``O_PATH`` descriptor of its root,
    whose real path is ``base``): ``(descriptor, stat)`` of the entry, the root first;
    each descriptor is open only until the next entry is asked for.

    Depth-first without recursion and with one directory open at a time besides the
    entry (a tree thousands of levels deep, as a sandbox can make, neither overflows the
    stack nor the descriptor table): each entry is opened by name with ``O_PATH`` and
    ``O_NOFOLLOW`` relative to its parent; a directory is entered through that very
    descriptor, and the walk climbs back by ".." checking that it reached the parent it
    left (device and inode). Entries at a path in ``mounts`` (mount points), or whose
    (device, inode) is in ``fenced``, are neither yielded nor entered; directories on
    another device are yielded but not entered.
    A directory that is not where the walk left it stops the walk (:class:`LeaseError`).
    """
    top = os.fstat(tree)
    yield tree, top
    fd = os.open(".", _DIR_FLAGS, dir_fd=tree)
    try:
        # One frame per directory on the current path: its identity, its path, and the
        # names still to visit.
        frames = [((top.st_dev, top.st_ino), base, os.listdir(fd))]
        while frames:
            _identity, path, names = frames[-1]
            if not names:
                frames.pop()
                if frames:  # climb back to the parent, and make sure it is the parent
                    parent = os.open("..", _DIR_FLAGS, dir_fd=fd)
                    os.close(fd)
                    fd = parent
                    st = os.fstat(fd)
                    if (st.st_dev, st.st_ino) != frames[-1][0]:
                        raise LeaseError(f"{frames[-1][1]} changed during the walk; stopped")
                continue
            name = names.pop()
            child_path = f"{path}/{name}"
            if child_path in mounts:
                continue
            try:
                entry = os.open(name, _ENTRY_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                continue  # removed meanwhile
            try:
                st = os.fstat(entry)
                identity = (st.st_dev, st.st_ino)
                if identity in fenced:
                    continue
                yield entry, st
                # Not entered: another file system's directory (an overlay's files may
                # show their layer's device, so only directories are told apart by it).
                if not stat.S_ISDIR(st.st_mode) or st.st_dev != top.st_dev:
                    continue
                child = os.open(".", _DIR_FLAGS, dir_fd=entry)  # the directory judged
            finally:
                os.close(entry)
            os.close(fd)
            fd = child
            frames.append((identity, child_path, os.listdir(fd)))
    finally:
        os.close(fd)


def mount_points_under(root: Path) -> set[str]:
    """Mount points strictly inside ``root`` (from this process's mountinfo).

    Error handling: :class:`LeaseError` when the mount table cannot be read: without it
    a bind mount inside the tree cannot be told from the tree, so nothing is walked."""
    prefix = str(root).rstrip("/") + "/"
    try:
        with open(PROC_SELF_MOUNTINFO, encoding="utf-8", errors="surrogateescape") as info:
            mounts = mounts_of(info.read())
    except OSError as exc:
        raise LeaseError(
            f"cannot tell the mounts inside {root} ({PROC_SELF_MOUNTINFO}: {exc.strerror}); "
            "nothing of it was changed"
        ) from exc
    return {m.point.rstrip("/") for m in mounts if m.point.startswith(prefix)}
