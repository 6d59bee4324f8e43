"""Workspace backends: the directory a run's sandbox binds, and the session operations
on it (read, write, list, diff, commit, discard). See docs/workspaces.md.

Agent runs (gatewayd/agent/loop.py) run on a session of either backend; `gatewayd run`
still binds the workspace directory itself.
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
