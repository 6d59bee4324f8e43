"""``cogni-tool mcp`` driven by the official MCP Python SDK's client, in a real sandbox.

The client is one nobody on the team wrote: ``mcp`` from PyPI. Two ways it reaches
``cogni-tool mcp``:

* Inside the run's sandbox, starting ``cogni-tool mcp`` as its subprocess, the usual
  way an MCP client starts a stdio server (``stdio_client`` + ``ClientSession``, and the
  high-level ``Client`` in its default mode). The sandbox's python3 has no ``mcp`` and
  the dev virtualenv is not the run's to see, so the SDK and what it requires are copied
  into the workspace (the same Python minor version: its compiled parts load) and put
  on ``sys.path`` by the script.
* From the host, starting ``gatewayd run ... -- cogni-tool mcp`` as its stdio server
  (gatewayd run streams the command's stdin and stdout): a host client using the run's
  tools, sandboxed.

Every call goes through the real gateway of a real run (policy, audit); the expected
results are the gateway's own answers.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

from gatewayd.audit.verify import verify_file
from gatewayd.daemon import open_daemon
from tests.integration.test_run_sandbox import (
    PY,
    SECRET_NAME,
    Sandboxed,
    _unavailable,
    sandbox_config,
)
from tests.livedaemon import sandbox_options

pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))

SDK_DIR = "sdk"  # in the workspace

POLICY = """
version: 1
name: mcp-client
tools:
  allow: [time.now, fs.read, fs.list]
filesystem:
  paths:
    workspace: {root: ., mode: rw}
limits: {calls_per_second: 1000, burst: 1000}
sandbox: {timeout_s: 120, cpu_s: 60, max_processes: 64}
"""

# The official client, as an agent would use it; it prints what it saw as one JSON line.
CLIENT = """
import json, os, sys
sys.path.insert(0, "/workspace/sdk")
import anyio
from mcp import Client, ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

def wire(model):
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)

async def main():
    # The SDK passes only HOME, PATH and a few more to its server by default: the run's
    # gateway variables must be passed on (docs/mcp.md says so too).
    server = StdioServerParameters(command="cogni-tool", args=["mcp"], env=dict(os.environ))
    seen = {"progress": []}

    async def on_progress(progress, total, message):
        seen["progress"].append([progress, total, message])

    async with stdio_client(server) as (read, write):
        async with ClientSession(read, write) as session:
            seen["init"] = wire(await session.initialize())
            await session.send_ping()
            seen["tools"] = wire(await session.list_tools())
            calls = {
                "allowed": ("fs.read", {"path": "notes.md"}),
                "denied_tool": ("fs.write", {"path": "x.txt", "content": "no"}),
                "denied_path": ("fs.read", {"path": "/etc/shadow"}),
                "unknown": ("no.such.tool", {}),
                "invalid": ("fs.read", {"nope": 1}),
            }
            for label, (name, args) in calls.items():
                callback = on_progress if label == "allowed" else None
                result = await session.call_tool(name, args, progress_callback=callback)
                seen[label] = wire(result)
    # The SDK's high-level client, as its README shows it: by default it probes
    # server/discover (a newer, stateless revision) and falls back to initialize.
    async with Client(server) as client:
        seen["auto_version"] = client.protocol_version
        seen["auto_tools"] = sorted(t.name for t in (await client.list_tools()).tools)
        seen["auto_call"] = wire(await client.call_tool("time.now", {}))
    print(json.dumps(seen))

anyio.run(main)
"""


# What the clients in the sandbox import (here and in test_mcp_clients_sandbox.py).
SDK_IMPORTS = (
    "anyio",
    "mcp",
    "mcp.client.session",
    "mcp.client.stdio",
    "mcp.client.streamable_http",
)
# Prints the file of every module the imports above loaded, one a line.
_SDK_PROBE = (
    f"import sys, {', '.join(SDK_IMPORTS)}\n"
    "print('\\n'.join(m.__file__ for m in list(sys.modules.values()) "
    "if getattr(m, '__file__', None)))"
)


def _requirement_closure(name: str) -> list[importlib.metadata.Distribution]:
    """``name``'s distribution and every one it requires, transitively (extras aside)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = [name]
    while todo:
        dist = importlib.metadata.distribution(todo.pop())
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in found:
            continue
        found[key] = dist
        for line in dist.requires or ():
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return list(found.values())


@functools.cache
def sdk_packages() -> tuple[Path, ...]:
    """The site-packages entries of the SDK and of what it requires (some it imports
    only when used: httpcore2 at the first request, jsonschema at a result's check),
    what its clients import besides (optional imports: cryptography), and every
    dist-info. Not this process's modules: they hold whatever earlier tests in it
    imported (litellm, temporalio, wasmtime...: 400 MB and 22,000 files to copy)."""
    import mcp

    site = Path(mcp.__file__).resolve().parents[1]
    tops: set[Path] = set(site.glob("*.dist-info"))
    for dist in _requirement_closure("mcp"):
        tops.update(site / Path(f).parts[0] for f in dist.files or () if Path(f).parts[0] != "..")
    probe = subprocess.run(
        [sys.executable, "-c", _SDK_PROBE], capture_output=True, text=True, check=True
    )
    for where in probe.stdout.splitlines():
        if Path(where).resolve().is_relative_to(site):
            tops.add(site / Path(where).resolve().relative_to(site).parts[0])
    return tuple(sorted(tops))


def copy_sdk(workspace: Path) -> None:
    target = workspace / SDK_DIR
    target.mkdir()
    for source in sdk_packages():
        if source.is_dir():
            shutil.copytree(source, target / source.name, symlinks=True)
        else:
            shutil.copy2(source, target / source.name)


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-mcp-", dir="/tmp"))
    path.chmod(0o711)  # the sandbox's uid passes through to its workspace and socket
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def sb(base: Path) -> AsyncIterator[Sandboxed]:
    os.environ[SECRET_NAME] = "sk-host-only-" + secrets.token_hex(8)
    try:
        async with open_daemon(sandbox_config(base), preload=True) as daemon:
            assert daemon.runs.support.available, daemon.runs.support.reason
            yield Sandboxed(daemon, base)
    finally:
        del os.environ[SECRET_NAME]


def wire(model: Any) -> dict[str, Any]:
    """An SDK result as it was on the wire (camelCase), whatever the SDK's field names."""
    value: dict[str, Any] = model.model_dump(mode="json", by_alias=True, exclude_none=True)
    return value


def text_of(result: dict[str, Any]) -> str:
    (part,) = result["content"]
    assert part["type"] == "text"
    return str(part["text"])


async def test_the_official_sdk_client_lists_calls_and_is_refused_through_cogni_tool_mcp(
    sb: Sandboxed,
) -> None:
    ws = sb.workspace()
    copy_sdk(ws)
    (ws / "client.py").write_text(textwrap.dedent(CLIENT))
    run = await sb.run(POLICY, workspace=ws)
    result = await sb.daemon.runs.exec(
        run.run_id, [PY, "-I", "/workspace/client.py"], timeout_s=110
    )
    assert result.exitCode == 0, result.stderr.decode(errors="replace")[-3000:]
    seen = json.loads(result.stdout.splitlines()[-1])

    # The handshake: the SDK's newest handshake version is ours too.
    init = seen["init"]
    assert init["protocolVersion"] == "2025-11-25"
    assert init["serverInfo"]["name"] == "cogni-tool"
    assert init["capabilities"]["tools"] == {"listChanged": False}

    assert seen["auto_version"] == "2025-11-25"
    assert seen["auto_tools"] == ["fs.list", "fs.read", "time.now"]
    assert seen["auto_call"]["isError"] is False
    assert seen["auto_call"]["structuredContent"]["timezone"] == "UTC"

    # Exactly the tools the policy allows, tools.list itself not among them.
    tools = {t["name"]: t for t in seen["tools"]["tools"]}
    assert sorted(tools) == ["fs.list", "fs.read", "time.now"]
    assert tools["fs.read"]["inputSchema"]["type"] == "object"
    assert "path" in tools["fs.read"]["inputSchema"]["properties"]
    assert tools["fs.read"]["description"]

    # The allowed call: the gateway's value, as text and as structured content.
    allowed = seen["allowed"]
    assert allowed.get("isError") is False
    assert allowed["structuredContent"]["content"] == "hello\n"
    assert json.loads(text_of(allowed)) == allowed["structuredContent"]
    assert [p[0] for p in seen["progress"]] == [0.0, 1.0]

    # Refusals are tool errors with the gateway's message, not protocol errors.
    for label, code, fragments in (
        ("denied_tool", "policy_denied", ["'fs.write' is not allowed", "fs.read"]),
        ("denied_path", "policy_denied", ["/etc/shadow"]),
        ("unknown", "unknown_tool", ["no tool named 'no.such.tool'", "fs.read"]),
        ("invalid", "invalid_args", ["invalid arguments for fs.read"]),
    ):
        refused = seen[label]
        assert refused["isError"] is True, (label, refused)
        text = text_of(refused)
        assert text.startswith(f"{code}: "), (label, text)
        for fragment in fragments:
            assert fragment in text, (label, text)

    # Each tools/call and each tools/list was one audited gateway call of this run.
    entries = await sb.entries()
    calls = [e for e in entries if e.get("kind") == "call" and e.get("runId") == run.run_id]
    called = [e.get("tool") for e in calls]
    assert called.count("fs.read") == 3  # allowed, denied_path, invalid
    assert {"fs.write", "no.such.tool", "tools.list"} <= set(called)
    assert verify_file(sb.audit_path).ok


async def test_a_host_client_gets_the_runs_tools_through_gatewayd_run(base: Path) -> None:
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    ws = base / "ws"
    ws.mkdir()
    (ws / "notes.md").write_text("hello\n")
    policy = base / "policy.yaml"
    policy.write_text(textwrap.dedent(POLICY))
    gatewayd = str(Path(sys.executable).parent / "gatewayd")
    argv = ["run", "--state-dir", str(base / "state"), *sandbox_options()]
    argv += ["--workspace", str(ws), "--policy", str(policy), "--", "cogni-tool", "mcp"]
    errors = (base / "gatewayd.stderr").open("w+")
    server = StdioServerParameters(command=gatewayd, args=argv)
    async with AsyncExitStack() as stack:
        read, write = await stack.enter_async_context(stdio_client(server, errlog=errors))
        session = await stack.enter_async_context(ClientSession(read, write))
        init = await session.initialize()
        listed = await session.list_tools()
        allowed = await session.call_tool("fs.read", {"path": "notes.md"})
        denied = await session.call_tool("fs.write", {"path": "x.txt", "content": "no"})
        unknown = await session.call_tool("no.such.tool", {})
    assert wire(init)["serverInfo"]["name"] == "cogni-tool"
    assert sorted(t["name"] for t in wire(listed)["tools"]) == ["fs.list", "fs.read", "time.now"]
    assert wire(allowed)["isError"] is False
    assert wire(allowed)["structuredContent"]["content"] == "hello\n"
    for result, start in ((denied, "policy_denied: "), (unknown, "unknown_tool: ")):
        answer = wire(result)
        assert answer["isError"] is True
        assert text_of(answer).startswith(start) and "fs.read" in text_of(answer), answer
    errors.seek(0)
    said = errors.read()
    # gatewayd's own lines went to stderr, never into the MCP stream; the run ended with
    # the stream (the client closed stdin, cogni-tool mcp ended, so did the run).
    assert "started" in said and "ended: exit 0" in said, said
    assert verify_file(base / "state" / "audit" / "audit.jsonl").ok
