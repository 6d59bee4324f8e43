"""Every run on a virtual workspace: a run made from a request (the control socket,
`gatewayd run`) works on a session of the workspace store, in real sandboxes.

- The default mode (overlay) leaves the host directory exactly as it was (bytes, modes,
  symlinks, deleted files) until `gatewayd workspace commit RUN`; discard leaves it so.
- The sandbox and the fs tools see one view (a command's write is read by fs.read, an
  fs.write is read by a command); policy paths beneath the workspace are in that view.
- The base is lent to the run's uid before the overlay is mounted and given back after
  the run (its read-only paths and apps folder fenced out), busy for other runs while
  lent; a mount that fails refuses the run naming the mode and the fix.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
import trio

from gatewayd.config import GatewaydConfig, SandboxUids
from gatewayd.daemon import Daemon, open_daemon
from gatewayd.errors import PolicyViolation
from gatewayd.runs import Grant, Run, RunRequest
from gatewayd.runs.model import WorkspaceRequest
from gatewayd.sandbox.session import SandboxUnavailable, WorkspaceInUse
from gatewayd.workspace.store import WorkspaceStore
from tests.conftest import frame, make_gateway, raw_exchange, request

PY = "/usr/bin/python3"
BIN = Path(sys.executable).parent
GATEWAYD = str(BIN / "gatewayd")
ENV = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}

POLICY = """
version: 1
name: virtual
tools:
  allow: [fs.read, fs.write, fs.list]
filesystem:
  paths:
    workspace: {root: ., mode: rw}
    out: {root: out, mode: rw}
    ref: {root: ref, mode: ro}
limits: {calls_per_second: 1000, burst: 1000}
sandbox: {timeout_s: 30, cpu_s: 20, max_processes: 48}
"""


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "sandboxed runs and overlay mounts need root"
    if not os.path.exists("/usr/bin/bwrap") or not os.path.exists(PY):
        return "needs bubblewrap at /usr/bin/bwrap and the system python3"
    return None


pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-vw-", dir="/tmp"))
    path.chmod(0o711)  # the sandbox's uid passes through to its workspace and socket
    try:
        yield path
    finally:
        subprocess.run(["umount", "-R", "-l", str(path)], capture_output=True, check=False)
        shutil.rmtree(path, ignore_errors=True)


def make_workspace(base: Path, name: str = "ws") -> Path:
    """A workspace with what a diff must carry: text, an executable, a symlink, a
    nested directory, a policy path read-write and one read-only."""
    ws = base / name
    (ws / "src").mkdir(parents=True)
    (ws / "out").mkdir()
    (ws / "ref").mkdir()
    (ws / "notes.md").write_text("hello\n")
    (ws / "src" / "main.py").write_text("print('v1')\n")
    (ws / "run.sh").write_text("#!/bin/sh\necho run\n")
    (ws / "run.sh").chmod(0o755)
    (ws / "gone.txt").write_text("to be deleted\n")
    (ws / "link").symlink_to("notes.md")
    (ws / "out" / "old.log").write_text("old\n")
    (ws / "ref" / "doc.txt").write_text("reference\n")
    return ws


def tree(root: Path, *, owners: bool = True) -> dict[str, tuple[Any, ...]]:
    """Everything of ``root`` a run could change: each entry's kind, mode, owner (unless
    ``owners`` is False: a base lent to a live run), and content (a symlink's target)."""
    found: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                content: object = os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                content = path.read_bytes()
            else:
                content = None
            rel = str(path.relative_to(root))
            owner = st.st_uid if owners else None
            found[rel] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), owner, content)
    return found


# --- `gatewayd run`: the host directory is untouched until commit ----------------------

# What the run does to its workspace: adds, changes, deletes, chmods, relinks, and
# writes into a policy path beneath it.
CHANGES = (
    "set -e; echo new > added.txt; echo more >> notes.md; rm gone.txt; chmod 600 run.sh; "
    "ln -sfn src link; mkdir -p deep/er; echo x > deep/er/f; echo made > out/new.log; "
    "printf 'print(2)\\n' > src/main.py"
)


def gw(base: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [GATEWAYD, *args], capture_output=True, text=True, env=ENV, timeout=180, check=False
    )


def gw_run(
    base: Path, ws: Path, *extra: str, script: str = CHANGES
) -> subprocess.CompletedProcess[str]:
    """`gatewayd run` of ``script`` (a /bin/sh script) on ``ws`` with ``extra`` options."""
    policy = base / "policy.yaml"
    policy.write_text(textwrap.dedent(POLICY))
    return gw(
        base,
        "run",
        "--state-dir",
        str(base / "state"),
        "--lendable-root",
        str(base),
        "--workspace",
        str(ws),
        "--policy",
        str(policy),
        *extra,
        "--",
        "sh",
        "-c",
        script,
    )


def run_id_of(proc: subprocess.CompletedProcess[str]) -> str:
    for line in proc.stderr.splitlines():
        if " started (" in line:
            return line.split("run ", 1)[1].split()[0]
    raise AssertionError(proc.stderr)


def test_a_default_run_leaves_the_directory_untouched_until_commit(base: Path) -> None:
    ws = make_workspace(base)
    before = tree(ws)
    proc = gw_run(base, ws)
    assert proc.returncode == 0, proc.stderr
    run_id = run_id_of(proc)
    assert "workspace mode overlay" in proc.stderr
    assert tree(ws) == before  # bytes, modes, owners, links, the deleted file
    # The run's end says what became of the session and how to go on.
    assert f"workspace (overlay) of {ws}: kept until " in proc.stderr
    for verb in ("diff", "commit", "discard"):
        assert f"gatewayd workspace {verb} --state-dir {base / 'state'} {run_id}" in proc.stderr
    diff = gw(base, "workspace", "diff", "--state-dir", str(base / "state"), run_id)
    assert diff.returncode == 0, diff.stderr
    assert "added.txt" in diff.stdout and "gone.txt" in diff.stdout
    assert tree(ws) == before
    commit = gw(base, "workspace", "commit", "--state-dir", str(base / "state"), run_id)
    assert commit.returncode == 0, commit.stderr
    after = tree(ws)
    owner = os.stat(ws).st_uid
    assert after["added.txt"][3] == b"new\n"
    assert after["notes.md"][3] == b"hello\nmore\n"
    assert "gone.txt" not in after
    assert after["run.sh"][1] == 0o600
    assert after["link"][3] == "src"
    assert after["deep/er/f"][3] == b"x\n"
    assert after["out/new.log"][3] == b"made\n" and after["out/old.log"] == before["out/old.log"]
    assert after["src/main.py"][3] == b"print(2)\n"
    assert after["ref/doc.txt"] == before["ref/doc.txt"]
    # Nothing of it is the sandbox's: committed files are the directory owner's.
    assert {entry[2] for entry in after.values()} == {owner}
    assert not any(name.startswith("apps") for name in after)  # the run's cover folder


def test_discard_leaves_the_directory_exactly_as_before(base: Path) -> None:
    ws = make_workspace(base)
    before = tree(ws)
    proc = gw_run(base, ws)
    assert proc.returncode == 0, proc.stderr
    run_id = run_id_of(proc)
    discard = gw(base, "workspace", "discard", "--state-dir", str(base / "state"), run_id)
    assert discard.returncode == 0, discard.stderr
    assert tree(ws) == before
    again = gw(base, "workspace", "commit", "--state-dir", str(base / "state"), run_id)
    assert again.returncode != 0 and run_id in again.stderr  # nothing left to commit


def test_on_end_commit_and_mode_host_are_chosen_on_the_command_line(base: Path) -> None:
    ws = make_workspace(base)
    proc = gw_run(base, ws, "--on-end", "commit")
    assert proc.returncode == 0, proc.stderr
    assert f"workspace (overlay) of {ws}: committed" in proc.stderr
    assert "gatewayd workspace commit" not in proc.stderr  # nothing kept to act on
    assert (ws / "added.txt").read_text() == "new\n" and not (ws / "gone.txt").exists()
    host = make_workspace(base, "ws-host")
    proc = gw_run(base, host, "--workspace-mode", "host", "--on-end", "discard")
    assert proc.returncode == 0, proc.stderr
    assert f"workspace (host) of {host}: discarded" in proc.stderr
    assert tree(host) == tree(make_workspace(base, "ws-fresh"))


def test_a_run_cut_off_by_its_time_limit_keeps_its_session_instead_of_committing(
    base: Path,
) -> None:
    ws = make_workspace(base)
    before = tree(ws)
    script = "echo half > half.txt; sleep 60"
    proc = gw_run(base, ws, "--on-end", "commit", "--max-runtime", "3", script=script)
    assert proc.returncode == 124, proc.stderr  # like timeout(1)
    assert "exceeded its 3 s (maxRuntimeSec); its command was stopped" in proc.stderr
    assert "could not start" not in proc.stderr
    assert "commit skipped: the run ended before its work did (max_runtime_exceeded)" in (
        proc.stderr
    )
    assert tree(ws) == before  # the half-done work never reached the base
    run_id = run_id_of(proc)
    diff = gw(base, "workspace", "diff", "--state-dir", str(base / "state"), run_id)
    assert diff.returncode == 0 and "half.txt" in diff.stdout, diff.stderr
    commit = gw(base, "workspace", "commit", "--state-dir", str(base / "state"), run_id)
    assert commit.returncode == 0, commit.stderr  # the operator may still apply it
    assert (ws / "half.txt").read_text() == "half\n"


def test_a_mode_the_policy_keeps_from_requests_is_refused_naming_the_allowed(base: Path) -> None:
    ws = make_workspace(base)
    before = tree(ws)
    policy = base / "policy.yaml"
    policy.write_text(textwrap.dedent(POLICY) + "workspace:\n  request_modes: [overlay]\n")
    proc = gw(
        base,
        "run",
        "--state-dir",
        str(base / "state"),
        "--lendable-root",
        str(base),
        "--workspace",
        str(ws),
        "--policy",
        str(policy),
        "--workspace-mode",
        "host",
        "--",
        "true",
    )
    assert proc.returncode != 0
    assert "policy_denied" in proc.stderr and "choose only: overlay" in proc.stderr
    assert tree(ws) == before


# --- one view for the sandbox and the fs tools, on the control socket's runs ----------


def sandbox_config(base: Path, **settings: Any) -> GatewaydConfig:
    return GatewaydConfig(
        state_dir=base / "state",
        policy_dirs=(base / "policies",),
        lendable_roots=(base,),
        netns_prefix=f"cgt{secrets.token_hex(4)}-",
        sandbox_uids=SandboxUids(base=1_700_000_000 + secrets.randbelow(50_000) * 1024, count=64),
        **settings,
    )


@pytest.fixture
async def daemon(base: Path) -> AsyncIterator[Daemon]:
    (base / "policies").mkdir()
    (base / "policies" / "virtual.yaml").write_text(textwrap.dedent(POLICY))
    config = sandbox_config(base)
    async with open_daemon(config, preload=True, control_socket=base / "control.sock") as running:
        assert running.runs.support.available, running.runs.support.reason
        yield running


async def control(daemon: Daemon, method: str, target: str, body: Any = None) -> Any:
    from gatewayd.cli.control_client import control_request

    socket = daemon.config.state_dir.parent / "control.sock"
    return await trio.to_thread.run_sync(control_request, socket, method, target, body)


async def sh(daemon: Daemon, run_id: str, script: str) -> dict[str, Any]:
    status, answer = await control(
        daemon, "POST", f"/v1/runs/{run_id}/exec", {"command": ["sh", "-c", script]}
    )
    assert status == 200 and answer["ok"], answer
    result: dict[str, Any] = answer["result"]
    return result


async def test_a_control_socket_run_sees_one_view_from_the_sandbox_and_the_fs_tools(
    daemon: Daemon, base: Path
) -> None:
    ws = make_workspace(base)
    make_workspace(base, "ws-copy")
    before = tree(ws)
    status, created = await control(
        daemon,
        "POST",
        "/v1/runs",
        {
            "workspacePath": str(ws),
            "policy": "virtual",
            "actorId": "tester",
            "tenantId": "t1",
            "grant": {"allowSandbox": True},
        },
    )
    assert status == 201, created
    summary = created["run"]
    run_id = summary["runId"]
    assert summary["workspace"]["mode"] == "overlay"
    assert summary["workspace"]["base"] == str(ws)
    assert summary["workspace"]["onEnd"] == "keep"
    assert summary["workspace"]["root"] != str(ws)
    run = daemon.runs.registry.get(run_id)
    assert run is not None and run.sandbox is not None and run.workspace is not None
    uid = run.sandbox.user.uid
    # Lent before the mount: the base is the run's, but its read-only path and what
    # it writes only in the view are not.
    assert os.stat(ws / "notes.md").st_uid == uid
    assert os.stat(ws / "ref").st_uid != uid and os.stat(ws / "ref" / "doc.txt").st_uid != uid
    # The sandbox writes; fs.read (through the run socket, from inside) reads it back.
    out = await sh(
        daemon,
        run_id,
        "echo from-sandbox > made.txt && echo more > out/new.log && "
        'cogni-tool exec fs.read \'{"path": "/workspace/made.txt"}\'',
    )
    assert out["exitCode"] == 0, out
    assert "from-sandbox" in out["stdout"]
    # fs.write (a tool, host-side) writes; the sandbox's next command reads it.
    out = await sh(
        daemon,
        run_id,
        'cogni-tool exec fs.write \'{"path": "/workspace/tool.txt", "content": "by-tool"}\''
        " >/dev/null && cat tool.txt && echo && cat out/new.log",
    )
    assert out["exitCode"] == 0, out
    assert out["stdout"].split() == ["by-tool", "more"]
    # The read-only path stays read-only, in the sandbox and for the tools.
    out = await sh(daemon, run_id, "echo x > ref/doc.txt")
    assert out["exitCode"] != 0
    assert tree(ws, owners=False) == tree(base / "ws-copy", owners=False)
    # While the run lives, the view also holds the empty apps folder made for the
    # sandbox's cover (gatewayd.sandbox.appsfolder); it goes before the session is sealed.
    diff = await trio.to_thread.run_sync(daemon.runs.workspaces.diff, run_id)
    assert sorted(diff.added) == ["apps/", "made.txt", "out/new.log", "tool.txt"]
    # The policy path beneath the workspace was not lent through the view: nothing of
    # it was copied into the delta but what the run wrote.
    upper = run.workspace.directory / "session" / "upper"
    assert not (upper / "out" / "old.log").exists()
    status, ended = await control(daemon, "DELETE", f"/v1/runs/{run_id}")
    assert status == 200, ended
    assert ended["run"]["workspace"]["fate"].startswith("kept until ")
    # Given back, untouched; what the session holds is the run's work alone.
    assert tree(ws) == before
    diff = await trio.to_thread.run_sync(daemon.runs.workspaces.diff, run_id)
    assert sorted(diff.added) == ["made.txt", "out/new.log", "tool.txt"]
    entries = [
        json.loads(line)
        for line in daemon.config.resolved_audit_path.read_text().splitlines()
        if line
    ]
    events = [e.get("event") for e in entries if e.get("runId") == run_id]
    assert events.index("run_created") < events.index("workspace_opened")
    assert events.index("workspace_ended") < events.index("run_ended")
    ended_entry = next(e for e in entries if e.get("event") == "workspace_ended")
    assert ended_entry["detail"]["added"] == 3
    assert ended_entry["detail"]["action"].startswith("kept until ")
    opened = next(e for e in entries if e.get("event") == "workspace_opened")
    assert opened["detail"]["mode"] == "overlay"
    assert opened["detail"]["modeFrom"] == "configuration"


async def test_a_lent_base_is_busy_for_other_runs_and_free_after(
    daemon: Daemon, base: Path
) -> None:
    ws = make_workspace(base)
    first = await start(daemon, base, ws)
    for mode in ("overlay", "host"):
        with pytest.raises(WorkspaceInUse, match="one run at a time"):
            await start(daemon, base, ws, WorkspaceRequest(mode=mode))
    # Within the base is busy too (another run's workspace inside this one's).
    (ws / "src" / "out").mkdir()
    (ws / "src" / "ref").mkdir()
    with pytest.raises(WorkspaceInUse):
        await start(daemon, base, ws / "src")
    await daemon.runs.end(first.run_id)
    second = await start(daemon, base, ws)
    await daemon.runs.end(second.run_id)
    assert {os.stat(p).st_uid for p in ws.rglob("*")} == {os.stat(ws).st_uid}


async def test_an_end_that_fails_after_the_give_back_leaves_the_base_free(
    daemon: Daemon, base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Seal, give-back and on-end run as one worker-thread step: a failure in its last
    # part still knows the base was given back (no other run is kept from it).
    ws = make_workspace(base)
    run = await start(daemon, base, ws)
    store = daemon.runs.workspaces

    def failing_end(run_id: str, **_: Any) -> str:
        raise OSError(5, "Input/output error (injected)")

    with monkeypatch.context() as patched:
        patched.setattr(store, "end_of_run", failing_end)
        await daemon.runs.end(run.run_id)
    assert run.workspace_fate == "kept (its end failed: see the audit log)"
    entries = [
        json.loads(line)
        for line in daemon.config.resolved_audit_path.read_text().splitlines()
        if line
    ]
    ended = next(
        e for e in entries if e.get("event") == "workspace_ended" and e.get("runId") == run.run_id
    )
    assert "injected" in ended["detail"]["error"]
    assert ended["detail"]["action"] == "kept (its end failed; see error)"
    assert isinstance(ended["detail"]["baseEntriesReturned"], int)
    assert {os.stat(p).st_uid for p in ws.rglob("*")} == {os.stat(ws).st_uid}
    again = await start(daemon, base, ws)  # not stuck: the base was given back
    await daemon.runs.end(again.run_id)


async def test_a_mount_that_fails_refuses_the_run_naming_the_mode_and_the_fix(
    daemon: Daemon, base: Path
) -> None:
    ws = make_workspace(base, "a,b")  # overlayfs options cannot carry a comma
    before = tree(ws)
    with pytest.raises(SandboxUnavailable) as caught:
        await start(daemon, base, ws)
    message = str(caught.value)
    assert "mode overlay" in message and "workspace_mode" in message
    assert "," in message  # the cause
    assert tree(ws) == before  # given back: owners as they were
    assert daemon.runs.registry.all() == []
    assert WorkspaceStore(daemon.config.resolved_agent_dir).list() == []


async def test_an_absolute_rw_path_into_the_base_is_refused(daemon: Daemon, base: Path) -> None:
    ws = make_workspace(base)
    policy = textwrap.dedent(POLICY).replace(
        "out: {root: out, mode: rw}", f"out: {{root: {ws}/out, mode: rw, mount: /srv/out}}"
    )
    path = base / "absolute.yaml"
    path.write_text(policy)
    with pytest.raises(PolicyViolation, match="relative to the workspace"):
        await start(daemon, base, ws, policy=str(path))


async def test_a_sandbox_refused_after_the_session_opened_gives_the_base_back_first(
    daemon: Daemon, base: Path
) -> None:
    ws = make_workspace(base)
    before = tree(ws)
    not_an_image = base / "not-an-image"
    not_an_image.mkdir()
    request = RunRequest(
        workspacePath=str(ws),
        policy="virtual",
        actorId="tester",
        tenantId="t1",
        grant=Grant(allowSandbox=True),
        workspace=WorkspaceRequest(mode="overlay", onEnd="commit"),
        sandboxImage=str(not_an_image),
    )
    pool = daemon.runs.uid_pool
    owners_at_release: list[set[int]] = []
    release = pool.release

    def watched(user: Any) -> None:
        owners_at_release.append({os.lstat(p).st_uid for p in [ws, *ws.rglob("*")]})
        release(user)

    pool.release = watched  # type: ignore[method-assign]
    try:
        with pytest.raises(SandboxUnavailable):
            await daemon.runs.start(request)
    finally:
        del pool.release
    # The uid went back to the pool once, after the base was the owner's again.
    assert owners_at_release == [{os.stat(ws).st_uid}]
    assert tree(ws) == before  # owners given back, nothing committed
    assert pool.in_use == 0
    assert WorkspaceStore(daemon.config.resolved_agent_dir).list() == []
    again = await start(daemon, base, ws)  # the base is free for the next run
    await daemon.runs.end(again.run_id)


@pytest.mark.parametrize("mode", ["overlay", "agentfs"])
async def test_a_rw_path_holding_the_base_is_refused_in_a_virtual_mode(
    daemon: Daemon, base: Path, mode: Literal["overlay", "agentfs"]
) -> None:
    holder = base / "home"
    holder.mkdir()
    ws = make_workspace(holder)
    before = tree(holder)
    policy = textwrap.dedent(POLICY).replace(
        "out: {root: out, mode: rw}", f"out: {{root: {holder}, mode: rw, mount: /srv/home}}"
    )
    path = base / "holding.yaml"
    path.write_text(policy)
    with pytest.raises(PolicyViolation, match="holds the workspace"):
        await start(daemon, base, ws, WorkspaceRequest(mode=mode), policy=str(path))
    assert tree(holder) == before
    assert daemon.runs.registry.all() == []


async def start(
    daemon: Daemon,
    base: Path,
    ws: Path,
    workspace: WorkspaceRequest | None = None,
    *,
    policy: str = "virtual",
) -> Run:
    request = RunRequest(
        workspacePath=str(ws),
        policy=policy,
        actorId="tester",
        tenantId="t1",
        grant=Grant(allowSandbox=True),
        workspace=workspace,
    )
    return await daemon.runs.start(request, policy_paths=policy != "virtual")


@pytest.mark.parametrize("mode", ["overlay", "host"])
async def test_the_made_apps_folders_record_is_flushed_only_outside_an_overlay_view(
    daemon: Daemon, base: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    # An overlay session's view is a mount a reboot takes, with the folder made in it:
    # its record is written (a crash of gatewayd alone leaves it in the page cache for
    # the next start), not flushed. In host mode the folder is the workspace's own.
    from gatewayd.sandbox.appsfolder import MADE_RECORD

    ws = make_workspace(base)
    flushed: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        flushed.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    run = await start(daemon, base, ws, WorkspaceRequest(mode=mode))
    monkeypatch.undo()
    try:
        assert run.sandbox is not None and run.sandbox.apps_folder is not None
        assert run.sandbox.apps_folder.made is not None
        assert (run.directory / MADE_RECORD).is_file()
        record_flushed = any(MADE_RECORD in path for path in flushed)
        assert record_flushed is (mode == "host"), flushed
    finally:
        await daemon.runs.end(run.run_id)


# --- a run without an OS sandbox: the fs tools still work in the session's view --------


async def test_a_degraded_run_writes_through_the_fs_tools_into_the_view_only(
    base: Path,
) -> None:
    ws = make_workspace(base)
    (ws / "docs").mkdir()  # the open policy's read-only path
    before = tree(ws)
    (base / "gw").mkdir()
    async with make_gateway(base / "gw", workspace_mode="overlay") as gw:
        run = await gw.create_run(ws)
        assert run.sandbox is None and run.workspace is not None
        assert run.workspace.mode == "overlay"
        payload = frame(request(run, "fs.write", {"path": "made.txt", "content": "degraded"}))
        [answer] = await raw_exchange(run.socket_path, payload)
        assert answer["ok"], answer
        payload = frame(request(run, "fs.read", {"path": "made.txt"}, tcid="c2"))
        [answer] = await raw_exchange(run.socket_path, payload)
        assert answer["ok"] and answer["value"]["content"] == "degraded", answer
        assert not (ws / "made.txt").exists()
        ended = await gw.daemon.runs.end(run.run_id)
        assert ended is not None
        assert ended["workspace"]["fate"].startswith("kept until ")
        diff = await trio.to_thread.run_sync(gw.daemon.runs.workspaces.diff, run.run_id)
        assert diff.added == ["made.txt"]
    assert tree(ws) == before


async def test_the_session_is_synced_after_each_command_of_the_sandbox(
    daemon: Daemon, base: Path
) -> None:
    ws = make_workspace(base)
    run = await start(daemon, base, ws)
    assert run.workspace is not None
    synced: list[bool] = []
    session = run.workspace.session
    view = run.workspace.root
    real_sync = session.sync

    def counting_sync() -> None:
        # After the command ended: what it wrote is in the view, never in the base.
        synced.append((view / "made.txt").exists() and not (ws / "made.txt").exists())
        real_sync()

    session.sync = counting_sync  # type: ignore[method-assign]
    for script in ("echo x > made.txt", "exit 3", "sleep 5"):
        await daemon.runs.exec(run.run_id, ["sh", "-c", script], timeout_s=1)
    assert synced == [True, True, True]  # three commands (one timed out), three syncs
    await daemon.runs.end(run.run_id)


# --- a crash: the next start gives the base back and keeps the session -----------------


def test_a_crashed_daemons_overlay_run_is_kept_and_its_base_given_back(base: Path) -> None:
    from tests.livedaemon import start_daemon

    ws = make_workspace(base)
    before = tree(ws)
    policy = base / "policy.yaml"
    policy.write_text(textwrap.dedent(POLICY))
    state = base / "state"
    daemon = start_daemon(state, sandbox=True, random_ids=False)
    try:
        run_id = daemon.create_run(ws, policy)["runId"]
        status, _ = daemon.control(
            "POST", f"/v1/runs/{run_id}/exec", {"command": ["sh", "-c", "echo x > made.md"]}
        )
        assert status == 200
        assert os.stat(ws / "notes.md").st_uid != 0  # lent, before the mount
        daemon.proc.kill()  # a crash: no cleanup at all
        daemon.proc.wait()
    finally:
        daemon.stop()
    assert os.stat(ws / "notes.md").st_uid != 0  # still lent: the lease is in the session
    restarted = start_daemon(state, sandbox=True, random_ids=False)
    try:
        assert tree(ws) == before  # given back; nothing of the run in the base
        status, listed = restarted.control("GET", "/v1/workspaces")
        assert status == 200, listed
        [session] = [s for s in listed["workspaces"] if s["runId"] == run_id]
        assert session["state"] == "kept" and session["mode"] == "overlay"
        status, diff = restarted.control("GET", f"/v1/workspaces/{run_id}/diff")
        assert status == 200, diff
        # The run's file, and not the apps folder made for its sandbox's cover.
        assert diff["diff"]["added"] == ["made.md"]
        status, _ = restarted.control("POST", f"/v1/workspaces/{run_id}/discard")
        assert status == 200
    finally:
        restarted.stop()
    assert tree(ws) == before


# --- a stop signal to a one-shot run: ended like a daemon's stop -------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_ends_the_one_shot_run_and_gives_the_base_back(
    base: Path, signum: signal.Signals
) -> None:
    ws = make_workspace(base)
    before = tree(ws)
    policy = base / "policy.yaml"
    policy.write_text(textwrap.dedent(POLICY))
    state = base / "state"
    argv = [GATEWAYD, "run", "--state-dir", str(state), "--lendable-root", str(base)]
    argv += ["--workspace", str(ws), "--policy", str(policy), "--on-end", "commit"]
    argv += ["--", "sh", "-c", "echo half > half.txt; echo ready; sleep 60"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == b"ready\n"  # the command runs, the base is lent
        assert os.stat(ws / "notes.md").st_uid != 0
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = err.decode()
    assert proc.returncode == 128 + signum, stderr
    assert f"gatewayd: {signum.name}: the run is being ended" in stderr, stderr
    assert tree(ws) == before  # given back, unmounted, and nothing committed
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(base) not in mounts
    run_id = run_id_of(subprocess.CompletedProcess(argv, proc.returncode, "", stderr))
    diff = gw(base, "workspace", "diff", "--state-dir", str(state), run_id)
    assert diff.returncode == 0 and "half.txt" in diff.stdout, diff.stderr  # kept
    log = state / "audit" / "audit.jsonl"
    verify = gw(base, "audit", "verify", str(log))
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert "daemon_stopping" in log.read_text()
