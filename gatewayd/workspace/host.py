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
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Final

from gatewayd.workspace.session import (
    SessionState,
    WorkspaceDiff,
    WorkspaceError,
    WorkspaceSession,
    make_state_dir,
)
from gatewayd.workspace.treediff import compare_trees

SNAPSHOT_NAME: Final = "snapshot"
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
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for name in os.listdir(fd):
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, dir_fd=fd)
            else:
                os.unlink(name, dir_fd=fd)
    finally:
        os.close(fd)


class HostWorkspace(WorkspaceSession):
    """The directory itself, with a snapshot for diff and discard."""

    def __init__(self, base: Path, state_dir: Path) -> None:
        super().__init__()
        self.base = base
        self.root = base
        self.state_dir = state_dir
        self.snapshot = state_dir / SNAPSHOT_NAME

    @classmethod
    def create(cls, base: Path, state_dir: Path) -> HostWorkspace:
        """Open a session on the directory ``base``; ``state_dir`` must be empty or new."""
        base = Path(os.path.realpath(base))
        if not base.is_dir():
            raise WorkspaceError(f"workspace base {base} is not a directory")
        session = cls(base, make_state_dir(Path(state_dir)))
        session.snapshot.mkdir(mode=0o700)
        try:
            copy_tree_contents(base, session.snapshot)
        except BaseException:
            shutil.rmtree(session.snapshot, ignore_errors=True)
            raise
        session._pin_root()
        return session

    def diff(self) -> WorkspaceDiff:
        self._require_open()
        return compare_trees(self.snapshot, self.root, [""])

    def commit(self) -> None:
        """The changes are already in the base: drop the snapshot."""
        self._require_open()
        shutil.rmtree(self.snapshot)
        self._state = SessionState.COMMITTED

    def discard(self) -> None:
        """Make the base's contents equal the snapshot again, then drop it.

        A crash here leaves the snapshot in place (it is removed last), so calling
        discard on a new session object over the same state directory is not
        possible yet; the snapshot can be copied back by hand.
        """
        self._require_open()
        clear_directory(self.root)
        copy_tree_contents(self.snapshot, self.root)
        shutil.rmtree(self.snapshot)
        self._state = SessionState.DISCARDED

    def close(self) -> None:
        if self._state is SessionState.OPEN:
            self.discard()
