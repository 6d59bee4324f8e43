"""Finding a workspace's apps: ``<workspace>/apps/<id>/APP.md``, each folder on its own.

Threat model: ``apps/`` lies inside a workspace, a tree that runs, install sources and
people write. Whatever is there must not make gatewayd read outside it, block, or stop
finding the other apps:

* every component below the workspace (``apps``, the app's folder, ``APP.md``) is
  opened relative to its parent's descriptor with ``O_NOFOLLOW``: a symlink at any of
  them is refused, never followed (a link ``apps/x -> /etc`` reads nothing);
* ``APP.md`` is first opened ``O_PATH``, which opens nothing a device or FIFO would
  notice, and must be a regular file with a single link (another name of a hard-linked
  file may lie outside the workspace); only then is it opened for reading, non-blocking,
  and must be the same inode; it is read up to :data:`MAX_MANIFEST_BYTES`;
* ``data`` and ``scripts``, when present, must be directories of their own, not links;
* at most :data:`MAX_APPS_DIR_ENTRIES` entries of ``apps/`` are read and at most
  :data:`MAX_APPS` apps parsed, in name order;
* one app's problem is that app's :class:`SkippedApp` (file, line, field, reason); the
  others are still found.

Entries of ``apps/`` whose names start with ``.`` are ignored (an installer stages a
copy there before renaming it into place), and so are files beside the app folders (a
README). The workspace path itself is the operator's and is followed as given.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from gatewayd.apps.manifest import (
    MANIFEST_FILE,
    MAX_MANIFEST_BYTES,
    AppManifest,
    app_id_problem,
    parse_manifest_bytes,
)
from gatewayd.apps.problems import ManifestError, ManifestProblem
from gatewayd.audit import MAX_SAFE_MESSAGE_CHARS, AuditEvent
from gatewayd.hostpaths.beneath import describe_mode, hard_linked
from gatewayd.policy.appsfolder import APPS_DIR_NAME
from gatewayd.policy.paths import shown

if TYPE_CHECKING:
    from gatewayd.audit import AuditLog

DATA_DIR: Final = "data"
SCRIPTS_DIR: Final = "scripts"

# Every app is a tool in the tools.list of each run that may call it, and discovery
# runs at every run start: far more apps than any caller's model can choose among.
MAX_APPS: Final = 100
# What one listing of apps/ reads before it stops: a directory of a million entries
# must not hold up a run's start. Entries past it are not looked at (a skip says so).
MAX_APPS_DIR_ENTRIES: Final = 1000
# Names of further skipped folders quoted in the one "too many apps" skip.
_NAMES_QUOTED: Final = 5

_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_PATH_FLAGS: Final = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_READ_CHUNK: Final = 64 * 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class DiscoveredApp:
    """A valid app: its id (= its folder's name), folder on the host and manifest."""

    id: str
    folder: Path
    manifest: AppManifest

    @property
    def tool_name(self) -> str:
        return self.manifest.tool_name


@dataclass(frozen=True, slots=True, kw_only=True)
class SkippedApp:
    """A folder that is no usable app: ``file`` (relative to the workspace, or as the
    operator named it) and its problems, the first one's line, field and reason."""

    file: str
    problems: tuple[ManifestProblem, ...]

    @property
    def line(self) -> int | None:
        return self.problems[0].line

    @property
    def field(self) -> str | None:
        return self.problems[0].field

    @property
    def reason(self) -> str:
        return self.problems[0].reason

    def describe(self) -> str:
        """``file:line: field: reason`` of the first problem."""
        return self.problems[0].describe(self.file)

    def audit_detail(self) -> dict[str, Any]:
        """The ``app_skipped`` entry's detail (the first problem; how many there were)."""
        return {
            "file": self.file,
            "line": self.line,
            "field": self.field,
            "reason": self.reason[:MAX_SAFE_MESSAGE_CHARS],
            "problems": len(self.problems),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Discovery:
    """The apps of one workspace: the valid ones by id, and the skipped ones."""

    workspace: Path
    apps: tuple[DiscoveredApp, ...]
    skipped: tuple[SkippedApp, ...]

    def get(self, app_id: str) -> DiscoveredApp | None:
        return next((app for app in self.apps if app.id == app_id), None)


class DiscoveryError(Exception):
    """The workspace itself cannot be read (not one app's problem): ``str(exc)`` says why."""


class _Refused(Exception):
    """One app's folder or manifest is refused: the reason, with a field when one applies."""

    def __init__(self, reason: str, field: str | None = None) -> None:
        super().__init__(reason)
        self.problem = ManifestProblem(None, field, reason)


def discover_apps(workspace: Path) -> Discovery:
    """Every app in ``<workspace>/apps/`` (see the module docstring); none when there is
    no ``apps/``.

    Error handling: :class:`DiscoveryError` when ``workspace`` is not a readable
    directory. Anything wrong below it is a :class:`SkippedApp`, never an exception.
    """
    root = _open_workspace(workspace)
    try:
        try:
            apps_fd = os.open(APPS_DIR_NAME, _DIR_FLAGS, dir_fd=root)
        except FileNotFoundError:
            return Discovery(workspace=workspace, apps=(), skipped=())
        except OSError as exc:
            skip = _skip(APPS_DIR_NAME, _Refused(_not_a_folder(root, APPS_DIR_NAME, exc)))
            return Discovery(workspace=workspace, apps=(), skipped=(skip,))
        try:
            return _discover_in(workspace, apps_fd)
        finally:
            os.close(apps_fd)
    finally:
        os.close(root)


def find_app(workspace: Path, app_id: str) -> DiscoveredApp | SkippedApp | None:
    """The app ``app_id`` of ``workspace`` read as :func:`discover_apps` reads it; None
    when ``apps/<app_id>`` does not exist.

    Error handling: :class:`DiscoveryError` as for :func:`discover_apps`; an id that is
    no app id is a :class:`SkippedApp` naming the reason.
    """
    root = _open_workspace(workspace)
    try:
        try:
            apps_fd = os.open(APPS_DIR_NAME, _DIR_FLAGS, dir_fd=root)
        except FileNotFoundError:
            return None
        except OSError as exc:
            return _skip(APPS_DIR_NAME, _Refused(_not_a_folder(root, APPS_DIR_NAME, exc)))
        try:
            if app_id_problem(app_id) is None and not _exists(apps_fd, app_id):
                return None
            return _read_app(
                apps_fd, app_id, workspace / APPS_DIR_NAME / app_id, f"{APPS_DIR_NAME}/"
            )
        finally:
            os.close(apps_fd)
    finally:
        os.close(root)


def check_app_folder(folder: Path) -> DiscoveredApp | SkippedApp:
    """The app in ``folder`` (an install source, or an installed app's folder), checked as
    discovery checks it except that the folder's name need not be the app's id (an
    installed copy takes the id as its name). ``folder`` itself is followed as given.
    """
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        return _skip(str(folder), _Refused(f"cannot open the app folder: {exc.strerror}"))
    try:
        return check_app_at(fd, folder)
    finally:
        os.close(fd)


def check_app_at(folder_fd: int, folder: Path) -> DiscoveredApp | SkippedApp:
    """:func:`check_app_folder` of the folder open as ``folder_fd`` (``folder`` names it in
    messages): an installer checks the copy it made by its descriptor, never by a path."""
    source = f"{folder}/{MANIFEST_FILE}"
    try:
        _check_subfolders(folder_fd)
        manifest = parse_manifest_bytes(_read_manifest(folder_fd), source)
    except _Refused as refused:
        return _skip(str(folder), refused)
    except ManifestError as exc:
        return SkippedApp(file=exc.source, problems=exc.problems)
    return DiscoveredApp(id=manifest.name, folder=folder, manifest=manifest)


async def record_skipped_apps(
    audit: AuditLog, skipped: Sequence[SkippedApp], *, run_id: str | None = None
) -> None:
    """One ``app_skipped`` audit entry per skipped app, durable when this returns.

    Called where a run's apps are discovered (its start, and after an install), with
    that run's id; ``run_id`` None for a discovery that belongs to no run.
    """
    last: int | None = None
    for skip in skipped:
        last = audit.record(
            "event", event=AuditEvent.APP_SKIPPED, runId=run_id, detail=skip.audit_detail()
        )
    if last is not None:
        await audit.durable(last)


# --- the walk -----------------------------------------------------------------------


def _open_workspace(workspace: Path) -> int:
    try:
        return os.open(workspace, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise DiscoveryError(
            f"cannot read the workspace {shown(str(workspace))}: {exc.strerror}"
        ) from None


def _discover_in(workspace: Path, apps_fd: int) -> Discovery:
    names, truncated = _list_app_folders(apps_fd)
    apps: list[DiscoveredApp] = []
    skipped: list[SkippedApp] = []
    for name in names[:MAX_APPS]:
        found = _read_app(apps_fd, name, workspace / APPS_DIR_NAME / name, f"{APPS_DIR_NAME}/")
        if isinstance(found, DiscoveredApp):
            apps.append(found)
        else:
            skipped.append(found)
    beyond = names[MAX_APPS:]
    if beyond:
        quoted = ", ".join(shown(name) for name in beyond[:_NAMES_QUOTED])
        more = ", ..." if len(beyond) > _NAMES_QUOTED else ""
        skipped.append(
            _skip(
                APPS_DIR_NAME,
                _Refused(
                    f"{len(beyond)} app folders beyond the first {MAX_APPS} (in name order) "
                    f"were not read ({quoted}{more}); a workspace has at most {MAX_APPS} apps"
                ),
            )
        )
    if truncated:
        skipped.append(
            _skip(
                APPS_DIR_NAME,
                _Refused(
                    f"{APPS_DIR_NAME}/ holds more than {MAX_APPS_DIR_ENTRIES} entries; only the "
                    "first ones listed were looked at, so some apps may be missing"
                ),
            )
        )
    return Discovery(workspace=workspace, apps=tuple(apps), skipped=tuple(skipped))


def _list_app_folders(apps_fd: int) -> tuple[list[str], bool]:
    """The names in ``apps/`` that may be app folders (directories and symlinks, not
    hidden), sorted; and whether the listing stopped at its cap."""
    names: list[str] = []
    truncated = False
    with os.scandir(apps_fd) as entries:
        for count, entry in enumerate(entries):
            if count >= MAX_APPS_DIR_ENTRIES:
                truncated = True
                break
            if entry.name.startswith("."):
                continue
            try:
                candidate = entry.is_symlink() or entry.is_dir(follow_symlinks=False)
            except OSError:  # raced away
                continue
            if candidate:
                names.append(entry.name)
    return sorted(names), truncated


def _read_app(apps_fd: int, name: str, folder: Path, prefix: str) -> DiscoveredApp | SkippedApp:
    """The app in ``apps/<name>``; every refusal a :class:`SkippedApp`."""
    where = f"{prefix}{shown(name)}"
    problem = app_id_problem(name)
    if problem is not None:
        return _skip(where, _Refused(f"the folder's name {problem}", "name"))
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=apps_fd)
    except OSError as exc:
        return _skip(where, _Refused(_not_a_folder(apps_fd, name, exc)))
    source = f"{where}/{MANIFEST_FILE}"
    try:
        _check_subfolders(fd)
        manifest = parse_manifest_bytes(_read_manifest(fd), source)
    except _Refused as refused:
        return _skip(where, refused)
    except ManifestError as exc:
        return SkippedApp(file=exc.source, problems=exc.problems)
    finally:
        os.close(fd)
    if manifest.name != name:
        return _skip(
            source,
            _Refused(
                f"the manifest's name {manifest.name!r} is not its folder's name {name!r}: "
                f"app {manifest.name!r} lives in {APPS_DIR_NAME}/{manifest.name}/",
                "name",
            ),
        )
    return DiscoveredApp(id=name, folder=folder, manifest=manifest)


def _skip(file: str, refused: _Refused) -> SkippedApp:
    return SkippedApp(file=file, problems=(refused.problem,))


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # there, but unreadable: _read_app says why
    return True


def _not_a_folder(dir_fd: int, name: str, exc: OSError) -> str:
    """Why ``name`` could not be opened as a folder, in words."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return f"{shown(name)} cannot be opened: {exc.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return (
            f"{shown(name)} is a symlink; app folders are never reached through a "
            "symlink, which could lead out of the workspace: move the folder itself here"
        )
    if not stat.S_ISDIR(st.st_mode):
        return f"{shown(name)} is {_kind(st.st_mode)}, not a folder"
    return f"{shown(name)} cannot be opened: {exc.strerror}"


def _check_subfolders(folder_fd: int) -> None:
    """``data`` and ``scripts``, when present, are directories of their own: they are
    lent to the app's sandbox, so a link there would lend whatever it points to."""
    for name in (DATA_DIR, SCRIPTS_DIR):
        try:
            st = os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise _Refused(f"cannot look at {name}/: {exc.strerror}", name) from None
        if not stat.S_ISDIR(st.st_mode):
            raise _Refused(
                f"{name} is {_kind(st.st_mode)}; an app's {name}/ must be a directory of its own "
                "(a link would lend the app whatever it points to)",
                name,
            )


def _read_manifest(folder_fd: int) -> bytes:
    """The bytes of ``APP.md`` in ``folder_fd`` (see the module docstring for the checks)."""
    try:
        probe = os.open(MANIFEST_FILE, _PATH_FLAGS, dir_fd=folder_fd)
    except FileNotFoundError:
        raise _Refused(
            f"there is no {MANIFEST_FILE}; an app folder holds its manifest, {MANIFEST_FILE}"
        ) from None
    except OSError as exc:
        raise _Refused(f"cannot open {MANIFEST_FILE}: {exc.strerror}") from None
    try:
        st = os.fstat(probe)
    finally:
        os.close(probe)
    if stat.S_ISLNK(st.st_mode):
        raise _Refused(
            f"{MANIFEST_FILE} is a symlink; a manifest is a regular file in its app's "
            "folder, never a link (which could lead out of the workspace)"
        )
    if not stat.S_ISREG(st.st_mode):
        raise _Refused(f"{MANIFEST_FILE} is {_kind(st.st_mode)}, not a regular file")
    if hard_linked(st):
        raise _Refused(
            f"{MANIFEST_FILE} has several hard links, and another of its names may be a "
            "file from outside the workspace, so only a file with a single link is read: "
            "copy it to get one"
        )
    if st.st_size > MAX_MANIFEST_BYTES:
        raise _Refused(_too_large())
    try:
        fd = os.open(MANIFEST_FILE, _READ_FLAGS, dir_fd=folder_fd)
    except OSError as exc:
        raise _Refused(f"cannot read {MANIFEST_FILE}: {exc.strerror}") from None
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(now.st_mode):
            raise _Refused(f"{MANIFEST_FILE} was replaced while it was read; try again")
        chunks: list[bytes] = []
        total = 0
        while total <= MAX_MANIFEST_BYTES:
            chunk = os.read(fd, min(_READ_CHUNK, MAX_MANIFEST_BYTES + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise _Refused(f"cannot read {MANIFEST_FILE}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if total > MAX_MANIFEST_BYTES:  # it grew while we read
        raise _Refused(_too_large())
    return b"".join(chunks)


def _kind(mode: int) -> str:
    return "a regular file" if stat.S_ISREG(mode) else f"a {describe_mode(mode)}"


def _too_large() -> str:
    return (
        f"{MANIFEST_FILE} is larger than {MAX_MANIFEST_BYTES} bytes; an app's manifest is a "
        "system prompt and its rules"
    )
