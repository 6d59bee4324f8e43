"""Binding a policy's path rules to a run's host directories: the run's grants.

The policy names directories as text (relative roots inside the workspace, absolute
roots on the host); a run needs them pinned to what is on disk when it starts. So each
root is resolved once (symlinks followed), must be a directory, a relative one must stay
inside the workspace, and its (device, inode) is recorded: the fs tools and workspaces
(:mod:`gatewayd.hostpaths.beneath`) refuse a root that was later swapped for a symlink or
another directory. This is the only place a policy's paths touch the filesystem before a
call.

The workspace's apps folder is no grant's to give (:mod:`gatewayd.policy.appsfolder`):
a root in it is refused, and a root holding it records where (``apps_parts``), so every
call refuses it.
"""

from __future__ import annotations

import stat
from pathlib import Path

from gatewayd.policy.appsfolder import APPS_DIR_NAME, apps_parts_beneath, lies_in_apps_folder
from gatewayd.policy.model import PathRule, Policy, PolicyError
from gatewayd.policy.paths import PathGrant, PathMode, holds_nested


def bind_paths(policy: Policy, workspace: Path) -> tuple[PathGrant, ...]:
    """Turn the policy's path rules into grants for a run whose workspace is ``workspace``.

    Relative roots become ``workspace/root`` on the host and ``/workspace/root`` inside;
    absolute roots stay as they are on the host and appear at ``mount`` (default: the same
    path). Host roots are resolved (symlinks followed) now, once, and each root's
    (device, inode) is pinned in ``root_id``: the fs tools refuse a root that was later
    swapped for a symlink or another directory. A grant whose host root contains
    another grant's is marked ``holds_nested`` (no symlink is followed beneath it).

    Error handling: a missing workspace or root, a root that is not a directory, a
    relative root that resolves outside the workspace, or a root in the workspace's apps
    folder is a :class:`PolicyError`.
    """
    source = f"policy {policy.name!r}"
    rules = policy.filesystem.paths
    if not rules:
        return ()
    try:
        base = workspace.resolve(strict=True)
    except OSError as exc:
        raise PolicyError(source, [f"workspace {workspace}: {exc.strerror}"]) from None
    if not base.is_dir():
        raise PolicyError(source, [f"workspace {workspace} is not a directory"])
    bound: list[tuple[str, PathRule, Path, tuple[int, int]]] = []
    for name, rule in rules.items():
        where = f"filesystem.paths.{name}.root"
        wanted = Path(rule.root) if rule.is_absolute else base / rule.root
        try:
            host_root = wanted.resolve(strict=True)
            # stat of the resolved path: no symlink left to follow in it.
            st = host_root.stat()
        except OSError as exc:
            raise PolicyError(source, [f"{where}: {wanted}: {exc.strerror}"]) from None
        if not stat.S_ISDIR(st.st_mode):
            raise PolicyError(source, [f"{where}: {wanted} is not a directory"])
        if not rule.is_absolute and not host_root.is_relative_to(base):
            raise PolicyError(
                source,
                [
                    f"{where}: {wanted} resolves to {host_root}, outside the workspace "
                    f"{base}; a relative root must stay inside the workspace"
                ],
            )
        if lies_in_apps_folder(host_root, base):
            raise PolicyError(
                source,
                [
                    f"{where}: {wanted} lies in the workspace's apps folder "
                    f"{base / APPS_DIR_NAME}, which no run reads or writes (an app is "
                    "reached only by calling its tool)"
                ],
            )
        bound.append((name, rule, host_root, (st.st_dev, st.st_ino)))
    roots = [host_root for _, _, host_root, _ in bound]
    return tuple(
        PathGrant(
            name=name,
            host_root=host_root,
            root_id=root_id,
            holds_nested=holds_nested(host_root, roots),
            visible_root=rule.visible_root,
            mode=PathMode(rule.mode),
            suffixes=rule.suffixes,
            max_file_bytes=rule.max_file_bytes,
            apps_parts=apps_parts_beneath(host_root, base),
        )
        for name, rule, host_root, root_id in bound
    )
