"""No run reaches another workspace's apps folder, proven with real runs and sandboxes.

``team/ws-a`` holds an app whose files every host user may read, so only gatewayd stands
between a run and them. A run whose workspace or policy path holds that folder (a parent
of ws-a as the workspace, a policy path over the team directory, read-only or writable,
or another name of ws-a made by a bind mount) or lies in it is refused before anything
of it is made or lent, with a message naming the folder and the fix; with or without an
OS sandbox. A run beside ws-a, given only what it needs, is started, and from inside it
neither the sandbox (ls, cat, symlinks planted to the host path and through ``..``) nor
the fs tools reach the folder; a hard link to one of its files refuses the run. ws-a is
recorded by a run's start (the app was copied by hand) or by ``install_app``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from cogni_tool.client import Client, ToolError
from gatewayd.apps.install import InstallError, install_app
from gatewayd.apps.workspaces import APPS_RECORD_FILE, AppsRecordError, recorded_workspaces
from gatewayd.daemon import open_daemon
from gatewayd.hostpaths.otherapps import OtherAppsFolderHeld
from gatewayd.runs import Run
from gatewayd.sandbox.netns import NETNS_RUN_DIR
from gatewayd.sandbox.session import UnsafeMounts
from tests.conftest import ROOT, Gateway
from tests.integration.test_apps_folder_sandbox import (
    APP_DATA,
    MANIFEST,
    POLICY,
    TOOLS_PROBE,
    outputs,
    plant_app,
    snapshot,
)
from tests.integration.test_run_sandbox import Sandboxed, _unavailable, sandbox_config

sandboxed = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-other-", dir="/tmp"))
    path.chmod(0o711)  # the sandbox's uid passes through to its workspace and socket
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def sb(base: Path) -> AsyncIterator[Sandboxed]:
    async with open_daemon(sandbox_config(base), preload=True) as daemon:
        assert daemon.runs.support.available, daemon.runs.support.reason
        yield Sandboxed(daemon, base)


def with_path(name: str, root: Path, mode: str, mount: str) -> str:
    """POLICY with one more policy path."""
    return POLICY.replace(
        "workspace: {root: ., mode: rw}",
        f"workspace: {{root: ., mode: rw}}\n    {name}: {{root: {root}, mode: {mode}, "
        f"mount: {mount}}}",
    )


async def team_with_app(sb: Sandboxed) -> tuple[Path, Path, Path]:
    """``team/ws-a`` with an app copied in by hand, recorded by a run's start there (and
    ended); ``team/ws-b`` and ``team/shared`` beside it. Returns (team, ws-a, ws-b)."""
    team = sb.base / "team"
    team.mkdir()
    team.chmod(0o711)
    ws_a = sb.workspace("team/ws-a")
    plant_app(ws_a)
    ws_b = sb.workspace("team/ws-b")
    (team / "shared").mkdir()
    (team / "shared" / "guide.md").write_text("# guide\n")
    run = await sb.run(POLICY, workspace=ws_a)  # its own apps: covered, and recorded
    await sb.daemon.runs.end(run.run_id)
    assert recorded_workspaces(sb.daemon.config.state_dir) == (ws_a,)
    return team, ws_a, ws_b


async def refused(sb: Sandboxed, ws: Path, policy: str, ws_a: Path) -> str:
    """The run is refused with ``bad_request`` before anything of it is made or lent,
    and the refusal is audited; returns its message."""
    before = snapshot(ws_a)
    with pytest.raises(OtherAppsFolderHeld) as caught:
        await sb.run(policy, workspace=ws)
    assert caught.value.code == "bad_request"
    assert snapshot(ws_a) == before  # nothing of ws-a lent (chowned) or changed
    assert os.stat(ws / "notes.md").st_uid == 0
    assert sb.daemon.runs.uid_pool.in_use == 0
    assert not [
        p for p in NETNS_RUN_DIR.iterdir() if p.name.startswith(sb.daemon.config.netns_prefix)
    ]
    refusal = [e for e in await sb.entries() if e.get("event") == "run_refused"][-1]
    assert refusal["errorCode"] == "bad_request"
    assert refusal["safeMessage"] == str(caught.value)
    return str(caught.value)


@sandboxed
@pytest.mark.parametrize("mode", ["ro", "rw"])
async def test_a_policy_path_holding_another_workspace_with_apps_refuses_the_run(
    sb: Sandboxed, mode: str
) -> None:
    team, ws_a, ws_b = await team_with_app(sb)
    message = await refused(sb, ws_b, with_path("team", team, mode, "/data/team"), ws_a)
    assert message == (
        f"run refused: its policy path 'team' {team} holds {ws_a / 'apps'}, another "
        "workspace's apps folder: no other run may hold it or run inside it. To start, name "
        f"the directories the run needs beside {ws_a} instead (workspaces holding apps: "
        "apps-workspaces.json in gatewayd's state directory)"
    )
    # The fix the message names: the directory the run needs, beside ws-a.
    run = await sb.run(with_path("shared", team / "shared", mode, "/data/shared"), workspace=ws_b)
    await sb.daemon.runs.end(run.run_id)


@sandboxed
async def test_a_parent_of_another_workspace_as_the_run_s_workspace_is_refused(
    sb: Sandboxed,
) -> None:
    # Before, ws-a's apps folder was an ordinary directory of the run's workspace:
    # visible, writable, and lent (chowned) to the run's uid.
    team, ws_a, _ = await team_with_app(sb)
    (team / "notes.md").write_text("team notes\n")
    message = await refused(sb, team, POLICY, ws_a)
    assert message.startswith(
        f"run refused: its workspace {team} holds {ws_a / 'apps'}, another workspace's apps folder"
    )


@sandboxed
@pytest.mark.parametrize("where", ["workspace", "policy path"])
async def test_a_workspace_or_policy_path_inside_another_s_apps_folder_is_refused(
    sb: Sandboxed, where: str
) -> None:
    _, ws_a, ws_b = await team_with_app(sb)
    data = ws_a / "apps" / "note-taker" / "data"
    if where == "workspace":
        (data / "notes.md").chmod(0o644)
        message = await refused(sb, data, POLICY, ws_a)
        assert message.startswith(f"run refused: its workspace {data} lies in {ws_a / 'apps'}")
    else:
        message = await refused(sb, ws_b, with_path("data", data, "ro", "/data/app"), ws_a)
        assert message.startswith(
            f"run refused: its policy path 'data' {data} lies in {ws_a / 'apps'}, another "
            "workspace's apps folder"
        )
    assert message.endswith(
        "To start, name a directory outside it (workspaces holding apps: "
        "apps-workspaces.json in gatewayd's state directory)"
    )


@sandboxed
async def test_another_name_of_the_workspace_made_by_a_bind_mount_is_refused_too(
    sb: Sandboxed,
) -> None:
    # /alias shares no name with ws-a; its (device, inode) is ws-a's.
    _, ws_a, ws_b = await team_with_app(sb)
    alias = sb.base / "alias"
    alias.mkdir()
    if subprocess.run(["mount", "--bind", str(ws_a), str(alias)]).returncode != 0:
        pytest.skip("cannot bind mount here")
    try:
        message = await refused(sb, ws_b, with_path("alias", alias, "ro", "/data/alias"), ws_a)
        assert message.startswith(f"run refused: its policy path 'alias' {alias} holds")
    finally:
        subprocess.run(["umount", str(alias)], check=True)


# --- a run beside the other workspace: nothing of its folder reachable from inside -------

BESIDE_PROBE = r"""
import json, os, subprocess, sys
host_a = sys.argv[1]
def sh(command):
    done = subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True)
    return [done.returncode, done.stdout]
os.symlink(host_a + "/apps/note-taker/APP.md", "/workspace/made-link")
print(json.dumps({
    "ls_host": sh(f"ls -A {host_a}/apps 2>/dev/null"),
    "cat_host": sh(f"cat {host_a}/apps/note-taker/APP.md 2>/dev/null"),
    "cat_up": sh("cat /data/shared/../ws-a/apps/note-taker/APP.md 2>/dev/null"),
    "ls_up": sh("ls -A /data/shared/.. 2>/dev/null"),
    "cat_planted": sh("cat /workspace/to-a 2>/dev/null"),
    "cat_planted_up": sh("cat /workspace/up-a 2>/dev/null"),
    "cat_made": sh("cat /workspace/made-link 2>/dev/null"),
    "grep": sh("grep -rl SECRET /workspace /data /tmp 2>/dev/null"),
}))
"""


@sandboxed
async def test_a_run_beside_another_workspace_reaches_nothing_of_its_apps_from_inside(
    sb: Sandboxed,
) -> None:
    team, ws_a, ws_b = await team_with_app(sb)
    # Symlinks planted on the host, by name and through '..' of the granted directory.
    (ws_b / "to-a").symlink_to(ws_a / "apps" / "note-taker" / "data" / "notes.md")
    (ws_b / "up-a").symlink_to("/data/shared/../ws-a/apps/note-taker/APP.md")
    (team / "shared" / "up").symlink_to("../ws-a/apps")
    before = snapshot(ws_a)
    run = await sb.run(with_path("shared", team / "shared", "ro", "/data/shared"), workspace=ws_b)
    assert run.sandbox is not None
    # Only its own (empty) apps folder is covered; ws-a's lies in no bind.
    assert run.sandbox.plan(["true"], {}).covered_trees == (str(ws_b / "apps"),)

    result = await sb.py(run, BESIDE_PROBE, str(ws_a), timeout=60)
    assert result.exitCode == 0, result.stderr
    for secret in (MANIFEST, APP_DATA, "note-taker"):
        assert secret not in outputs(result), outputs(result)
    seen = json.loads(result.stdout)
    for name in ("cat_host", "cat_up", "cat_planted", "cat_planted_up", "cat_made"):
        assert seen[name] == [1, ""], (name, seen[name])
    assert seen["ls_host"][1] == ""
    assert "ws-a" not in seen["ls_up"][1]  # '..' of a bind is the sandbox's own /data
    assert seen["grep"][1] == ""

    calls: list[tuple[str, dict[str, Any], str]] = [
        ("fs.read", {"path": "to-a"}, "symlink"),
        ("fs.read", {"path": "up-a"}, "symlink"),
        ("fs.read", {"path": "/data/shared/up/note-taker/APP.md"}, "leads outside"),
        ("fs.read", {"path": "/data/shared/../ws-a/apps/note-taker/APP.md"}, "outside"),
        ("fs.read", {"path": f"{ws_a}/apps/note-taker/APP.md"}, "outside the readable paths"),
        ("fs.list", {"path": "/data/shared/up"}, "leads outside"),
        ("fs.list", {"path": "/data/shared/.."}, "outside the readable paths"),
        ("fs.write", {"path": "/data/shared/up/evil/APP.md", "content": "x"}, "read-only"),
        ("fs.write", {"path": f"{ws_a}/apps/evil/APP.md", "content": "x"}, "outside"),
    ]
    tool_result = await sb.py(
        run, TOOLS_PROBE, json.dumps([[tool, args] for tool, args, _ in calls]), timeout=60
    )
    assert tool_result.exitCode == 0, tool_result.stderr
    for (tool, args, expected), answer in zip(calls, json.loads(tool_result.stdout), strict=True):
        shown = answer["out"] + answer["err"]
        assert answer["rc"] != 0 and expected in answer["err"], (tool, args, answer)
        for secret in (MANIFEST, APP_DATA):
            assert secret not in shown, (tool, args, shown)
    listing = await sb.py(run, TOOLS_PROBE, json.dumps([["fs.list", {"path": "/data/shared"}]]))
    entries = json.loads(json.loads(listing.stdout)[0]["out"])["entries"]
    assert "note-taker" not in json.dumps(entries)
    await sb.daemon.runs.end(run.run_id)
    assert snapshot(ws_a) == before


@sandboxed
@pytest.mark.parametrize("where", ["workspace", "policy path"])
async def test_a_hard_link_to_another_workspace_s_app_file_refuses_the_run(
    sb: Sandboxed, where: str
) -> None:
    # A name outside the folder shows the file itself; no check by path sees it. Before,
    # `cat /workspace/linked.md` read the app's data.
    team, ws_a, ws_b = await team_with_app(sb)
    notes = ws_a / "apps" / "note-taker" / "data" / "notes.md"
    policy = with_path("shared", team / "shared", "ro", "/data/shared")
    os.link(notes, (ws_b if where == "workspace" else team / "shared") / "linked.md")
    had_apps_folder = (ws_b / "apps").exists()
    with pytest.raises(UnsafeMounts) as caught:
        await sb.run(policy, workspace=ws_b)
    assert caught.value.code == "bad_request"
    # The apps folder made for the refused run (before this check ran) is gone again.
    assert (ws_b / "apps").exists() == had_apps_folder
    assert str(caught.value) == (
        f"run refused: the apps folder {ws_a / 'apps'} of another workspace holds {notes}, "
        "a file with 2 names of which 1 lie in the folder: another name of it on the file "
        "system the run's workspace or policy paths lie on could show that app's file to "
        "the run, which no check by path sees. Remove the other names (or make them "
        "copies), then start the run again"
    )
    assert os.stat(notes).st_uid == 0 and sb.daemon.runs.uid_pool.in_use == 0
    # Once the other name is a copy, the run starts.
    linked = (ws_b if where == "workspace" else team / "shared") / "linked.md"
    linked.unlink()
    run = await sb.run(policy, workspace=ws_b)
    await sb.daemon.runs.end(run.run_id)


@sandboxed
async def test_an_install_records_the_workspace_before_any_run_sees_it(sb: Sandboxed) -> None:
    team = sb.base / "team"
    team.mkdir()
    ws_a, ws_b = sb.workspace("team/ws-a"), sb.workspace("team/ws-b")
    source = sb.base / "src"
    shutil.copytree(ROOT / "apps" / "examples" / "note-taker", source)
    state = sb.daemon.config.state_dir
    install_app(source, ws_a, state_dir=state)
    assert recorded_workspaces(state) == (ws_a,)
    message = await refused(sb, ws_b, with_path("team", team, "ro", "/data/team"), ws_a)
    assert f"holds {ws_a / 'apps'}" in message


@sandboxed
async def test_a_damaged_record_refuses_every_run_until_it_is_mended(sb: Sandboxed) -> None:
    ws = sb.workspace()
    record = sb.daemon.config.state_dir / APPS_RECORD_FILE
    record.write_text('{"version": 1, "workspaces": ["relative"]}')
    with pytest.raises(AppsRecordError) as caught:
        await sb.run(POLICY, workspace=ws)
    assert caught.value.code == "internal"
    assert "entry 0 is not an absolute path" in str(caught.value)
    assert "no run starts until it is mended" in str(caught.value)
    refusal = [e for e in await sb.entries() if e.get("event") == "run_refused"][-1]
    assert refusal["errorCode"] == "internal"
    record.write_text('{"version": 1, "workspaces": []}')
    run = await sb.run(POLICY, workspace=ws)
    await sb.daemon.runs.end(run.run_id)


# --- without an OS sandbox: the same refusal, so no fs tool gets a path there ------------


async def _call(run: Run, tool: str, args: dict[str, Any]) -> Any:
    def go() -> Any:
        with Client(str(run.socket_path), run.run_id) as client:
            return client.call(tool, args)

    return await trio.to_thread.run_sync(go)


async def test_a_run_without_an_os_sandbox_is_refused_the_same_and_reads_nothing(
    gateway: Gateway, short_tmp: Path
) -> None:
    team = short_tmp / "team"
    ws_a, ws_b = team / "ws-a", team / "ws-b"
    ws_b.mkdir(parents=True)
    (ws_a / "notes.md").parent.mkdir(parents=True)
    (ws_a / "notes.md").write_text("a\n")
    plant_app(ws_a)
    run_a = await gateway.create_run(ws_a, POLICY)  # records ws-a
    assert run_a.degraded
    held = with_path("team", team, "ro", "/data/team")
    with pytest.raises(OtherAppsFolderHeld, match=f"its policy path 'team' {team} holds"):
        await gateway.create_run(ws_b, held)
    with pytest.raises(OtherAppsFolderHeld, match=f"its workspace {team} holds"):
        await gateway.create_run(team, POLICY)
    # Beside it, the fs tools find no way in either.
    (ws_b / "to-a").symlink_to(ws_a / "apps" / "note-taker" / "APP.md")
    run_b = await gateway.create_run(ws_b, POLICY)
    for tool, args in (
        ("fs.read", {"path": "to-a"}),
        ("fs.read", {"path": "../ws-a/apps/note-taker/APP.md"}),
        ("fs.write", {"path": "../ws-a/apps/evil/APP.md", "content": "x"}),
        ("fs.list", {"path": "/workspace/.."}),
    ):
        with pytest.raises(ToolError) as caught:
            await _call(run_b, tool, args)
        assert caught.value.code == "policy_denied", (tool, args, caught.value)
        assert MANIFEST not in caught.value.safe_message
    assert not (ws_a / "apps" / "evil").exists()


# --- installing: the record first, or nothing ---------------------------------------------

GATEWAYD = str(Path(sys.executable).parent / "gatewayd")


def test_an_install_into_a_workspace_it_cannot_record_installs_nothing(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    source = tmp_path / "src"
    shutil.copytree(ROOT / "apps" / "examples" / "note-taker", source)
    state = tmp_path / "state"
    state.mkdir()
    (state / APPS_RECORD_FILE).write_text("[]")
    with pytest.raises(InstallError) as caught:
        install_app(source, ws, state_dir=state)
    assert str(caught.value).startswith(f"the apps record {state / APPS_RECORD_FILE} cannot")
    assert str(caught.value).endswith("; nothing was installed")
    assert os.listdir(ws) == []  # not even apps/


def test_the_install_command_records_through_a_symlinked_workspace_and_reports_failures(
    tmp_path: Path,
) -> None:
    real = tmp_path / "real-ws"
    real.mkdir()
    link = tmp_path / "ws-link"
    link.symlink_to(real)
    source = tmp_path / "src"
    shutil.copytree(ROOT / "apps" / "examples" / "note-taker", source)
    state = tmp_path / "new" / "state"  # made, as the daemon makes it, on first use

    def install(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [GATEWAYD, "apps", "install", str(source), "--workspace", str(link), *extra],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
            check=False,
        )

    done = install("--state-dir", str(state))
    assert done.returncode == 0, done.stderr
    assert recorded_workspaces(state) == (real,)  # the real path, not the link's
    assert oct(state.stat().st_mode & 0o777) == oct(0o711)

    (state / APPS_RECORD_FILE).write_text("{")
    broken = install("--state-dir", str(state), "--replace")
    assert broken.returncode == 1 and "Traceback" not in broken.stderr
    assert broken.stderr.startswith(
        f"gatewayd apps install: the apps record {state / APPS_RECORD_FILE} cannot be used: "
        "it is not JSON"
    )
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    unusable = install("--state-dir", str(not_a_dir))
    assert unusable.returncode == 1 and "Traceback" not in unusable.stderr
    assert unusable.stderr.startswith(
        f"gatewayd apps install: cannot use the state directory {not_a_dir}, where the "
        "workspace is recorded as holding apps:"
    )
