"""The workspace's apps folder: no run, and no tool a run calls, reads or writes it.

``<workspace>/apps/`` holds the installed apps: each app's manifest, its scripts and the
data only that app may write. Everyone else reaches an app only by calling its tool
(``app_<id>``), whose calls the app's own rules review; a run that could read the folder
would read every app's data, and one that could write it would plant an app or rewrite
another's rules. So, whatever a run's policy grants:

* the policy step refuses every path at or beneath the folder, however it is written
  (``apps/x``, ``/workspace/apps``, ``./apps``, ``apps/../apps``, ``//workspace/apps/``)
  with ``policy_denied`` (:func:`in_apps_folder`, used by
  :func:`gatewayd.policy.decide.resolve_path`);
* the fs tools follow no symlink beneath a root holding the folder while it exists, and
  refuse a directory that *is* the folder by its (device, inode), whatever name reached
  it (:mod:`gatewayd.hostpaths.beneath`); ``fs.list`` never shows it;
* the OS sandbox covers it with an empty read-only tmpfs wherever a bind shows it
  (:mod:`gatewayd.sandbox.plan`), so a symlink resolved inside the sandbox meets the
  cover, and refuses a run whose apps folder holds a file with a hard link outside it
  (:mod:`gatewayd.sandbox.appsfolder`).

Another workspace's apps folder is no run's either: gatewayd records the workspaces that
hold apps, and a run whose workspace or policy path holds or lies in the folder of one
of them is refused when it is created (:func:`apps_folder_overlap` compares the names;
:mod:`gatewayd.hostpaths.otherapps` also the identities, and says why it refuses rather
than covers).

The folder's name is compared ignoring case (``str.casefold``: ``APPS``, ``Apps``, and
``apps`` spelled with the long s, U+017F). Linux names are case-sensitive, so on most
file systems ``APPS`` is another directory; but a workspace may live on one that folds
case (ext4 or f2fs with casefold directories, vfat, exFAT, CIFS), where ``APPS/x`` opens
the apps folder itself and a ``fs.write`` to ``APPS/evil/APP.md`` would plant an app.
Refusing every spelling costs a name nobody needs and holds on every file system.

Pure: no I/O. Paths here are real host paths (resolved when the run is created) and
components beneath a grant's root.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import PurePath
from typing import Final

from gatewayd.policy.paths import shown

# The folder's name inside the workspace (``<workspace>/apps/<app-id>/APP.md``).
APPS_DIR_NAME: Final = "apps"

# Why a path in the apps folder is refused, and what the caller may do instead.
APPS_FOLDER_REASON: Final = (
    "The apps folder belongs to the apps: no run or tool reads or writes it, and an app "
    "is reached only by calling its tool (app_<id>; tools.list shows those this run may "
    "call)"
)


def is_apps_name(name: str) -> bool:
    """Whether ``name`` spells the apps folder's name, in any case (see the module doc)."""
    return name.casefold() == APPS_DIR_NAME


def in_apps_folder(parts: Sequence[str], apps_parts: Sequence[str] | None) -> bool:
    """Whether ``parts`` (components beneath a grant's root) lie at or beneath the apps
    folder, which lies at ``apps_parts`` beneath the same root (None: not beneath it).
    Every component but the folder's own name must match exactly; that one in any case."""
    if not apps_parts or len(parts) < len(apps_parts):
        return False
    depth = len(apps_parts) - 1
    return tuple(parts[:depth]) == tuple(apps_parts[:depth]) and is_apps_name(parts[depth])


def apps_parts_beneath(root: PurePath, workspace: PurePath) -> tuple[str, ...] | None:
    """Where the apps folder of ``workspace`` lies beneath ``root`` (both real host
    paths), as components; None when ``root`` does not hold the workspace."""
    if not workspace.is_relative_to(root):
        return None
    return (*workspace.relative_to(root).parts, APPS_DIR_NAME)


def lies_in_apps_folder(path: PurePath, workspace: PurePath) -> bool:
    """Whether the real host path ``path`` is the apps folder of ``workspace`` or lies
    beneath it (in any spelling of its name)."""
    return path.is_relative_to(workspace) and in_apps_folder(
        path.relative_to(workspace).parts, (APPS_DIR_NAME,)
    )


def apps_folder_overlap(root: PurePath, workspace: PurePath) -> str | None:
    """How the real host path ``root`` (a run's workspace or a policy path's root)
    overlaps the apps folder of ``workspace`` (a real host path), by their names:
    ``"lies in"`` when ``root`` is the folder or lies beneath it (its name in any case),
    ``"holds"`` when the folder lies beneath ``root``, None when they are apart. Names
    only: another name of the same directory (a case-folding file system's spelling of
    a parent, a bind mount) is for the caller to compare by (device, inode)."""
    if lies_in_apps_folder(root, workspace):
        return "lies in"
    if (workspace / APPS_DIR_NAME).is_relative_to(root):
        return "holds"
    return None


def apps_folder_message(
    path: str, folder: str, *, write: bool, spelled: str = APPS_DIR_NAME
) -> str:
    """The refusal of ``path`` (as the caller wrote it, made safe by the caller) at or
    beneath the apps folder seen at ``folder``, whose name the path spells ``spelled``."""
    verb = "write to" if write else "read"
    case = (
        ""
        if spelled == APPS_DIR_NAME
        else f" ('{shown(spelled)}' is its name in another case, which some file systems "
        "do not tell apart)"
    )
    return f"Cannot {verb} '{path}': it lies in the apps folder '{folder}'{case}. " + (
        APPS_FOLDER_REASON
    )
