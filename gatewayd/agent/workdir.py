"""An agent run's work directory in ``agent_dir``: made fresh, marked as gatewayd's and
locked while its run lives; what a crashed run left is removed at the next daemon start.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import shutil
import stat
from pathlib import Path
from typing import Final

import structlog

from gatewayd.errors import GatewayError
from gatewayd.sandbox.lease import mount_points_under
from gatewayd.workspace.overlay import unmount

log = structlog.get_logger("gatewayd.agent")

# A work directory of agent_dir: its name, the marker that says gatewayd made it, and
# the lock its run holds (the start-up sweep removes only unlocked, marked ones).
WORK_NAME_BYTES: Final = 8
_WORK_NAME_RE: Final = re.compile(rf"[0-9a-f]{{{2 * WORK_NAME_BYTES}}}")
WORK_MARKER: Final = ".cogni-agent-run"


class AgentDirError(GatewayError):
    """agent_dir is not gatewayd's private directory (a misconfiguration)."""


def make_work_dir(parent: Path) -> tuple[Path, int]:
    """A fresh work directory, marked as gatewayd's and locked while the run lives
    (returns the lock's descriptor; closing it releases the lock)."""
    try:
        parent.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        st = os.lstat(parent)
        if (
            not stat.S_ISDIR(st.st_mode)
            or st.st_uid != os.geteuid()
            or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        ):
            raise AgentDirError(
                f"agent_dir {parent} must be a directory of gatewayd's own user that no one "
                "else may write (as gatewayd makes it: mode 0700); choose another agent_dir"
            ) from None
    work = parent / secrets.token_hex(WORK_NAME_BYTES)
    work.mkdir(mode=0o700)
    lock = os.open(work / WORK_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    return work, lock


def sweep_leftovers(agent_dir: Path) -> list[str]:
    """:func:`remove_leftovers` at the daemon's start: never raises; a failure is logged
    and reported as the list's one entry."""
    try:
        return remove_leftovers(agent_dir)
    except Exception as exc:
        log.warning("agent_leftover_cleanup_failed", error=str(exc))
        return [f"cleanup failed: {exc}"]


def remove_leftovers(agent_dir: Path) -> list[str]:
    """What a crashed agent run left in ``agent_dir`` (an overlay still mounted, a
    checkout still the run uid's): unmounted and removed. Called at daemon start. Only
    directories gatewayd made are touched (a 16-hex name and the marker inside), and only
    when no live run holds the marker's lock: an ``agent_dir`` pointed at the wrong place
    or shared with another daemon loses nothing. Returns the work directories removed."""
    if not agent_dir.is_dir():
        return []
    removed = []
    for entry in sorted(agent_dir.iterdir()):
        if entry.is_symlink() or not entry.is_dir() or not _WORK_NAME_RE.fullmatch(entry.name):
            continue
        if not _abandoned(entry):
            continue
        # Deepest first: the merged view before anything mounted beneath its directory.
        for point in sorted(mount_points_under(entry), key=len, reverse=True):
            unmount(Path(point), detach=True)
        remove_tree(entry)
        removed.append(entry.name)
    return removed


def _abandoned(work: Path) -> bool:
    """Does ``work`` carry gatewayd's marker, with no live run holding its lock?"""
    try:
        fd = os.open(work / WORK_MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def remove_tree(path: Path) -> None:
    """The agent's work directory, whoever owns what in it (the run's uid did)."""
    shutil.rmtree(path, ignore_errors=True)
