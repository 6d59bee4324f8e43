"""A run pins its workspace and each policy path outside it, and policy paths have no
bound: gatewayd-launcher takes as many pinned directories as its command line holds, so a
run whose policy names 64 such paths runs its commands (a fixed bound of 64 made every
command of such a run fail with "could not read its arguments")."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from gatewayd.config import GatewaydConfig, SandboxUids
from gatewayd.daemon import Daemon, open_daemon
from gatewayd.runs import Grant, RunLimits, RunRequest

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/usr/bin/bwrap"),
    reason="sandboxed runs need root and bubblewrap",
)

PATHS = 64


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-pins-", dir="/tmp"))
    path.chmod(0o711)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def daemon(base: Path) -> AsyncIterator[Daemon]:
    config = GatewaydConfig(
        state_dir=base / "state",
        policy_dirs=(base,),
        workspace_mode="host",
        netns_prefix=f"cgp{secrets.token_hex(4)}-",
        sandbox_uids=SandboxUids(base=1_700_000_000 + secrets.randbelow(50_000) * 1024, count=8),
    )
    async with open_daemon(config, preload=False) as opened:
        assert opened.runs.support.available, opened.runs.support.reason
        yield opened


async def test_a_run_with_many_policy_paths_can_run_a_command(base: Path, daemon: Daemon) -> None:
    shared = base / "shared"
    shared.mkdir(mode=0o755)
    rules = []
    for i in range(PATHS):
        (shared / f"d{i}").mkdir(mode=0o755)
        rules.append(f"    d{i}: {{root: {shared}/d{i}, mount: /data/d{i}, mode: ro}}")
    policy = base / "many.yaml"
    policy.write_text(
        textwrap.dedent(
            """\
            version: 1
            name: many
            tools:
              allow: [time.now]
            filesystem:
              paths:
                workspace: {root: ., mode: rw}
            """
        )
        + "\n".join(rules)
        + "\n"
    )
    ws = base / "ws"
    ws.mkdir()
    runs = daemon.runs
    run = await runs.start(
        RunRequest(
            workspacePath=str(ws),
            policy=str(policy),
            actorId="tester",
            tenantId="t1",
            grant=Grant(allowSandbox=True),
            limits=RunLimits(maxMemoryMb=2048),
        ),
        policy_paths=True,
    )
    assert run.sandbox is not None and len(run.sandbox.pins) == PATHS + 1
    result = await runs.exec(run.run_id, ["/bin/true"], timeout_s=30)
    assert result.exitCode == 0, result.stderr
