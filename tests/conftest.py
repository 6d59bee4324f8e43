"""Shared fixtures: an in-process gatewayd on real unix sockets, and policy files."""

from __future__ import annotations

import gc
import json
import os
import shutil
import struct
import tempfile
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import trio

from tests import hypothesis_counts

if TYPE_CHECKING:  # imported where used: xdist's controller loads this file and runs no test
    from gatewayd.daemon import Daemon
    from gatewayd.runs import Run
    from gatewayd.tools.registry import ToolRegistry

ROOT = Path(__file__).resolve().parent.parent
HEADER = struct.Struct(">I")

# Before any test module is imported: the settings their properties make inherit from it.
hypothesis_counts.load_profile()


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session) -> Iterator[object]:
    """No collection of garbage while the tests are collected: what collection makes
    lives to the end of the session, so the collector's full passes over the growing heap
    (1.2-1.9 s of a worker's CPU, before its first test) found nearly nothing to free."""
    gc.disable()
    try:
        return (yield)
    finally:
        gc.enable()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Everything collection loaded (the modules, the tests, their parameters) lives to
    the end of the session: out of the collector's sight, its full collections no longer
    walk it again and again (they took a sixth to a quarter of the fast lane's CPU)."""
    gc.freeze()


OPEN_POLICY = """
version: 1
name: test-open
tools:
  allow: [time.now, "fs.*"]
filesystem:
  paths:
    workspace: {root: ., mode: rw, suffixes: [.txt, .md, .json], max_file_bytes: 100000}
    docs: {root: docs, mode: ro}
limits:
  call_timeout_s: 5
  calls_per_second: 100000
  burst: 100000
  max_concurrent_calls: 64
require_os_sandbox: false
"""


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temporary directory: unix socket paths must fit in 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="cg-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def workspace(short_tmp: Path) -> Path:
    ws = short_tmp / "ws"
    (ws / "docs").mkdir(parents=True)
    (ws / "notes.md").write_text("line one\nline two\n")
    (ws / "docs" / "guide.md").write_text("# guide\n")
    return ws


def write_policy(directory: Path, text: str, name: str = "policy.yaml") -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(text))
    return path


class Gateway:
    """An in-process daemon plus helpers to create runs and talk to them."""

    def __init__(self, daemon: Daemon, base: Path) -> None:
        self.daemon = daemon
        self.base = base
        self.audit_path = daemon.config.resolved_audit_path

    async def create_run(
        self,
        workspace: Path,
        policy: str = OPEN_POLICY,
        *,
        allow_sandbox: bool = True,
        tool_ids: tuple[str, ...] | None = None,
    ) -> Run:
        if "require_os_sandbox" not in policy:
            # This daemon has no OS sandbox (its clients are the test itself, on the
            # host): gateway-core tests say so in each policy. Sandboxed runs are
            # tested with a real sandbox in tests/integration/test_run_sandbox.py.
            policy = textwrap.dedent(policy) + "require_os_sandbox: false\n"
        from gatewayd.runs import Grant, RunRequest

        path = write_policy(self.base, policy, name=f"p{len(os.listdir(self.base))}.yaml")
        request = RunRequest(
            workspacePath=str(workspace),
            policy=str(path),
            actorId="tester",
            tenantId="t1",
            grant=Grant(allowSandbox=allow_sandbox),
            toolIds=tool_ids,
        )
        # The test is the daemon's local caller, like `gatewayd run`: it names a file.
        return await self.daemon.runs.start(request, policy_paths=True)

    async def audit_entries(self) -> list[dict[str, Any]]:
        """Every entry so far, after making all recorded entries durable (result entries
        are synced just after their response)."""
        await self.daemon.audit.durable(self.daemon.audit.last_seq)
        return [json.loads(line) for line in self.audit_path.read_text().splitlines() if line]


@pytest.fixture
async def gateway(short_tmp: Path) -> AsyncIterator[Gateway]:
    async with make_gateway(short_tmp) as gw:
        yield gw


def make_gateway(base: Path, tools: ToolRegistry | None = None, **settings: Any) -> Any:
    """An async context manager giving a Gateway rooted at ``base`` (no OS sandbox);
    ``settings`` are further settings (``models=...``)."""
    from contextlib import asynccontextmanager

    from gatewayd.config import GatewaydConfig
    from gatewayd.daemon import open_daemon
    from gatewayd.tools import builtin_tools

    @asynccontextmanager
    async def cm() -> AsyncIterator[Gateway]:
        policies = base / "policies"
        policies.mkdir(exist_ok=True)
        # These runs write the workspace itself (what the gateway-core tests check on
        # the host): mode host, unless a test names another.
        settings.setdefault("workspace_mode", "host")
        config = GatewaydConfig(
            state_dir=base / "state", policy_dirs=(policies,), os_sandbox=False, **settings
        )
        async with open_daemon(config, preload=True, tools=tools or builtin_tools()) as daemon:
            yield Gateway(daemon, policies)

    return cm()


# --- raw framing for tests that must send exactly the bytes they want ---------------


def frame(obj: Any) -> bytes:
    body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return HEADER.pack(len(body)) + body


async def read_frame(stream: trio.abc.ReceiveStream, buf: bytearray) -> dict[str, Any] | None:
    """The next frame decoded, or None at EOF."""
    while True:
        if len(buf) >= 4:
            (n,) = HEADER.unpack_from(buf)
            if len(buf) >= 4 + n:
                body = bytes(buf[4 : 4 + n])
                del buf[: 4 + n]
                result: dict[str, Any] = json.loads(body)
                return result
        data = await stream.receive_some(65536)
        if not data:
            return None
        buf += data


async def raw_exchange(sock: Path, payload: bytes, *, expect: int = 1) -> list[dict[str, Any]]:
    """Send ``payload`` on a fresh connection and read up to ``expect`` frames."""
    stream = await trio.open_unix_socket(str(sock))
    out: list[dict[str, Any]] = []
    async with stream:
        await stream.send_all(payload)
        buf = bytearray()
        with trio.fail_after(10):
            while len(out) < expect:
                msg = await read_frame(stream, buf)
                if msg is None:
                    break
                out.append(msg)
    return out


def request(run: Run, tool: str, args: dict[str, Any] | None = None, tcid: str = "c1") -> dict:
    return {"v": 1, "runId": run.run_id, "toolCallId": tcid, "tool": tool, "args": args or {}}
