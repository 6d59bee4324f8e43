"""An app's child run offers its caller's allowed MCP tools to the app's model: a caller
inside a real sandbox prompts the note taker; the app's model calls the pinned
``mcp.misc.echo`` of the declared misbehaving server (tests/mcp_servers/), reviewed
under the app's rules like every call of an app, audited under the child run; a pinned
tool the caller may not call is not offered to the app (never more than its caller)."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Final

import pytest

from gatewayd.apps.install import install_app
from gatewayd.daemon import open_daemon
from gatewayd.mcp.approval import Approval
from gatewayd.mcp.declaration import McpServerDeclaration
from tests.fakeprovider import Call, FakeProvider, Text
from tests.integration.test_app_invoke import (
    APP_MODEL,
    EXAMPLES,
    KEY_ENV,
    REVIEWER,
    app_config,
    base,
    call_inside,
    model,
    reviewer,
    sandboxed,
)
from tests.integration.test_mcp_pinned_tools import PY, SERVER, SERVERS_DIR
from tests.integration.test_run_sandbox import Sandboxed

__all__ = ["base", "model", "reviewer"]  # the fixtures, shared

CALLER_POLICY: Final = f"""
version: 1
name: app-mcp-caller
tools:
  allow: [app_*, mcp.misc.echo]
filesystem:
  paths:
    workspace: {{root: ., mode: rw}}
model_access:
  models: [{APP_MODEL}]
review: {{mode: "off", model: {REVIEWER}}}
limits: {{call_timeout_s: 120, calls_per_second: 100, burst: 100}}
sandbox: {{timeout_s: 60, cpu_s: 30, max_processes: 64}}
"""


@pytest.fixture
async def sb(base: Path, model: FakeProvider, reviewer: FakeProvider) -> AsyncIterator[Sandboxed]:
    config = app_config(base, model, reviewer).model_copy(
        update={
            "mcp_servers": {
                "misc": McpServerDeclaration.model_validate(
                    {
                        "command": [PY, "-I", SERVER],
                        "read_only_paths": [str(SERVERS_DIR)],
                        "call_timeout_s": 10,
                    }
                )
            }
        }
    )
    os.environ[KEY_ENV] = "sk-test-" + secrets.token_hex(8)
    try:
        async with open_daemon(config, preload=True) as daemon:
            assert daemon.runs.support.available, daemon.runs.support.reason
            yield Sandboxed(daemon, base)
    finally:
        os.environ.pop(KEY_ENV, None)


@sandboxed
async def test_an_app_calls_its_callers_allowed_mcp_tool_reviewed_by_its_rules(
    sb: Sandboxed, model: FakeProvider, reviewer: FakeProvider
) -> None:
    await Approval(sb.daemon.mcp_tools).pin("misc", tools=("echo", "env"), by="ops")
    ws = sb.workspace()
    install_app(EXAMPLES / "note-taker", ws)
    run = await sb.run(CALLER_POLICY, workspace=ws)
    model.script(
        Text(content=None, calls=(Call(name="mcp-misc-echo", arguments={"text": "via app"}),)),
        Text(content="The echo said: via app."),
    )
    answer = await call_inside(sb, run, "app_note_taker", {"prompt": "echo 'via app'"})
    assert answer["rc"] == 0, answer
    value = json.loads(answer["out"])
    assert value["ok"] is True and value["answer"] == "The echo said: via app.", value

    offered = [t["function"]["name"] for t in model.chat_requests[0].body["tools"]]
    assert offered == ["read", "write", "edit", "list", "exec", "mcp-misc-echo"]
    told = [m["content"] for m in model.chat_requests[-1].body["messages"] if m["role"] == "tool"]
    assert json.loads(told[0]) == {"content": [{"type": "text", "text": "via app"}]}
    # Reviewed under the app's rules, as every call of an app is.
    prompts = [r.body["messages"][-1]["content"] for r in reviewer.chat_requests]
    assert any("mcp.misc.echo" in p for p in prompts), prompts

    await sb.daemon.runs.end(run.run_id)
    entries = await sb.entries()
    (invoked,) = [e for e in entries if e.get("event") == "app_invoked"]
    child = invoked["detail"]["childRunId"]
    (echo,) = [
        e
        for e in entries
        if e["kind"] == "call" and e.get("runId") == child and e.get("tool") == "mcp.misc.echo"
    ]
    assert echo["decision"] == "allow"
    assert echo["review"]["app"] == "note-taker"
    assert echo["detail"]["server"] == "misc"
