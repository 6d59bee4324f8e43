"""A provider's reply is read at most up to a cap (models.<alias>.max_reply_bytes).

The fake provider on loopback (tests/fakeprovider.py) sends replies far past the cap, made
and sent a piece at a time, in every framing a client must handle (a Content-Length, HTTP/1.1
chunked, ended by closing the connection), compressed (a gzip bomb: small on the wire, huge
inflated), as a success and as an error status, to both of litellm's HTTP paths (the OpenAI
SDK for ``openai/``, litellm's own handler for ``hosted_vllm/``). Each fails as
``too_large`` naming the cap, and the fake sees the connection closed long before the end;
a child process's peak memory shows gatewayd never holds the reply. Then every caller: the
``model.chat`` tool fails with ``tool_failed``, the rule review fails closed, and the agent
run ends ``internal``. A reply at the cap exactly is read whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from gatewayd import model_client
from gatewayd.agent.loop import run_agent
from gatewayd.config import DEFAULT_MAX_REPLY_BYTES, MIN_REPLY_BYTES, ModelAlias
from gatewayd.daemon import open_daemon
from gatewayd.model_client import ModelCallError, ModelCallKind, complete
from gatewayd.model_transport import ACCEPT_ENCODING
from tests.conftest import Gateway, make_gateway
from tests.fakeprovider import Call, FakeProvider, Huge, Malformed, Text, provider_with_key
from tests.gitserver import DEFAULT_TOKEN, GitServer, make_bare_repo
from tests.integration.test_agent_run import (
    MODEL_KEY,
    MODEL_KEY_ENV,
    REPO_FILES,
    TOKEN_ENV,
    agent_base,
    agent_config,
    task,
)
from tests.integration.test_model_client import DEEP, DEEP_VALID
from tests.integration.test_review import REVIEWED, beside_a_call_in_flight, call, calls_of
from tests.integration.test_run_sandbox import _unavailable

KEY_ENV = "COGNI_TEST_REPLY_CAP_KEY"
KEY = "sk-reply-cap-host-only-0123456789"
MESSAGES = [{"role": "user", "content": "hello"}]
ROOT = Path(__file__).resolve().parents[2]
# Well past the default cap: what an outside review saw read whole and accepted.
ATTACK_BYTES = 50 << 20
# What the child process is sent: big enough that holding it would show in its peak RSS.
RSS_ATTACK_BYTES = 256 << 20
# The child's peak may grow by this much at most over its peak after a reply at the cap
# (which it must read whole): an eighth of the attack, far below holding any of it.
RSS_SLACK_BYTES = RSS_ATTACK_BYTES // 8
# Both of litellm's HTTP paths: the OpenAI SDK's client, and litellm's own handler.
ROUTES = ("openai", "hosted_vllm")
ATTACKS = [
    pytest.param(Huge(size=ATTACK_BYTES), id="content-length"),
    pytest.param(Huge(size=ATTACK_BYTES, framing="chunked"), id="chunked"),
    pytest.param(Huge(size=ATTACK_BYTES, framing="close"), id="close-delimited"),
    pytest.param(Huge(size=ATTACK_BYTES, status=500), id="error-status"),
    pytest.param(Huge(size=ATTACK_BYTES, gzip=True), id="gzip-bomb"),
    pytest.param(Huge(size=ATTACK_BYTES, gzip=True, framing="chunked"), id="gzip-bomb-chunked"),
]


@pytest.fixture(scope="module", autouse=True)
def _litellm_loaded() -> None:
    model_client.preload()


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    with provider_with_key(KEY_ENV, KEY) as provider:
        yield provider


def alias_for(fake: FakeProvider, provider: str = "openai", **fields: Any) -> ModelAlias:
    return ModelAlias(
        provider=provider,
        model="fake-model",
        api_base=fake.api_base,
        api_key_env=KEY_ENV,
        **fields,
    )


async def failing_call(alias: ModelAlias) -> ModelCallError:
    with pytest.raises(ModelCallError) as caught:
        await complete(alias, MESSAGES, timeout_s=30, alias_name="assistant")
    return caught.value


def assert_names_the_cap(message: str, cap: int) -> None:
    assert f"passed the cap of {cap} bytes" in message
    assert "max_reply_bytes" in message  # the setting that changes it
    assert KEY not in message


def assert_cut_short(fake: FakeProvider, reply: Huge) -> None:
    """The fake saw the connection closed before it had sent the reply (a gzip bomb is
    small on the wire, so that proof is the child's memory instead)."""
    [sent] = fake.wait_huge_sent()
    if not reply.gzip:
        assert not sent.finished and sent.wire_bytes < reply.size // 2, sent


# --- the model client, on both of litellm's paths ----------------------------------------


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("reply", ATTACKS)
async def test_a_reply_past_the_cap_fails_too_large_and_is_not_read_to_its_end(
    fake: FakeProvider, route: str, reply: Huge
) -> None:
    fake.script(reply)
    error = await failing_call(alias_for(fake, route))
    assert error.kind is ModelCallKind.TOO_LARGE
    assert_names_the_cap(str(error), DEFAULT_MAX_REPLY_BYTES)
    assert_cut_short(fake, reply)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    "reply",
    [
        pytest.param(Huge(size=MIN_REPLY_BYTES), id="content-length"),
        pytest.param(Huge(size=MIN_REPLY_BYTES, framing="chunked"), id="chunked"),
        pytest.param(Huge(size=MIN_REPLY_BYTES, framing="close"), id="close-delimited"),
        pytest.param(Huge(size=MIN_REPLY_BYTES, gzip=True), id="gzip"),
    ],
)
async def test_an_aliases_own_cap_holds_to_the_byte_decoded(
    fake: FakeProvider, route: str, reply: Huge
) -> None:
    """At the cap exactly the reply is read whole; one byte more (inflated, for gzip: on
    the wire it is far below the cap) fails naming the alias's own cap."""
    alias = alias_for(fake, route, max_reply_bytes=MIN_REPLY_BYTES)
    fake.script(reply)
    answer = await complete(alias, MESSAGES, timeout_s=30)
    assert answer.text == reply.text("fake-model")
    fake.script(Huge(size=reply.size + 1, framing=reply.framing, gzip=reply.gzip))
    error = await failing_call(alias)
    assert error.kind is ModelCallKind.TOO_LARGE
    assert_names_the_cap(str(error), MIN_REPLY_BYTES)


async def test_a_reply_at_the_default_cap_is_read_whole(fake: FakeProvider) -> None:
    reply = Huge(size=DEFAULT_MAX_REPLY_BYTES)
    fake.script(reply)
    answer = await complete(alias_for(fake), MESSAGES, timeout_s=30)
    assert answer.text == reply.text("fake-model")
    # gatewayd asks for the one coding it inflates in bounded pieces.
    assert fake.chat_requests[0].headers["accept-encoding"] == ACCEPT_ENCODING


@pytest.mark.parametrize(
    ("coding", "body", "says"),
    [
        ("br", b"\x1b\x00", "content coding 'br', which gatewayd did not ask for"),
        ("zstd", b"\x28\xb5\x2f\xfd", "content coding 'zstd', which gatewayd did not ask for"),
        ("gzip, gzip", b"\x1f\x8b", "stacked content codings (gzip, gzip)"),
        ("gzip", b"plainly not gzip", "gzip body is corrupt"),
    ],
)
async def test_a_reply_in_a_coding_gatewayd_cannot_bound_is_malformed(
    fake: FakeProvider, coding: str, body: bytes, says: str
) -> None:
    """A coding gatewayd would have to hand to a decoder it cannot bound (or a stack of
    codings, or a corrupt body) is refused, not decoded."""
    fake.script(Malformed(body=body, headers={"Content-Encoding": coding}))
    error = await failing_call(alias_for(fake))
    assert error.kind is ModelCallKind.MALFORMED
    assert says in str(error) and "OpenAI-compatible" in str(error)
    assert KEY not in str(error)


def test_gatewayds_memory_does_not_grow_with_the_reply(fake: FakeProvider) -> None:
    """A child process (model_client as gatewayd runs it) reads a reply at the cap, then a
    gzip bomb and a close-delimited reply of RSS_ATTACK_BYTES each: its peak RSS barely
    moves past what the reply at the cap took."""
    script = textwrap.dedent(
        """
        import json, resource, sys, trio
        from gatewayd import model_client
        from gatewayd.config import ModelAlias

        alias = ModelAlias(provider="openai", model="fake-model", api_base=sys.argv[1])
        model_client.preload()

        async def ask():
            try:
                answer = await model_client.complete(
                    alias, [{"role": "user", "content": "hi"}], timeout_s=60
                )
            except model_client.ModelCallError as exc:
                return str(exc.kind)
            return f"ok {len(answer.text)}"

        for _ in range(int(sys.argv[2])):
            outcome = trio.run(ask)
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            print(json.dumps({"outcome": outcome, "peak": peak}), flush=True)
        """
    )
    at_cap = Huge(size=DEFAULT_MAX_REPLY_BYTES)
    fake.script(
        at_cap,
        Huge(size=RSS_ATTACK_BYTES, gzip=True),
        Huge(size=RSS_ATTACK_BYTES, framing="close"),
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("LITELLM_")}
    done = subprocess.run(
        [sys.executable, "-c", script, fake.api_base, "3"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    first, *attacks = [json.loads(line) for line in done.stdout.splitlines()]
    assert first["outcome"] == f"ok {len(at_cap.text('fake-model'))}"
    for attack in attacks:
        assert attack["peak"] - first["peak"] < RSS_SLACK_BYTES, (first, attacks)
        assert attack["outcome"] == "too_large"


# --- model.chat over a real run socket ---------------------------------------------------

CHAT_POLICY = """
version: 1
name: chatty
tools:
  allow: [model.chat]
limits: {calls_per_second: 1000, burst: 1000}
require_os_sandbox: false
model_access:
  models: [assistant, small]
  max_requests: 10
  max_tokens: 100000
"""


@pytest.fixture
async def gw(short_tmp: Path, fake: FakeProvider) -> AsyncIterator[Gateway]:
    aliases = {
        "assistant": alias_for(fake),
        "small": alias_for(fake, max_reply_bytes=MIN_REPLY_BYTES),
        "reviewer": alias_for(fake),
    }
    async with make_gateway(short_tmp, models=aliases) as gateway:
        yield gateway


def chat(model: str = "assistant") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}]}


@pytest.mark.parametrize("reply", ATTACKS)
async def test_model_chat_past_the_cap_is_tool_failed_naming_the_cap(
    gw: Gateway, workspace: Path, fake: FakeProvider, reply: Huge
) -> None:
    fake.script(reply)
    run = await gw.create_run(workspace, CHAT_POLICY)
    answer = await call(run, "model.chat", chat())
    assert answer["errorCode"] == "tool_failed"
    message = answer["safeMessage"]
    assert message.startswith("the model call failed (too_large): model alias 'assistant'")
    assert_names_the_cap(message, DEFAULT_MAX_REPLY_BYTES)
    for host_detail in (fake.api_base, "127.0.0.1", KEY_ENV):
        assert host_detail not in message
    [result] = [e for e in await calls_of(gw, "c1") if e["kind"] == "result"]
    assert result["errorCode"] == "tool_failed"
    assert KEY not in gw.audit_path.read_text()
    assert_cut_short(fake, reply)


async def test_model_chat_at_an_aliases_cap_answers_whole(
    gw: Gateway, workspace: Path, fake: FakeProvider
) -> None:
    reply = Huge(size=MIN_REPLY_BYTES)
    fake.script(reply)
    run = await gw.create_run(workspace, CHAT_POLICY)
    answer = await call(run, "model.chat", chat("small"))
    assert answer["ok"], answer
    assert answer["value"]["content"] == reply.text("fake-model")


# --- model.chat on replies gatewayd cannot read ----------------------------------------------


@pytest.mark.filterwarnings("ignore::UserWarning")  # pydantic's, on litellm's models
@pytest.mark.parametrize(
    ("reply", "says"),
    [
        pytest.param(
            Malformed(status=400, body=DEEP),
            "(bad_request): model alias 'assistant': the provider refused the request "
            "(HTTP 400: [[[[",
            id="deep-error",
        ),
        pytest.param(
            Malformed(status=502, body=DEEP_VALID),
            "(provider_error): model alias 'assistant': the provider failed (HTTP 502: ",
            id="deep-valid-error",
        ),
        pytest.param(
            Malformed(body=DEEP),
            "(malformed): model alias 'assistant': the answer is not a readable chat "
            "completion (the answer nests too deeply to be parsed)",
            id="deep-answer",
        ),
        pytest.param(
            Malformed(body=b"[1, 2, 3]"),
            "(malformed): model alias 'assistant': the answer is not a readable chat",
            id="answer-of-another-shape",
        ),
        pytest.param(
            Text(content="half an emoji: \ud83d"),
            "(malformed): model alias 'assistant': the answer holds a lone UTF-16 surrogate",
            id="lone-surrogate",
        ),
    ],
)
async def test_model_chat_on_a_reply_it_cannot_read_is_tool_failed_and_the_connection_goes_on(
    gw: Gateway, workspace: Path, fake: FakeProvider, reply: Any, says: str
) -> None:
    """The call fails as tool_failed saying what was wrong (no host detail), audited; the
    model.chat call in flight beside it on the same connection is answered, and the
    connection serves the next call."""
    run = await gw.create_run(workspace, CHAT_POLICY)

    answers = await beside_a_call_in_flight(
        run, fake, "model.chat", chat(), reply, held=Text(content="held answer")
    )

    bad = answers["bad"]
    assert bad["errorCode"] == "tool_failed"
    assert bad["safeMessage"].startswith("the model call failed " + says), bad
    for host_detail in (fake.api_base, "127.0.0.1", KEY_ENV, KEY):
        assert host_detail not in bad["safeMessage"]
    assert answers["held"]["value"]["content"] == "held answer"
    assert answers["after"]["value"]["content"] == "held answer"
    call_entry, result = await calls_of(gw, "bad")
    assert (call_entry["decision"], result["errorCode"]) == ("allow", "tool_failed")
    assert [e["kind"] for e in await calls_of(gw, "held")] == ["call", "result"]


async def test_a_usage_count_below_zero_gives_a_runs_model_budget_nothing_back(
    gw: Gateway, workspace: Path, fake: FakeProvider
) -> None:
    fake.script(Text(content="ok", prompt_tokens=-100_000, completion_tokens=5))
    run = await gw.create_run(workspace, CHAT_POLICY)

    answer = await call(run, "model.chat", chat())

    assert answer["value"]["usage"] == {"promptTokens": None, "completionTokens": 5}
    assert run.model_budget.tokens == 5


# --- the rule review fails closed ----------------------------------------------------------


@pytest.mark.parametrize("reply", ATTACKS)
async def test_a_review_reply_past_the_cap_denies_and_the_audit_says_why(
    gw: Gateway, workspace: Path, fake: FakeProvider, reply: Huge
) -> None:
    """An ALLOW padded with whitespace past the cap (a clean ALLOW once stripped, were
    it read whole) is no ALLOW: the reply is never read to its end."""
    fake.script(dataclasses.replace(reply, lead="ALLOW", pad=b" "))
    run = await gw.create_run(workspace, REVIEWED)
    answer = await call(run, "fs.read", {"path": "notes.md"})
    assert answer["errorCode"] == "review_denied"
    assert answer["safeMessage"] == (
        "the rule review failed (the reviewer's reply was too large), so the call is "
        "denied; gatewayd's operator must fix it"
    )
    [entry] = [e for e in await calls_of(gw, "c1") if e["kind"] == "call"]
    assert entry["decision"] == "deny"
    review = entry["review"]
    assert review["verdict"] == "deny" and review["source"] == "failed"
    assert review["failure"].startswith("too_large: model alias 'reviewer'")
    assert_names_the_cap(review["failure"], DEFAULT_MAX_REPLY_BYTES)
    assert KEY not in gw.audit_path.read_text()
    assert_cut_short(fake, reply)


# --- the host-owned agent run ----------------------------------------------------------


@pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))
async def test_an_agent_run_whose_model_reply_is_too_large_ends_internal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As for any failed model call (docs/agent-runs.md): the run ends ``internal``,
    keeps its partial patch and pushes nothing; the message names the cap."""
    monkeypatch.setenv(TOKEN_ENV, DEFAULT_TOKEN)
    monkeypatch.setenv(MODEL_KEY_ENV, MODEL_KEY)
    edit = Call(name="edit", arguments={"path": "calc.py", "old": "a - b", "new": "a + b"})
    reply = Huge(size=ATTACK_BYTES, framing="chunked")
    with (
        contextlib.contextmanager(agent_base)() as base,
        FakeProvider() as provider,
        GitServer(base / "served", token=DEFAULT_TOKEN) as server,
    ):
        provider.script(Text(content=None, calls=(edit,)), reply)
        sha = make_bare_repo(server.root, "calc.git", REPO_FILES)
        async with open_daemon(agent_config(base, provider), preload=True) as daemon:
            result = await run_agent(
                daemon.runs, daemon.dispatcher, task(server.url_for("calc.git"), sha)
            )
        assert not result.ok and result.error_code == "internal"
        assert result.message.startswith("the model call failed (too_large): model alias")
        assert f"passed the cap of {DEFAULT_MAX_REPLY_BYTES} bytes" in result.message
        assert MODEL_KEY not in result.message
        assert result.turns == 2 and result.branch is None
        assert len(result.patches) == 1 and "+    return a + b" in result.patches[0]
        assert_cut_short(provider, reply)


# --- redirects ---------------------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
async def test_a_redirect_from_the_provider_is_never_followed(
    fake: FakeProvider, route: str, status: int
) -> None:
    # Where the redirect points: another origin, which must never see the request (nor,
    # with a provider that sends its key as x-api-key, the key).
    with FakeProvider() as elsewhere:
        target = f"{elsewhere.api_base}/chat/completions"
        fake.script(Malformed(status=status, body=b"", headers={"Location": target}))
        error = await failing_call(alias_for(fake, route))
        assert elsewhere.requests == []
    assert str(status) in str(error) and KEY not in str(error)
    assert len(fake.chat_requests) == 1
