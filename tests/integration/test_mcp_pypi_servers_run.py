"""MCP servers from PyPI, started by an MCP client on the host through ``gatewayd run``.

The client is the official Python SDK's (``mcp`` on PyPI: ``stdio_client`` and
``ClientSession``); the servers are the reference servers nobody on the team wrote,
``mcp-server-time``, ``mcp-server-git`` and ``mcp-server-fetch``. The client starts
``gatewayd run --policy P --workspace W -- SERVER`` as its stdio server, the way it would
start SERVER itself: gatewayd relays stdin and stdout, so the client gets SERVER's own
tools, while SERVER runs in a real bubblewrap sandbox (a run's uid, a network namespace
with only its loopback, only the policy's paths).

What a sandboxed server needs to see. The sandbox shows the host's system image (/usr with
/usr/bin/python3), the workspace and the policy's paths, never /root, /home or the host's
/tmp. A virtualenv's programs start its interpreter by the absolute path in their shebang,
so a virtualenv made from the system python (``/usr/bin/python3 -m venv``) runs in the
sandbox once its directory is a policy path (read-only); one made from an interpreter under
/root (pyenv's, like this checkout's .venv) cannot. The tests therefore make such a
virtualenv, whose packages are the dev virtualenv's (its site-packages, one more read-only
policy path, listed in a .pth file: the same packages a ``pip install`` would bring,
without a registry in the test), and console scripts as pip writes them. The same
Python minor version is required for the compiled parts (pydantic-core, lxml) to load.

What is shown: the client gets each server's own tools and answers (the same list as
when it starts the server itself); mcp-server-git works on a repository in the workspace,
reaches no repository outside it (host paths, a planted symlink, ``..``, /etc, /root, this
checkout) and cannot write one the policy makes read-only; mcp-server-fetch cannot reach
an origin on the host's loopback from a network-less sandbox, and with the policy's
egress proxy reaches it only by an allowlisted domain (another gets the proxy's 403, both
audited); a server the sandbox cannot see ends the client's session at once, with
gatewayd's stderr naming it.

Each confinement test has a control: the same server started directly on the host by
the same client does what the sandboxed one cannot, or the same call succeeds where the
policy allows it, so a refusal is the sandbox's, not the server's.
"""

from __future__ import annotations

import http.server
import importlib.metadata
import ipaddress
import json
import shutil
import socket
import string
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, ClassVar, TextIO

import pytest
import trio
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.shared.exceptions import MCPError
from mcp.types import CONNECTION_CLOSED

from gatewayd.audit.verify import verify_file
from tests.conftest import ROOT
from tests.integration.test_run_sandbox import PY, _unavailable
from tests.livedaemon import sandbox_options

SERVERS = ("mcp-server-time", "mcp-server-git", "mcp-server-fetch")


def _skip_reason() -> str | None:
    reason = _unavailable()
    if reason is not None:
        return reason
    probe = subprocess.run(
        [PY, "-c", "import sys; print(sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.stdout.strip() != str(sys.version_info[:2]):
        return (
            f"{PY} is Python {probe.stdout.strip()}, the dev virtualenv {sys.version_info[:2]}: "
            "the servers' compiled packages would not load in the sandbox"
        )
    for server in SERVERS:
        if shutil.which(server, path=str(Path(sys.executable).parent)) is None:
            return f"{server} is not installed (pip install -e '.[dev]')"
    return None


pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))

GATEWAYD = str(Path(sys.executable).parent / "gatewayd")
# Where the sandbox sees the servers' virtualenv (the host's /tmp, where tests make it, is
# the sandbox's own tmpfs: a policy path may not be seen there).
VENV_VISIBLE = "/opt/mcp-venv"
# The dev virtualenv's packages, and where the sandbox sees them (the .pth names that): a
# checkout may lie under /tmp, which the sandbox keeps for its own tmpfs.
SITE_PACKAGES = sysconfig.get_path("purelib")
SITE_VISIBLE = "/opt/mcp-site"

POLICY = """
version: 1
name: pypi-mcp-servers
tools:
  allow: [time.now]
filesystem:
  paths:
    workspace: {root: ., mode: rw}
    server_venv: {root: $venv, mount: $venv_visible, mode: ro}
    server_packages: {root: $site_packages, mount: $site_visible, mode: ro}
$extra_paths
env: {allow: [$env_allow]}
sandbox: {timeout_s: 120, cpu_s: 60}
"""

# What the servers' answers and refusals say; their own texts (mcp-server-fetch's through
# httpx), which the tests check so that a refusal is known to be the expected one.
FETCH_FAILED = "Failed to fetch"
CONNECT_FAILED = "ConnectError"
TOOL_ERROR = "Error executing tool"
# How long a session with a server that cannot start may take to end: gatewayd's start
# and the run's teardown on a loaded 2-core machine.
END_WAIT_S = 60


@pytest.fixture(scope="module")
def server_venv() -> Iterator[Path]:
    """A virtualenv made from the sandbox's python, with the dev virtualenv's packages and
    the servers' console scripts (shebang: the path the sandbox sees it at)."""
    base = Path(tempfile.mkdtemp(prefix="cg-mcp-venv-", dir="/tmp"))
    base.chmod(0o711)  # the run's uid passes through to the bound virtualenv
    venv = base / "venv"
    try:
        subprocess.run([PY, "-m", "venv", "--without-pip", str(venv)], check=True)
        site = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
        (site / "site-packages" / "dev-packages.pth").write_text(SITE_VISIBLE + "\n")
        scripts = importlib.metadata.entry_points(group="console_scripts")
        for server in SERVERS:
            (entry,) = [e for e in scripts if e.name == server]
            script = venv / "bin" / server
            script.write_text(
                f"#!{VENV_VISIBLE}/bin/python\n"
                "import sys\n"
                f"from {entry.module} import {entry.attr}\n"
                f"sys.exit({entry.attr}())\n"
            )
            script.chmod(0o755)
        yield venv
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-mcp-pypi-", dir="/tmp"))
    path.chmod(0o711)  # the sandbox's uid passes through to its workspace and socket
    (path / "ws").mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_argv(
    base: Path,
    venv: Path,
    *command: str,
    extra_paths: str = "",
    env_allow: str = "",
    more_policy: str = "",
) -> list[str]:
    """``gatewayd run`` options for ``command`` in a sandbox of ``base``'s workspace;
    ``extra_paths``: more policy path rules, one a line; ``env_allow``: the host
    variables the command sees, comma-separated; ``more_policy``: more sections."""
    policy = base / "policy.yaml"
    text = string.Template(textwrap.dedent(POLICY)).substitute(
        venv=venv,
        venv_visible=VENV_VISIBLE,
        site_packages=SITE_PACKAGES,
        site_visible=SITE_VISIBLE,
        extra_paths="\n".join(f"    {rule}" for rule in extra_paths.splitlines()),
        env_allow=env_allow,
    )
    policy.write_text(text + more_policy)
    # Mode host: what the servers write (a branch, a file) is looked for in the workspace.
    argv = ["run", "--state-dir", str(base / "state"), "--workspace-mode", "host"]
    argv += sandbox_options()
    return [*argv, "--workspace", str(base / "ws"), "--policy", str(policy), "--", *command]


@asynccontextmanager
async def session(
    command: str, args: list[str], errors: TextIO, env: dict[str, str] | None = None
) -> AsyncIterator[ClientSession]:
    """An initialized SDK session with the stdio server ``command args``; ``env``: more
    variables than the SDK's default few."""
    server = StdioServerParameters(command=command, args=args, env=env)
    async with (
        stdio_client(server, errlog=errors) as (read, write),
        ClientSession(read, write) as client,
    ):
        await client.initialize()
        yield client


def through_gatewayd(
    base: Path, venv: Path, server: str, *args: str, **policy: str
) -> tuple[str, list[str]]:
    """The command and arguments that start ``server`` (one of the venv's console
    scripts) through ``gatewayd run``, as the client's stdio server; ``policy``: the
    policy's additions (:func:`run_argv`)."""
    command = f"{VENV_VISIBLE}/bin/{server}"
    return GATEWAYD, run_argv(base, venv, command, *args, **policy)


def on_the_host(server: str, *args: str) -> tuple[str, list[str]]:
    """The same server started directly on the host: the control."""
    return str(Path(sys.executable).parent / server), list(args)


def wire(model: Any) -> dict[str, Any]:
    """An SDK result as it was on the wire (camelCase)."""
    value: dict[str, Any] = model.model_dump(mode="json", by_alias=True, exclude_none=True)
    return value


def text_of(result: Any) -> str:
    parts = wire(result)["content"]
    assert [p["type"] for p in parts] == ["text"], parts
    return str(parts[0]["text"])


def errlog(base: Path, name: str) -> TextIO:
    return (base / f"{name}.stderr").open("w+")


def gatewayd_said(errors: TextIO) -> str:
    errors.seek(0)
    return errors.read()


def assert_run_ended_cleanly(base: Path, errors: TextIO) -> None:
    """gatewayd's lines went to stderr (never into the MCP stream), the run ended with
    the client's session, its exec was audited, and the log verifies."""
    said = gatewayd_said(errors)
    assert "gatewayd: run " in said and "started" in said, said
    assert "ended: exit 0" in said, said
    log = base / "state" / "audit" / "audit.jsonl"
    entries = [json.loads(line) for line in log.read_text().splitlines() if line]
    (ended,) = [e for e in entries if e.get("event") == "exec_ended"]
    assert ended["detail"]["exitCode"] == 0
    assert ended["detail"]["stdinBytes"] > 0 and ended["detail"]["stdoutBytes"] > 0
    assert verify_file(log).ok


async def test_the_same_host_client_gets_the_runs_tools_and_a_pypi_servers_tools(
    base: Path, server_venv: Path
) -> None:
    # One client, two stdio servers through `gatewayd run`: cogni-tool mcp (the run's
    # gateway tools) and mcp-server-time (its own tools, sandboxed).
    errors = errlog(base, "cogni-tool")
    argv = run_argv(base, server_venv, "cogni-tool", "mcp")
    async with session(GATEWAYD, argv, errors) as client:
        gateway_tools = sorted(t.name for t in (await client.list_tools()).tools)
        now = wire(await client.call_tool("time.now", {}))
    assert gateway_tools == ["time.now"]
    assert now["isError"] is False and now["structuredContent"]["timezone"] == "UTC"
    assert_run_ended_cleanly(base, errors)

    shutil.rmtree(base / "state")  # a fresh daemon and audit log for the second run
    errors = errlog(base, "time")
    # The local zone is named: the server derives it from /etc, and the sandbox's /etc is
    # an allowlist of the host's (its descriptions would say 'UTC', the host's 'Etc/UTC').
    zone = ("--local-timezone", "America/Chicago")
    command, args = through_gatewayd(base, server_venv, "mcp-server-time", *zone)
    async with session(command, args, errors) as client:
        listed = wire(await client.list_tools())
        paris = await client.call_tool("get_current_time", {"timezone": "Europe/Paris"})
        converted = await client.call_tool(
            "convert_time",
            {"source_timezone": "UTC", "time": "12:00", "target_timezone": "Asia/Tokyo"},
        )
        unknown_zone = await client.call_tool("get_current_time", {"timezone": "Mars/Olympus"})
    async with session(*on_the_host("mcp-server-time", *zone), errlog(base, "direct")) as client:
        direct = wire(await client.list_tools())

    # The server's own tools, exactly as it lists them when started directly.
    assert sorted(t["name"] for t in listed["tools"]) == ["convert_time", "get_current_time"]
    assert listed == direct
    assert "Use 'America/Chicago' as local timezone" in json.dumps(listed)
    assert wire(paris)["isError"] is False
    assert wire(paris)["structuredContent"]["timezone"] == "Europe/Paris"
    assert json.loads(text_of(paris))["timezone"] == "Europe/Paris"
    target = wire(converted)["structuredContent"]["target"]
    assert target["timezone"] == "Asia/Tokyo" and target["datetime"].endswith("T21:00:00+09:00")
    assert wire(converted)["structuredContent"]["time_difference"] == "+9.0h"
    # The server's own error, passed through unchanged as an MCP tool error.
    assert wire(unknown_zone)["isError"] is True
    assert "Mars/Olympus" in text_of(unknown_zone)
    assert_run_ended_cleanly(base, errors)


def make_repo(path: Path, message: str) -> None:
    path.mkdir()
    git = ["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    subprocess.run([*git, "init", "-q", "-b", "main"], check=True)
    (path / "README.md").write_text("hello\n")
    subprocess.run([*git, "add", "README.md"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", message], check=True)


async def test_the_git_server_works_on_the_workspace_and_reaches_no_repository_beyond_it(
    base: Path, server_venv: Path
) -> None:
    make_repo(base / "ws" / "repo", "inside the workspace")
    outside = base / "outside"  # a repository on the host, next to the workspace
    make_repo(outside, "host secret 7d3f")
    # A symlink planted in the workspace to the outside repository: followed on the host,
    # it leads there; in the sandbox the host path does not exist.
    (base / "ws" / "link").symlink_to(outside)
    escapes = {
        "host tmp": str(outside),
        "symlink": "/workspace/link",
        "dot-dot": f"/workspace/../{outside.relative_to('/')}",
        "/etc": "/etc",
        "/root": "/root",
        # This checkout (a git repository on the host): only the dev virtualenv's
        # site-packages below it is bound, read-only.
        "checkout": str(ROOT),
    }

    async with session(*on_the_host("mcp-server-git"), errlog(base, "direct")) as client:
        control = await client.call_tool("git_log", {"repo_path": str(base / "ws" / "link")})
    assert "host secret 7d3f" in text_of(control)  # the server itself would read it

    errors = errlog(base, "git")
    command, args = through_gatewayd(base, server_venv, "mcp-server-git")
    async with session(command, args, errors) as client:
        names = {t.name for t in (await client.list_tools()).tools}
        log = await client.call_tool("git_log", {"repo_path": "/workspace/repo"})
        (base / "ws" / "repo" / "new.txt").write_text("new\n")
        status = await client.call_tool("git_status", {"repo_path": "/workspace/repo"})
        added = await client.call_tool(
            "git_add", {"repo_path": "/workspace/repo", "files": ["new.txt"]}
        )
        refused = {
            label: await client.call_tool("git_log", {"repo_path": path})
            for label, path in escapes.items()
        }
    assert {"git_log", "git_status", "git_add", "git_commit"} <= names
    assert wire(log)["isError"] is False and "inside the workspace" in text_of(log)
    assert "new.txt" in text_of(status)
    assert wire(added)["isError"] is False  # the rw workspace: the index was written
    for label, result in refused.items():
        text = text_of(result)
        assert wire(result)["isError"] is True, (label, text)
        assert text.startswith(f"{TOOL_ERROR} git_log"), (label, text)
        assert "host secret" not in text, (label, text)
    assert_run_ended_cleanly(base, errors)


async def test_the_git_server_cannot_write_a_repository_the_policy_makes_read_only(
    base: Path, server_venv: Path
) -> None:
    # A read-only rule inside the rw workspace holds in the sandbox (a read-only mount):
    # the same writes succeed in a repository beside it that the rule does not cover.
    for name in ("readonly", "writable"):
        make_repo(base / "ws" / name, f"{name} repository")
        (base / "ws" / name / "new.txt").write_text("new\n")
    rule = "readonly: {root: readonly, mode: ro}"
    # A read-only tree is not lent to the run's uid: git refuses a repository another
    # user owns unless it is named safe (git's "dubious ownership" check). The client
    # passes that setting to gatewayd as variables, and the policy lets them in.
    safe = {"GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "safe.directory"}
    safe["GIT_CONFIG_VALUE_0"] = "/workspace/readonly"
    command, args = through_gatewayd(
        base, server_venv, "mcp-server-git", extra_paths=rule, env_allow=", ".join(safe)
    )
    errors = errlog(base, "git-ro")
    results: dict[str, dict[str, Any]] = {}
    async with session(command, args, errors, env=safe) as client:
        for name in ("readonly", "writable"):
            repo = f"/workspace/{name}"
            for tool, args_ in (
                ("git_log", {}),
                ("git_create_branch", {"branch_name": "sneaky"}),
                ("git_add", {"files": ["new.txt"]}),
            ):
                result = await client.call_tool(tool, {"repo_path": repo, **args_})
                results[f"{name} {tool}"] = wire(result) | {"text": text_of(result)}
    assert "readonly repository" in results["readonly git_log"]["text"]  # reading is fine
    branch, added = results["readonly git_create_branch"], results["readonly git_add"]
    assert branch["isError"] is True and added["isError"] is True, (branch, added)
    # GitPython's own words: the lock file next to the ref cannot be made.
    lock = "/workspace/readonly/.git/refs/heads/sneaky.lock' could not be obtained"
    assert lock in branch["text"], branch
    assert added["text"].startswith(f"{TOOL_ERROR} git_add"), added
    for tool in ("git_log", "git_create_branch", "git_add"):
        assert results[f"writable {tool}"]["isError"] is False, results[f"writable {tool}"]
    heads = {
        name: sorted(p.name for p in (base / "ws" / name / ".git/refs/heads").iterdir())
        for name in ("readonly", "writable")
    }
    assert heads == {"readonly": ["main"], "writable": ["main", "sneaky"]}
    assert_run_ended_cleanly(base, errors)


class _Origin(http.server.BaseHTTPRequestHandler):
    """A loopback origin on the host: one page, and every request's path recorded."""

    BODY: ClassVar[bytes] = b"<html><body><p>origin marker 51c2</p></body></html>"

    def do_GET(self) -> None:
        server = self.server
        assert isinstance(server, _OriginServer)
        server.requests.append(self.path)
        self.send_response(200)
        self.send_header("content-type", "text/html")
        self.send_header("content-length", str(len(self.BODY)))
        self.end_headers()
        self.wfile.write(self.BODY)

    def log_message(self, format: str, *args: Any) -> None:
        return  # quiet: the test reads the recorded paths


class _OriginServer(http.server.ThreadingHTTPServer):
    def __init__(self, address: str = "127.0.0.1") -> None:
        super().__init__((address, 0), _Origin)
        self.requests: list[str] = []


@pytest.fixture
def origin() -> Iterator[tuple[int, list[str]]]:
    server = _OriginServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], server.requests
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


async def test_the_fetch_server_cannot_reach_a_loopback_origin_on_the_host(
    base: Path, server_venv: Path, origin: tuple[int, list[str]]
) -> None:
    port, requests = origin
    # The server's own guard against private addresses is turned off, and robots.txt not
    # fetched: the network namespace is what stops it.
    options = ("--allow-private-ips", "--ignore-robots-txt")
    urls = [f"http://127.0.0.1:{port}/secret", f"http://localhost:{port}/secret"]

    async with session(*on_the_host("mcp-server-fetch", *options), errlog(base, "d")) as client:
        control = await client.call_tool("fetch", {"url": urls[0]})
    assert "origin marker 51c2" in text_of(control)  # the server itself would reach it
    assert requests == ["/secret"]

    errors = errlog(base, "fetch")
    command, args = through_gatewayd(base, server_venv, "mcp-server-fetch", *options)
    async with session(command, args, errors) as client:
        names = {t.name for t in (await client.list_tools()).tools}
        results = [await client.call_tool("fetch", {"url": url}) for url in urls]
    assert names == {"fetch"}
    for url, result in zip(urls, results, strict=True):
        text = text_of(result)
        assert wire(result)["isError"] is True, text
        # The sandbox's loopback is its own: nothing listens there, the host's is unseen.
        assert f"{FETCH_FAILED} {url}" in text and CONNECT_FAILED in text, text
        assert "origin marker" not in text
    assert requests == ["/secret"]  # the origin heard nothing from the sandbox
    assert_run_ended_cleanly(base, errors)


def loopback_host_name() -> tuple[str, str] | None:
    """A name of this host that resolves, on the host, to a loopback address only (Debian
    maps its hostname to 127.0.1.1 in /etc/hosts), and that address: an origin the egress
    proxy can reach by an allowlisted domain. None where there is no such name."""
    name = socket.gethostname()
    try:
        found = {str(info[4][0]) for info in socket.getaddrinfo(name, None, socket.AF_INET)}
    except OSError:
        return None
    if len(found) != 1 or not ipaddress.ip_address(next(iter(found))).is_loopback:
        return None
    if name in ("localhost", "localhost.localdomain"):
        return None  # on NO_PROXY: never sent to the proxy
    return name, found.pop()


@pytest.mark.skipif(loopback_host_name() is None, reason="no host name that resolves to loopback")
async def test_the_fetch_server_reaches_only_the_policys_domains_through_the_egress_proxy(
    base: Path, server_venv: Path
) -> None:
    found = loopback_host_name()
    assert found is not None
    name, address = found
    server = _OriginServer(address)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    network = textwrap.dedent(f"""
        network:
          allow_domains: [{name}]
          schemes: [http]
          ports: [{port}]
          allow_private: [{name}]
          proxy: {{enabled: true}}
        """)
    allowed = f"http://{name}:{port}/page"
    off_the_list = f"http://off-the-list.example:{port}/page"
    # Around the proxy: 127.0.0.1 is on NO_PROXY (the sandbox's own services live there),
    # so this goes to the sandbox's own loopback, where nothing listens.
    bypass = f"http://127.0.0.1:{port}/page"
    errors = errlog(base, "fetch-proxy")
    options = ("--allow-private-ips", "--ignore-robots-txt")
    command, args = through_gatewayd(
        base, server_venv, "mcp-server-fetch", *options, more_policy=network
    )
    try:
        async with session(command, args, errors) as client:
            results = [
                await client.call_tool("fetch", {"url": url})
                for url in (allowed, off_the_list, bypass)
            ]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    fetched, refused, unreached = (wire(r) | {"text": text_of(r)} for r in results)
    assert fetched["isError"] is False and "origin marker 51c2" in fetched["text"], fetched
    # The proxy's 403, as the server reports it (the reason is in the audit entry below).
    assert refused["isError"] is True, refused
    assert refused["text"] == f"{TOOL_ERROR} fetch: {FETCH_FAILED} {off_the_list} - status code 403"
    assert unreached["isError"] is True and CONNECT_FAILED in unreached["text"], unreached
    assert server.requests == ["/page"]  # only the allowed fetch reached the origin
    assert_run_ended_cleanly(base, errors)
    log = base / "state" / "audit" / "audit.jsonl"
    entries = [json.loads(line) for line in log.read_text().splitlines() if line]
    egress = {e["detail"]["domain"]: e for e in entries if e.get("event") == "egress"}
    assert egress[name]["detail"]["verdict"] == "allowed"
    assert egress["off-the-list.example"]["detail"]["verdict"] == "denied"
    assert "off-the-list.example" in egress["off-the-list.example"]["safeMessage"]


async def test_a_server_the_sandbox_cannot_see_ends_the_session_at_once_saying_which(
    base: Path, server_venv: Path
) -> None:
    # The dev virtualenv's own console script: on the host it runs, but neither it (the
    # virtualenv is no policy path) nor its interpreter is in the sandbox. The client's
    # session ends at its first request with gatewayd's exit, never hangs; gatewayd's
    # stderr names the program (the operator's clue), and the run is audited as ended.
    program = str(Path(sys.executable).parent / "mcp-server-time")
    errors = errlog(base, "unseen")
    argv = run_argv(base, server_venv, program)
    with trio.fail_after(END_WAIT_S), pytest.raises(BaseExceptionGroup) as raised:
        async with session(GATEWAYD, argv, errors):
            pass
    (closed,) = leaves(raised.value)
    assert isinstance(closed, MCPError), closed
    assert closed.code == CONNECTION_CLOSED
    said = gatewayd_said(errors)
    assert f"bwrap: execvp {program}: No such file or directory" in said, said
    assert "ended: exit 1" in said, said
    log = base / "state" / "audit" / "audit.jsonl"
    entries = [json.loads(line) for line in log.read_text().splitlines() if line]
    (ended,) = [e for e in entries if e.get("event") == "exec_ended"]
    assert ended["detail"]["exitCode"] == 1
    assert verify_file(log).ok


def leaves(error: BaseException) -> list[BaseException]:
    """The exceptions in ``error``, however deeply grouped (anyio's and trio's task groups
    each wrap what they raise)."""
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in leaves(inner)]
    return [error]
