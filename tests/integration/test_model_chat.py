"""model.chat over a real run socket, answered through litellm by a real OpenAI-compatible
server on loopback (tests/fakeprovider.py): the grant, the budget, provider errors, and a
provider that echoes the key back."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from gatewayd.config import ModelAlias
from tests.conftest import Gateway, make_gateway
from tests.fakeprovider import FakeProvider, HttpError, Text, provider_with_key
from tests.integration.test_review import call

KEY_ENV = "COGNI_TEST_CHAT_KEY"
KEY = "sk-chat-host-only-9876543210"

POLICY = """
version: 1
name: chatty
tools:
  allow: [model.chat]
limits: {calls_per_second: 1000, burst: 1000}
require_os_sandbox: false
model_access:
  models: [assistant]
  max_requests: 3
  max_tokens: 1000
"""


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
        "other": ModelAlias(
            provider="openai", model="fake-other", api_base=fake.api_base, api_key_env=KEY_ENV
        ),
    }
    async with make_gateway(short_tmp, models=aliases) as gateway:
        yield gateway


def chat(model: str = "assistant", text: str = "hello") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}]}


async def test_a_granted_model_answers_with_content_and_usage(
    gw: Gateway, workspace: Path, fake: FakeProvider
) -> None:
    fake.script(Text(content="hi there", prompt_tokens=12, completion_tokens=3))
    run = await gw.create_run(workspace, POLICY)
    answer = await call(run, "model.chat", {**chat(), "max_tokens": 50, "temperature": 0.2})
    assert answer["ok"], answer
    assert answer["value"] == {
        "model": "assistant",
        "content": "hi there",
        "usage": {"promptTokens": 12, "completionTokens": 3},
    }
    sent = fake.chat_requests[0]
    assert sent.body["model"] == "fake-chat" and sent.body["max_tokens"] == 50
    assert sent.body["messages"] == [{"role": "user", "content": "hello"}]
    assert sent.authorization == f"Bearer {KEY}"  # the key stays on the host side
    assert KEY not in str(answer)


async def test_a_model_the_policy_does_not_grant_is_refused_naming_the_granted_ones(
    gw: Gateway, workspace: Path, fake: FakeProvider
) -> None:
    run = await gw.create_run(workspace, POLICY)
    answer = await call(run, "model.chat", chat(model="other"))
    assert answer["errorCode"] == "policy_denied"
    assert "models it may use: assistant" in answer["safeMessage"]
    assert fake.chat_requests == []


async def test_the_runs_request_budget_runs_out_with_rate_limited(
    gw: Gateway, workspace: Path, fake: FakeProvider
) -> None:
    run = await gw.create_run(workspace, POLICY)
    for n in range(3):
        assert (await call(run, "model.chat", chat(), f"c{n}"))["ok"]
    spent = await call(run, "model.chat", chat(), "c3")
    assert spent["errorCode"] == "rate_limited"
    assert "3 model requests are spent" in spent["safeMessage"]
    assert len(fake.chat_requests) == 3


async def test_the_runs_token_budget_runs_out_with_rate_limited(
    gw: Gateway, workspace: Path, fake: FakeProvider
) -> None:
    fake.script(Text(content="long", prompt_tokens=900, completion_tokens=200))
    run = await gw.create_run(workspace, POLICY)
    assert (await call(run, "model.chat", chat(), "a"))["ok"]
    spent = await call(run, "model.chat", chat(), "b")
    assert spent["errorCode"] == "rate_limited" and "1000 model tokens" in spent["safeMessage"]


async def test_a_provider_error_is_tool_failed_and_an_echoed_key_never_leaks(
    gw: Gateway, workspace: Path, fake: FakeProvider
) -> None:
    fake.script(HttpError(status=500, message=f"boom, your key was {KEY}"))
    run = await gw.create_run(workspace, POLICY)
    answer = await call(run, "model.chat", chat())
    assert answer["errorCode"] == "tool_failed"
    assert "the model call failed (provider_error)" in answer["safeMessage"]
    assert KEY not in answer["safeMessage"]
    assert "boom" in answer["safeMessage"]  # the provider's own words help the agent
    entries = (gw.audit_path.read_text() if gw.audit_path.exists() else "") + str(
        await gw.audit_entries()
    )
    assert KEY not in entries


async def test_malformed_chat_arguments_are_invalid_args_with_the_schema_hint(
    gw: Gateway, workspace: Path, fake: FakeProvider
) -> None:
    run = await gw.create_run(workspace, POLICY)
    answer = await call(run, "model.chat", {"model": "assistant", "messages": []})
    assert answer["errorCode"] == "invalid_args" and "tools.list" in answer["safeMessage"]
    answer = await call(
        run, "model.chat", {"model": "assistant", "messages": [{"role": "root", "content": "x"}]}
    )
    assert answer["errorCode"] == "invalid_args"


@pytest.mark.parametrize(
    ("reply", "kind", "hint"),
    [
        (HttpError(status=500, message="overloaded"), "provider_error", "overloaded"),
        (HttpError(status=401, message="bad key"), "auth", "refused gatewayd's key"),
        (HttpError(status=429, message="slow down"), "rate_limited", "wait before calling"),
    ],
)
async def test_model_errors_tell_the_sandbox_no_endpoint_or_variable_and_the_log_all(
    gw: Gateway, workspace: Path, fake: FakeProvider, reply: HttpError, kind: str, hint: str
) -> None:
    fake.script(reply)
    run = await gw.create_run(workspace, POLICY)
    with capture_logs() as logs:
        answer = await call(run, "model.chat", chat())
    message = answer["safeMessage"]
    assert answer["errorCode"] == "tool_failed"
    assert message.startswith(f"the model call failed ({kind}): model alias 'assistant'")
    assert hint in message
    for host_detail in (fake.api_base, f":{fake.port}", "127.0.0.1", KEY_ENV):
        assert host_detail not in message
    logged = [e for e in logs if e["event"] == "model_call_failed"]
    assert logged and fake.api_base in logged[0]["error"]  # the operator sees where
