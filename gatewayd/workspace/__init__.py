"""Workspace backends: the directory a run's sandbox binds, and the session operations
on it (read, write, list, diff, commit, discard). See docs/workspaces.md.

Not wired into runs yet: this package is a standalone, tested module.
"""

from gatewayd.workspace.host import HostWorkspace
from gatewayd.workspace.overlay import OverlayWorkspace, recover_commit
from gatewayd.workspace.session import WorkspaceDiff, WorkspaceError, WorkspaceSession

__all__ = [
    "HostWorkspace",
    "OverlayWorkspace",
    "WorkspaceDiff",
    "WorkspaceError",
    "WorkspaceSession",
    "recover_commit",
]
