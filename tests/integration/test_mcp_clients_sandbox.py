"""Official MCP clients nobody on the team wrote, inside a real sandbox of a real run,
against both of cogni-tool's MCP transports:

* the Python SDK's streamable HTTP client (``mcp`` from PyPI: ``streamable_http_client``
  + ``ClientSession``, and the high-level ``Client``) against ``cogni-tool serve``'s
  ``/mcp`` on the sandbox's loopback;
* the TypeScript SDK's client (``@modelcontextprotocol/sdk`` from npm, driven by
  tests/mcp_node/client.mjs) against ``cogni-tool mcp`` over stdio and against ``/mcp``.

Each lists the run's tools, calls an allowed tool, a denied one and an unknown one; the
expected answers are the real gateway's. The Python SDK is copied into the workspace (as
in test_mcp_stdio_sandbox); node is the host's /usr/bin/node, which the sandbox sees
with /usr, and the SDK's node_modules (``make node-packages``) are granted read-only.

``cogni-tool serve`` runs for a run whose policy grants a model (its listener is the
model endpoint's): the policy here grants one, never called.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from gatewayd.audit.verify import verify_file
from gatewayd.config import ModelAlias
from gatewayd.daemon import open_daemon
from gatewayd.sandbox.plan import MODEL_ENDPOINT_PORT
from tests.integration.test_mcp_stdio_sandbox import copy_sdk, text_of
from tests.integration.test_run_sandbox import PY, Sandboxed, _unavailable, sandbox_config

NODE_DIR = Path(__file__).resolve().parents[1] / "mcp_node"
NODE = "/usr/bin/node"
KEY_ENV = "COGNI_TEST_MCP_HTTP_KEY"
MCP_URL = f"http://127.0.0.1:{MODEL_ENDPOINT_PORT}/mcp"

pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))

POLICY = f"""
version: 1
name: mcp-clients
tools:
  allow: [time.now, fs.read, fs.list, model.chat]
filesystem:
  paths:
    workspace: {{root: ., mode: rw}}
    mcpnode: {{root: {NODE_DIR}, mount: /opt/mcpnode, mode: ro}}
limits: {{calls_per_second: 1000, burst: 1000}}
sandbox: {{timeout_s: 120, cpu_s: 60, max_processes: 64}}
model_access:
  models: [assistant]
  max_requests: 1
  max_tokens: 1000
"""
LISTED = ["fs.list", "fs.read", "model.chat", "time.now"]

# The Python SDK's streamable HTTP client, as an agent would use it; one JSON line out.
PY_CLIENT = """
import json, sys
sys.path.insert(0, "/workspace/sdk")
import anyio
from mcp import Client, ClientSession
from mcp.client.streamable_http import streamable_http_client

URL = sys.argv[1]

def wire(model):
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)

async def main():
    seen = {"progress": []}

    async def on_progress(progress, total, message):
        seen["progress"].append([progress, total, message])

    async with streamable_http_client(URL) as streams:
        async with ClientSession(streams[0], streams[1]) as session:
            seen["init"] = wire(await session.initialize())
            await session.send_ping()
            seen["tools"] = wire(await session.list_tools())
            calls = {
                "allowed": ("fs.read", {"path": "notes.md"}),
                "denied": ("fs.write", {"path": "x.txt", "content": "no"}),
                "unknown": ("no.such.tool", {}),
            }
            for label, (name, args) in calls.items():
                callback = on_progress if label == "allowed" else None
                result = await session.call_tool(name, args, progress_callback=callback)
                seen[label] = wire(result)
    # The high-level client in its default mode: it probes server/discover, which this
    # server refuses (-32601), and falls back to initialize.
    async with Client(URL) as client:
        seen["auto_version"] = client.protocol_version
        seen["auto_call"] = wire(await client.call_tool("time.now", {}))
    print(json.dumps(seen))

anyio.run(main)
"""


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-mcph-", dir="/tmp"))
    path.chmod(0o711)  # the sandbox's uid passes through to its workspace and socket
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def sb(base: Path) -> AsyncIterator[Sandboxed]:
    # A model the policy grants, so that the run has cogni-tool serve; never called.
    alias = ModelAlias(
        provider="openai", model="unused", api_base="http://127.0.0.1:9/v1", api_key_env=KEY_ENV
    )
    os.environ[KEY_ENV] = "sk-host-only-" + secrets.token_hex(8)
    try:
        config = sandbox_config(base).changed(models={"assistant": alias})
        async with open_daemon(config, preload=True) as daemon:
            assert daemon.runs.support.available, daemon.runs.support.reason
            yield Sandboxed(daemon, base)
    finally:
        del os.environ[KEY_ENV]


def node_unavailable() -> str | None:
    if not os.path.exists(NODE):
        return f"needs node at {NODE} (make setup installs Debian's nodejs)"
    if not (NODE_DIR / "node_modules" / "@modelcontextprotocol" / "sdk").is_dir():
        return f"needs {NODE_DIR}/node_modules (make node-packages)"
    return None


def assert_refusals(denied: dict[str, Any], unknown: dict[str, Any]) -> None:
    """The gateway's refusals, as MCP tool errors with its message."""
    for result, start, fragments in (
        (denied, "policy_denied: ", ["'fs.write' is not allowed", "fs.read"]),
        (unknown, "unknown_tool: ", ["no tool named 'no.such.tool'", "fs.read"]),
    ):
        assert result["isError"] is True, result
        text = text_of(result)
        assert text.startswith(start), text
        for fragment in fragments:
            assert fragment in text, text


def assert_allowed(allowed: dict[str, Any]) -> None:
    assert allowed.get("isError") is False, allowed
    assert allowed["structuredContent"]["content"] == "hello\n"
    assert json.loads(text_of(allowed)) == allowed["structuredContent"]


async def run_calls(sb: Sandboxed, run_id: str) -> list[str | None]:
    entries = await sb.entries()
    return [e.get("tool") for e in entries if e.get("kind") == "call" and e.get("runId") == run_id]


async def test_the_python_sdks_http_client_lists_calls_and_is_refused_through_serve(
    sb: Sandboxed,
) -> None:
    ws = sb.workspace()
    copy_sdk(ws)
    (ws / "client.py").write_text(textwrap.dedent(PY_CLIENT))
    run = await sb.run(POLICY, workspace=ws)
    result = await sb.daemon.runs.exec(
        run.run_id, [PY, "-I", "/workspace/client.py", MCP_URL], timeout_s=110
    )
    assert result.exitCode == 0, result.stderr.decode(errors="replace")[-3000:]
    seen = json.loads(result.stdout.splitlines()[-1])

    assert seen["init"]["protocolVersion"] == "2025-11-25"
    assert seen["init"]["serverInfo"]["name"] == "cogni-tool"
    assert sorted(t["name"] for t in seen["tools"]["tools"]) == LISTED
    assert_allowed(seen["allowed"])
    # Progress came on the POST's event stream, before the answer.
    assert [p[0] for p in seen["progress"]] == [0.0, 1.0]
    assert_refusals(seen["denied"], seen["unknown"])
    assert seen["auto_version"] == "2025-11-25"
    assert seen["auto_call"]["isError"] is False
    assert seen["auto_call"]["structuredContent"]["timezone"] == "UTC"

    called = await run_calls(sb, run.run_id)
    assert {"fs.read", "fs.write", "no.such.tool", "tools.list", "time.now"} <= set(called)
    assert verify_file(sb.audit_path).ok


@pytest.mark.skipif(node_unavailable() is not None, reason=str(node_unavailable()))
async def test_the_typescript_sdks_client_over_stdio_and_http(sb: Sandboxed) -> None:
    ws = sb.workspace()
    run = await sb.run(POLICY, workspace=ws)
    seen: dict[str, dict[str, Any]] = {}
    for mode in ("stdio", "http"):
        result = await sb.daemon.runs.exec(
            run.run_id, [NODE, "/opt/mcpnode/client.mjs", mode, MCP_URL], timeout_s=110
        )
        assert result.exitCode == 0, (mode, result.stderr.decode(errors="replace")[-3000:])
        seen[mode] = json.loads(result.stdout.splitlines()[-1])

    for mode, out in seen.items():
        assert out["version"]["name"] == "cogni-tool", mode
        assert out["capabilities"]["tools"] == {"listChanged": False}, mode
        assert sorted(t["name"] for t in out["tools"]) == LISTED, mode
        read = next(t for t in out["tools"] if t["name"] == "fs.read")
        assert (
            read["inputSchema"]["type"] == "object" and "path" in read["inputSchema"]["properties"]
        )
        assert_allowed(out["allowed"])
        # The last progress comes just before the answer; the TS SDK (1.x) runs
        # notification handlers a microtask late and responses at once, so when both
        # arrive in one read it has retired the token and drops that progress
        # (modelcontextprotocol/typescript-sdk#2580). The first always arrives.
        assert out["progress"] in ([[0, 1]], [[0, 1], [1, 1]]), (mode, out["progress"])
        assert_refusals(out["denied"], out["unknown"])
    # Over HTTP: a session was issued at initialize, and the client ended it with DELETE.
    assert seen["http"]["sessionId"] and seen["http"]["protocolVersion"] == "2025-11-25"
    assert seen["http"]["terminated"] is True
    assert seen["stdio"]["sessionId"] is None

    called = await run_calls(sb, run.run_id)
    assert called.count("fs.write") == 2 and called.count("no.such.tool") == 2
    assert verify_file(sb.audit_path).ok


# A run gatewayd starts no cogni-tool serve for (no model, no app): its own process starts
# one, as docs/mcp.md says, and talks MCP over HTTP to it.
SELF_STARTED_POLICY = """
version: 1
name: mcp-http-self-started
tools:
  allow: [time.now, fs.read, fs.list]
filesystem:
  paths:
    workspace: {root: ., mode: rw}
limits: {calls_per_second: 1000, burst: 1000}
sandbox: {timeout_s: 120, cpu_s: 60, max_processes: 64}
"""
SELF_STARTED_PORT = 18080

# Starts cogni-tool serve as the docs say, waits for its "ready", then an SDK session.
SELF_STARTED_CLIENT = """
import json, subprocess, sys
sys.path.insert(0, "/workspace/sdk")
import anyio
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

PORT = int(sys.argv[1])
server = subprocess.Popen(
    ["cogni-tool", "serve", "--openai-port", str(PORT)], stdout=subprocess.PIPE, text=True
)
assert server.stdout.readline().strip() == "ready"

def wire(model):
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)

async def main():
    seen = {}
    async with streamable_http_client(f"http://127.0.0.1:{PORT}/mcp") as streams:
        async with ClientSession(streams[0], streams[1]) as session:
            seen["init"] = wire(await session.initialize())
            seen["tools"] = wire(await session.list_tools())
            seen["allowed"] = wire(await session.call_tool("fs.read", {"path": "notes.md"}))
            seen["denied"] = wire(
                await session.call_tool("fs.write", {"path": "x.txt", "content": "no"})
            )
            seen["unknown"] = wire(await session.call_tool("no.such.tool", {}))
    print(json.dumps(seen))

try:
    anyio.run(main)
finally:
    server.terminate()
"""


async def test_a_run_without_services_starts_serve_itself_and_speaks_mcp_over_http(
    sb: Sandboxed,
) -> None:
    ws = sb.workspace()
    copy_sdk(ws)
    (ws / "client.py").write_text(textwrap.dedent(SELF_STARTED_CLIENT))
    run = await sb.run(SELF_STARTED_POLICY, workspace=ws)
    assert run.sandbox is not None and not run.sandbox.services.model_endpoint
    result = await sb.daemon.runs.exec(
        run.run_id, [PY, "-I", "/workspace/client.py", str(SELF_STARTED_PORT)], timeout_s=110
    )
    assert result.exitCode == 0, result.stderr.decode(errors="replace")[-3000:]
    seen = json.loads(result.stdout.splitlines()[-1])

    assert seen["init"]["serverInfo"]["name"] == "cogni-tool"
    assert sorted(t["name"] for t in seen["tools"]["tools"]) == ["fs.list", "fs.read", "time.now"]
    assert_allowed(seen["allowed"])
    assert_refusals(seen["denied"], seen["unknown"])
    called = await run_calls(sb, run.run_id)
    assert {"fs.read", "fs.write", "no.such.tool", "tools.list"} <= set(called)
    assert verify_file(sb.audit_path).ok
