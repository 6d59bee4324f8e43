"""The ``overlay`` backend: kernel overlayfs, mounted by gatewayd.

The base is the overlay's ``lowerdir`` and is never written while the session is
open; the sandbox binds the merged mount, and every change lands in ``upperdir``
under gatewayd's private state directory. Why kernel overlayfs (docs/workspaces.md
has the long form): it is in the kernel Debian 12 ships, needs no FUSE daemon, and
the merged directory is an ordinary directory that bubblewrap binds like any other.

Mount options, fixed: ``redirect_dir=off`` (renaming a directory that came from the
base fails with EXDEV, and tools such as ``mv`` fall back to copy and delete, so the
upper directory never holds redirect xattrs the diff and commit would have to
follow), ``metacopy=off`` (a file in the upper directory always holds its whole
content, so commit can copy it), ``index=off``, ``xino=off``; ``nosuid,nodev``.

Diff walks the upper directory: a regular file or symlink there is added or
modified; a whiteout (a character device 0/0) is a removal; a directory with
``trusted.overlay.opaque=y`` replaced the base's directory of that name entirely.

Commit is a journal replayed forward: the planned operations are written durably
to ``commit.journal`` before the base is touched, each file is replaced atomically
(temporary file in the same directory, fsync, rename), then ``commit.applied`` is
written durably (:mod:`gatewayd.workspace.commit_marker`), and the journal is removed,
then the delta; the marker stays until the state directory is removed or reused. After
a crash, :func:`recover_commit` (which :meth:`OverlayWorkspace.create` calls on the state
directory) replays the whole journal unless the marker says it was applied; every
operation is idempotent, and the upper directory it copies from is kept until the
journal is gone. A commit may be told to leave paths out (``leave_out``: the session
store's git-metadata rule, :mod:`gatewayd.workspace.commit_rules`): they never enter the
journal.

Delta size limit (``max_delta_bytes``): the upper and work directories then live on a
private tmpfs mounted by gatewayd at ``state_dir/delta`` (``size=<bytes>``, mode 0700,
``nosuid,nodev``), so the sandbox's writes past the limit fail with ENOSPC instead of
filling the host's disk. tmpfs carries what an upper directory needs (``trusted.*``
xattrs for opaque directories, 0/0 character devices for whiteouts). The tmpfs is
unmounted last: commit reads the upper directory from it while the journal exists. It
lives in memory (and swap), so it does not survive a reboot: a commit interrupted by a
reboot cannot be finished (recovery says so); one interrupted by a crash of gatewayd can.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from gatewayd.files import LIBC, write_atomically
from gatewayd.workspace.commit_marker import is_applied
from gatewayd.workspace.journal import (
    JOURNAL_NAME,
    apply_journal,
    commit_interrupted,
    finish_applied,
    journal_operations,
    load_journal,
    prepare_create,
)
from gatewayd.workspace.session import (
    DIR_FLAGS,
    SessionState,
    WorkspaceDiff,
    WorkspaceError,
    WorkspaceSession,
    make_state_dir,
    open_dirs,
)
from gatewayd.workspace.treediff import compare_trees

UPPER_NAME: Final = "upper"
WORK_NAME: Final = "work"
# Mount point of the size-limited tmpfs holding upper and work (with max_delta_bytes).
DELTA_NAME: Final = "delta"
MERGED_NAME: Final = "merged"
OPAQUE_XATTR: Final = "trusted.overlay.opaque"
MOUNT_OPTIONS: Final = "redirect_dir=off,metacopy=off,index=off,xino=off"

# From <sys/mount.h>.
MS_NOSUID: Final = 0x2
MS_NODEV: Final = 0x4
MNT_DETACH: Final = 0x2
# The delta tmpfs: only gatewayd enters it; nothing on it is a device or setuid.
DELTA_MOUNT_FLAGS: Final = MS_NOSUID | MS_NODEV
DELTA_MODE: Final = 0o700

# Characters the kernel's overlay option parser gives a meaning (separators, escapes).
_OPTION_UNSAFE: Final = frozenset(",:\\\n")
# Setuid, setgid and sticky bits never travel from the sandbox to the host.
_COMMIT_MODE_MASK: Final = 0o777
# A directory the commit makes is gatewayd's alone until its mode is set.
_NEW_DIR_MODE: Final = 0o700


def _mount_overlay(lower: Path, upper: Path, work: Path, merged: Path) -> None:
    for path in (lower, upper, work, merged):
        if _OPTION_UNSAFE & set(str(path)):
            raise WorkspaceError(
                f"{path} contains one of , : \\ or a newline, which overlayfs options "
                "cannot carry; use another directory"
            )
    options = f"lowerdir={lower},upperdir={upper},workdir={work},{MOUNT_OPTIONS}"
    rc = LIBC.mount(
        b"overlay",
        os.fsencode(merged),
        b"overlay",
        ctypes.c_ulong(MS_NOSUID | MS_NODEV),
        os.fsencode(options),
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise WorkspaceError(
            f"mounting the overlay at {merged} failed: {errno.errorcode.get(err, err)} "
            f"({os.strerror(err)}); gatewayd needs CAP_SYS_ADMIN and a kernel with overlayfs"
        )


def _mount_delta_tmpfs(path: Path, size: int) -> None:
    options = f"size={size},mode={DELTA_MODE:o}"
    rc = LIBC.mount(
        b"tmpfs",
        os.fsencode(path),
        b"tmpfs",
        ctypes.c_ulong(DELTA_MOUNT_FLAGS),
        os.fsencode(options),
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise WorkspaceError(
            f"mounting the delta tmpfs at {path} failed: {errno.errorcode.get(err, err)} "
            f"({os.strerror(err)}); gatewayd needs CAP_SYS_ADMIN"
        )


def unmount(path: Path, *, detach: bool) -> None:
    """Unmount ``path`` if it is a mount point; ``detach`` falls back to a lazy unmount."""
    if not os.path.ismount(path):
        return
    if LIBC.umount2(os.fsencode(path), 0) == 0:
        return
    err = ctypes.get_errno()
    if err == errno.EBUSY and detach and LIBC.umount2(os.fsencode(path), MNT_DETACH) == 0:
        return
    raise WorkspaceError(
        f"unmounting {path} failed: {errno.errorcode.get(err, err)} ({os.strerror(err)})"
        + ("; a process (the sandbox?) still uses it" if err == errno.EBUSY else "")
    )


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _is_opaque(path: Path) -> bool:
    try:
        return os.getxattr(path, OPAQUE_XATTR, follow_symlinks=False) == b"y"
    except OSError:
        return False


# --- the delta as a list of operations ----------------------------------------
#
# ["remove", rel]        remove whatever is at base/rel (absent is fine)
# ["replace_dir", rel]   remove whatever is at base/rel, then make an empty directory
# ["dir", rel]           make sure base/rel is a directory (merged into, not replaced)
# ["file", rel]          copy upper/rel (regular file or symlink) over base/rel
# Listed parent before child, so replaying the list in order rebuilds the delta.


def plan_delta(upper: Path, base: Path) -> list[list[str]]:
    """The operations that make ``base`` equal the merged view of ``base`` + ``upper``."""
    return list(_walk_upper(upper, base, ""))


def _walk_upper(upper: Path, base: Path, rel_dir: str) -> Iterator[list[str]]:
    for name in sorted(os.listdir(upper / rel_dir if rel_dir else upper)):
        rel = f"{rel_dir}/{name}" if rel_dir else name
        path = upper / rel
        st = os.lstat(path)
        if _is_whiteout(st):
            yield ["remove", rel]
        elif stat.S_ISDIR(st.st_mode):
            base_is_dir = stat.S_ISDIR(lstat_mode(base / rel))
            if _is_opaque(path) or not base_is_dir:
                yield ["replace_dir", rel]
            else:
                yield ["dir", rel]
            yield from _walk_upper(upper, base, rel)
        elif stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
            yield ["file", rel]
        # Anything else (a FIFO, a device node the sandbox made) never reaches the host.


def lstat_mode(path: Path) -> int:
    """The mode of ``path`` (not followed), 0 when there is nothing there."""
    try:
        return os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return 0


def _scopes(ops: list[list[str]]) -> list[str]:
    """The subtrees a diff must compare: everything but directories merged into."""
    return [rel for op, rel in ops if op != "dir"]


# --- applying operations to the base, never through a symlink ------------------


def _remove_at(parent_fd: int, name: str) -> None:
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=parent_fd)
    else:
        os.unlink(name, dir_fd=parent_fd)


def _temp_name(name: str) -> str:
    return f".cogni-commit.{hashlib.sha256(os.fsencode(name)).hexdigest()[:16]}.tmp"


def _copy_in(source: Path, parent_fd: int, name: str) -> None:
    """Replace base entry ``name`` with ``source`` (a file or symlink), atomically."""
    tmp = _temp_name(name)
    _remove_at(parent_fd, tmp)  # a leftover of an interrupted commit
    owner = os.fstat(parent_fd)
    st = os.lstat(source)
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(source), tmp, dir_fd=parent_fd)
        if os.geteuid() == 0:
            # The link itself (never what it points at), as the files below.
            os.chown(tmp, owner.st_uid, owner.st_gid, dir_fd=parent_fd, follow_symlinks=False)
    else:
        src = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            dst = os.open(
                tmp,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                st.st_mode & _COMMIT_MODE_MASK,
                dir_fd=parent_fd,
            )
            try:
                while os.sendfile(dst, src, None, 1 << 24):
                    pass
                os.fchmod(dst, st.st_mode & _COMMIT_MODE_MASK)
                if os.geteuid() == 0:
                    # The sandbox's uid means nothing on the host: files belong to
                    # whoever owns the directory they land in.
                    os.fchown(dst, owner.st_uid, owner.st_gid)
                os.fsync(dst)
            finally:
                os.close(dst)
        finally:
            os.close(src)
    existing = _lstat_at(parent_fd, name)
    if existing is not None and stat.S_ISDIR(existing):
        shutil.rmtree(name, dir_fd=parent_fd)  # rename cannot replace a directory
    os.replace(tmp, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)


def _lstat_at(dir_fd: int, name: str) -> int | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return None


def _make_dir(parent_fd: int, name: str, mode: int) -> None:
    """Make directory ``name`` with ``mode``, owned like the directory it lands in.

    Mode and owner go on through a descriptor of the directory made: a writer in the
    base could swap the name for a symlink between mkdir and chmod, and a chmod or chown
    by name would follow it to a host file (as root)."""
    os.mkdir(name, _NEW_DIR_MODE, dir_fd=parent_fd)
    made = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    try:
        if os.geteuid() == 0:
            owner = os.fstat(parent_fd)
            os.fchown(made, owner.st_uid, owner.st_gid)
        os.fchmod(made, mode)
    finally:
        os.close(made)


def apply_operation(base_fd: int, upper: Path, op: str, rel: str) -> None:
    """Apply one journal operation to the base (idempotent)."""
    *dirs, name = rel.split("/")
    parent = open_dirs(base_fd, dirs)
    try:
        if op == "remove":
            _remove_at(parent, name)
        elif op == "replace_dir":
            _remove_at(parent, name)
            _make_dir(parent, name, os.lstat(upper / rel).st_mode & _COMMIT_MODE_MASK)
        elif op == "dir":
            mode = _lstat_at(parent, name)
            if mode is None or not stat.S_ISDIR(mode):
                _remove_at(parent, name)
                _make_dir(parent, name, os.lstat(upper / rel).st_mode & _COMMIT_MODE_MASK)
        elif op == "file":
            _copy_in(upper / rel, parent, name)
        else:
            raise WorkspaceError(f"unknown commit operation {op!r} in the journal")
        os.fsync(parent)
    finally:
        os.close(parent)


def _replay(state_dir: Path, journal: dict[str, object], *, keep_marker: bool) -> None:
    base = Path(str(journal["base"]))
    ops = journal_operations(state_dir, journal)
    on_tmpfs = journal.get("delta_on_tmpfs") is True
    upper = (state_dir / DELTA_NAME if on_tmpfs else state_dir) / UPPER_NAME
    if not upper.is_dir():
        raise WorkspaceError(
            f"the commit journal in {state_dir} cannot be replayed: the delta {upper} is "
            + ("gone (its tmpfs does not survive a reboot); " if on_tmpfs else "gone; ")
            + f"{base} holds part of the commit, each file whole; remove "
            f"{state_dir / JOURNAL_NAME} to give up the rest"
        )
    # Looked up now, not bound at import: a test stands in for a step to crash there.
    apply_journal(
        state_dir,
        base,
        ops,
        upper,
        apply=apply_operation,
        remove_delta=_remove_delta,
        keep_marker=keep_marker,
    )


def _remove_delta(state_dir: Path) -> None:
    """Delete upper and work, wherever they are; unmount and remove a delta tmpfs."""
    for name in (UPPER_NAME, WORK_NAME):
        shutil.rmtree(state_dir / name, ignore_errors=True)
    delta = state_dir / DELTA_NAME
    if os.path.ismount(delta):
        # Unmounting frees the whole delta at once; busy only if someone sits inside.
        unmount(delta, detach=True)
    if delta.is_dir():
        delta.rmdir()


def recover_commit(state_dir: Path, *, keep_marker: bool = False) -> bool:
    """Finish a commit a crash interrupted in ``state_dir``; True if there was one (a
    journal to replay, or the applied marker: then only the journal and the delta are
    dropped, and nothing is applied again). ``keep_marker``: leave the marker for the
    session store, which removes it with the session (see commit_marker)."""
    if not commit_interrupted(state_dir):
        return False
    unmount(Path(state_dir) / MERGED_NAME, detach=True)
    if is_applied(state_dir):
        finish_applied(Path(state_dir), remove_delta=_remove_delta, keep_marker=keep_marker)
    else:
        _replay(Path(state_dir), load_journal(state_dir), keep_marker=keep_marker)
    merged = Path(state_dir) / MERGED_NAME
    if merged.is_dir() and not os.path.ismount(merged):
        merged.rmdir()
    return True


class OverlayWorkspace(WorkspaceSession):
    """A copy-on-write view of ``base``: the sandbox binds :attr:`root` (the merged mount)."""

    def __init__(self, base: Path, state_dir: Path, *, max_delta_bytes: int | None = None) -> None:
        super().__init__()
        self.base = base
        self.state_dir = state_dir
        self.max_delta_bytes = max_delta_bytes
        self.delta = state_dir / DELTA_NAME if max_delta_bytes is not None else state_dir
        self.upper = self.delta / UPPER_NAME
        self.work = self.delta / WORK_NAME
        self.root = state_dir / MERGED_NAME
        self._mounted = False

    @classmethod
    def create(
        cls, base: Path, state_dir: Path, *, max_delta_bytes: int | None = None
    ) -> OverlayWorkspace:
        """Mount an overlay over ``base`` with its delta under ``state_dir``.

        A commit a crash interrupted in ``state_dir`` is finished first
        (:func:`recover_commit`); then ``state_dir`` must hold nothing else.
        ``max_delta_bytes`` caps what the session may write (new and copied-up files,
        directories, whiteouts) on a private tmpfs: past it, writes fail with ENOSPC.
        """
        base, state_dir = prepare_create(base, state_dir, max_delta_bytes, recover_commit)
        if state_dir.is_dir():
            for leftover in (MERGED_NAME,):
                if (state_dir / leftover).is_dir() and not os.path.ismount(state_dir / leftover):
                    (state_dir / leftover).rmdir()
        session = cls(base, make_state_dir(state_dir), max_delta_bytes=max_delta_bytes)
        try:
            if max_delta_bytes is not None:
                session.delta.mkdir(mode=DELTA_MODE)
                _mount_delta_tmpfs(session.delta, max_delta_bytes)
            for path in (session.upper, session.work, session.root):
                path.mkdir(mode=0o755)
            _mount_overlay(base, session.upper, session.work, session.root)
        except BaseException:
            session._remove_all()
            raise
        session._mounted = True
        session._pin_root()
        return session

    def _remove_all(self) -> None:
        _remove_delta(self.state_dir)
        if self.root.is_dir() and not os.path.ismount(self.root):
            self.root.rmdir()

    @classmethod
    def recover_state(cls, base: Path, state_dir: Path) -> str | None:
        """A commit a crash interrupted is finished from its journal (the applied marker
        is left for the store, which removes it with the session)."""
        return "committed" if recover_commit(state_dir, keep_marker=True) else None

    @classmethod
    def reopen(cls, base: Path, state_dir: Path) -> OverlayWorkspace:
        """The sealed session a run left in ``state_dir`` (its upper directory, no mount),
        for diff, commit or discard from another process.

        Error handling: :class:`WorkspaceError` when the delta is gone: a delta on a
        tmpfs (``max_delta_bytes``) does not survive a reboot, and nothing is left to
        commit (the base was never written).
        """
        base = Path(os.path.realpath(base))
        state_dir = Path(os.path.realpath(state_dir))
        on_tmpfs = (state_dir / DELTA_NAME).is_dir()
        session = cls(base, state_dir, max_delta_bytes=None)
        if on_tmpfs:
            session.delta = state_dir / DELTA_NAME
            session.upper = session.delta / UPPER_NAME
            session.work = session.delta / WORK_NAME
        # A daemon that died with the run left its merged view mounted.
        unmount(session.root, detach=True)
        if not session.upper.is_dir() or (on_tmpfs and not os.path.ismount(session.delta)):
            raise WorkspaceError(
                f"the session in {state_dir} has lost its delta"
                + (" (it was on a tmpfs, which does not survive a reboot)" if on_tmpfs else "")
                + f"; {base} was never written, so there is nothing to commit"
            )
        if not session.root.is_dir():
            session.root.mkdir(mode=0o755)
        session._sealed = True
        return session

    def seal(self) -> None:
        """Unmount the merged view (the sandbox is gone); the upper directory, and its
        tmpfs, stay for diff, commit and discard. A lazy unmount if something still
        holds the view: nothing should (the sandbox's processes are dead)."""
        self._require_open()
        if self._mounted:
            unmount(self.root, detach=True)
            self._mounted = False
        self._sealed = True

    def delta_operations(self) -> list[list[str]]:
        """The operations commit would apply (the upper directory, read as a plan)."""
        return plan_delta(self.upper, self.base)

    def committed_bytes(self) -> int:
        """The apparent size of every regular file commit would copy (see the ABC): the
        tmpfs bounding the delta counts blocks, and a sparse file needs almost none."""
        total = 0
        for op, rel in self.delta_operations():
            if op == "file":
                st = os.lstat(self.upper / rel)
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
        return total

    def touched(self) -> list[str]:
        """Every path of the base the commit writes or removes (a directory merged into
        included: the commit makes it a directory)."""
        return [rel for _op, rel in self.delta_operations()]

    def diff(self) -> WorkspaceDiff:
        self._require_open()
        scopes = _scopes(self.delta_operations())
        if self._mounted:
            return compare_trees(self.base, self.root, scopes)
        # Sealed: no merged view. Beneath each scope the upper directory holds the whole
        # new content (a file copied up whole, metacopy off; an opaque or new directory
        # whole), and a whiteout, a 0/0 device, reads as absent: the same answer.
        return compare_trees(self.base, self.upper, scopes)

    def commit(self, *, leave_out: frozenset[str] = frozenset(), keep_marker: bool = False) -> None:
        """Unmount, then apply the delta to the base through a journal (see module doc);
        the operations on the paths in ``leave_out`` are left out of it; ``keep_marker``:
        the applied marker stays (the session store removes it with the session).

        Error handling: if the merged mount is still in use, nothing is applied and the
        session stays open (:class:`WorkspaceError`). A failure while applying leaves
        the journal, so :func:`recover_commit` finishes the commit later.
        """
        self._require_open()
        unmount(self.root, detach=False)
        self._mounted = False
        ops = [op for op in self.delta_operations() if op[1] not in leave_out]
        journal: dict[str, object] = {
            "base": str(self.base),
            "ops": ops,
            "delta_on_tmpfs": self.delta != self.state_dir,
        }
        write_atomically(self.state_dir / JOURNAL_NAME, json.dumps(journal).encode())
        self._state = SessionState.COMMITTED
        _replay(self.state_dir, journal, keep_marker=keep_marker)
        self.root.rmdir()

    def discard(self) -> None:
        """Unmount and drop the delta; the base was never written."""
        self._require_open()
        self._state = SessionState.DISCARDED
        self._teardown()

    def _teardown(self) -> None:
        if self._mounted:
            unmount(self.root, detach=True)
            self._mounted = False
        self._remove_all()

    def close(self) -> None:
        if self._state is SessionState.OPEN and not self._sealed:
            self.discard()
        elif self._mounted:
            self._teardown()
