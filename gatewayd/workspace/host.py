"""The ``host`` backend: the sandbox binds the directory itself.

Writes land in the base at once (that is the point: compatibility with tools that
expect the real directory). To offer diff and discard anyway, create() snapshots the
tree into the private state directory with ``cp -a --reflink=auto``: on btrfs or XFS
the copy shares blocks with the original (near free), elsewhere it is a plain copy.
GNU cp is used because it already gets every corner right (symlinks kept as links,
hard links, modes, times, sparse files) and is on every Debian host; a Python copy
would redo that, less well. Alternatives (hashes only) could not restore on discard.

diff compares the snapshot with the directory; commit accepts the changes (drops the
snapshot); discard restores the directory's contents from the snapshot.

Discard is recoverable: it first writes ``discard.pending`` durably (after flushing the
snapshot to disk), and only then empties the base. A crash part-way leaves the marker
and the whole snapshot; :func:`recover_discard` (which :meth:`HostWorkspace.create`
calls on the state directory) redoes the restore from the start, which is idempotent.
A snapshot is only ever deleted after being renamed to ``snapshot.dropped``, so a
``snapshot`` directory left without a marker is always a whole one (a session that was
never ended), and a ``snapshot.dropped`` is always garbage.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Final

from gatewayd.files import LIBC, fsync_dir, write_atomically
from gatewayd.workspace.session import (
    DIR_FLAGS,
    SessionState,
    WorkspaceDiff,
    WorkspaceError,
    WorkspaceSession,
    make_state_dir,
)
from gatewayd.workspace.treediff import compare_trees

SNAPSHOT_NAME: Final = "snapshot"
# A snapshot on its way out: renamed first so a half-deleted one is never taken for whole.
DROPPED_NAME: Final = "snapshot.dropped"
# Present (durably) from before discard touches the base until the base is restored.
DISCARD_MARKER_NAME: Final = "discard.pending"
# Debian's coreutils; a fixed path, never a PATH lookup by the daemon.
CP: Final = "/usr/bin/cp"
# Copying a large tree can take a while; a stuck copy (hung NFS) must not hang gatewayd.
COPY_TIMEOUT_SECONDS: Final = 600


def copy_tree_contents(source: Path, dest: Path) -> None:
    """Copy everything inside ``source`` into the existing directory ``dest``."""
    result = subprocess.run(
        [CP, "-a", "--reflink=auto", "--", f"{source}/.", f"{dest}/"],
        capture_output=True,
        timeout=COPY_TIMEOUT_SECONDS,
        check=False,
    )
    if result.returncode != 0:
        message = result.stderr.decode(errors="replace").strip()
        raise WorkspaceError(f"copying {source} to {dest} failed: {message}")


def clear_directory(path: Path) -> None:
    """Remove every entry inside ``path`` (never following a symlink), keeping ``path``."""
    fd = os.open(path, DIR_FLAGS)
    try:
        for name in os.listdir(fd):
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, dir_fd=fd)
            else:
                os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)


def sync_file_system(path: Path) -> None:
    """Flush every dirty page of the file system holding ``path`` (syncfs(2)).

    cp does not fsync what it copies: without this, a power loss after discard emptied
    the base could find the snapshot's files (or the restored ones) empty.
    """
    fd = os.open(path, DIR_FLAGS)
    try:
        if LIBC.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise WorkspaceError(
                f"flushing the file system of {path} failed: "
                f"{errno.errorcode.get(err, err)} ({os.strerror(err)})"
            )
    finally:
        os.close(fd)


def _drop_snapshot(state_dir: Path) -> None:
    """Delete the snapshot: rename (durable), then remove, so no half one keeps its name."""
    dropped = state_dir / DROPPED_NAME
    if (state_dir / SNAPSHOT_NAME).exists():
        os.rename(state_dir / SNAPSHOT_NAME, dropped)
        fsync_dir(state_dir, follow_symlinks=False)
    shutil.rmtree(dropped, ignore_errors=True)


def _restore(state_dir: Path, base: Path) -> None:
    """With the marker durable: make ``base`` equal the snapshot, then end the discard."""
    snapshot = state_dir / SNAPSHOT_NAME
    marker = state_dir / DISCARD_MARKER_NAME
    if snapshot.is_dir():
        clear_directory(base)
        copy_tree_contents(snapshot, base)
        sync_file_system(base)
        # From here the base is whole again: the snapshot may go, marker still set.
        os.rename(snapshot, state_dir / DROPPED_NAME)
        fsync_dir(state_dir, follow_symlinks=False)
    # No snapshot under its name with the marker set: an earlier attempt restored the
    # base and renamed it (that rename is the last step that needed the snapshot).
    marker.unlink()
    fsync_dir(state_dir, follow_symlinks=False)
    _drop_snapshot(state_dir)


def recover_discard(state_dir: Path, base: Path) -> bool:
    """Finish a discard a crash interrupted in ``state_dir``; True if there was one.

    Error handling: a marker naming another base than ``base`` raises
    :class:`WorkspaceError` and touches nothing (restoring the wrong directory would
    destroy it).
    """
    state_dir = Path(state_dir)
    marker = state_dir / DISCARD_MARKER_NAME
    if not marker.exists():
        return False
    base = Path(os.path.realpath(base))
    try:
        recorded = json.loads(marker.read_bytes())["base"]
    except (ValueError, KeyError, TypeError) as exc:
        raise WorkspaceError(f"{marker} is malformed ({exc}); restore {base} by hand") from None
    if recorded != str(base):
        raise WorkspaceError(
            f"{marker} is a pending discard of {recorded}, not of {base}; recover it with that base"
        )
    _restore(state_dir, base)
    return True


class HostWorkspace(WorkspaceSession):
    """The directory itself, with a snapshot for diff and discard."""

    def __init__(self, base: Path, state_dir: Path) -> None:
        super().__init__()
        self.base = base
        self.root = base
        self.state_dir = state_dir
        self.snapshot = state_dir / SNAPSHOT_NAME

    @classmethod
    def create(
        cls, base: Path, state_dir: Path, *, max_delta_bytes: int | None = None
    ) -> HostWorkspace:
        """Open a session on the directory ``base``; ``state_dir`` must be empty or new.

        ``max_delta_bytes`` is accepted for the one signature every backend has, and not
        enforced here: the sandbox writes the host directory itself, so nothing bounds
        its writes as they happen. The session store measures the delta when the run
        ends and refuses to commit one past the limit (docs/workspaces.md).

        A discard a crash interrupted in ``state_dir`` is finished first
        (:func:`recover_discard`, which restores ``base``), as is the removal of a
        dropped snapshot; then ``state_dir`` must hold nothing else.
        """
        base = Path(os.path.realpath(base))
        if not base.is_dir():
            raise WorkspaceError(f"workspace base {base} is not a directory")
        state_dir = Path(state_dir)
        if state_dir.is_dir():
            recover_discard(state_dir, base)
            shutil.rmtree(state_dir / DROPPED_NAME, ignore_errors=True)
        session = cls(base, make_state_dir(state_dir))
        session.snapshot.mkdir(mode=0o700)
        try:
            copy_tree_contents(base, session.snapshot)
        except BaseException:
            shutil.rmtree(session.snapshot, ignore_errors=True)
            raise
        session._pin_root()
        return session

    writes_base = True

    @classmethod
    def recover_state(cls, base: Path, state_dir: Path) -> str | None:
        """A discard a crash interrupted is finished (the base restored)."""
        return "discarded" if recover_discard(state_dir, base) else None

    @classmethod
    def reopen(cls, base: Path, state_dir: Path) -> HostWorkspace:
        """The sealed session a run left in ``state_dir`` (its snapshot), for diff, commit
        or discard from another process. A discard a crash interrupted is finished first,
        and the session is then gone (:class:`WorkspaceError` says so), as it is when
        the snapshot is missing."""
        base = Path(os.path.realpath(base))
        state_dir = Path(state_dir)
        if recover_discard(state_dir, base):
            raise WorkspaceError(
                f"the session in {state_dir} was being discarded; the discard is finished"
            )
        session = cls(base, state_dir)
        if not session.snapshot.is_dir():
            raise WorkspaceError(f"the session in {state_dir} has no snapshot of {base}")
        session._pin_root()
        session._sealed = True
        return session

    def diff(self) -> WorkspaceDiff:
        self._require_open()
        return compare_trees(self.snapshot, self.root, [""])

    def commit(self, *, leave_out: frozenset[str] = frozenset(), keep_marker: bool = False) -> None:
        """The changes are already in the base: drop the snapshot. Nothing can be left
        out (the run wrote the base itself): a non-empty ``leave_out`` is refused."""
        self._require_open()
        if leave_out:
            raise WorkspaceError(
                "mode host cannot leave paths out of a commit: the run wrote them into "
                f"{self.base} itself ({', '.join(sorted(leave_out)[:5])}); discard the "
                "session to restore the directory"
            )
        self._state = SessionState.COMMITTED
        _drop_snapshot(self.state_dir)

    def discard(self) -> None:
        """Make the base's contents equal the snapshot again, then drop it.

        Error handling: a failure (or crash) after the marker is written leaves the
        marker and the snapshot; :func:`recover_discard`, or a new
        :meth:`HostWorkspace.create` on the same state directory, finishes the restore.
        """
        self._require_open()
        # The snapshot must be on disk before the base it replaces is deleted.
        sync_file_system(self.snapshot)
        marker = json.dumps({"base": str(self.base)}).encode()
        write_atomically(self.state_dir / DISCARD_MARKER_NAME, marker)
        self._state = SessionState.DISCARDED
        _restore(self.state_dir, self.base)

    def close(self) -> None:
        # A sealed session's snapshot is kept for a later commit or discard.
        if self._state is SessionState.OPEN and not self._sealed:
            self.discard()
