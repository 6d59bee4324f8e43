"""The host-owned agent loop offers a run's allowed tool-folder tools to the model, like
its apps and MCP tools: a real agent run (a git checkout, an overlay workspace, the real
sandbox, a fake OpenAI-compatible provider driven through litellm) calling the example
wasm tool ``files.write`` (examples/tools/write). Its write lands in the run's workspace
session, not in the checkout's base, and so reaches the host only as the run's patch."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

from gatewayd.agent.loop import run_agent
from gatewayd.daemon import open_daemon
from tests.exampletools import copy_examples
from tests.fakeprovider import Call, FakeProvider, Text
from tests.gitserver import DEFAULT_TOKEN, GitServer, make_bare_repo
from tests.integration.test_agent_run import (
    MODEL_KEY,
    MODEL_KEY_ENV,
    REPO_FILES,
    TOKEN_ENV,
    agent_config,
    base,
    pytestmark,
    server,
    task,
    tool_results,
)

__all__ = ["base", "pytestmark", "server"]  # the fixtures and the skip, shared

POLICY: Final = """\
version: 1
name: agent-folder-tools
description: The agent policy, plus one tool folder's tool.
tools:
  allow: ["fs.read", "fs.write", "fs.edit", "fs.list", "sandbox.exec", "files.write"]
filesystem:
  paths:
    checkout: {root: ., mode: rw}
model_access:
  models: [agent-model]
review: {mode: "off"}
limits: {call_timeout_s: 120}
"""


async def test_an_agent_run_offers_its_allowed_folder_tools_and_their_writes_make_the_patch(
    base: Path, server: GitServer
) -> None:
    sha = make_bare_repo(server.root, "calc.git", dict(REPO_FILES))
    (base / "policies").mkdir()
    (base / "policies" / "agent-folder-tools.yaml").write_text(POLICY)
    tool_dir = copy_examples(base / "tools", ("write", "wordcount"))
    with FakeProvider() as provider:
        config = agent_config(base, provider, tool_dirs=(tool_dir,))
        config = config.model_copy(update={"policy_dirs": (*config.policy_dirs, base / "policies")})
        os.environ[TOKEN_ENV] = DEFAULT_TOKEN
        os.environ[MODEL_KEY_ENV] = MODEL_KEY
        try:
            async with open_daemon(config, preload=True) as daemon:
                provider.script(
                    Text(
                        content=None,
                        calls=(
                            Call(
                                name="files-write",
                                arguments={"path": "notes.txt", "content": "from the tool\n"},
                            ),
                        ),
                    ),
                    Text(content=None, calls=(Call(name="text-wordcount", arguments={}),)),
                    Text(content="Add out/notes.txt\n\nThe tool wrote the notes."),
                )
                result = await run_agent(
                    daemon.runs,
                    daemon.dispatcher,
                    task(server.url_for("calc.git"), sha, policy="agent-folder-tools", push=False),
                    folder_tools=tuple(tool.name for tool in daemon.tool_folders.tools),
                )
        finally:
            os.environ.pop(TOKEN_ENV, None)
            os.environ.pop(MODEL_KEY_ENV, None)
        offered = [t["function"]["name"] for t in provider.chat_requests[0].body["tools"]]
        told = tool_results(provider)
    # The five and the folder tool the policy allows; text.wordcount is loaded, not allowed.
    assert offered == ["read", "write", "edit", "list", "exec", "files-write"]
    assert told[1]["error"] == "bad_request" and "no tool 'text-wordcount'" in told[1]["message"]
    assert any("folder tools offered: files.write" in line for line in result.logs)
    assert result.ok, result.message
    # The wasm tool wrote into the run's workspace session: the write is the patch.
    (patch,) = result.patches
    assert "out/notes.txt" in patch and "+from the tool" in patch
    calls = [e for e in result.audit_log if e["kind"] == "call" and e.get("tool") == "files.write"]
    assert [c["decision"] for c in calls] == ["allow"]
    assert calls[0]["detail"]["entryDigest"].startswith("sha256:")
