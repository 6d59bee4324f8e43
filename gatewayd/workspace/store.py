"""The session store: every run's workspace session, from the run's start until the
session is committed, discarded or expires, under ``state_dir/workspaces/<runId>/``.

One directory per session (0700, gatewayd's; no sandbox ever binds the state directory):

- ``meta.json``: the :class:`SessionInfo` (mode, base, state, what happens at run end,
  until when it is kept), rewritten atomically at each change of state;
- ``lock``: whoever works on the session holds an exclusive ``flock`` on it: the daemon
  for as long as the run is live, a command (``gatewayd workspace commit``, the control
  socket's routes, expiry) while it commits, discards or diffs. A second one is refused
  at once (:class:`WorkspaceBusy`), never queued and never interleaved; the kernel
  drops the lock of a process that dies, so a crash never leaves a session locked;
- ``session/``: the backend's own state (the overlay's upper directory, the host
  backend's snapshot);
- ``lease.json``: the base lent to the run's uid (written by the run's ``before_mount``;
  given back by the run at its end, or by :meth:`WorkspaceStore.recover`);
- ``seal.json``: what :meth:`RunWorkspace.seal` recorded when the run ended: the diff's
  counts, the delta's size (host), and a signature of every base path the delta
  touches, for the commit's conflict check.

States: ``live`` (the run is on it) → ``kept`` (sealed; waits for commit, discard or
expiry) → ``committed`` | ``discarded`` (the directory is then removed). Two more are
written for the length of one operation, so a crash part-way is finished, never
guessed: ``committing`` and ``discarding``.

The conflict check (commit): a kept session's base may change after the run (another
run committed, the operator edited). At seal, every base path the delta touches gets a
signature from ``lstat`` (kind, permission bits, size, modification time in ns, inode;
for a directory the delta replaces or removes, every entry beneath it too; for a
directory it only merges into, its kind). Commit compares them again and refuses, naming
the paths, when any differs: the commit would overwrite or delete a change nobody has
looked at. Signatures, not content hashes: sealing costs a stat per touched entry, not
a read of every file a run deleted; an edit that restores size, time and inode exactly
is not seen (no editor does that by accident). Owner and inode change time are left out
on purpose: giving a lent base back changes both, and says nothing about content.
Discard always works (it never writes the base, except in mode host, where it restores
the run's snapshot).

What a commit leaves out: git metadata (and the removal of a directory holding some),
unless the session was opened with ``commit_git_metadata`` (the policy's choice, kept in
``meta.json`` so a commit from another process honours it); the diff and the commit's
answer name it, and the symlinks leading out of the workspace
(:mod:`gatewayd.workspace.commit_rules`). A commit killed part-way is told apart by its
journal and its ``commit.applied`` marker, which stays until the session is recorded
committed and its directory removed (:mod:`gatewayd.workspace.commit_marker`).

Backends are looked up by mode in :data:`BACKENDS` and imported when first used, so a
mode's library (agentfs pulls in an SDK) is loaded only by runs that use it.

Thread use: the daemon calls these methods from worker threads
(``trio.to_thread.run_sync``); the table of live sessions is guarded by a lock, and
each session's directory by its ``flock``.
"""

from __future__ import annotations

import builtins
import contextlib
import datetime
import fcntl
import functools
import hashlib
import importlib
import json
import os
import re
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Final, Literal, Protocol, cast, get_args

import structlog
import trio

from gatewayd.audit import AuditLog
from gatewayd.audit.events import AuditEvent
from gatewayd.errors import GatewayError, InvalidArguments, LimitExceeded
from gatewayd.files import write_atomically
from gatewayd.policy.workspace_section import MAX_KEEP_FOR_S
from gatewayd.protocol import ErrorCode
from gatewayd.sandbox.lease import LEASE_FILE, LeaseError, give_back, read_lease
from gatewayd.workspace.commit_marker import is_applied
from gatewayd.workspace.commit_rules import HeldBack, held_back, is_git_metadata
from gatewayd.workspace.journal import check_max_delta_bytes
from gatewayd.workspace.overlay import unmount
from gatewayd.workspace.session import (
    DIR_FLAGS,
    WorkspaceDiff,
    WorkspaceError,
    WorkspaceSession,
    open_dirs,
)

log = structlog.get_logger("gatewayd.workspace.store")

WorkspaceMode = Literal["host", "overlay", "agentfs"]
OnEnd = Literal["keep", "commit", "discard"]
MODES: Final[tuple[WorkspaceMode, ...]] = get_args(WorkspaceMode)
ON_END: Final[tuple[OnEnd, ...]] = get_args(OnEnd)

# Each mode's backend class, "module:class", imported on first use (see module doc).
BACKENDS: Final[Mapping[WorkspaceMode, str]] = {
    "host": "gatewayd.workspace.host:HostWorkspace",
    "overlay": "gatewayd.workspace.overlay:OverlayWorkspace",
    "agentfs": "gatewayd.workspace.agentfs:AgentFSWorkspace",
}

WORKSPACES_DIR: Final = "workspaces"
META_NAME: Final = "meta.json"
LOCK_NAME: Final = "lock"
SESSION_NAME: Final = "session"
SEAL_NAME: Final = "seal.json"
# Session directories and their records: gatewayd's alone.
DIRECTORY_MODE: Final = 0o700
RECORD_MODE: Final = 0o600
# A run id, as gatewayd.runs.model.new_run_id makes them; nothing else names a
# directory here (no path, no "..").
RUN_ID_PATTERN: Final = re.compile(r"[0-9a-f]{32}")
# meta.json and seal.json are gatewayd's own; a larger one is not (a record is read
# whole, so the cap bounds the memory a damaged one can take).
MAX_META_BYTES: Final = 1 << 20
# seal.json holds a line per base path the delta touches: a run that wrote a million
# files makes it about as large as the overlay's commit journal, never more.
MAX_SEAL_BYTES: Final = 512 << 20
# How often the daemon looks for kept sessions past their keep time: they are kept
# hours to days, so a minute late is nothing, and a look costs one directory listing.
EXPIRY_INTERVAL_S: Final = 60
# How many conflicting paths a refusal names (the rest are counted).
MAX_NAMED_CONFLICTS: Final = 20
# Held (flock, in the store's directory) by whoever writes a base: a commit, a host
# discard, a journal's replay, a run's session being made. Not a run id, so neither
# list() nor recover() takes it for a session.
BASE_LOCK_NAME: Final = ".base.lock"

SessionStateName = Literal["live", "kept", "committing", "committed", "discarding", "discarded"]
STATES: Final[tuple[SessionStateName, ...]] = get_args(SessionStateName)


class WorkspaceNotFound(GatewayError):
    """No session of that run in the store (never made, or already ended); the code of
    the control socket's "no such run"."""

    code = ErrorCode.BAD_REQUEST


class WorkspaceBusy(WorkspaceError):
    """Another process (or the live run) works on the session now."""


class WorkspaceConflict(WorkspaceError):
    """Base paths the delta touches changed since the run ended: commit refused."""

    def __init__(self, message: str, paths: list[str]) -> None:
        super().__init__(message)
        self.paths = paths


class DeltaTooLarge(LimitExceeded):
    """A host session's delta is past its limit: it cannot be committed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionInfo:
    """What ``meta.json`` holds; ``gatewayd workspace list`` prints it."""

    run_id: str
    mode: WorkspaceMode
    base: Path
    state: SessionStateName
    on_end: OnEnd
    keep_for_s: int
    keep_until: float | None
    max_delta_bytes: int | None
    created: float
    # The base directory's (device, inode) at open: a commit or a host discard writes
    # only into that directory, never into another one put at its path since.
    base_id: tuple[int, int] | None = None
    # Filled at seal: the diff's counts (added, removed, modified, renamed, binary).
    counts: dict[str, int] = field(default_factory=dict)
    # Filled at seal: mode host, the bytes of the files the run added or changed (nothing
    # bounds them as they are written); overlay, the bytes its commit would copy, sparse
    # files whole (the delta's tmpfs counts blocks). None: the backend bounds its own.
    delta_bytes: int | None = None
    # Why the session is in its state when that is not obvious (a commit refused at
    # run end, a daemon that died with the run).
    note: str | None = None
    # The policy's workspace.commit_git_metadata when the session opened: a commit,
    # from whatever process, writes git metadata into the base only if this says so
    # (see gatewayd.workspace.commit_rules). A record without it: False, the safe side.
    commit_git_metadata: bool = False

    def to_json(self) -> dict[str, Any]:
        """The wire form (control socket, ``--json``): camelCase like the run API."""
        return {
            "runId": self.run_id,
            "mode": self.mode,
            "base": str(self.base),
            "state": self.state,
            "onEnd": self.on_end,
            "keepForSec": self.keep_for_s,
            "keepUntil": iso_time(self.keep_until) if self.keep_until is not None else None,
            "maxDeltaBytes": self.max_delta_bytes,
            "created": iso_time(self.created),
            "counts": dict(self.counts),
            "deltaBytes": self.delta_bytes,
            "note": self.note,
            "commitGitMetadata": self.commit_git_metadata,
        }

    def to_record(self) -> bytes:
        # Field by field, not dataclasses.asdict: that deep-copies every value (the
        # base's Path most of all), about half of this record's cost at each write.
        record = {f.name: getattr(self, f.name) for f in fields(self)}
        record["base"] = str(self.base)
        record["counts"] = dict(self.counts)
        return json.dumps(record, sort_keys=True).encode()

    @classmethod
    def from_record(cls, data: bytes) -> SessionInfo:
        record = json.loads(data)
        if not isinstance(record, dict):
            raise TypeError("not an object")
        record["base"] = Path(record["base"])
        if record.get("base_id") is not None:
            device, inode = record["base_id"]
            record["base_id"] = (int(device), int(inode))
        info = cls(**record)
        if info.mode not in MODES or info.on_end not in ON_END or info.state not in STATES:
            raise ValueError(
                f"unknown mode {info.mode!r}, on-end {info.on_end!r} or state {info.state!r}"
            )
        if RUN_ID_PATTERN.fullmatch(info.run_id) is None:
            raise ValueError(f"run id {info.run_id!r} is not one")
        if not isinstance(info.commit_git_metadata, bool):
            raise TypeError(f"commit_git_metadata {info.commit_git_metadata!r} is not a bool")
        return info


def iso_time(when: float) -> str:
    """``when`` (seconds since the epoch) as ISO 8601 UTC, to the second."""
    moment = datetime.datetime.fromtimestamp(int(when), tz=datetime.UTC)
    return moment.isoformat().replace("+00:00", "Z")


def diff_counts(diff: WorkspaceDiff) -> dict[str, int]:
    """The counts the audit log, the run summary and ``list`` show."""
    return {
        "added": len(diff.added),
        "removed": len(diff.removed),
        "modified": len(diff.modified),
        "renamed": len(diff.renamed),
        "binary": len(diff.binary),
    }


def diff_json(diff: WorkspaceDiff) -> dict[str, Any]:
    """A diff's wire form (control socket, ``gatewayd workspace diff --json``):
    ``leftOut`` the paths a commit leaves out of the base, with why; ``linksOut`` the
    symlinks leading out of the workspace, with their targets; ``gitMetadata`` every
    changed path under a ``.git`` (in mode host already in the base: it cannot be left
    out)."""
    changed = [*diff.added, *diff.removed, *diff.modified]
    changed += [name for pair in diff.renamed for name in pair]
    return {
        "added": diff.added,
        "removed": diff.removed,
        "modified": diff.modified,
        "renamed": [list(pair) for pair in diff.renamed],
        "binary": diff.binary,
        "unified": diff.unified,
        "leftOut": [{"path": path, "reason": reason} for path, reason in diff.left_out],
        "linksOut": [{"path": path, "target": target} for path, target in diff.links_out],
        "gitMetadata": sorted({path for path in changed if is_git_metadata(path)}),
    }


def _is_left_out(rel: str, held: HeldBack) -> bool:
    rel = rel.rstrip("/")
    return rel in held.ops or any(rel.startswith(f"{top}/") for top in held.paths)


def committed_part(diff: WorkspaceDiff, held: HeldBack) -> WorkspaceDiff:
    """``diff`` without what the commit left out (named in ``left_out`` instead)."""
    if not held.paths:
        return replace(diff, left_out=[])
    added = [rel for rel in diff.added if not _is_left_out(rel, held)]
    removed = [rel for rel in diff.removed if not _is_left_out(rel, held)]
    renamed = []
    for old, new in diff.renamed:
        old_out, new_out = _is_left_out(old, held), _is_left_out(new, held)
        if not old_out and not new_out:
            renamed.append((old, new))
        elif not old_out:
            removed.append(old)  # moved into what is left out: only its removal is written
        elif not new_out:
            added.append(new)
    return replace(
        diff,
        added=sorted(added),
        removed=sorted(removed),
        modified=[rel for rel in diff.modified if not _is_left_out(rel, held)],
        renamed=renamed,
        binary=[rel for rel in diff.binary if not _is_left_out(rel, held)],
        links_out=[(rel, t) for rel, t in diff.links_out if not _is_left_out(rel, held)],
        left_out=sorted(held.paths.items()),
    )


def commit_summary(diff: WorkspaceDiff) -> str:
    """What a commit's answer adds to "committed": what it left out, the links it
    wrote that lead out of the workspace ("" when neither)."""
    parts = []
    if diff.left_out:
        parts.append("left out: " + ", ".join(path for path, _reason in diff.left_out))
    if diff.links_out:
        parts.append(
            "links leading out of the workspace: "
            + ", ".join(f"{path} -> {target}" for path, target in diff.links_out)
        )
    return "; ".join(parts)


class _Backend(Protocol):
    """What the store needs of a backend class (its classmethods)."""

    writes_base: bool

    def create(
        self, base: Path, state_dir: Path, *, max_delta_bytes: int | None = None
    ) -> WorkspaceSession: ...

    def reopen(self, base: Path, state_dir: Path) -> WorkspaceSession: ...

    def recover_state(self, base: Path, state_dir: Path) -> str | None: ...


def backend_of(mode: str) -> _Backend:
    """The backend class of ``mode``, imported now. Error handling: InvalidArguments for
    an unknown mode; WorkspaceError when its backend cannot be imported (a missing
    library), naming the other modes."""
    if mode not in BACKENDS:
        raise InvalidArguments(
            f"unknown workspace mode {mode!r}; the modes are {', '.join(BACKENDS)}"
        )
    module_name, _, class_name = BACKENDS[cast(WorkspaceMode, mode)].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise WorkspaceError(
            f"the {mode} workspace backend cannot be loaded ({exc}); use another "
            f"workspace mode ({', '.join(m for m in BACKENDS if m != mode)})"
        ) from exc
    return cast(_Backend, getattr(module, class_name))


def check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or RUN_ID_PATTERN.fullmatch(run_id) is None:
        raise InvalidArguments(
            f"{str(run_id)[:80]!r} is not a run id (32 lowercase hex characters, as "
            "`gatewayd workspace list` shows them)"
        )
    return run_id


# --- the lock -------------------------------------------------------------------


def _take_lock(directory: Path, run_id: str) -> int:
    """An open descriptor holding ``directory/lock`` exclusively; WorkspaceBusy when
    someone else holds it. The descriptor is close-on-exec (no sandbox inherits it)."""
    fd = os.open(
        directory / LOCK_NAME,
        os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
        RECORD_MODE,
    )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise WorkspaceBusy(
            f"the workspace session of run {run_id} is in use: the run is still live, or "
            "another command is committing or discarding it; try again when it is done"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _overlaps(one: Path, other: Path) -> bool:
    """Is one of the two directories (real paths) the other or beneath it?"""
    return one == other or one in other.parents or other in one.parents


# --- records --------------------------------------------------------------------


def _read_record(path: Path, cap: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        chunks, size = [], 0
        while chunk := os.read(fd, min(1 << 20, cap + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > cap:
                raise ValueError(f"{path} is over {cap} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _write_info(directory: Path, info: SessionInfo, *, sync_dir: bool = True) -> None:
    write_atomically(directory / META_NAME, info.to_record(), RECORD_MODE, sync_dir=sync_dir)


# --- the conflict check's signatures -------------------------------------------


def _entry_line(rel: str, st: os.stat_result, *, directory_time: bool) -> str:
    mode = stat.S_IMODE(st.st_mode)
    kind = stat.S_IFMT(st.st_mode)
    if stat.S_ISDIR(st.st_mode) and not directory_time:
        return f"{rel}\0{kind}\0{mode}"
    return f"{rel}\0{kind}\0{mode}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}"


def base_signature(base: Path, rel: str, *, whole: bool) -> str:
    """The signature of ``base/rel`` for the conflict check (see module doc): absent,
    the entry itself (a directory merged into: its kind alone), or with ``whole`` every
    entry beneath it. No symlink is followed on the way (a base holding a link
    ``dir -> /etc`` is signed as the link)."""
    *dirs, name = rel.split("/")
    try:
        parent = open_dirs(base, dirs)
    except (FileNotFoundError, NotADirectoryError, OSError):
        return "absent-parent"
    try:
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return "absent"
        if not stat.S_ISDIR(st.st_mode):
            return _entry_line(rel, st, directory_time=True)
        if not whole:
            return "dir"
        # Names are bytes (a surrogate-escaped str here): hashed as the bytes they are.
        digest = hashlib.sha256(os.fsencode(_entry_line(rel, st, directory_time=False)))
        top = os.open(name, DIR_FLAGS, dir_fd=parent)
        try:
            for dirpath, dirnames, filenames, dir_fd in os.fwalk(
                ".", dir_fd=top, follow_symlinks=False
            ):
                dirnames.sort()
                for entry in sorted(dirnames + filenames):
                    try:
                        child = os.stat(entry, dir_fd=dir_fd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    line = _entry_line(f"{dirpath}/{entry}", child, directory_time=False)
                    digest.update(os.fsencode(line) + b"\n")
        finally:
            os.close(top)
        return digest.hexdigest()
    finally:
        os.close(parent)


def _touched_with_depth(session: WorkspaceSession) -> dict[str, bool]:
    """Each base path the delta touches, and whether it is touched whole (replaced or
    removed: everything beneath it counts) or only as itself (a directory merged into)."""
    touched: dict[str, bool] = {}
    ops = getattr(session, "delta_operations", None)
    if callable(ops):
        for op, rel in ops():
            touched[rel] = op != "dir"
        return touched
    for rel in session.touched():
        touched[rel] = True
    return touched


# --- mounts left under a session directory --------------------------------------


def _mounts_under(directory: Path) -> list[Path]:
    """Every mount point strictly beneath ``directory``, deepest first."""
    prefix = f"{directory}/"
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as table:
        for line in table:
            fields = line.split(" ")
            if len(fields) > 4:
                point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
                if point.startswith(prefix):
                    found.append(Path(point))
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def _remove_directory(directory: Path) -> None:
    """Remove a session directory, unmounting anything left mounted beneath it first
    (rmtree must never descend into a mount)."""
    for point in _mounts_under(directory):
        unmount(point, detach=True)
    shutil.rmtree(directory, ignore_errors=True)


# --- the handle of a live run ----------------------------------------------------


class RunWorkspace:
    """A live run's session: the sandbox binds :attr:`root`; the store's directory for
    it is :attr:`directory`. Made by :meth:`WorkspaceStore.open_session`; holds the
    session's lock until :meth:`WorkspaceStore.end_of_run`."""

    def __init__(
        self,
        *,
        store: WorkspaceStore,
        info: SessionInfo,
        directory: Path,
        session: WorkspaceSession,
        lock_fd: int,
    ) -> None:
        self._store = store
        self._info = info
        self.run_id = info.run_id
        self.mode: WorkspaceMode = info.mode
        self.base = info.base
        self.directory = directory
        self.session = session
        self.root = session.root
        self._lock_fd: int | None = lock_fd
        self._guard = threading.Lock()
        # Sealed with meta.json left live (seal(record_state=False)).
        self._state_unrecorded = False

    @property
    def info(self) -> SessionInfo:
        """The session's record as it is now (counts filled in once sealed)."""
        return self._info

    @property
    def sealed(self) -> bool:
        return self.session.is_sealed

    def seal(self, *, record_state: bool = True) -> None:
        """The run's sandbox is gone: unmount the view (the overlay keeps its upper
        directory), final sync (agentfs), record the diff's counts and the base's
        signature of every path the delta touches (the commit's conflict check); state
        ``kept``. Idempotent. ``record_state`` False: only for a caller that calls
        :meth:`WorkspaceStore.end_of_run` next, which writes ``meta.json`` once for
        both (a crash in between leaves it live: recovery seals it again and keeps it)."""
        with self._guard:
            if self.session.is_sealed or not self.session.is_open:
                return
            self.session.seal()
            self._info = self._store._record_seal(
                self.directory, self._info, self.session, record_state=record_state
            )
            # meta.json still says live: WorkspaceStore.end_of_run writes it once, with
            # the state its on-end leads to (or, if that fails, as the seal would have).
            self._state_unrecorded = not record_state

    def keep_sealed_record(self) -> None:
        """After a step that failed between :meth:`seal` with ``record_state=False`` and
        the write of the session's next state: ``meta.json`` says kept, as the seal
        would have recorded it (nothing if a state was written since). Blocking."""
        with self._guard:
            if self._state_unrecorded and self._store._still_live(self.directory):
                _write_info(self.directory, self._info)
            self._state_unrecorded = False

    @contextlib.contextmanager
    def sealed_for_its_end(self) -> Iterator[None]:
        """Seal with ``meta.json`` left live for the steps of the run's end in the
        ``with`` block (the base given back, :meth:`WorkspaceStore.end_of_run`, which
        writes it once with the state its on-end leads to); a step that raises leaves
        it recorded kept, as the seal would have (:meth:`keep_sealed_record`). A seal
        that fails leaves the session live. Blocking."""
        self.seal(record_state=False)
        try:
            yield
        except BaseException:
            self.keep_sealed_record()
            raise

    def _release(self) -> None:
        with self._guard:
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None


# --- the store ------------------------------------------------------------------


# How the store has an operator's and the daemon's own actions audited: the event, the
# run id, the entry's detail; durable when it returns (the daemon's writes through the
# audit log). Called from the thread the store's method runs in.
Recorder = Callable[[AuditEvent, str, Mapping[str, Any]], None]


def _not_recorded(event: AuditEvent, run_id: str, detail: Mapping[str, Any]) -> None:
    """The recorder of a store nobody audits (tests of the store alone)."""


def audit_recorder(audit: AuditLog) -> Recorder:
    """A recorder writing to the daemon's audit log, durably, from the worker thread a
    store method runs in (the daemon calls the store through ``trio.to_thread``)."""

    def record(event: AuditEvent, run_id: str, detail: Mapping[str, Any]) -> None:
        trio.from_thread.run(
            functools.partial(audit.append, "event", event=event, runId=run_id, detail=detail)
        )

    return record


class WorkspaceStore:
    """Every run's workspace session under ``state_dir/workspaces/`` (see module doc).

    ``record`` audits what :meth:`commit`, :meth:`discard`, :meth:`expire` and
    :meth:`recover` do (``workspace_committed`` durable before the base is written, and
    again with ``error`` when the commit then failed); a run's own end is audited by its
    caller (``workspace_ended``).
    """

    def __init__(self, state_dir: Path, *, record: Recorder = _not_recorded) -> None:
        self.root = Path(state_dir) / WORKSPACES_DIR
        self._record = record
        self._live: dict[str, RunWorkspace] = {}
        self._live_lock = threading.Lock()

    def _directory(self, run_id: str) -> Path:
        return self.root / check_run_id(run_id)

    def _ensure_root(self) -> None:
        self.root.mkdir(mode=DIRECTORY_MODE, parents=True, exist_ok=True)
        if self.root.is_symlink() or not self.root.is_dir():
            raise WorkspaceError(f"{self.root} is not a directory")
        os.chmod(self.root, DIRECTORY_MODE)

    @contextlib.contextmanager
    def _writing_base(
        self, info: SessionInfo | None, *, wait: bool, doing: str = "commit"
    ) -> Iterator[None]:
        """Held while the caller writes a base (or makes a run's session on one).

        Each session's own lock keeps two commands off one session; this one keeps a
        commit of one session off a base another session's commit is writing (each would
        pass its conflict check against a base the other is about to change, and the
        second would overwrite the first's change unseen). One lock for the whole store:
        commits are rare, and bases may nest. ``wait``: block until it is free (a run
        starting or ending, a journal's replay); else WorkspaceBusy at once (a command).

        With ``info`` (the session about to write its base), a session still ``live`` on
        a base overlapping it is refused too (WorkspaceBusy naming the run): its overlay's
        lower layer must not change under it, and a host run's base is lent to its uid.
        A run's session is made under this lock, so no run starts on the base while a
        commit writes it. Lock order: a session's lock, then this one; never the reverse.
        """
        fd = os.open(
            self.root / BASE_LOCK_NAME,
            os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
            RECORD_MODE,
        )
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise WorkspaceBusy(
                    "another commit or discard is writing a workspace base now (or a run's "
                    "session is being made); nothing was written: try again when it is done"
                ) from None
            if info is not None:
                self._refuse_live_over(info, doing=doing)
            yield
        finally:
            os.close(fd)

    def _refuse_live_over(self, info: SessionInfo, *, doing: str) -> None:
        """WorkspaceBusy when another session is live on a base overlapping ``info``'s."""
        for entry in sorted(os.listdir(self.root)):
            if entry == info.run_id or RUN_ID_PATTERN.fullmatch(entry) is None:
                continue
            try:
                other = self._read_info(self.root / entry)
            except WorkspaceError:
                continue  # never opened, or damaged: no run is on it
            if other.state == "live" and _overlaps(other.base, info.base):
                raise WorkspaceBusy(
                    f"run {other.run_id} is live on {other.base}, which overlaps {info.base}: "
                    f"the {doing} would write a tree that run is working on, so nothing was "
                    f"written; {doing} run {info.run_id}'s session when it ends (it stays kept)"
                )

    # --- a run's session -------------------------------------------------------

    def open_session(
        self,
        run_id: str,
        base: Path,
        mode: WorkspaceMode,
        *,
        on_end: OnEnd,
        keep_for_s: int,
        max_delta_bytes: int | None,
        before_mount: Callable[[Path], None] | None = None,
        commit_git_metadata: bool = False,
    ) -> RunWorkspace:
        """Make run ``run_id``'s session over ``base`` in ``mode``; the store holds it
        (locked) until :meth:`end_of_run`.

        ``before_mount(directory)`` runs after the session directory exists and before
        the backend mounts anything: the caller lends the base there (the lease file
        stays in the directory, so :meth:`recover` gives it back after a crash). It
        must fsync ``directory`` before it changes anything outside it (as recording
        its lease there durably does, whatever it lends): that fsync makes
        ``meta.json``'s name durable too, so the store makes none of its own for it.
        ``commit_git_metadata`` (the policy's ``workspace.commit_git_metadata``) is
        recorded with the session: every later commit, from any process, honours it.

        Error handling: InvalidArguments for a bad run id, mode, on-end, keep time or
        delta limit; WorkspaceError when the base is not a directory, overlaps the
        store, or the backend fails (nothing is left behind: the directory is removed
        and a lease recorded by ``before_mount`` given back).
        """
        check_run_id(run_id)
        if on_end not in ON_END:
            raise InvalidArguments(f"on-end {on_end!r} is not one of {', '.join(ON_END)}")
        if isinstance(keep_for_s, bool) or not isinstance(keep_for_s, int):
            raise InvalidArguments(f"keep_for_s must be whole seconds, not {keep_for_s!r}")
        if not 0 < keep_for_s <= MAX_KEEP_FOR_S:
            raise InvalidArguments(
                f"a session is kept 1 to {MAX_KEEP_FOR_S} seconds (90 days), not {keep_for_s}"
            )
        if (problem := check_max_delta_bytes(max_delta_bytes)) is not None:
            raise InvalidArguments(problem)
        if not isinstance(commit_git_metadata, bool):
            raise InvalidArguments(
                f"commit_git_metadata must be true or false, not {commit_git_metadata!r}"
            )
        # Loaded first: a mode whose library is missing fails before anything is made.
        backend = backend_of(mode)
        real_base = Path(os.path.realpath(base))
        if not real_base.is_dir():
            raise WorkspaceError(f"workspace base {base} is not a directory")
        self._ensure_root()
        store_root = Path(os.path.realpath(self.root))
        if real_base == store_root or store_root in real_base.parents:
            raise WorkspaceError(f"workspace base {real_base} is inside gatewayd's store")
        if real_base in store_root.parents:
            raise WorkspaceError(
                f"workspace base {real_base} holds gatewayd's workspace store "
                f"{store_root}; a run's sandbox must never see it"
            )
        directory = self._directory(run_id)
        try:
            directory.mkdir(mode=DIRECTORY_MODE)
        except FileExistsError:
            raise WorkspaceError(f"run {run_id} already has a workspace session") from None
        info = SessionInfo(
            run_id=run_id,
            mode=mode,
            base=real_base,
            state="live",
            on_end=on_end,
            keep_for_s=keep_for_s,
            keep_until=None,
            max_delta_bytes=max_delta_bytes,
            created=time.time(),
            base_id=_identity(real_base),
            commit_git_metadata=commit_git_metadata,
        )
        lock_fd: int | None = None
        try:
            # Locked before its record names it live: a command finding a live record
            # with nobody holding the lock takes the run for dead and recovers it.
            lock_fd = _take_lock(directory, run_id)
            # Durable before anything outside the directory changes: by the directory's
            # fsync here, or by the one before_mount makes for its own record there
            # first (one fsync for both names). A power cut before it leaves both names,
            # either or none, and nothing lent yet; recover() tidies each (a lease
            # without meta.json: given back, the directory removed).
            _write_info(directory, info, sync_dir=before_mount is None)
            # Never on a base a commit is writing: it waits for the commit to finish.
            with self._writing_base(None, wait=True):
                if before_mount is not None:
                    before_mount(directory)
                session = backend.create(
                    real_base, directory / SESSION_NAME, max_delta_bytes=max_delta_bytes
                )
        except BaseException:
            self._undo_open(directory)
            if lock_fd is not None:
                os.close(lock_fd)
            raise
        handle = RunWorkspace(
            store=self, info=info, directory=directory, session=session, lock_fd=lock_fd
        )
        with self._live_lock:
            self._live[run_id] = handle
        return handle

    def _undo_open(self, directory: Path) -> None:
        """A session that failed to open: give back a recorded lease, remove it all."""
        try:
            lease = read_lease(directory)
            if lease is not None:
                give_back(lease)
        except (LeaseError, OSError) as exc:
            log.error("workspace_lease_not_returned", directory=str(directory), error=str(exc))
            return  # the lease record stays for recover(); so does the directory
        _remove_directory(directory)

    def live(self, run_id: str) -> RunWorkspace | None:
        """The live run's handle in this process, or None."""
        with self._live_lock:
            return self._live.get(run_id)

    def end_of_run(
        self, run_id: str, *, on_end: OnEnd | None = None, interrupted: str | None = None
    ) -> str:
        """Apply the run's on-end to its session (sealing it first if the caller did
        not): "committed", "discarded", or "kept until <ISO time>" (with the reason when
        a commit was refused: a conflict, a host delta past its limit). ``on_end``
        overrides the session's own (a run refused before anything ran: discard).
        ``interrupted``: why the run ended before its work did (its time ran out, the
        daemon stopped); a commit is then not made, the session is kept with that note,
        as a crash keeps it: half-done work never reaches the base on its own.
        Writes the session's record once for the seal (if the caller did not record
        it: :meth:`RunWorkspace.seal`) and the on-end. Releases the session's lock.
        Error handling: WorkspaceNotFound when no live session of ``run_id`` is in
        this store; a discard that fails raises (the session stays kept, and recover()
        or a later discard finishes it)."""
        with self._live_lock:
            handle = self._live.pop(check_run_id(run_id), None)
        if handle is None:
            raise WorkspaceNotFound(f"run {run_id} has no live workspace session here")
        try:
            # Sealed with meta.json left live: the on-end below writes it once (kept,
            # committing or discarding) instead of once for the seal and once more for
            # the on-end. A crash between the two leaves it live, which recovery seals
            # and keeps, as it keeps a sealed one: never committed, the base given back.
            with handle.sealed_for_its_end():
                return self._apply_on_end(handle, on_end, interrupted)
        finally:
            handle._release()

    def _still_live(self, directory: Path) -> bool:
        """Does the session's record still say live (nothing written since the seal)?"""
        try:
            return self._read_info(directory).state == "live"
        except WorkspaceError:
            return False  # damaged or gone: nothing to write over

    def _apply_on_end(
        self, handle: RunWorkspace, on_end: OnEnd | None, interrupted: str | None
    ) -> str:
        """:meth:`end_of_run`'s on-end of the sealed ``handle``: each way writes the
        session's record once."""
        info = handle.info
        action = on_end or info.on_end
        if action == "commit" and interrupted is not None:
            note = f"commit skipped: {interrupted}"
            kept = self._keep(handle.directory, info, note=note)
            return f"kept until {iso_time(kept)} ({note})"
        if action == "discard":
            try:
                self._discard_locked(handle.directory, info, handle.session, wait=True)
                return "discarded"
            except WorkspaceBusy as exc:
                # A host session over a base another run is live on: restored later.
                kept = self._keep(handle.directory, info, note=f"discard refused: {exc}")
                return f"kept until {iso_time(kept)} (discard refused: {exc})"
        if action == "commit":
            try:
                done = self._commit_locked(handle.directory, info, handle.session, wait=True)
                summary = commit_summary(done)
                return f"committed ({summary})" if summary else "committed"
            except (WorkspaceConflict, DeltaTooLarge, WorkspaceBusy) as exc:
                # Refused before anything was written: the session is kept as it was.
                kept = self._keep(handle.directory, handle.info, note=f"commit refused: {exc}")
                return f"kept until {iso_time(kept)} (commit refused: {exc})"
        kept = self._keep(handle.directory, info, note=None)
        return f"kept until {iso_time(kept)}"

    def _keep(self, directory: Path, info: SessionInfo, *, note: str | None) -> float:
        until = time.time() + info.keep_for_s
        _write_info(directory, replace(info, state="kept", keep_until=until, note=note))
        return until

    def _record_seal(
        self,
        directory: Path,
        info: SessionInfo,
        session: WorkspaceSession,
        *,
        record_state: bool = True,
        signed_at_run_end: bool = False,
    ) -> SessionInfo:
        """What seal records (seal.json, durable before any record says kept) and the
        session's new record (state kept): written to meta.json unless ``record_state``
        is False (the caller writes it with the state that follows).
        ``signed_at_run_end``: the run's own seal wrote seal.json before its daemon died
        (meta.json still live): its signatures, taken when the run ended, stay, so a base
        edited after that is a conflict for the commit as it would have been."""
        diff = session.diff()
        # Host: what the run wrote into the base; the others: what their commit would
        # copy into it, sparse files at full size (their own limit counts blocks).
        delta_bytes = (
            _bytes_written(session.root, diff) if session.writes_base else session.committed_bytes()
        )
        if not signed_at_run_end:
            signatures: dict[str, dict[str, Any]] = {}
            if not session.writes_base:
                # Host mode has nothing to check: its commit writes nothing to the base.
                for rel, whole in _touched_with_depth(session).items():
                    signature = base_signature(info.base, rel, whole=whole)
                    signatures[rel] = {"whole": whole, "signature": signature}
            record = {"signatures": signatures, "sealed": time.time()}
            write_atomically(directory / SEAL_NAME, json.dumps(record).encode(), RECORD_MODE)
        sealed = replace(info, state="kept", counts=diff_counts(diff), delta_bytes=delta_bytes)
        if record_state:
            _write_info(directory, sealed)
        return sealed

    # --- any session, by run id --------------------------------------------------

    def list(self) -> list[SessionInfo]:
        """Every session in the store, oldest first (unreadable records are logged and
        left out)."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in sorted(os.listdir(self.root)):
            if RUN_ID_PATTERN.fullmatch(entry) is None:
                continue
            try:
                found.append(self._read_info(self.root / entry))
            except WorkspaceError as exc:
                log.warning("workspace_record_unreadable", run_id=entry, error=str(exc))
        return sorted(found, key=lambda info: info.created)

    def info(self, run_id: str) -> SessionInfo:
        """Run ``run_id``'s session record. Error handling: WorkspaceNotFound."""
        handle = self.live(run_id)
        if handle is not None:
            return handle.info
        return self._read_info(self._directory(run_id))

    def _read_info(self, directory: Path) -> SessionInfo:
        try:
            data = _read_record(directory / META_NAME, MAX_META_BYTES)
        except FileNotFoundError:
            raise WorkspaceNotFound(
                f"run {directory.name} has no workspace session: it was never made, or it "
                "was committed, discarded or expired (`gatewayd workspace list` shows the "
                "sessions there are)"
            ) from None
        except (OSError, ValueError) as exc:
            raise WorkspaceError(f"{directory / META_NAME} cannot be read: {exc}") from None
        try:
            info = SessionInfo.from_record(data)
            if info.run_id != directory.name:
                raise ValueError(f"it names run {info.run_id}")
        except (ValueError, TypeError, KeyError) as exc:
            raise WorkspaceError(
                f"{directory / META_NAME} is malformed ({exc}); the session's delta is in "
                f"{directory / SESSION_NAME}"
            ) from None
        return info

    @contextlib.contextmanager
    def _locked(self, run_id: str) -> Iterator[tuple[Path, SessionInfo]]:
        """The session's directory and record, its lock held; a session a dead daemon
        left live is recovered (kept) first."""
        directory = self._directory(run_id)
        self._read_info(directory)  # WorkspaceNotFound before a lock file is made
        fd = _take_lock(directory, run_id)
        try:
            info = self._read_info(directory)
            if info.state in ("live", "committing", "discarding"):
                # Nobody holds the lock, so whoever wrote that state is gone: finish
                # what it left first (the run's daemon, a command killed part-way).
                done = self._recover_one(directory, info)
                if not directory.is_dir():
                    raise WorkspaceNotFound(f"no session is left: {done}")
                info = self._read_info(directory)
            yield directory, info
        finally:
            os.close(fd)

    def diff(self, run_id: str) -> WorkspaceDiff:
        """What a live or kept session changed. Error handling: WorkspaceNotFound;
        WorkspaceBusy when another process holds it."""
        handle = self.live(run_id)
        if handle is not None:
            return self._marked(handle.info, handle.session, handle.session.diff())
        with self._locked(run_id) as (directory, info):
            self._require_kept(info)
            session = backend_of(info.mode).reopen(info.base, directory / SESSION_NAME)
            return self._marked(info, session, session.diff())

    @staticmethod
    def _held_back(info: SessionInfo, session: WorkspaceSession) -> HeldBack:
        """What a commit of ``session`` leaves out of the base (see
        :mod:`gatewayd.workspace.commit_rules`): nothing in mode host (the run wrote the
        base itself) or when the session was opened with ``commit_git_metadata``."""
        ops = getattr(session, "delta_operations", None)
        if session.writes_base or info.commit_git_metadata or not callable(ops):
            return HeldBack()
        return held_back(info.base, ops())

    def _marked(
        self, info: SessionInfo, session: WorkspaceSession, diff: WorkspaceDiff
    ) -> WorkspaceDiff:
        """``diff`` naming what a commit would leave out (the paths stay listed)."""
        return replace(diff, left_out=sorted(self._held_back(info, session).paths.items()))

    def commit(self, run_id: str, *, by: str = "unknown") -> WorkspaceDiff:
        """Make the base hold the kept session's changes; the session ends. Returns what
        was committed. ``by``: who asked, for the audit entry. Error handling:
        WorkspaceNotFound; WorkspaceBusy for a live run (or another command on it);
        WorkspaceConflict naming the base paths changed since the run ended;
        DeltaTooLarge for a host delta past its limit."""
        if self.live(run_id) is not None:
            raise WorkspaceBusy(
                f"run {run_id} is still live; its session can be committed once it ends "
                "(stop it with DELETE /v1/runs/{runId}, or let it finish)"
            )
        with self._locked(run_id) as (directory, info):
            self._require_kept(info)

            def audited(diff: WorkspaceDiff) -> None:
                detail = _detail(info, by=by) | diff_counts(diff)
                if diff.left_out:
                    detail["leftOut"] = [
                        {"path": path, "reason": reason} for path, reason in diff.left_out
                    ]
                if diff.links_out:
                    detail["linksOut"] = [
                        {"path": path, "target": target} for path, target in diff.links_out
                    ]
                self._record(AuditEvent.WORKSPACE_COMMITTED, run_id, detail)

            return self._commit_locked(directory, info, None, before=audited, by=by)

    def discard(self, run_id: str, *, by: str = "unknown") -> None:
        """Drop the kept session; the base stays as it was (mode host: restored to its
        state at run start). ``by``: who asked, for the audit entry. Error handling:
        WorkspaceNotFound; WorkspaceBusy."""
        if self.live(run_id) is not None:
            raise WorkspaceBusy(
                f"run {run_id} is still live; its session can be discarded once it ends"
            )
        with self._locked(run_id) as (directory, info):
            self._record(AuditEvent.WORKSPACE_DISCARDED, run_id, _detail(info, by=by))
            self._discard_locked(directory, info, None)

    def _require_kept(self, info: SessionInfo) -> None:
        if info.state != "kept":
            raise WorkspaceError(
                f"the workspace session of run {info.run_id} is {info.state}, not kept"
            )

    def _commit_locked(
        self,
        directory: Path,
        info: SessionInfo,
        session: WorkspaceSession | None,
        *,
        before: Callable[[WorkspaceDiff], None] | None = None,
        by: str = "",
        wait: bool = False,
    ) -> WorkspaceDiff:
        if info.max_delta_bytes is not None and (info.delta_bytes or 0) > info.max_delta_bytes:
            host = backend_of(info.mode).writes_base
            raise DeltaTooLarge(
                f"run {info.run_id} "
                + (
                    f"wrote {info.delta_bytes} bytes into"
                    if host
                    else f"would write {info.delta_bytes} bytes (sparse files whole) into"
                )
                + f" {info.base}, past its limit of {info.max_delta_bytes} (measured at the "
                f"run's end); it cannot be committed: discard it (`gatewayd workspace "
                f"discard {info.run_id}`)"
                + (" to restore the directory" if host else "; the base was never written")
            )
        # The check and the apply under one lock: no other commit writes the base between.
        with self._writing_base(info, wait=wait), contextlib.ExitStack() as stack:
            _require_same_base(info)
            if session is None:
                session = backend_of(info.mode).reopen(info.base, directory / SESSION_NAME)
                # A sealed session's close keeps its delta; it frees what reopen opened
                # (agentfs: its database) when the commit is refused.
                stack.callback(session.close)
            held = self._held_back(info, session)
            # A path left out is never written: its change since the seal is no conflict
            # (the operator ran git in the base after the run: its index changed).
            conflicts = [
                rel for rel in self._conflicts(directory, info) if not _is_left_out(rel, held)
            ]
            if conflicts:
                named = conflicts[:MAX_NAMED_CONFLICTS]
                more = len(conflicts) - len(named)
                raise WorkspaceConflict(
                    f"{info.base} changed since run {info.run_id} ended, where the session "
                    f"would write: {', '.join(named)}"
                    + (f" and {more} more" if more else "")
                    + "; nothing was committed. Look at the session's diff and the base, then "
                    "discard it (the base stays as it is now) or bring those paths back",
                    conflicts,
                )
            diff = committed_part(session.diff(), held)
            if before is not None:
                before(diff)
            _write_info(directory, replace(info, state="committing"))
            try:
                # The applied marker stays until _finished records the session committed
                # and removes its directory: recovery then never has to guess.
                session.commit(leave_out=held.ops, keep_marker=True)
            except Exception as exc:
                if before is not None:
                    detail = _detail(info, by=by) | {"error": str(exc)}
                    self._record(AuditEvent.WORKSPACE_COMMITTED, info.run_id, detail)
                raise
        self._finished(directory, info, "committed")
        return diff

    def _conflicts(self, directory: Path, info: SessionInfo) -> builtins.list[str]:
        try:
            record = json.loads(_read_record(directory / SEAL_NAME, MAX_SEAL_BYTES))
            signatures = record["signatures"]
        except FileNotFoundError:
            return []  # never sealed (a dead run's session is sealed by recovery)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise WorkspaceError(
                f"{directory / SEAL_NAME} cannot be read ({exc}): the conflict check has "
                "nothing to compare; discard the session"
            ) from None
        try:
            return sorted(
                rel
                for rel, signed in signatures.items()
                if base_signature(info.base, rel, whole=bool(signed["whole"]))
                != signed["signature"]
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise WorkspaceError(
                f"{directory / SEAL_NAME} is malformed ({exc!r}): the conflict check has "
                "nothing to compare; discard the session"
            ) from None

    def _discard_locked(
        self,
        directory: Path,
        info: SessionInfo,
        session: WorkspaceSession | None,
        *,
        wait: bool = False,
    ) -> None:
        backend = backend_of(info.mode)
        # A host discard restores the run's snapshot into the base: a write like a commit's.
        writing: contextlib.AbstractContextManager[None] = (
            self._writing_base(info, wait=wait, doing="discard")
            if backend.writes_base
            else contextlib.nullcontext()
        )
        with writing:
            if backend.writes_base:
                _require_same_base(info, doing="discard")
            was = info.state
            _write_info(directory, replace(info, state="discarding"))
            if session is None:
                try:
                    session = backend.reopen(info.base, directory / SESSION_NAME)
                except WorkspaceError:
                    # Lost state: fine when the base was never written, or when this is the
                    # second attempt of a discard that restored it already.
                    if backend.writes_base and was != "discarding":
                        _write_info(directory, info)
                        raise
                    session = None
            if session is not None:
                session.discard()
        self._finished(directory, info, "discarded")

    def _finished(self, directory: Path, info: SessionInfo, state: SessionStateName) -> None:
        _write_info(directory, replace(info, state=state))
        _remove_directory(directory)

    def expire(self, now: float | None = None) -> builtins.list[str]:
        """Discard every kept session past its keep time; returns their run ids. A
        session in use is left for the next round; a failure is logged and skipped."""
        now = time.time() if now is None else now
        expired = []
        for info in self.list():
            if info.state != "kept" or info.keep_until is None or info.keep_until > now:
                continue
            try:
                self._expire_one(info.run_id, now)
            except (WorkspaceBusy, WorkspaceNotFound):
                continue  # in use, or committed or discarded meanwhile
            except (GatewayError, OSError) as exc:
                log.error("workspace_expiry_failed", run_id=info.run_id, error=str(exc))
                continue
            expired.append(info.run_id)
        return expired

    def _expire_one(self, run_id: str, now: float) -> None:
        with self._locked(run_id) as (directory, info):
            # Read again under the lock: a commit may have got there first.
            if info.state != "kept" or info.keep_until is None or info.keep_until > now:
                raise WorkspaceBusy(f"run {run_id}'s session changed while it expired")
            detail = _detail(info, by="expiry") | {"keptUntil": iso_time(info.keep_until)}
            self._record(AuditEvent.WORKSPACE_EXPIRED, run_id, detail)
            self._discard_locked(directory, info, None)

    # --- recovery ------------------------------------------------------------------

    def recover(self) -> builtins.list[str]:
        """At daemon start: finish or tidy what a crash left. For each session nobody
        holds: a commit's journal is finished (never a half-applied base), a discard
        finished; a session its dead run left live is unmounted, its base lease given
        back, sealed and kept; an ended one's directory removed. Returns one line per
        session it changed, saying what it did."""
        if not self.root.is_dir():
            return []
        done = []
        for entry in sorted(os.listdir(self.root)):
            directory = self.root / entry
            if RUN_ID_PATTERN.fullmatch(entry) is None or not directory.is_dir():
                continue
            try:
                info = self._read_info(directory)
            except WorkspaceNotFound:
                # A crash between mkdir and the first record: nothing of it was used;
                # unless another process is making it right now (it holds the lock).
                try:
                    os.close(_take_lock(directory, entry))
                except WorkspaceBusy:
                    continue
                self._undo_open(directory)
                done.append(f"run {entry}: removed a session that never opened")
                continue
            except WorkspaceError as exc:
                done.append(f"run {entry}: left alone: {exc}")
                continue
            try:
                fd = _take_lock(directory, entry)
            except WorkspaceBusy:
                continue
            try:
                line = self._recover_one(directory, info)
            except (GatewayError, OSError) as exc:
                line = f"run {entry}: recovery failed: {exc}"
                log.error("workspace_recovery_failed", run_id=entry, error=str(exc))
            finally:
                os.close(fd)
            if line:
                done.append(line)
                self._record(
                    AuditEvent.WORKSPACE_RECOVERED,
                    entry,
                    {"mode": info.mode, "base": str(info.base), "what": line},
                )
        return done

    def _recover_one(self, directory: Path, info: SessionInfo) -> str | None:
        """One session, its lock held; returns what was done (None: nothing to do)."""
        backend = backend_of(info.mode)
        state_dir = directory / SESSION_NAME
        if info.state in ("committed", "discarded"):
            _remove_directory(directory)
            return f"run {info.run_id}: removed the {info.state} session's leftovers"
        if state_dir.is_dir():
            # The commit's applied marker (gatewayd.workspace.commit_marker): all of it was
            # applied; recovery only drops the journal and the delta, never applies again.
            applied = is_applied(state_dir)
            # A replay is never refused (a half-applied base is worse than a wait), but
            # never runs beside another commit writing the base either.
            with self._writing_base(None, wait=True):
                finished = backend.recover_state(info.base, state_dir)
            if finished is not None:
                self._give_back(directory)
                ended: SessionStateName = "committed" if finished == "committed" else "discarded"
                self._finished(directory, info, ended)
                if applied:
                    return (
                        f"run {info.run_id}: the interrupted commit had finished (it was "
                        "wholly applied; its journal and delta are dropped)"
                    )
                what = "commit" if ended == "committed" else "discard"
                return f"run {info.run_id}: finished the interrupted {what} ({ended})"
        if info.state == "discarding":
            self._discard_locked(directory, info, None)
            return f"run {info.run_id}: finished the interrupted discard"
        try:
            session = backend.reopen(info.base, state_dir)
        except WorkspaceError as exc:
            self._give_back(directory)
            if info.state == "committing" and not backend.writes_base:
                # No journal and no applied marker: the commit never began applying (the
                # journal is written before the first write into the base, the marker
                # before the journal goes), and its delta is lost: nothing to commit.
                self._finished(directory, info, "discarded")
                return (
                    f"run {info.run_id}: the interrupted commit never began and its delta "
                    f"is lost ({exc}); {info.base} was never written: discarded"
                )
            if info.state == "committing":
                # Host: the run wrote the base; commit only drops the snapshot.
                self._finished(directory, info, "committed")
                return f"run {info.run_id}: the interrupted commit had finished"
            if backend.writes_base:
                _write_info(directory, replace(info, note=f"recovery: {exc}"))
                return f"run {info.run_id}: cannot be reopened: {exc}"
            self._finished(directory, info, "discarded")
            return f"run {info.run_id}: discarded, {exc}"
        # The view is unmounted (reopen): the base can be given back now.
        self._give_back(directory)
        if info.state == "committing":
            # No journal, no applied marker, the delta there: the commit never began
            # applying (a crash before its journal was durable); the base is as it was.
            session.close()
            until = self._keep(directory, info, note="a commit was interrupted before it began")
            return f"run {info.run_id}: the commit never began; kept until {iso_time(until)}"
        if info.state == "live":
            # A seal.json there is the run's own (written whole, atomically, at its end).
            signed = (directory / SEAL_NAME).is_file()
            # meta.json written once, by the keep (kept, with its note and time).
            sealed = self._record_seal(
                directory, info, session, record_state=False, signed_at_run_end=signed
            )
            until = self._keep(directory, sealed, note="its daemon ended during the run")
            return (
                f"run {info.run_id}: its daemon ended during the run; kept until {iso_time(until)}"
            )
        if info.keep_until is None:
            until = self._keep(directory, info, note=info.note)
            return f"run {info.run_id}: kept until {iso_time(until)}"
        return None

    def _give_back(self, directory: Path) -> None:
        """Return a base lent for the run (a dead daemon's lease) and drop the record."""
        lease = read_lease(directory)
        if lease is None:
            return
        give_back(lease)
        (directory / LEASE_FILE).unlink()


def _identity(path: Path) -> tuple[int, int]:
    st = os.stat(path, follow_symlinks=False)
    return (st.st_dev, st.st_ino)


def _require_same_base(info: SessionInfo, *, doing: str = "commit") -> None:
    """WorkspaceConflict unless the base is still the directory the session was opened
    on (not replaced, not a symlink now): ``doing`` would write into it."""
    try:
        now: tuple[int, int] | None = _identity(info.base)
        is_dir = stat.S_ISDIR(os.stat(info.base, follow_symlinks=False).st_mode)
    except OSError:
        now, is_dir = None, False
    if info.base_id is not None and (now != info.base_id or not is_dir):
        raise WorkspaceConflict(
            f"{info.base} is no longer the directory run {info.run_id} worked on (it was "
            f"replaced, moved or removed since); the {doing} would write into another "
            "directory, so nothing was written. "
            + (
                "Discard the session, or put the directory back"
                if doing == "commit"
                else "Put the directory back, or drop the session's snapshot by removing "
                "its directory in the workspace store by hand"
            ),
            ["."],
        )


def _detail(info: SessionInfo, *, by: str) -> dict[str, Any]:
    """The audit detail every workspace entry has."""
    return {"mode": info.mode, "base": str(info.base), "by": by}


def _bytes_written(root: Path, diff: WorkspaceDiff) -> int:
    """The bytes of the files ``diff`` says were added or changed under ``root`` (mode
    host: the delta's size, measured after the run)."""
    total = 0
    for rel in [*diff.added, *diff.modified, *(new for _old, new in diff.renamed)]:
        if rel.endswith("/"):
            continue
        *dirs, name = rel.split("/")
        try:
            parent = open_dirs(root, dirs)
        except OSError:
            continue
        try:
            total += os.stat(name, dir_fd=parent, follow_symlinks=False).st_size
        except OSError:
            continue
        finally:
            os.close(parent)
    return total
