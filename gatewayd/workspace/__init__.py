"""Workspace backends: the directory a run's sandbox binds, and the session operations
on it (read, write, list, diff, commit, discard). See docs/workspaces.md.

Agent runs (gatewayd/agent/loop.py) run on a session of their own; every other run's
session lives in the session store (:mod:`gatewayd.workspace.store`, imported on its
own: it is not re-exported here), which keeps it after the run until it is committed,
discarded or expires.
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
