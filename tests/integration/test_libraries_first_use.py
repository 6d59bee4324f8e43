"""gatewayd.libraries: what each list names is everything its first real use imports.

Checked against the real libraries, in a fresh interpreter where nothing has loaded them
yet (the MCP lists with the test MCP servers started for real): integration, not the fast
lane's pure layers.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Final

# What each list's first real use does, after only the list was loaded: no module
# outside gatewayd may be imported then (it would be imported on the event loop).
FIRST_USES: Final = """
import sys
from gatewayd import libraries

def new_outside(before):
    return sorted(m for m in set(sys.modules) - before if not m.startswith("gatewayd"))

libraries.load(libraries.HTTP)
import gatewayd.tools.http as http
before = set(sys.modules)
http.fetch_request(http.FetchArgs(url="https://example.com/x"))
http._parse_url("https://example.com/")
import gatewayd.pinned_backend
gatewayd.pinned_backend.PinnedBackend("example.com", ())
import gatewayd.egress
print("HTTP", new_outside(before))

libraries.load(libraries.JSON_SCHEMA)
before = set(sys.modules)
from gatewayd.mcp import schemas
from gatewayd.runners.manifest import parse_manifest
schema = {
    "type": "object",
    "properties": {"a": {"type": "string", "pattern": "^a+$"}},
    "patternProperties": {"^x": {"type": "integer"}},
    "additionalProperties": False,
}
decode = schemas.arguments_decoder(schemas.bounded_validator(schema), lambda exc: exc)
try:
    decode({"a": "b", "c": 1})
except Exception as exc:
    assert "Additional properties" in str(exc) or "does not match" in str(exc), exc
try:
    parse_manifest({"name": "t"}, file="manifest.yaml", folder="/nowhere")
except ValueError as exc:
    assert "missing" in str(exc) or "required" in str(exc), exc
print("JSON_SCHEMA", new_outside(before))

libraries.load(libraries.WASM)
before = set(sys.modules)
import gatewayd.runners.wasm
print("WASM", new_outside(before))

libraries.load(libraries.MARKDOWN)
before = set(sys.modules)
from gatewayd.apps import problems, sections
sections.read_body("# Rules\\n\\n## Allow\\n\\n- read the docs\\n", 0)
assert problems.invisible_character("caf\\u00e9 \\u200b") is not None
print("MARKDOWN", new_outside(before))

# Both of an MCP session's transports, to real servers (tests/mcp_servers, argv[1]):
# gatewayd's stdio client, and the SDK's streamable HTTP, whose first connection imports
# its trio backends.
libraries.load((*libraries.JSON_SCHEMA, *libraries.MCP))
import os, socket, subprocess, time
import trio
with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
servers = sys.argv[1]
remote = subprocess.Popen(
    [sys.executable, servers + "/http_server.py", str(port)],
    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
)
stdio = subprocess.Popen(
    [sys.executable, "-I", servers + "/misbehaving_server.py"],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
)
for _ in range(600):  # a numeric address, no getaddrinfo: its idna codec is the list's
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            break
    time.sleep(0.05)
before = set(sys.modules)
from gatewayd.mcp import client

async def first_uses():
    to_server = trio.lowlevel.FdStream(os.dup(stdio.stdin.fileno()))
    from_server = trio.lowlevel.FdStream(os.dup(stdio.stdout.fileno()))
    sessions = (
        client.open_session(to_server, from_server, name="near"),
        client.open_remote_session(f"http://127.0.0.1:{port}/mcp", name="far"),
    )
    for opened in sessions:
        with trio.fail_after(60):
            async with opened as session:
                await session.initialize()
                assert "echo" in [tool.name for tool in await session.tools()]
                result = await session.call("echo", {"text": "hi"})
                assert result.content == [{"type": "text", "text": "hi"}], result
    await to_server.aclose()
    await from_server.aclose()

try:
    trio.run(first_uses)
finally:
    remote.kill()
    stdio.kill()
print("MCP", new_outside(before))
"""

SERVERS_DIR: Final = str(Path(__file__).resolve().parent.parent / "mcp_servers")


def first_uses(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter, given the test servers' directory."""
    return subprocess.run(
        [sys.executable, "-c", code, SERVERS_DIR],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_each_list_holds_every_library_its_first_real_use_imports() -> None:
    done = first_uses(FIRST_USES)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n") == [
        "HTTP []",
        "JSON_SCHEMA []",
        "WASM []",
        "MARKDOWN []",
        "MCP []",
        "",
    ], done.stdout


def test_the_positive_control_sees_a_first_use_that_was_not_loaded() -> None:
    # The same check, with the HTTP list left unloaded: what the first use imports shows.
    code = FIRST_USES.replace("libraries.load(libraries.HTTP)\n", "", 1)
    done = first_uses(code)
    assert done.returncode == 0, done.stderr[-3000:]
    first = done.stdout.split("\n")[0]
    assert first.startswith("HTTP [") and "'httpx'" in first and "'httpcore'" in first, first


def test_the_positive_control_sees_what_an_mcp_session_imports_beyond_the_client() -> None:
    # The MCP list cut to gatewayd's client alone: the SDK's HTTP transport's first
    # connection imports its trio backends, which the list names.
    code = FIRST_USES.replace(
        "libraries.load((*libraries.JSON_SCHEMA, *libraries.MCP))",
        "libraries.load((*libraries.JSON_SCHEMA, 'gatewayd.mcp.client'))",
        1,
    )
    assert code != FIRST_USES
    done = first_uses(code)
    assert done.returncode == 0, done.stderr[-3000:]
    mcp = done.stdout.split("\n")[4]
    assert mcp.startswith("MCP [") and "'anyio._backends._trio'" in mcp, mcp
    assert "'httpcore2._backends.trio'" in mcp, mcp


# http.fetch's first use after only what gatewayd.daemon's TOOL_LIBRARIES names for it
# was loaded: what it imports then (gatewayd's own modules included), and whether the
# egress proxy, which a fetch does not use, was loaded with it.
FETCH_FIRST_USE: Final = """
import sys
from gatewayd import libraries
from gatewayd.daemon import TOOL_LIBRARIES

libraries.load(TOOL_LIBRARIES["http.fetch"])
before = set(sys.modules)
import gatewayd.tools.http as http
http.fetch_request(http.FetchArgs(url="https://example.com/x"))
from gatewayd.pinned_backend import PinnedBackend
PinnedBackend("example.com", ())
print(sorted(set(sys.modules) - before), "gatewayd.egress" in sys.modules)
"""


def test_http_fetch_s_libraries_are_what_a_fetch_imports_and_not_the_egress_proxy() -> None:
    done = first_uses(FETCH_FIRST_USE)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == "[] False\n", done.stdout
