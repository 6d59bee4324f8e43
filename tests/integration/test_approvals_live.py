"""Approvals seen from inside a real sandbox (cogni-tool's exit 25 and its message;
an approved command still has no network), and a real `gatewayd serve` killed with
SIGKILL while a call waits: started again on the same state, it denies that call
("gatewayd restarted"), the log verifies, and the call's effect never happened."""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import tempfile
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from gatewayd.approvals import Approvals, Operator
from gatewayd.daemon import open_daemon
from tests.integration.test_run_sandbox import Sandboxed, sandbox_config
from tests.livedaemon import BIN, LiveDaemon, start_daemon

PATIENCE_S = 20.0


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "sandboxed runs need root (network namespaces, a uid per run)"
    if not os.path.exists("/usr/bin/bwrap"):
        return "needs bubblewrap at /usr/bin/bwrap"
    return None


sandboxed = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))

SANDBOX_POLICY = """
version: 1
name: approvals-sandboxed
tools:
  allow: [time.now, fs.read, fs.write, sandbox.exec]
filesystem:
  paths:
    workspace: {root: ., mode: rw}
limits: {calls_per_second: 1000, burst: 1000}
sandbox: {timeout_s: 60, cpu_s: 20, max_processes: 48, max_output_bytes: 65536}
approvals:
  required:
    - {tool: fs.write, reason: writes change the workspace}
    - {tool: sandbox.exec}
  timeout_s: 3
"""

# Each call in turn through cogni-tool, waiting as long as the approval takes.
CALLS = """
import json, subprocess, sys
out = []
for tool, args in json.loads(sys.argv[1]):
    done = subprocess.run(["cogni-tool", "exec", "--timeout", "0", tool, json.dumps(args)],
                          capture_output=True, text=True)
    out.append({"rc": done.returncode, "out": done.stdout, "err": done.stderr})
print(json.dumps(out))
"""

NO_NETWORK = "python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), timeout=3)\""


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-appr-", dir="/tmp"))
    path.chmod(0o711)  # the sandbox's uid passes through to its workspace and socket
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def sb(base: Path) -> AsyncIterator[Sandboxed]:
    # Host mode: the test reads each call's effect (or its absence) in the workspace itself.
    config = sandbox_config(base).changed(workspace_mode="host")
    async with open_daemon(config, preload=True, control_socket=base / "control.sock") as daemon:
        assert daemon.runs.support.available, daemon.runs.support.reason
        yield Sandboxed(daemon, base)


async def answer_next(approvals: Approvals, tool: str, *, approve: bool, reason: str) -> None:
    """Wait for the next call of ``tool`` to wait, then answer it."""
    with trio.fail_after(PATIENCE_S):
        while not (waiting := [p for p in approvals.pending() if p["tool"] == tool]):
            await trio.sleep(0.01)
    await approvals.decide(
        waiting[0]["approvalId"],
        approve=approve,
        by=Operator(uid=0, pid=os.getpid(), name="tester"),
        reason=reason,
    )


@sandboxed
async def test_from_inside_a_sandbox_cogni_tool_waits_and_exits_25_when_not_approved(
    sb: Sandboxed,
) -> None:
    ws = sb.workspace()
    run = await sb.run(SANDBOX_POLICY, workspace=ws)
    approvals = sb.daemon.approvals
    assert approvals is not None
    calls = [
        ["fs.write", {"path": "denied.txt", "content": "x"}],
        ["fs.write", {"path": "approved.txt", "content": "y"}],
        ["fs.write", {"path": "/etc/passwd", "content": "x"}],  # outside: never asked
        ["sandbox.exec", {"command": NO_NETWORK}],
        ["fs.write", {"path": "unanswered.txt", "content": "z"}],
    ]
    outcome: dict[str, Any] = {}

    async def calling() -> None:
        outcome["result"] = await sb.py(run, CALLS, json.dumps(calls), timeout=60)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(calling)
        await answer_next(approvals, "fs.write", approve=False, reason="not today")
        await answer_next(approvals, "fs.write", approve=True, reason="fine")
        # The approved command runs in the same sandbox: approval grants no network.
        await answer_next(approvals, "sandbox.exec", approve=True, reason="try it")
        # The last write is left unanswered: the policy's 3 s deny it.
    result = outcome["result"]
    assert result.exitCode == 0, result.stderr
    denied, approved, outside, command, unanswered = json.loads(result.stdout)
    assert denied["rc"] == 25, denied
    assert denied["err"].startswith(
        "cogni-tool: approval_denied: the operator denied this call of fs.write"
    )
    assert "not today" in denied["err"]
    assert approved["rc"] == 0, approved
    assert (ws / "approved.txt").read_text() == "y"
    assert not (ws / "denied.txt").exists()
    assert outside["rc"] == 15 and outside["err"].startswith("cogni-tool: policy_denied: ")
    assert command["rc"] == 0, command
    ran = json.loads(command["out"])
    assert ran["exitCode"] != 0, ran  # no route out of the sandbox, approved or not
    assert unanswered["rc"] == 25, unanswered
    assert "nobody answered within 3 s (approvals.timeout_s)" in unanswered["err"]
    assert not (ws / "unanswered.txt").exists()
    entries = await sb.entries()
    asked = [e for e in entries if e.get("event") == "approval_pending"]
    assert [e["tool"] for e in asked] == ["fs.write", "fs.write", "sandbox.exec", "fs.write"]
    verdicts = [e["detail"]["verdict"] for e in entries if e.get("event") == "approval_decided"]
    assert verdicts == ["denied", "approved", "approved", "denied"]


# --- a restart while a call waits ----------------------------------------------------------

LIVE_POLICY = """
version: 1
name: approvals-live
tools: {allow: [time.now, fs.write]}
filesystem:
  paths:
    workspace: {root: ., mode: rw}
approvals:
  required: [{tool: fs.write}]
  timeout_s: 600
require_os_sandbox: false
"""
HEADER = struct.Struct(">I")


def frame(obj: dict[str, Any]) -> bytes:
    data = json.dumps(obj).encode()
    return HEADER.pack(len(data)) + data


class Waiter(threading.Thread):
    """A client that sends one call and reads until the connection ends."""

    def __init__(self, sock: str, payload: bytes) -> None:
        super().__init__(daemon=True)
        self.sock, self.payload = sock, payload
        self.received = b""

    def run(self) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(PATIENCE_S * 3)
            conn.connect(self.sock)
            conn.sendall(self.payload)
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                self.received += data


def audit_entries(daemon: LiveDaemon) -> list[dict[str, Any]]:
    return [json.loads(line) for line in daemon.audit_path.read_text().splitlines() if line]


def test_a_call_waiting_when_gatewayd_is_killed_is_denied_at_the_next_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Host mode: the write's effect, had it happened, would be in the workspace itself.
    monkeypatch.setenv("GATEWAYD_WORKSPACE_MODE", "host")
    base = Path(tempfile.mkdtemp(prefix="cg-apr-", dir="/tmp"))  # short socket paths
    try:
        ws = base / "ws"
        ws.mkdir()
        policy = base / "approvals.yaml"
        policy.write_text(textwrap.dedent(LIVE_POLICY))
        state = base / "state"
        daemon = start_daemon(state)
        try:
            run = daemon.create_run(ws, policy)
            call = {
                "v": 1,
                "runId": run["runId"],
                "toolCallId": "waits-1",
                "tool": "fs.write",
                "args": {"path": "effect.txt", "content": "must never exist"},
            }
            waiter = Waiter(run["socket"], frame(call))
            waiter.start()
            deadline = time.monotonic() + PATIENCE_S
            while True:
                status, listed = daemon.control("GET", "/v1/approvals")
                if status == 200 and listed["approvals"]:
                    break
                assert time.monotonic() < deadline, "the call never waited"
                time.sleep(0.02)
            (waiting,) = listed["approvals"]
            assert list((state / "approvals").iterdir()) == [
                state / "approvals" / f"{waiting['approvalId']}.json"
            ]
            daemon.proc.kill()  # SIGKILL: no withdrawal, no clean-up
            daemon.proc.wait()
        finally:
            daemon.stop()
        waiter.join(PATIENCE_S)
        assert not waiter.is_alive() and waiter.received == b""  # no answer, ever
        again = start_daemon(state)
        try:
            status, listed = again.control("GET", "/v1/approvals")
            assert status == 200 and listed["approvals"] == []
            # The approval the dead daemon held cannot be answered now.
            status, late = again.control(
                "POST", f"/v1/approvals/{waiting['approvalId']}/approve", {}
            )
            assert status == 404 and "no call waits for approval" in late["message"]
        finally:
            assert again.stop() == 0
        entries = audit_entries(again)
        mine = [e for e in entries if e.get("toolCallId") == "waits-1"]
        assert [e.get("event") or e["kind"] for e in mine] == [
            "approval_pending",
            "approval_decided",
            "call",
            "result",
        ]
        _, decided, called, result = mine
        assert decided["detail"]["approvalId"] == waiting["approvalId"]
        assert decided["detail"]["verdict"] == "denied"
        assert decided["detail"]["decidedBy"] == {"kind": "gatewayd"}
        assert decided["detail"]["reason"].startswith("gatewayd restarted")
        assert called["decision"] == "deny" and called["errorCode"] == "approval_denied"
        assert called["runId"] == run["runId"] and called["argsDigest"] == mine[0]["argsDigest"]
        assert result["errorCode"] == "approval_denied"
        assert not any(e.get("decision") == "allow" for e in mine)
        assert not (ws / "effect.txt").exists()  # the tool never ran
        assert list((state / "approvals").iterdir()) == []
        verify = subprocess.run(
            [str(BIN / "gatewayd"), "audit", "verify", str(again.audit_path)],
            capture_output=True,
            text=True,
            check=False,
        )
        assert verify.returncode == 0, verify.stdout + verify.stderr
        assert verify.stdout.startswith("OK: "), verify.stdout
    finally:
        shutil.rmtree(base, ignore_errors=True)
