"""bench/run_start_floor.py, the floor bench/sandbox_launch.py --run-start measures beside
gatewayd's run start + end: each round leaves what an overlay run's end leaves (the
session kept, its base given back, no mount, namespace or run directory), and it waits
for the disk exactly as often as gatewayd's own start + end of an overlay run does, no
more (a padded floor) and no less, for the same records. Figures are not asserted."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gatewayd.config import GatewaydConfig, SandboxUids
from gatewayd.daemon import open_daemon
from gatewayd.runs import Grant, RunRequest
from gatewayd.sandbox.netns import NETNS_RUN_DIR, remove_stale_netns
from tests.conftest import ROOT
from tests.integration.test_run_sandbox import POLICY, _unavailable

sys.path.insert(0, str(ROOT / "bench"))
from run_start_floor import RunStartFloor

pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))

ROUNDS = 3


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-fl-", dir="/tmp"))
    path.chmod(0o711)  # the sandbox's uid passes through to its workspace and socket
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def workspace(base: Path, name: str) -> Path:
    ws = base / name
    for sub in ("src", "docs"):
        (ws / sub).mkdir(parents=True)
        (ws / sub / "f.txt").write_text("hello\n")
    return ws


RUN_ID = re.compile(r"[0-9a-f]{32}")


def flushed(call: str, fd: int) -> str:
    """The call and what it flushed, as a record's role (not where it lies): the records
    in a run's or a session's directory by their names (a temporary file's as the record
    it becomes), such a directory itself, and any other file by its name."""
    path = Path(os.readlink(f"/proc/self/fd/{fd}"))
    name = re.sub(r"^\.(.+?)(\.\d+)?\.tmp$", r"\1", path.name)
    if RUN_ID.fullmatch(path.name):
        return f"{call} {path.parent.name}/<run>/"
    if RUN_ID.fullmatch(path.parent.name):
        return f"{call} {path.parent.parent.name}/<run>/{name}"
    return f"{call} {name}"


@contextmanager
def counted_flushes() -> Iterator[list[str]]:
    """Every fsync and fdatasync of this process meanwhile, with what it flushed."""
    calls: list[str] = []
    real = os.fsync, os.fdatasync

    def fsync(fd: int) -> None:
        calls.append(flushed("fsync", fd))
        real[0](fd)

    def fdatasync(fd: int) -> None:
        calls.append(flushed("fdatasync", fd))
        real[1](fd)

    os.fsync, os.fdatasync = fsync, fdatasync
    try:
        yield calls
    finally:
        os.fsync, os.fdatasync = real


def mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mountinfo") as table:
        return [line.split()[4] for line in table if line.split()[4].startswith(str(path))]


async def test_the_floor_leaves_what_a_run_leaves_and_flushes_as_often_as_gatewayd(
    base: Path,
) -> None:
    prefix = f"cgfl{secrets.token_hex(4)}-"
    (base / "sandboxed.yaml").write_text(textwrap.dedent(POLICY))
    config = GatewaydConfig(
        state_dir=base / "state",
        policy_dirs=(base,),
        lendable_roots=(base,),
        workspace_mode="overlay",
        netns_prefix=prefix,
        sandbox_uids=SandboxUids(base=1_730_000_000 + secrets.randbelow(50_000) * 1024, count=4),
    )
    try:
        async with open_daemon(config, preload=True) as daemon:
            assert daemon.runs.support.available, daemon.runs.support.reason
            request = RunRequest(
                workspacePath=str(workspace(base, "ws")),
                policy="sandboxed",
                actorId="tester",
                tenantId="t1",
                grant=Grant(allowSandbox=True),
            )
            with counted_flushes() as gatewayd:
                run = await daemon.runs.start(request)
                await daemon.runs.end(run.run_id)
            uid = daemon.runs.uid_pool.acquire().uid
            ws = workspace(base, "ws-floor")
            owners = {p: os.lstat(p).st_uid for p in (ws, *ws.rglob("*"))}
            floor = RunStartFloor(base=base, workspace=ws, uid=uid, netns_prefix=prefix)
            try:
                with counted_flushes() as floors:
                    for _ in range(ROUNDS):
                        got = floor.round()
                        assert got["total"] > 0 and got["start"] + got["end"] <= got["total"]
            finally:
                floor.close()
    finally:
        remove_stale_netns(prefix)
    # Gatewayd's flushes, of the same records, no more and no fewer (whatever their order).
    assert sorted(floors) == sorted(gatewayd * ROUNDS), (gatewayd, floors)
    # Every round ended as an overlay run's end: the session kept (its records, no
    # lease), the base given back, nothing mounted or pinned, no run directory.
    sessions = sorted((base / "floor-agent" / "workspaces").iterdir())
    sessions = [s for s in sessions if not s.name.startswith(".")]
    assert len(sessions) == ROUNDS
    for session in sessions:
        assert sorted(os.listdir(session)) == ["lock", "meta.json", "seal.json", "session"]
    assert {p: os.lstat(p).st_uid for p in (ws, *ws.rglob("*"))} == owners
    assert mounts_under(base) == []
    assert os.listdir(base / "floor-state" / "runs") == []
    assert not [name for name in os.listdir(NETNS_RUN_DIR) if name.startswith(prefix)]


def test_the_sandbox_floor_starts_the_command_and_leaves_nothing(base: Path) -> None:
    # bench/sandbox_floor.py, the attached run's third floor (bench/cli_start.py): the
    # command really runs in a sandbox of the run's plan, and every start's cgroup, the
    # namespace and the uid's processes are gone afterwards.
    from sandbox_floor import SandboxStartFloor

    from gatewayd.sandbox.uids import pids_of_uid

    uid = 1_600_000_000 + secrets.randbelow(50_000) * 1024
    prefix = f"cgtsf{secrets.token_hex(3)}-"
    with SandboxStartFloor(base, uid=uid, netns_prefix=prefix) as floor:
        assert "--seccomp" in floor.argv and floor.argv[-2:] == ["/bin/date", "+%s%N"]
        for _ in range(ROUNDS):
            called = time.perf_counter()
            took = floor.start()
            whole = time.perf_counter() - called
            # The command's own clock reading, in seconds, within the call (the spawn
            # to the command's start is part of it): not a number in the wrong unit.
            assert 0 < took <= whole
        cgroup_name = f"cogni-{floor.run_id}-"
    assert not [name for name in os.listdir(NETNS_RUN_DIR) if name.startswith(prefix)]
    assert pids_of_uid(uid) == []
    for controller in ("memory", "pids"):
        parent = Path(f"/sys/fs/cgroup/{controller}")
        if parent.is_dir():
            left = [p for p in parent.rglob(f"{cgroup_name}*")]
            assert left == []
