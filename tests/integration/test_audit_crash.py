"""A crash under load loses no answered call's entries (invariant RESULT_BEFORE_REPLY).

A real `gatewayd serve`, two real runs, several clients on real unix socket
connections with many requests in flight each (pipelined), a mix of every kind of call:
allowed with a side effect (fs.write), allowed without one (time.now, fs.read,
tools.list), refused by policy, invalid arguments, unknown tool, malformed frames, and a
run whose rate limit refuses most of its calls. At a random moment under load the daemon
is killed with SIGKILL. Then every toolCallId any client saw answered must have both its
``call`` and its ``result`` entry in the log the crash left. The next round starts the
daemon again on the same state (which recovers the log), and so on; at the end a clean
start and stop, and `gatewayd audit verify` must pass.

The same with a sandboxed daemon for the answers that are not a call's: commands run in
runs through the control socket (the answer carries the exit code) and refusals of the
egress proxy, seen from inside a sandbox: every one answered before the kill has its
``exec_ended`` or ``egress`` entry.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gatewayd.audit.query import read_log
from tests.conftest import write_policy
from tests.livedaemon import BIN, LiveDaemon, sandbox_options, start_daemon

HEADER = struct.Struct(">I")
ROUNDS = 5
# Connections to the main run, and requests each keeps in flight.
CLIENTS = 4
IN_FLIGHT = 8
# The kill comes once this many answers have arrived (the load is running), then after
# a random pause of up to KILL_SPREAD_S: anywhere in a flush cycle, or between them.
MIN_ANSWERS_BEFORE_KILL = 200
KILL_SPREAD_S = 0.25
# Bounds on waiting for something that takes milliseconds, for a loaded machine.
PATIENCE_S = 30.0

POLICY = """
version: 1
name: crash
tools: {allow: [time.now, "fs.*"]}
filesystem:
  paths:
    workspace: {root: ., mode: rw, suffixes: [.txt, .md], max_file_bytes: 100000}
    docs: {root: docs, mode: ro}
limits: {call_timeout_s: 5, calls_per_second: 1000000, burst: 1000000, max_concurrent_calls: 64}
require_os_sandbox: false
"""
# Most calls of this run are refused as rate_limited.
TIGHT_POLICY = """
version: 1
name: tight
tools: {allow: [time.now]}
limits: {call_timeout_s: 5, calls_per_second: 50, burst: 10}
require_os_sandbox: false
"""


def body(obj: dict[str, Any]) -> bytes:
    data = json.dumps(obj, separators=(",", ":")).encode()
    return HEADER.pack(len(data)) + data


def mixed_call(run_id: str, tcid: str, i: int) -> bytes:
    """The i-th call of a client: every kind in turn."""
    base = {"v": 1, "runId": run_id, "toolCallId": tcid}
    kinds: list[dict[str, Any]] = [
        {
            "tool": "fs.write",
            "args": {"path": f"out/{tcid.partition('-')[0]}.txt", "content": tcid},
        },
        {"tool": "time.now", "args": {}},
        {"tool": "fs.read", "args": {"path": "notes.md"}},
        {"tool": "tools.list", "args": {}},
        {"tool": "fs.write", "args": {"path": "docs/x.md", "content": "x"}},  # read-only
        {"tool": "time.now", "args": {"zone": "utc"}},  # invalid arguments
        {"tool": "no.such", "args": {}},  # unknown tool
        {},  # malformed: no tool, no args (the toolCallId is recovered)
    ]
    return body({**base, **kinds[i % len(kinds)]})


def now_call(run_id: str, tcid: str, _i: int) -> bytes:
    return body({"v": 1, "runId": run_id, "toolCallId": tcid, "tool": "time.now", "args": {}})


class Client(threading.Thread):
    """One connection keeping IN_FLIGHT requests in flight until the daemon dies; records
    every toolCallId answered (including answers read after the daemon died: they left
    it before)."""

    def __init__(self, sock: str, run_id: str, name: str, make: Callable[[str, str, int], bytes]):
        super().__init__(daemon=True)
        self.sock, self.run_id, self.name_, self.make = sock, run_id, name, make
        self.answered: list[str | None] = []
        self.sent = 0

    def _send_next(self, conn: socket.socket) -> bool:
        try:
            conn.sendall(self.make(self.run_id, f"{self.name_}-{self.sent}", self.sent))
        except OSError:
            return False  # the daemon is gone; keep reading what it sent before
        self.sent += 1
        return True

    def run(self) -> None:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(PATIENCE_S)
        conn.connect(self.sock)
        buf = bytearray()
        sending = all(self._send_next(conn) for _ in range(IN_FLIGHT))
        try:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return  # reset: everything sent before the crash was read first
                if not data:
                    return
                buf += data
                while len(buf) >= 4 and len(buf) >= 4 + HEADER.unpack_from(buf)[0]:
                    (n,) = HEADER.unpack_from(buf)
                    self.answered.append(json.loads(buf[4 : 4 + n])["toolCallId"])
                    del buf[: 4 + n]
                    if sending:
                        sending = self._send_next(conn)
        finally:
            conn.close()


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-crash-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def create_run(daemon: LiveDaemon, ws: Path, policy: str) -> dict[str, Any]:
    """A run of the policy named ``policy`` (in the daemon's --policy-dir)."""
    status, data = daemon.control(
        "POST",
        "/v1/runs",
        {
            "workspacePath": str(ws),
            "policy": policy,
            "actorId": "tester",
            "tenantId": "t1",
            "grant": {"allowSandbox": True},
        },
    )
    assert status == 201, data
    run: dict[str, Any] = data["run"]
    return run


def crash_under_load(daemon: LiveDaemon, ws: Path, round_no: int, rng: random.Random) -> list[str]:
    """Load the daemon from several clients, kill it, return every answered toolCallId."""
    main = create_run(daemon, ws, "crash")
    tight = create_run(daemon, ws, "tight")
    clients = [
        Client(main["socket"], main["runId"], f"r{round_no}c{i}", mixed_call)
        for i in range(CLIENTS)
    ]
    clients.append(Client(tight["socket"], tight["runId"], f"r{round_no}t", now_call))
    for client in clients:
        client.start()
    deadline = time.monotonic() + PATIENCE_S
    while sum(len(c.answered) for c in clients) < MIN_ANSWERS_BEFORE_KILL:
        assert time.monotonic() < deadline, "the load never got going"
        assert all(c.is_alive() for c in clients), "a client stopped before the crash"
        time.sleep(0.005)
    time.sleep(rng.uniform(0, KILL_SPREAD_S))
    daemon.proc.kill()  # SIGKILL: no clean-up, no last flush
    daemon.proc.wait()
    for client in clients:
        client.join(PATIENCE_S)
        assert not client.is_alive(), "a client still reads from a dead daemon"
    assert all(c.answered for c in clients), "a client was never answered"
    answered = [tcid for c in clients for tcid in c.answered]
    assert None not in answered, "an answer without its toolCallId"
    return [tcid for tcid in answered if tcid is not None]


def entries_by_call(audit_path: Path) -> dict[str, set[str]]:
    kinds: dict[str, set[str]] = {}
    for record in read_log(audit_path):
        entry = record.entry
        if entry is not None and entry.get("toolCallId") and entry["kind"] in ("call", "result"):
            kinds.setdefault(entry["toolCallId"], set()).add(entry["kind"])
    return kinds


def test_every_call_answered_before_a_kill_9_under_load_has_its_call_and_result_entries(
    base: Path,
) -> None:
    seed = random.randrange(1 << 32)
    rng = random.Random(seed)
    ws = base / "ws"
    (ws / "docs").mkdir(parents=True)
    (ws / "notes.md").write_text("line one\nline two\n")
    policies = base / "policies"
    policies.mkdir()
    write_policy(policies, POLICY, "crash.yaml")
    write_policy(policies, TIGHT_POLICY, "tight.yaml")
    state = base / "state"
    options = ("--policy-dir", str(policies))
    for round_no in range(ROUNDS):
        daemon = start_daemon(state, *options)  # recovers what the previous crash left
        try:
            answered = crash_under_load(daemon, ws, round_no, rng)
        finally:
            daemon.stop()
        entries = entries_by_call(daemon.audit_path)
        lost = [t for t in answered if entries.get(t) != {"call", "result"}]
        assert not lost, (
            f"round {round_no} (seed {seed}): {len(lost)} of {len(answered)} answered calls "
            f"lack an entry, e.g. {[(t, sorted(entries.get(t, ()))) for t in lost[:5]]}"
        )
    daemon = start_daemon(state, *options)
    assert daemon.stop() == 0
    verify = subprocess.run(
        [str(BIN / "gatewayd"), "audit", "verify", str(daemon.audit_path)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert verify.stdout.startswith("OK: "), verify.stdout


# --- the control socket's exec and the egress proxy under a kill -9 -----------------------

SANDBOX_ROUNDS = 3
# Connections of host clients each running commands in a run of its own, one at a time.
EXEC_CLIENTS = 3
# The kill comes once this many commands were answered and this many proxy refusals were
# seen inside the sandbox (the load is running), then after a random pause.
MIN_EXECS_BEFORE_KILL = 20
MIN_EGRESS_BEFORE_KILL = 20
SANDBOX_POLICY = """
version: 1
name: crash-sandboxed
tools: {allow: [time.now]}
filesystem:
  paths:
    workspace: {root: ., mode: rw}
network:
  allow_domains: [allowed.example.org]
  schemes: [http, https]
  proxy:
    enabled: true
    connections_per_second: 10000
    connection_burst: 1024
    max_connections: 1024
sandbox: {timeout_s: 600, cpu_s: 600, max_processes: 48}
# The sandbox's counts of the proxy's refusals are read from the workspace on the host.
workspace: {mode: host}
"""
# In the sandbox, through the run's egress proxy (cogni-tool serve relays 127.0.0.1:3128):
# requests to a domain the policy does not allow, one per connection, each 403 seen
# written down (a line) after it arrived.
EGRESS_CLIENT = """
import os, socket
out = os.open("/workspace/egress-403s", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
while True:
    conn = socket.create_connection(("127.0.0.1", 3128))
    conn.sendall(b"GET http://denied.example.org/ HTTP/1.1\\r\\nHost: denied.example.org\\r\\n\\r\\n")
    head = b""
    while b"\\r\\n" not in head:
        chunk = conn.recv(4096)
        if not chunk:
            break
        head += chunk
    conn.close()
    if head.startswith(b"HTTP/1.1 403 "):
        os.write(out, b"403\\n")
"""


def sandbox_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "sandboxed runs need root"
    if not os.path.exists("/usr/bin/bwrap") or not os.path.exists("/usr/bin/python3"):
        return "needs bubblewrap at /usr/bin/bwrap and the system python3"
    return None


class ExecClient(threading.Thread):
    """Runs ``true`` in its own run over the control socket, one command after another,
    until the daemon dies; counts the commands answered and sets ``each_answer`` as each
    answer arrives."""

    def __init__(self, daemon: LiveDaemon, run_id: str, each_answer: threading.Event) -> None:
        super().__init__(daemon=True)
        self.live, self.run_id = daemon, run_id
        self.answered = 0
        self.each_answer = each_answer

    def run(self) -> None:
        while True:
            try:
                status, _ = self.live.control(
                    "POST", f"/v1/runs/{self.run_id}/exec", {"command": ["true"]}
                )
            except (OSError, ValueError):
                return  # the daemon is gone (reset, or an answer cut short)
            assert status == 200
            self.answered += 1
            self.each_answer.set()


def egress_403s(ws: Path) -> int:
    path = ws / "egress-403s"
    return len(path.read_bytes().splitlines()) if path.exists() else 0


def test_every_command_and_proxy_refusal_answered_before_a_kill_9_is_in_the_log(
    base: Path,
) -> None:
    """A sandboxed `gatewayd serve`: host clients run commands in their runs through the
    control socket (its answer carries the exit code) while a command inside another
    run keeps asking the egress proxy for a domain its policy refuses. Killed at a
    random moment, or (every other round) the moment a command's answer arrives, well
    inside the audit log's own flush delay: every command answered has its
    ``exec_ended`` entry, and every 403 the sandbox saw has its ``egress`` entry."""
    if (why := sandbox_unavailable()) is not None:
        pytest.skip(why)
    seed = random.randrange(1 << 32)
    rng = random.Random(seed)
    base.chmod(0o711)  # the sandbox's uid passes through to its workspaces and sockets
    policies = base / "policies"
    policies.mkdir()
    write_policy(policies, SANDBOX_POLICY, "crash-sandboxed.yaml")
    # Fixed for every round: each start sweeps the namespaces the last one's crash left.
    options = ("--policy-dir", str(policies), *sandbox_options())
    state = base / "state"
    for round_no in range(SANDBOX_ROUNDS):
        daemon = start_daemon(state, *options, sandbox=True, random_ids=False)
        try:
            workspaces = [base / f"r{round_no}-ws{i}" for i in range(EXEC_CLIENTS + 1)]
            runs = []
            for ws in workspaces:
                ws.mkdir()
                runs.append(create_run(daemon, ws, "crash-sandboxed")["runId"])
            egress_ws, egress_run = workspaces[-1], runs[-1]
            proxy_load = threading.Thread(
                target=_quietly,
                args=(
                    daemon.control,
                    "POST",
                    f"/v1/runs/{egress_run}/exec",
                    {"command": ["/usr/bin/python3", "-c", EGRESS_CLIENT]},
                ),
                daemon=True,
            )
            proxy_load.start()
            each_answer = threading.Event()
            clients = [ExecClient(daemon, run_id, each_answer) for run_id in runs[:-1]]
            for client in clients:
                client.start()
            deadline = time.monotonic() + PATIENCE_S
            while (
                sum(c.answered for c in clients) < MIN_EXECS_BEFORE_KILL
                or egress_403s(egress_ws) < MIN_EGRESS_BEFORE_KILL
            ):
                assert time.monotonic() < deadline, "the load never got going"
                assert all(c.is_alive() for c in clients), "a client stopped before the crash"
                time.sleep(0.005)
            if round_no % 2 == 0:
                each_answer.clear()
                assert each_answer.wait(PATIENCE_S), "no command was answered"
            else:
                time.sleep(rng.uniform(0, KILL_SPREAD_S))
            daemon.proc.kill()  # SIGKILL: no clean-up, no last flush
            daemon.proc.wait()
            for client in clients:
                client.join(PATIENCE_S)
                assert not client.is_alive(), "a client still waits on a dead daemon"
            proxy_load.join(PATIENCE_S)
        finally:
            daemon.stop()
        seen_403s = egress_403s(egress_ws)
        ended: dict[str, int] = {}
        refused = 0
        for record in read_log(daemon.audit_path):
            entry = record.entry or {}
            if entry.get("event") == "exec_ended":
                ended[entry["runId"]] = ended.get(entry["runId"], 0) + 1
            elif entry.get("event") == "egress" and entry.get("runId") == egress_run:
                refused += entry.get("errorCode") == "policy_denied"
        lost = {
            c.run_id: (c.answered, ended.get(c.run_id, 0))
            for c in clients
            if ended.get(c.run_id, 0) < c.answered
        }
        assert not lost, f"round {round_no} (seed {seed}): commands answered, ended: {lost}"
        assert refused >= seen_403s, (
            f"round {round_no} (seed {seed}): the sandbox saw {seen_403s} refusals from the "
            f"egress proxy, the log holds {refused}"
        )
    daemon = start_daemon(state, *options, sandbox=True, random_ids=False)
    assert daemon.stop() == 0
    verify = subprocess.run(
        [str(BIN / "gatewayd"), "audit", "verify", str(daemon.audit_path)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr


def _quietly(call: Callable[..., Any], *args: Any) -> None:
    """``call``, whose end (the daemon killed under it) is no news."""
    with contextlib.suppress(OSError, ValueError):
        call(*args)
