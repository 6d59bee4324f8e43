"""gatewayd.model_client against a real HTTP server on loopback, through real litellm.

The fake provider (tests/fakeprovider.py) speaks the OpenAI chat API; litellm routes
``openai/<model>`` with ``api_base`` to it. litellm is imported once for the module.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest
import trio

from gatewayd import model_client, model_transport
from gatewayd.config import DEFAULT_MAX_REPLY_BYTES, ModelAlias
from gatewayd.model_client import (
    KEYLESS_PLACEHOLDER,
    REDACTED,
    Completion,
    ModelCallError,
    ModelCallKind,
    complete,
)
from gatewayd.protocol import ErrorCode
from tests.fakeprovider import Call, Drop, FakeProvider, HttpError, Malformed, Text

KEY_ENV = "COGNI_TEST_MODEL_KEY"
KEY = "sk-test-0123456789abcdefSECRET"
MESSAGES = [
    {"role": "system", "content": "You review tool calls."},
    {"role": "user", "content": "May I read notes.md?"},
]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module", autouse=True)
def _litellm_loaded() -> None:
    """Pay litellm's import once for the whole module, as the daemon does at start."""
    model_client.preload()


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    with FakeProvider() as provider:
        yield provider


@pytest.fixture
def key_env(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(KEY_ENV, KEY)
    return KEY


def alias_for(fake: FakeProvider, **overrides: Any) -> ModelAlias:
    fields: dict[str, Any] = {
        "provider": "openai",
        "model": "reviewer-model",
        "api_base": fake.api_base,
        "api_key_env": KEY_ENV,
    }
    return ModelAlias(**(fields | overrides))


async def failing_call(alias: ModelAlias, timeout_s: float = 5.0) -> ModelCallError:
    with pytest.raises(ModelCallError) as caught:
        await complete(alias, MESSAGES, timeout_s=timeout_s, alias_name="reviewer")
    return caught.value


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


# --- success -------------------------------------------------------------------------


async def test_complete_returns_text_reported_model_usage_and_latency(
    fake: FakeProvider, key_env: str
) -> None:
    fake.script(
        Text(content="ALLOW", model="reviewer-model-2025", prompt_tokens=42, completion_tokens=3)
    )

    result = await complete(alias_for(fake), MESSAGES, timeout_s=5)

    assert result == Completion(
        text="ALLOW",
        model="reviewer-model-2025",
        prompt_tokens=42,
        completion_tokens=3,
        latency_ms=result.latency_ms,
        finish_reason="stop",
    )
    assert 0 < result.latency_ms < 5000


async def test_request_carries_messages_model_options_and_key_from_environment(
    fake: FakeProvider, key_env: str
) -> None:
    await complete(alias_for(fake), MESSAGES, timeout_s=5, max_tokens=64, temperature=0)

    [request] = fake.chat_requests
    assert request.method == "POST"
    assert request.path == "/v1/chat/completions"
    assert request.authorization == f"Bearer {KEY}"
    assert request.body["model"] == "reviewer-model"
    assert request.body["messages"] == MESSAGES
    assert request.body["max_tokens"] == 64
    assert request.body["temperature"] == 0
    assert not request.body.get("stream")


async def test_unset_options_are_left_to_the_provider(fake: FakeProvider, key_env: str) -> None:
    await complete(alias_for(fake), MESSAGES, timeout_s=5, temperature=None)

    [request] = fake.chat_requests
    assert "temperature" not in request.body
    assert "max_tokens" not in request.body


async def test_key_is_read_from_the_environment_at_each_call(
    fake: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-first-key")
    await complete(alias_for(fake), MESSAGES, timeout_s=5)
    monkeypatch.setenv(KEY_ENV, "sk-rotated-key")
    await complete(alias_for(fake), MESSAGES, timeout_s=5)

    assert [r.authorization for r in fake.chat_requests] == [
        "Bearer sk-first-key",
        "Bearer sk-rotated-key",
    ]


async def test_alias_without_key_variable_sends_placeholder_never_an_ambient_key(
    fake: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # litellm's own fallback must not be used

    await complete(alias_for(fake, api_key_env=None), MESSAGES, timeout_s=5)

    [request] = fake.chat_requests
    assert request.authorization == f"Bearer {KEYLESS_PLACEHOLDER}"


async def test_missing_usage_reads_as_none(fake: FakeProvider, key_env: str) -> None:
    fake.script(Text(content="ALLOW", usage=False))

    result = await complete(alias_for(fake), MESSAGES, timeout_s=5)

    assert (result.text, result.prompt_tokens, result.completion_tokens) == ("ALLOW", None, None)


async def test_sequential_calls_reuse_litellm_without_reimporting(
    fake: FakeProvider, key_env: str
) -> None:
    alias = alias_for(fake)
    results = [await complete(alias, MESSAGES, timeout_s=5) for _ in range(5)]

    assert [r.text for r in results] == ["ok"] * 5
    assert len(fake.chat_requests) == 5


# --- errors: one request each, a kind, a message that says what to do ------------------


@pytest.mark.parametrize(
    ("status", "kind", "phrase"),
    [
        (
            401,
            ModelCallKind.AUTH,
            f"refused the key (HTTP 401); check that the environment variable {KEY_ENV}",
        ),
        (403, ModelCallKind.AUTH, "refused the key (HTTP 403)"),
        (429, ModelCallKind.RATE_LIMITED, "rate limiting (HTTP 429: slow down"),
        (400, ModelCallKind.BAD_REQUEST, "refused the request (HTTP 400: slow down"),
        (404, ModelCallKind.BAD_REQUEST, "refused the request (HTTP 404: slow down"),
        (422, ModelCallKind.BAD_REQUEST, "refused the request (HTTP 422: slow down"),
        (500, ModelCallKind.PROVIDER_ERROR, "the provider failed (HTTP 500: slow down"),
        (503, ModelCallKind.PROVIDER_ERROR, "the provider failed (HTTP 503: slow down"),
    ],
)
async def test_http_error_maps_to_kind_with_one_request_and_actionable_message(
    fake: FakeProvider, key_env: str, status: int, kind: ModelCallKind, phrase: str
) -> None:
    fake.script(HttpError(status=status, message="slow down"))

    error = await failing_call(alias_for(fake))

    assert error.kind is kind
    assert phrase in str(error)
    assert str(error).startswith(
        f"model alias 'reviewer' (openai/reviewer-model at {fake.api_base})"
    )
    assert error.code is ErrorCode.TOOL_FAILED
    assert len(fake.chat_requests) == 1  # no retries, by litellm or the OpenAI SDK


@pytest.mark.parametrize("status", [400, 401, 403, 404, 429, 500, 503])
async def test_key_echoed_by_the_provider_never_appears_in_the_error(
    fake: FakeProvider, key_env: str, status: int
) -> None:
    fake.script(HttpError(status=status, message=f"Incorrect API key provided: {KEY} (yes, {KEY})"))

    error = await failing_call(alias_for(fake))

    assert KEY not in str(error)
    assert KEY not in repr(error.args)
    assert error.__cause__ is None and error.__suppress_context__  # no keyed traceback
    if error.kind is not ModelCallKind.AUTH:  # auth errors quote no provider text at all
        assert REDACTED in str(error)


async def test_key_in_a_malformed_answer_never_appears_in_the_error(
    fake: FakeProvider, key_env: str
) -> None:
    fake.script(
        Malformed(body=f"<html>bad gateway for {KEY}</html>".encode(), content_type="text/html")
    )

    error = await failing_call(alias_for(fake))

    assert error.kind is ModelCallKind.MALFORMED
    assert KEY not in str(error)


async def test_answer_later_than_the_timeout_is_a_timeout_after_one_request(
    fake: FakeProvider, key_env: str
) -> None:
    fake.script(Text(content="too late", delay_s=3))
    started = time.perf_counter()

    error = await failing_call(alias_for(fake), timeout_s=0.3)

    elapsed = time.perf_counter() - started
    assert error.kind is ModelCallKind.TIMEOUT
    assert "no answer within 0.3 s" in str(error)
    assert elapsed < 0.3 + model_client.TIMEOUT_GRACE_S
    assert len(fake.chat_requests) == 1


async def test_alias_timeout_caps_a_longer_call_timeout(fake: FakeProvider, key_env: str) -> None:
    fake.script(Text(content="too late", delay_s=3))

    error = await failing_call(alias_for(fake, timeout_s=0.2), timeout_s=30)

    assert error.kind is ModelCallKind.TIMEOUT
    assert "no answer within 0.2 s" in str(error)


async def test_trickling_answer_is_cut_off_by_the_outer_deadline(
    fake: FakeProvider, key_env: str
) -> None:
    # Each piece arrives within litellm's read timeout, so only trio's deadline ends it.
    fake.script(Text(content="x" * 400, gap_s=0.1))
    started = time.perf_counter()

    error = await failing_call(alias_for(fake), timeout_s=0.3)

    elapsed = time.perf_counter() - started
    assert error.kind is ModelCallKind.TIMEOUT
    assert 0.3 + model_client.TIMEOUT_GRACE_S <= elapsed < 0.3 + model_client.TIMEOUT_GRACE_S + 1


async def test_cancelled_caller_returns_at_once_while_the_provider_is_still_thinking(
    fake: FakeProvider, key_env: str
) -> None:
    fake.script(Text(content="too late", delay_s=3))
    started = time.perf_counter()

    with trio.move_on_after(0.2) as scope:
        await complete(alias_for(fake), MESSAGES, timeout_s=5)

    assert scope.cancelled_caught
    assert time.perf_counter() - started < 1


@pytest.mark.parametrize(
    ("reply", "phrase"),
    [
        (Malformed(), "not JSON: Expecting property name"),
        (Malformed(body=b'{"object": "list"}'), "not a readable chat completion"),
        (
            Malformed(body=b"<html>hi</html>", content_type="text/html"),
            "not a readable chat completion",
        ),
        (
            Malformed(body=b'{"choices": [{"message": {"role": "assistant", "content": null}}]}'),
            "no text content",
        ),
    ],
    ids=["not-json", "not-a-completion", "html", "null-content"],
)
async def test_unreadable_answer_is_malformed_after_one_request(
    fake: FakeProvider, key_env: str, reply: Malformed, phrase: str
) -> None:
    fake.script(reply)

    error = await failing_call(alias_for(fake))

    assert error.kind is ModelCallKind.MALFORMED
    assert phrase in str(error)
    assert len(fake.chat_requests) == 1


async def test_dropped_connection_is_a_connection_error_after_one_request(
    fake: FakeProvider, key_env: str
) -> None:
    fake.script(Drop())

    error = await failing_call(alias_for(fake))

    assert error.kind is ModelCallKind.CONNECTION
    assert "could not reach the provider (Server disconnected without sending a response" in str(
        error
    )
    assert len(fake.chat_requests) == 1


async def test_closed_port_is_a_connection_error_naming_the_endpoint(key_env: str) -> None:
    port = closed_port()
    alias = ModelAlias(
        provider="openai", model="m", api_base=f"http://127.0.0.1:{port}/v1", api_key_env=KEY_ENV
    )

    error = await failing_call(alias)

    assert error.kind is ModelCallKind.CONNECTION
    assert f"at http://127.0.0.1:{port}/v1): could not reach the provider" in str(error)
    assert "Connection refused" in str(error)
    assert "reachable from the gatewayd host" in str(error)


async def test_endpoint_userinfo_and_query_are_left_out_of_errors(key_env: str) -> None:
    port = closed_port()
    alias = ModelAlias(
        provider="openai",
        model="m",
        api_base=f"http://user:hunter2@127.0.0.1:{port}/v1?token=abc",
        api_key_env=KEY_ENV,
    )

    error = await failing_call(alias)

    assert f"at http://127.0.0.1:{port}/v1)" in str(error)
    assert "hunter2" not in str(error) and "token=abc" not in str(error)


@pytest.mark.parametrize("value", [None, ""], ids=["unset", "empty"])
async def test_missing_key_variable_names_the_variable_and_sends_nothing(
    fake: FakeProvider, monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    if value is None:
        monkeypatch.delenv(KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(KEY_ENV, value)

    error = await failing_call(alias_for(fake))

    assert error.kind is ModelCallKind.MISSING_KEY
    assert f"the environment variable {KEY_ENV} that holds its key is not set" in str(error)
    assert "model alias 'reviewer'" in str(error)
    assert fake.chat_requests == []


async def test_error_without_alias_name_names_the_model_and_endpoint(
    fake: FakeProvider, key_env: str
) -> None:
    fake.script(HttpError(status=500))

    with pytest.raises(
        ModelCallError, match=r"^model openai/reviewer-model at http://127\.0\.0\.1:\d+/v1: "
    ):
        await complete(alias_for(fake), MESSAGES, timeout_s=5)


@pytest.mark.parametrize("timeout_s", [0.0, -1.0, float("nan"), float("inf")])
async def test_timeout_must_be_a_positive_number(fake: FakeProvider, timeout_s: float) -> None:
    with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds"):
        await complete(alias_for(fake), MESSAGES, timeout_s=timeout_s)


# --- the fake itself, for the streaming model.chat tool -----------------------------


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")  # litellm's own
def test_fake_streams_sse_chunks_that_litellm_reassembles(fake: FakeProvider) -> None:
    litellm = model_transport.LITELLM.get()
    fake.script(Text(content="a streamed answer", prompt_tokens=5, completion_tokens=4))

    chunks = list(
        litellm.completion(
            model="openai/m",
            messages=MESSAGES,
            api_base=fake.api_base,
            api_key=KEY,
            stream=True,
            stream_options={"include_usage": True},
            num_retries=0,
            max_retries=0,
            timeout=5,
        )
    )

    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "a streamed answer"
    assert fake.chat_requests[0].body["stream"] is True


def test_fake_lists_models() -> None:
    import httpx

    with FakeProvider() as provider:
        listing = httpx.get(f"{provider.api_base}/models").json()
        assert listing["data"][0]["id"] == "fake-model"
        assert provider.requests[0].method == "GET"


# --- import hygiene ---------------------------------------------------------------------


def test_importing_model_client_leaves_litellm_unloaded_and_preload_makes_no_connection() -> None:
    script = textwrap.dedent(
        """
        import sys, time
        attempts = []
        sys.addaudithook(
            lambda event, args: attempts.append(event)
            if event in ("socket.connect", "socket.getaddrinfo") else None
        )
        import gatewayd.model_client as mc
        assert "litellm" not in sys.modules, "importing gatewayd.model_client imported litellm"
        started = time.perf_counter()
        mc.preload()
        print(f"{time.perf_counter() - started:.2f}")
        assert "litellm" in sys.modules
        assert not attempts, attempts
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("LITELLM_")}
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr


# --- tools (the host-owned agent loop) ---------------------------------------------------

READ_TOOL = {
    "type": "function",
    "function": {
        "name": "read",
        "description": "read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
    },
}


async def test_tools_go_out_and_tool_calls_come_back_in_order(
    fake: FakeProvider, key_env: str
) -> None:
    fake.script(
        Text(
            content=None,
            calls=(
                Call(name="read", arguments={"path": "a.py"}, id="c1"),
                Call(name="read", arguments="{broken", id="c2"),
            ),
        )
    )

    result = await complete(alias_for(fake), MESSAGES, timeout_s=5, tools=[READ_TOOL])

    assert fake.chat_requests[0].body["tools"] == [READ_TOOL]
    assert result.text == "" and result.finish_reason == "tool_calls"
    assert result.tool_calls == (
        model_client.ToolCall(id="c1", name="read", arguments='{"path": "a.py"}'),
        # Invalid JSON is passed on as written: the agent loop tells the model.
        model_client.ToolCall(id="c2", name="read", arguments="{broken"),
    )


async def test_a_key_echoed_into_tool_call_arguments_is_redacted(
    fake: FakeProvider, key_env: str
) -> None:
    # Arguments become file contents and commands in the sandbox: never the key.
    fake.script(Text(content=None, calls=(Call(name="read", arguments={"path": f"x{KEY}y"}),)))

    result = await complete(alias_for(fake), MESSAGES, timeout_s=5, tools=[READ_TOOL])

    assert KEY not in result.tool_calls[0].arguments
    assert REDACTED in result.tool_calls[0].arguments


async def test_a_tool_call_without_a_name_is_malformed(fake: FakeProvider, key_env: str) -> None:
    fake.script(
        Malformed(
            body=(
                b'{"id": "x", "object": "chat.completion", "created": 1, "model": "m", '
                b'"choices": [{"index": 0, "finish_reason": "tool_calls", "message": '
                b'{"role": "assistant", "content": null, "tool_calls": [{"id": "c1", '
                b'"type": "function", "function": {"name": "", "arguments": "{}"}}]}}]}'
            )
        )
    )

    with pytest.raises(ModelCallError) as caught:
        await complete(alias_for(fake), MESSAGES, timeout_s=5, tools=[READ_TOOL])

    assert caught.value.kind is ModelCallKind.MALFORMED
    assert "tool call without an id or a function name" in str(caught.value)


# --- whatever a provider sends ends as a ModelCallError -----------------------------------

# Every litellm route through which a provider's reply reaches gatewayd: the OpenAI SDK's
# (openai) and litellm's own handler, with the parsers of three providers.
ROUTES = ("openai", "hosted_vllm", "anthropic", "ollama_chat")
# Past Python's recursion limit in any recursive parser, far under the reply cap.
DEEP = b"[" * 200_000
# The same depth as valid JSON: an error body whose message is nested, not unterminated.
DEEP_VALID = b'{"error": {"message": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}"
COMPLETION_HEAD = (
    b'{"id": "x", "object": "chat.completion", "created": 1, "model": "m", "choices": '
    b'[{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", '
    b'"content": "ALLOW"}}], "usage": {"prompt_tokens": '
)
UNREADABLE = "the answer is not a readable chat completion"
# A body of empty lists just under the default reply cap: 2.8 million lists, about 180 MB
# once parsed.
MEMORY_BODY_BYTES = DEFAULT_MAX_REPLY_BYTES - 64
# The memory a child gets past its size: enough to read that body (held as bytes, text and
# a copy or two), far from enough to parse it.
MEMORY_HEADROOM = 100 << 20
PROVIDER_REPLIES = [
    pytest.param(
        Malformed(body=DEEP),
        ModelCallKind.MALFORMED,
        "the answer nests too deeply to be parsed",
        id="deep-200",
    ),
    pytest.param(
        Malformed(body=DEEP_VALID),
        ModelCallKind.MALFORMED,
        "the answer nests too deeply to be parsed",
        id="deep-valid-200",
    ),
    pytest.param(
        Malformed(status=400, body=DEEP),
        ModelCallKind.BAD_REQUEST,
        "the provider refused the request (HTTP 400: [[[[",
        id="deep-400",
    ),
    pytest.param(
        Malformed(status=429, body=DEEP_VALID),
        ModelCallKind.RATE_LIMITED,
        'the provider is rate limiting (HTTP 429: {"error": {"message": [[[[',
        id="deep-valid-429",
    ),
    pytest.param(
        Malformed(status=500, body=DEEP),
        ModelCallKind.PROVIDER_ERROR,
        "the provider failed (HTTP 500: [[[[",
        id="deep-500",
    ),
    pytest.param(
        Malformed(status=400, body=b'\xff{"error": {"message": "not \xfe UTF-8"}}'),
        ModelCallKind.BAD_REQUEST,
        "the provider refused the request (HTTP 400: ",
        id="not-utf8-400",
    ),
    pytest.param(
        Malformed(body=b'\xff\xfe{"choices": []}'),
        ModelCallKind.MALFORMED,
        UNREADABLE,
        id="not-utf8",
    ),
    pytest.param(
        Malformed(
            status=400,
            body=b'{"error": {"message": "x", "code": ' + b"9" * 5000 + b"}}",
        ),
        ModelCallKind.BAD_REQUEST,
        "the provider refused the request (HTTP 400: {",
        id="huge-int-400",
    ),
    pytest.param(
        Malformed(body=COMPLETION_HEAD + b"9" * 5000 + b"}}"),
        ModelCallKind.MALFORMED,
        UNREADABLE,
        id="huge-int",
    ),
    pytest.param(
        Malformed(body=COMPLETION_HEAD + b"NaN}}"), ModelCallKind.MALFORMED, UNREADABLE, id="nan"
    ),
    # An error body past MAX_ERROR_BODY_CHARS is quoted from its start, never parsed (its
    # message, "big", would be quoted alone if it were).
    pytest.param(
        Malformed(
            status=400,
            body=b'{"error": {"message": "big"}, "pad": "'
            + b"x" * model_client.MAX_ERROR_BODY_CHARS
            + b'"}',
        ),
        ModelCallKind.BAD_REQUEST,
        'the provider refused the request (HTTP 400: {"error": {"message": "big"}, "pad": "xxx',
        id="big-error-body",
    ),
    # Headers litellm reads on an error (rate limits, when to retry) that are no numbers.
    pytest.param(
        Malformed(
            status=429,
            body=b'{"error": {"message": "slow down"}}',
            headers={
                "Retry-After": "1e999",
                "x-ratelimit-remaining-requests": "NaN",
                "x-ratelimit-reset-requests": "-" + "9" * 5000,
                "retry-after-ms": "[[[[",
            },
        ),
        ModelCallKind.RATE_LIMITED,
        "the provider is rate limiting (HTTP 429: slow down); wait before calling again",
        id="odd-headers-429",
    ),
    pytest.param(Malformed(body=b"[1, 2, 3]"), ModelCallKind.MALFORMED, UNREADABLE, id="list"),
    pytest.param(Malformed(body=b"null"), ModelCallKind.MALFORMED, UNREADABLE, id="null"),
    pytest.param(
        Malformed(body=b'{"choices": [null], "model": "m"}'),
        ModelCallKind.MALFORMED,
        UNREADABLE,
        id="choice-null",
    ),
    pytest.param(
        Malformed(body=b'{"choices": "x", "model": "m"}'),
        ModelCallKind.MALFORMED,
        UNREADABLE,
        id="choices-text",
    ),
]


@pytest.mark.filterwarnings("ignore::UserWarning")  # pydantic's, on litellm's models
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(("reply", "kind", "phrase"), PROVIDER_REPLIES)
async def test_every_reply_a_provider_can_send_ends_as_a_model_call_error(
    fake: FakeProvider,
    key_env: str,
    route: str,
    reply: Malformed,
    kind: ModelCallKind,
    phrase: str,
) -> None:
    """Bodies of success and error replies that exhaust a recursive parser, are not UTF-8,
    hold numbers Python or JSON refuse, or have the wrong shape, on every route: each ends
    as the ModelCallError of its kind, with a message that says what was wrong (no
    traceback quoted from litellm, no key), after one request."""
    fake.script(reply)

    error = await failing_call(alias_for(fake, provider=route))

    assert (error.kind, phrase in str(error)) == (kind, True), str(error)
    assert str(error).startswith(f"model alias 'reviewer' ({route}/reviewer-model at ")
    if kind is ModelCallKind.MALFORMED:
        assert str(error).endswith("check that the endpoint speaks the OpenAI-compatible chat API")
    assert "Traceback" not in str(error) and "site-packages" not in str(error)
    assert KEY not in str(error)
    assert len(fake.requests) == 1


@pytest.mark.parametrize(
    "reply",
    [
        pytest.param(Text(content="ALLOW \ud800"), id="text"),
        pytest.param(Text(content="ok", model="m\udfff"), id="model"),
        pytest.param(
            Text(content=None, calls=(Call(name="read\udc80", arguments={"path": "a"}),)),
            id="tool-name",
        ),
        pytest.param(
            Text(content=None, calls=(Call(name="read", arguments='{"path": "\ud83d"}'),)),
            id="tool-arguments",
        ),
    ],
)
async def test_an_answer_holding_a_lone_surrogate_is_malformed(
    fake: FakeProvider, key_env: str, reply: Text
) -> None:
    """JSON's "\\ud800" decodes to a string no UTF-8 encoder writes: such an answer could
    reach neither the sandbox's reply frame nor the audit log, so it is refused here."""
    fake.script(reply)

    with pytest.raises(ModelCallError) as caught:
        await complete(alias_for(fake), MESSAGES, timeout_s=5, tools=[READ_TOOL])

    assert caught.value.kind is ModelCallKind.MALFORMED
    assert "the answer holds a lone UTF-16 surrogate escape (\\ud800-\\udfff)" in str(caught.value)


@pytest.mark.parametrize(
    ("reported", "read"),
    [(-5, None), (model_client.MAX_REPORTED_TOKENS + 1, None), (2**60, None), (7, 7)],
)
async def test_a_usage_count_that_is_no_count_reads_as_not_reported(
    fake: FakeProvider, key_env: str, reported: int, read: int | None
) -> None:
    """A negative count would give a budget tokens back; one past 2**53 is no count."""
    fake.script(Text(content="ok", prompt_tokens=reported, completion_tokens=3))

    answer = await complete(alias_for(fake), MESSAGES, timeout_s=5)

    assert (answer.prompt_tokens, answer.completion_tokens) == (read, 3)


def test_a_reply_that_exhausts_memory_under_the_cap_is_still_a_model_call_error(
    fake: FakeProvider,
) -> None:
    """A child process (model_client as gatewayd runs it) gets a memory limit its current
    size plus MEMORY_HEADROOM: room to read an 8 MiB reply, not to parse one of 2.8
    million empty lists. The control: that body cannot be parsed there. Then that body,
    as an error reply and as an answer, each fails as a ModelCallError."""
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
                return f"{exc.kind}: {exc}"
            except BaseException as exc:
                return f"escaped: {type(exc).__name__}"
            return f"ok {answer.text}"

        print(trio.run(ask), flush=True)  # worker threads and connections made
        with open("/proc/self/status") as status:
            [size] = [int(l.split()[1]) * 1024 for l in status if l.startswith("VmSize:")]
        limit = size + int(sys.argv[2])
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        body = sys.stdin.buffer.read()
        try:
            json.loads(body)
            print("control: parsed", flush=True)
        except MemoryError:
            print("control: MemoryError", flush=True)
        del body
        for _ in range(2):
            print(trio.run(ask), flush=True)
        """
    )
    lists = b"[" + b"[]," * (MEMORY_BODY_BYTES // 3) + b"[]]"
    fake.script(
        Text(content="warm"),
        Malformed(status=400, body=lists),
        Malformed(body=b'{"choices": ' + lists + b"}"),
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("LITELLM_")}
    done = subprocess.run(
        [sys.executable, "-c", script, fake.api_base, str(MEMORY_HEADROOM)],
        input=lists,
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    lines = done.stdout.decode().splitlines()
    assert lines[:2] == ["ok warm", "control: MemoryError"], lines
    error_reply, answer = lines[2:]
    assert error_reply.startswith("bad_request: model openai/fake-model at "), error_reply
    assert "the provider refused the request (HTTP 400: [[],[],[]," in error_reply
    assert answer.startswith("malformed: model openai/fake-model at "), answer
    assert f"{UNREADABLE} (parsing the answer ran out of memory)" in answer


async def test_a_failure_while_explaining_a_failure_is_still_a_model_call_error(
    fake: FakeProvider, key_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection (no reply makes the explanation fail once bodies are parsed under
    gatewayd's JSON discipline): whatever it raises, the call fails as provider_error
    naming both exceptions' types."""

    def broken(_response: Any) -> str:
        raise RecursionError("injected")

    monkeypatch.setattr(model_client, "_provider_text", broken)
    fake.script(HttpError(status=400))

    error = await failing_call(alias_for(fake))

    assert error.kind is ModelCallKind.PROVIDER_ERROR
    assert "the provider failed (BadRequestError), and its reply could not be read to say " in (
        str(error)
    )
    assert "why (RecursionError); retry later" in str(error)


async def test_an_answer_gatewayd_fails_to_read_is_malformed_whatever_it_raises(
    fake: FakeProvider, key_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection, as above, for the reading of an answer litellm accepted."""

    def broken(_choice: Any, _where: str) -> tuple[model_client.ToolCall, ...]:
        raise KeyError("injected")

    monkeypatch.setattr(model_client, "_tool_calls", broken)
    fake.script(Text(content="ALLOW"))

    error = await failing_call(alias_for(fake))

    assert error.kind is ModelCallKind.MALFORMED
    assert f"{UNREADABLE} (KeyError while reading it)" in str(error)
