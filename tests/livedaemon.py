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
SHIPPED = Path(__file__).resolve().parent.parent / "policies"


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

    @property
    def policy_dir(self) -> Path:
        """The daemon's own policy directory (first on its --policy-dir list)."""
        return self.state.parent / f"{self.state.name}-policies"

    def policy_name(self, policy: Path) -> str:
        """The name the control socket knows ``policy`` by: a link to it in the daemon's
        policy directory (the control socket takes names only), so a test that edits
        the file and reloads still edits what the run reads."""
        for link in self.policy_dir.iterdir():
            if link.is_symlink() and Path(os.readlink(link)) == policy.absolute():
                return link.stem
        name = f"{policy.stem}-{len(list(self.policy_dir.iterdir()))}"
        (self.policy_dir / f"{name}.yaml").symlink_to(policy.absolute())
        return name

    def create_run(self, workspace: Path, policy: Path, **extra: Any) -> dict[str, Any]:
        body = {
            "workspacePath": str(workspace),
            "policy": self.policy_name(policy),
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


def policy_options(state: Path) -> list[str]:
    """``--policy-dir`` options for a daemon on ``state``: its own directory, where
    :meth:`LiveDaemon.policy_name` links a test's policy files, then the shipped ones."""
    policy_dir = state.parent / f"{state.name}-policies"
    policy_dir.mkdir(exist_ok=True)
    options = ["--policy-dir", str(policy_dir)]
    return [*options, "--policy-dir", str(SHIPPED), "--policy-dir", str(SHIPPED / "examples")]


def start_daemon(
    state: Path, *extra: str, sandbox: bool = False, random_ids: bool = True
) -> LiveDaemon:
    """A `gatewayd serve` on ``state``; without ``sandbox`` it has no OS sandbox (its
    clients are the test itself, on the host), so its policies say
    ``require_os_sandbox: false``. A sandboxed one gets a random prefix and uid range
    (:func:`sandbox_options`), or with ``random_ids=False`` the ones gatewayd derives
    from ``state``."""
    log_path = state.parent / "gatewayd.log"
    log = open(log_path, "wb")  # noqa: SIM115 (the process owns it)
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    mode = (sandbox_options() if random_ids else []) if sandbox else ["--no-os-sandbox"]
    policies = policy_options(state)
    proc = subprocess.Popen(
        [str(BIN / "gatewayd"), "serve", "--state-dir", str(state), *mode, *policies, *extra],
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
