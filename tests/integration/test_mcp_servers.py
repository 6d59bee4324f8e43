"""Declared MCP servers run by gatewayd (gatewayd/mcp/servers.py), through the real
sandbox: each instance a run of its own (its uid, its network namespace), its stdio the
MCP session. The server is tests/mcp_servers/misbehaving_server.py (system python3,
standard library) or a real one from PyPI (mcp-server-time, with the virtualenv bound
read-only)."""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import sys
import tempfile
import textwrap
import threading
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from ipaddress import IPv4Address, IPv6Address, ip_address
from pathlib import Path
from typing import Any

import pytest
import trio

from gatewayd.config import GatewaydConfig, SandboxUids
from gatewayd.daemon import Daemon, open_daemon
from gatewayd.dialer import Resolver
from gatewayd.errors import ToolFailed, ToolTimedOut
from gatewayd.mcp.servers import McpServers
from gatewayd.protocol import ErrorCode
from gatewayd.runs import Grant, Run, RunLimits, RunRequest
from gatewayd.sandbox.uids import pids_of_uid

PY = "/usr/bin/python3"
SERVERS_DIR = Path(__file__).resolve().parent.parent / "mcp_servers"
SERVER = str(SERVERS_DIR / "misbehaving_server.py")
VENV = Path(sys.prefix)
SITE_PACKAGES = (
    VENV / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
)
SECRET = "COGNI_TEST_MCP_TOKEN"
OUTSIDE_V4 = "198.51.100.1"  # TEST-NET-2 (RFC 5737): never routed anywhere

CALLER_POLICY = """
version: 1
name: mcp-caller
tools:
  allow: [time.now]
filesystem:
  paths:
    workspace: {root: ., mode: rw}
    docs: {root: docs, mode: ro}
limits: {calls_per_second: 1000, burst: 1000}
sandbox: {timeout_s: 30, cpu_s: 20, max_processes: 48}
"""


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "sandboxed runs need root (network namespaces, a uid per run)"
    if not os.path.exists("/usr/bin/bwrap") or not os.path.exists(PY):
        return "needs bubblewrap at /usr/bin/bwrap and the system python3"
    return None


pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))


def server(*switches: str, **fields: Any) -> dict[str, Any]:
    """A declaration of the misbehaving server with ``switches``."""
    return {
        "command": [PY, "-I", SERVER, *switches],
        "read_only_paths": [str(SERVERS_DIR)],
        "call_timeout_s": 10,
        **fields,
    }


class Mcp:
    def __init__(self, daemon: Daemon, base: Path) -> None:
        self.daemon = daemon
        self.base = base
        self.servers: McpServers = daemon.mcp_servers

    def workspace(self) -> Path:
        ws = self.base / f"ws-{secrets.token_hex(3)}"
        (ws / "docs").mkdir(parents=True)
        (ws / "docs" / "guide.md").write_text("# guide\n")
        (ws / "notes.md").write_text("notes\n")
        return ws

    async def run(self, policy: str = CALLER_POLICY) -> Run:
        path = self.base / f"policy-{secrets.token_hex(4)}.yaml"
        path.write_text(textwrap.dedent(policy))
        request = RunRequest(
            workspacePath=str(self.workspace()),
            policy=str(path),
            actorId="tester",
            tenantId="t1",
            grant=Grant(allowSandbox=True),
            limits=RunLimits(maxMemoryMb=1024),
        )
        return await self.daemon.runs.start(request, policy_paths=True)

    async def call(self, name: str, tool: str, caller: Run, /, **args: Any) -> str:
        result = await self.servers.call_tool(name, tool, args, caller=caller, timeout_s=30)
        return "".join(block.get("text", "") for block in result.content)


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-mcp-", dir="/tmp"))
    path.chmod(0o711)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def config(base: Path, servers: dict[str, Any]) -> GatewaydConfig:
    return GatewaydConfig.model_validate(
        {
            "state_dir": str(base / "state"),
            "policy_dirs": [str(base)],
            "netns_prefix": f"cgm{secrets.token_hex(4)}-",
            "sandbox_uids": SandboxUids(
                base=1_700_000_000 + secrets.randbelow(50_000) * 1024, count=64
            ).model_dump(),
            "audit_fsync": False,
            "mcp_servers": servers,
        }
    )


def gateway(base: Path, servers: dict[str, Any], resolver: Resolver | None = None) -> Any:
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def cm() -> AsyncIterator[Mcp]:
        async with open_daemon(config(base, servers), preload=True, resolver=resolver) as daemon:
            assert daemon.runs.support.available, daemon.runs.support.reason
            yield Mcp(daemon, base)

    return cm()


# --- start, list, call --------------------------------------------------------------------


async def test_a_server_starts_on_the_first_call_in_a_sandbox_of_its_own(base: Path) -> None:
    async with gateway(base, {"misc": server("--page-size", "3")}) as mcp:
        caller = await mcp.run()
        assert mcp.servers.instance_run("misc", caller=caller) is None  # lazily
        tools = await mcp.servers.list_tools("misc", caller=caller)
        # Every page of tools/list, in the server's words.
        assert {t.name for t in tools} >= {"echo", "crash", "hang", "flood", "read"}
        echo = next(t for t in tools if t.name == "echo")
        assert echo.description == "Echo the text back."
        assert echo.input_schema["required"] == ["text"]
        instance = mcp.servers.instance_run("misc", caller=caller)
        assert instance is not None and instance.sandbox is not None
        assert caller.sandbox is not None
        # Its own run: a child of the caller, its own uid and network namespace.
        assert instance.spec.parent_run_id == caller.run_id
        assert instance.sandbox.user.uid != caller.sandbox.user.uid
        assert instance.sandbox.netns_id != caller.sandbox.netns_id
        assert await mcp.call("misc", "echo", caller, text="hi") == "hi"
        # One instance serves the caller's next calls.
        assert await mcp.call("misc", "echo", caller, text="again") == "again"
        assert mcp.servers.instance_run("misc", caller=caller) is instance
        created = [
            e
            for e in await _entries(mcp)
            if e.get("event") == "run_created" and e["runId"] == instance.run_id
        ]
        assert created[0]["detail"]["mcpServer"] == "misc"
        assert created[0]["detail"]["parentRunId"] == caller.run_id


async def test_a_shared_server_serves_every_run_from_one_instance(base: Path) -> None:
    async with gateway(base, {"misc": server(share="shared")}) as mcp:
        a, b = await mcp.run(), await mcp.run()
        assert await mcp.call("misc", "echo", a, text="a") == "a"
        assert await mcp.call("misc", "echo", b, text="b") == "b"
        instance = mcp.servers.instance_run("misc", caller=a)
        assert instance is not None and instance is mcp.servers.instance_run("misc", caller=b)
        assert instance.spec.parent_run_id is None
        # Its workspace is an empty one of its own: no run's files.
        listing = await mcp.call("misc", "read", a, path="/workspace/notes.md")
        assert "No such file" in listing


async def test_per_run_servers_stop_with_their_run_leaving_no_process(base: Path) -> None:
    async with gateway(base, {"misc": server()}) as mcp:
        caller = await mcp.run()
        assert await mcp.call("misc", "echo", caller, text="x") == "x"
        instance = mcp.servers.instance_run("misc", caller=caller)
        assert instance is not None and instance.sandbox is not None
        uid = instance.sandbox.user.uid
        assert pids_of_uid(uid) != []
        await mcp.daemon.runs.end(caller.run_id)
        assert pids_of_uid(uid) == []
        assert mcp.daemon.registry.get(instance.run_id) is None
        ended = [
            e
            for e in await _entries(mcp)
            if e.get("event") == "run_ended" and e["runId"] == instance.run_id
        ]
        assert ended and ended[0]["detail"]["reason"] == "mcp_server_stopped"


async def test_every_instance_stops_with_the_daemon(base: Path) -> None:
    async with gateway(base, {"misc": server(share="shared")}) as mcp:
        caller = await mcp.run()
        await mcp.call("misc", "echo", caller, text="x")
        instance = mcp.servers.instance_run("misc", caller=caller)
        assert instance is not None and instance.sandbox is not None
        uid = instance.sandbox.user.uid
    assert pids_of_uid(uid) == []


# --- misbehaviour ----------------------------------------------------------------------


async def test_a_crashed_server_fails_the_call_and_the_next_call_starts_it_again(
    base: Path,
) -> None:
    async with gateway(base, {"misc": server("--crash-after", "2")}) as mcp:
        caller = await mcp.run()
        assert await mcp.call("misc", "echo", caller, text="1") == "1"
        first = mcp.servers.instance_run("misc", caller=caller)
        with pytest.raises(ToolFailed) as crashed:
            await mcp.call("misc", "echo", caller, text="2")
        assert crashed.value.code is ErrorCode.TOOL_FAILED
        assert "'misc'" in str(crashed.value) and "next call starts it again" in str(crashed.value)
        # A fresh instance (a fresh run) answers the next call.
        assert await mcp.call("misc", "echo", caller, text="3") == "3"
        second = mcp.servers.instance_run("misc", caller=caller)
        assert second is not None and second is not first


async def test_a_server_that_keeps_crashing_backs_off(base: Path) -> None:
    async with gateway(base, {"misc": server("--exit-at-start")}) as mcp:
        caller = await mcp.run()
        with pytest.raises(ToolFailed) as first:
            await mcp.call("misc", "echo", caller, text="x")
        # The start's failure says what happened, with the server's last words.
        assert "handshake" in str(first.value), first.value
        assert "told to exit at start" in str(first.value)
        with pytest.raises(ToolFailed):
            await mcp.call("misc", "echo", caller, text="x")
        # Two in a row: the next start waits; a call meanwhile is refused at once.
        with trio.fail_after(1):
            with pytest.raises(ToolFailed) as waiting:
                await mcp.call("misc", "echo", caller, text="x")
        assert "2 times in a row" in str(waiting.value)
        assert "next start is allowed in" in str(waiting.value)


async def test_a_hung_call_times_out_and_the_next_call_works(base: Path) -> None:
    async with gateway(base, {"misc": server()}) as mcp:
        caller = await mcp.run()
        assert await mcp.call("misc", "echo", caller, text="x") == "x"
        hung = mcp.servers.instance_run("misc", caller=caller)
        assert hung is not None and hung.sandbox is not None
        with trio.fail_after(10):
            with pytest.raises(ToolTimedOut) as timed_out:
                await mcp.servers.call_tool("misc", "hang", {}, caller=caller, timeout_s=1)
        assert timed_out.value.code is ErrorCode.TIMEOUT
        assert "within 1 s" in str(timed_out.value) and "stopped" in str(timed_out.value)
        assert pids_of_uid(hung.sandbox.user.uid) == []  # the hung instance is gone
        assert await mcp.call("misc", "echo", caller, text="y") == "y"


async def test_a_listed_server_answers_its_tools_without_a_request_or_a_guard(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every call's pin check reads the tool list: once listed, it comes from the
    session's cache, with no request and no deadline; only the call itself is guarded."""
    async with gateway(base, {"misc": server()}) as mcp:
        caller = await mcp.run()
        listed = await mcp.servers.list_tools("misc", caller=caller)
        guarded: list[str] = []
        guard = mcp.servers._guarded

        async def spy(instance: Any, pending: Any, limit: float, what: str) -> Any:
            guarded.append(what)
            return await guard(instance, pending, limit, what)

        monkeypatch.setattr(mcp.servers, "_guarded", spy)
        assert await mcp.servers.list_tools("misc", caller=caller) is listed
        assert await mcp.call("misc", "echo", caller, text="x") == "x"
        assert guarded == ["tools/call echo"]


async def test_calls_waiting_on_a_stopped_instance_answer_at_once(base: Path) -> None:
    async with gateway(base, {"misc": server()}) as mcp:
        caller = await mcp.run()
        await mcp.call("misc", "echo", caller, text="x")
        waiting: list[BaseException] = []

        async def unanswered() -> None:
            try:
                await mcp.servers.call_tool("misc", "ignore", {}, caller=caller, timeout_s=60)
            except ToolFailed as exc:
                waiting.append(exc)

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(unanswered)
                await trio.sleep(0.2)
                with pytest.raises(ToolTimedOut):
                    await mcp.servers.call_tool("misc", "hang", {}, caller=caller, timeout_s=1)
        assert len(waiting) == 1 and "was stopped (mcp_server_timeout)" in str(waiting[0])


async def test_first_calls_arriving_together_share_one_start(base: Path) -> None:
    async with gateway(base, {"misc": server()}) as mcp:
        caller = await mcp.run()
        said: list[str] = []

        async def one(i: int) -> None:
            said.append(await mcp.call("misc", "echo", caller, text=str(i)))

        async with trio.open_nursery() as nursery:
            for i in range(5):
                nursery.start_soon(one, i)
        assert sorted(said) == ["0", "1", "2", "3", "4"]
        created = [
            e
            for e in await _entries(mcp)
            if e.get("event") == "run_created" and "mcpServer" in e["detail"]
        ]
        assert len(created) == 1


@pytest.mark.parametrize(
    ("tool", "said"),
    [("flood", "flooded its stdout"), ("garbage", "not JSON-RPC messages")],
)
async def test_a_server_flooding_its_stdout_is_stopped(base: Path, tool: str, said: str) -> None:
    async with gateway(base, {"misc": server()}) as mcp:
        caller = await mcp.run()
        await mcp.call("misc", "echo", caller, text="x")
        instance = mcp.servers.instance_run("misc", caller=caller)
        assert instance is not None and instance.sandbox is not None
        with trio.fail_after(20):
            with pytest.raises(ToolFailed) as flooded:
                await mcp.servers.call_tool("misc", tool, {}, caller=caller, timeout_s=15)
        assert said in str(flooded.value)
        assert pids_of_uid(instance.sandbox.user.uid) == []
        assert await mcp.call("misc", "echo", caller, text="after") == "after"


async def test_stderr_is_kept_bounded_for_diagnostics(base: Path) -> None:
    async with gateway(base, {"misc": server("--stderr", "starting up")}) as mcp:
        caller = await mcp.run()
        await mcp.call("misc", "stderr", caller, text="E" * 40_000 + " the end")
        tail = b""
        with trio.fail_after(5):
            while not tail.endswith(b" the end\n"):
                await trio.sleep(0.01)
                tail = mcp.servers.stderr_tail("misc", caller=caller)
        assert len(tail) == 16 * 1024  # STDERR_TAIL_BYTES: the last of it, never all


async def test_a_changed_tool_list_is_read_again(base: Path) -> None:
    async with gateway(base, {"misc": server()}) as mcp:
        caller = await mcp.run()
        before = {t.name: t for t in await mcp.servers.list_tools("misc", caller=caller)}
        await mcp.call("misc", "change", caller)
        with trio.fail_after(5):
            while True:
                after = {t.name: t for t in await mcp.servers.list_tools("misc", caller=caller)}
                if after["echo"].description != before["echo"].description:
                    break
                await trio.sleep(0.01)
        assert "evil.example" in after["echo"].description


async def test_an_unknown_tool_is_the_servers_refusal(base: Path) -> None:
    async with gateway(base, {"misc": server()}) as mcp:
        caller = await mcp.run()
        with pytest.raises(ToolFailed) as refused:
            await mcp.call("misc", "nope", caller)
        assert "answered tools/call nope with an error" in str(refused.value)
        assert "Unknown tool: nope" in str(refused.value)
        assert await mcp.call("misc", "echo", caller, text="ok") == "ok"  # still serving


# --- what the sandbox lets it do ------------------------------------------------------------


async def test_a_server_has_no_network_without_egress_domains(base: Path) -> None:
    async with gateway(base, {"misc": server()}) as mcp:
        caller = await mcp.run()
        said = await mcp.call("misc", "connect", caller, host=OUTSIDE_V4, port=443)
        assert said.startswith("error:") and "unreachable" in said.lower(), said


@pytest.fixture
def origin() -> Iterator[int]:
    """An HTTP origin on loopback answering every GET with "hello from the origin"."""

    class Hello(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"hello from the origin"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


async def resolve(host: str, _port: int) -> tuple[IPv4Address | IPv6Address, ...]:
    # Every name is the loopback origin: only the egress proxy's allowlist tells them apart.
    return (ip_address("127.0.0.1"),)


async def test_egress_domains_are_reached_through_the_proxy_and_nothing_else(
    base: Path, origin: int
) -> None:
    servers = {
        "misc": server(
            egress_domains=["api.example.org"],
            egress_ports=[origin],
            egress_allow_private=["api.example.org", "other.example.net"],
        )
    }
    async with gateway(base, servers, resolver=resolve) as mcp:
        caller = await mcp.run()
        said = await mcp.call("misc", "fetch", caller, url=f"http://api.example.org:{origin}/")
        assert said == "200 hello from the origin", said
        # A domain off the list: the proxy refuses it, saying what is allowed.
        said = await mcp.call("misc", "fetch", caller, url=f"http://other.example.net:{origin}/")
        assert said.startswith("error: 403") and "api.example.org" in said, said
        # Around the proxy: no route out of its namespace.
        said = await mcp.call("misc", "connect", caller, host=OUTSIDE_V4, port=443)
        assert said.startswith("error:"), said
        instance = mcp.servers.instance_run("misc", caller=caller)
        assert instance is not None
        egress = [
            e
            for e in await _entries(mcp)
            if e.get("runId") == instance.run_id and "egress" in str(e.get("event", ""))
        ]
        assert egress, "the proxy's connections are audited under the server's run"


async def test_a_server_reads_only_the_paths_it_was_given(base: Path) -> None:
    servers = {"misc": server(workspace_paths=[{"path": "docs", "mode": "ro"}])}
    async with gateway(base, servers) as mcp:
        caller = await mcp.run()
        assert await mcp.call("misc", "read", caller, path="/workspace/docs/guide.md") == (
            "# guide\n"
        )
        # The rest of the caller's workspace, the host's files, gatewayd's state: unseen.
        for path in ("/workspace/notes.md", "/etc/shadow", str(base / "state" / "audit")):
            said = await mcp.call("misc", "read", caller, path=path)
            assert said.startswith("error:"), (path, said)


async def test_a_server_never_gets_more_than_its_caller(base: Path) -> None:
    # The server asks for docs rw; the caller may only read docs: the server reads it.
    servers = {"misc": server(workspace_paths=[{"path": "docs", "mode": "rw"}])}
    async with gateway(base, servers) as mcp:
        caller = await mcp.run()
        said = await mcp.call("misc", "write", caller, path="/workspace/docs/new.md", text="x")
        assert said.startswith("error:") and "Read-only" in said, said
        assert not (caller.spec.workspace / "docs" / "new.md").exists()


async def test_a_path_the_caller_cannot_read_is_refused_saying_so(base: Path) -> None:
    policy = CALLER_POLICY.replace("    workspace: {root: ., mode: rw}\n", "")
    servers = {"misc": server(workspace_paths=[{"path": ".", "mode": "ro"}])}
    async with gateway(base, servers) as mcp:
        caller = await mcp.run(policy)
        with pytest.raises(ToolFailed) as refused:
            await mcp.call("misc", "echo", caller, text="x")
        message = str(refused.value)
        assert "workspace path '.'" in message and "may not read" in message
        assert "/workspace/docs (ro)" in message  # what the caller does hold


async def test_secrets_reach_the_server_and_are_scrubbed_from_results(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    value = "tok-" + secrets.token_hex(12)
    monkeypatch.setenv(SECRET, value)
    servers = {"misc": server(secret_env=[SECRET], env={"PLAIN": "visible"})}
    async with gateway(base, servers) as mcp:
        caller = await mcp.run()
        assert await mcp.call("misc", "env", caller, name="PLAIN") == "visible"
        said = await mcp.call("misc", "env", caller, name=SECRET)
        assert value not in said and said == f"[REDACTED:{SECRET}]"


async def test_a_missing_secret_refuses_the_start_naming_it(base: Path) -> None:
    servers = {"misc": server(secret_env=["COGNI_TEST_MCP_ABSENT"])}
    async with gateway(base, servers) as mcp:
        caller = await mcp.run()
        with pytest.raises(ToolFailed) as refused:
            await mcp.call("misc", "echo", caller, text="x")
        assert "COGNI_TEST_MCP_ABSENT" in str(refused.value)
        assert "is not set" in str(refused.value)


# --- a real server from PyPI ----------------------------------------------------------------


async def test_mcp_server_time_from_pypi_lists_its_tools_in_the_sandbox(base: Path) -> None:
    if not (SITE_PACKAGES / "mcp_server_time").is_dir():
        pytest.skip("mcp-server-time is not installed in this virtualenv (the dev extra)")
    # The virtualenv's own interpreter may live where no sandbox sees it (a pyenv build
    # under /root): the system python3 of the same version runs its packages.
    servers = {
        "time": {
            "command": [PY, "-m", "mcp_server_time", "--local-timezone", "UTC"],
            "read_only_paths": [str(VENV)],
            "env": {"PYTHONPATH": str(SITE_PACKAGES)},
            "share": "shared",
            "start_timeout_s": 60,
        }
    }
    async with gateway(base, servers) as mcp:
        tools = await mcp.servers.list_tools("time", caller=None)
        assert {t.name for t in tools} >= {"get_current_time", "convert_time"}
        caller = await mcp.run()
        result = await mcp.servers.call_tool(
            "time", "get_current_time", {"timezone": "UTC"}, caller=caller, timeout_s=30
        )
        assert not result.is_error and "UTC" in str(result.content)


async def _entries(mcp: Mcp) -> list[dict[str, Any]]:
    import json

    await mcp.daemon.audit.durable(mcp.daemon.audit.last_seq)
    path = mcp.daemon.config.resolved_audit_path
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def pypi_server(module: str, *args: str, **fields: Any) -> dict[str, Any]:
    """A server from PyPI, installed in this virtualenv, run by the system python3."""
    if not (SITE_PACKAGES / module).is_dir():
        pytest.skip(f"{module} is not installed in this virtualenv (the dev extra)")
    env = {"PYTHONPATH": str(SITE_PACKAGES), **fields.pop("env", {})}
    return {
        "command": [PY, "-m", module, *args],
        "read_only_paths": [str(VENV)],
        "env": env,
        "start_timeout_s": 60,
        "call_timeout_s": 30,
        **fields,
    }


async def test_mcp_server_git_from_pypi_reads_a_repository_of_the_callers_workspace(
    base: Path,
) -> None:
    servers = {
        "git": pypi_server(
            "mcp_server_git",
            workspace_paths=[{"path": "repo", "mode": "ro"}],
            # The repository is the workspace owner's, not the sandbox user's: git's
            # ownership check would refuse it.
            env={
                "GIT_CONFIG_COUNT": "1",
                "GIT_CONFIG_KEY_0": "safe.directory",
                "GIT_CONFIG_VALUE_0": "*",
            },
        )
    }
    async with gateway(base, servers) as mcp:
        caller = await mcp.run()
        repo = caller.spec.workspace / "repo"
        repo.mkdir()
        for command in (
            ["git", "init", "-q", "-b", "main"],
            ["git", "-c", "user.name=t", "-c", "user.email=t@example.org", "commit", "-q",
             "--allow-empty", "-m", "first"],
        ):  # fmt: skip
            await trio.run_process(command, cwd=repo)
        (repo / "new.txt").write_text("untracked\n")
        tools = {t.name for t in await mcp.servers.list_tools("git", caller=caller)}
        assert {"git_status", "git_log", "git_commit"} <= tools
        said = await mcp.call("git", "git_status", caller, repo_path="/workspace/repo")
        assert "new.txt" in said, said
        # The workspace is read-only for it: staging a file fails (EROFS).
        result = await mcp.servers.call_tool(
            "git", "git_add", {"repo_path": "/workspace/repo", "files": ["new.txt"]},
            caller=caller, timeout_s=30,
        )  # fmt: skip
        assert result.is_error, result
        assert "Read-only file system" in str(result.content), result.content


async def test_mcp_server_fetch_from_pypi_goes_through_the_egress_proxy(
    base: Path, origin: int
) -> None:
    servers = {
        "fetch": pypi_server(
            "mcp_server_fetch",
            "--ignore-robots-txt",
            egress_domains=["api.example.org"],
            egress_ports=[origin],
            egress_allow_private=["api.example.org"],
        )
    }
    async with gateway(base, servers, resolver=resolve) as mcp:
        caller = await mcp.run()
        assert "fetch" in {t.name for t in await mcp.servers.list_tools("fetch", caller=caller)}
        said = await mcp.call(
            "fetch", "fetch", caller, url=f"http://api.example.org:{origin}/", raw=True
        )
        assert "hello from the origin" in said, said
        refused = await mcp.servers.call_tool(
            "fetch", "fetch", {"url": f"http://elsewhere.example.net:{origin}/", "raw": True},
            caller=caller, timeout_s=30,
        )  # fmt: skip
        assert refused.is_error and "hello from the origin" not in str(refused.content)
        assert "403" in str(refused.content), refused.content  # the proxy refused it


RULED_POLICY = CALLER_POLICY.replace(
    "    docs: {root: docs, mode: ro}\n", "    docs: {root: docs, mode: ro, suffixes: [.md]}\n"
)


@pytest.mark.parametrize(
    ("policy", "paths", "prepare", "said"),
    [
        # rw asked, and the caller may write it: its sandbox holds the tree.
        (CALLER_POLICY, [{"path": ".", "mode": "rw"}], None, "cannot be lent to a server's"),
        # The caller reads it only under a suffix rule, which a mount cannot keep.
        (RULED_POLICY, [{"path": "docs"}], None, "only under suffix or size rules"),
        # A symlink in the workspace leading out of it.
        (CALLER_POLICY, [{"path": "out"}], "symlink", "leads out of the calling run's workspace"),
        (CALLER_POLICY, [{"path": "absent"}], None, "No such file or directory"),
        (CALLER_POLICY, [{"path": "notes.md"}], None, "is not a directory; declare directories"),
    ],
)
async def test_a_workspace_path_the_server_may_not_have_refuses_its_start(
    base: Path, policy: str, paths: list[dict[str, str]], prepare: str | None, said: str
) -> None:
    async with gateway(base, {"misc": server(workspace_paths=paths)}) as mcp:
        caller = await mcp.run(policy)
        if prepare == "symlink":
            (caller.spec.workspace / "out").symlink_to("/etc")
        with pytest.raises(ToolFailed) as refused:
            await mcp.call("misc", "echo", caller, text="x")
        assert refused.value.code is ErrorCode.TOOL_FAILED
        assert "MCP server 'misc'" in str(refused.value) and said in str(refused.value)
        assert mcp.servers.instance_run("misc", caller=caller) is None  # nothing started


async def test_a_missing_read_only_path_refuses_the_start_naming_it(base: Path) -> None:
    missing = str(base / "no-venv")
    async with gateway(base, {"misc": server(read_only_paths=[str(SERVERS_DIR), missing])}) as mcp:
        caller = await mcp.run()
        with pytest.raises(ToolFailed) as refused:
            await mcp.call("misc", "echo", caller, text="x")
        assert f"read_only_paths entry {missing!r}" in str(refused.value)


async def test_a_missing_program_refuses_the_start_with_what_bwrap_said(base: Path) -> None:
    async with gateway(base, {"misc": server() | {"command": ["/opt/nothing/here"]}}) as mcp:
        caller = await mcp.run()
        with pytest.raises(ToolFailed) as refused:
            await mcp.call("misc", "echo", caller, text="x")
        message = str(refused.value)
        assert "before the MCP handshake completed" in message
        assert "/opt/nothing/here" in message and "No such file" in message


async def test_a_server_that_never_answers_the_handshake_times_out_its_start(
    base: Path,
) -> None:
    silent = {"command": [PY, "-c", "import time; time.sleep(60)"], "start_timeout_s": 1}
    async with gateway(base, {"misc": server() | silent}) as mcp:
        caller = await mcp.run()
        with trio.fail_after(10), pytest.raises(ToolFailed) as refused:
            await mcp.call("misc", "echo", caller, text="x")
        assert "did not complete the MCP handshake within 1 s (start_timeout_s)" in str(
            refused.value
        )


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def test_a_remote_server_is_reached_over_streamable_http(base: Path) -> None:
    port = free_port()
    async with trio.open_nursery() as nursery:
        process = await nursery.start(
            functools.partial(
                trio.run_process,
                [sys.executable, str(SERVERS_DIR / "http_server.py"), str(port)],
                check=False,
            )
        )
        try:
            with trio.fail_after(30):
                while True:
                    try:
                        await (await trio.open_tcp_stream("127.0.0.1", port)).aclose()
                        break
                    except OSError:
                        await trio.sleep(0.05)
            servers = {"far": {"url": f"http://127.0.0.1:{port}/mcp", "call_timeout_s": 10}}
            async with gateway(base, servers) as mcp:
                caller = await mcp.run()
                tools = await mcp.servers.list_tools("far", caller=caller)
                assert [t.name for t in tools] == ["echo"]
                assert tools[0].description == "Echo the text back."
                assert await mcp.call("far", "echo", caller, text="over http") == "over http"
                # No run, no sandbox: the server is elsewhere.
                assert mcp.servers.instance_run("far", caller=caller) is None
                process.kill()
                await process.wait()
                with trio.fail_after(20), pytest.raises(ToolFailed) as gone:
                    await mcp.call("far", "echo", caller, text="gone")
                assert "the connection closed" in str(gone.value), gone.value
                assert "the next call starts it again" in str(gone.value)
        finally:
            process.kill()


async def test_a_remote_server_that_is_not_there_refuses_the_call_saying_so(
    base: Path,
) -> None:
    servers = {"far": {"url": f"http://127.0.0.1:{free_port()}/mcp", "start_timeout_s": 5}}
    async with gateway(base, servers) as mcp:
        caller = await mcp.run()
        with trio.fail_after(20), pytest.raises(ToolFailed) as refused:
            await mcp.servers.list_tools("far", caller=caller)
        message = str(refused.value)
        assert "MCP server 'far' could not start" in message and "connect" in message


async def test_a_run_ending_during_its_servers_handshake_stops_it_at_once(base: Path) -> None:
    """A per-run server still in its handshake (start_timeout_s long) when its caller
    ends: the run's end stops it then, not after the start times out, and no process of
    it is left behind its caller."""
    silent = {"command": [PY, "-c", "import time; time.sleep(600)"], "start_timeout_s": 300}
    async with gateway(base, {"misc": server() | silent}) as mcp:
        caller = await mcp.run()
        refused: list[BaseException] = []

        async def first_call() -> None:
            try:
                await mcp.call("misc", "echo", caller, text="x")
            except ToolFailed as exc:
                refused.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(first_call)
            with trio.fail_after(20):
                while (instance := mcp.servers.instance_run("misc", caller=caller)) is None:
                    await trio.sleep(0.05)
            assert instance.sandbox is not None
            uid = instance.sandbox.user.uid
            with trio.fail_after(20):
                while pids_of_uid(uid) == []:  # the program is running, in its handshake
                    await trio.sleep(0.05)
            with trio.fail_after(15):  # well under STOP_WAIT_S and start_timeout_s
                await mcp.daemon.runs.end(caller.run_id)
        assert pids_of_uid(uid) == []
        assert len(refused) == 1
        assert "was stopped before its MCP handshake completed" in str(refused[0])


async def test_a_secret_cut_by_the_stderr_tail_of_a_failed_start_is_not_shown_in_part(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed start's message quotes the end of the server's stderr (to the caller):
    where the cut falls inside a secret the server printed, the part left must not be
    shown either (the tail is scrubbed before it is cut)."""
    value = "tok-" + secrets.token_hex(16)
    monkeypatch.setenv(SECRET, value)
    said_at_exit = "\nmisbehaving server: told to exit at start\n"
    # The quoted tail (the last 256 bytes) starts in the middle of the secret.
    padding = "y" * (256 - len(said_at_exit) - len(value) // 2)
    declared = server("--stderr", value + padding, "--exit-at-start", secret_env=[SECRET])
    async with gateway(base, {"misc": declared}) as mcp:
        caller = await mcp.run()
        with pytest.raises(ToolFailed) as refused:
            await mcp.call("misc", "echo", caller, text="x")
    message = str(refused.value)
    assert "its stderr ends:" in message and padding in message
    assert value[len(value) // 2 :] not in message
    assert value[-8:] not in message


async def test_a_server_given_the_whole_workspace_never_sees_its_apps_folder(base: Path) -> None:
    """`path: .` lends the caller's whole workspace (read-only): its apps folder, every
    app's data, stays covered in the server's sandbox as in every run's, whichever name
    reaches it."""
    servers = {"misc": server(workspace_paths=[{"path": ".", "mode": "ro"}])}
    async with gateway(base, servers) as mcp:
        caller = await mcp.run()
        workspace = caller.spec.workspace
        (workspace / "apps" / "notes" / "data").mkdir(parents=True)
        (workspace / "apps" / "notes" / "data" / "secret.txt").write_text("app data\n")
        (workspace / "via").symlink_to("apps/notes")
        assert await mcp.call("misc", "read", caller, path="/workspace/notes.md") == "notes\n"
        for path in ("/workspace/apps/notes/data/secret.txt", "/workspace/via/data/secret.txt"):
            said = await mcp.call("misc", "read", caller, path=path)
            assert said.startswith("error:"), (path, said)
