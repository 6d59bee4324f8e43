"""Other workspaces' apps folders: no run holds one, nor runs inside one.

A run's own workspace's apps folder is hidden wherever the run could see it (the policy
step, the fs tools, the sandbox's cover: :mod:`gatewayd.policy.appsfolder`). Another
workspace's folder would be an ordinary directory to the run: visible through a policy
path that holds that workspace (``home: {root: /srv/team, mode: ro}``), and visible,
writable and lent to the run's uid when a client picks a parent of that workspace as the
run's workspace; a run could then read every app's data there, rewrite an app's rules or
plant an app. gatewayd records every workspace that holds apps
(:mod:`gatewayd.apps.workspaces`), and a run is **refused** (``bad_request``, a message
naming the folder and the fix) when its workspace or any policy path's root

* holds the apps folder of a recorded workspace other than its own (the folder lies at
  or beneath the root), or
* lies in one (the root is the folder, or beneath it: ``ws-a/apps/notes/data``).

Refused, not covered: a writable root holding the folder could rename or replace the
directories on the way to it, so no cover placed by path stays over it (the sandbox plan
refuses such a cover already), and lending the root would hand the folder's files to
the run's uid; a read-only root could be covered, but one rule for every root is the one
an operator can predict, and naming a directory beside the other workspace is always
possible. (The run's *own* apps folder inside a root is covered as before.)

Each root is compared with each recorded folder twice: by name (the real paths, the
folder's name in any case), and by identity, so another name of a directory on the way
(a case-folding file system's ``WS-A``, a bind mount of the workspace) does not slip by:
the (device, inode) of the root and of each directory above it, found by opening ``..``
from the root itself, against those of the folder and each directory above *it*. A
folder that does not exist (yet) is compared by name and through its nearest existing
parent: an install may make it while the run lives.

Checked when a run is created (:meth:`gatewayd.runs.registry.RunRegistry.create`),
before anything of the run is made or lent; the run's own workspace is recorded then if
it holds apps (installed by hand, or before the record existed).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from gatewayd.apps.workspaces import (
    APPS_RECORD_FILE,
    holds_apps,
    record_workspace,
    recorded_workspaces,
)
from gatewayd.errors import GatewayError
from gatewayd.policy.appsfolder import APPS_DIR_NAME, apps_folder_overlap
from gatewayd.policy.paths import PathGrant
from gatewayd.protocol import ErrorCode

Identity = tuple[int, int]  # (st_dev, st_ino)

_PATH_FLAGS: Final = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC


class OtherAppsFolderHeld(GatewayError):
    """The run's workspace or a policy path holds, or lies in, another workspace's apps
    folder (the run's request or policy is at fault); nothing of the run was made."""

    code = ErrorCode.BAD_REQUEST


def guard_apps_folders(
    state_dir: Path, workspace: Path, grants: Sequence[PathGrant]
) -> tuple[Path, ...]:
    """Record ``workspace`` if it holds apps, then refuse the run if its workspace or a
    grant's root holds or lies in another recorded workspace's apps folder (see the
    module doc). Returns the other recorded workspaces' apps folders (real paths), for
    the sandbox's start to check for hard links. ``workspace`` and the grants' roots are
    real paths. Blocking.

    Error handling: :class:`OtherAppsFolderHeld` naming the root, the folder and the fix;
    :class:`~gatewayd.apps.workspaces.AppsRecordError` when the record cannot be read or
    written.
    """
    recorded = recorded_workspaces(state_dir)
    if workspace not in recorded and holds_apps(workspace):
        record_workspace(state_dir, workspace)
    others = other_workspaces(workspace, recorded)
    roots = [("its workspace", workspace)]
    roots.extend((f"its policy path {grant.name!r}", grant.host_root) for grant in grants)
    refuse_held_folders(roots, others)
    return tuple(other / APPS_DIR_NAME for other in others)


def other_apps_folders(state_dir: Path, workspace: Path) -> tuple[Path, ...]:
    """The apps folders (real paths) of the recorded workspaces other than ``workspace``.
    Blocking. Error handling: :class:`~gatewayd.apps.workspaces.AppsRecordError`."""
    others = other_workspaces(workspace, recorded_workspaces(state_dir))
    return tuple(other / APPS_DIR_NAME for other in others)


def other_workspaces(workspace: Path, recorded: Sequence[Path]) -> tuple[Path, ...]:
    """The recorded workspaces that are not ``workspace``, by name or by identity."""
    own = _identity(workspace)
    return tuple(
        other
        for other in recorded
        if other != workspace and (own is None or _identity(other) != own)
    )


def refuse_held_folders(roots: Sequence[tuple[str, Path]], others: Sequence[Path]) -> None:
    """Refuse the first root (``(what it is, its real path)``) that holds or lies in the
    apps folder of a workspace of ``others``. Blocking (a few ``open``/``fstat`` each).

    Error handling: :class:`OtherAppsFolderHeld`.
    """
    if not others:
        return
    folders = [(other, _ancestry(other / APPS_DIR_NAME)) for other in others]
    for what, root in roots:
        root_chain = _chain_from(root)
        root_id = root_chain[0] if root_chain else None
        for other, (folder_id, folder_chain) in folders:
            relation = apps_folder_overlap(root, other)
            if relation is None and folder_id is not None and folder_id in root_chain:
                relation = "lies in"
            if relation is None and root_id is not None and root_id in folder_chain:
                relation = "holds"
            if relation is not None:
                raise OtherAppsFolderHeld(_message(what, root, relation, other))


def _message(what: str, root: Path, relation: str, other: Path) -> str:
    # Short enough for the audit entry's message (paths are the operator's own).
    fix = (
        f"name the directories the run needs beside {other} instead"
        if relation == "holds"
        else "name a directory outside it"
    )
    return (
        f"run refused: {what} {root} {relation} {other / APPS_DIR_NAME}, another workspace's "
        f"apps folder: no other run may hold it or run inside it. To start, {fix} "
        f"(workspaces holding apps: {APPS_RECORD_FILE} in gatewayd's state directory)"
    )


def _identity(path: Path) -> Identity | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def _ancestry(folder: Path) -> tuple[Identity | None, frozenset[Identity]]:
    """The folder's identity (None when it cannot be opened as a directory), and the
    identities of it and every directory above it: from the folder itself, or from its
    nearest parent that exists."""
    for candidate in (folder, *folder.parents):
        chain = _chain_from(candidate)
        if chain:
            return (chain[0] if candidate == folder else None), frozenset(chain)
    return None, frozenset()


def _chain_from(path: Path) -> list[Identity]:
    """(device, inode) of ``path`` (followed as given) and of every directory above it,
    by opening ``..`` from it: the directories really above it, whatever names led
    there. Empty when ``path`` cannot be opened as a directory."""
    try:
        fd = os.open(path, _PATH_FLAGS)
    except OSError:
        return []
    chain: list[Identity] = []
    try:
        while True:
            st = os.fstat(fd)
            here = (st.st_dev, st.st_ino)
            if here in chain:  # the root is its own parent
                return chain
            chain.append(here)
            parent = os.open("..", _PATH_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = parent
    finally:
        os.close(fd)
