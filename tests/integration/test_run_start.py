"""A run's start and end in a real daemon with the OS sandbox: nothing forks the daemon,
the network namespace made by the namespace thread is loopback only from inside a real
sandbox, and the uid pool's records stay right while runs start and end at once. The
namespace made while the run's session opens: removed when the start is then refused,
its failure raised at the sandbox's step, and a daemon killed with both made leaves
nothing after its next start. A start's and an end's audit entries are durable, in
order, when each returns.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import traceback
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from gatewayd.config import GatewaydConfig, SandboxUids
from gatewayd.daemon import Daemon, open_daemon
from gatewayd.policy.workspace_section import WorkspaceModeName
from gatewayd.runs import Grant, Run, RunRequest
from gatewayd.sandbox.netns import NETNS_RUN_DIR, NetnsError
from gatewayd.sandbox.session import ImageRefused, WorkspaceInUse
from gatewayd.sandbox.uids import UidPoolExhausted
from tests.integration.test_run_sandbox import OUTSIDE_V4, POLICY, PY, _unavailable

pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))

# Every fork of this process, with the stack that made it.
_FORK_STACKS: list[list[str]] = []
os.register_at_fork(
    before=lambda: _FORK_STACKS.append([frame.filename for frame in traceback.extract_stack()])
)
# A command's launcher (and a spare one made ahead of a run's next command) forks bwrap:
# that is a command starting, not the run's start or end.
_LAUNCHER = os.path.join("gatewayd", "sandbox", "launch.py")

UID_COUNT = 3


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-rs-", dir="/tmp"))
    path.chmod(0o711)  # the sandbox's uid passes through to its workspace and socket
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def sandboxed_config(base: Path, mode: WorkspaceModeName) -> GatewaydConfig:
    """A sandboxed daemon's configuration on ``base`` (its policy written there), with
    its own prefix and uid range, runs' workspaces in ``mode``."""
    (base / "sandboxed.yaml").write_text(textwrap.dedent(POLICY))
    return GatewaydConfig(
        state_dir=base / "state",
        policy_dirs=(base,),
        workspace_mode=mode,
        netns_prefix=f"cgrs{secrets.token_hex(4)}-",
        sandbox_uids=SandboxUids(
            base=1_720_000_000 + secrets.randbelow(50_000) * 1024, count=UID_COUNT
        ),
    )


@pytest.fixture
async def daemon(base: Path) -> AsyncIterator[Daemon]:
    config = sandboxed_config(base, "host")
    async with open_daemon(config, preload=True) as started:
        assert started.runs.support.available, started.runs.support.reason
        yield started


def sandboxed_request(workspace: Path) -> RunRequest:
    """A request for a run of the sandboxed policy on ``workspace`` (made if missing)."""
    workspace.mkdir(exist_ok=True)
    return RunRequest(
        workspacePath=str(workspace),
        policy="sandboxed",
        actorId="tester",
        tenantId="t1",
        grant=Grant(allowSandbox=True),
    )


async def start(daemon: Daemon, base: Path, name: str) -> Run:
    return await daemon.runs.start(sandboxed_request(base / name))


def forks_outside_the_launcher(since: int) -> list[list[str]]:
    return [stack for stack in _FORK_STACKS[since:] if not any(_LAUNCHER in f for f in stack)]


async def test_a_run_starts_and_ends_without_a_fork_and_its_namespace_is_loopback_only(
    daemon: Daemon, base: Path
) -> None:
    forks = len(_FORK_STACKS)
    run = await start(daemon, base, "ws")
    assert run.sandbox is not None
    assert forks_outside_the_launcher(forks) == []
    # From inside a real sandbox of the run: lo alone, up (its own loopback answers), no
    # route anywhere, the outside unreachable.
    probe = await daemon.runs.exec(
        run.run_id,
        [
            PY,
            "-I",
            "-c",
            textwrap.dedent(
                f"""
                import json, socket
                out = {{"interfaces": socket.if_nameindex()}}
                with socket.create_server(("127.0.0.1", 0)) as server:
                    socket.create_connection(server.getsockname(), timeout=5).close()
                    out["loopback"] = "answers"
                out["routes"] = open("/proc/net/route").read().splitlines()[1:]
                out["routes6"] = [
                    line for line in open("/proc/net/ipv6_route").read().splitlines()
                    if not line.split()[-1] == "lo"
                ]
                s = socket.socket()
                s.settimeout(5)
                try:
                    s.connect(({OUTSIDE_V4!r}, 80))
                    out["outside"] = "connected"
                except OSError as e:
                    out["outside"] = e.errno
                print(json.dumps(out))
                """
            ),
        ],
    )
    assert probe.exitCode == 0, probe.stderr
    seen = json.loads(probe.stdout)
    assert seen == {
        "interfaces": [[1, "lo"]],
        "loopback": "answers",
        "routes": [],
        "routes6": [],
        "outside": 101,  # ENETUNREACH
    }
    # The namespace thread is back in the daemon's namespace; so is every thread.
    home = os.stat("/proc/self/ns/net")
    for thread in threading.enumerate():
        if thread.native_id is not None:
            st = os.stat(f"/proc/self/task/{thread.native_id}/ns/net")
            assert (st.st_dev, st.st_ino) == (home.st_dev, home.st_ino), thread.name
    path = run.sandbox.netns.path
    forks = len(_FORK_STACKS)
    await daemon.runs.end(run.run_id)
    assert forks_outside_the_launcher(forks) == []
    assert not os.path.lexists(path)
    with open("/proc/self/mountinfo", encoding="utf-8") as info:
        assert not [line for line in info if line.split(" ")[4] == str(path)]
    assert not list(NETNS_RUN_DIR.glob(f"{daemon.config.resolved_netns_prefix}*"))


async def start_or_refused(
    daemon: Daemon, base: Path, name: str, runs: list[Run], refused: list[str]
) -> None:
    try:
        runs.append(await start(daemon, base, name))
    except UidPoolExhausted as exc:
        refused.append(str(exc))


async def test_the_uid_pools_records_stay_right_while_runs_start_and_end_at_once(
    daemon: Daemon, base: Path
) -> None:
    pool = daemon.runs.uid_pool
    scans: list[int] = []
    for round_ in range(3):
        runs: list[Run] = []
        refused: list[str] = []
        async with trio.open_nursery() as nursery:
            for i in range(UID_COUNT + 2):
                name = f"ws-{round_}-{i}"
                nursery.start_soon(start_or_refused, daemon, base, name, runs, refused)
        # Every uid lent once, to one live run; the runs past the pool's size refused.
        assert len(runs) == UID_COUNT and len(refused) == 2, refused
        assert all("end a run or configure a larger range" in message for message in refused)
        uids = {run.sandbox.user.uid for run in runs if run.sandbox is not None}
        assert len(uids) == UID_COUNT and pool.in_use == UID_COUNT
        async with trio.open_nursery() as nursery:
            for run in runs:
                nursery.start_soon(daemon.runs.end, run.run_id)
        assert pool.in_use == 0
        # The start-up probe's uid is looked at again (one scan, the first time the
        # pool runs out); uids back from ended runs are lent again without a look.
        assert pool.held == frozenset()
        scans.append(pool.scans)
    assert scans[0] <= 1 and scans[1:] == [scans[0]] * 2


# --- the namespace made while the session opens ----------------------------------------


def _namespaces(daemon: Daemon) -> set[str]:
    return {p.name for p in NETNS_RUN_DIR.glob(f"{daemon.config.resolved_netns_prefix}*")}


async def test_a_start_refused_after_its_namespace_was_made_ahead_leaves_none(
    daemon: Daemon, base: Path
) -> None:
    holder = await start(daemon, base, "held")
    assert _namespaces(daemon) == {f"{daemon.config.resolved_netns_prefix}{holder.run_id}"}
    # The sandbox refuses the second run on the workspace the first holds: a step after
    # the namespace began to be made, before the sandbox takes it.
    with pytest.raises(WorkspaceInUse, match="one workspace"):
        await start(daemon, base, "held")
    (base / "other").mkdir()
    with pytest.raises(ImageRefused) as image_refused:
        await daemon.runs.start(
            RunRequest(
                workspacePath=str(base / "other"),
                policy="sandboxed",
                actorId="tester",
                tenantId="t1",
                grant=Grant(allowSandbox=True),
                sandboxImage=str(base / "no-such-image"),
            )
        )
    assert str(base / "no-such-image") in str(image_refused.value)
    assert _namespaces(daemon) == {f"{daemon.config.resolved_netns_prefix}{holder.run_id}"}
    assert daemon.runs.uid_pool.in_use == 1
    await daemon.runs.end(holder.run_id)
    assert _namespaces(daemon) == set()


async def test_a_namespace_that_cannot_be_made_refuses_the_start_at_its_step(
    daemon: Daemon, base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gatewayd.sandbox import netns as netns_module

    # No interface of that index in a new namespace: the creation fails, and the start
    # raises it where the sandbox takes the namespace, leaving nothing.
    monkeypatch.setattr(netns_module, "_LOOPBACK_INDEX", 999)
    (base / "ws").mkdir()
    with pytest.raises(NetnsError, match=r"has no 'lo' interface") as refused:
        await start(daemon, base, "ws")
    assert "network namespace" in str(refused.value)
    assert _namespaces(daemon) == set()
    assert daemon.runs.uid_pool.in_use == 0
    assert os.stat(base / "ws").st_uid == 0, "nothing stays lent"


CRASHING_START = """
import os, sys, time
from pathlib import Path
import trio
from gatewayd.config import GatewaydConfig, SandboxUids
from gatewayd.daemon import open_daemon
from gatewayd.runs import Grant, RunRequest
from gatewayd.sandbox.netns import NETNS_RUN_DIR
from gatewayd.workspace import store as store_module

base, prefix, uid_base = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
real_open = store_module.WorkspaceStore.open_session

def open_then_die(self, run_id, *args, **kwargs):
    real_open(self, run_id, *args, **kwargs)  # the base lent, the overlay mounted
    deadline = time.monotonic() + 10
    while not (NETNS_RUN_DIR / f"{prefix}{run_id}").exists():  # made meanwhile
        if time.monotonic() > deadline:
            os._exit(3)
        time.sleep(0.001)
    os._exit(9)  # a crash between the two: no cleanup at all

store_module.WorkspaceStore.open_session = open_then_die

async def main():
    config = GatewaydConfig(
        state_dir=base / "state", policy_dirs=(base,), netns_prefix=prefix,
        sandbox_uids=SandboxUids(base=uid_base, count=3), workspace_mode="overlay",
    )
    async with open_daemon(config, preload=True) as daemon:
        await daemon.runs.start(
            RunRequest(workspacePath=str(base / "ws"), policy="sandboxed", actorId="tester",
                       tenantId="t1", grant=Grant(allowSandbox=True)),
        )

trio.run(main)
"""


async def test_a_daemon_killed_while_the_namespace_and_the_session_are_made_leaves_nothing(
    base: Path,
) -> None:
    """The namespace is made while the workspace session opens: a crash with both made
    (the base lent, the overlay mounted, the namespace pinned) is cleaned by the next
    start as before: namespace removed, base given back, the session kept."""
    (base / "sandboxed.yaml").write_text(textwrap.dedent(POLICY))
    ws = base / "ws"
    ws.mkdir()
    (ws / "notes.md").write_text("hello\n")
    prefix = f"cgrc{secrets.token_hex(4)}-"
    uid_base = 1_720_000_000 + secrets.randbelow(50_000) * 1024
    child = subprocess.run(
        [sys.executable, "-c", CRASHING_START, str(base), prefix, str(uid_base)],
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
        capture_output=True,
        check=False,
        timeout=120,
    )
    assert child.returncode == 9, child.stderr.decode()[-3000:]
    [netns] = NETNS_RUN_DIR.glob(f"{prefix}*")
    run_id = netns.name.removeprefix(prefix)
    assert os.stat(ws / "notes.md").st_uid != 0, "lent before the crash"
    assert str(base) in Path("/proc/self/mountinfo").read_text(), "the view still mounted"
    config = GatewaydConfig(
        state_dir=base / "state",
        policy_dirs=(base,),
        netns_prefix=prefix,
        sandbox_uids=SandboxUids(base=uid_base, count=3),
        workspace_mode="overlay",
    )
    async with open_daemon(config, preload=True) as restarted:
        assert not list(NETNS_RUN_DIR.glob(f"{prefix}*"))
        assert os.stat(ws / "notes.md").st_uid == 0 and os.stat(ws).st_uid == 0
        info = restarted.runs.workspaces.info(run_id)
        assert info.state == "kept" and info.note == "its daemon ended during the run"
        mounts = Path("/proc/self/mountinfo").read_text()
        assert str(base) not in mounts
        assert list((base / "state" / "runs").iterdir()) == []


# --- the audit entries of a start and an end: one flush each ----------------------------


def _events_of(daemon: Daemon, run_id: str) -> list[str]:
    """The events of ``run_id`` on disk, in the log's order; each one durable (its seq at
    or below the log's durable one)."""
    lines = daemon.audit.path.read_text().splitlines()
    entries = [e for e in map(json.loads, lines) if e.get("runId") == run_id]
    assert all(e["seq"] <= daemon.audit.durable_seq for e in entries)
    return [e["event"] for e in entries]


async def test_a_start_and_an_end_return_once_their_entries_are_durable_in_order(
    daemon: Daemon, base: Path
) -> None:
    run = await start(daemon, base, "audited")
    # run_created rides workspace_opened's flush: both on disk, in order, once it returns.
    assert _events_of(daemon, run.run_id) == ["run_created", "workspace_opened"]
    await daemon.runs.end(run.run_id)
    assert _events_of(daemon, run.run_id) == [
        "run_created",
        "workspace_opened",
        "workspace_ended",
        "run_ended",
    ]


async def test_an_overlay_sessions_loan_is_planned_in_the_sessions_own_hand_off(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What of the base is lent is planned in the worker thread that opens the session
    # and lends it: one hand-off, not one for the plan and another for the session.
    from gatewayd.runs import workspaces

    config = sandboxed_config(base, "overlay")
    handed: list[str] = []
    planned_in: list[bool] = []
    real_run_sync = trio.to_thread.run_sync
    real_plan = workspaces.plan_base_loan

    async def run_sync(fn: Any, *args: Any, **kwargs: Any) -> Any:
        handed.append(getattr(fn, "__qualname__", repr(fn)))
        return await real_run_sync(fn, *args, **kwargs)

    def plan_base_loan(*args: Any, **kwargs: Any) -> Any:
        planned_in.append(threading.current_thread() is not threading.main_thread())
        return real_plan(*args, **kwargs)

    async with open_daemon(config, preload=True) as started:
        monkeypatch.setattr(trio.to_thread, "run_sync", run_sync)
        monkeypatch.setattr("gatewayd.runs.lifecycle.plan_base_loan", plan_base_loan)
        run = await start(started, base, "ws")
        monkeypatch.undo()
        assert run.workspace is not None and run.workspace.mode == "overlay"
        assert planned_in == [True]
        assert not [name for name in handed if "plan_base_loan" in name], handed
        assert [name for name in handed if "_open_workspace" in name] == [
            "RunManager._open_workspace.<locals>.open_session"
        ]
        await started.runs.end(run.run_id)
