"""Installing an app: copy a source folder into ``<workspace>/apps/<id>/``, safely.

Threat model: the source folder may be hostile (later, ``install_app`` takes one from a
run's workspace). Nothing in it may make gatewayd read outside it, block, fill the disk,
or overwrite another app; and a crash at any moment must lose no app's ``data/``.

* **The source.** It is opened with ``O_NOFOLLOW`` (a symlinked source is refused) and
  walked by descriptors, each entry opened relative to its parent with ``O_NOFOLLOW``
  and checked on its descriptor. Only directories and regular files with a single link
  are copied. **Any symlink is refused**, even one that stays inside: whether it stays
  inside depends on where it is resolved (a relative link that stays inside the source
  may lead out once the copy sits elsewhere, and the app's sandbox resolves it in its
  own mount tree), discovery refuses links where an app's folder is lent anyway, and an
  app needs none. FIFOs, sockets and devices are refused (opening a FIFO blocks; a
  device is no file), and so is a file with several hard links (another of its names
  may be a file from outside the source, ``/etc/shadow`` linked into a workspace).
  A source inside the workspace's ``apps/`` (or holding it) is refused: it would copy
  another app's folder, its ``data/`` included, or the installer's own staging.
* **Caps.** :data:`MAX_INSTALL_FILES`, :data:`MAX_INSTALL_ENTRIES`, :data:`MAX_INSTALL_BYTES`,
  :data:`MAX_INSTALL_FILE_BYTES` and :data:`MAX_INSTALL_DEPTH`, counted while copying
  (a file that grows while it is read is caught too).
* **The target.** ``apps/`` (made if missing, mode :data:`APPS_FOLDER_MODE`) and
  everything in it are opened relative to the workspace's descriptor with
  ``O_NOFOLLOW``. The copy is built in ``apps/.staging-<random>`` (discovery ignores
  names starting with ``.``), fsynced, its copied ``APP.md`` validated by its
  descriptor as discovery reads it (the id is the manifest's ``name``; the source's
  folder name does not matter), ``data/`` made if missing, then renamed into place in
  one atomic step (``renameat2``: ``RENAME_NOREPLACE`` for a new app, so an id made
  meanwhile is never overwritten; ``RENAME_EXCHANGE`` for a replacement).
* **One installer at a time** per workspace: an exclusive ``flock`` on ``apps/``, waited
  for at most :data:`INSTALL_LOCK_WAIT_S`. Two installs of one id: the second waits,
  then finds the app installed and is refused (unless it replaces).

Replacing keeps ``data/``. The old ``data/`` is moved (renamed, never copied, so no
path an attacker could swap is read) into the new folder, which is first renamed
``.replacing-<id>``; then the two folders swap names. A crash can leave:

1. ``.staging-<random>``: a copy in progress, no app's data in it -> removed;
2. ``.replacing-<id>`` holding ``data/`` while ``apps/<id>`` has none (the crash fell
   between moving ``data/`` and the swap): ``data/`` is moved back into ``apps/<id>``,
   which is the old app, intact -> then 3;
3. ``.replacing-<id>`` without ``data/``: a new copy never swapped in, or the old
   folder after the swap -> removed.

:func:`recover_leftovers` does this at the start of every install, under the lock, and
says what it did. A ``.replacing-<id>`` that holds ``data/`` while ``apps/<id>`` also
has one (or is gone) is left alone and named: which copy to keep is the operator's call.

We write the copy ourselves: ``shutil.copytree`` follows the source by path, has no
caps, and copies FIFOs and devices as they are; ``shutil.rmtree(dir_fd=...)``, which
never follows a symlink on Linux, removes leftovers.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final

from gatewayd.apps.discovery import DATA_DIR, DiscoveredApp, check_app_at
from gatewayd.apps.manifest import MANIFEST_FILE, AppManifest
from gatewayd.apps.workspaces import AppsRecordError, record_workspace
from gatewayd.audit import AuditEvent
from gatewayd.files import RENAME_EXCHANGE, RENAME_NOREPLACE, fsync_dir_fd, rename_at, write_all
from gatewayd.hostpaths.beneath import describe_mode, hard_linked
from gatewayd.policy.appsfolder import APPS_DIR_NAME
from gatewayd.policy.paths import shown

if TYPE_CHECKING:
    from gatewayd.audit import AuditLog

# An app is a manifest, a few scripts and seed data, not a data set: a thousand files
# is far beyond any, and each copied file costs an open, a write and an fsync.
MAX_INSTALL_FILES: Final = 1000
# What one install may add to the workspace's disk; an app's own data grows in data/
# afterwards, under its own limits.
MAX_INSTALL_BYTES: Final = 64 * 1024 * 1024
# One script or seed file; a bigger one is a data set to fetch, not to install.
MAX_INSTALL_FILE_BYTES: Final = 16 * 1024 * 1024
# Every entry of the source, folders included: empty folders cost no bytes but a
# directory block, an inode and an fsync each, and a listing is read whole before it
# is sorted, so its length is bounded here, while it is read.
MAX_INSTALL_ENTRIES: Final = 2 * MAX_INSTALL_FILES
# Directory levels below the source folder: deep enough for any script tree, and it
# bounds the descriptors the walk holds open at once (one per level).
MAX_INSTALL_DEPTH: Final = 16
# How long an install waits for another one in the same workspace to end: a copy of
# MAX_INSTALL_BYTES takes seconds; longer means a stuck installer, said so.
INSTALL_LOCK_WAIT_S: Final = 30.0
_LOCK_POLL_S: Final = 0.05

# apps/ when an install makes it: the mode a run's start makes it with
# (gatewayd.sandbox.appsfolder), so either may make it first.
APPS_FOLDER_MODE: Final = 0o755
# An app's folder, its subfolders and files are the daemon's, readable by the app's
# sandbox (which gets its own uid); only the executable bit of a source file is kept.
FOLDER_MODE: Final = 0o755
FILE_MODE: Final = 0o644
EXECUTABLE_FILE_MODE: Final = 0o755
# data/: the daemon's alone until an invocation lends it to the app's own uid; no other
# host user reads an app's state.
DATA_MODE: Final = 0o700
# The staging folder is nobody's to read while it is built.
_STAGING_MODE: Final = 0o700

STAGING_PREFIX: Final = ".staging-"
REPLACING_PREFIX: Final = ".replacing-"

_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_WRITE_FLAGS: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK: Final = 1024 * 1024

# Judges a copied app (its manifest) against the installed one it replaces (None: none).
Vet = Callable[[AppManifest, AppManifest | None], None]


class InstallError(Exception):
    """The install was refused or failed; nothing was installed or replaced. ``str(exc)``
    names the file or folder, what is wrong and what to do."""


@dataclass(frozen=True, slots=True, kw_only=True)
class InstalledApp:
    """What an install did: the app, where it went, whether it replaced one (and kept its
    ``data/``), what was copied, and what the recovery of leftovers did first."""

    app: DiscoveredApp
    replaced: bool
    kept_data: bool
    files: int
    bytes: int
    recovered: tuple[str, ...] = field(default=())

    @property
    def id(self) -> str:
        return self.app.id

    @property
    def tool_name(self) -> str:
        return self.app.tool_name

    def audit_detail(self) -> dict[str, object]:
        """The ``app_installed`` entry's detail."""
        return {
            "app": self.id,
            "tool": self.tool_name,
            "replaced": self.replaced,
            "keptData": self.kept_data,
            "files": self.files,
            "bytes": self.bytes,
        }


def install_app(
    source: Path,
    workspace: Path,
    *,
    replace: bool = False,
    state_dir: Path | None = None,
    source_fd: int | None = None,
    vet: Vet | None = None,
) -> InstalledApp:
    """Install the app folder ``source`` into ``workspace`` (see the module docstring).

    ``source``'s parents and ``workspace`` itself are the operator's paths, followed as
    given; ``source`` itself and everything beneath ``workspace`` are not.

    ``state_dir``: gatewayd's state directory, where the workspace (its real path) is
    recorded as holding apps **before** anything is copied, so that no run holds its
    apps folder (:mod:`gatewayd.apps.workspaces`). Every caller in gatewayd passes it;
    None records nothing (tests of the copy alone).

    ``source_fd``: the source folder already open for reading (the ``install_app`` tool
    opens it beneath its caller's grant, following no symlink); ``source`` then only
    names it in messages. The descriptor stays the caller's.

    ``vet``: called under the lock with the copied app's manifest and the installed one
    it would replace (None: a new app, or one that discovery skips), before anything is
    put in place; whatever it raises refuses the install (the ``install_app`` tool's: a
    replacement from inside a run may not loosen the app's rules).

    Resource handling: every descriptor is closed, the lock released, and the staging
    folder removed on any failure.

    Error handling: :class:`InstallError` for every refusal and failure; the workspace's
    apps are then as they were (a leftover a crash leaves is recovered next time).
    """
    src_fd = _open_source(source) if source_fd is None else os.dup(source_fd)
    try:
        ws_fd = _open_workspace(workspace)
        try:
            if state_dir is not None:
                _record_workspace(state_dir, ws_fd)
            apps_fd = _open_apps_folder(ws_fd, workspace)
            try:
                _refuse_source_in_apps(src_fd, apps_fd, source, workspace)
                with _install_lock(apps_fd, workspace):
                    try:
                        recovered = recover_leftovers(apps_fd)
                        return _install_locked(
                            src_fd, apps_fd, source, workspace, replace, recovered, vet
                        )
                    except OSError as exc:
                        raise InstallError(
                            f"installing {source} into {workspace}/{APPS_DIR_NAME}/ failed: {exc}; "
                            "nothing was installed (what was left is cleaned up by the next "
                            "install)"
                        ) from None
            finally:
                os.close(apps_fd)
        finally:
            os.close(ws_fd)
    finally:
        os.close(src_fd)


async def record_app_installed(
    audit: AuditLog, installed: InstalledApp, *, run_id: str | None = None
) -> None:
    """The ``app_installed`` audit entry, durable when this returns (``run_id``: the run
    whose call installed it; None for an operator's install through the daemon)."""
    seq = audit.record(
        "event", event=AuditEvent.APP_INSTALLED, runId=run_id, detail=installed.audit_detail()
    )
    await audit.durable(seq)


# --- opening ---------------------------------------------------------------------------


def _open_source(source: Path) -> int:
    try:
        return os.open(source, _DIR_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and source.is_symlink()):
            raise InstallError(
                f"the source {source} is a symlink; name the app folder itself "
                f"({os.path.realpath(source)} if that is the one you mean)"
            ) from None
        if exc.errno == errno.ENOTDIR:
            raise InstallError(
                f"the source {source} is not a folder; an app source is a folder holding "
                f"{MANIFEST_FILE}"
            ) from None
        raise InstallError(f"cannot open the source {source}: {exc.strerror}") from None


def _record_workspace(state_dir: Path, ws_fd: int) -> None:
    """Record the opened workspace, by the real path of the directory opened (not the
    name given, which may be a symlink or change meanwhile), as holding apps."""
    real = Path(os.readlink(f"/proc/self/fd/{ws_fd}"))
    try:
        record_workspace(state_dir, real)
    except AppsRecordError as exc:
        raise InstallError(f"{exc}; nothing was installed") from None


def _open_workspace(workspace: Path) -> int:
    try:
        return os.open(workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise InstallError(f"cannot open the workspace {workspace}: {exc.strerror}") from None


def _open_apps_folder(ws_fd: int, workspace: Path) -> int:
    """``apps/`` of the workspace, made if missing; never through a symlink."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(APPS_DIR_NAME, APPS_FOLDER_MODE, dir_fd=ws_fd)
    try:
        return os.open(APPS_DIR_NAME, _DIR_FLAGS, dir_fd=ws_fd)
    except OSError as exc:
        try:
            st = os.stat(APPS_DIR_NAME, dir_fd=ws_fd, follow_symlinks=False)
        except OSError:
            st = None
        if st is not None and not stat.S_ISDIR(st.st_mode):
            raise InstallError(
                f"{workspace}/{APPS_DIR_NAME} is a {describe_mode(st.st_mode)}, not a folder; "
                "apps are installed into a real folder there (never through a link): "
                "remove it and install again"
            ) from None
        raise InstallError(f"cannot open {workspace}/{APPS_DIR_NAME}: {exc.strerror}") from None


def _refuse_source_in_apps(src_fd: int, apps_fd: int, source: Path, workspace: Path) -> None:
    """Refuse a source at or below ``apps/``: walk up from the source by ``..`` (no path
    strings, so no other name of the folder slips by) comparing with ``apps/``."""
    apps_id = _identity(os.fstat(apps_fd))
    fd = os.open(".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=src_fd)
    try:
        while True:
            here = _identity(os.fstat(fd))
            if here == apps_id:
                raise InstallError(
                    f"the source {source} lies in {workspace}/{APPS_DIR_NAME}/, where apps are "
                    "installed (an installed app, its data or an install under way): "
                    "install from a folder outside it"
                )
            parent = os.open("..", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
            if _identity(os.fstat(parent)) == here:  # the root
                os.close(parent)
                return
            os.close(fd)
            fd = parent
    finally:
        os.close(fd)


@contextlib.contextmanager
def _install_lock(apps_fd: int, workspace: Path) -> Iterator[None]:
    deadline = time.monotonic() + INSTALL_LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(apps_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise InstallError(
                    f"another install into {workspace}/{APPS_DIR_NAME}/ has run for more than "
                    f"{INSTALL_LOCK_WAIT_S:g} s; try again when it ends"
                ) from None
            time.sleep(_LOCK_POLL_S)
    try:
        yield
    finally:
        fcntl.flock(apps_fd, fcntl.LOCK_UN)


# --- the install, under the lock -------------------------------------------------------


def _install_locked(
    src_fd: int,
    apps_fd: int,
    source: Path,
    workspace: Path,
    replace: bool,
    recovered: tuple[str, ...],
    vet: Vet | None = None,
) -> InstalledApp:
    staging = STAGING_PREFIX + secrets.token_hex(8)
    os.mkdir(staging, _STAGING_MODE, dir_fd=apps_fd)
    try:
        stage_fd = os.open(staging, _DIR_FLAGS, dir_fd=apps_fd)
        try:
            copier = _Copier(source, _identity(os.fstat(apps_fd)), workspace)
            copier.copy_dir(src_fd, stage_fd, "", 0)
            app = _validate_copy(stage_fd, source)
            target = workspace / APPS_DIR_NAME / app.id
            existing = _existing_app(apps_fd, app.id, workspace)
            if existing and not replace:
                raise InstallError(
                    f"app {app.id!r} is already installed in {workspace}/{APPS_DIR_NAME}/{app.id}; "
                    "to replace it (its data/ is kept) install again with --replace"
                )
            if vet is not None:
                vet(app.manifest, _installed_manifest(apps_fd, app.id) if existing else None)
            kept_data = False
            if existing:
                # The replacement's data/ is the installed one, moved in just before the
                # swap; until then the copy has none, so a crash leaves no second data/
                # that recovery could confuse with the app's own.
                _drop_source_data(stage_fd)
            else:
                _ensure_data(stage_fd)
            os.fchmod(stage_fd, FOLDER_MODE)  # from the staging's own mode to an app's
            fsync_dir_fd(stage_fd)
        finally:
            os.close(stage_fd)
        if existing:
            kept_data = _swap_in(apps_fd, staging, app.id, workspace)
        else:
            _move_in(apps_fd, staging, app.id, workspace)
    except BaseException:
        _remove_quietly(apps_fd, staging)
        raise
    fsync_dir_fd(apps_fd)
    return InstalledApp(
        app=DiscoveredApp(id=app.id, folder=target, manifest=app.manifest),
        replaced=existing,
        kept_data=kept_data,
        files=copier.files,
        bytes=copier.bytes,
        recovered=recovered,
    )


def _validate_copy(stage_fd: int, source: Path) -> DiscoveredApp:
    """The copied ``APP.md``, read by descriptor as discovery reads it."""
    found = check_app_at(stage_fd, source)
    if not isinstance(found, DiscoveredApp):
        problems = "; ".join(problem.describe(found.file) for problem in found.problems)
        raise InstallError(
            f"the source is not a valid app: {problems} "
            f"(`gatewayd apps check {source}` lists every problem)"
        )
    return found


def _existing_app(apps_fd: int, app_id: str, workspace: Path) -> bool:
    try:
        st = os.stat(app_id, dir_fd=apps_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        raise InstallError(
            f"{workspace}/{APPS_DIR_NAME}/{app_id} is a {describe_mode(st.st_mode)}, not an app "
            "folder; it is not replaced (a link could lead anywhere): remove it and install again"
        )
    return True


def _installed_manifest(apps_fd: int, app_id: str) -> AppManifest | None:
    """The manifest of the installed ``apps/<app_id>`` as discovery reads it; None when
    discovery would skip it (it is then no app, with no rules in force)."""
    fd = os.open(app_id, _DIR_FLAGS, dir_fd=apps_fd)
    try:
        found = check_app_at(fd, Path(app_id))
    finally:
        os.close(fd)
    if not isinstance(found, DiscoveredApp) or found.manifest.name != app_id:
        return None
    return found.manifest


def _drop_source_data(stage_fd: int) -> None:
    """A replacement keeps the installed ``data/``, so the source's seed data is not used."""
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(DATA_DIR, dir_fd=stage_fd)


def _ensure_data(stage_fd: int) -> None:
    with contextlib.suppress(FileExistsError):
        os.mkdir(DATA_DIR, DATA_MODE, dir_fd=stage_fd)
    os.chmod(DATA_DIR, DATA_MODE, dir_fd=stage_fd, follow_symlinks=False)


def _move_in(apps_fd: int, staging: str, app_id: str, workspace: Path) -> None:
    try:
        rename_at(apps_fd, staging, apps_fd, app_id, RENAME_NOREPLACE)
    except FileExistsError:
        raise InstallError(
            f"app {app_id!r} appeared in {workspace}/{APPS_DIR_NAME}/ while this install ran; "
            "nothing was changed: install again (with --replace to replace it)"
        ) from None
    except OSError as exc:
        raise InstallError(_rename_failed(workspace, exc)) from None


def _swap_in(apps_fd: int, staging: str, app_id: str, workspace: Path) -> bool:
    """Replace ``apps/<app_id>`` by the staged copy, moving the old ``data/`` into it
    (see the module docstring for the order and what a crash leaves); whether a
    ``data/`` was kept."""
    replacing = REPLACING_PREFIX + app_id
    old_fd = os.open(app_id, _DIR_FLAGS, dir_fd=apps_fd)
    try:
        try:
            rename_at(apps_fd, staging, apps_fd, replacing, RENAME_NOREPLACE)
        except FileExistsError:
            raise InstallError(
                f"{workspace}/{APPS_DIR_NAME}/{replacing}, left by an interrupted replacement, "
                f"still holds a data/ of app {app_id!r}; keep the one you want in "
                f"{APPS_DIR_NAME}/{app_id}/data, remove {replacing}, and install again"
            ) from None
        except OSError as exc:
            raise InstallError(_rename_failed(workspace, exc)) from None
        fsync_dir_fd(apps_fd)
        new_fd = os.open(replacing, _DIR_FLAGS, dir_fd=apps_fd)
        try:
            # A real folder's data/ only: discovery refuses a link there, and a link is
            # never moved into the new app.
            kept = _is_real_dir(old_fd, DATA_DIR)
            if kept:
                os.rename(DATA_DIR, DATA_DIR, src_dir_fd=old_fd, dst_dir_fd=new_fd)
                fsync_dir_fd(old_fd)
            else:
                _ensure_data(new_fd)
            fsync_dir_fd(new_fd)
        finally:
            os.close(new_fd)
        _exchange(apps_fd, replacing, app_id, workspace)
        fsync_dir_fd(apps_fd)
    except BaseException:
        os.close(old_fd)
        # The new copy (under either name) holds no data now or is recovered: give the
        # old app its data back, if it was moved, and remove the copy. What cannot be put
        # right now is put right by the next install.
        with contextlib.suppress(OSError):
            recover_leftovers(apps_fd)
        raise
    os.close(old_fd)
    _remove_quietly(apps_fd, replacing)
    return kept


def _exchange(apps_fd: int, replacing: str, app_id: str, workspace: Path) -> None:
    try:
        rename_at(apps_fd, replacing, apps_fd, app_id, RENAME_EXCHANGE)
    except OSError as exc:
        raise InstallError(_rename_failed(workspace, exc)) from None


def _rename_failed(workspace: Path, exc: OSError) -> str:
    if exc.errno == errno.EINVAL:
        return (
            f"the file system of {workspace}/{APPS_DIR_NAME}/ cannot rename atomically "
            "(renameat2 NOREPLACE/EXCHANGE), which a safe install needs: keep the "
            "workspace on ext4, xfs, btrfs or tmpfs"
        )
    return f"cannot move the app into {workspace}/{APPS_DIR_NAME}/: {exc.strerror}"


# --- leftovers -------------------------------------------------------------------------


def recover_leftovers(apps_fd: int) -> tuple[str, ...]:
    """Put right what an interrupted install left in ``apps/`` (the module docstring's
    three states); what was done or left alone, one sentence each. Call under the lock."""
    notes: list[str] = []
    with os.scandir(apps_fd) as entries:
        names = sorted(entry.name for entry in entries)
    for name in names:
        if name.startswith(STAGING_PREFIX):
            _remove_quietly(apps_fd, name)
            notes.append(f"removed {shown(name)}, a copy an interrupted install left")
        elif name.startswith(REPLACING_PREFIX):
            notes.append(_recover_replacing(apps_fd, name, name[len(REPLACING_PREFIX) :]))
    if notes:
        fsync_dir_fd(apps_fd)
    return tuple(notes)


def _recover_replacing(apps_fd: int, name: str, app_id: str) -> str:
    try:
        left_fd = os.open(name, _DIR_FLAGS, dir_fd=apps_fd)
    except OSError:
        return f"left {shown(name)} alone: it is not a folder"
    try:
        if not _is_real_dir(left_fd, DATA_DIR):
            _remove_quietly(apps_fd, name)
            return f"removed {shown(name)}, the rest of an interrupted replacement of {app_id}"
        try:
            app_fd = os.open(app_id, _DIR_FLAGS, dir_fd=apps_fd)
        except OSError:
            return (
                f"left {shown(name)} alone: it holds the data/ of app {app_id}, which is "
                "no longer installed; move it back by hand or remove it"
            )
        try:
            if _exists_at(app_fd, DATA_DIR):
                return (
                    f"left {shown(name)} alone: it holds a data/ of app {app_id}, which has "
                    f"one too; keep the one you want in {APPS_DIR_NAME}/{app_id}/data and remove "
                    f"{shown(name)}"
                )
            os.rename(DATA_DIR, DATA_DIR, src_dir_fd=left_fd, dst_dir_fd=app_fd)
            fsync_dir_fd(left_fd)
            fsync_dir_fd(app_fd)
        finally:
            os.close(app_fd)
    finally:
        os.close(left_fd)
    _remove_quietly(apps_fd, name)
    return f"moved the data/ of app {app_id} back from an interrupted replacement"


def _remove_quietly(apps_fd: int, name: str) -> None:
    """Remove ``apps/<name>`` (never following a link); one that cannot be removed now is
    removed by the next install's recovery."""
    with contextlib.suppress(OSError):
        shutil.rmtree(name, dir_fd=apps_fd)


def _is_real_dir(dir_fd: int, name: str) -> bool:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return stat.S_ISDIR(st.st_mode)


def _exists_at(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _identity(st: os.stat_result) -> tuple[int, int]:
    return (st.st_dev, st.st_ino)


# --- the copy --------------------------------------------------------------------------


class _Copier:
    """Copies a source tree by descriptors, counting against the caps."""

    def __init__(self, source: Path, apps_id: tuple[int, int], workspace: Path) -> None:
        self.source = source
        # apps/ itself: a source holding it (the workspace, or a folder with a bind mount
        # of it) would copy the apps and the copy in progress.
        self.apps_id = apps_id
        self.workspace = workspace
        self.files = 0
        self.bytes = 0
        self.entries = 0

    def copy_dir(self, src_fd: int, dst_fd: int, rel: str, depth: int) -> None:
        names = []
        with os.scandir(src_fd) as entries:
            for entry in entries:
                self.entries += 1
                if self.entries > MAX_INSTALL_ENTRIES:
                    raise InstallError(
                        f"the source {self.source} holds more than {MAX_INSTALL_ENTRIES} "
                        "files and folders; an app is a manifest, scripts and seed data: "
                        "leave the rest out"
                    )
                names.append(entry.name)
        for name in sorted(names):
            where = f"{rel}{name}"
            st = os.stat(name, dir_fd=src_fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                self._copy_subdir(src_fd, dst_fd, name, where, depth + 1)
            elif stat.S_ISREG(st.st_mode):
                self._copy_file(src_fd, dst_fd, name, where)
            else:
                raise InstallError(self._refusal(where, st.st_mode))
        fsync_dir_fd(dst_fd)

    def _copy_subdir(self, src_fd: int, dst_fd: int, name: str, where: str, depth: int) -> None:
        if depth > MAX_INSTALL_DEPTH:
            raise InstallError(
                f"{self._at(where)} is more than {MAX_INSTALL_DEPTH} folders deep; an app "
                "source is at most that deep: flatten it"
            )
        try:
            sub_src = os.open(name, _DIR_FLAGS, dir_fd=src_fd)
        except OSError as exc:
            raise InstallError(f"cannot open {self._at(where)}: {exc.strerror}") from None
        try:
            if _identity(os.fstat(sub_src)) == self.apps_id:
                raise InstallError(
                    f"the source {self.source} holds {self.workspace}/{APPS_DIR_NAME}/ (at "
                    f"{shown(where)}), where apps are installed: install from the app's "
                    "own folder"
                )
            os.mkdir(name, FOLDER_MODE, dir_fd=dst_fd)
            sub_dst = os.open(name, _DIR_FLAGS, dir_fd=dst_fd)
            try:
                self.copy_dir(sub_src, sub_dst, f"{where}/", depth)
            finally:
                os.close(sub_dst)
        finally:
            os.close(sub_src)

    def _copy_file(self, src_fd: int, dst_fd: int, name: str, where: str) -> None:
        self.files += 1
        if self.files > MAX_INSTALL_FILES:
            raise InstallError(
                f"the source {self.source} holds more than {MAX_INSTALL_FILES} files; an "
                "app is a manifest, scripts and seed data: leave the rest out"
            )
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=src_fd)
        except OSError as exc:
            raise InstallError(f"cannot read {self._at(where)}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # replaced since it was looked at
                raise InstallError(self._refusal(where, st.st_mode))
            if hard_linked(st):
                raise InstallError(
                    f"{self._at(where)} has several hard links, and another of its names "
                    "may be a file from outside the source, so it is not copied: make it a "
                    "copy of its own (cp it to a new name)"
                )
            if st.st_size > MAX_INSTALL_FILE_BYTES:
                raise InstallError(self._too_large(where))
            mode = EXECUTABLE_FILE_MODE if st.st_mode & 0o111 else FILE_MODE
            self._copy_bytes(fd, dst_fd, name, where, mode)
        finally:
            os.close(fd)

    def _copy_bytes(self, fd: int, dst_fd: int, name: str, where: str, mode: int) -> None:
        out = os.open(name, _WRITE_FLAGS, mode, dir_fd=dst_fd)
        try:
            size = 0
            while chunk := os.read(fd, _CHUNK):
                size += len(chunk)
                self.bytes += len(chunk)
                if size > MAX_INSTALL_FILE_BYTES:  # it grew while it was read
                    raise InstallError(self._too_large(where))
                if self.bytes > MAX_INSTALL_BYTES:
                    raise InstallError(
                        f"the source {self.source} holds more than {MAX_INSTALL_BYTES} "
                        f"bytes (reached at {where}); an app is at most that: leave large "
                        "files out"
                    )
                write_all(out, chunk)
            os.fchmod(out, mode)  # the umask may have taken bits off
            os.fsync(out)
        finally:
            os.close(out)

    def _too_large(self, where: str) -> str:
        return (
            f"{self._at(where)} is larger than {MAX_INSTALL_FILE_BYTES} bytes, the most one "
            "file of an app may hold: leave it out, or have the app fetch it"
        )

    def _at(self, where: str) -> str:
        return f"{self.source}/{shown(where)}"

    def _refusal(self, where: str, mode: int) -> str:
        kind = describe_mode(mode)
        if stat.S_ISLNK(mode):
            return (
                f"{self._at(where)} is a symlink; an app source may hold no links (one "
                "could lead out of it wherever it is installed): replace it by the file "
                "or folder it points to"
            )
        return (
            f"{self._at(where)} is a {kind}; an app source holds only folders and "
            "regular files: remove it"
        )
