"""How a run's grants decide the workspace's bind in its sandbox plan: a ``ro`` grant on
the workspace itself (``root: .``) binds /workspace read-only, with the policy paths
beneath it mounted after it; anything else keeps the view the caller gave."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

import pytest

from gatewayd.policy.paths import PathGrant, PathMode
from gatewayd.sandbox.plan import ETC_ALLOWLIST, Bind, HostLayout, RoBind, SandboxPlan
from gatewayd.sandbox.session import (
    CommandLimits,
    SandboxSettings,
    SandboxView,
    UnsafeMounts,
    _plan,
    _policy_mounts,
    _refuse_writable_workspace,
    sandbox_view,
)

WORKSPACE = Path("/srv/work/project")
LAYOUT = HostLayout(system_links=(("bin", "usr/bin"),), system_dirs=(), etc_entries=ETC_ALLOWLIST)


def grant(name: str, root: str, mode: PathMode, visible: str | None = None) -> PathGrant:
    host = WORKSPACE if root == "." else WORKSPACE / root
    return PathGrant(
        name=name,
        host_root=host,
        root_id=(1, 1),
        holds_nested=False,
        visible_root=PurePosixPath(
            visible or ("/workspace" if root == "." else f"/workspace/{root}")
        ),
        mode=mode,
    )


def plan_for(grants: list[PathGrant], view: SandboxView, tmp_path: Path) -> SandboxPlan:
    state = Path(os.path.realpath(tmp_path)) / "state"
    return _plan(
        run_id="run-0123abcd",
        settings=SandboxSettings(
            bwrap="/usr/bin/bwrap",
            netns_prefix="cgt-",
            state_dir=state,
            cogni_tool_dir=state / "cogni-tool",
            layout=LAYOUT,
        ),
        workspace=WORKSPACE,
        mounts=_policy_mounts(grants, WORKSPACE),
        socket_path=state / "runs" / "run-0123abcd" / "gateway.sock",
        netns_path=Path("/run/netns/cgt-run"),
        env_names=(),
        image_dir=None,
        limits=CommandLimits(
            timeout_s=30,
            cpu_s=20,
            memory_mb=512,
            max_processes=32,
            max_file_mb=64,
            max_open_files=256,
            max_output_bytes=65536,
            tmp_mb=64,
        ),
        command=["true"],
        env_values={},
        view=sandbox_view(grants, WORKSPACE, view),
    )


def workspace_steps(plan: SandboxPlan) -> list[tuple[str, str, str]]:
    """(kind, source, destination) of every bind at or beneath /workspace, in order."""
    return [
        (type(step).__name__, step.src, step.dest)
        for step in plan.steps
        if isinstance(step, Bind | RoBind) and step.dest.startswith("/workspace")
    ]


def test_a_read_only_grant_on_the_workspace_binds_it_read_only_before_its_rw_paths(
    tmp_path: Path,
) -> None:
    grants = [
        grant("out", "out", PathMode.RW),
        grant("workspace", ".", PathMode.RO),
        grant("docs", "docs", PathMode.RO),
    ]
    assert workspace_steps(plan_for(grants, SandboxView(), tmp_path)) == [
        ("RoBind", str(WORKSPACE), "/workspace"),
        ("RoBind", f"{WORKSPACE}/docs", "/workspace/docs"),
        ("Bind", f"{WORKSPACE}/out", "/workspace/out"),
    ]


@pytest.mark.parametrize(
    "grants",
    [
        [grant("workspace", ".", PathMode.RW)],
        [grant("out", "out", PathMode.RW)],  # no grant on the workspace itself
        [],  # no filesystem section
        # The workspace's directory granted ro elsewhere: /workspace is still the
        # commands' writable working directory (only a ro grant on "." changes that).
        [grant("mirror", ".", PathMode.RO, visible="/data")],
    ],
    ids=["rw", "sub-path-only", "none", "elsewhere"],
)
def test_without_a_read_only_grant_on_it_the_workspace_stays_writable(
    grants: list[PathGrant], tmp_path: Path
) -> None:
    assert sandbox_view(grants, WORKSPACE, SandboxView()) == SandboxView()
    steps = workspace_steps(plan_for(grants, SandboxView(), tmp_path))
    assert steps[0] == ("Bind", str(WORKSPACE), "/workspace")


def test_an_apps_read_only_view_stays_read_only_whatever_the_grants(tmp_path: Path) -> None:
    view = SandboxView(workspace_read_only=True, gateway_socket=False, cwd="/workspace/out")
    grants = [grant("workspace", ".", PathMode.RW), grant("out", "out", PathMode.RW)]
    assert sandbox_view(grants, WORKSPACE, view) is view
    assert workspace_steps(plan_for(grants, view, tmp_path)) == [
        ("RoBind", str(WORKSPACE), "/workspace"),
        ("Bind", f"{WORKSPACE}/out", "/workspace/out"),
    ]


def test_a_read_only_grant_keeps_the_rest_of_the_view(tmp_path: Path) -> None:
    view = SandboxView(gateway_socket=False, cwd="/workspace/out")
    made = sandbox_view([grant("workspace", ".", PathMode.RO)], WORKSPACE, view)
    assert made == SandboxView(workspace_read_only=True, gateway_socket=False, cwd="/workspace/out")


@pytest.mark.parametrize(
    ("host", "refused"),
    [
        (WORKSPACE, True),  # a symlink to "." resolved, or an absolute root naming it
        (WORKSPACE.parent, True),  # holds it
        (WORKSPACE / "out", False),
        (Path("/srv/other"), False),
        (Path("/srv/work/project2"), False),  # a sibling whose name only starts alike
    ],
)
def test_a_rw_path_at_or_above_a_read_only_workspace_is_refused(host: Path, refused: bool) -> None:
    alias = PathGrant(
        name="out",
        host_root=host,
        root_id=(1, 2),
        holds_nested=False,
        visible_root=PurePosixPath("/workspace/out"),
        mode=PathMode.RW,
    )
    grants = [grant("workspace", ".", PathMode.RO), alias]
    if not refused:
        _refuse_writable_workspace(grants, WORKSPACE)
        return
    with pytest.raises(UnsafeMounts, match=r"'out' .* is or holds the workspace") as exc:
        _refuse_writable_workspace(grants, WORKSPACE)
    assert exc.value.code == "bad_request"
    assert "beneath the workspace" in str(exc.value)
