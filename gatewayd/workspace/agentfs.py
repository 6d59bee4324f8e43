"""The ``agentfs`` backend: the session's delta kept in an AgentFS database.

AgentFS (``agentfs-sdk`` on PyPI, Turso's SQLite-backed agent file system) stores files,
directories and their modes in its own tables (``fs_inode``, ``fs_dentry``, ``fs_data``,
``fs_symlink``). Here one AgentFS database per session (``state_dir/delta.db``) holds the
session's *delta* over the base, in the shape AgentFS's own overlay file system uses: the
entries the session added or changed in the file tables, and the base paths it removed
in ``fs_whiteout`` (``fs_overlay_config`` names the base). Diff and commit read that
database, never the sandbox's directory.

The view. The Python SDK (0.6.4) has no FUSE mount (the Rust CLI has one; the SDK does
not), so the sandbox cannot bind the database itself. It binds a *materialised view*:
``state_dir/view``, a copy of the base made at create with ``cp -a --reflink=auto`` (as
the host backend's snapshot: near free on btrfs/XFS, a plain copy elsewhere). The view
is brought into the database by :meth:`AgentFSWorkspace.sync`:

* when: after every command the sandbox runs (the run's lifecycle calls ``sync()``),
  after every :meth:`~AgentFSWorkspace.write` (that one path only), and before every
  diff, commit and seal (the whole view). Between two syncs the database lags the view.
* how: every entry of the view is ``lstat``-ed (no symlink followed, descriptor-based
  walk) and compared with the record of the last sync (kind, mode, size, mtime, inode).
  Only entries whose record changed are read and written to the database, so a sync
  that finds nothing costs one ``lstat`` per entry and no database write. An entry whose
  mtime lies within :data:`RACY_WINDOW_NS` of the sync is re-read at the next sync, since
  a second write in the same clock tick could leave its record unchanged (git's "racy
  clean" problem, solved the same way). The ctime is not compared: lending the view to
  the run's uid and giving it back chowns every entry, which changes every ctime. So a
  file rewritten in place to its old size with its old mtime set back (``touch -d``) is
  not seen as changed: only the sandbox can do that, only to its own change, and that
  change is then not committed (the base keeps what it had).
* what: a changed or new regular file's bytes and mode; a directory's mode; a symlink's
  target; every base path no longer in the view as a whiteout (only the topmost: a
  removed directory's children are covered by its whiteout). FIFOs, sockets and device
  nodes are not workspace content and never reach the database (as with overlay). A
  file with several hard links is stored once per name (the links are not kept, as
  overlayfs's copy-up does not keep them either).

What the SDK cannot do, and what is done instead (never dropping data):

* modes: ``write_file`` and ``mkdir`` always create 0644 files and 0755 directories,
  and there is no chmod. The mode is set in the SDK's own ``fs_inode.mode`` column
  through the SDK's connection, as AgentFS's Rust implementation stores it.
* symlinks: the SDK has no symlink creation (its ``rm``/``rename`` refuse symlinks with
  ENOSYS). A symlink is stored as AgentFS's schema defines one (an ``S_IFLNK`` inode, its
  directory entry and an ``fs_symlink`` row), written and removed through the same
  connection.
* names: AgentFS paths are text; a name or symlink target that is not valid UTF-8 cannot
  be stored, and the sync refuses with the path (nothing is dropped silently: the view
  keeps it, and the session cannot be committed until it is renamed).
* memory: ``write_file`` takes a file's whole content, so a sync holds one changed file
  in memory at a time (the sandbox's file size limit, 1 GiB by default, bounds it).
* durability: the SDK commits after every statement; with SQLite's default FULL sync
  that cost ~10 ms per file measured here, so the connection runs with
  ``synchronous=OFF`` (~4 ms) and :meth:`seal` makes the database durable once
  (checkpoint, fsync) before the view is removed.

The SDK is asyncio (over pyturso, whose connection runs its blocking driver in a worker
thread bound to the event loop that opened it); gatewayd is trio. Each session runs a
private asyncio loop in a thread of its own (:class:`_SdkLoop`), and every public method
submits its coroutines there and waits: the methods are blocking, like the other
backends' (copies, mounts), and the daemon calls them from a worker thread, never on the
trio loop. One loop per session, not ``asyncio.run`` per call, because the connection is
bound to the loop it was opened on (opening costs ~50 ms and re-initialises the schema).

Delta limit (``max_delta_bytes``): checked at every sync against the bytes of the files
and symlink targets the delta holds (sizes as the view's files have them when scanned),
and, always, :data:`MAX_DELTA_ENTRIES` against the entries it holds.
A sync past the limit is refused with ``limit_exceeded`` and records nothing: the
database keeps the last delta within the limit, the view keeps the sandbox's files, and
diff and commit refuse until files are removed (seal keeps the view: below).
``write()`` refuses a write that would pass it before writing. The sandbox's own writes
to the view are not bounded as they happen (the view is an ordinary directory on the
state directory's file system): only by the sandbox's file size limit and the host's
disk; the limit decides what can be committed.

Seal: a final sync, the database made durable, then the view is removed (the database
holds the whole delta; the view was a full copy of the base). A seal whose sync fails
(the limit, a name that is not UTF-8) keeps the view, so nothing is lost, and every later
commit says why; diff shows what the database holds, and discard still works.

Commit is a journal replayed forward, as the overlay backend's: the delta is exported
from the database into ``state_dir/upper`` (each entry fsync'ed), the operations are written durably
to ``commit.journal``, then applied to the base with the overlay backend's
:func:`~gatewayd.workspace.overlay.apply_operation` (each file replaced atomically); then
``commit.applied`` is written durably (:mod:`gatewayd.workspace.commit_marker`), the
journal removed, then everything else but the marker, which stays until the state
directory is removed or reused. :func:`recover_commit` (which
:meth:`AgentFSWorkspace.create` and :meth:`AgentFSWorkspace.reopen` call) replays an
interrupted one, or, with the marker, only tidies up (nothing is applied twice). Paths
the session store leaves out (``leave_out``) never enter the journal.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, TypeVar, cast

from agentfs_sdk import AgentFS, ErrnoException
from turso.aio import connect

from gatewayd.errors import LimitExceeded
from gatewayd.files import fsync_dir, write_atomically
from gatewayd.policy.paths import shown
from gatewayd.workspace.commit_marker import APPLIED_NAME, is_applied
from gatewayd.workspace.host import copy_tree_contents
from gatewayd.workspace.journal import (
    JOURNAL_NAME,
    apply_journal,
    commit_interrupted,
    finish_applied,
    journal_operations,
    load_journal,
    prepare_create,
)
from gatewayd.workspace.overlay import apply_operation, lstat_mode
from gatewayd.workspace.session import (
    DIR_FLAGS,
    SessionState,
    WorkspaceDiff,
    WorkspaceError,
    WorkspaceSession,
    make_state_dir,
    open_dirs,
    read_all,
    split_relative,
)
from gatewayd.workspace.treediff import compare_trees, walk_below

T = TypeVar("T")

DB_NAME: Final = "delta.db"
VIEW_NAME: Final = "view"
# The delta exported from the database for a commit: what the journal replays from.
UPPER_NAME: Final = "upper"
# Temporary exports for diff live beside the database (same file system, private).
EXPORT_PREFIX: Final = "export-"
# Twice the coarsest kernel timer tick (HZ=100): file times come from a clock that only
# moves once per tick, so an entry whose mtime is this close to a sync may change again
# without its record changing; it is re-read at the next sync.
RACY_WINDOW_NS: Final = 20_000_000
# Entries (files, directories, symlinks, whiteouts) a delta may hold, whatever its byte
# limit: the SDK writes about 250 entries a second here, so a sandbox that floods the view
# with empty files would otherwise hold a daemon worker thread for minutes per sync.
MAX_DELTA_ENTRIES: Final = 100_000
# Setuid, setgid and sticky bits never travel from the sandbox to the host (as overlay).
COMMIT_MODE_MASK: Final = 0o777
# Where the delta's limit is kept for a reopened session (the SDK's key-value store).
LIMIT_KEY: Final = "gatewayd.max_delta_bytes"
# gatewayd's record of the view at the last sync (the SDK has no place for it).
VIEW_TABLE: Final = "gatewayd_view"
ROOT_INO: Final = 1

Kind = Literal["file", "link", "dir"]
# What a sync compares: kind, st_mode, size, mtime_ns (-1: read again), inode.
Seen = tuple[Kind, int, int, int, int]

_SCHEMA: Final = f"""
CREATE TABLE IF NOT EXISTS fs_whiteout (
    path TEXT PRIMARY KEY,
    parent_path TEXT NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS idx_fs_whiteout_parent ON fs_whiteout(parent_path);
CREATE TABLE IF NOT EXISTS fs_overlay_config (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS {VIEW_TABLE} (
    path BLOB PRIMARY KEY,
    in_base INTEGER NOT NULL,
    dirty INTEGER NOT NULL,
    kind TEXT,
    mode INTEGER,
    size INTEGER,
    mtime_ns INTEGER,
    ino INTEGER,
    digest BLOB
);
"""


def _kind_of(mode: int) -> Kind | None:
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "link"
    if stat.S_ISREG(mode):
        return "file"
    return None  # FIFOs, sockets, devices: not workspace content


def _seen(st: os.stat_result) -> Seen | None:
    kind = _kind_of(st.st_mode)
    if kind is None:
        return None
    return (kind, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino)


def _components(rel: str) -> list[str]:
    return rel.split("/")


def _parent(rel: str) -> str:
    return rel.rpartition("/")[0]


def _ancestors(rel: str) -> Iterable[str]:
    parent = _parent(rel)
    while parent:
        yield parent
        parent = _parent(parent)


def _text(rel: str) -> str:
    """``rel`` as AgentFS can store it; a name that is not UTF-8 is refused."""
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        raise WorkspaceError(
            f"'{shown('/workspace/' + rel)}' is not valid UTF-8; AgentFS stores names and "
            "symlink targets as text: rename it (nothing else of the session was lost)"
        ) from None
    return rel


@dataclass(slots=True)
class _Row:
    """What gatewayd knows of one view path: in the base at create, the view's entry at
    the last sync (None: gone), whether it ever changed (then it is in the delta), and
    the sha256 of the content or target the delta holds for it (a file read again with
    the same content is not written again)."""

    in_base: bool
    seen: Seen | None
    dirty: bool
    digest: bytes | None = None


def _scan(view: Path, scope: str) -> dict[str, Seen]:
    """Every entry at and below ``view/scope`` and the ancestors of ``scope``, without
    following a symlink; an entry that vanishes or turns into a link while we walk is
    left out (the next sync sees it as it then is)."""
    found: dict[str, Seen] = {}
    parts = _components(scope) if scope else []
    fd = os.open(view, DIR_FLAGS)
    try:
        for index, part in enumerate(parts):
            try:
                st = os.stat(part, dir_fd=fd, follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                return found
            seen = _seen(st)
            if seen is None:
                return found
            found["/".join(parts[: index + 1])] = seen
            if seen[0] != "dir":
                return found
            try:
                child = os.open(part, DIR_FLAGS, dir_fd=fd)
            except OSError:
                return found
            os.close(fd)
            fd = child
        for rel, st in walk_below(fd, scope):
            seen = _seen(st)
            if seen is not None:
                found[rel] = seen
    finally:
        os.close(fd)
    return found


def _read_entry(view: Path, rel: str, kind: str) -> bytes:
    """A view file's bytes or a symlink's target, opened beneath ``view`` with no symlink
    followed on the way; OSError when it changed kind since the scan."""
    *dirs, name = _components(rel)
    parent = open_dirs(view, dirs)
    try:
        if kind == "link":
            return os.fsencode(os.readlink(name, dir_fd=parent))
        fd = os.open(
            name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent
        )
    finally:
        os.close(parent)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{rel} is no longer a regular file")
        return read_all(fd)
    finally:
        os.close(fd)


class _SdkLoop:
    """A private asyncio event loop in a thread: the SDK's coroutines run there."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="agentfs-sdk", daemon=True
        )
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


class _Delta:
    """The session's AgentFS database: the SDK for files and directories, its
    connection for what the SDK lacks (modes, symlinks, whiteouts, gatewayd's record)."""

    def __init__(self, loop: _SdkLoop, agent: Any) -> None:
        self._loop = loop
        self._agent = agent
        self._db: Any = agent.get_database()
        self.fs: Any = agent.fs

    @classmethod
    def open(cls, path: Path) -> _Delta:
        loop = _SdkLoop()
        try:
            agent = loop.run(cls._open(path))
        except BaseException:
            loop.close()
            raise
        return cls(loop, agent)

    @staticmethod
    async def _open(path: Path) -> Any:
        db = await connect(str(path))
        # See the module docstring (durability): made durable once, at seal.
        await db.execute("PRAGMA synchronous = OFF")
        agent = await AgentFS.open_with(db)
        await db.executescript(_SCHEMA)
        await db.commit()
        return agent

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.run(coro)

    def close(self) -> None:
        try:
            self.run(self._agent.close())
        finally:
            self._loop.close()

    # --- reading the record and the delta ------------------------------------------

    async def config(self) -> tuple[str | None, int | None]:
        cursor = await self._db.execute(
            "SELECT value FROM fs_overlay_config WHERE key = 'base_path'"
        )
        row = await cursor.fetchone()
        limit = await self._agent.kv.get(LIMIT_KEY)
        return (str(row[0]) if row else None, int(limit) if limit is not None else None)

    async def set_config(self, base: Path, limit: int | None) -> None:
        await self._db.execute(
            "INSERT OR REPLACE INTO fs_overlay_config (key, value) VALUES ('base_path', ?)",
            (str(base),),
        )
        await self._db.commit()
        await self._agent.kv.set(LIMIT_KEY, limit)

    async def rows(self) -> dict[str, _Row]:
        cursor = await self._db.execute(
            f"SELECT path, in_base, dirty, kind, mode, size, mtime_ns, ino, digest "  # noqa: S608
            f"FROM {VIEW_TABLE}"
        )
        rows: dict[str, _Row] = {}
        for path, in_base, dirty, kind, mode, size, mtime, ino, digest in await cursor.fetchall():
            seen: Seen | None = None
            if kind is not None:
                seen = (cast(Kind, str(kind)), mode, size, mtime, ino)
            rows[os.fsdecode(bytes(path))] = _Row(
                bool(in_base), seen, bool(dirty), None if digest is None else bytes(digest)
            )
        return rows

    async def save_rows(self, rows: dict[str, _Row | None]) -> None:
        removed = [(os.fsencode(path),) for path, row in rows.items() if row is None]
        kept = [
            (
                os.fsencode(path),
                int(row.in_base),
                int(row.dirty),
                *(row.seen or (None,) * 5),
                row.digest,
            )
            for path, row in rows.items()
            if row is not None
        ]
        if removed:
            await self._db.executemany(
                f"DELETE FROM {VIEW_TABLE} WHERE path = ?",  # noqa: S608
                removed,
            )
        if kept:
            await self._db.executemany(
                f"INSERT OR REPLACE INTO {VIEW_TABLE} "  # noqa: S608
                "(path, in_base, dirty, kind, mode, size, mtime_ns, ino, digest) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                kept,
            )
        await self._db.commit()

    async def entries(self) -> dict[str, tuple[Kind, int, int]]:
        """Every entry of the delta's file tree: path -> (kind, mode, size)."""
        cursor = await self._db.execute(
            "SELECT d.parent_ino, d.name, d.ino, i.mode, i.size "
            "FROM fs_dentry d JOIN fs_inode i ON i.ino = d.ino"
        )
        children: dict[int, list[tuple[str, int, int, int]]] = {}
        for parent, name, ino, mode, size in await cursor.fetchall():
            children.setdefault(int(parent), []).append((str(name), int(ino), int(mode), size))
        found: dict[str, tuple[Kind, int, int]] = {}
        pending = [(ROOT_INO, "")]
        while pending:
            ino, prefix = pending.pop()
            for name, child, mode, size in children.get(ino, []):
                rel = f"{prefix}/{name}" if prefix else name
                kind = _kind_of(mode)
                if kind is None:
                    continue
                found[rel] = (kind, mode, int(size))
                if kind == "dir":
                    pending.append((child, rel))
        return found

    async def whiteouts(self) -> set[str]:
        cursor = await self._db.execute("SELECT path FROM fs_whiteout")
        return {str(row[0]).lstrip("/") for row in await cursor.fetchall()}

    async def read(self, rel: str, kind: Kind) -> bytes:
        if kind == "link":
            ino = (await self.fs.stat("/" + rel)).ino
            cursor = await self._db.execute("SELECT target FROM fs_symlink WHERE ino = ?", (ino,))
            row = await cursor.fetchone()
            return os.fsencode(str(row[0]))
        return bytes(await self.fs.read_file("/" + rel, encoding=None))

    # --- changing the delta ----------------------------------------------------------

    async def _set_mode(self, rel: str, mode: int) -> None:
        ino = (await self.fs.stat("/" + rel)).ino
        await self._db.execute("UPDATE fs_inode SET mode = ? WHERE ino = ?", (mode, ino))
        await self._db.commit()

    async def put(self, rel: str, kind: Kind, mode: int, data: bytes) -> None:
        """Make ``rel`` (whose parent is already there) a ``kind`` entry holding ``data``."""
        path = "/" + rel
        if kind == "dir":
            with contextlib.suppress(ErrnoException):  # EEXIST: only its mode changes
                await self.fs.mkdir(path)
        elif kind == "file":
            await self.fs.write_file(path, data)
        else:
            await self._symlink(rel, os.fsdecode(data))
        await self._set_mode(rel, mode)

    async def _symlink(self, rel: str, target: str) -> None:
        """A symlink as AgentFS's schema holds one (the Python SDK cannot make one)."""
        parent = (await self.fs.stat("/" + _parent(rel))).ino
        now = int(time.time())
        cursor = self._db.cursor()
        try:
            await cursor.execute(
                "INSERT INTO fs_inode (mode, nlink, uid, gid, size, atime, mtime, ctime) "
                "VALUES (?, 1, 0, 0, ?, ?, ?, ?) RETURNING ino",
                (stat.S_IFLNK | 0o777, len(os.fsencode(target)), now, now, now),
            )
            row = await cursor.fetchone()
        finally:
            await cursor.close()
        ino = int(row[0])
        await self._db.execute(
            "INSERT INTO fs_dentry (name, parent_ino, ino) VALUES (?, ?, ?)",
            (rel.rpartition("/")[2], parent, ino),
        )
        await self._db.execute("INSERT INTO fs_symlink (ino, target) VALUES (?, ?)", (ino, target))
        await self._db.commit()

    async def remove(self, rel: str, kind: Kind) -> None:
        """Remove ``rel`` (a directory is empty by then: removals go deepest first)."""
        if kind == "dir":
            await self.fs.rmdir("/" + rel)
        elif kind == "file":
            await self.fs.unlink("/" + rel)
        else:
            ino = (await self.fs.stat("/" + rel)).ino
            parent = (await self.fs.stat("/" + _parent(rel))).ino
            await self._db.execute(
                "DELETE FROM fs_dentry WHERE parent_ino = ? AND name = ?",
                (parent, rel.rpartition("/")[2]),
            )
            for table in ("fs_symlink", "fs_inode"):
                await self._db.execute(f"DELETE FROM {table} WHERE ino = ?", (ino,))  # noqa: S608
            await self._db.commit()

    async def set_whiteouts(self, add: Iterable[str], drop: Iterable[str]) -> None:
        now = int(time.time())
        for rel in drop:
            await self._db.execute("DELETE FROM fs_whiteout WHERE path = ?", ("/" + rel,))
        for rel in add:
            await self._db.execute(
                "INSERT OR REPLACE INTO fs_whiteout (path, parent_path, created_at) "
                "VALUES (?, ?, ?)",
                ("/" + rel, "/" + _parent(rel), now),
            )
        await self._db.commit()

    async def make_durable(self) -> None:
        """Fold the write-ahead log into the database file (then fsync'ed by the caller)."""
        await self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        await self._db.commit()


# --- commit: a journal replayed forward ------------------------------------------------


def _apply(base_fd: int, upper: Path, op: str, rel: str) -> None:
    """One journal operation (idempotent): the overlay backend's, plus the mode of a
    directory merged into (AgentFS records a directory's mode change; overlay's commit
    does not carry it)."""
    apply_operation(base_fd, upper, op, rel)
    if op != "dir":
        return
    *dirs, name = _components(rel)
    parent = open_dirs(base_fd, dirs)
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent)
    finally:
        os.close(parent)
    try:
        os.fchmod(fd, os.lstat(upper / rel).st_mode & COMMIT_MODE_MASK)
    finally:
        os.close(fd)


def _clear_state(state_dir: Path, *, keep_marker: bool = False) -> None:
    """Remove everything the session kept (view, database, exports) from ``state_dir``;
    ``keep_marker``: all but a commit's applied marker (it outlives the delta)."""
    for entry in os.listdir(state_dir):
        if keep_marker and entry == APPLIED_NAME:
            continue
        path = state_dir / entry
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def _replay(state_dir: Path, journal: dict[str, object], *, keep_marker: bool) -> None:
    base = Path(str(journal["base"]))
    ops = journal_operations(state_dir, journal)
    upper = state_dir / UPPER_NAME
    if not upper.is_dir():
        raise WorkspaceError(
            f"the commit journal in {state_dir} cannot be replayed: the exported delta "
            f"{upper} is gone; {base} holds part of the commit, each file whole; the "
            f"database {state_dir / DB_NAME} still holds the delta"
        )
    apply_journal(
        state_dir,
        base,
        ops,
        upper,
        apply=_apply,
        remove_delta=_remove_delta,
        keep_marker=keep_marker,
    )


def _remove_delta(state_dir: Path) -> None:
    """All the session kept but a commit's applied marker (it outlives the delta)."""
    _clear_state(state_dir, keep_marker=True)


def recover_commit(state_dir: Path, *, keep_marker: bool = False) -> bool:
    """Finish a commit a crash interrupted in ``state_dir``; True if there was one (the
    session is then gone: its delta is in the base). With the applied marker nothing is
    applied again: the journal and the delta are dropped. ``keep_marker``: leave the
    marker for the session store, which removes it with the session."""
    if is_applied(state_dir):
        finish_applied(Path(state_dir), remove_delta=_remove_delta, keep_marker=keep_marker)
        return True
    if not commit_interrupted(state_dir):
        return False
    _replay(Path(state_dir), load_journal(state_dir), keep_marker=keep_marker)
    return True


class AgentFSWorkspace(WorkspaceSession):
    """A copy of ``base`` the sandbox binds (:attr:`root`), its delta in AgentFS."""

    def __init__(self, base: Path, state_dir: Path, *, max_delta_bytes: int | None = None) -> None:
        super().__init__()
        self.base = base
        self.state_dir = state_dir
        self.max_delta_bytes = max_delta_bytes
        self.root = state_dir / VIEW_NAME
        self.database = state_dir / DB_NAME
        self._delta: _Delta | None = None
        self._rows: dict[str, _Row] = {}
        # The delta as the database holds it: its entries (kind, mode, size) and whiteouts.
        self._entries: dict[str, tuple[Kind, int, int]] = {}
        self._whiteouts: set[str] = set()
        # Why the last sync of a sealed session failed (its view is kept); None: fine.
        self._unsettled: str | None = None
        # One operation at a time: the daemon may write and sync from two worker threads.
        self._lock = threading.RLock()

    # --- opening ---------------------------------------------------------------------

    @classmethod
    def create(
        cls, base: Path, state_dir: Path, *, max_delta_bytes: int | None = None
    ) -> AgentFSWorkspace:
        """Copy ``base`` into a view under ``state_dir`` and open an empty delta.

        A commit a crash interrupted in ``state_dir`` is finished first
        (:func:`recover_commit`); then ``state_dir`` must hold nothing else.
        """
        base, state_dir = prepare_create(base, state_dir, max_delta_bytes, recover_commit)
        session = cls(base, make_state_dir(state_dir), max_delta_bytes=max_delta_bytes)
        try:
            session.root.mkdir(mode=0o700)
            copy_tree_contents(base, session.root)
            session._delta = _Delta.open(session.database)
            session._delta.run(session._delta.set_config(base, max_delta_bytes))
            session._rows = {
                rel: _Row(in_base=True, seen=seen, dirty=False)
                for rel, seen in _scan(session.root, "").items()
            }
            session._delta.run(session._delta.save_rows(dict(session._rows)))
        except BaseException:
            session._release()
            _clear_state(state_dir)
            raise
        session._pin_root()
        return session

    @classmethod
    def recover_state(cls, base: Path, state_dir: Path) -> str | None:
        """A commit a crash interrupted is finished from its journal (the applied marker
        is left for the store, which removes it with the session)."""
        return "committed" if recover_commit(state_dir, keep_marker=True) else None

    @classmethod
    def reopen(cls, base: Path, state_dir: Path) -> AgentFSWorkspace:
        """The sealed session a run left in ``state_dir``, for diff, commit or discard from
        another process. A view still there (gatewayd died before seal) is sealed now:
        synced, so nothing the sandbox wrote is lost, then removed.

        Error handling: :class:`WorkspaceError` when the session is gone (an interrupted
        commit is finished, then says so), has no database, or is of another base.
        """
        base = Path(os.path.realpath(base))
        state_dir = Path(os.path.realpath(state_dir))
        if recover_commit(state_dir):
            raise WorkspaceError(
                f"the session in {state_dir} was being committed; the commit is finished"
            )
        if not (state_dir / DB_NAME).is_file():
            raise WorkspaceError(f"the session in {state_dir} has no AgentFS database")
        session = cls(base, state_dir)
        session._delta = _Delta.open(session.database)
        try:
            recorded, session.max_delta_bytes = session._delta.run(session._delta.config())
            if recorded != str(base):
                raise WorkspaceError(
                    f"the session in {state_dir} is a delta over {recorded}, not over {base}"
                )
            session._load()
            session._seal_view()
        except BaseException:
            session._release()
            raise
        session._sealed = True
        return session

    def _load(self) -> None:
        delta = self._require_delta()
        self._rows = delta.run(delta.rows())
        self._entries = delta.run(delta.entries())
        self._whiteouts = delta.run(delta.whiteouts())

    def _require_delta(self) -> _Delta:
        if self._delta is None:
            raise WorkspaceError(f"the AgentFS database of {self.state_dir} is closed")
        return self._delta

    def _release(self) -> None:
        if self._delta is not None:
            delta, self._delta = self._delta, None
            delta.close()

    # --- sync: the view into the database ----------------------------------------------

    @property
    def delta_bytes(self) -> int:
        """Bytes of file content and symlink targets the delta holds."""
        return sum(size for kind, _mode, size in self._entries.values() if kind != "dir")

    def sync(self) -> None:
        """Bring the database up to date with the view (see the module docstring)."""
        with self._lock:
            self._require_open()
            if self.root.is_dir():
                self._sync("", frozenset())

    def _sync(self, scope: str, force: frozenset[str]) -> None:
        started = time.time_ns()
        now = _scan(self.root, scope)
        candidates = set(now)
        candidates.update(_ancestors(scope + "/x") if scope else ())
        if scope:
            candidates.update(p for p in self._rows if p == scope or p.startswith(scope + "/"))
        else:
            candidates.update(self._rows)
        changes: dict[str, _Row | None] = {}
        for rel in candidates:
            row = self._rows.get(rel)
            current = now.get(rel)
            if rel not in force and (row.seen if row is not None else None) == current:
                continue
            if current is None:
                changes[rel] = _Row(True, None, dirty=False) if row and row.in_base else None
            else:
                changes[rel] = _Row(
                    row.in_base if row else False, current, True, row.digest if row else None
                )
        if not changes:
            return
        rows = dict(self._rows)
        for rel, change in changes.items():
            if change is None:
                rows.pop(rel, None)
            else:
                rows[rel] = change
        wanted, whiteouts = self._desired(rows)
        size = sum(seen[2] for seen in wanted.values() if seen[0] != "dir")
        if self.max_delta_bytes is not None and size > self.max_delta_bytes:
            raise LimitExceeded(
                f"the workspace's changes hold {size} bytes, past the session's delta "
                f"limit of {self.max_delta_bytes} bytes; nothing since the last sync is "
                "recorded: remove files to come back under it"
            )
        if len(wanted) + len(whiteouts) > MAX_DELTA_ENTRIES:
            raise LimitExceeded(
                f"the workspace's changes touch {len(wanted) + len(whiteouts)} entries, past "
                f"the agentfs backend's limit of {MAX_DELTA_ENTRIES}; nothing since the last "
                "sync is recorded: remove files (or use the overlay workspace mode)"
            )
        for rel in wanted:
            _text(rel)
        raced, digests = self._apply(
            wanted, whiteouts, {rel for rel, c in changes.items() if c}, rows
        )
        for rel, digest in digests.items():
            changes[rel] = dataclasses.replace(rows[rel], digest=digest)
        delta = self._require_delta()
        for rel, row in changes.items():
            if row is None or row.seen is None:
                continue
            if rel in raced or row.seen[3] >= started - RACY_WINDOW_NS:
                # Too close to the clock tick, or changed while read: read again at the
                # next sync (module docstring).
                kind, mode, size, _mtime, ino = row.seen
                changes[rel] = dataclasses.replace(row, seen=(kind, mode, size, -1, ino))
        delta.run(delta.save_rows(changes))
        for rel, change in changes.items():
            if change is None:
                self._rows.pop(rel, None)
            else:
                self._rows[rel] = change

    @staticmethod
    def _desired(rows: dict[str, _Row]) -> tuple[dict[str, Seen], set[str]]:
        """The delta the rows call for: every entry that changed (with its ancestors, as
        directories merged into), and a whiteout for each base path gone from the view
        whose parent is still a directory there (the topmost one removed)."""
        wanted: dict[str, Seen] = {}
        for rel, row in rows.items():
            if row.seen is None or not row.dirty:
                continue
            wanted[rel] = row.seen
            for ancestor in _ancestors(rel):
                if ancestor in wanted:
                    break
                above = rows.get(ancestor)
                if above is not None and above.seen is not None:
                    wanted[ancestor] = above.seen
        whiteouts = set()
        for rel, row in rows.items():
            if not row.in_base or row.seen is not None:
                continue
            parent = _parent(rel)
            above = rows.get(parent)
            if not parent or (above is not None and above.seen and above.seen[0] == "dir"):
                whiteouts.add(rel)
        return wanted, whiteouts

    def _apply(
        self,
        wanted: dict[str, Seen],
        whiteouts: set[str],
        changed: set[str],
        rows: dict[str, _Row],
    ) -> tuple[set[str], dict[str, bytes]]:
        """Make the database's delta ``wanted`` + ``whiteouts``, reading ``changed`` from
        the view; the in-memory picture follows each step that succeeded. Returns the
        entries that changed under us while being read (the next sync re-reads them), and
        the digest of each file or symlink written."""
        delta = self._require_delta()
        stale = [
            rel
            for rel, (kind, _mode, _size) in self._entries.items()
            if rel not in wanted or wanted[rel][0] != kind
        ]
        for rel in sorted(stale, key=_components, reverse=True):
            delta.run(delta.remove(rel, self._entries[rel][0]))
            del self._entries[rel]
        raced: set[str] = set()
        digests: dict[str, bytes] = {}
        for rel in sorted(wanted, key=_components):
            kind, mode, *_ = wanted[rel]
            held = self._entries.get(rel)
            if held is not None and held[1] == mode and (kind == "dir" or rel not in changed):
                continue
            data = b""
            if kind != "dir":
                try:
                    data = _read_entry(self.root, rel, kind)
                except OSError:
                    raced.add(rel)
                    continue
                digest = hashlib.sha256(data).digest()
                if held == (kind, mode, len(data)) and rows[rel].digest == digest:
                    continue  # read again (close to the clock tick), unchanged
                digests[rel] = digest
            if kind == "link":
                _text(os.fsdecode(data))
                if held is not None:  # a symlink's row is made anew, never updated
                    delta.run(delta.remove(rel, "link"))
                    del self._entries[rel]
            delta.run(delta.put(rel, kind, mode, data))
            self._entries[rel] = (kind, mode, len(data))
        for rel in whiteouts:
            _text(rel)
        add, drop = whiteouts - self._whiteouts, self._whiteouts - whiteouts
        if add or drop:
            delta.run(delta.set_whiteouts(sorted(add), sorted(drop)))
            self._whiteouts = set(whiteouts)
        return raced, digests

    def _settle(self, *, to_commit: bool = False) -> None:
        """The delta as complete as it can be. A sealed session whose view could not be
        recorded refuses a commit (with the reason); diff and touched then show what the
        database holds, so the session can still be listed, shown and discarded."""
        if to_commit and self._unsettled is not None:
            raise WorkspaceError(self._unsettled)
        if not self._sealed and self.root.is_dir():
            self._sync("", frozenset())

    def _settle_for_seal(self) -> None:
        """A last sync of the view; on failure the view is kept and the reason recorded."""
        try:
            self._sync("", frozenset())
        except (LimitExceeded, WorkspaceError) as exc:
            self._unsettled = (
                f"the session's view {self.root} could not be recorded ({exc}); it is kept "
                "as the sandbox left it: discard the session, or copy what you need from it"
            )

    # --- the session contract ------------------------------------------------------------

    def write(self, rel: str, data: bytes) -> None:
        """Write ``rel`` in the view (refused past the delta limit), then record it."""
        with self._lock:
            normalized = "/".join(split_relative(rel))
            self._require_open()
            if self._sealed:
                raise WorkspaceError(
                    "the workspace session is sealed (its run is over): diff, commit or "
                    "discard it; it takes no more writes"
                )
            if self.max_delta_bytes is not None:
                held = self._entries.get(normalized)
                projected = self.delta_bytes - (held[2] if held else 0) + len(data)
                if projected > self.max_delta_bytes:
                    raise LimitExceeded(
                        f"writing {len(data)} bytes to '{shown('/workspace/' + normalized)}' "
                        f"would bring the workspace's changes to {projected} bytes, past "
                        f"the session's delta limit of {self.max_delta_bytes} bytes"
                    )
            super().write(rel, data)
            self._sync(normalized, frozenset({normalized}))

    def seal(self) -> None:
        """A final sync, the database made durable, then the view removed (module doc)."""
        with self._lock:
            self._require_open()
            if not self._sealed:
                self._seal_view()
            self._sealed = True

    def _seal_view(self) -> None:
        """Sync the view a last time; once the database is durable, remove the view. A
        failed sync keeps the view and records why (:attr:`_unsettled`)."""
        if not self.root.is_dir():
            return
        self._settle_for_seal()
        if self._unsettled is not None:
            return
        delta = self._require_delta()
        delta.run(delta.make_durable())
        for name in (DB_NAME, f"{DB_NAME}-wal"):
            if (self.state_dir / name).exists():
                fd = os.open(self.state_dir / name, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        fsync_dir(self.state_dir, follow_symlinks=False)
        shutil.rmtree(self.root)

    def delta_operations(self) -> list[list[str]]:
        """The operations commit would apply, parent before child (overlay's format)."""
        ops: list[list[str]] = []
        for rel in sorted(set(self._entries) | self._whiteouts, key=_components):
            entry = self._entries.get(rel)
            if entry is None:
                ops.append(["remove", rel])
            elif entry[0] == "dir":
                base_is_dir = stat.S_ISDIR(lstat_mode(self.base / rel))
                ops.append(
                    ["dir" if base_is_dir and rel not in self._whiteouts else "replace_dir", rel]
                )
            else:
                ops.append(["file", rel])
        return ops

    def touched(self) -> list[str]:
        with self._lock:
            self._require_open()
            self._settle()
            return [rel for _op, rel in self.delta_operations()]

    def _export(self, dest: Path, *, durable: bool = False) -> None:
        """Write the delta's entries (modes, symlinks) into the empty directory ``dest``;
        ``durable``: every file and directory fsync'ed (what a commit replays from must
        survive a power loss; one fsync per entry, not a ``syncfs`` of the whole file
        system, which on a busy host waits for everyone's writes)."""
        delta = self._require_delta()
        directories = [dest]
        for rel in sorted(self._entries, key=_components):
            kind, mode, _size = self._entries[rel]
            *dirs, name = _components(rel)
            parent = open_dirs(dest, dirs)
            try:
                if kind == "dir":
                    os.mkdir(name, 0o700, dir_fd=parent)
                    fd = os.open(name, DIR_FLAGS, dir_fd=parent)
                    directories.append(dest / rel)
                elif kind == "link":
                    os.symlink(delta.run(delta.read(rel, kind)), name, dir_fd=parent)
                    continue
                else:
                    fd = os.open(
                        name,
                        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                        0o600,
                        dir_fd=parent,
                    )
                    try:
                        data = delta.run(delta.read(rel, kind))
                        view = memoryview(data)
                        while view:
                            view = view[os.write(fd, view) :]
                        if durable:
                            os.fsync(fd)
                    except BaseException:
                        os.close(fd)
                        raise
                try:
                    os.fchmod(fd, mode & COMMIT_MODE_MASK)
                finally:
                    os.close(fd)
            finally:
                os.close(parent)
        if durable:
            for directory in directories:
                fsync_dir(directory, follow_symlinks=False)

    def diff(self) -> WorkspaceDiff:
        with self._lock:
            self._require_open()
            self._settle()
            scopes = [rel for op, rel in self.delta_operations() if op != "dir"]
            staging = Path(tempfile.mkdtemp(prefix=EXPORT_PREFIX, dir=self.state_dir))
            try:
                self._export(staging)
                return compare_trees(self.base, staging, scopes)
            finally:
                shutil.rmtree(staging, ignore_errors=True)

    def commit(self, *, leave_out: frozenset[str] = frozenset(), keep_marker: bool = False) -> None:
        """Export the delta, then apply it to the base through a journal (module doc),
        the operations on the paths in ``leave_out`` left out of it; ``keep_marker``: the
        applied marker stays (the session store removes it with the session).

        Error handling: a delta that could not be recorded (past the limit, a name that
        is not UTF-8) refuses before anything is written (:class:`LimitExceeded` or
        :class:`WorkspaceError`), the session stays open. A failure while applying
        leaves the journal, so :func:`recover_commit` finishes the commit later.
        """
        with self._lock:
            self._require_open()
            self._settle(to_commit=True)
            ops = [op for op in self.delta_operations() if op[1] not in leave_out]
            upper = self.state_dir / UPPER_NAME
            shutil.rmtree(upper, ignore_errors=True)
            upper.mkdir(mode=0o700)
            self._export(upper, durable=True)
            journal: dict[str, object] = {"base": str(self.base), "ops": ops}
            write_atomically(self.state_dir / JOURNAL_NAME, json.dumps(journal).encode())
            self._state = SessionState.COMMITTED
            self._release()
            _replay(self.state_dir, journal, keep_marker=keep_marker)

    def discard(self) -> None:
        """Drop the view and the database; the base was never written."""
        with self._lock:
            self._require_open()
            self._state = SessionState.DISCARDED
            self._release()
            _clear_state(self.state_dir)

    def close(self) -> None:
        with self._lock:
            if self._state is SessionState.OPEN and not self._sealed:
                self.discard()
            else:
                self._release()
