"""Path grants: which host directories a run's tools may touch, and how they look from inside.

A grant pairs a host directory (``host_root``) with the path under which the
sandbox sees it (``visible_root``, e.g. ``/workspace``). Agents name files by their
visible path (absolute, or relative to ``/workspace``); the policy maps that
lexically to a grant plus path components beneath it, and the fs tools then open
those components beneath ``host_root`` without following any symlink out of it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Final, Literal

# Where the run's workspace appears inside the sandbox, and what relative paths
# are resolved against.
WORKSPACE_VISIBLE_ROOT = PurePosixPath("/workspace")

# Linux's PATH_MAX: a longer path cannot be opened anyway, and refusing it early keeps
# the work per call and the size of error messages bounded. The policy checks bytes;
# the fs tools' argument schemas use it as a (looser) character limit.
MAX_PATH_BYTES: Final = 4096
# Longest path quoted in a message: the agent wrote the path, so it could be 4 KiB of
# noise or terminal escapes; a message (and the audit line) only needs enough to
# recognise it.
MAX_SHOWN_PATH_CHARS: Final = 200


def shown(text: str) -> str:
    """``text`` (a path or name the agent wrote) made safe and short for a message:
    cut to :data:`MAX_SHOWN_PATH_CHARS` and control characters escaped."""
    if len(text) > MAX_SHOWN_PATH_CHARS:
        text = text[: MAX_SHOWN_PATH_CHARS - 1] + "…"
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


class PathMode(enum.StrEnum):
    RO = "ro"
    RW = "rw"


@dataclass(frozen=True, slots=True, kw_only=True)
class PathGrant:
    """One directory the run may read (``ro``) or read and write (``rw``).

    ``root_id`` pins the root's identity: a writable grant may contain this grant's
    root (``reference`` inside ``/workspace``), and the agent can replace that
    directory, by name, with a symlink to ``/`` or with another directory. The fs
    tools open ``host_root`` without following a final symlink and refuse it unless
    its (device, inode) is still ``root_id``.

    ``holds_nested`` says another grant's root lies inside this one on the host: a
    symlink here could then lead into that grant and read it under this grant's
    rules (a ``.md``-only grant's ``key.pem``), so the fs tools follow no symlink at
    all beneath this root.

    ``apps_parts`` says where the workspace's apps folder lies beneath this root (its
    components: ``("apps",)`` for the workspace itself), or None when it lies outside
    it: no call reaches a path there (:mod:`gatewayd.policy.appsfolder`).
    """

    name: str
    host_root: Path  # absolute host path, resolved when the run is created
    root_id: tuple[int, int]  # (st_dev, st_ino) of host_root when the run was created
    holds_nested: bool  # another grant's host root lies strictly beneath host_root
    visible_root: PurePosixPath  # absolute path the agent uses
    mode: PathMode
    suffixes: tuple[str, ...] = ()  # empty: any suffix
    max_file_bytes: int | None = None  # None: no policy limit (tool limits still apply)
    apps_parts: tuple[str, ...] | None = None  # the apps folder beneath host_root, if there


def holds_nested(root: Path, roots: Iterable[Path]) -> bool:
    """Whether another of ``roots`` lies strictly beneath ``root``: what a grant's
    ``holds_nested`` says."""
    return any(other != root and other.is_relative_to(root) for other in roots)


Access = Literal["read", "write"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PathAccess:
    """A path a call wants to touch, as the agent wrote it, and how."""

    path: str
    access: Access
    size: int | None = None  # bytes a write will leave in the file, when known up front
    # Names and metadata only, never contents (fs.list, fs.stat): suffix rules, which
    # say whose contents may be read, do not apply.
    metadata_only: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class ResolvedPath:
    """A path mapped onto a grant: open ``parts`` beneath ``grant.host_root``."""

    grant: PathGrant
    parts: tuple[str, ...]  # no '', '.', '..' or '/' in any part; () is the root itself
    visible: str  # normalized visible path, for messages and results
    access: Access
