"""The workspaces that hold apps: gatewayd's durable record of them.

An app's folder is private to the app (:mod:`gatewayd.policy.appsfolder`), and a run's
own workspace's folder is covered wherever the run can see it. But a run may see *other*
workspaces too: through a policy path that holds one, or by choosing a parent of one as
its workspace; and nothing on disk tells an apps folder from any directory named
``apps`` without reading it. So gatewayd keeps a list of the workspaces that hold apps,
and a run whose workspace or policy paths hold (or lie in) the apps folder of one it
lists is refused (:mod:`gatewayd.hostpaths.otherapps`).

A workspace is recorded **before** an app is installed into it (:func:`install_app
<gatewayd.apps.install.install_app>`, the one function the operator's command and the
install tool share), so no app exists unrecorded for long enough to be read; and when a
run starts in a workspace that holds apps which were installed otherwise (copied by
hand, installed before this record existed). An entry is dropped only when its
workspace no longer exists (checked whenever an entry is added), so the workspaces an
agent run makes and removes do not pile up; one whose apps are gone stays, since a
stale entry costs a refusal that names it, and a forgotten one could cost an app's data.

The record, ``STATE_DIR/apps-workspaces.json``::

    {"version": 1, "workspaces": ["/srv/team/ws-a", "/home/ann/notes"]}

Each entry is a real path (absolute, normalized, symlinks resolved when recorded). It is
written atomically (a temporary file, fsync, rename) under an exclusive ``flock`` on a
lock file beside it, since the operator's ``gatewayd apps install`` and the daemon write
it from different processes. A record that is absent means no workspace holds apps yet.
One that cannot be read or does not parse, or holds anything but such paths, fails
closed: :class:`AppsRecordError`, and no run starts until the operator mends or removes
it (the message says how); guessing would mean guessing which folders to protect.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from gatewayd.apps.manifest import MANIFEST_FILE
from gatewayd.errors import GatewayError
from gatewayd.files import write_atomically
from gatewayd.inputfile import InputFileError, read_input_file
from gatewayd.policy.appsfolder import APPS_DIR_NAME
from gatewayd.policy.paths import MAX_PATH_BYTES, shown

# In gatewayd's state directory.
APPS_RECORD_FILE: Final = "apps-workspaces.json"
APPS_RECORD_LOCK: Final = "apps-workspaces.lock"
APPS_RECORD_VERSION: Final = 1
# Every run's start compares its paths with every entry (a few stats each): a host with
# more workspaces holding apps than this is not one gatewayd is built for, and the cap
# keeps a damaged record from costing each start seconds.
MAX_RECORDED_WORKSPACES: Final = 4096
# 4096 entries of at most PATH_MAX bytes, JSON-quoted, with room to spare.
MAX_RECORD_BYTES: Final = 4 * 1024 * 1024
# A writer holds the lock for one read and one small atomic write; waiting longer than
# this means a writer is stuck, and the caller should say so rather than hang.
RECORD_LOCK_WAIT_S: Final = 10.0
_LOCK_POLL_S: Final = 0.02
# Whether a workspace holds apps is read from at most this many entries of its apps
# folder (one stat each): enough for any real folder, and a bound on what a run's start
# spends on a folder someone filled with names.
MAX_APPS_LOOKED_AT: Final = 1024


class AppsRecordError(GatewayError):
    """The record of workspaces holding apps cannot be read or written; gatewayd's own
    state is at fault (the message names the file and what to do)."""


def record_path(state_dir: Path) -> Path:
    """Where the record lives in ``state_dir``."""
    return state_dir / APPS_RECORD_FILE


def recorded_workspaces(state_dir: Path) -> tuple[Path, ...]:
    """The workspaces recorded as holding apps, in the order recorded; () when there is
    no record yet. Blocking.

    Error handling: :class:`AppsRecordError` when the record exists but cannot be read,
    is too large, or is not a list of real absolute paths (see the module doc).
    """
    path = record_path(state_dir)
    try:
        # "it": the message below names the file already.
        raw = read_input_file(path, max_bytes=MAX_RECORD_BYTES, what="it")
    except InputFileError as exc:
        if exc.errno == errno.ENOENT:
            return ()
        raise _unusable(path, str(exc)) from None
    return _parse(path, raw)


def record_workspace(state_dir: Path, workspace: Path) -> bool:
    """Add ``workspace`` (a real path) to the record unless it is there; whether it was
    added. Blocking; safe against other writers (a lock file beside the record).

    Error handling: :class:`AppsRecordError` for a workspace given other than as a real
    absolute path, a full or unreadable record, or a failure to write it.
    """
    problem = _entry_problem(str(workspace))
    if problem is not None:
        raise AppsRecordError(f"cannot record the workspace {workspace!s}: {problem}")
    path = record_path(state_dir)
    with _record_lock(state_dir):
        recorded = recorded_workspaces(state_dir)
        if workspace in recorded:
            return False
        # Workspaces made and removed for one run (an agent run's clone) would fill the
        # record: one that no longer exists has no apps folder left to protect.
        recorded = tuple(entry for entry in recorded if _exists(entry))
        if len(recorded) >= MAX_RECORDED_WORKSPACES:
            raise AppsRecordError(
                f"the apps record {path} already lists {MAX_RECORDED_WORKSPACES} workspaces, "
                f"the most gatewayd keeps; cannot add {workspace}: remove entries of "
                "workspaces that no longer hold apps (and whose apps/ is gone)"
            )
        text = json.dumps(
            {
                "version": APPS_RECORD_VERSION,
                "workspaces": [str(entry) for entry in (*recorded, workspace)],
            },
            indent=1,
        )
        try:
            write_atomically(path, text.encode() + b"\n")
        except OSError as exc:
            raise AppsRecordError(
                f"cannot write the apps record {path}: {exc.strerror}; the workspace "
                f"{workspace} is not recorded"
            ) from None
    return True


def holds_apps(workspace: Path) -> bool:
    """Whether ``workspace``'s apps folder holds an app: a folder in it with an
    ``APP.md`` (valid or not: a broken app's data is as private). Reads at most
    :data:`MAX_APPS_LOOKED_AT` entries; follows no symlink; False when there is no
    directory to read. Blocking."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        ws_fd = os.open(workspace, flags)
    except OSError:
        return False
    try:
        try:
            apps_fd = os.open(APPS_DIR_NAME, flags, dir_fd=ws_fd)
        except OSError:
            return False
        try:
            with os.scandir(apps_fd) as entries:
                for count, entry in enumerate(entries):
                    if count >= MAX_APPS_LOOKED_AT:
                        return True  # that many names: treat it as holding apps
                    if _is_app_folder(apps_fd, entry.name):
                        return True
        finally:
            os.close(apps_fd)
    finally:
        os.close(ws_fd)
    return False


def _exists(path: Path) -> bool:
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # unreadable is not gone: keep it
    return True


def _is_app_folder(apps_fd: int, name: str) -> bool:
    try:
        st = os.stat(f"{name}/{MANIFEST_FILE}", dir_fd=apps_fd, follow_symlinks=False)
    except (OSError, ValueError):
        return False
    return not stat.S_ISDIR(st.st_mode)


def _parse(path: Path, raw: bytes) -> tuple[Path, ...]:
    try:
        document = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise _unusable(path, f"it is not JSON ({exc})") from None
    if not isinstance(document, dict) or set(document) != {"version", "workspaces"}:
        raise _unusable(path, 'it is not an object with exactly "version" and "workspaces"')
    if document["version"] != APPS_RECORD_VERSION:
        raise _unusable(
            path, f"its version is {shown(repr(document['version']))}, not {APPS_RECORD_VERSION}"
        )
    entries = document["workspaces"]
    if not isinstance(entries, list):
        raise _unusable(path, '"workspaces" is not a list')
    if len(entries) > MAX_RECORDED_WORKSPACES:
        raise _unusable(path, f"it lists more than {MAX_RECORDED_WORKSPACES} workspaces")
    workspaces: list[Path] = []
    for index, entry in enumerate(entries):
        problem = "is not a string" if not isinstance(entry, str) else _entry_problem(entry)
        if problem is not None:
            raise _unusable(path, f"entry {index} {problem}")
        workspace = Path(entry)
        if workspace not in workspaces:
            workspaces.append(workspace)
    return tuple(workspaces)


def _entry_problem(entry: str) -> str | None:
    """What keeps ``entry`` from being a recorded workspace: a real absolute path, not
    the root (which holds every folder), with no NUL."""
    if "\0" in entry:
        return "holds a NUL byte"
    if not entry.startswith("/") or entry.startswith("//"):
        return "is not an absolute path"
    if os.path.normpath(entry) != entry:
        return "is not a normalized path (no '.', '..', empty or trailing components)"
    if entry == "/":
        return "is the root directory"
    try:
        size = len(os.fsencode(entry))
    except UnicodeEncodeError:
        return "is not a valid file name (an unpaired surrogate)"
    if size >= MAX_PATH_BYTES:
        return f"is longer than a path may be ({MAX_PATH_BYTES} bytes)"
    return None


def _unusable(path: Path, why: str) -> AppsRecordError:
    return AppsRecordError(
        f"the apps record {path} cannot be used: {why}. It lists the workspaces whose apps "
        "no other run may reach, so no run starts until it is mended (one real absolute "
        'path per entry: {"version": 1, "workspaces": ["/path/to/workspace"]}); removing '
        "it forgets them until an install or a run in each records it again"
    )


@contextlib.contextmanager
def _record_lock(state_dir: Path) -> Iterator[None]:
    lock = state_dir / APPS_RECORD_LOCK
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise AppsRecordError(
            f"cannot open the apps record's lock {lock}: {exc.strerror}"
        ) from None
    try:
        deadline = time.monotonic() + RECORD_LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise AppsRecordError(
                        f"another process has held {lock} for more than "
                        f"{RECORD_LOCK_WAIT_S:g} s; try again when it ends"
                    ) from None
                time.sleep(_LOCK_POLL_S)
        yield
    finally:
        os.close(fd)  # closing releases the lock
