"""A policy's ``ro`` grant on the workspace itself (``root: .``) holds for every command,
probed from inside real sandboxes of real runs.

Each way a process changes a directory is tried from inside and must fail; the host
workspace is compared entry by entry (content, mode, owner, link target) before and after,
so a change that slipped through anywhere would show. A ``rw`` policy path beneath the
workspace stays writable and lent; a workspace without a grant on ``.`` stays the
commands' writable working directory, as docs/policy.md says.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from gatewayd.daemon import open_daemon
from gatewayd.policy.appsfolder import APPS_DIR_NAME
from gatewayd.sandbox.session import UnsafeMounts, WorkspaceInUse
from tests.integration.test_run_sandbox import Sandboxed, _unavailable, sandbox_config
from tests.livedaemon import sandbox_options, start_daemon

pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))

GATEWAYD = str(Path(sys.executable).parent / "gatewayd")

READ_ONLY = """
version: 1
name: read-only-workspace
tools:
  allow: [time.now, fs.read, fs.list, fs.write, sandbox.exec]
filesystem:
  paths:
    workspace: {root: ., mode: ro}
    out: {root: out, mode: rw}
limits: {calls_per_second: 1000, burst: 1000}
sandbox: {timeout_s: 30, cpu_s: 20, max_processes: 48}
"""
# No grant on the workspace itself: only the path beneath it.
SUB_PATH_ONLY = READ_ONLY.replace("    workspace: {root: ., mode: ro}\n", "")

# Every call that changes a directory or a file in it; each line is "what:result".
WRITE_PROBE = r"""
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
def attempt(what, fn):
    try:
        fn(); return f"{what}:ok"
    except OSError as e:
        return f"{what}:{errno.errorcode.get(e.errno, e.errno)}"
def mount_rw():
    ms_remount, ms_bind = 32, 4096  # remount the bind without MS_RDONLY: writable
    if libc.mount(None, b"/workspace", None, ms_remount | ms_bind, None) < 0:
        raise OSError(ctypes.get_errno(), "")
W = "/workspace"
out = [
    attempt("touch", lambda: open(f"{W}/new", "x")),
    attempt("append", lambda: open(f"{W}/notes.md", "a").write("changed")),
    attempt("overwrite", lambda: os.open(f"{W}/notes.md", os.O_WRONLY)),
    attempt("truncate_open", lambda: open(f"{W}/notes.md", "w")),
    attempt("truncate", lambda: os.truncate(f"{W}/notes.md", 0)),
    attempt("utime", lambda: os.utime(f"{W}/notes.md", (0, 0))),
    attempt("rm", lambda: os.unlink(f"{W}/notes.md")),
    attempt("rmdir", lambda: os.rmdir(f"{W}/empty")),
    attempt("mkdir", lambda: os.mkdir(f"{W}/made")),
    attempt("rename", lambda: os.rename(f"{W}/notes.md", f"{W}/renamed.md")),
    attempt("rename_dir", lambda: os.rename(f"{W}/sub", f"{W}/sub2")),
    attempt("rename_into_out", lambda: os.rename(f"{W}/notes.md", f"{W}/out/notes.md")),
    attempt("chmod", lambda: os.chmod(f"{W}/notes.md", 0o777)),
    attempt("chmod_dir", lambda: os.chmod(W, 0o777)),
    attempt("chown", lambda: os.chown(f"{W}/notes.md", os.getuid(), os.getgid())),
    attempt("symlink", lambda: os.symlink("/etc/passwd", f"{W}/link")),
    attempt("hardlink", lambda: os.link(f"{W}/notes.md", f"{W}/hard")),
    attempt("hardlink_into_out", lambda: os.link(f"{W}/notes.md", f"{W}/out/hard")),
    attempt("fifo", lambda: os.mkfifo(f"{W}/fifo")),
    attempt("xattr", lambda: os.setxattr(f"{W}/notes.md", "user.x", b"1")),
    attempt("cwd", lambda: open("/proc/self/cwd/new", "x")),
    attempt("cwd_append", lambda: open("/proc/self/cwd/notes.md", "a").write("changed")),
    attempt("nested", lambda: open(f"{W}/sub/deep.txt", "a").write("changed")),
    attempt("remount", mount_rw),
    attempt("out_write", lambda: open(f"{W}/out/made.txt", "x").write("by the sandbox")),
    attempt("out_mkdir", lambda: os.mkdir(f"{W}/out/dir")),
]
print(" ".join(out))
"""
REFUSED = {
    "touch": "EROFS",
    "append": "EROFS",
    "overwrite": "EROFS",
    "truncate_open": "EROFS",
    "truncate": "EROFS",
    "utime": "EROFS",
    "rm": "EROFS",
    "rmdir": "EROFS",
    "mkdir": "EROFS",
    "rename": "EROFS",
    "rename_dir": "EROFS",
    "rename_into_out": "EXDEV",  # another mount: no name of it reaches a writable place
    "chmod": "EROFS",
    "chmod_dir": "EROFS",
    "chown": "EROFS",
    "symlink": "EROFS",
    "hardlink": "EROFS",
    "hardlink_into_out": "EXDEV",
    "fifo": "EPERM",  # seccomp refuses every FIFO before the mount is asked
    "xattr": "EROFS",
    "cwd": "EROFS",
    "cwd_append": "EROFS",
    "nested": "EROFS",
    "remount": "EPERM",
}


def make_workspace(base: Path) -> Path:
    ws = base / "ws"
    ws.mkdir()
    (ws / "notes.md").write_text("hello\n")
    (ws / "script.sh").write_text("#!/bin/sh\necho hi\n")
    (ws / "script.sh").chmod(0o755)
    (ws / "sub").mkdir()
    (ws / "sub" / "deep.txt").write_text("deep\n")
    (ws / "empty").mkdir()
    (ws / "out").mkdir()
    os.symlink("notes.md", ws / "alias")
    # Writable by anyone, so that only the read-only mount can refuse a write there
    # (the permission check would come first otherwise: EACCES, not EROFS).
    for path in (ws / "notes.md", ws / "sub" / "deep.txt"):
        path.chmod(0o666)
    return ws


def snapshot(ws: Path, *, running: bool = False) -> dict[str, tuple[object, ...]]:
    """Every entry of ``ws`` but the rw path ``out``: type and mode, owner, size, content
    or link target, and a file's modification time (a directory's changes while gatewayd
    makes and removes the covered apps folder, which is not the run's doing). While the
    run lives (``running``), that apps folder is left out too."""
    skip = ("out", APPS_DIR_NAME) if running else ("out",)
    seen: dict[str, tuple[object, ...]] = {}
    for path in [ws, *sorted(ws.rglob("*"))]:
        rel = path.relative_to(ws)
        if rel.parts and rel.parts[0] in skip:
            continue
        st = path.lstat()
        size = st.st_size
        if stat.S_ISLNK(st.st_mode):
            body: object = os.readlink(path)
        elif stat.S_ISREG(st.st_mode):
            body = (hashlib.sha256(path.read_bytes()).hexdigest(), st.st_mtime_ns)
        else:
            body = sorted(set(os.listdir(path)) - ({*skip} if path == ws else set()))
            size = 0  # on some file systems, its number of entries
        seen[str(rel)] = (st.st_mode, st.st_uid, st.st_gid, size, body)
    return seen


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-ro-", dir="/tmp"))
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


async def test_no_call_from_inside_changes_a_read_only_workspace_and_it_is_not_lent(
    sb: Sandboxed,
) -> None:
    ws = make_workspace(sb.base)
    before = snapshot(ws)
    run = await sb.run(READ_ONLY, workspace=ws)
    assert run.sandbox is not None
    uid = run.sandbox.user.uid
    # Not lent: nothing of the workspace became the run's, so no chmod from inside (or
    # after a mount trick) could make it writable. The rw path beneath it is lent.
    assert snapshot(ws, running=True) == before
    assert os.stat(ws / "out").st_uid == uid
    assert list(run.sandbox.trees) == [ws / "out"]
    result = await sb.py(run, WRITE_PROBE)
    got = dict(item.split(":") for item in result.stdout.decode().split())
    assert got == {**REFUSED, "out_write": "ok", "out_mkdir": "ok"}, result.stderr
    assert snapshot(ws, running=True) == before  # during the run
    await sb.daemon.runs.end(run.run_id)
    assert snapshot(ws) == before  # and after it, with no apps folder left
    # The rw path was lent and given back like any.
    assert (ws / "out" / "made.txt").read_text() == "by the sandbox"
    for path in (ws / "out", ws / "out" / "made.txt", ws / "out" / "dir"):
        assert os.stat(path).st_uid == 0, path


async def test_a_shell_command_by_sandbox_exec_cannot_change_it_and_fs_write_is_denied(
    sb: Sandboxed,
) -> None:
    # The agent's way in: a tool call asking for a shell command, and the fs tools.
    ws = make_workspace(sb.base)
    before = snapshot(ws)
    run = await sb.run(READ_ONLY, workspace=ws)
    shell = "touch /workspace/new; echo changed >> /workspace/notes.md; echo ok > out/x"
    result = await sb.daemon.runs.exec(
        run.run_id,
        [
            "sh",
            "-c",
            'cogni-tool exec sandbox.exec "$1"; cogni-tool exec fs.write "$2"; echo "fs=$?"',
            "sh",
            json.dumps({"command": shell}),
            json.dumps({"path": "notes.md", "content": "changed"}),
        ],
    )
    lines = result.stdout.decode().splitlines()
    inner = json.loads(lines[0])
    assert inner["exitCode"] == 0, inner  # the last command, into out, succeeded
    assert inner["stderr"].count("Read-only file system") == 2, inner
    assert lines[1] == "fs=15", result.stderr  # policy_denied: the grant is ro
    assert b"policy_denied" in result.stderr and b"read-only" in result.stderr.lower()
    assert (ws / "out" / "x").read_text() == "ok\n"  # the command ran, in /workspace
    assert snapshot(ws, running=True) == before
    await sb.daemon.runs.end(run.run_id)


@pytest.mark.parametrize(
    "alias",
    ["symlink", "symlink-via-sub", "absolute", "absolute-parent"],
)
async def test_a_rw_path_that_is_the_read_only_workspace_under_another_name_refuses_the_run(
    sb: Sandboxed, alias: str
) -> None:
    # Whoever owns the workspace plants `out -> .`: the rw rule would bind (and lend) the
    # whole workspace at /workspace/out. Refused before anything is lent, and so is an
    # absolute rw root at or above it.
    ws = sb.base / "outer" / "ws"
    ws.mkdir(parents=True)
    (ws / "notes.md").write_text("hello\n")
    (ws / "sub").mkdir()
    policy = READ_ONLY
    if alias == "symlink":
        os.symlink(".", ws / "out")
    elif alias == "symlink-via-sub":
        os.symlink("sub/..", ws / "out")
    else:
        (ws / "out").mkdir()
        root = ws if alias == "absolute" else ws.parent
        policy = READ_ONLY.replace(
            "    out: {root: out, mode: rw}\n",
            f"    out: {{root: out, mode: rw}}\n    alias: {{root: {root}, mount: /data/ws, mode: rw}}\n",
        )
    before = snapshot(ws)
    with pytest.raises(UnsafeMounts, match="run refused") as refused:
        await sb.run(policy, workspace=ws)
    if alias != "absolute-parent":  # that one the plan refuses first (the apps folder)
        assert "which is or holds the workspace" in str(refused.value)
        assert "beneath the workspace" in str(refused.value)  # what to do
    assert snapshot(ws) == before  # nothing lent
    assert sb.daemon.runs.uid_pool.in_use == 0
    event = [e for e in await sb.entries() if e.get("event") == "run_refused"][-1]
    assert event["errorCode"] == "bad_request"


async def test_a_read_only_workspace_is_still_held_by_its_run_alone(sb: Sandboxed) -> None:
    # Not lent, but not shared either: gatewayd makes and removes the workspace's apps
    # folder for the run, so a second run there would pull the cover's mount point from
    # under the first. The first run's commands keep working; the next run waits its turn.
    ws = make_workspace(sb.base)
    no_out = READ_ONLY.replace("    out: {root: out, mode: rw}\n", "")
    first = await sb.run(no_out, workspace=ws)
    assert first.sandbox is not None and first.sandbox.held == (ws,)
    for policy in (no_out, SUB_PATH_ONLY):  # another read-only run, or a writing one
        with pytest.raises(WorkspaceInUse, match="which a live run holds"):
            await sb.run(policy, workspace=ws)
    with pytest.raises(WorkspaceInUse, match="overlaps"):
        await sb.run(no_out, workspace=ws / "sub")
    result = await sb.py(first, "print(open('/workspace/notes.md').read(), end='')")
    assert result.stdout == b"hello\n", result.stderr
    await sb.daemon.runs.end(first.run_id)
    second = await sb.run(no_out, workspace=ws)  # free again
    await sb.daemon.runs.end(second.run_id)
    refused = [e for e in await sb.entries() if e.get("event") == "run_refused"]
    assert len(refused) == 3 and {e["errorCode"] for e in refused} == {"bad_request"}


async def test_without_a_grant_on_the_workspace_it_stays_the_commands_writable_directory(
    sb: Sandboxed,
) -> None:
    # As documented: only an explicit ro grant on "." makes the workspace read-only.
    ws = make_workspace(sb.base)
    run = await sb.run(SUB_PATH_ONLY, workspace=ws)
    assert run.sandbox is not None
    assert os.stat(ws / "notes.md").st_uid == run.sandbox.user.uid  # lent, as before
    result = await sb.py(run, "open('/workspace/made.txt', 'x').write('x'); print('made')")
    assert result.stdout == b"made\n", result.stderr
    await sb.daemon.runs.end(run.run_id)
    assert os.stat(ws / "made.txt").st_uid == 0


def _cli_policy(base: Path) -> Path:
    policy = base / "policy.yaml"
    # Mode host: the workspace itself is what must stay unchanged (and out/ written).
    policy.write_text(textwrap.dedent(READ_ONLY) + "workspace: {mode: host}\n")
    return policy


# The reported reproduction, as a shell command.
CHANGE = "touch /workspace/new; echo changed >> /workspace/notes.md; echo ok > /workspace/out/x"


def test_gatewayd_run_with_a_read_only_workspace_leaves_it_unchanged(base: Path) -> None:
    ws = make_workspace(base)
    before = snapshot(ws)
    proc = subprocess.run(
        [
            GATEWAYD,
            "run",
            "--state-dir",
            str(base / "state"),
            *sandbox_options(),
            "--workspace",
            str(ws),
            "--policy",
            str(_cli_policy(base)),
            "--",
            "sh",
            "-c",
            CHANGE,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr  # the last command, into out, succeeded
    assert proc.stderr.count("Read-only file system") == 2, proc.stderr
    assert snapshot(ws) == before
    assert (ws / "out" / "x").read_text() == "ok\n"


def test_gatewayd_exec_in_a_run_with_a_read_only_workspace_leaves_it_unchanged(
    base: Path,
) -> None:
    ws = make_workspace(base)
    before = snapshot(ws)
    daemon = start_daemon(base / "state", sandbox=True)
    try:
        run = daemon.create_run(ws, _cli_policy(base))
        exec_argv = [GATEWAYD, "exec", "--state-dir", str(base / "state"), run["runId"]]
        proc = subprocess.run(
            [*exec_argv, "--", "sh", "-c", CHANGE],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr.count("Read-only file system") == 2, proc.stderr
        assert snapshot(ws, running=True) == before
    finally:
        daemon.stop()
    assert snapshot(ws) == before
    assert (ws / "out" / "x").read_text() == "ok\n"
