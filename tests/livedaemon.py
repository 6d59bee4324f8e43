"""A real `gatewayd serve` process for tests that need a daemon outside the test's
own event loop (fuzzing, real CLI clients, curl on the control socket)."""

from __future__ import annotations

import http.client
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("gatewayd", timeout=30)
        self.unix_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(self.unix_path)


@dataclass
class LiveDaemon:
    proc: subprocess.Popen[bytes]
    state: Path
    log_path: Path

    @property
    def control_socket(self) -> Path:
        return self.state / "control.sock"

    @property
    def audit_path(self) -> Path:
        return self.state / "audit" / "audit.jsonl"

    def control(self, method: str, target: str, body: Any = None) -> tuple[int, Any]:
        conn = _UnixHTTPConnection(str(self.control_socket))
        payload = json.dumps(body).encode() if body is not None else None
        conn.request(method, target, body=payload, headers={"content-type": "application/json"})
        resp = conn.getresponse()
        data = json.loads(resp.read() or b"null")
        conn.close()
        return resp.status, data

    def create_run(self, workspace: Path, policy: Path, **extra: Any) -> dict[str, Any]:
        body = {
            "workspacePath": str(workspace),
            "policy": str(policy),
            "actorId": "tester",
            "tenantId": "t1",
            "grant": {"allowSandbox": True},
            **extra,
        }
        status, data = self.control("POST", "/v1/runs", body)
        if status != 201:
            raise RuntimeError(f"run creation failed: {status} {data}")
        run: dict[str, Any] = data["run"]
        return run

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> int:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def sandbox_options() -> list[str]:
    """Options that keep a test daemon's namespaces and sandbox uids apart from every
    other daemon's on this host (each removes its prefix's namespaces at start)."""
    tag = secrets.token_hex(4)
    base = 1_700_000_000 + secrets.randbelow(50_000) * 1024
    return ["--netns-prefix", f"cgt{tag}-", "--sandbox-uids", f"{base}+64"]


def start_daemon(state: Path, *extra: str, sandbox: bool = False) -> LiveDaemon:
    """A `gatewayd serve` on ``state``; without ``sandbox`` it has no OS sandbox (its
    clients are the test itself, on the host), so its policies say
    ``require_os_sandbox: false``."""
    log_path = state.parent / "gatewayd.log"
    log = open(log_path, "wb")  # noqa: SIM115 (the process owns it)
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    mode = sandbox_options() if sandbox else ["--no-os-sandbox"]
    proc = subprocess.Popen(
        [str(BIN / "gatewayd"), "serve", "--state-dir", str(state), *mode, *extra],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    daemon = LiveDaemon(proc=proc, state=state, log_path=log_path)
    deadline = time.monotonic() + 30
    while not _healthy(daemon):  # the socket file appears before it listens
        if not daemon.alive() or time.monotonic() > deadline:
            daemon.stop()
            raise RuntimeError(f"gatewayd did not start:\n{log_path.read_text()}")
        time.sleep(0.02)
    return daemon


def _healthy(daemon: LiveDaemon) -> bool:
    if not daemon.control_socket.exists():
        return False
    try:
        status, _ = daemon.control("GET", "/v1/health")
    except OSError:
        return False
    return status == 200
