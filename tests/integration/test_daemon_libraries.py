"""A serving daemon loads the libraries its tools and runs may need (gatewayd.libraries)
in a worker thread at its start, and has them before any run can start: no call of its
imports one on the event loop.

Each test opens a real daemon (no OS sandbox: the libraries do not depend on it) in a
fresh interpreter, where nothing has loaded the libraries yet, and records which thread
imported each one.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Final

from tests.unit.test_cli_imports import clean_env

# Opens a daemon on argv[1] (a state directory) with argv[2] (a JSON object of further
# settings) and prints, as JSON, which thread imported each watched library by the time
# open_daemon yields ("main" is trio's), and whether the lists were loaded then.
SCRIPT: Final = """
import json, sys, threading
WATCHED = {"httpx", "httpcore", "h11", "markdown_it", "regex", "jsonschema", "referencing", "wasmtime"}
seen = {}

class Watch:
    def find_spec(self, name, path, target=None):
        if name in WATCHED and name not in seen:
            main = threading.current_thread() is threading.main_thread()
            seen[name] = "main" if main else "worker"
        return None

sys.meta_path.insert(0, Watch())
from pathlib import Path
import trio
from gatewayd import libraries
from gatewayd.config import GatewaydConfig
from gatewayd.daemon import NETWORK_LIBRARIES, open_daemon

async def main():
    state = Path(sys.argv[1])
    config = GatewaydConfig(state_dir=state, os_sandbox=False, **json.loads(sys.argv[2]))
    async with open_daemon(config, preload=sys.argv[3] == "preload") as daemon:
        print(json.dumps({
            "threads": dict(seen),
            "network": libraries.loaded(NETWORK_LIBRARIES),
            "markdown": libraries.loaded(libraries.MARKDOWN),
            "json_schema": libraries.loaded(libraries.JSON_SCHEMA),
        }))

trio.run(main)
"""


def open_in_fresh_interpreter(
    tmp_path: Path, settings: dict[str, object], *, preload: bool = True
) -> dict[str, object]:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            SCRIPT,
            str(tmp_path / "state"),
            json.dumps(settings),
            "preload" if preload else "no",
        ],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    answer: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return answer


def test_a_serving_daemon_has_its_tools_libraries_before_it_serves_loaded_off_the_loop(
    tmp_path: Path,
) -> None:
    answer = open_in_fresh_interpreter(tmp_path, {})
    assert answer["network"] is True and answer["markdown"] is True
    threads = answer["threads"]
    assert isinstance(threads, dict)
    assert {"httpx", "httpcore", "h11", "markdown_it", "regex"} <= set(threads), threads
    on_the_loop = sorted(name for name, thread in threads.items() if thread == "main")
    assert not on_the_loop, f"imported on the event loop's thread: {on_the_loop}"
    # No MCP server, no tool folder: no schema to check, no wasm tool.
    assert answer["json_schema"] is False
    assert not {"jsonschema", "wasmtime"} & set(threads), threads


def test_a_daemon_with_tool_folders_loads_the_schemas_library_off_the_loop_too(
    tmp_path: Path,
) -> None:
    folders = tmp_path / "tools"
    folders.mkdir()
    answer = open_in_fresh_interpreter(tmp_path, {"tool_dirs": [str(folders)]})
    assert answer["json_schema"] is True
    threads = answer["threads"]
    assert isinstance(threads, dict)
    assert {"jsonschema", "referencing"} <= set(threads), threads
    on_the_loop = sorted(name for name, thread in threads.items() if thread == "main")
    assert not on_the_loop, f"imported on the event loop's thread: {on_the_loop}"


def test_a_daemon_opened_without_preload_loads_none_of_them(tmp_path: Path) -> None:
    # `gatewayd run`'s: it loads what its run can reach itself (gatewayd.daemon's
    # load_for_run, tested with a real one-shot run in test_cli_imports_live.py).
    answer = open_in_fresh_interpreter(tmp_path, {}, preload=False)
    assert answer == {
        "threads": {},
        "network": False,
        "markdown": False,
        "json_schema": False,
    }


# Opens a daemon with one remote MCP server (tests/mcp_servers/http_server.py on
# argv[2]'s port), waits until open_daemon yields, then makes one MCP call (the server's
# first: its session opens then) and prints, as JSON, every module imported on trio's
# thread during that call.
MCP_SCRIPT: Final = """
import json, sys, threading
during_call = [False]
on_the_loop = []

class Watch:
    def find_spec(self, name, path, target=None):
        if during_call[0] and threading.current_thread() is threading.main_thread():
            on_the_loop.append(name)
        return None

sys.meta_path.insert(0, Watch())
from pathlib import Path
import trio
from gatewayd.config import GatewaydConfig
from gatewayd.daemon import open_daemon
from gatewayd.runs import Grant, RunRequest

POLICY = '''
version: 1
name: mcp-caller
tools:
  allow: [time.now]
filesystem:
  paths:
    workspace: {root: ., mode: rw}
require_os_sandbox: false
'''

async def main():
    base = Path(sys.argv[1])
    (base / "ws").mkdir()
    (base / "caller.yaml").write_text(POLICY)
    url = f"http://127.0.0.1:{sys.argv[2]}/mcp"
    config = GatewaydConfig(
        state_dir=base / "state",
        policy_dirs=(base,),
        os_sandbox=False,
        mcp_servers={"far": {"url": url, "call_timeout_s": 20}},
    )
    async with open_daemon(config, preload=sys.argv[3] == "preload") as daemon:
        request = RunRequest(
            workspacePath=str(base / "ws"),
            policy=str(base / "caller.yaml"),
            actorId="tester",
            tenantId="t1",
            grant=Grant(allowSandbox=True),
        )
        caller = await daemon.runs.start(request, policy_paths=True)
        during_call[0] = True
        with trio.fail_after(60):
            result = await daemon.mcp_servers.call_tool(
                "far", "echo", {"text": "hi"}, caller=caller, timeout_s=20
            )
        during_call[0] = False
        return {"result": result.content, "on_the_loop": sorted(set(on_the_loop))}

print(json.dumps(trio.run(main)))  # last: the daemon logs to stdout as it stops
"""
MCP_SERVERS_DIR: Final = Path(__file__).resolve().parent.parent / "mcp_servers"


def first_mcp_call(*, preload: bool) -> dict[str, object]:
    """One MCP call in a fresh daemon, its server a real one on loopback (its state under
    a short directory: a run's socket path must fit a unix socket's)."""
    base = Path(tempfile.mkdtemp(prefix="cg-lib-", dir="/tmp"))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, str(MCP_SERVERS_DIR / "http_server.py"), str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the test MCP server did not start"
                time.sleep(0.05)
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                MCP_SCRIPT,
                str(base),
                str(port),
                "preload" if preload else "no",
            ],
            capture_output=True,
            text=True,
            env=clean_env(),
            timeout=120,
            check=False,
        )
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(base, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    answer: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    assert answer["result"] == [{"type": "text", "text": "hi"}], answer
    return answer


def test_a_serving_daemons_first_mcp_call_imports_nothing_on_the_event_loop() -> None:
    # The MCP client and its SDK's transport were loaded at the daemon's start.
    answer = first_mcp_call(preload=True)
    assert answer["on_the_loop"] == [], answer["on_the_loop"]


def test_the_recorder_sees_the_mcp_client_imported_on_the_loop_when_nothing_loaded_it() -> None:
    # The positive control: the same call in a daemon that loaded nothing (preload
    # off) imports the client and the SDK on trio's thread, and the recorder says so.
    on_the_loop = first_mcp_call(preload=False)["on_the_loop"]
    assert isinstance(on_the_loop, list)
    assert {"gatewayd.mcp.client", "mcp", "anyio._backends._trio"} <= set(on_the_loop), on_the_loop


# Opens and closes a daemon with a model alias configured (argv[1]: its state directory,
# argv[2]: "preload" or not) and prints, as JSON, whether litellm was imported by then:
# the daemon's exit waits for whatever its start began.
MODELS_SCRIPT: Final = """
import json, sys
from pathlib import Path
import trio
from gatewayd.config import GatewaydConfig

async def main():
    from gatewayd.daemon import open_daemon

    config = GatewaydConfig.model_validate({
        "state_dir": sys.argv[1],
        "os_sandbox": False,
        "models": {"reviewer": {
            "provider": "openai", "model": "m", "api_base": "http://127.0.0.1:9/v1",
            "api_key_env": "COGNI_TEST_UNUSED_KEY",
        }},
    })
    async with open_daemon(config, preload=sys.argv[2] == "preload"):
        pass

trio.run(main)
print(json.dumps({"litellm": "litellm" in sys.modules}))
"""


def litellm_imported(tmp_path: Path, *, preload: bool) -> bool:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            MODELS_SCRIPT,
            str(tmp_path / "state"),
            "preload" if preload else "no",
        ],
        capture_output=True,
        text=True,
        env={**clean_env(), "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    imported: bool = json.loads(done.stdout.splitlines()[-1])["litellm"]
    return imported


def test_a_one_shot_daemon_with_models_configured_does_not_import_litellm(
    tmp_path: Path,
) -> None:
    # `gatewayd run`'s: its run may ask no model, and its exit would wait for the import;
    # a review or a model call imports it in a worker thread when one is made.
    assert litellm_imported(tmp_path, preload=False) is False


def test_a_serving_daemon_with_models_configured_imports_litellm_at_its_start(
    tmp_path: Path,
) -> None:
    # The positive control: the check above sees litellm when a start imports it.
    assert litellm_imported(tmp_path, preload=True) is True
