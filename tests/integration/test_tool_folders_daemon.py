"""Tool folders in a real daemon (gatewayd/daemon.py with ``tool_dirs``): each valid
folder is a tool of the daemon, shown in a run's ``tools.list`` and callable only where
the run's policy allows it, its required needs held to the run's grants (a run that
lacks one is refused ``policy_denied`` naming it, before anything runs), its calls
audited with the folder and the digests; an invalid folder is skipped and the daemon
starts without it. Calls go over the run's real socket to the real wasm runner."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gatewayd.protocol import ErrorCode
from gatewayd.runs import Run
from tests import wasmmodules as wm
from tests.conftest import Gateway, make_gateway
from tests.integration.test_review import call

ALLOWING = """
version: 1
name: tool-folders
tools:
  allow: ["text.*"]
filesystem:
  paths:
    workspace: {root: ., mode: rw}
env:
  allow: [LANG]
limits: {calls_per_second: 1000, burst: 1000}
"""
NOT_ALLOWING = """
version: 1
name: no-tool-folders
tools:
  allow: [time.now]
limits: {calls_per_second: 1000, burst: 1000}
"""
# Allows the tools, but grants no workspace path and no environment variable.
LACKING = """
version: 1
name: lacking
tools:
  allow: ["text.*"]
limits: {calls_per_second: 1000, burst: 1000}
"""


def manifest(name: str, **fields: Any) -> dict[str, Any]:
    return {
        "name": name,
        "version": "1.0.0",
        "description": f"The tool {name}.",
        "input_schema": {
            "type": "object",
            "properties": {"text": {"type": "string"}},
            "required": ["text"],
        },
        "runtime": "wasm",
        "entry": "tool.wasm",
        **fields,
    }


def folder(root: Path, name: str, data: dict[str, Any], module: bytes) -> None:
    path = root / name
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps(data))
    (path / "tool.wasm").write_bytes(module)


@pytest.fixture
async def gw(short_tmp: Path) -> AsyncIterator[Gateway]:
    tools = short_tmp / "tools"
    echo = wm.wasm(wm.echo())
    folder(tools, "echo", manifest("text.echo"), echo)
    folder(
        tools,
        "reader",
        manifest(
            "text.reader",
            capabilities={"filesystem": [{"path": "docs", "access": "read"}], "env": ["LANG"]},
        ),
        echo,
    )
    folder(tools, "env", manifest("text.env", capabilities={"env": ["LANG"]}), echo)
    folder(tools, "broken", manifest("text.broken", limits={"fuel": "lots"}), echo)
    folder(tools, "fs", manifest("fs.read"), echo)  # a built-in's name
    folder(
        tools,
        "proc",
        manifest("text.proc", runtime="process", entry=["/tool/run"]),
        echo,
    )
    async with make_gateway(short_tmp, tool_dirs=(tools,)) as gateway:
        yield gateway


async def names(run: Run) -> list[str]:
    answer = await call(run, "tools.list", {})
    assert answer["ok"], answer
    return [tool["name"] for tool in answer["value"]]


async def test_a_folder_tool_is_listed_and_runs_where_the_policy_allows_it(
    gw: Gateway, workspace: Path
) -> None:
    run = await gw.create_run(workspace, ALLOWING)
    assert await names(run) == ["tools.list", "text.echo", "text.env", "text.reader"]
    answer = await call(run, "text.echo", {"text": "hello"}, tcid="e1")
    assert answer["ok"], answer
    assert answer["value"] == {"arguments": {"text": "hello"}}
    listed = (await call(run, "tools.list", {}))["value"]
    echo = next(tool for tool in listed if tool["name"] == "text.echo")
    assert echo["runner"] == "wasm"
    assert echo["argsSchema"]["required"] == ["text"]
    (entry,) = [
        e for e in await gw.audit_entries() if e.get("toolCallId") == "e1" and e.get("detail")
    ]
    detail = entry["detail"]
    assert detail["folder"].endswith("/tools/echo")
    assert detail["manifestDigest"].startswith("sha256:")
    assert detail["entryDigest"].startswith("sha256:")


async def test_a_folder_tool_the_policy_does_not_allow_is_neither_listed_nor_run(
    gw: Gateway, workspace: Path
) -> None:
    run = await gw.create_run(workspace, NOT_ALLOWING)
    assert await names(run) == ["tools.list", "time.now"]
    answer = await call(run, "text.echo", {"text": "x"})
    assert not answer["ok"]
    assert answer["errorCode"] == ErrorCode.POLICY_DENIED
    assert "'text.echo' is not allowed" in answer["safeMessage"]


@pytest.mark.parametrize(
    ("tool", "named"),
    [
        ("text.reader", "Cannot read '/workspace/docs'"),
        ("text.env", "environment variable 'LANG' is not allowed"),
    ],
)
async def test_a_required_capability_the_run_lacks_is_policy_denied_naming_it(
    gw: Gateway, workspace: Path, tool: str, named: str
) -> None:
    run = await gw.create_run(workspace, LACKING)
    answer = await call(run, tool, {"text": "x"})
    assert not answer["ok"]
    assert answer["errorCode"] == ErrorCode.POLICY_DENIED
    assert named in answer["safeMessage"]


async def test_arguments_are_checked_against_the_manifests_schema(
    gw: Gateway, workspace: Path
) -> None:
    run = await gw.create_run(workspace, ALLOWING)
    answer = await call(run, "text.echo", {"text": 3})
    assert answer["errorCode"] == ErrorCode.INVALID_ARGS
    assert "at $.text: 3 is not of type 'string'" in answer["safeMessage"]


async def test_invalid_folders_are_skipped_and_the_daemon_starts_without_them(
    gw: Gateway,
) -> None:
    folders = gw.daemon.tool_folders
    assert [tool.name for tool in folders.tools] == ["text.echo", "text.env", "text.reader"]
    problems = {Path(p.file).parent.name: p for p in folders.problems}
    assert set(problems) == {"broken", "fs", "proc"}
    assert problems["broken"].field == "limits.fuel"
    assert "one of gatewayd's own tools" in problems["fs"].reason
    # This daemon has no OS sandbox: a process tool has nowhere to run.
    assert "os_sandbox: false" in problems["proc"].reason
    assert "text.broken" not in gw.daemon.dispatcher.tools
    assert gw.daemon.wasm is not None
