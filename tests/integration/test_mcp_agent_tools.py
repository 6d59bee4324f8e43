"""The host-owned agent loop offers a run's allowed, pinned MCP tools to the model,
beside its five tools: a real agent run (a git checkout, the real sandbox, a fake
OpenAI-compatible provider driven through litellm) calling the declared misbehaving
server's ``echo`` (tests/mcp_servers/misbehaving_server.py) in a sandbox of its own.
The model calls it by its function name (dots made hyphens); a pinned tool the policy
does not allow is not offered; every call is audited like any other."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

from gatewayd.agent.loop import run_agent
from gatewayd.daemon import open_daemon
from gatewayd.mcp.approval import Approval
from tests.fakeprovider import Call, FakeProvider, Text
from tests.gitserver import DEFAULT_TOKEN, GitServer, make_bare_repo
from tests.integration.test_agent_run import (
    MODEL_KEY,
    MODEL_KEY_ENV,
    REPO_FILES,
    TOKEN_ENV,
    agent_config,
    base,
    by_event,
    pytestmark,
    server,
    task,
    tool_results,
)
from tests.integration.test_mcp_pinned_tools import PY, SERVER, SERVERS_DIR

__all__ = ["base", "pytestmark", "server"]  # the fixtures and the skip, shared

POLICY: Final = """\
version: 1
name: agent-mcp
description: The agent policy, plus one MCP tool.
tools:
  allow: ["fs.read", "fs.write", "fs.edit", "fs.list", "sandbox.exec", "mcp.misc.echo"]
filesystem:
  paths:
    checkout: {root: ., mode: rw}
model_access:
  models: [agent-model]
review: {mode: "off"}
limits: {call_timeout_s: 120}
"""


async def test_an_agent_run_offers_and_calls_its_allowed_pinned_mcp_tools(
    base: Path, server: GitServer
) -> None:
    sha = make_bare_repo(server.root, "calc.git", dict(REPO_FILES))
    (base / "policies").mkdir()
    (base / "policies" / "agent-mcp.yaml").write_text(POLICY)
    with FakeProvider() as provider:
        config = agent_config(
            base,
            provider,
            mcp_servers={
                "misc": {
                    "command": [PY, "-I", SERVER],
                    "read_only_paths": [str(SERVERS_DIR)],
                    "call_timeout_s": 10,
                }
            },
        )
        config = config.model_copy(update={"policy_dirs": (*config.policy_dirs, base / "policies")})
        os.environ[TOKEN_ENV] = DEFAULT_TOKEN
        os.environ[MODEL_KEY_ENV] = MODEL_KEY
        try:
            async with open_daemon(config, preload=True) as daemon:
                await Approval(daemon.mcp_tools).pin("misc", tools=("echo", "env"), by="ops")
                provider.script(
                    Text(
                        content=None,
                        calls=(Call(name="mcp-misc-echo", arguments={"text": "from the model"}),),
                    ),
                    Text(
                        content=None,
                        calls=(Call(name="mcp-misc-env", arguments={"name": "PATH"}),),
                    ),
                    Text(content="Nothing to change\n\nThe echo answered."),
                )
                result = await run_agent(
                    daemon.runs,
                    daemon.dispatcher,
                    task(server.url_for("calc.git"), sha, policy="agent-mcp", push=False),
                    mcp=daemon.mcp_tools,
                )
        finally:
            os.environ.pop(TOKEN_ENV, None)
            os.environ.pop(MODEL_KEY_ENV, None)
        offered = {
            t["function"]["name"]: t["function"] for t in provider.chat_requests[0].body["tools"]
        }
        told = tool_results(provider)
    # The five, and the one pinned MCP tool the policy allows (env is pinned, not allowed).
    assert list(offered) == ["read", "write", "edit", "list", "exec", "mcp-misc-echo"]
    echo = offered["mcp-misc-echo"]
    assert echo["description"] == "Echo the text back."
    assert echo["parameters"]["required"] == ["text"]
    assert told[0] == {"content": [{"type": "text", "text": "from the model"}]}
    # A pinned tool the policy does not allow is no tool the model can name.
    assert told[1] == {
        "error": "bad_request",
        "message": "there is no tool 'mcp-misc-env'; the tools are read, write, edit, list, "
        "exec, mcp-misc-echo",
    }
    assert any("MCP tools offered: mcp.misc.echo" in line for line in result.logs)
    calls = [
        e for e in result.audit_log if e["kind"] == "call" and e.get("tool", "").startswith("mcp.")
    ]
    assert [(c["tool"], c["decision"]) for c in calls] == [("mcp.misc.echo", "allow")]
    assert calls[0]["detail"]["server"] == "misc"
    assert by_event(result.audit_log, "agent_call_refused")  # mcp-misc-env: no such tool
