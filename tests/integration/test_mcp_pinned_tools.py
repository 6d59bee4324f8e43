"""Pinned MCP tools as gateway tools, end to end: a real daemon, the declared server
(tests/mcp_servers/misbehaving_server.py) in a sandbox of its own, and a real sandboxed
client calling through ``cogni-tool exec``; pinning through `gatewayd mcp` (a real
process: in a daemon of its own when none serves, through the control socket when
one does).

What a run sees: a pinned tool listed and callable; a tool offered but not pinned absent
and refused with the hint to pin it; a tool the policy does not allow absent; a tool
whose description changed after pinning refused (``policy_denied`` naming the change,
audited), until the operator pins it again; the audit log verifies.
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
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Final

import pytest
import trio
import yaml

from gatewayd.audit import read_entries, verify_file
from gatewayd.config import GatewaydConfig, SandboxUids
from gatewayd.daemon import Daemon, open_daemon
from gatewayd.mcp.approval import Approval
from gatewayd.runs import Grant, Run, RunRequest
from gatewayd.sandbox.launch import ExecResult

PY: Final = "/usr/bin/python3"
SERVERS_DIR: Final = Path(__file__).resolve().parent.parent / "mcp_servers"
SERVER: Final = str(SERVERS_DIR / "misbehaving_server.py")
GATEWAYD: Final = str(Path(sys.executable).parent / "gatewayd")
POLICY: Final = """
version: 1
name: mcp-pinned
tools:
  allow: [mcp.misc.echo, mcp.misc.change, time.now]
filesystem:
  paths:
    workspace: {root: ., mode: rw}
limits: {calls_per_second: 1000, burst: 1000}
"""


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "sandboxed runs need root (network namespaces, a uid per run)"
    if not os.path.exists("/usr/bin/bwrap") or not os.path.exists(PY):
        return "needs bubblewrap at /usr/bin/bwrap and the system python3"
    return None


pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-pin-", dir="/tmp"))
    path.chmod(0o711)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def settings(base: Path) -> dict[str, Any]:
    """gatewayd's configuration: the misbehaving server, shared (so a pin lists the very
    instance the runs call, and sees what its ``change`` tool changed)."""
    return {
        "state_dir": str(base / "state"),
        "policy_dirs": [str(base)],
        "netns_prefix": f"cgp{secrets.token_hex(4)}-",
        "sandbox_uids": SandboxUids(
            base=1_750_000_000 + secrets.randbelow(50_000) * 1024, count=64
        ).model_dump(),
        "audit_fsync": False,
        "mcp_servers": {
            "misc": {
                "command": [PY, "-I", SERVER],
                "read_only_paths": [str(SERVERS_DIR)],
                "share": "shared",
                "call_timeout_s": 10,
            }
        },
    }


class Pinned:
    def __init__(self, daemon: Daemon, base: Path) -> None:
        self.daemon = daemon
        self.base = base
        self.approval = Approval(daemon.mcp_tools)

    async def run(self) -> Run:
        workspace = self.base / f"ws-{secrets.token_hex(3)}"
        workspace.mkdir()
        policy = self.base / "mcp-pinned.yaml"
        policy.write_text(textwrap.dedent(POLICY))
        request = RunRequest(
            workspacePath=str(workspace),
            policy=str(policy),
            actorId="tester",
            tenantId="t1",
            grant=Grant(allowSandbox=True),
        )
        return await self.daemon.runs.start(request, policy_paths=True)

    async def tool(self, run: Run, tool: str, args: dict[str, Any] | None = None) -> ExecResult:
        """``cogni-tool exec TOOL ARGS`` inside the run's sandbox."""
        argv = ["cogni-tool", "exec", tool, json.dumps(args or {})]
        return await self.daemon.runs.exec(run.run_id, argv, timeout_s=60)

    async def entries(self) -> list[dict[str, Any]]:
        audit = self.daemon.audit
        await audit.durable(audit.last_seq)
        return list(read_entries(self.daemon.config.resolved_audit_path))


@asynccontextmanager
async def gateway(base: Path, **options: Any) -> AsyncIterator[Pinned]:
    config = GatewaydConfig.model_validate(settings(base))
    async with open_daemon(config, preload=True, **options) as daemon:
        assert daemon.runs.support.available, daemon.runs.support.reason
        yield Pinned(daemon, base)
    report = verify_file(config.resolved_audit_path)
    assert report.ok, report


def tool_names(result: ExecResult) -> list[str]:
    assert result.exitCode == 0, result.stderr
    return [manifest["name"] for manifest in json.loads(result.stdout)]


async def test_only_pinned_tools_the_policy_allows_are_listed_and_callable(base: Path) -> None:
    async with gateway(base) as gw:
        pinned = await gw.approval.pin("misc", tools=("echo", "change", "read"), by="tester")
        assert pinned["added"] == ["change", "echo", "read"]
        run = await gw.run()
        names = tool_names(await gw.tool(run, "tools.list"))
        assert "mcp.misc.echo" in names and "mcp.misc.change" in names
        assert "mcp.misc.read" not in names  # pinned, but the policy does not allow it
        assert "mcp.misc.env" not in names  # offered, never pinned

        echoed = await gw.tool(run, "mcp.misc.echo", {"text": "hello"})
        assert echoed.exitCode == 0, echoed.stderr
        assert json.loads(echoed.stdout)["content"] == [{"type": "text", "text": "hello"}]

        unpinned = await gw.tool(run, "mcp.misc.env", {"name": "PATH"})
        assert unpinned.exitCode != 0
        assert b"unknown_tool" in unpinned.stderr
        assert b"gatewayd mcp pin misc" in unpinned.stderr

        denied = await gw.tool(run, "mcp.misc.read", {"path": "/etc/passwd"})
        assert b"policy_denied" in denied.stderr and b"not allowed for this run" in denied.stderr

        bad = await gw.tool(run, "mcp.misc.echo", {"text": 7})
        assert b"invalid_args" in bad.stderr and b"at $.text: 7 is not of type" in bad.stderr

        calls = [e for e in await gw.entries() if e["kind"] == "call" and e["runId"] == run.run_id]
        echo_call = next(c for c in calls if c["tool"] == "mcp.misc.echo")
        assert echo_call["argsSummary"] == {"text": "[5 chars]"}  # a text: its size only
        assert echo_call["decision"] == "allow"
        assert echo_call["detail"]["server"] == "misc"
        assert echo_call["detail"]["mcpTool"] == "echo"
        assert echo_call["detail"]["runner"] == "mcp"


async def test_a_description_changed_after_pinning_is_refused_until_pinned_again(
    base: Path,
) -> None:
    async with gateway(base) as gw:
        await gw.approval.pin("misc", tools=("echo", "change"), by="tester")
        run = await gw.run()
        assert (await gw.tool(run, "mcp.misc.echo", {"text": "before"})).exitCode == 0
        # The server changes echo's description (and says so: tools/list_changed).
        assert (await gw.tool(run, "mcp.misc.change")).exitCode == 0
        refused = await gw.tool(run, "mcp.misc.echo", {"text": "after"})
        assert refused.exitCode != 0
        assert b"policy_denied" in refused.stderr
        assert b"changed this tool's description since the operator pinned it" in refused.stderr
        changed = [e for e in await gw.entries() if e.get("event") == "mcp_tool_changed"]
        assert changed and changed[-1]["runId"] == run.run_id
        assert changed[-1]["detail"]["changes"][0]["kind"] == "description"
        result = next(
            e
            for e in reversed(await gw.entries())
            if e["kind"] == "result" and e.get("tool") == "mcp.misc.echo"
        )
        assert result["errorCode"] == "policy_denied"

        diff = await gw.approval.diff("misc")
        assert [(c["kind"], c["mcpName"]) for c in diff["changes"] if c["mcpName"] == "echo"] == [
            ("description", "echo")
        ]
        # The operator approves the change: the runs that start from now on may call it.
        repinned = await gw.approval.pin("misc", tools=("echo",), by="operator")
        assert repinned["changed"] == ["echo"]
        pins = [e for e in await gw.entries() if e.get("event") == "mcp_tools_pinned"]
        assert pins[-1]["detail"]["pinnedBy"] == "operator"
        assert pins[-1]["detail"]["changed"] == ["echo"]
        later = await gw.run()
        assert (await gw.tool(later, "mcp.misc.echo", {"text": "again"})).exitCode == 0


def gatewayd_mcp(base: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    config = base / "gatewayd.yaml"
    config.write_text(yaml.safe_dump(settings(base)))
    return subprocess.run(
        [GATEWAYD, "mcp", *argv, "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
    )


async def test_gatewayd_mcp_pins_in_a_daemon_of_its_own_when_none_serves(base: Path) -> None:
    listed = gatewayd_mcp(base, "list")
    assert listed.returncode == 0, listed.stderr
    assert "misc  stdio  shared  0 pinned" in listed.stdout

    pinned = gatewayd_mcp(base, "pin", "misc", "--tool", "echo", "--by", "ops")
    assert pinned.returncode == 0, pinned.stderr
    assert "pinned 1 tool(s) of server misc" in pinned.stdout
    assert "mcp.misc.echo  sha256:" in pinned.stdout

    shown = gatewayd_mcp(base, "show", "misc")
    assert shown.returncode == 0, shown.stderr
    assert "mcp.misc.echo" in shown.stdout and "'Echo the text back.'" in shown.stdout
    assert "by ops" in shown.stdout

    diff = gatewayd_mcp(base, "diff", "misc")
    assert diff.returncode == 1  # the tools not pinned are differences
    assert "new tool  mcp.misc.env: offered, not pinned" in diff.stdout

    unknown = gatewayd_mcp(base, "pin", "nope")
    assert unknown.returncode == 1
    assert "bad_request: no MCP server named 'nope' is declared; declared: misc" in unknown.stderr

    not_offered = gatewayd_mcp(base, "pin", "misc", "--tool", "missing")
    assert not_offered.returncode == 1
    assert "does not offer 'missing'; it offers" in not_offered.stderr

    bad_name = gatewayd_mcp(base, "show", "../etc")
    assert bad_name.returncode == 1 and "is not an MCP server name" in bad_name.stderr

    # A daemon started afterwards gives its runs the pinned tool.
    async with gateway(base) as gw:
        run = await gw.run()
        assert "mcp.misc.echo" in tool_names(await gw.tool(run, "tools.list"))
        entries = await gw.entries()
    pinned_events = [e for e in entries if e.get("event") == "mcp_tools_pinned"]
    assert [e["detail"]["pinnedBy"] for e in pinned_events] == ["ops"]


async def test_gatewayd_mcp_goes_through_the_control_socket_of_a_running_daemon(
    base: Path,
) -> None:
    control = base / "control.sock"
    async with gateway(base, control_socket=control) as gw:

        def pin() -> subprocess.CompletedProcess[str]:
            return gatewayd_mcp(base, "pin", "misc", "--control-socket", str(control))

        done = await trio.to_thread.run_sync(pin)
        assert done.returncode == 0, done.stderr
        assert "pinned" in done.stdout and "mcp.misc.echo" in done.stdout
        # The running daemon did it: its audit log holds the pin, its next run the tools.
        pins = [e for e in await gw.entries() if e.get("event") == "mcp_tools_pinned"]
        assert len(pins) == 1 and pins[0]["detail"]["server"] == "misc"
        run = await gw.run()
        assert "mcp.misc.echo" in tool_names(await gw.tool(run, "tools.list"))

        def listed() -> subprocess.CompletedProcess[str]:
            return gatewayd_mcp(base, "list", "--control-socket", str(control))

        out = await trio.to_thread.run_sync(listed)
        assert out.returncode == 0, out.stderr
        pinned = len(pins[0]["detail"]["tools"])  # every tool the test server offers
        assert pinned > 1
        assert f"misc  stdio  shared  {pinned} pinned  (pins current)" in out.stdout

        def refused() -> subprocess.CompletedProcess[str]:
            return gatewayd_mcp(base, "pin", "nope", "--control-socket", str(control))

        nope = await trio.to_thread.run_sync(refused)
        assert nope.returncode == 1
        assert (
            "gatewayd mcp pin: bad_request: no MCP server named 'nope' is declared; "
            "declared: misc" in nope.stderr
        )
