"""The command lines as an operator and an agent use them: `gatewayd run`, `gatewayd
serve` with curl on the control socket, `cogni-tool` exit codes, `policy check`,
`audit verify/show`, and the control-socket commands given ids that are no ids."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.conftest import OPEN_POLICY, ROOT, write_policy
from tests.livedaemon import start_daemon

BIN = Path(sys.executable).parent
GATEWAYD = str(BIN / "gatewayd")
ENV = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-cli-", dir="/tmp"))
    (path / "ws" / "docs").mkdir(parents=True)
    (path / "ws" / "notes.md").write_text("hello\n")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def gw_run(
    base: Path,
    *cmd: str,
    policy: str = OPEN_POLICY,
    extra_env: dict[str, str] | None = None,
    extra: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    pol = write_policy(base, policy)
    return subprocess.run(
        [
            GATEWAYD,
            "run",
            "--state-dir",
            str(base / "state"),
            "--workspace",
            str(base / "ws"),
            "--policy",
            str(pol),
            "--no-os-sandbox",
            *extra,
            "--",
            *cmd,
        ],
        capture_output=True,
        text=True,
        env={**ENV, **(extra_env or {})},
        timeout=120,
    )


def test_gatewayd_run_serves_the_command_and_reports_the_audit_path(base: Path) -> None:
    proc = gw_run(base, "cogni-tool", "exec", "time.now", "{}")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["timezone"] == "UTC"
    assert "1 calls, 1 allowed, 0 denied" in proc.stderr
    assert f"audit log {base / 'state' / 'audit' / 'audit.jsonl'}" in proc.stderr
    verify = subprocess.run(
        [GATEWAYD, "audit", "verify", str(base / "state/audit/audit.jsonl")],
        capture_output=True,
        text=True,
    )
    assert verify.returncode == 0 and verify.stdout.startswith("OK")


def test_a_degraded_run_warns_and_audits_its_command_and_calls_as_degraded(base: Path) -> None:
    # --no-os-sandbox stands for a host without bubblewrap; OPEN_POLICY allows that.
    proc = gw_run(base, "cogni-tool", "exec", "time.now", "{}")
    assert "WARNING" in proc.stderr and "NO OS sandbox" in proc.stderr
    entries = [
        json.loads(line) for line in (base / "state/audit/audit.jsonl").read_text().splitlines()
    ]
    marked = [e for e in entries if e.get("degraded")]
    assert [e.get("event", e["kind"]) for e in marked] == ["exec_started", "call", "exec_ended"]
    assert all("--no-os-sandbox" in e["degraded"] for e in marked)
    assert marked[-1]["detail"]["exitCode"] == 0


def test_a_run_requiring_the_os_sandbox_is_refused_on_a_host_without_it(base: Path) -> None:
    strict = OPEN_POLICY.replace("require_os_sandbox: false\n", "")
    proc = gw_run(base, "true", policy=strict)
    assert proc.returncode == 1
    assert "policy_denied" in proc.stderr and "require_os_sandbox: false" in proc.stderr


def test_gatewayd_run_exits_with_the_commands_status(base: Path) -> None:
    assert gw_run(base, "sh", "-c", "exit 7").returncode == 7
    assert gw_run(base, "sh", "-c", "kill -TERM $$").returncode == 128 + 15


def test_the_command_gets_only_allowlisted_environment(base: Path) -> None:
    proc = gw_run(base, "env", extra_env={"PROVIDER_API_KEY": "sk-host-secret"})
    assert proc.returncode == 0
    env = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    assert "sk-host-secret" not in proc.stdout
    assert set(env) <= {
        "PATH",
        "HOME",
        "LANG",
        "LC_ALL",
        "TERM",
        "TZ",
        "COGNI_GATEWAY_SOCK",
        "COGNI_RUN_ID",
    }
    assert len(env["COGNI_RUN_ID"]) == 32


@pytest.mark.parametrize(
    ("script", "code"),
    [
        ('cogni-tool exec fs.read \'{"path": "/etc/passwd"}\'', 15),
        ("cogni-tool exec no.such '{}'", 14),
        ("cogni-tool exec fs.read '{\"path\": 3}'", 16),
        ('cogni-tool exec fs.read \'{"path": "missing.md"}\'', 20),
        ("COGNI_RUN_ID=0123 cogni-tool exec time.now '{}'", 12),
        ("cogni-tool exec time.now 'not json'", 2),
        ("COGNI_GATEWAY_SOCK= cogni-tool exec time.now '{}'", 3),
    ],
)
def test_cogni_tool_exit_codes_in_a_real_run(base: Path, script: str, code: int) -> None:
    proc = gw_run(base, "sh", "-c", f"{script}; echo EXIT=$?")
    assert f"EXIT={code}" in proc.stdout, proc.stdout + proc.stderr


def test_a_spec_without_the_sandbox_grant_is_refused(base: Path) -> None:
    spec = base / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "workspacePath": str(base / "ws"),
                "policy": str(write_policy(base, OPEN_POLICY)),
                "actorId": "u",
                "tenantId": "t",
                "grant": {"allowSandbox": False},
            }
        )
    )
    proc = subprocess.run(
        [GATEWAYD, "run", "--state-dir", str(base / "state"), "--spec", str(spec), "--", "true"],
        capture_output=True,
        text=True,
        env=ENV,
    )
    assert proc.returncode == 1
    assert "authz_denied" in proc.stderr and "allowSandbox" in proc.stderr
    show = subprocess.run(
        [GATEWAYD, "audit", "show", str(base / "state/audit/audit.jsonl")],
        capture_output=True,
        text=True,
    )
    assert "run_refused" in show.stdout


def test_policy_check_summarizes_or_names_the_bad_field(base: Path) -> None:
    ok = subprocess.run(
        [GATEWAYD, "policy", "check", str(ROOT / "policies/examples/demo.yaml")],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0 and "fs.read" in ok.stdout
    assert "warning" not in ok.stderr
    typo = write_policy(
        base, "version: 1\nname: t\ntools: {allow: [fs.raed, time.now]}\n", name="typo.yaml"
    )
    warned = subprocess.run(
        [GATEWAYD, "policy", "check", str(typo)], capture_output=True, text=True
    )
    assert warned.returncode == 0
    assert "'fs.raed' matches no tool" in warned.stderr and "time.now" not in warned.stderr
    bad = write_policy(
        base,
        "version: 1\nname: x\nfilesystem:\n  paths:\n    w: {root: ., mode: rwx}\n",
        name="bad.yaml",
    )
    proc = subprocess.run([GATEWAYD, "policy", "check", str(bad)], capture_output=True, text=True)
    assert proc.returncode == 1
    assert "bad.yaml" in proc.stderr and "filesystem.paths.w.mode" in proc.stderr


def test_audit_verify_fails_on_a_tampered_log_and_show_filters(base: Path) -> None:
    proc = gw_run(
        base,
        "sh",
        "-c",
        "cogni-tool exec time.now '{}'; cogni-tool exec fs.read '{\"path\": \"/etc\"}'; true",
    )
    assert proc.returncode == 0
    audit = base / "state/audit/audit.jsonl"
    denied = subprocess.run(
        [GATEWAYD, "audit", "show", "--denied", str(audit)], capture_output=True, text=True
    )
    assert "policy_denied" in denied.stdout and "time.now" not in denied.stdout
    data = audit.read_bytes().replace(b'"decision":"deny"', b'"decision":"allow"', 1)
    audit.write_bytes(data)
    verify = subprocess.run(
        [GATEWAYD, "audit", "verify", str(audit)], capture_output=True, text=True
    )
    assert verify.returncode == 1 and "OK" not in verify.stdout.split("\n")[0]


def test_serve_control_socket_works_with_curl(base: Path) -> None:
    daemon = start_daemon(base / "state")
    try:
        sock = str(daemon.control_socket)

        def curl(*args: str) -> tuple[int, dict]:
            out = subprocess.run(
                ["curl", "-s", "-w", "\n%{http_code}", "--unix-socket", sock, *args],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            body, status = out.rsplit("\n", 1)
            return int(status), json.loads(body)

        status, created = curl(
            "-X",
            "POST",
            "-H",
            "content-type: application/json",
            "-d",
            json.dumps(
                {
                    "workspacePath": str(base / "ws"),
                    "policy": daemon.policy_name(write_policy(base, OPEN_POLICY)),
                    "actorId": "op",
                    "tenantId": "t",
                    "grant": {"allowSandbox": True},
                }
            ),
            "http://gatewayd/v1/runs",
        )
        assert status == 201, created
        run_id = created["run"]["runId"]
        assert Path(created["run"]["socket"]).is_socket()
        status, listing = curl("http://gatewayd/v1/runs")
        assert status == 200 and [r["runId"] for r in listing["runs"]] == [run_id]
        status, refused = curl(
            "-X",
            "POST",
            "-d",
            json.dumps(
                {
                    "workspacePath": str(base / "ws"),
                    "policy": str(write_policy(base, OPEN_POLICY)),
                    "actorId": "op",
                    "tenantId": "t",
                }
            ),
            "http://gatewayd/v1/runs",
        )
        assert status == 403 and refused["errorCode"] == "authz_denied"
        status, bad = curl("-X", "POST", "-d", "{", "http://gatewayd/v1/runs")
        assert status == 400 and bad["errorCode"] == "bad_request"
        huge = base / "huge.json"
        huge.write_text('{"pad": "' + "x" * (2 << 20) + '"}')
        status, bad = curl("-X", "POST", "--data-binary", f"@{huge}", "http://gatewayd/v1/runs")
        assert status == 413 and "bytes" in bad["message"]
        status, bad = curl(
            "-X", "POST", "-d", json.dumps({"runId": "x"}), "http://gatewayd/v1/runs"
        )
        assert status == 400 and "assigned by gatewayd" in bad["message"]
        status, ended = curl("-X", "DELETE", f"http://gatewayd/v1/runs/{run_id}")
        assert status == 200 and ended["run"]["state"] == "ended"
        status, _ = curl(f"http://gatewayd/v1/runs/{run_id}")
        assert status == 404
        assert daemon.stop() == 0
        verify = subprocess.run(
            [GATEWAYD, "audit", "verify", str(daemon.audit_path)], capture_output=True, text=True
        )
        assert verify.returncode == 0, verify.stdout
        assert not daemon.control_socket.exists()
    finally:
        daemon.stop()


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("runuser"),
    reason="needs root and runuser to act as another user",
)
def test_control_socket_refuses_other_users(base: Path) -> None:
    daemon = start_daemon(base / "state")
    try:
        sock = str(daemon.control_socket)
        cmd = [
            "runuser",
            "-u",
            "nobody",
            "--",
            "curl",
            "-s",
            "--unix-socket",
            sock,
            "http://gatewayd/v1/runs",
        ]
        # Layer 1: the 0600 root-owned socket keeps other users from connecting at all.
        first = subprocess.run(cmd, capture_output=True, text=True)
        assert first.returncode != 0 and "runs" not in first.stdout
        # Layer 2: even if permissions were loosened, the peer check says no.
        os.chmod(base, 0o755)
        os.chmod(daemon.state, 0o755)
        os.chmod(sock, 0o777)
        second = subprocess.run(cmd, capture_output=True, text=True)
        assert json.loads(second.stdout)["errorCode"] == "authz_denied"
    finally:
        daemon.stop()


def test_max_frame_bytes_is_configurable_and_enforced(base: Path) -> None:
    big = "x" * 5000
    proc = gw_run(
        base,
        "sh",
        "-c",
        f'cogni-tool exec fs.write \'{{"path": "a.txt", "content": "{big}"}}\'; echo EXIT=$?',
        extra=("--max-frame-bytes", "4096"),
    )
    assert "EXIT=11" in proc.stdout, proc.stdout + proc.stderr
    assert "too_large" in proc.stderr and "4096" in proc.stderr
    assert not (base / "ws" / "a.txt").exists()


def test_max_frame_bytes_out_of_range_is_a_usage_error(base: Path) -> None:
    proc = gw_run(base, "true", extra=("--max-frame-bytes", "10"))
    assert proc.returncode == 2
    assert "outside 64.." in proc.stderr


def test_a_command_over_max_runtime_is_stopped_and_reported(base: Path) -> None:
    proc = gw_run(base, "sleep", "30", extra=("--max-runtime", "1"))
    assert proc.returncode == 124
    assert "exceeded its 1 s (maxRuntimeSec)" in proc.stderr
    show = subprocess.run(
        [GATEWAYD, "audit", "show", str(base / "state/audit/audit.jsonl")],
        capture_output=True,
        text=True,
    )
    assert "max_runtime_exceeded" in show.stdout


def test_gatewayd_rules_tightens_at_once_and_loosens_only_when_confirmed(base: Path) -> None:
    policy = write_policy(
        base,
        OPEN_POLICY + "review:\n  rules:\n    allow: [Reading notes]\n    deny: [Writing keys]\n",
        name="reviewed.yaml",
    )
    daemon = start_daemon(base / "state")
    state = ["--state-dir", str(base / "state")]
    name = daemon.policy_name(policy)  # the control socket takes names only

    def rules(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [GATEWAYD, "rules", args[0], *state, *args[1:]], capture_output=True, text=True, env=ENV
        )

    try:
        shown = rules("show", "--policy", name)
        assert shown.returncode == 0, shown.stderr
        assert "1. Reading notes" in shown.stdout and "1. Writing keys" in shown.stdout
        tightened = rules("add-deny", "--policy", name, "Deleting files", "--by", "ops")
        assert tightened.returncode == 0 and tightened.stdout.startswith("APPLIED add_deny")
        assert "Deleting files" in policy.read_text()
        loosened = rules("add-allow", "--policy", name, "Writing anything")
        assert loosened.returncode == 0 and loosened.stdout.startswith("PENDING ")
        confirmation = loosened.stdout.split()[1].rstrip(":")
        assert "Writing anything" not in policy.read_text()
        listed = rules("pending")
        assert confirmation in listed.stdout and "add_allow" in listed.stdout
        confirmed = rules("confirm", confirmation)
        assert confirmed.returncode == 0 and confirmed.stdout.startswith("APPLIED add_allow")
        assert "Writing anything" in policy.read_text()
        missing = rules("remove-allow", "--policy", name, "No such rule")
        assert missing.returncode == 1 and "no allow rule 'No such rule'" in missing.stderr
        unknown = rules("confirm", "0" * 32)
        assert unknown.returncode == 1 and "no pending rule change" in unknown.stderr
    finally:
        daemon.stop()
    entries = [json.loads(line) for line in daemon.audit_path.read_text().splitlines()]
    changed = [e["detail"] for e in entries if e.get("event") == "rule_changed"]
    assert [(d["action"], d["rule"]) for d in changed] == [
        ("add_deny", "Deleting files"),
        ("add_allow", "Writing anything"),
    ]
    assert changed[1]["confirmationId"] == confirmation


@pytest.fixture(scope="module")
def served() -> Iterator[Path]:
    """A `gatewayd serve` for the tests that only ask it (no run): its state directory."""
    path = Path(tempfile.mkdtemp(prefix="cg-cli-", dir="/tmp"))
    daemon = start_daemon(path / "state")
    try:
        yield daemon.state
    finally:
        daemon.stop()
        shutil.rmtree(path, ignore_errors=True)


# Each control-socket command that puts a user-given id in its request's path (its
# words before the id, and after it), and what its refusal starts with.
ID_COMMANDS = (
    # `gatewayd exec` and `gatewayd workspace` check the id themselves before they ask.
    (("exec",), ("--", "/bin/true"), "gatewayd exec: bad_request: {id!r} is not a run id"),
    (("approvals", "approve"), (), "gatewayd approvals: "),
    (("approvals", "deny"), (), "gatewayd approvals: "),
    (("apps", "rules", "confirm"), (), "gatewayd apps rules: bad_request: no route POST"),
    (("apps", "rules", "cancel"), (), "gatewayd apps rules: bad_request: no route DELETE"),
    (("rules", "confirm"), (), "gatewayd rules: bad_request: no route POST"),
    (("rules", "cancel"), (), "gatewayd rules: bad_request: no route DELETE"),
    *(
        (("workspace", name), (), f"gatewayd workspace {name}: bad_request: {{id!r}} is not")
        for name in ("list", "diff", "commit", "discard")
    ),
)


@pytest.mark.parametrize(
    "given",
    ["a b", "../x", "%2e%2e", "\u00e9" * 32, "x\ty"],
    ids=["space", "dotdot", "percent", "non-ascii", "tab"],
)
def test_an_id_that_is_no_id_is_refused_by_name_without_a_traceback(
    served: Path, given: str
) -> None:
    # Quoted whole, the id reaches the daemon as one path segment (never a traceback
    # here, never "../" walking the path), and the daemon's refusal names it as sent.
    for before, after, refusal in ID_COMMANDS:
        done = subprocess.run(
            [GATEWAYD, *before, "--state-dir", str(served), given, *after],
            capture_output=True,
            text=True,
            env=ENV,
            timeout=60,
        )
        assert done.returncode == 1, (before, done)
        assert "Traceback" not in done.stderr, (before, done.stderr)
        assert done.stderr.startswith(refusal.format(id=given)), (before, done.stderr)
        checked_here = before[0] in ("workspace", "exec")
        named = repr(given) if checked_here else f"/{quote(given, safe='')}"
        assert named in done.stderr, (before, done.stderr)
