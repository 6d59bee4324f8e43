"""Path grants: which host directories a run's tools may touch, and how they look from inside.

A grant pairs a host directory (``host_root``) with the path under which the
sandbox sees it (``visible_root``, e.g. ``/workspace``). Agents name files by their
visible path (absolute, or relative to ``/workspace``); the policy maps that
lexically to a grant plus path components beneath it, and the fs tools then open
those components beneath ``host_root`` without following any symlink out of it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

# Where the run's workspace appears inside the sandbox, and what relative paths
# are resolved against.
WORKSPACE_VISIBLE_ROOT = PurePosixPath("/workspace")


class PathMode(enum.StrEnum):
    RO = "ro"
    RW = "rw"


@dataclass(frozen=True, slots=True, kw_only=True)
class PathGrant:
    """One directory the run may read (``ro``) or read and write (``rw``)."""

    name: str
    host_root: Path  # absolute host path, fixed when the run is created
    visible_root: PurePosixPath  # absolute path the agent uses
    mode: PathMode
    suffixes: tuple[str, ...] = ()  # empty: any suffix
    max_file_bytes: int | None = None  # None: no policy limit (tool limits still apply)


Access = Literal["read", "write"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PathAccess:
    """A path a call wants to touch, as the agent wrote it, and how."""

    path: str
    access: Access
    size: int | None = None  # bytes a write will leave in the file, when known up front
    is_dir: bool = False  # a directory (list, stat of a dir): suffix rules do not apply


@dataclass(frozen=True, slots=True, kw_only=True)
class ResolvedPath:
    """A path mapped onto a grant: open ``parts`` beneath ``grant.host_root``."""

    grant: PathGrant
    parts: tuple[str, ...]  # no '', '.', '..' or '/' in any part; () is the root itself
    visible: str  # normalized visible path, for messages and results
    access: Access
