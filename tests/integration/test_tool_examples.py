"""The example tools (examples/tools/), built by ``make tools``, each called through a real
daemon that loaded them from a tool directory, in a real sandboxed run, through the
dispatcher (allowlist, argument schema, capabilities, audit, the runner): what an
operator gets from dropping the folders into ``tool_dirs``.

The model example asks a real OpenAI-compatible server on loopback (tests/fakeprovider.py)
through litellm, as every model call does.
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

from gatewayd.audit import Peer
from gatewayd.config import GatewaydConfig, ModelAlias, SandboxUids
from gatewayd.daemon import Daemon, open_daemon
from gatewayd.protocol import ErrorCode, Request, Response
from gatewayd.runs import Grant, Run, RunLimits, RunRequest
from tests.exampletools import TOOL_NAMES, copy_examples
from tests.fakeprovider import FakeProvider, Text, provider_with_key
from tests.responses import failure, value

KEY_ENV = "COGNI_TEST_EXAMPLES_KEY"
KEY = "sk-examples-host-only-0123456789"
PEER = Peer(pid=4242, uid=1000, gid=1000)

# src/ read-only, out/ read-write, the model alias the summarize example declares (its
# requests are model.chat calls of the run: the run allows that tool too).
POLICY = """
version: 1
name: tool-examples
tools:
  allow: ["text.*", "files.*", model.chat]
filesystem:
  paths:
    src: {root: src, mode: ro}
    out: {root: out, mode: rw}
model_access:
  models: [default]
  max_requests: 2
limits: {calls_per_second: 1000, burst: 1000, call_timeout_s: 20}
sandbox: {timeout_s: 30, cpu_s: 20}
"""


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "sandboxed runs need root (network namespaces, a uid per run)"
    if not os.path.exists("/usr/bin/bwrap") or not os.path.exists("/usr/bin/python3"):
        return "needs bubblewrap at /usr/bin/bwrap and the system python3 (the process example)"
    return None


pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))


class Examples:
    """A daemon whose tool directory holds the examples, and a run of it."""

    def __init__(self, daemon: Daemon, base: Path, run: Run, workspace: Path) -> None:
        self.daemon = daemon
        self.base = base
        self.run = run
        self.workspace = workspace
        self._ids = 0

    async def start(self, policy_text: str) -> Run:
        """Another run, on a workspace of its own (one workspace serves one run)."""
        token = secrets.token_hex(4)
        policy = self.base / f"policy-{token}.yaml"
        policy.write_text(textwrap.dedent(policy_text))
        request = RunRequest(
            workspacePath=str(make_workspace(self.base / f"ws-{token}")),
            policy=str(policy),
            actorId="tester",
            tenantId="t1",
            grant=Grant(allowSandbox=True),
            limits=RunLimits(maxMemoryMb=1024),
        )
        return await self.daemon.runs.start(request, policy_paths=True)

    async def call(self, tool: str, args: dict[str, Any], run: Run | None = None) -> Response:
        self._ids += 1
        run = run or self.run
        request = Request(v=1, runId=run.run_id, toolCallId=f"c{self._ids}", tool=tool, args=args)
        return await self.daemon.dispatcher.handle(run, request, PEER)

    async def entries(self) -> list[dict[str, Any]]:
        audit = self.daemon.audit
        await audit.durable(audit.last_seq)
        text = self.daemon.config.resolved_audit_path.read_text()
        return [json.loads(line) for line in text.splitlines() if line]


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    with provider_with_key(KEY_ENV, KEY) as provider:
        yield provider


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-ex-", dir="/tmp"))
    path.chmod(0o711)  # the run's uid passes through to its workspace
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def make_workspace(ws: Path) -> Path:
    (ws / "src" / "deep").mkdir(parents=True)
    (ws / "src" / "a.txt").write_text("alpha\nthe needle is here\nomega\n")
    (ws / "src" / "deep" / "b.md").write_text("# notes\nanother needle\nneedle again\n")
    (ws / "src" / "binary.bin").write_bytes(b"needle\0\x01\x02")
    # What a hostile workspace holds for a search: a link out of src/ and a FIFO.
    (ws / "src" / "link-out").symlink_to("../secret.txt")
    os.mkfifo(ws / "src" / "fifo")
    (ws / "out").mkdir()
    # Beside src/ and out/: a file the examples were never granted.
    (ws / "secret.txt").write_text("a needle nobody may find\n")
    return ws


@pytest.fixture
async def ex(base: Path, fake: FakeProvider) -> AsyncIterator[Examples]:
    tools = copy_examples(base / "tools")
    workspace = make_workspace(base / "ws")
    config = GatewaydConfig(
        state_dir=base / "state",
        policy_dirs=(base,),
        netns_prefix=f"cgx{secrets.token_hex(4)}-",
        sandbox_uids=SandboxUids(base=1_710_000_000 + secrets.randbelow(50_000) * 1024, count=64),
        audit_fsync=False,
        tool_dirs=(tools,),
        # What the example tools write is looked for in the workspace itself.
        workspace_mode="host",
        models={
            "default": ModelAlias(
                provider="openai", model="fake-chat", api_base=fake.api_base, api_key_env=KEY_ENV
            )
        },
    )
    async with open_daemon(config, preload=True) as daemon:
        assert daemon.runs.support.available, daemon.runs.support.reason
        for name in TOOL_NAMES.values():
            assert name in daemon.dispatcher.tools, (name, daemon.tool_folders)
        policy = base / "policy.yaml"
        policy.write_text(textwrap.dedent(POLICY))
        request = RunRequest(
            workspacePath=str(workspace),
            policy=str(policy),
            actorId="tester",
            tenantId="t1",
            grant=Grant(allowSandbox=True),
            limits=RunLimits(maxMemoryMb=1024),
        )
        run = await daemon.runs.start(request, policy_paths=True)
        yield Examples(daemon, base, run, workspace)


# --- text.wordcount: no capability -------------------------------------------------------


async def test_wordcount_counts_and_its_call_is_audited_with_the_modules_digest(
    ex: Examples,
) -> None:
    answer = await ex.call("text.wordcount", {"text": "héllo  big\nworld"})
    assert value(answer) == {"words": 3, "lines": 2, "chars": 16, "bytes": 17}
    (entry,) = [
        e for e in await ex.entries() if e.get("toolCallId") == "c1" and e.get("kind") == "call"
    ]
    assert entry["tool"] == "text.wordcount"
    detail = entry["detail"]
    assert detail["folder"].endswith("/tools/wordcount")
    assert detail["entryDigest"].startswith("sha256:")
    assert detail["manifestDigest"].startswith("sha256:")


async def test_wordcount_arguments_outside_its_schema_are_invalid_args_naming_the_field(
    ex: Examples,
) -> None:
    message = failure(await ex.call("text.wordcount", {}), ErrorCode.INVALID_ARGS)
    assert "'text' is a required property" in message
    message = failure(
        await ex.call("text.wordcount", {"text": "x", "extra": 1}), ErrorCode.INVALID_ARGS
    )
    assert "extra" in message


# --- files.search: src/ read-only ----------------------------------------------------------


async def test_search_finds_lines_beneath_src_and_nothing_else_of_the_workspace(
    ex: Examples,
) -> None:
    found = value(await ex.call("files.search", {"query": "needle"}))
    matches = sorted((m["path"], m["line"]) for m in found["matches"])
    assert matches == [
        ("/workspace/src/a.txt", 2),
        ("/workspace/src/deep/b.md", 2),
        ("/workspace/src/deep/b.md", 3),
    ]  # secret.txt lies outside src/ (link-out is not followed); binary.bin is binary;
    # the FIFO is skipped, not opened (opening it would wait for a writer)
    assert found["truncated"] is False
    bounded = value(await ex.call("files.search", {"query": "needle", "max_results": 1}))
    assert len(bounded["matches"]) == 1 and bounded["truncated"] is True


async def test_search_cannot_climb_out_of_src(ex: Examples) -> None:
    message = failure(
        await ex.call("files.search", {"query": "needle", "path": "../"}), ErrorCode.TOOL_FAILED
    )
    assert 'may not contain ".."' in message


async def test_search_in_a_run_that_does_not_grant_src_is_policy_denied_naming_it(
    ex: Examples,
) -> None:
    run = await ex.start(POLICY.replace("    src: {root: src, mode: ro}\n", ""))
    message = failure(await ex.call("files.search", {"query": "x"}, run), ErrorCode.POLICY_DENIED)
    assert "/workspace/src" in message


# --- files.write: out/ read-write ----------------------------------------------------------


async def test_write_writes_beneath_out_and_cannot_write_elsewhere(ex: Examples) -> None:
    answer = value(await ex.call("files.write", {"path": "n/x.txt", "content": "made\n"}))
    assert answer == {"path": "/workspace/out/n/x.txt", "bytes": 5, "appended": False}
    assert (ex.workspace / "out" / "n" / "x.txt").read_text() == "made\n"
    value(await ex.call("files.write", {"path": "n/x.txt", "content": "more\n", "append": True}))
    assert (ex.workspace / "out" / "n" / "x.txt").read_text() == "made\nmore\n"
    message = failure(
        await ex.call("files.write", {"path": "../escape.txt", "content": "x"}),
        ErrorCode.TOOL_FAILED,
    )
    assert 'may not contain ".."' in message
    assert not (ex.workspace / "escape.txt").exists()


async def test_write_in_a_run_granting_out_read_only_is_policy_denied(ex: Examples) -> None:
    run = await ex.start(POLICY.replace("out: {root: out, mode: rw}", "out: {root: out, mode: ro}"))
    message = failure(
        await ex.call("files.write", {"path": "x.txt", "content": "x"}, run),
        ErrorCode.POLICY_DENIED,
    )
    assert "/workspace/out" in message


# --- text.summarize: the host's model ------------------------------------------------------


async def test_summarize_asks_the_model_through_a_nested_call_of_the_run(
    ex: Examples, fake: FakeProvider
) -> None:
    fake.script(Text(content="A short summary.", prompt_tokens=40, completion_tokens=4))
    answer = value(
        await ex.call("text.summarize", {"text": "A long text about needles.", "max_words": 5})
    )
    assert answer == {
        "summary": "A short summary.",
        "model": "default",
        "usage": {"promptTokens": 40, "completionTokens": 4},
    }
    (sent,) = fake.chat_requests
    assert sent.authorization == f"Bearer {KEY}"  # the key is the host's, never the tool's
    assert sent.body["messages"][1] == {"role": "user", "content": "A long text about needles."}
    assert "at most 5 words" in sent.body["messages"][0]["content"]
    nested = [e for e in await ex.entries() if e.get("toolCallId") == "c1.m1"]
    assert nested and all(e["tool"] == "model.chat" for e in nested)
    assert KEY not in json.dumps(answer)


async def test_summarize_in_a_run_without_the_model_is_policy_denied_before_it_runs(
    ex: Examples, fake: FakeProvider
) -> None:
    run = await ex.start(POLICY.replace("models: [default]", "models: []"))
    message = failure(await ex.call("text.summarize", {"text": "x"}, run), ErrorCode.POLICY_DENIED)
    assert "default" in message
    assert fake.chat_requests == []


async def test_summarize_stops_when_the_runs_model_budget_is_spent(
    ex: Examples, fake: FakeProvider
) -> None:
    for _ in range(2):  # the policy's max_requests
        value(await ex.call("text.summarize", {"text": "x"}))
    failure(await ex.call("text.summarize", {"text": "x"}), ErrorCode.RATE_LIMITED)
    assert len(fake.chat_requests) == 2


# --- files.lines: a process tool ------------------------------------------------------------


async def test_lines_counts_in_a_fresh_sandbox_that_shows_only_src(ex: Examples) -> None:
    answer = value(
        await ex.call(
            "files.lines",
            {"paths": ["src/a.txt", "src/deep/b.md", "secret.txt", "src/link-out", "src/fifo"]},
        )
    )
    missing = "No such file or directory"
    assert answer == {
        "files": [
            {"path": "/workspace/src/a.txt", "lines": 3},
            {"path": "/workspace/src/deep/b.md", "lines": 3},
            {"path": "/workspace/secret.txt", "error": missing},  # not in its sandbox
            {"path": "/workspace/src/link-out", "error": missing},  # leads there
            {"path": "/workspace/src/fifo", "error": "not a regular file"},  # never waited on
        ],
        "total": 6,
    }


async def test_lines_refuses_a_path_that_climbs_with_its_own_message(ex: Examples) -> None:
    message = failure(
        await ex.call("files.lines", {"paths": ["src/../../etc/passwd"]}), ErrorCode.TOOL_FAILED
    )
    assert "without '..'" in message
