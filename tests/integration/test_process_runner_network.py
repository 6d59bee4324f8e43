"""A process tool's network: exactly the domains its manifest declares that the calling
run's policy allows, through an egress proxy of the call's own, proven from inside real
sandboxes of a real daemon (its tool folders read from disk, as an operator's are).

The origin is a plain-HTTP server on the host's loopback; the daemon's resolver maps the
test's names to it (as tests/integration/test_sandbox_services.py does). The tool is a
probe that tries, from inside, to reach each name through the proxy and without it, the
run's own services, and reports what happened.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import shutil
import socket
import stat
import tempfile
import textwrap
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, ClassVar

import pytest
import trio
from structlog.testing import capture_logs

from gatewayd.audit import Peer
from gatewayd.config import GatewaydConfig, ModelAlias, SandboxUids
from gatewayd.daemon import Daemon, open_daemon
from gatewayd.dialer import resolve_host
from gatewayd.errors import ToolFailed
from gatewayd.policy.model import NetworkSection
from gatewayd.protocol import ErrorCode, Request, Response
from gatewayd.runners.process import ProcessToolRunner
from gatewayd.runners.spec import NameNeed
from gatewayd.runs import Grant, Run, RunLimits, RunRequest
from gatewayd.runs.services import CallEgressProxies
from gatewayd.sandbox.plan import EGRESS_PROXY_PORT, MODEL_ENDPOINT_PORT
from gatewayd.tools.registry import ToolContext
from tests.integration.test_process_runner import folder_tool
from tests.origin_server import QuietHandler, serving
from tests.responses import value

PY = "/usr/bin/python3"
PEER = Peer(pid=4242, uid=1000, gid=1000)
GRANTED = "api.example.org"  # declared by the tools, allowed by the run
RUN_ONLY = "run-only.example.org"  # allowed by the run, declared by no tool
TOOL_ONLY = "tool-only.example.org"  # declared by tools, not allowed by the run
KEY_ENV = "COGNI_TEST_PROCNET_KEY"

PROBE = r"""
import json, os, socket, sys, urllib.request

args = json.load(sys.stdin)["arguments"]


def attempt(fn):
    try:
        return "ok: " + repr(fn())
    except urllib.error.HTTPError as exc:
        return "HTTPError %d: %s" % (exc.code, exc.read().decode("utf-8", "replace"))
    except Exception as exc:
        return type(exc).__name__ + ": " + str(exc)


def fetch(url, proxied=True):
    handler = urllib.request.ProxyHandler() if proxied else urllib.request.ProxyHandler({})
    with urllib.request.build_opener(handler).open(url, timeout=10) as answer:
        return answer.read().decode()


def connect(host, port):
    with socket.create_connection((host, port), timeout=3) as s:
        return s.getpeername()


def tunnel(host, port):
    # HTTPS's way through a proxy: CONNECT, answered before any byte reaches the origin.
    with socket.create_connection(("127.0.0.1", 3128), timeout=5) as s:
        s.sendall(("CONNECT %s:%d HTTP/1.1\r\nHost: %s:%d\r\n\r\n" % (host, port, host, port)).encode())
        return s.recv(4096).split(b"\r\n")[0].decode()


port = args["port"]
report = {
    "fetch": {url: attempt(lambda url=url: fetch(url)) for url in args["urls"]},
    "env": {k: v for k, v in os.environ.items() if "proxy" in k.lower()},
    "egress_socket": os.path.exists("/run/cogni/egress.sock"),
    "interfaces": sorted(name for _, name in socket.if_nameindex()),
}
if args.get("direct"):
    report.update(
        {
            "connect_granted": attempt(lambda: tunnel(args["host"], port)),
            "connect_run_only": attempt(lambda: tunnel(args["run_only"], port)),
            "unproxied": attempt(lambda: fetch("http://%s:%d/x" % (args["host"], port), False)),
            "tcp_origin_loopback": attempt(lambda: connect("127.0.0.1", port)),
            "tcp_host_address": attempt(lambda: connect(args["host_ip"], port)),
            "dns": attempt(lambda: socket.getaddrinfo(args["host"], port)),
            "model_endpoint": attempt(lambda: connect("127.0.0.1", args["model_port"])),
            "model_endpoint_http": attempt(
                lambda: fetch("http://127.0.0.1:%d/v1/models" % args["model_port"], False)
            ),
        }
    )
print(json.dumps(report))
"""


def policy(port: int) -> str:
    return f"""
    version: 1
    name: process-network
    tools:
      allow: ["net.*", model.chat]
    model_access:
      models: [assistant]
    network:
      allow_domains: [{GRANTED}, {RUN_ONLY}]
      schemes: [http, https]
      ports: [{port}]
      allow_private: [{GRANTED}, {RUN_ONLY}, {TOOL_ONLY}]
      proxy: {{enabled: true}}
    limits: {{calls_per_second: 1000, burst: 1000, call_timeout_s: 30}}
    sandbox: {{timeout_s: 60, cpu_s: 30, max_processes: 64}}
    """


# name -> the manifest's network capability
TOOLS: dict[str, list[Any]] = {
    # required GRANTED, optional TOOL_ONLY (the run lacks it: the call runs without it)
    "net.mixed": [GRANTED, {"domain": TOOL_ONLY, "optional": True}],
    # required TOOL_ONLY: refused before the call
    "net.needs": [TOOL_ONLY],
    # optional TOOL_ONLY only: nothing granted, so no proxy at all
    "net.optonly": [{"domain": TOOL_ONLY, "optional": True}],
}


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "sandboxed runs need root (network namespaces, a uid per run)"
    if not os.path.exists("/usr/bin/bwrap") or not os.path.exists(PY):
        return "needs bubblewrap at /usr/bin/bwrap and the system python3"
    return None


pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))


class _Origin(QuietHandler):
    seen: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        host = self.headers.get("Host", "")
        self.seen.append(f"{host} {self.path}")
        body = f"hello from the origin, as {host.split(':')[0]}".encode()
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
    path = Path(tempfile.mkdtemp(prefix="cg-pnet-", dir="/tmp"))
    path.chmod(0o711)  # the run's uid passes through to its workspace
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def write_tools(base: Path) -> Path:
    tools = base / "tools"
    for name, network in TOOLS.items():
        folder = tools / name.replace(".", "-")
        folder.mkdir(parents=True)
        (folder / "probe.py").write_text(PROBE)
        manifest = {
            "name": name,
            "version": "1.0.0",
            "description": f"network probe {name}",
            "input_schema": {"type": "object"},
            "runtime": "process",
            "entry": [PY, "-I", "/tool/probe.py"],
            "capabilities": {"network": network},
            "limits": {"timeout": 20, "memory": 128},
        }
        (folder / "manifest.json").write_text(json.dumps(manifest))
        folder.chmod(0o755)
        (folder / "probe.py").chmod(0o644)
    tools.chmod(0o755)
    return tools


class Harness:
    def __init__(self, daemon: Daemon, run: Run, port: int) -> None:
        self.daemon = daemon
        self.run = run
        self.port = port
        self._ids = 0

    async def call(self, tool: str, **args: Any) -> Response:
        self._ids += 1
        request = Request(
            v=1, runId=self.run.run_id, toolCallId=f"c{self._ids}", tool=tool, args=args
        )
        return await self.daemon.dispatcher.handle(self.run, request, PEER)

    async def probe(self, tool: str, *hosts: str, **more: Any) -> dict[str, Any]:
        urls = [f"http://{host}:{self.port}/from-{tool}" for host in hosts]
        report: dict[str, Any] = value(await self.call(tool, port=self.port, urls=urls, **more))
        return report

    async def entries(self) -> list[dict[str, Any]]:
        audit = self.daemon.audit
        await audit.durable(audit.last_seq)
        path = self.daemon.config.resolved_audit_path
        return [json.loads(line) for line in path.read_text().splitlines() if line]


@pytest.fixture
async def harness(base: Path, origin: int) -> AsyncIterator[Harness]:
    async def resolve(host: str, port: int) -> tuple[Any, ...]:
        if host in (GRANTED, RUN_ONLY, TOOL_ONLY):
            return (ipaddress.ip_address("127.0.0.1"),)
        raise OSError(f"no such host {host}")

    # A model alias, so that the run has its model endpoint on its loopback (the tool
    # must not reach it); no call is made to it.
    alias = ModelAlias(
        provider="openai", model="fake", api_base="http://127.0.0.1:9/v1", api_key_env=KEY_ENV
    )
    config = GatewaydConfig(
        state_dir=base / "state",
        policy_dirs=(base,),
        tool_dirs=(write_tools(base),),
        netns_prefix=f"cgn{secrets.token_hex(4)}-",
        sandbox_uids=SandboxUids(base=1_700_000_000 + secrets.randbelow(50_000) * 1024, count=64),
        audit_fsync=False,
        models={"assistant": alias},
    )
    ws = base / "ws"
    ws.mkdir()
    policy_file = base / "policy.yaml"
    policy_file.write_text(textwrap.dedent(policy(origin)))
    os.environ[KEY_ENV] = "sk-host-only-" + secrets.token_hex(8)
    try:
        async with open_daemon(config, preload=True, resolver=resolve) as daemon:
            assert daemon.runs.support.available, daemon.runs.support.reason
            run = await daemon.runs.start(
                RunRequest(
                    workspacePath=str(ws),
                    policy=str(policy_file),
                    actorId="tester",
                    tenantId="t1",
                    grant=Grant(allowSandbox=True),
                    limits=RunLimits(maxMemoryMb=1024),
                ),
                policy_paths=True,
            )
            yield Harness(daemon, run, origin)
    finally:
        os.environ.pop(KEY_ENV, None)


def host_address() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("198.51.100.1", 9))  # no packet is sent: picks the outgoing address
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.2"


def leftover_sockets(run: Run) -> list[str]:
    return sorted(p.name for p in run.directory.glob("egress-*.sock"))


def processes_of(uid: int, running: str) -> list[int]:
    """The processes of ``uid`` (a run's) whose command line holds ``running``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                owner = entry.stat().st_uid
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if owner == uid and running.encode() in cmdline:
                found.append(int(entry.name))
    return found


# --- the intersection ------------------------------------------------------------------


async def test_a_granted_domain_is_reached_through_the_calls_own_proxy_and_no_other(
    harness: Harness,
) -> None:
    report = await harness.probe("net.mixed", GRANTED, RUN_ONLY, TOOL_ONLY)
    fetched = report["fetch"]
    # Declared and granted: reached, through the proxy (the origin saw the request).
    assert fetched[f"http://{GRANTED}:{harness.port}/from-net.mixed"] == (
        f"ok: 'hello from the origin, as {GRANTED}'"
    )
    # Granted by the run, not declared: the call's proxy refuses it (the run's would not).
    run_only = fetched[f"http://{RUN_ONLY}:{harness.port}/from-net.mixed"]
    assert run_only.startswith("HTTPError 403") and f"{RUN_ONLY!r} is not allowed" in run_only
    assert RUN_ONLY not in run_only.split("allowed domains:")[1]  # only the call's listed
    # Declared (optional), not granted by the run: the call ran without it.
    tool_only = fetched[f"http://{TOOL_ONLY}:{harness.port}/from-net.mixed"]
    assert tool_only.startswith("HTTPError 403") and f"{TOOL_ONLY!r} is not allowed" in tool_only
    assert _Origin.seen == [f"{GRANTED}:{harness.port} /from-net.mixed"]
    # The proxy variables of a run's sandbox, pointing at the call's own bridge.
    proxy = f"http://127.0.0.1:{EGRESS_PROXY_PORT}"
    assert report["env"]["HTTP_PROXY"] == proxy and report["env"]["https_proxy"] == proxy
    assert report["egress_socket"] is True and report["interfaces"] == ["lo"]
    # The run's own proxy still allows RUN_ONLY: the tool did not share it.
    result = await harness.daemon.runs.exec(
        harness.run.run_id,
        ["curl", "-sS", "--max-time", "10", f"http://{RUN_ONLY}:{harness.port}/from-run"],
        timeout_s=20,
    )
    assert result.stdout == f"hello from the origin, as {RUN_ONLY}".encode(), result.stderr


async def test_every_connection_is_audited_as_the_runs_egress_naming_the_tool_and_call(
    harness: Harness,
) -> None:
    await harness.probe("net.mixed", GRANTED, RUN_ONLY)
    entries = await harness.entries()
    call = next(e for e in entries if e.get("tool") == "net.mixed" and e.get("phase") != "started")
    call_id = call["toolCallId"]
    egress = [e for e in entries if e.get("event") in ("egress", "egress_opened")]
    summary = [
        (
            e["event"],
            e["runId"],
            e["detail"]["domain"],
            e["detail"].get("verdict"),
            e["detail"]["tool"],
            e["detail"]["toolCallId"],
        )
        for e in egress
    ]
    run_id = harness.run.run_id
    # The allowed connection's entry is written when it closes, the denied one at once:
    # under load the proxy may see the close after the second request.
    assert summary[0] == ("egress_opened", run_id, GRANTED, None, "net.mixed", call_id)
    assert sorted(summary[1:], key=str) == sorted(
        [
            ("egress", run_id, GRANTED, "allowed", "net.mixed", call_id),
            ("egress", run_id, RUN_ONLY, "denied", "net.mixed", call_id),
        ],
        key=str,
    )
    [allowed] = [e for e in egress[1:] if e["detail"]["verdict"] == "allowed"]
    [denied] = [e for e in egress[1:] if e["detail"]["verdict"] == "denied"]
    assert allowed["detail"]["bytesDown"] > 0
    assert denied["errorCode"] == "policy_denied"


async def test_a_required_domain_the_run_lacks_is_refused_before_the_call(
    harness: Harness,
) -> None:
    response = await harness.call("net.needs", port=harness.port, urls=[])
    assert not response.ok and response.errorCode is ErrorCode.POLICY_DENIED
    assert response.safeMessage and TOOL_ONLY in response.safeMessage
    assert not leftover_sockets(harness.run)
    entries = await harness.entries()
    assert not [e for e in entries if e.get("event") in ("egress", "egress_opened")]


async def test_a_call_granted_no_domain_gets_no_proxy_at_all(harness: Harness) -> None:
    report = await harness.probe("net.optonly", TOOL_ONLY)
    fetched = report["fetch"][f"http://{TOOL_ONLY}:{harness.port}/from-net.optonly"]
    # No proxy variable, so urllib resolves the name itself, and cannot (no network).
    assert fetched.startswith("URLError"), fetched
    assert report["env"] == {} and report["egress_socket"] is False
    assert _Origin.seen == []


# --- nothing else ------------------------------------------------------------------------


async def test_direct_connections_and_the_runs_model_endpoint_are_out_of_reach(
    harness: Harness,
) -> None:
    # The run itself reaches its model endpoint: the probe below is meaningful.
    listed = await harness.daemon.runs.exec(
        harness.run.run_id,
        ["curl", "-sS", "--max-time", "10", f"http://127.0.0.1:{MODEL_ENDPOINT_PORT}/v1/models"],
        timeout_s=20,
    )
    assert b"assistant" in listed.stdout, listed.stderr
    report = await harness.probe(
        "net.mixed",
        GRANTED,
        direct=True,
        host=GRANTED,
        run_only=RUN_ONLY,
        host_ip=host_address(),
        model_port=MODEL_ENDPOINT_PORT,
    )
    assert report["fetch"][f"http://{GRANTED}:{harness.port}/from-net.mixed"].startswith("ok:")
    # A tunnel (CONNECT, as for https) through the call's proxy: the same intersection.
    assert report["connect_granted"] == "ok: 'HTTP/1.1 200 Connection established'"
    assert report["connect_run_only"] == "ok: 'HTTP/1.1 403 Forbidden'", report
    # No way out but the proxy.
    assert report["unproxied"].startswith("URLError"), report["unproxied"]
    assert report["tcp_origin_loopback"].startswith("ConnectionRefusedError")
    assert report["tcp_host_address"].startswith("OSError: [Errno 101]"), report
    assert report["dns"].startswith("gaierror"), report["dns"]
    assert report["model_endpoint"].startswith("ConnectionRefusedError"), report
    assert report["model_endpoint_http"].startswith("URLError"), report


async def test_the_calls_proxy_and_bridge_are_gone_after_the_call(harness: Harness) -> None:
    await harness.probe("net.mixed", GRANTED)
    assert leftover_sockets(harness.run) == []
    # The bridge ran beside the tool, in its sandbox; neither outlives the call.
    sandbox = harness.run.sandbox
    assert sandbox is not None
    assert processes_of(sandbox.user.uid, "/tool/probe.py") == []
    assert processes_of(sandbox.user.uid, "cogni-tool") != []  # the run's own services live
    # A second call gets a fresh socket, served as the first was.
    report = await harness.probe("net.mixed", GRANTED)
    assert report["fetch"][f"http://{GRANTED}:{harness.port}/from-net.mixed"].startswith("ok:")
    assert leftover_sockets(harness.run) == []


# --- the call's proxy itself -------------------------------------------------------------


def call_context(harness: Harness) -> ToolContext:
    run = harness.run
    return ToolContext(
        run_id=run.run_id,
        grants=(),
        max_output_bytes=100_000,
        tool_call_id="direct-1",
        network=run.spec.policy.network,
        sandbox=run.sandbox,
        timeout_s=20,
    )


async def test_a_proxy_that_cannot_start_is_tool_failed_and_the_tool_never_runs(
    harness: Harness, base: Path
) -> None:
    def broken(
        *, ctx: ToolContext, tool: str, network: NetworkSection, socket: Path
    ) -> AbstractAsyncContextManager[None]:
        raise OSError(f"no room for {socket}")

    tool = folder_tool(
        "net.direct", base / "tools" / "net-mixed", network=(NameNeed(name=GRANTED),)
    )
    runner = ProcessToolRunner(tool, egress=broken)
    with capture_logs() as logs, pytest.raises(ToolFailed, match="network proxy could not be"):
        await runner.run({"port": harness.port, "urls": []}, call_context(harness))
    assert [e["error"] for e in logs if e["event"] == "process_tool_egress_failed"]
    assert _Origin.seen == []


async def test_the_calls_socket_serves_no_process_outside_a_calls_sandbox(
    harness: Harness,
) -> None:
    """The host (this test, root) and the run's own sandbox (the run's network namespace)
    are refused by the call's proxy, audited; only a call's sandbox is served."""
    sandbox = harness.run.sandbox
    assert sandbox is not None
    socket_path = sandbox.call_egress_socket()
    net = harness.run.spec.policy.network.model_copy(update={"allow_domains": (GRANTED,)})
    proxies = CallEgressProxies(
        audit=harness.daemon.audit, resolve=resolve_host, reply_after_result=True
    )
    async with proxies(
        ctx=call_context(harness), tool="net.direct", network=net, socket=socket_path
    ):
        assert stat.S_IMODE(socket_path.stat().st_mode) == 0o660
        assert socket_path.stat().st_gid == sandbox.user.gid
        stream = await trio.open_unix_socket(str(socket_path))
        async with stream:
            head = f"GET http://{GRANTED}:{harness.port}/x HTTP/1.1\r\nHost: {GRANTED}\r\n\r\n"
            await stream.send_all(head.encode())
            answer = await stream.receive_some(4096)
    assert answer.startswith(b"HTTP/1.1 403"), answer
    assert b"only processes inside its run's sandbox" in answer
    assert not socket_path.exists()
    refused = [e for e in await harness.entries() if e.get("event") == "egress"][-1]
    assert refused["errorCode"] == "authz_denied"
    assert refused["detail"]["tool"] == "net.direct"
    assert _Origin.seen == []
