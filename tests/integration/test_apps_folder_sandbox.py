"""No run sees the workspace's apps folder, proven from inside real sandboxes.

An in-process gatewayd with the OS sandbox (real bubblewrap, real namespaces, a uid per
run) starts runs on workspaces holding an app whose files every host user may read, so
only gatewayd stands between the run and them. Each probe tries, inside: reading the
folder directly, through symlinks planted in the workspace or made there, making,
removing and renaming it, mounting over it, and every fs tool with every spelling of a
path into it. Hard links are refused when the run starts (the sandbox cannot make one).
The same rules for a run without an OS sandbox, and for both workspace backends.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
import tempfile
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from cogni_tool.client import Client, ToolError
from gatewayd.daemon import open_daemon
from gatewayd.runs import Grant, Run, RunLimits, RunRequest
from gatewayd.sandbox.appsfolder import MADE_RECORD
from gatewayd.sandbox.netns import NETNS_RUN_DIR
from gatewayd.sandbox.session import UnsafeMounts, clean_leftovers
from gatewayd.workspace import HostWorkspace, OverlayWorkspace, WorkspaceSession
from tests.conftest import Gateway
from tests.integration.test_run_sandbox import Sandboxed, _unavailable, sandbox_config

sandboxed = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))

POLICY = """
version: 1
name: apps-hidden
tools:
  allow: [fs.read, fs.write, fs.edit, fs.list, fs.stat]
filesystem:
  paths:
    workspace: {root: ., mode: rw}
limits: {calls_per_second: 1000, burst: 1000}
sandbox: {timeout_s: 30, cpu_s: 20, max_processes: 48, max_output_bytes: 262144}
"""
MANIFEST = "APP-MANIFEST-SECRET"
APP_DATA = "APP-DATA-SECRET"


def plant_app(ws: Path) -> Path:
    """An installed app, world-readable: only gatewayd keeps a run out of it."""
    app = ws / "apps" / "note-taker"
    (app / "data").mkdir(parents=True)
    (app / "APP.md").write_text(f"{MANIFEST}\n")
    (app / "data" / "notes.md").write_text(f"{APP_DATA}\n")
    for path in (ws / "apps", app, app / "data"):
        path.chmod(0o755)
    return app


def plant_symlinks(ws: Path) -> None:
    """Symlinks in the workspace, each leading into the folder another way."""
    (ws / "link-file").symlink_to("apps/note-taker/data/notes.md")
    (ws / "link-dir").symlink_to("apps")
    (ws / "link-abs").symlink_to("/workspace/apps/note-taker/APP.md")
    (ws / "docs").mkdir(exist_ok=True)
    (ws / "docs" / "up").symlink_to("../apps/note-taker")


def snapshot(tree: Path) -> dict[str, tuple[object, ...]]:
    """Every entry below ``tree``: kind, owner, mode and content."""
    found: dict[str, tuple[object, ...]] = {}
    for path in sorted(tree.rglob("*")):
        st = os.lstat(path)
        content = path.read_bytes() if stat.S_ISREG(st.st_mode) else b""
        found[str(path.relative_to(tree))] = (st.st_mode, st.st_uid, st.st_gid, content)
    return found


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-apps-", dir="/tmp"))
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


def outputs(result: Any) -> str:
    return (result.stdout + result.stderr).decode(errors="replace")


# --- the OS sandbox: what a command sees --------------------------------------------------

SEE_PROBE = r"""
import ctypes, errno, json, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
def attempt(fn):
    try:
        fn()
        return "ok"
    except OSError as e:
        return errno.errorcode[e.errno]
def syscall(rc):
    if rc != 0:
        raise OSError(ctypes.get_errno(), "")
def sh(command):
    done = subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True)
    return [done.returncode, done.stdout]
def write(path):
    with open(path, "w") as f:
        f.write("planted")
os.mkdir("/workspace/fake")
os.symlink("apps/note-taker/data/notes.md", "/workspace/mine")
out = {
    "listdir": os.listdir("/workspace/apps"),
    "ls": sh("ls -A /workspace/apps"),
    "read": attempt(lambda: open("/workspace/apps/note-taker/APP.md").read()),
    "cat_planted_link": sh("cat /workspace/link-file"),
    "cat_absolute_link": sh("cat /workspace/link-abs"),
    "ls_linked_dir": sh("ls -A /workspace/link-dir/"),
    "cat_through_parent_link": sh("cat /workspace/docs/up/APP.md"),
    "cat_own_link": sh("cat /workspace/mine"),
    "grep_workspace": sh("grep -rl SECRET /workspace"),
    "mkdir": attempt(lambda: os.mkdir("/workspace/apps/evil")),
    "makedirs": attempt(lambda: os.makedirs("/workspace/apps/x/data")),
    "write_data": attempt(lambda: write("/workspace/apps/x/data/f")),
    "write_manifest": attempt(lambda: write("/workspace/apps/APP.md")),
    "chmod": attempt(lambda: os.chmod("/workspace/apps", 0o777)),
    "rename_apps": attempt(lambda: os.rename("/workspace/apps", "/workspace/x")),
    "mv_apps": sh("mv /workspace/apps /workspace/x 2>/dev/null; echo $?"),
    "rename_over_apps": attempt(lambda: os.rename("/workspace/fake", "/workspace/apps")),
    "rmdir_apps": attempt(lambda: os.rmdir("/workspace/apps")),
    "rename_workspace": attempt(lambda: os.rename("/workspace", "/elsewhere")),
    "hard_link": attempt(lambda: os.link("/workspace/apps/note-taker/APP.md", "/workspace/l")),
    "umount": attempt(lambda: syscall(libc.umount2(b"/workspace/apps", 2))),
    "bind_over": attempt(
        lambda: syscall(libc.mount(b"/workspace/fake", b"/workspace/apps", None, 4096, None))
    ),
    "new_mount_namespace": attempt(lambda: syscall(libc.unshare(0x00020000))),
}
print(json.dumps(out))
"""


@sandboxed
async def test_the_sandbox_sees_an_empty_apps_folder_it_can_neither_read_write_nor_move(
    sb: Sandboxed,
) -> None:
    ws = sb.workspace()
    app = plant_app(ws)
    plant_symlinks(ws)
    before = snapshot(ws / "apps")
    run = await sb.run(POLICY, workspace=ws)
    assert run.sandbox is not None
    assert run.sandbox.plan(["true"], {}).covered_trees == (str(ws / "apps"),)
    # The lease lent the workspace but not the folder: the run's uid owns nothing in it.
    assert os.stat(ws / "notes.md").st_uid == run.sandbox.user.uid
    assert {os.lstat(p).st_uid for p in (ws / "apps", *app.rglob("*"))} == {0}

    result = await sb.py(run, SEE_PROBE)
    assert result.exitCode == 0, result.stderr
    for secret in (MANIFEST, APP_DATA, "note-taker"):
        assert secret not in outputs(result), outputs(result)
    seen = json.loads(result.stdout)
    assert seen["listdir"] == [] and seen["ls"] == [0, ""]
    assert seen["read"] == "ENOENT"
    for name in ("cat_planted_link", "cat_absolute_link", "cat_through_parent_link"):
        assert seen[name] == [1, ""], (name, seen[name])
    assert seen["cat_own_link"] == [1, ""]
    assert seen["ls_linked_dir"] == [0, ""]  # the link leads onto the empty cover
    assert seen["grep_workspace"][1] == ""
    assert {name: seen[name] for name in ("mkdir", "makedirs", "write_manifest", "chmod")} == {
        "mkdir": "EROFS",
        "makedirs": "EROFS",
        "write_manifest": "EROFS",
        "chmod": "EROFS",
    }
    assert seen["write_data"] == "ENOENT"  # no apps/x/data to write in, and none can be made
    # A mount point cannot be renamed, replaced or removed; the workspace is one too.
    assert seen["rename_apps"] == "EBUSY"
    assert seen["mv_apps"] == [0, "1\n"]
    assert seen["rename_over_apps"] == "EBUSY"
    assert seen["rmdir_apps"] == "EBUSY"
    assert seen["rename_workspace"] in ("EBUSY", "EROFS")
    assert seen["hard_link"] == "ENOENT"
    # No capability to unmount, mount or make a mount namespace of its own.
    assert seen["umount"] == "EPERM"
    assert seen["bind_over"] == "EPERM"
    assert seen["new_mount_namespace"] == "EPERM"

    await sb.daemon.runs.end(run.run_id)
    assert snapshot(ws / "apps") == before
    assert not (ws / "x").exists() and not (ws / "l").exists()


@sandboxed
async def test_a_missing_apps_folder_is_made_covered_for_the_run_and_removed_after(
    sb: Sandboxed,
) -> None:
    ws = sb.workspace()
    run = await sb.run(POLICY, workspace=ws)
    assert run.sandbox is not None and run.sandbox.apps_folder is not None
    made = os.lstat(ws / "apps")
    # The cover's mount point: empty, made as the workspace owner's and lent with it.
    assert stat.S_ISDIR(made.st_mode) and os.listdir(ws / "apps") == []
    uid = run.sandbox.user.uid
    assert (made.st_uid, stat.S_IMODE(made.st_mode)) == (uid, 0o755) == (os.stat(ws).st_uid, 0o755)
    assert (run.directory / MADE_RECORD).exists()
    result = await sb.py(
        run,
        r"""
        import errno, json, os
        def attempt(fn):
            try:
                fn()
                return "ok"
            except OSError as e:
                return errno.errorcode[e.errno]
        def plant():
            os.makedirs("/workspace/apps/evil", exist_ok=True)
            open("/workspace/apps/evil/APP.md", "w").write("---\nname: evil\n---\n")
        os.mkdir("/workspace/fake")
        print(json.dumps({
            "plant": attempt(plant),
            "mkdir": attempt(lambda: os.mkdir("/workspace/apps/evil")),
            "replace": attempt(lambda: os.rename("/workspace/fake", "/workspace/apps")),
            "rmdir": attempt(lambda: os.rmdir("/workspace/apps")),
            "listed": os.listdir("/workspace/apps"),
        }))
        """,
    )
    assert json.loads(result.stdout) == {
        "plant": "EROFS",
        "mkdir": "EROFS",
        "replace": "EBUSY",
        "rmdir": "EBUSY",
        "listed": [],
    }, result.stderr
    await sb.daemon.runs.end(run.run_id)
    assert not (ws / "apps").exists()  # the run's end takes it away again
    assert sorted(os.listdir(ws)) == ["fake", "notes.md"]


@sandboxed
async def test_a_made_folder_an_app_was_installed_into_meanwhile_stays(sb: Sandboxed) -> None:
    ws = sb.workspace()
    run = await sb.run(POLICY, workspace=ws)
    plant_app(ws)  # an operator's install while the run lives
    result = await sb.py(run, "import os; print(os.listdir('/workspace/apps'))")
    assert result.stdout.strip() == b"[]"  # covered all the same
    await sb.daemon.runs.end(run.run_id)
    assert (ws / "apps" / "note-taker" / "APP.md").read_text() == f"{MANIFEST}\n"


def test_after_a_crash_the_next_start_removes_the_empty_folder_made(base: Path) -> None:
    # What a daemon killed mid-run leaves: its run directory with the record, and the
    # folder it made. clean_leftovers (run at every start) removes the folder if it is
    # still that empty directory, and leaves one an app was installed into.
    runs = base / "runs"
    for name, installed in (("a", False), ("b", True)):
        ws = base / f"ws-{name}"
        (ws / "apps").mkdir(parents=True)
        st = os.stat(ws / "apps")
        record = {"path": str(ws / "apps"), "device": st.st_dev, "inode": st.st_ino}
        (runs / name).mkdir(parents=True)
        (runs / name / MADE_RECORD).write_text(json.dumps(record))
        if installed:
            plant_app(ws)
    cleaned = clean_leftovers(runs, None)
    assert cleaned["runDirs"] == ["a", "b"]
    assert not (base / "ws-a" / "apps").exists()
    assert (base / "ws-b" / "apps" / "note-taker" / "APP.md").exists()


# --- refused at the start: what no cover hides ------------------------------------------


async def _refused(sb: Sandboxed, ws: Path, policy: str = POLICY) -> str:
    lent_before = os.stat(ws / "notes.md").st_uid
    with pytest.raises(UnsafeMounts) as caught:
        await sb.run(policy, workspace=ws)
    assert getattr(caught.value, "code", None) == "bad_request"
    # Refused before anything was lent or made.
    assert os.stat(ws / "notes.md").st_uid == lent_before == 0
    assert sb.daemon.runs.uid_pool.in_use == 0
    assert not [
        p for p in NETNS_RUN_DIR.iterdir() if p.name.startswith(sb.daemon.config.netns_prefix)
    ]
    refusal = [e for e in await sb.entries() if e.get("event") == "run_refused"][-1]
    assert refusal["errorCode"] == "bad_request"
    assert refusal["safeMessage"] == str(caught.value)
    return str(caught.value)


@sandboxed
async def test_a_hard_link_to_an_apps_file_refuses_the_run_before_anything_is_lent(
    sb: Sandboxed,
) -> None:
    # A mount over apps/ does not hide another name of one of its files.
    ws = sb.workspace()
    app = plant_app(ws)
    os.link(app / "data" / "notes.md", ws / "linked.md")
    message = await _refused(sb, ws)
    assert message.startswith(
        f"run refused: the workspace's apps folder holds {app / 'data' / 'notes.md'}, a "
        "file with 2 names of which 1 lie in the folder: another name of it (in the "
        "workspace or a policy path) would show an app's file to the run"
    ), message
    assert "Remove the other names (or make them copies)" in message
    assert (ws / "linked.md").read_text() == f"{APP_DATA}\n"


@sandboxed
async def test_a_hard_link_outside_the_workspace_refuses_the_run_too(sb: Sandboxed) -> None:
    # The other name in a directory a policy path shows (or anywhere): counted the same.
    ws = sb.workspace()
    app = plant_app(ws)
    shared = sb.base / "shared"
    shared.mkdir()
    os.link(app / "APP.md", shared / "manifest-copy.md")
    policy = POLICY.replace(
        "workspace: {root: ., mode: rw}",
        f"workspace: {{root: ., mode: rw}}\n    shared: {{root: {shared}, mode: ro, "
        "mount: /data/shared}",
    )
    message = await _refused(sb, ws, policy)
    assert f"holds {app / 'APP.md'}, a file with 2 names of which 1 lie" in message


@sandboxed
async def test_hard_links_whose_names_all_lie_in_the_folder_are_fine(sb: Sandboxed) -> None:
    ws = sb.workspace()
    app = plant_app(ws)
    os.link(app / "data" / "notes.md", app / "data" / "notes-again.md")
    run = await sb.run(POLICY, workspace=ws)
    result = await sb.py(run, "import os; print(os.listdir('/workspace/apps'))")
    assert result.stdout.strip() == b"[]"
    await sb.daemon.runs.end(run.run_id)


@sandboxed
@pytest.mark.parametrize("kind", ["symlink", "file", "fifo"])
async def test_an_apps_entry_that_is_no_directory_refuses_the_run(sb: Sandboxed, kind: str) -> None:
    ws = sb.workspace()
    (ws / "docs").mkdir()
    if kind == "symlink":
        (ws / "apps").symlink_to("docs")  # would make docs the apps folder
    elif kind == "file":
        (ws / "apps").write_text("not a folder\n")
    else:
        os.mkfifo(ws / "apps")
    message = await _refused(sb, ws)
    what = "a symlink" if kind == "symlink" else "not a directory"
    assert message == (
        f"run refused: the workspace's apps folder {ws / 'apps'} is {what}; it must be a "
        "directory (or absent), since no run may see it and the sandbox hides a directory "
        "there: move it away, then start the run again"
    )


@sandboxed
async def test_a_policy_path_in_the_folder_refuses_the_run(sb: Sandboxed) -> None:
    ws = sb.workspace()
    plant_app(ws)
    policy = POLICY.replace(
        "workspace: {root: ., mode: rw}",
        "workspace: {root: ., mode: rw}\n    data: {root: apps/note-taker/data, mode: rw}",
    )
    with pytest.raises(Exception, match=r"lies in the workspace's apps folder") as caught:
        await sb.run(policy, workspace=ws)
    assert getattr(caught.value, "code", "bad_request") == "bad_request"
    assert os.stat(ws / "apps" / "note-taker" / "data" / "notes.md").st_uid == 0


@sandboxed
async def test_a_writable_policy_path_holding_the_workspace_refuses_the_run(
    sb: Sandboxed,
) -> None:
    # Inside it the sandbox could rename the workspace's directory, taking the folder
    # where the host's tools would not look for it; read-only, it is covered there too.
    up = sb.base / "up"
    up.mkdir()
    ws = sb.workspace("up/ws")
    plant_app(ws)
    policy = POLICY.replace(
        "workspace: {root: ., mode: rw}",
        f"workspace: {{root: ., mode: rw}}\n    up: {{root: {up}, mode: rw, mount: /data/up}}",
    )
    message = await _refused(sb, ws, policy)
    assert (
        message.startswith("run refused: step ")
        and (
            f"is writable and holds {ws / 'apps'}, a covered tree, below a directory the "
            "sandbox could rename (ws): bind it read-only"
        )
        in message
    ), message
    run = await sb.run(
        policy.replace("mode: rw, mount: /data/up", "mode: ro, mount: /data/up"), workspace=ws
    )
    result = await sb.py(
        run, "import os; print(os.listdir('/data/up/ws/apps'), os.listdir('/workspace/apps'))"
    )
    assert result.stdout.strip() == b"[] []", result.stderr
    await sb.daemon.runs.end(run.run_id)


# --- the fs tools, called with cogni-tool from inside -----------------------------------

# Every spelling of a path into the folder, and every way a symlink leads there.
TOOL_CALLS: list[tuple[str, dict[str, Any], str]] = [
    ("fs.read", {"path": "apps/note-taker/APP.md"}, "lies in the apps folder"),
    ("fs.read", {"path": "/workspace/apps/note-taker/data/notes.md"}, "lies in the apps folder"),
    ("fs.read", {"path": "./apps/note-taker/APP.md"}, "lies in the apps folder"),
    ("fs.read", {"path": "apps/../apps/note-taker/APP.md"}, "lies in the apps folder"),
    ("fs.read", {"path": "//workspace//apps//note-taker/APP.md"}, "lies in the apps folder"),
    ("fs.read", {"path": "APPS/note-taker/APP.md"}, "lies in the apps folder"),
    ("fs.read", {"path": "link-file"}, "symlink"),
    ("fs.read", {"path": "link-dir/note-taker/APP.md"}, "symlink"),
    ("fs.read", {"path": "docs/up/APP.md"}, "symlink"),
    ("fs.read", {"path": "link-abs"}, "symlink"),
    ("fs.list", {"path": "apps"}, "lies in the apps folder"),
    ("fs.list", {"path": "apps/"}, "lies in the apps folder"),
    ("fs.list", {"path": "link-dir"}, "symlink"),
    ("fs.stat", {"path": "/workspace/apps"}, "lies in the apps folder"),
    ("fs.stat", {"path": "Apps/note-taker"}, "lies in the apps folder"),
    ("fs.write", {"path": "apps/evil/APP.md", "content": "planted"}, "lies in the apps folder"),
    ("fs.write", {"path": "apps/note-taker/data/f", "content": "x"}, "lies in the apps folder"),
    ("fs.write", {"path": "link-dir/evil/APP.md", "content": "x"}, "symlink"),
    ("fs.edit", {"path": "apps/note-taker/APP.md", "old": "APP", "new": "X"}, "apps folder"),
]

TOOLS_PROBE = """
import json, subprocess, sys
calls = json.loads(sys.argv[1])
out = []
for tool, args in calls:
    done = subprocess.run(["cogni-tool", "exec", tool, json.dumps(args)],
                          capture_output=True, text=True)
    out.append({"rc": done.returncode, "out": done.stdout, "err": done.stderr})
print(json.dumps(out))
"""


@sandboxed
async def test_every_fs_tool_refuses_every_path_into_the_folder_from_inside(
    sb: Sandboxed,
) -> None:
    ws = sb.workspace()
    plant_app(ws)
    plant_symlinks(ws)
    (ws / "docs" / "guide.md").write_text("# guide\n")
    before = snapshot(ws / "apps")
    run = await sb.run(POLICY, workspace=ws)
    calls = [[tool, args] for tool, args, _ in TOOL_CALLS]
    calls += [["fs.list", {}], ["fs.list", {"pattern": "**"}]]
    result = await sb.py(run, TOOLS_PROBE, json.dumps(calls))
    assert result.exitCode == 0, result.stderr
    answers = json.loads(result.stdout)
    for (tool, args, expected), answer in zip(TOOL_CALLS, answers, strict=False):
        shown = answer["out"] + answer["err"]
        assert answer["rc"] == 15, (tool, args, answer)  # policy_denied
        assert answer["err"].startswith("cogni-tool: policy_denied: "), (tool, args, answer)
        assert expected in answer["err"], (tool, args, answer)
        for secret in (MANIFEST, APP_DATA, str(ws)):
            assert secret not in shown, (tool, args, shown)
    top, everything = answers[-2:]
    assert top["rc"] == 0 and everything["rc"] == 0, (top, everything)
    assert "/workspace/apps" not in [e["path"] for e in json.loads(top["out"])["entries"]]
    listed = [e["path"] for e in json.loads(everything["out"])["entries"]]
    assert listed and not [p for p in listed if p.startswith("/workspace/apps")], listed
    assert "note-taker" not in everything["out"]
    # Every call went through the chokepoint: the refusals are audited as denials.
    audited = [e for e in await sb.entries() if e["kind"] == "call"]
    denied = [e for e in audited if e["decision"] == "deny"]
    assert len(denied) >= len([c for c in TOOL_CALLS if c[2] != "symlink"])
    await sb.daemon.runs.end(run.run_id)
    assert snapshot(ws / "apps") == before


# --- without an OS sandbox --------------------------------------------------------------


async def _call(run: Run, tool: str, args: dict[str, Any]) -> Any:
    def go() -> Any:
        with Client(str(run.socket_path), run.run_id) as client:
            return client.call(tool, args)

    return await trio.to_thread.run_sync(go)


async def test_a_run_without_an_os_sandbox_is_refused_the_folder_by_every_fs_tool(
    gateway: Gateway, short_tmp: Path
) -> None:
    ws = short_tmp / "ws"
    ws.mkdir()
    (ws / "notes.md").write_text("hello\n")
    plant_app(ws)
    plant_symlinks(ws)
    before = snapshot(ws / "apps")
    run = await gateway.create_run(ws, POLICY)
    assert run.sandbox is None and run.degraded
    for tool, args, expected in TOOL_CALLS:
        with pytest.raises(ToolError) as caught:
            await _call(run, tool, args)
        assert caught.value.code == "policy_denied", (tool, args, caught.value)
        assert expected in caught.value.safe_message, (tool, args, caught.value)
    listing = await _call(run, "fs.list", {"pattern": "**"})
    assert not [e for e in listing["entries"] if e["path"].startswith("/workspace/apps")]
    assert snapshot(ws / "apps") == before


async def test_a_run_without_an_os_sandbox_makes_no_apps_folder_and_lets_none_be_planted(
    gateway: Gateway, short_tmp: Path
) -> None:
    ws = short_tmp / "plain"
    ws.mkdir()
    run = await gateway.create_run(ws, POLICY)
    for path in ("apps/evil/APP.md", "APPS/evil/APP.md", "/workspace/apps/APP.md"):
        with pytest.raises(ToolError) as caught:
            await _call(run, "fs.write", {"path": path, "content": "---\nname: evil\n---\n"})
        assert caught.value.code == "policy_denied"
    assert os.listdir(ws) == []


# --- both workspace backends ------------------------------------------------------------


async def _start_on(sb: Sandboxed, session: WorkspaceSession, overlay: bool) -> Run:
    """A run on a session's root, the way an agent run starts one."""
    policy = sb.base / f"policy-{secrets.token_hex(4)}.yaml"
    policy.write_text(textwrap.dedent(POLICY))
    request = RunRequest(
        workspacePath=str(session.root),
        policy=str(policy),
        actorId="tester",
        tenantId="t1",
        grant=Grant(allowSandbox=True),
        limits=RunLimits(maxMemoryMb=2048),
    )
    if not overlay:
        return await sb.daemon.runs.start(request, policy_paths=True)
    user = sb.daemon.runs.uid_pool.acquire()
    os.chown(session.root, user.uid, user.gid)  # the merged view: the run uid's
    return await sb.daemon.runs.start(
        request, sandbox_user=user, lend_workspace=False, policy_paths=True
    )


@sandboxed
@pytest.mark.parametrize("backend", ["host", "overlay"])
@pytest.mark.parametrize("installed", [True, False], ids=["with-apps", "without-apps"])
async def test_both_workspace_backends_hide_the_folder_and_leave_no_trace_of_the_cover(
    sb: Sandboxed, backend: str, installed: bool
) -> None:
    work = sb.base / f"work-{backend}"
    repo = work / "repo"
    repo.mkdir(parents=True)
    (repo / "README.md").write_text("hello\n")
    if installed:
        plant_app(repo)
    state = work / "session"
    session: WorkspaceSession = (
        OverlayWorkspace.create(repo, state)
        if backend == "overlay"
        else HostWorkspace.create(repo, state)
    )
    try:
        run = await _start_on(sb, session, overlay=backend == "overlay")
        result = await sb.py(
            run,
            r"""
            import errno, json, os
            def attempt(fn):
                try:
                    fn()
                    return "ok"
                except OSError as e:
                    return errno.errorcode[e.errno]
            print(json.dumps({
                "listed": os.listdir("/workspace/apps"),
                "read": attempt(lambda: open("/workspace/apps/note-taker/APP.md").read()),
                "mkdir": attempt(lambda: os.mkdir("/workspace/apps/evil")),
                "rename": attempt(lambda: os.rename("/workspace/apps", "/workspace/x")),
            }))
            """,
        )
        assert json.loads(result.stdout) == {
            "listed": [],
            "read": "ENOENT",
            "mkdir": "EROFS",
            "rename": "EBUSY",
        }, result.stderr
        assert MANIFEST not in outputs(result)
        await sb.daemon.runs.end(run.run_id)
        # The cover's mount point (made when the folder was missing) is gone again: the
        # session's diff, which an agent run turns into a patch, holds nothing.
        diff = await trio.to_thread.run_sync(session.diff)
        assert diff.empty, (diff.added, diff.removed, diff.modified)
        assert (session.root / "apps").exists() is installed
    finally:
        await trio.to_thread.run_sync(session.close)
    assert (repo / "apps").exists() is installed
