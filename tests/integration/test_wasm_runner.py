"""A wasm tool's model requests through a real daemon: the ``cogni.model_chat`` import
makes a nested ``model.chat`` call of the run (policy, audit, budget), answered by the
loopback fake OpenAI provider, audited with the parent call's toolCallId as prefix."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from gatewayd.config import ModelAlias
from gatewayd.policy.capabilities import Capabilities
from gatewayd.runners.rights import required_request
from gatewayd.runners.spec import FolderTool, NameNeed
from gatewayd.runners.wasm import WasmEngine, WasmToolRunner
from gatewayd.tools import builtin_tools
from gatewayd.tools.manifest import RunnerKind, ToolManifest
from gatewayd.tools.registry import Tool
from tests import wasmmodules as wm
from tests.conftest import Gateway, make_gateway
from tests.fakeprovider import FakeProvider, Text, provider_with_key
from tests.integration.test_review import call

KEY_ENV = "COGNI_TEST_WASM_CHAT_KEY"
KEY = "sk-wasm-chat-host-only-0123456789"

POLICY = """
version: 1
name: wasm-model
tools:
  allow: [test.summarize, test.sneaky, model.chat]
limits: {calls_per_second: 1000, burst: 1000}
require_os_sandbox: false
model_access:
  models: [assistant]
  max_requests: 5
  max_tokens: 1000
"""

REQUEST = json.dumps(
    {"model": "assistant", "messages": [{"role": "user", "content": "summarize: a b c"}]}
)


def wasm_tool(folder: Path, name: str, request: str, models: tuple[str, ...]) -> FolderTool:
    folder.mkdir(parents=True)
    entry = folder / "tool.wasm"
    entry.write_bytes(wm.wasm(wm.model_request(request)))
    return FolderTool(
        manifest=ToolManifest(
            name=name,
            version="1.0.0",
            summary="asks a model",
            args_schema={"type": "object"},
            runner=RunnerKind.WASM,
            capabilities=Capabilities(model_access=models),
        ),
        folder=str(folder),
        manifest_path=str(folder / "manifest.json"),
        entry=(str(entry),),
        models=tuple(NameNeed(name=model) for model in models),
    )


def as_tool(spec: FolderTool, engine: WasmEngine) -> Tool[dict[str, Any]]:
    return Tool(
        manifest=spec.manifest,
        decode=dict,
        requests=lambda _args: required_request(spec),
        runner=WasmToolRunner(spec, engine),
    )


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    with provider_with_key(KEY_ENV, KEY) as provider:
        yield provider


@pytest.fixture
async def gw(short_tmp: Path, fake: FakeProvider) -> AsyncIterator[Gateway]:
    aliases = {
        "assistant": ModelAlias(
            provider="openai", model="fake-chat", api_base=fake.api_base, api_key_env=KEY_ENV
        ),
    }
    engine = WasmEngine(short_tmp / "wasm-cache")
    tools = builtin_tools()
    tools.register(
        as_tool(wasm_tool(short_tmp / "sum", "test.summarize", REQUEST, ("assistant",)), engine)
    )
    # Declares no model, yet asks for one: answered policy_denied, no call made.
    tools.register(as_tool(wasm_tool(short_tmp / "sneaky", "test.sneaky", REQUEST, ()), engine))
    try:
        async with make_gateway(short_tmp, tools=tools, models=aliases) as gateway:
            yield gateway
    finally:
        engine.close()


async def test_a_wasm_tools_model_request_is_a_nested_audited_model_chat_call(
    gw: Gateway, workspace: Path, fake: FakeProvider
) -> None:
    fake.script(Text(content="three letters", prompt_tokens=10, completion_tokens=2))
    run = await gw.create_run(workspace, POLICY)
    answer = await call(run, "test.summarize", {}, tcid="w1")
    assert answer["ok"], answer
    assert answer["value"]["ok"] is True, answer
    assert answer["value"]["value"]["content"] == "three letters"
    assert fake.chat_requests[0].body["messages"][0]["content"] == "summarize: a b c"
    entries = await gw.audit_entries()
    nested = [e for e in entries if e.get("toolCallId") == "w1.m1"]
    assert nested and all(e["tool"] == "model.chat" for e in nested if "tool" in e)
    parent = [e for e in entries if e.get("toolCallId") == "w1"]
    assert parent and all(e["tool"] == "test.summarize" for e in parent if "tool" in e)


async def test_a_model_the_manifest_does_not_declare_is_policy_denied_without_a_call(
    gw: Gateway, workspace: Path, fake: FakeProvider
) -> None:
    run = await gw.create_run(workspace, POLICY)
    answer = await call(run, "test.sneaky", {}, tcid="s1")
    assert answer["ok"], answer
    value = answer["value"]
    assert value["ok"] is False and value["errorCode"] == "policy_denied"
    assert "declares" in value["message"] and "none" in value["message"]
    assert fake.chat_requests == []
    entries = await gw.audit_entries()
    assert not [e for e in entries if str(e.get("toolCallId", "")).startswith("s1.")]


async def test_a_run_that_does_not_allow_model_chat_answers_the_module_policy_denied(
    gw: Gateway, workspace: Path, fake: FakeProvider
) -> None:
    run = await gw.create_run(workspace, POLICY.replace(", model.chat]", "]"))
    answer = await call(run, "test.summarize", {}, tcid="n1")
    assert answer["ok"], answer
    value = answer["value"]
    assert value["ok"] is False and value["errorCode"] == "policy_denied"
    assert "'model.chat' is not allowed for this run" in value["message"]
    assert fake.chat_requests == []


async def test_a_model_request_runs_in_the_calls_slot_in_a_run_of_one_slot(
    gw: Gateway, workspace: Path, fake: FakeProvider
) -> None:
    """The nested call does not wait for a second slot: with one slot per run, its
    parent holds it, and waiting would last until the call's time limit."""
    fake.script(Text(content="one slot is enough", prompt_tokens=3, completion_tokens=4))
    policy = POLICY.replace(
        "limits: {calls_per_second: 1000, burst: 1000}",
        "limits: {calls_per_second: 1000, burst: 1000, max_concurrent_calls: 1, "
        "call_timeout_s: 20}",
    )
    run = await gw.create_run(workspace, policy)
    with trio.fail_after(10):
        answer = await call(run, "test.summarize", {}, tcid="o1")
    assert answer["ok"], answer
    assert answer["value"]["value"]["content"] == "one slot is enough"
    # The slot was given back once: the next call gets it.
    fake.script(Text(content="again", prompt_tokens=1, completion_tokens=1))
    with trio.fail_after(10):
        again = await call(run, "test.summarize", {}, tcid="o2")
    assert again["value"]["value"]["content"] == "again"
