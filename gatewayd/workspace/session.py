"""The session contract every workspace backend satisfies, and the path-safe file
operations they share.

Every operation takes a path relative to the workspace root. It is resolved by the
kernel beneath the root (:mod:`gatewayd.hostpaths.beneath`): absolute paths and ``..``
are refused before anything is opened; a symlink that leads out of the tree is
refused (reads follow symlinks that stay inside, writes follow none).
"""

from __future__ import annotations

import abc
import enum
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import ClassVar, Final

from gatewayd.errors import InvalidArguments, PolicyViolation, ToolFailed
from gatewayd.files import write_all
from gatewayd.hostpaths.beneath import (
    BeneathRoot,
    require_single_link_regular,
    translate_oserror,
)
from gatewayd.policy.paths import PathGrant, PathMode, ResolvedPath, shown

# The name paths are shown under in messages (never the host path).
VISIBLE_ROOT: Final = PurePosixPath("/workspace")
# Mode of files write() creates (the daemon's umask still applies).
NEW_FILE_MODE: Final = 0o644
# Mode of a backend's private state directory: only gatewayd reads the snapshot/delta.
STATE_DIR_MODE: Final = 0o700


class WorkspaceError(ToolFailed):
    """A session operation failed for a reason that is not the caller's path."""


class SessionState(enum.Enum):
    OPEN = "open"
    COMMITTED = "committed"
    DISCARDED = "discarded"


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkspaceDiff:
    """What changed between the base and the current view.

    Paths are relative, with ``/`` separators; a directory that exists on one side
    only is listed with a trailing ``/`` (its files are listed too). ``binary`` names
    every added, removed or modified file whose content is binary (a NUL byte in the
    first 8 KiB, or not UTF-8): such files have no hunk in ``unified``. A rename is a
    removed and an added file with identical content (sha256); it has no hunk.

    ``links_out`` names each symlink the change adds or alters that leads out of the
    workspace, with its target (kept in the diff: see
    :mod:`gatewayd.workspace.commit_rules`). ``left_out`` names, with the reason, the paths
    a commit of this session leaves out of the base (filled by the session store; the
    backends' own diff has none).
    """

    unified: str
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    modified: list[str] = field(default_factory=list)
    renamed: list[tuple[str, str]] = field(default_factory=list)
    binary: list[str] = field(default_factory=list)
    links_out: list[tuple[str, str]] = field(default_factory=list)
    left_out: list[tuple[str, str]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.added or self.removed or self.modified or self.renamed)


# A directory opened for walking a tree the sandbox may have written: never through a link.
DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_dirs(start: Path | int, parts: Sequence[str], *, create: bool = False) -> int:
    """A descriptor of ``start/parts...``, opened one component at a time with O_NOFOLLOW:
    OSError (ELOOP, ENOTDIR) when a component is a symlink or not a directory, so gatewayd
    never walks through a link a sandbox planted (``dir -> /etc``). ``start`` is a path or
    a directory descriptor (left open). ``create`` makes missing components (0755)."""
    fd = os.open(start, DIR_FLAGS) if isinstance(start, Path) else os.dup(start)
    try:
        for part in parts:
            try:
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(part, 0o755, dir_fd=fd)
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_all(fd: int) -> bytes:
    """Everything left in the open file ``fd`` (workspace files: no size cap here)."""
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def split_relative(rel: str) -> tuple[str, ...]:
    """The components of the relative path ``rel``; absolute paths and ``..`` refused."""
    if "\0" in rel:
        raise InvalidArguments(f"'{shown(rel)}' contains a NUL byte")
    if rel.startswith("/"):
        raise PolicyViolation(
            f"'{shown(rel)}' is absolute; workspace paths are relative to the workspace root"
        )
    parts = tuple(p for p in rel.split("/") if p not in ("", "."))
    if ".." in parts:
        raise PolicyViolation(
            f"'{shown(rel)}' contains '..'; workspace paths may not leave the workspace"
        )
    return parts


def make_state_dir(state_dir: Path) -> Path:
    """Create ``state_dir`` (private, empty); refuse one that holds anything."""
    state_dir.mkdir(mode=STATE_DIR_MODE, parents=True, exist_ok=True)
    os.chmod(state_dir, STATE_DIR_MODE)
    if any(state_dir.iterdir()):
        raise WorkspaceError(f"state directory {state_dir} is not empty")
    return state_dir


class WorkspaceSession(abc.ABC):
    """One workspace session over a base directory.

    ``root`` is the directory the sandbox binds: the base itself (host backend) or
    the merged overlay mount (overlay backend). A session is open until commit(),
    discard() or close(); close() discards anything not committed, unless the session
    was sealed (seal(): the run is over and its delta is kept for later).

    Resource handling: use as a context manager or call close(); close() is
    idempotent and releases mounts and private state.

    Error handling: path problems raise :class:`PolicyViolation` (escapes) or
    :class:`InvalidArguments`; I/O problems :class:`ToolFailed`; using a finished
    session raises :class:`WorkspaceError`.
    """

    root: Path
    base: Path

    def __init__(self) -> None:
        self._state = SessionState.OPEN
        self._grant: PathGrant | None = None
        # Sealed: the run is over, the delta is kept for diff/commit/discard (see seal()).
        self._sealed = False

    # --- lifecycle ----------------------------------------------------------

    def __enter__(self) -> WorkspaceSession:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def is_open(self) -> bool:
        return self._state is SessionState.OPEN

    def _require_open(self) -> None:
        if self._state is not SessionState.OPEN:
            raise WorkspaceError(f"the workspace session is already {self._state.value}")

    def _pin_root(self) -> None:
        st = os.stat(self.root, follow_symlinks=False)
        self._grant = PathGrant(
            name="workspace",
            host_root=self.root,
            root_id=(st.st_dev, st.st_ino),
            holds_nested=False,
            visible_root=VISIBLE_ROOT,
            mode=PathMode.RW,
        )

    def _target(self, rel: str, access: str) -> ResolvedPath:
        self._require_open()
        if self._grant is None:
            raise WorkspaceError("the workspace session has no root")
        parts = split_relative(rel)
        visible = str(PurePosixPath(VISIBLE_ROOT, *parts))
        return ResolvedPath(
            grant=self._grant,
            parts=parts,
            visible=visible,
            access="write" if access == "write" else "read",
        )

    # Whether the sandbox writes the base itself (host): then only the backend's own
    # copy can undo a run, and a session whose state is lost cannot be discarded.
    writes_base: ClassVar[bool] = False

    @classmethod
    def recover_state(cls, base: Path, state_dir: Path) -> str | None:
        """Finish what a crash interrupted in ``state_dir`` (a commit's journal, a
        discard's marker): "committed" or "discarded" when that ended the session, None
        when nothing was pending. The default: nothing is ever pending."""
        return None

    def seal(self) -> None:
        """The run's sandbox is gone: stop serving :attr:`root` to it, keep the delta.

        After seal, diff, commit and discard still work (from this process, or from
        another one through the backend's ``reopen``); close() keeps the delta instead
        of discarding it. The default (a backend with nothing mounted): nothing to do.
        """
        self._require_open()
        self._sealed = True

    @property
    def is_sealed(self) -> bool:
        return self._sealed

    def sync(self) -> None:
        """Bring the session's record of the delta up to date with :attr:`root` (a
        backend whose view is a copy of its store); the default has nothing to sync
        beyond checking the session is still open."""
        self._require_open()

    def committed_bytes(self) -> int | None:
        """The bytes commit would write into the base: every file it copies, at its full
        size (a sparse file costs little where the delta is held and all of its size once
        copied). The session store checks it against the delta limit at seal. None: the
        backend bounds what its commit writes itself (the default)."""
        return None

    def touched(self) -> list[str]:
        """The relative paths of the base the delta would change at commit: what the
        commit's conflict check compares. The default: every path the diff names (a
        directory without its trailing ``/``); backends that know their delta's
        operations say more precisely (a mode change, a directory merged into)."""
        diff = self.diff()
        paths = [*diff.added, *diff.removed, *diff.modified]
        paths += [name for pair in diff.renamed for name in pair]
        return sorted({path.rstrip("/") for path in paths})

    @abc.abstractmethod
    def diff(self) -> WorkspaceDiff:
        """What the session changed, relative to the base as it was at create time."""

    @abc.abstractmethod
    def commit(self, *, leave_out: frozenset[str] = frozenset(), keep_marker: bool = False) -> None:
        """Make the base equal the session's view; the session ends. ``leave_out``: paths
        (as :meth:`touched` names them) the commit must not write; a backend that cannot
        leave anything out (the sandbox wrote the base itself) refuses a non-empty one.
        ``keep_marker``: a journaled commit leaves its applied marker
        (:mod:`gatewayd.workspace.commit_marker`) for the caller to remove (the session
        store, with the session); a backend with no journal ignores it."""

    @abc.abstractmethod
    def discard(self) -> None:
        """Leave the base exactly as it was at create time; the session ends."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything the session holds; discards uncommitted changes."""

    # --- file operations ----------------------------------------------------

    def read(self, rel: str) -> bytes:
        """The bytes of the regular file ``rel``."""
        target = self._target(rel, "read")
        with BeneathRoot(target) as beneath:
            fd = beneath.open_file(os.O_RDONLY, follow_final=True)
            try:
                require_single_link_regular(fd, target.visible)
                return read_all(fd)
            finally:
                os.close(fd)

    def write(self, rel: str, data: bytes) -> None:
        """Make ``rel`` a regular file holding ``data``; missing parents are created.

        Never follows a symlink (any component); refuses a file with several links.
        """
        target = self._target(rel, "write")
        with BeneathRoot(target) as beneath:
            parent, name = beneath.open_parent(create=True)
            try:
                fd = beneath.open_name(parent, name, os.O_WRONLY | os.O_CREAT, NEW_FILE_MODE)
            finally:
                os.close(parent)
            try:
                # Checked before truncating: a hard link must not be emptied either.
                require_single_link_regular(fd, target.visible)
                os.ftruncate(fd, 0)
                write_all(fd, data)
            except OSError as exc:
                raise translate_oserror(exc, target.visible) from None
            finally:
                os.close(fd)

    def list(self, rel: str = ".") -> list[str]:
        """The sorted names in directory ``rel``."""
        target = self._target(rel, "read")
        with BeneathRoot(target) as beneath:
            fd = beneath.open_file(os.O_RDONLY | os.O_DIRECTORY, follow_final=True)
            try:
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    raise ToolFailed(f"'{shown(target.visible)}' is not a directory")
                return sorted(os.listdir(fd))
            except OSError as exc:
                raise translate_oserror(exc, target.visible) from None
            finally:
                os.close(fd)
