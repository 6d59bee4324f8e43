"""Secrets end to end: keys from gatewayd's environment or systemd credentials, and a
provider (a real loopback OpenAI-compatible server, driven through litellm) that echoes
the key back - in its answer, in an HTTP error, in a review verdict - never gets it onto
the run's socket, into the audit log's bytes, or past ``gatewayd audit verify``."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import trio
from structlog.testing import capture_logs

from gatewayd.audit import verify_file
from gatewayd.cli import build_parser
from gatewayd.cli.options import config_from_options
from gatewayd.config import ConfigError, GatewaydConfig, ModelAlias
from gatewayd.configsources import load_config
from gatewayd.daemon import open_daemon
from gatewayd.secrets import MIN_SCRUB_CHARS, REFRESH_INTERVAL_S
from tests.conftest import Gateway
from tests.fakeprovider import FakeProvider, HttpError, Reply, Text
from tests.integration.test_review import call

KEY_ENV = "COGNI_TEST_SECRET_KEY"
KEY = "sk-secret-host-only-5f3a9c1e7b2d4680"
FORGE_ENV = "COGNI_TEST_FORGE_TOKEN"
FORGE = "ghp_forgeTokenHostOnly0123456789ab"

POLICY = """
version: 1
name: secretive
tools:
  allow: [model.chat, time.now]
limits: {calls_per_second: 1000, burst: 1000}
require_os_sandbox: false
model_access:
  models: [assistant]
  max_requests: 20
  max_tokens: 100000
"""

REVIEWED = """
version: 1
name: reviewed
tools:
  allow: [time.now]
limits: {calls_per_second: 1000, burst: 1000, call_timeout_s: 20}
require_os_sandbox: false
review:
  mode: llm
  model: assistant
  timeout_s: 10
  tools: [time.now]
  rules:
    deny: [Anything at all]
"""


def b64(value: str, *, urlsafe: bool = False) -> str:
    encode = base64.urlsafe_b64encode if urlsafe else base64.b64encode
    return encode(value.encode()).decode()


def leaks(secret: str) -> list[str]:
    """The forms of ``secret`` that must appear nowhere."""
    return [secret, b64(secret), b64(secret, urlsafe=True), json.dumps(secret)[1:-1]]


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """Both secrets in gatewayd's environment, no credentials directory."""
    monkeypatch.setenv(KEY_ENV, KEY)
    monkeypatch.setenv(FORGE_ENV, FORGE)
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    return monkeypatch


@pytest.fixture
def creds(tmp_path: Path) -> Path:
    directory = tmp_path / "credentials"
    directory.mkdir(mode=0o700)
    return directory


@pytest.fixture
def fake() -> Iterator[FakeProvider]:
    with FakeProvider() as provider:
        yield provider


def echoing(fake: FakeProvider, make: Callable[[str], Reply], extra: Sequence[str] = ()) -> None:
    """Answer every request with ``make(text)``, the text quoting the request's own
    Authorization header, the key in base64 and in JSON, and the ``extra`` values (as
    they are at the time of the request)."""

    def respond(_body: Mapping[str, Any]) -> Reply:
        auth = fake.requests[-1].authorization or ""  # recorded before respond() runs
        key = auth.removeprefix("Bearer ")
        quoted = [f"header {auth}", f"b64 {b64(key)}", f"json {json.dumps({'k': key})}"]
        return make("echo: " + " | ".join(quoted + [f"extra {x}" for x in extra]))

    fake.respond = respond


def daemon_config(base: Path, fake: FakeProvider) -> GatewaydConfig:
    policies = base / "policies"
    policies.mkdir(exist_ok=True)
    alias = ModelAlias(
        provider="openai", model="fake-chat", api_base=fake.api_base, api_key_env=KEY_ENV
    )
    return GatewaydConfig(
        state_dir=base / "state",
        policy_dirs=(policies,),
        os_sandbox=False,
        models={"assistant": alias},
        secret_env=(FORGE_ENV,),
    )


@pytest.fixture
async def gw(
    short_tmp: Path, fake: FakeProvider, env: pytest.MonkeyPatch
) -> AsyncIterator[Gateway]:
    config = daemon_config(short_tmp, fake)
    async with open_daemon(config, preload=True) as daemon:
        yield Gateway(daemon, short_tmp / "policies")


def chat(text: str = "hello") -> dict[str, Any]:
    return {"model": "assistant", "messages": [{"role": "user", "content": text}]}


async def assert_nowhere(gw: Gateway, answer: dict[str, Any], *secrets: str) -> bytes:
    """No form of any secret in the answer or the audit file; the log still verifies."""
    await gw.audit_entries()  # every recorded entry durable
    raw = gw.audit_path.read_bytes()
    wire = json.dumps(answer)
    for secret in secrets:
        for form in leaks(secret):
            assert form not in wire, f"{form!r} reached the run's socket"
            assert form.encode() not in raw, f"{form!r} is in the audit log"
    report = verify_file(gw.audit_path)
    assert report.ok, report.render()
    return raw


# --- a provider that echoes the key ---------------------------------------------------------


async def test_a_key_echoed_in_the_answer_reaches_neither_the_run_nor_the_audit(
    gw: Gateway, workspace: Path, fake: FakeProvider
) -> None:
    echoing(fake, lambda text: Text(content=text), [FORGE, b64(FORGE)])
    run = await gw.create_run(workspace, POLICY)

    answer = await call(run, "model.chat", chat())

    assert answer["ok"], answer
    assert fake.chat_requests[0].authorization == f"Bearer {KEY}"  # the real key was sent
    content = answer["value"]["content"]
    assert content.count(f"[REDACTED:{KEY_ENV}]") == 3, content  # header, base64, JSON
    assert content.count(f"[REDACTED:{FORGE_ENV}]") == 2, content  # secret_env, raw and base64
    assert content.startswith(f"echo: header Bearer [REDACTED:{KEY_ENV}] | b64 ")
    await assert_nowhere(gw, answer, KEY, FORGE)


async def test_a_key_echoed_in_an_http_error_is_not_in_the_message_or_the_audit(
    gw: Gateway, workspace: Path, fake: FakeProvider
) -> None:
    echoing(fake, lambda text: HttpError(status=400, message=text), [FORGE])
    run = await gw.create_run(workspace, POLICY)

    answer = await call(run, "model.chat", chat())

    assert answer["errorCode"] == "tool_failed"
    message = answer["safeMessage"]
    assert "the model call failed (bad_request)" in message
    assert "the provider refused the request (HTTP 400: echo: header Bearer [REDACTED:" in message
    assert f"[REDACTED:{FORGE_ENV}]" in message
    raw = await assert_nowhere(gw, answer, KEY, FORGE)
    entries = [json.loads(line) for line in raw.splitlines()]
    result = next(e for e in entries if e["kind"] == "result" and e.get("tool") == "model.chat")
    assert result["safeMessage"] == message  # the audit says what the run was told


async def test_a_key_echoed_by_the_review_model_is_not_in_the_denial_or_the_audit(
    gw: Gateway, workspace: Path, fake: FakeProvider
) -> None:
    echoing(fake, lambda text: Text(content=f"DENY: {text}"), [FORGE])
    run = await gw.create_run(workspace, REVIEWED)

    answer = await call(run, "time.now", {})

    assert answer["errorCode"] == "review_denied"
    assert answer["safeMessage"].startswith("the rule review denied this call: echo: header")
    assert f"[REDACTED:{FORGE_ENV}]" in answer["safeMessage"]
    raw = await assert_nowhere(gw, answer, KEY, FORGE)
    call_entry = next(json.loads(line) for line in raw.splitlines() if b'"review"' in line)
    assert f"[REDACTED:{KEY_ENV}]" in call_entry["review"]["reason"]


# --- where the key comes from ---------------------------------------------------------------


async def test_keys_come_from_systemd_credentials_when_the_variables_are_unset(
    short_tmp: Path,
    workspace: Path,
    fake: FakeProvider,
    creds: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.delenv(FORGE_ENV, raising=False)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    (creds / KEY_ENV).write_text(KEY + "\n")  # as `echo KEY > file` leaves it
    (creds / FORGE_ENV).write_text(FORGE)
    echoing(fake, lambda text: Text(content=text), [FORGE])

    async with open_daemon(daemon_config(short_tmp, fake), preload=True) as daemon:
        gw = Gateway(daemon, short_tmp / "policies")
        run = await gw.create_run(workspace, POLICY)
        answer = await call(run, "model.chat", chat())

        assert answer["ok"], answer
        assert fake.chat_requests[0].authorization == f"Bearer {KEY}"  # newline dropped
        assert f"[REDACTED:{FORGE_ENV}]" in answer["value"]["content"]
        await assert_nowhere(gw, answer, KEY, FORGE)


async def test_the_environment_variable_wins_over_the_credential(
    gw: Gateway, workspace: Path, fake: FakeProvider, creds: Path, env: pytest.MonkeyPatch
) -> None:
    (creds / KEY_ENV).write_text("sk-from-the-credential-file-000000")
    env.setenv("CREDENTIALS_DIRECTORY", str(creds))
    run = await gw.create_run(workspace, POLICY)

    assert (await call(run, "model.chat", chat()))["ok"]

    assert fake.chat_requests[0].authorization == f"Bearer {KEY}"


def missing_key_logged(logs: list[Any]) -> str:
    """The operator's account of the missing key (gatewayd's log)."""
    return str(next(e for e in logs if e["event"] == "model_key_missing")["error"])


async def test_a_missing_key_tells_the_sandbox_the_fact_and_the_operator_where_to_look(
    gw: Gateway, workspace: Path, fake: FakeProvider, creds: Path, env: pytest.MonkeyPatch
) -> None:
    env.delenv(KEY_ENV)
    env.setenv("CREDENTIALS_DIRECTORY", str(creds))
    run = await gw.create_run(workspace, POLICY)

    with capture_logs() as logs:
        answer = await call(run, "model.chat", chat())

    assert answer["errorCode"] == "tool_failed"
    message = answer["safeMessage"]
    assert message.startswith("the model call failed (missing_key): model alias 'assistant'")
    assert "gatewayd's operator must provide it" in message
    # Host details (the variable, the credential path) are not the sandbox's to know.
    assert KEY_ENV not in message and str(creds) not in message
    logged = missing_key_logged(logs)
    assert f"the environment variable {KEY_ENV} that holds its key is not set" in logged
    assert f"there is no credential file {creds / KEY_ENV}" in logged
    assert f"LoadCredential={KEY_ENV}:" in logged
    assert fake.chat_requests == []  # nothing was sent without a key


async def test_a_missing_key_without_credentials_says_where_gatewayd_looked(
    gw: Gateway, workspace: Path, fake: FakeProvider, env: pytest.MonkeyPatch
) -> None:
    env.delenv(KEY_ENV)
    run = await gw.create_run(workspace, POLICY)

    with capture_logs() as logs:
        answer = await call(run, "model.chat", chat())

    assert answer["errorCode"] == "tool_failed"
    assert "(missing_key)" in answer["safeMessage"]
    assert f"the environment variable {KEY_ENV} that holds its key" in missing_key_logged(logs)
    assert "$CREDENTIALS_DIRECTORY is not set" in missing_key_logged(logs)
    assert fake.chat_requests == []


async def test_an_unreadable_credential_is_tool_failed_saying_why_without_its_bytes(
    gw: Gateway, workspace: Path, fake: FakeProvider, creds: Path, env: pytest.MonkeyPatch
) -> None:
    env.delenv(KEY_ENV)
    env.setenv("CREDENTIALS_DIRECTORY", str(creds))
    (creds / KEY_ENV).write_bytes(b"sk-\xff\xfe" + KEY.encode())
    run = await gw.create_run(workspace, POLICY)

    with capture_logs() as logs:
        answer = await call(run, "model.chat", chat())

    assert answer["errorCode"] == "tool_failed"
    assert "(missing_key)" in answer["safeMessage"] and str(creds) not in answer["safeMessage"]
    assert f"the credential file {creds / KEY_ENV}" in missing_key_logged(logs)
    assert "is not UTF-8 text" in missing_key_logged(logs)
    await assert_nowhere(gw, answer, KEY)
    assert fake.chat_requests == []


# --- rotation and short values ------------------------------------------------------------


async def test_rotated_secrets_are_used_and_scrubbed_old_and_new(
    gw: Gateway, workspace: Path, fake: FakeProvider, env: pytest.MonkeyPatch
) -> None:
    # Unrelated to the old values: a new value holding an old one would be caught by that.
    new_key, new_forge = "sk-rotated-7e1d0c2b9a8f6e5d", "ghp_rotatedForgeToken9876543210"
    extra = [KEY, FORGE]
    echoing(fake, lambda text: Text(content=text), extra)
    run = await gw.create_run(workspace, POLICY)
    # litellm is imported (seconds) and the scrubber has just read the values.
    assert (await call(run, "model.chat", chat(), "c0"))["ok"]
    env.setenv(KEY_ENV, new_key)
    env.setenv(FORGE_ENV, new_forge)

    # At once: the new key is sent, and the answer echoing it is scrubbed (the call's own
    # key always is, before the daemon-wide scrubber re-reads); old values stay scrubbed.
    first = await call(run, "model.chat", chat(), "c1")
    assert fake.chat_requests[-1].authorization == f"Bearer {new_key}"
    assert first["ok"] and f"extra [REDACTED:{KEY_ENV}]" in first["value"]["content"]
    assert first["value"]["content"].startswith(f"echo: header Bearer [REDACTED:{KEY_ENV}]")
    # Within the refresh interval the daemon-wide scrubber has read the new values too
    # (before that, a new secret_env value is not known yet: the documented lag).
    await trio.sleep(REFRESH_INTERVAL_S + 0.1)
    extra.append(new_forge)
    second = await call(run, "model.chat", chat(), "c2")
    assert second["ok"]
    assert second["value"]["content"].endswith(
        f"extra [REDACTED:{KEY_ENV}] | extra [REDACTED:{FORGE_ENV}] | extra [REDACTED:{FORGE_ENV}]"
    )
    for answer in (first, second):
        await assert_nowhere(gw, answer, KEY, FORGE, new_key, new_forge)


async def test_a_value_too_short_to_scrub_is_warned_about_and_left_in_text(
    short_tmp: Path, workspace: Path, fake: FakeProvider, env: pytest.MonkeyPatch
) -> None:
    short = "k" * (MIN_SCRUB_CHARS - 1)
    env.setenv(FORGE_ENV, short)
    fake.script(Text(content=f"the token is {short}"))
    with capture_logs() as logs:
        async with open_daemon(daemon_config(short_tmp, fake), preload=True) as daemon:
            gw = Gateway(daemon, short_tmp / "policies")
            run = await gw.create_run(workspace, POLICY)
            answer = await call(run, "model.chat", chat())
    assert answer["value"]["content"] == f"the token is {short}"
    warnings = [e for e in logs if e["event"] == "secret_too_short_to_scrub"]
    assert warnings == [
        {
            "event": "secret_too_short_to_scrub",
            "log_level": "warning",
            "name": FORGE_ENV,
            "length": MIN_SCRUB_CHARS - 1,
            "minimum": MIN_SCRUB_CHARS,
        }
    ]


# --- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("secret_env: FORGE", "secret_env: Value error, must be a list of environment variable"),
        ("secret_env: [FORGE-TOKEN]", "secret_env.0: Value error, secret_env name 'FORGE-TOKEN'"),
        ("secret_env: [A, B, A]", "secret_env: Value error, names a secret more than once: A"),
        ("secret_env: [1]", "secret_env.0: Input should be a valid string"),
        ("secret_env: [{A: b}]", "secret_env.0: Input should be a valid string"),
        ("secrets_env: [A]", "secrets_env: Extra inputs are not permitted"),
    ],
)
def test_bad_secret_env_is_refused_naming_the_field_and_the_rule(
    tmp_path: Path, text: str, expected: str
) -> None:
    path = tmp_path / "gatewayd.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value).startswith(f"{path}: ")
    assert expected in str(caught.value)


def test_secret_env_goes_from_the_file_into_the_daemons_configuration(tmp_path: Path) -> None:
    path = tmp_path / "gatewayd.yaml"
    path.write_text(f"secret_env: [{FORGE_ENV}, OTHER]\n")
    args = build_parser().parse_args(["serve", "--config", str(path), "--state-dir", "/tmp/x"])
    assert config_from_options(args).secret_env == (FORGE_ENV, "OTHER")
