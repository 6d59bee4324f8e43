"""sandbox.exec's options (cwd, env, allowedDomains, packageManagers), its ``failed`` flag
and its hints, called with ``cogni-tool`` from inside real sandboxes of a real daemon; and
the same options on the control socket's exec (``gatewayd exec``'s flags).

Every refusal is checked for its error code and for a message that says what *is*
allowed. The network cases use a plain-HTTP origin on the host's loopback, which the
daemon's resolver names (as tests/integration/test_process_runner_network.py does).
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from gatewayd.config import GatewaydConfig, SandboxUids
from gatewayd.daemon import Daemon, open_daemon
from gatewayd.runs import Grant, Run, RunLimits, RunRequest
from tests.integration.test_run_sandbox import _unavailable
from tests.livedaemon import start_daemon
from tests.origin_server import QuietHandler, serving

pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))

PY = "/usr/bin/python3"
GATEWAYD = str(Path(sys.executable).parent / "gatewayd")
GRANTED = "api.example.org"
RUN_ONLY = "run-only.example.org"
PYPI = "pypi.org"
OUTSIDE = "evil.example.com"  # allowed by nothing
ENV_NAME = "COGNI_TEST_GREETING"
OTHER_ENV = "COGNI_TEST_OTHER"

POLICY = """
version: 1
name: exec-options
tools:
  allow: [sandbox.exec, http.fetch, fs.read]
filesystem:
  paths:
    workspace: {{root: ., mode: rw}}
    docs: {{root: docs, mode: ro}}
env:
  allow: [{env}, {other}]
network:
  allow_domains: [{granted}, {run_only}]
  package_managers: [pypi]
  schemes: [http, https]
  ports: [{port}]
  allow_private: [{granted}, {run_only}, {pypi}, files.pythonhosted.org]
  proxy: {{enabled: {proxy}}}
limits: {{calls_per_second: 1000, burst: 1000, call_timeout_s: 60}}
sandbox: {{timeout_s: 30, cpu_s: 20, max_processes: 40, max_file_mb: 1, max_output_bytes: 65536}}
"""

# Runs each argument (a JSON object) as `cogni-tool exec sandbox.exec ARGS` from inside
# the sandbox and prints one JSON list: exit status, stdout (the value) and stderr.
CALLER = r"""
import json, subprocess, sys
out = []
for args in sys.argv[1:]:
    p = subprocess.run(
        ["cogni-tool", "exec", "--timeout", "60", "sandbox.exec", args],
        capture_output=True, text=True,
    )
    value = json.loads(p.stdout) if p.stdout else None
    if value and len(value["stdout"]) > 1000:  # the outer command's output is bounded too
        value["stdout"] = "<%d chars>" % len(value["stdout"])
    out.append({"rc": p.returncode, "value": value, "error": p.stderr.strip()})
print(json.dumps(out))
"""

FETCH = r"""
import json, sys, urllib.request
out = {}
for url in sys.argv[1:]:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            out[url] = "ok: " + answer.read().decode()
    except urllib.error.HTTPError as exc:
        out[url] = "HTTPError %d" % exc.code
    except Exception as exc:
        out[url] = type(exc).__name__
print(json.dumps(out))
"""


class _Origin(QuietHandler):
    seen: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        host = self.headers.get("Host", "")
        self.seen.append(host.split(":")[0])
        body = f"hello {host.split(':')[0]}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def origin() -> Iterator[int]:
    _Origin.seen = []
    with serving(_Origin) as port:
        yield port


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-exo-", dir="/tmp"))
    path.chmod(0o711)  # the run's uid passes through to its workspace
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def workspace(base: Path) -> Path:
    ws = base / "ws"
    (ws / "sub" / "deeper").mkdir(parents=True)
    (ws / "docs").mkdir()
    (ws / "file.txt").write_text("a file\n")
    os.symlink("/etc", ws / "out")  # leads out of the workspace
    os.symlink("sub", ws / "inside")  # stays inside it
    return ws


def policy_text(port: int, *, proxy: bool = True) -> str:
    return textwrap.dedent(
        POLICY.format(
            env=ENV_NAME,
            other=OTHER_ENV,
            granted=GRANTED,
            run_only=RUN_ONLY,
            pypi=PYPI,
            port=port,
            proxy="true" if proxy else "false",
        )
    )


class Harness:
    def __init__(self, daemon: Daemon, base: Path, port: int) -> None:
        self.daemon = daemon
        self.base = base
        self.port = port

    async def run(self, *, proxy: bool = True, memory_mb: int = 1024) -> Run:
        path = self.base / f"policy-{secrets.token_hex(4)}.yaml"
        path.write_text(policy_text(self.port, proxy=proxy))
        ws = self.base / "ws"
        if not ws.exists():
            workspace(self.base)
        return await self.daemon.runs.start(
            RunRequest(
                workspacePath=str(ws),
                policy=str(path),
                actorId="tester",
                tenantId="t1",
                grant=Grant(allowSandbox=True),
                limits=RunLimits(maxMemoryMb=memory_mb),
            ),
            policy_paths=True,
        )

    async def calls(self, run: Run, *calls: dict[str, Any]) -> list[dict[str, Any]]:
        """Each of ``calls`` as sandbox.exec's arguments, from inside ``run``'s sandbox."""
        result = await self.daemon.runs.exec(
            run.run_id,
            [PY, "-I", "-c", CALLER, *(json.dumps(c) for c in calls)],
            timeout_s=120,
        )
        assert result.exitCode == 0, result.stderr
        answers: list[dict[str, Any]] = json.loads(result.stdout)
        return answers

    async def entries(self) -> list[dict[str, Any]]:
        audit = self.daemon.audit
        await audit.durable(audit.last_seq)
        path = self.daemon.config.resolved_audit_path
        return [json.loads(line) for line in path.read_text().splitlines() if line]


@pytest.fixture
async def harness(base: Path, origin: int) -> AsyncIterator[Harness]:
    async def resolve(host: str, port: int) -> tuple[Any, ...]:
        if host in (GRANTED, RUN_ONLY, PYPI, OUTSIDE):
            return (ipaddress.ip_address("127.0.0.1"),)
        raise OSError(f"no such host {host}")

    config = GatewaydConfig(
        state_dir=base / "state",
        policy_dirs=(base,),
        netns_prefix=f"cgx{secrets.token_hex(4)}-",
        sandbox_uids=SandboxUids(base=1_700_000_000 + secrets.randbelow(50_000) * 1024, count=64),
        audit_fsync=False,
        workspace_mode="host",
    )
    os.environ[OTHER_ENV] = "gatewayd's own value"
    try:
        async with open_daemon(config, preload=True, resolver=resolve) as daemon:
            assert daemon.runs.support.available, daemon.runs.support.reason
            yield Harness(daemon, base, origin)
    finally:
        os.environ.pop(OTHER_ENV, None)


def refused(answer: dict[str, Any], code: str, *phrases: str) -> None:
    """``answer`` is cogni-tool's refusal with ``code``, its message holding ``phrases``."""
    assert answer["value"] is None, answer
    assert answer["error"].startswith(f"cogni-tool: {code}: "), answer
    for phrase in phrases:
        assert phrase in answer["error"], (phrase, answer["error"])


# --- cwd, env, failed ------------------------------------------------------------------


async def test_cwd_env_and_failed_from_inside_and_each_refusal_says_what_is_allowed(
    harness: Harness,
) -> None:
    run = await harness.run()
    answers = await harness.calls(
        run,
        {"command": "pwd", "cwd": "sub"},
        {"command": "pwd", "cwd": "/workspace/sub/deeper"},
        {"command": "pwd", "cwd": "sub/../sub/deeper/.."},
        {"command": "pwd", "cwd": "inside"},  # a symlink that stays inside: followed
        {"command": "pwd"},
        {"command": "exit 3"},
        {"command": 'printf "%s|%s" "$COGNI_TEST_GREETING" "$COGNI_TEST_OTHER"'},
        {"command": 'printf "%s" "$COGNI_TEST_GREETING"', "env": {ENV_NAME: "hi there"}},
        # refusals
        {"command": "pwd", "cwd": "/etc"},
        {"command": "pwd", "cwd": "../../etc"},
        {"command": "pwd", "cwd": "out"},
        {"command": "pwd", "cwd": "missing"},
        {"command": "pwd", "cwd": "file.txt"},
        {"command": "pwd", "cwd": "apps"},
        {"command": "env", "env": {"LD_PRELOAD": "/tmp/x.so"}},
        {"command": "env", "env": {"PATH": "/tmp"}},
        {"command": "env", "env": {ENV_NAME: "a\u0000b"}},
    )
    (sub, deeper, dots, inside, default, exited, no_env, with_env) = answers[:8]
    assert sub["value"]["stdout"] == "/workspace/sub\n", sub
    assert deeper["value"]["stdout"] == "/workspace/sub/deeper\n", deeper
    assert dots["value"]["stdout"] == "/workspace/sub\n", dots
    # A symlink that stays inside, where the workspace holds another grant (docs, with
    # its own rules): the fs tools follow none there, and neither does cwd.
    refused(inside, "policy_denied", "'/workspace/inside' is a symlink", "use the real path")
    assert default["value"]["stdout"] == "/workspace\n", default
    for ok in (sub, deeper, default, no_env, with_env):
        assert ok["value"]["failed"] is False and ok["value"]["hint"] is None, ok
    assert exited["value"]["exitCode"] == 3 and exited["value"]["failed"] is True, exited
    assert exited["value"]["hint"] is None, exited  # the command's own failure: no hint
    # A tool's command gets no host value, not even of env.allow, unless it asks.
    assert no_env["value"]["stdout"] == "|", no_env
    assert with_env["value"]["stdout"] == "hi there", with_env
    etc, dotdot, out, missing, a_file, apps, preload, path, nul = answers[8:]
    refused(etc, "invalid_args", "outside /workspace", "'/etc'")
    refused(dotdot, "invalid_args", "outside /workspace")
    refused(out, "policy_denied", "'/workspace/out'")
    refused(missing, "tool_failed", "'/workspace/missing' does not exist")
    refused(a_file, "tool_failed", "not a directory")
    refused(apps, "policy_denied", "apps")
    for env_refusal in (preload, path):
        refused(env_refusal, "policy_denied", "is not allowed for this run", ENV_NAME, OTHER_ENV)
    refused(nul, "invalid_args", "NUL")
    # Refusals are the calls' results on the record: policy_denied, nothing ran.
    results = [
        e
        for e in await harness.entries()
        if e.get("tool") == "sandbox.exec" and e.get("kind") == "result"
    ]
    codes = [e.get("errorCode") for e in results]
    assert codes.count("policy_denied") == 5, codes  # inside, out, apps, two names
    await harness.daemon.runs.end(run.run_id)


# --- the network: narrowing, never widening --------------------------------------------


def fetch(*hosts: str, port: int) -> str:
    urls = " ".join(f"http://{h}:{port}/x" for h in hosts)
    return f"{PY} -I -c '{FETCH}' {urls}"


async def test_allowed_domains_and_package_managers_narrow_one_command_and_never_widen(
    harness: Harness,
) -> None:
    run = await harness.run()
    port = harness.port
    all_three = fetch(GRANTED, RUN_ONLY, PYPI, port=port)
    answers = await harness.calls(
        run,
        {"command": all_three},
        {"command": all_three, "allowedDomains": [GRANTED]},
        {"command": all_three, "packageManagers": ["pypi"]},
        {"command": all_three, "allowedDomains": []},
        {"command": "env | grep -i _proxy | sort", "allowedDomains": [GRANTED]},
        {"command": "true", "allowedDomains": [OUTSIDE]},
        {"command": "true", "allowedDomains": ["*.example.org"]},  # wider than the list
        {"command": "true", "packageManagers": ["npm"]},
        {"command": "true", "packageManagers": ["nope"]},
        {"command": "true", "allowedDomains": ["Not A Domain"]},
    )
    run_wide, granted, pypi, none, proxy_env = (a["value"] for a in answers[:5])
    urls = [f"http://{h}:{port}/x" for h in (GRANTED, RUN_ONLY, PYPI)]

    def got(value: dict[str, Any]) -> list[str]:
        report = json.loads(value["stdout"])
        return [report[u].split(":")[0] for u in urls]

    # The run's proxy: every domain of the run (its package manager's too).
    assert got(run_wide) == ["ok", "ok", "ok"], run_wide
    # Narrowed: the command's own proxy allows what it asked for and nothing else.
    assert got(granted) == ["ok", "HTTPError 403", "HTTPError 403"], granted
    assert got(pypi) == ["HTTPError 403", "HTTPError 403", "ok"], pypi
    # No network at all: no proxy to ask, and no name resolves.
    assert got(none) == ["URLError", "URLError", "URLError"], none
    assert "HTTP_PROXY=http://127.0.0.1:3128" in proxy_env["stdout"], proxy_env
    out, wider, npm, nope, bad = answers[5:]
    refused(out, "policy_denied", OUTSIDE, "may only narrow", GRANTED, RUN_ONLY, PYPI)
    refused(wider, "policy_denied", "*.example.org", "may only narrow")
    refused(npm, "policy_denied", "'npm' is not allowed", "allowed: pypi")
    refused(nope, "invalid_args", "unknown package manager 'nope'", "pypi, npm")
    refused(bad, "invalid_args", "is not a domain")
    # The narrowed commands' connections are on the record as the call's.
    egress = [e for e in await harness.entries() if e.get("event", "").startswith("egress")]
    tagged = [e for e in egress if (e.get("detail") or {}).get("tool") == "sandbox.exec"]
    assert tagged, egress
    assert not list(run.directory.glob("egress-*.sock"))  # each call's proxy is gone
    await harness.daemon.runs.end(run.run_id)


async def test_a_run_whose_proxy_is_off_refuses_a_command_asking_for_a_domain(
    harness: Harness,
) -> None:
    run = await harness.run(proxy=False)
    answers = await harness.calls(
        run,
        {"command": "true", "allowedDomains": [GRANTED]},
        {"command": "true", "packageManagers": ["pypi"]},
        {"command": "echo alone", "allowedDomains": []},  # narrowing to none is fine
    )
    refused(answers[0], "policy_denied", "network.proxy.enabled is false", "http.fetch")
    refused(answers[1], "policy_denied", "network.proxy.enabled is false")
    assert answers[2]["value"]["stdout"] == "alone\n", answers[2]
    await harness.daemon.runs.end(run.run_id)


# --- hints -----------------------------------------------------------------------------

RESOLVE = f"{PY} -I -c \"import socket; socket.getaddrinfo('{GRANTED}', 80)\""
TUNNEL = (
    f"{PY} -I -c \"import urllib.request; urllib.request.urlopen('https://{RUN_ONLY}:"
    "{port}/', timeout=10)\""
)


async def test_each_hint_names_the_rule_its_value_and_the_way_that_works(
    harness: Harness,
) -> None:
    run = await harness.run(memory_mb=128)
    answers = await harness.calls(
        run,
        {"command": "sleep 10", "timeout_s": 1},
        {"command": f"{PY} -I -c 'b = bytearray(400 << 20); b[::4096] = b\"x\" * (100 << 8)'"},
        {"command": "head -c 2097152 /dev/zero > big"},
        {"command": "touch /usr/made-here"},
        {"command": "touch docs/x"},
        {"command": RESOLVE},
        {"command": RESOLVE, "allowedDomains": []},
        {"command": TUNNEL.format(port=harness.port), "allowedDomains": [GRANTED]},
        {
            "command": f"{PY} -I -c 'import threading, time\n"
            "[threading.Thread(target=time.sleep, args=(5,)).start() for _ in range(80)]'"
        },
        {"command": "head -c 100000 /dev/zero | tr '\\0' x"},
        {"command": "cat /workspace/missing.txt"},
        {"command": "echo 'Permission denied' >&2; exit 1"},
        {"command": "cat /etc/shadow"},
        {"command": "ls /workspace/apps/anything"},
    )
    values = [a["value"] for a in answers]
    for answer in answers:
        assert answer["rc"] == 0, answer
    timeout, oom, fsize, ro_usr, ro_docs, dns, dns_none, tunnel, fork, cut = values[:10]
    enoent, denied, hidden, apps = values[10:]
    assert timeout["errorCode"] == "timeout" and timeout["failed"], timeout
    assert "time limit of 1 s" in timeout["hint"] and "up to 30 s" in timeout["hint"], timeout
    assert oom["errorCode"] == "oom_killed", oom
    assert "memory limit of 128 MiB" in oom["hint"], oom
    assert fsize["errorCode"] == "limit_exceeded", fsize
    assert "file size limit of 1 MiB" in fsize["hint"], fsize
    for ro in (ro_usr, ro_docs):
        assert "read-only in this sandbox" in ro["hint"], ro
        assert "/workspace (except /workspace/docs), /tmp" in ro["hint"], ro
    # The run has its proxy: a program that resolves names itself is told to use it.
    assert "only through the egress proxy at http://127.0.0.1:3128" in dns["hint"], dns
    assert GRANTED in dns["hint"] and PYPI in dns["hint"], dns
    assert "Network access is disabled for this command" in dns_none["hint"], dns_none
    assert "cogni-tool exec http.fetch" in dns_none["hint"], dns_none
    assert "proxy refused a connection" in tunnel["hint"], tunnel
    assert f"may reach only {GRANTED} (this command's" in tunnel["hint"], tunnel
    assert fork["failed"] and "at most 40 processes" in fork["hint"], fork
    assert not cut["failed"] and cut["stdoutTruncated"], cut
    assert cut["stdout"] == "<65536 chars>", cut
    assert "Output was cut at 65536 bytes (stdout" in cut["hint"], cut
    # What the host could cause as well gets no hint: never a wrong cause.
    assert enoent["failed"] and enoent["hint"] is None, enoent
    assert denied["failed"] and denied["hint"] is None, denied
    # A path the sandbox does not show at all: said so, never whether the host has it.
    assert "'/etc/shadow' is outside what this sandbox shows" in hidden["hint"], hidden
    assert "apps folder" in apps["hint"], apps
    await harness.daemon.runs.end(run.run_id)


async def test_without_a_proxy_the_hint_says_network_access_is_disabled(
    harness: Harness,
) -> None:
    run = await harness.run(proxy=False)
    answers = await harness.calls(
        run,
        {"command": RESOLVE},
        {"command": "curl -sS --max-time 3 http://1.1.1.1/"},
        {"command": "curl -sS --max-time 3 http://127.0.0.1:9/"},  # loopback: no hint
    )
    dns, curl, local = (a["value"] for a in answers)
    for value in (dns, curl):
        assert value["hint"].startswith("Network access is disabled in this sandbox"), value
        assert "cogni-tool exec http.fetch" in value["hint"], value
        assert GRANTED in value["hint"], value
    assert local["failed"] and local["hint"] is None, local
    await harness.daemon.runs.end(run.run_id)


# --- the control socket: the same options, the same checks -----------------------------


def test_gatewayd_exec_takes_the_options_and_refuses_as_the_tool_does(
    base: Path, origin: int
) -> None:
    ws = workspace(base)
    policy = base / "exec-options.yaml"
    policy.write_text(policy_text(origin).replace("    docs: {root: docs, mode: ro}\n", ""))
    os.environ[ENV_NAME] = "from gatewayd"
    try:
        daemon = start_daemon(base / "state", sandbox=True)
    finally:
        os.environ.pop(ENV_NAME, None)
    try:
        run = daemon.create_run(ws, policy)
        exec_argv = [GATEWAYD, "exec", "--state-dir", str(base / "state")]

        def gatewayd_exec(*argv: str) -> subprocess.CompletedProcess[str]:
            # The options come before the run id; the command after --.
            cut = argv.index("--")
            return subprocess.run(
                [*exec_argv, *argv[:cut], run["runId"], *argv[cut:]],
                capture_output=True,
                text=True,
                timeout=60,
            )

        shown = gatewayd_exec("--cwd", "sub", "--", "sh", "-c", f'pwd; echo "${ENV_NAME}"')
        assert shown.returncode == 0, shown.stderr
        # The operator's exec gets gatewayd's values of env.allow, as before ...
        assert shown.stdout == "/workspace/sub\nfrom gatewayd\n", shown
        over = gatewayd_exec("--env", f"{ENV_NAME}=given", "--", "sh", "-c", f"echo ${ENV_NAME}")
        assert over.stdout == "given\n", over  # ... which --env overrides
        wide = gatewayd_exec("--allow-domain", OUTSIDE, "--", "true")
        assert wide.returncode == 1, wide
        assert f"policy_denied: allowedDomains: '{OUTSIDE}'" in wide.stderr, wide.stderr
        npm = gatewayd_exec("--package-manager", "npm", "--", "true")
        assert "policy_denied: packageManagers: 'npm'" in npm.stderr, npm.stderr
        secret = gatewayd_exec("--env", "HOME=/root", "--", "true")
        assert "policy_denied" in secret.stderr and ENV_NAME in secret.stderr, secret.stderr
        cwd = gatewayd_exec("--cwd", "/etc", "--", "true")
        assert "invalid_args: cwd '/etc' is outside /workspace" in cwd.stderr, cwd.stderr
        usage = gatewayd_exec("--env", "NOEQUALS", "--", "true")
        assert usage.returncode == 2 and "give NAME=VALUE" in usage.stderr, usage.stderr
        # A hint is printed after the command's own output, on stderr.
        offline = gatewayd_exec("--no-network", "--", PY, "-I", "-c", RESOLVE.split('"')[1])
        assert offline.returncode == 1, offline
        assert "hint: Network access is disabled for this command" in offline.stderr
        # The control answer itself carries failed and hint.
        status, answer = daemon.control(
            "POST",
            f"/v1/runs/{run['runId']}/exec",
            {"command": ["sh", "-c", "touch /usr/x"], "cwd": "/workspace/sub"},
        )
        assert status == 200 and answer["result"]["failed"] is True, answer
        assert "writable: /workspace, /tmp" in answer["result"]["hint"], answer
        status, answer = daemon.control(
            "POST",
            f"/v1/runs/{run['runId']}/exec",
            {"command": ["true"], "packageManagers": ["pypi", "go"]},
        )
        assert status == 403 and answer["errorCode"] == "policy_denied", answer
        assert "'go' is not allowed" in answer["message"], answer
        status, answer = daemon.control(
            "POST", f"/v1/runs/{run['runId']}/exec", {"command": ["true"], "cwd": "nope"}
        )
        assert (status, answer["errorCode"]) == (400, "tool_failed"), answer
        assert "'/workspace/nope' does not exist" in answer["message"], answer
        status, answer = daemon.control(
            "POST", f"/v1/runs/{run['runId']}/exec", {"command": ["true"], "env": {"A": 1}}
        )
        assert (status, answer["errorCode"]) == (400, "bad_request"), answer
        assert "env" in answer["message"], answer
    finally:
        daemon.stop()
    ended = [
        json.loads(line)
        for line in daemon.audit_path.read_text().splitlines()
        if '"exec_ended"' in line
    ]
    assert any(e.get("errorCode") == "policy_denied" for e in ended), ended
