"""Which directories may be lendable roots (:mod:`gatewayd.sandbox.lendable` says what
lending is and the other checks): the rules on the paths alone, and the defaults.

A module of its own, importing nothing of gatewayd, nor pathlib: a client command that
resolves the control socket (gatewayd/cli/options.py) checks the default roots against
the state directory as the configuration would, without loading the configuration's
models.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Iterable

# typing's flag without importing typing: client commands start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Final

    # A path as a string or a pathlib path: the daemon's are paths, a client's strings.
    AnyPath = str | os.PathLike[str]

# Where workspaces live on a fresh host; the tests put theirs under /tmp.
DEFAULT_LENDABLE_ROOTS: Final[tuple[str, ...]] = ("/home", "/tmp", "/var/tmp")
# Trees that hold the system, root's own files or the kernel's: no lendable root may lie
# at, above or beneath one, and no bind mount may bring one under a root.
SYSTEM_TREES: Final[tuple[str, ...]] = (
    "/usr",
    "/etc",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/boot",
    "/opt",
    "/root",
    "/run",
    "/proc",
    "/sys",
    "/dev",
    "/var/lib",
    "/var/cache",
    "/var/log",
    "/var/spool",
    "/var/mail",
    "/var/backups",
    "/snap",
)
# Never a root themselves, though a root beneath them may be: / holds everything, and
# /srv holds the data of the host's services (a web root served as root, say); an
# operator who keeps workspaces there names the directory that holds them
# (/srv/workspaces), never /srv.
NEVER_ROOTS: Final[tuple[str, ...]] = ("/", "/srv")


# --- the roots (pure) --------------------------------------------------------------------


def root_problem(root: str, reserved: Iterable[tuple[str, AnyPath]] = ()) -> str | None:
    """Why ``root`` cannot be a lendable root, or None when it can. ``reserved`` are
    gatewayd's own directories by setting name (``state_dir``, ``agent_dir``): a root
    at or beneath one would lend gatewayd's state."""
    if not is_clean_absolute(root):
        return f"{root!r} must be an absolute, normalized path (no '..', '.', '//')"
    if root == "/":
        return "/ holds the whole system; name the directory that holds the workspaces"
    if root in NEVER_ROOTS:
        return (
            f"{root} itself holds the host's service data; name the directory beneath it that "
            f"holds the workspaces (e.g. {root}/workspaces)"
        )
    for tree in SYSTEM_TREES:
        if is_within(root, tree):
            return f"{root} lies in the system tree {tree}, which is never lent"
        if is_within(tree, root):
            return f"{root} holds the system tree {tree}, which is never lent"
    for setting, path in reserved:
        if is_within(root, os.fspath(path)):
            return f"{root} lies in gatewayd's own {setting} {path}, which is never lent"
    return None


def real_root_problem(root: AnyPath, reserved: Iterable[tuple[str, AnyPath]] = ()) -> str | None:
    """:func:`root_problem` of ``root`` as written, then of its real path (symlinks and
    ``..`` resolved as the host has them now): a root that is a symlink into a system
    tree (``/var/run`` is ``/run``) or into gatewayd's own directories is no root either.
    ``reserved`` must be real paths. Reads the file system."""
    written = os.fspath(root)
    problem = root_problem(written, reserved)
    if problem is not None:
        return problem
    real = os.path.realpath(written)
    if real == written:
        return None
    problem = root_problem(real, reserved)
    return None if problem is None else f"{root} is really {real}, and {problem}"


def is_clean_absolute(path: str) -> bool:
    """``path`` is absolute and normalized: no ``..``, ``.``, ``//`` or trailing ``/``."""
    return (
        path.startswith("/")
        and not path.startswith("//")
        and posixpath.normpath(path) == path
        and "\0" not in path
    )


def is_within(path: str, tree: str) -> bool:
    """``path`` is ``tree`` or lies beneath it (both clean absolute paths)."""
    return tree in ("/", path) or path.startswith(tree + "/")
