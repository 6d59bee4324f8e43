"""A per-run MCP server's workspace paths against the calling run's agent
(gatewayd/mcp/child.py workspace_grants): the agent owns the files and can put symlinks
where the operator declared directories, before the server starts or while it is being
started; the server must only ever see what the checks judged, inside the caller's
workspace and outside its apps folder."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import trio

from gatewayd.mcp import child as child_module
from gatewayd.mcp.child import ServerUnavailable, workspace_grants
from gatewayd.mcp.declaration import McpServerDeclaration
from gatewayd.policy import RunRules, TokenBucket, load_policy_text
from gatewayd.policy.paths import WORKSPACE_VISIBLE_ROOT, PathGrant, PathMode
from gatewayd.runs import Grant, Run, RunRequest, RunSpec

POLICY = """
version: 1
name: mcp-paths
require_os_sandbox: false
"""


def caller(workspace: Path) -> Run:
    """A run whose one grant is its whole workspace, read-only."""
    policy = load_policy_text(POLICY, "mcp-paths.yaml")
    st = os.stat(workspace)
    grant = PathGrant(
        name="workspace",
        host_root=workspace,
        root_id=(st.st_dev, st.st_ino),
        holds_nested=False,
        visible_root=WORKSPACE_VISIBLE_ROOT,
        mode=PathMode.RO,
        apps_parts=("apps",),
    )
    spec = RunSpec(
        runId="0123456789abcdef0123456789abcdef",
        request=RunRequest(
            workspacePath=str(workspace),
            policy=policy.name,
            actorId="tester",
            tenantId="t1",
            grant=Grant(allowSandbox=True),
        ),
        workspace=workspace,
        policy=policy,
        policy_source="mcp-paths.yaml",
        grants=(grant,),
        rules=RunRules(tool_patterns=(), run_tool_ids=None, grants=(grant,)),
    )
    return Run(
        spec=spec,
        directory=workspace / "run",
        socket_path=workspace / "run" / "gateway.sock",
        bucket=TokenBucket(rate=1, burst=1),
        limiter=trio.CapacityLimiter(1),
    )


def declared(path: str) -> McpServerDeclaration:
    return McpServerDeclaration.model_validate(
        {"command": ["/bin/true"], "workspace_paths": [{"path": path, "mode": "ro"}]}
    )


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    root = (tmp_path / "ws").resolve()
    (root / "repo" / "src").mkdir(parents=True)
    (root / "apps" / "notes" / "data").mkdir(parents=True)
    (tmp_path / "outside" / "src").mkdir(parents=True)
    return root


def test_a_declared_directory_is_granted_read_only_at_its_identity(workspace: Path) -> None:
    (grant,) = workspace_grants("srv", declared("repo/src"), caller(workspace))
    st = os.stat(workspace / "repo" / "src")
    assert grant.host_root == workspace / "repo" / "src"
    assert grant.root_id == (st.st_dev, st.st_ino)
    assert grant.mode is PathMode.RO
    assert grant.visible_root == WORKSPACE_VISIBLE_ROOT / "repo" / "src"


@pytest.mark.parametrize("target", ["apps", "apps/notes/data", "APPS/notes"])
def test_a_symlink_into_the_apps_folder_is_refused(workspace: Path, target: str) -> None:
    """The agent replaces the declared directory with a symlink to the apps folder,
    every app's data, which no sandbox sees."""
    os.rename(workspace / "repo", workspace / "repo.old")
    (workspace / "repo").symlink_to(workspace / target)
    if target.startswith("APPS"):
        os.rename(workspace / "apps", workspace / "APPS")
    with pytest.raises(ServerUnavailable, match=r"apps folder \(.*\), which no sandbox sees"):
        workspace_grants("srv", declared("repo"), caller(workspace))


def test_a_symlink_out_of_the_workspace_is_refused(workspace: Path) -> None:
    os.rename(workspace / "repo", workspace / "repo.old")
    (workspace / "repo").symlink_to(workspace.parent / "outside")
    with pytest.raises(ServerUnavailable, match="leads out of the calling run's workspace"):
        workspace_grants("srv", declared("repo/src"), caller(workspace))


def test_a_component_swapped_for_a_symlink_during_the_checks_is_refused(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race: the path is judged inside the workspace, then the agent swaps a
    component for a symlink out of it before the identity the sandbox binds is taken.
    The identity must be of the judged directory, or nothing."""
    judged = child_module._covering_grant

    def swap_then_judge(run: Run, host: Path) -> Any:
        found = judged(run, host)
        os.rename(workspace / "repo", workspace / "repo.old")
        (workspace / "repo").symlink_to(workspace.parent / "outside")
        return found

    monkeypatch.setattr(child_module, "_covering_grant", swap_then_judge)
    with pytest.raises(ServerUnavailable, match="changed while it was checked"):
        workspace_grants("srv", declared("repo/src"), caller(workspace))


def test_a_declared_file_is_refused_saying_declare_directories(workspace: Path) -> None:
    (workspace / "repo" / "f").write_text("x")
    with pytest.raises(ServerUnavailable, match="declare directories"):
        workspace_grants("srv", declared("repo/f"), caller(workspace))
