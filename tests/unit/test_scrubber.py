"""gatewayd.secrets: where a secret's value comes from (environment, systemd credential
file), and the scrubber that takes every configured value out of text, JSON, audit lines
and log lines, in the encodings it promises, picking up rotated values."""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import structlog
from structlog.testing import capture_logs

from gatewayd.audit import AuditEvent, open_audit_log, read_entries, verify_file
from gatewayd.audit.chain import WITHHELD_REASON, Chain, read_line
from gatewayd.config import ModelAlias
from gatewayd.logs import configure_logging
from gatewayd.protocol import MAX_ID_CHARS
from gatewayd.secrets import (
    MAX_CREDENTIAL_BYTES,
    MAX_VALUES_PER_NAME,
    MIN_SCRUB_CHARS,
    Scrubber,
    SecretError,
    SecretMissing,
    UnscrubbableError,
    encodings,
    read_secret,
    redact,
)

KEY = "sk-proj-Z3x9Qw7Lm2Np4Rt6Vb8Kc1Hd5Fg0"
FORGE = "ghp_forgeToken0123456789abcdefXYZ"


class Clock:
    """Monotonic seconds that move only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


def scrubber(env: dict[str, str], *names: str, clock: Clock | None = None) -> Scrubber:
    return Scrubber(names or tuple(env), environ=env, clock=clock or Clock())


def b64(text: str, *, prefix: bytes = b"", urlsafe: bool = False) -> str:
    encode = base64.urlsafe_b64encode if urlsafe else base64.b64encode
    return encode(prefix + text.encode()).decode()


# --- read_secret: environment, then systemd credential --------------------------------


@pytest.fixture
def creds(tmp_path: Path) -> Path:
    directory = tmp_path / "credentials"
    directory.mkdir()
    return directory


def test_the_environment_variable_is_the_first_place_looked() -> None:
    secret = read_secret("K", {"K": KEY})
    assert (secret.value, secret.source) == (KEY, "environment")


def test_an_unset_variable_falls_back_to_the_credential_file_minus_one_newline(
    creds: Path,
) -> None:
    (creds / "K").write_text(KEY + "\n\n")
    secret = read_secret("K", {"CREDENTIALS_DIRECTORY": str(creds)})
    assert secret.value == KEY + "\n"  # exactly one trailing newline is dropped
    assert secret.source == str(creds / "K")


def test_an_empty_variable_counts_as_unset(creds: Path) -> None:
    (creds / "K").write_text(KEY)
    assert read_secret("K", {"K": "", "CREDENTIALS_DIRECTORY": str(creds)}).value == KEY


def test_the_variable_wins_over_the_credential(creds: Path) -> None:
    (creds / "K").write_text("from-the-credential-file")
    assert read_secret("K", {"K": KEY, "CREDENTIALS_DIRECTORY": str(creds)}).value == KEY


def test_missing_everywhere_names_the_variable_and_the_credential_path(creds: Path) -> None:
    with pytest.raises(SecretMissing) as caught:
        read_secret("K", {"CREDENTIALS_DIRECTORY": str(creds)}, holds="its key")
    message = str(caught.value)
    assert "the environment variable K that holds its key is not set" in message
    assert f"there is no credential file {creds / 'K'}" in message
    assert "LoadCredential=K:" in message and "EnvironmentFile" in message


def test_missing_without_a_credentials_directory_says_that_it_is_not_set() -> None:
    with pytest.raises(SecretMissing) as caught:
        read_secret("K", {})
    message = str(caught.value)
    assert "the environment variable K that holds the secret is not set" in message
    assert "$CREDENTIALS_DIRECTORY is not set" in message


def test_an_empty_credential_file_is_missing_and_says_so(creds: Path) -> None:
    (creds / "K").write_text("\n")
    with pytest.raises(SecretMissing, match=r"the credential file .*/K is empty"):
        read_secret("K", {"CREDENTIALS_DIRECTORY": str(creds)})


def test_a_credential_that_is_not_utf8_is_refused_without_quoting_it(creds: Path) -> None:
    (creds / "K").write_bytes(b"sk-\xff\xfe-secret-bytes")
    with pytest.raises(SecretError) as caught:
        read_secret("K", {"CREDENTIALS_DIRECTORY": str(creds)})
    assert not isinstance(caught.value, SecretMissing)
    message = str(caught.value)
    assert f"the credential file {creds / 'K'}" in message
    assert "is not UTF-8 text (byte 3)" in message
    assert "secret-bytes" not in message


def test_a_variable_that_is_not_utf8_is_refused() -> None:
    undecodable = b"sk-\xff-key".decode("utf-8", "surrogateescape")
    with pytest.raises(SecretError, match=r"environment variable K .* is not UTF-8 text"):
        read_secret("K", {"K": undecodable})


def test_an_oversize_credential_file_is_refused_after_a_bounded_read(creds: Path) -> None:
    (creds / "K").write_bytes(b"x" * (MAX_CREDENTIAL_BYTES + 1))
    with pytest.raises(
        SecretError, match=f"is larger than {MAX_CREDENTIAL_BYTES} bytes.*LoadCredential"
    ):
        read_secret("K", {"CREDENTIALS_DIRECTORY": str(creds)})
    (creds / "K").write_bytes(b"x" * MAX_CREDENTIAL_BYTES)  # the cap itself is fine
    assert len(read_secret("K", {"CREDENTIALS_DIRECTORY": str(creds)}).value) == (
        MAX_CREDENTIAL_BYTES
    )


def test_a_credential_that_is_not_a_regular_file_is_refused_without_blocking(
    creds: Path,
) -> None:
    os.mkfifo(creds / "K")  # opening a FIFO for reading would wait for a writer
    with pytest.raises(
        SecretError, match=r"credential file .*/K .* must be a regular file, not a FIFO"
    ):
        read_secret("K", {"CREDENTIALS_DIRECTORY": str(creds)})


def test_an_unopenable_credential_says_what_to_check(creds: Path) -> None:
    (creds / "K").symlink_to(creds / "K")  # a loop: ELOOP, whoever runs the test
    with pytest.raises(
        SecretError, match=r"cannot read the credential file .*symbolic links.*permissions"
    ):
        read_secret("K", {"CREDENTIALS_DIRECTORY": str(creds)})


@pytest.mark.parametrize("name", ["", "A-B", "../etc/passwd", "1ABC", "A B"])
def test_a_name_that_is_not_a_variable_name_is_a_callers_bug(name: str) -> None:
    with pytest.raises(ValueError, match="is not a secret name"):
        read_secret(name, {})
    with pytest.raises(ValueError, match="is not a secret name"):
        Scrubber([name])


# --- the encodings ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shown", "expected"),
    [
        (KEY, "[REDACTED:OPENAI_API_KEY]"),
        (b64(KEY), "[REDACTED:OPENAI_API_KEY]"),
        (b64(KEY, urlsafe=True), "[REDACTED:OPENAI_API_KEY]"),
        (json.dumps({"k": KEY}), '{"k": "[REDACTED:OPENAI_API_KEY]"}'),
        (f"https://h/v1?key={KEY}&x=1", "https://h/v1?key=[REDACTED:OPENAI_API_KEY]&x=1"),
        (f"Bearer {KEY}", "Bearer [REDACTED:OPENAI_API_KEY]"),
    ],
    ids=["raw", "base64", "base64url", "json", "url", "header"],
)
def test_the_value_and_each_promised_encoding_are_replaced_by_the_name(
    shown: str, expected: str
) -> None:
    scrub = scrubber({"OPENAI_API_KEY": KEY})
    assert scrub.text(f"before {shown} after") == f"before {expected} after"


def test_json_escaped_and_percent_encoded_forms_of_an_awkward_value() -> None:
    value = 'pa"ss\\wörd/+ 1234'
    scrub = scrubber({"PW": value})
    for shown in (
        json.dumps(value),  # \" \\ and \u00f6
        msgspec.json.encode(value).decode(),  # \" \\ and the raw ö
        "https://h/?p=" + "pa%22ss%5Cw%C3%B6rd%2F%2B%201234",
        b64(value),
        b64(value, urlsafe=True),
    ):
        out = scrub.text(shown)
        assert "[REDACTED:PW]" in out, shown
        assert "ss\\w" not in out and 'pa"ss' not in out and "1234" not in out


@pytest.mark.parametrize("prefix", [b"", b"u", b"us", b"user:", b"user:x"])
@pytest.mark.parametrize("urlsafe", [False, True])
def test_a_value_base64_encoded_inside_longer_text_is_found_at_every_alignment(
    prefix: bytes, urlsafe: bool
) -> None:
    value = "sk-live?>?>0123456789abcdef~~~"  # encodes to + and / (- and _ in base64url)
    blob = b64("", prefix=prefix + value.encode() + b":tail", urlsafe=urlsafe)
    assert ("+" in blob) != urlsafe and ("-" in blob) == urlsafe

    out = scrubber({"V": value}).text(f"Basic {blob}")

    before, found, after = out.removeprefix("Basic ").partition("[REDACTED:V]")
    assert found, out
    # Left over: the characters that also encode the neighbouring text, which carry at
    # most two bytes of the value at each end.
    assert len(before) <= 4 * -(-(len(prefix) + 2) // 3)
    assert len(after) <= 4 * -(-(2 + len(b":tail")) // 3)


def test_encodings_are_documented_and_not_more() -> None:
    forms = encodings(KEY)
    assert KEY in forms and b64(KEY) in forms
    assert KEY[::-1] not in forms and KEY.encode().hex() not in forms  # said: not covered
    assert KEY.upper() not in forms


def test_a_secret_split_across_two_texts_is_not_found_as_documented() -> None:
    scrub = scrubber({"K": KEY})
    half = len(KEY) // 2
    assert scrub.text(KEY[:half]) == KEY[:half] and scrub.text(KEY[half:]) == KEY[half:]


# --- overlapping secrets, short values, nothing configured -------------------------------


def test_overlapping_secrets_are_replaced_longest_first() -> None:
    inner = "token-0123456789"
    outer = f"Bearer {inner}-suffix"
    scrub = scrubber({"OUTER": outer, "INNER": inner})
    assert scrub.text(f"a {outer} b {inner} c") == "a [REDACTED:OUTER] b [REDACTED:INNER] c"
    # The same order whichever name is configured first.
    scrub = scrubber({"INNER": inner, "OUTER": outer}, "INNER", "OUTER")
    assert scrub.text(f"a {outer} b") == "a [REDACTED:OUTER] b"


def test_two_names_with_one_value_use_the_first_name() -> None:
    scrub = scrubber({"FIRST": KEY, "SECOND": KEY}, "FIRST", "SECOND")
    assert scrub.text(KEY) == "[REDACTED:FIRST]"


def test_a_short_value_is_not_scrubbed_and_is_warned_about_once() -> None:
    env = {"SHORT": "hunter2", "K": KEY}
    clock = Clock()
    scrub = scrubber(env, clock=clock)
    with capture_logs() as logs:
        assert scrub.text("hunter2 and " + KEY) == "hunter2 and [REDACTED:K]"
        for value in ("abc", "hunter2", "hunter2"):  # rotated away and back: no new warning
            env["SHORT"] = value
            clock.now += 10
            assert scrub.text(value) == value
    warnings = [entry for entry in logs if entry["event"] == "secret_too_short_to_scrub"]
    assert [(w["name"], w["length"], w["minimum"]) for w in warnings] == [
        ("SHORT", 7, MIN_SCRUB_CHARS),
        ("SHORT", 3, MIN_SCRUB_CHARS),
    ]
    assert all(w["log_level"] == "warning" for w in warnings)
    assert "hunter2" not in str(logs)


def test_a_second_scrubber_of_the_same_names_can_stay_quiet() -> None:
    quiet = Scrubber(["SHORT"], environ={"SHORT": "abc"}, warn=False)
    with capture_logs() as logs:
        quiet.text("abc")
    assert logs == []


def test_an_unreadable_credential_is_warned_about_once_and_scrubbing_goes_on(
    creds: Path,
) -> None:
    (creds / "BAD").write_bytes(b"\xff\xfe")
    clock = Clock()
    scrub = Scrubber(
        ["BAD", "K"], environ={"CREDENTIALS_DIRECTORY": str(creds), "K": KEY}, clock=clock
    )
    with capture_logs() as logs:
        assert scrub.text(KEY) == "[REDACTED:K]"
        clock.now += 5
        scrub.text(KEY)
    assert [entry["event"] for entry in logs] == ["secret_unreadable"]
    assert "not UTF-8" in logs[0]["reason"] and logs[0]["name"] == "BAD"


def test_no_secret_configured_is_the_zero_cost_path() -> None:
    def clock() -> float:
        raise AssertionError("a scrubber without names must not even read the clock")

    scrub = Scrubber([], clock=clock)
    text, payload, value = "anything " + KEY, b'{"a":"' + KEY.encode() + b'"}', {"k": [KEY]}
    assert scrub.text(text) is text
    assert scrub.json(payload) is payload
    assert scrub.value(value) is value
    assert not scrub.found_in(payload)


def test_names_without_values_scrub_nothing() -> None:
    scrub = scrubber({}, "UNSET")
    assert scrub.text(KEY) == KEY and not scrub.found_in(KEY.encode())


def test_text_without_a_secret_comes_back_as_the_same_object() -> None:
    scrub = scrubber({"K": KEY})
    text = "nothing to see here " * 10
    assert scrub.text(text) is text


def test_for_config_takes_every_alias_key_and_secret_env_once() -> None:
    models = {
        "a": ModelAlias(provider="openai", model="m", api_key_env="K"),
        "b": ModelAlias(provider="openai", model="m", api_key_env="K"),
        "local": ModelAlias(provider="openai", model="m", api_base="http://127.0.0.1:1/v1"),
    }
    assert Scrubber.for_config(models, ("FORGE", "K")).names == ("K", "FORGE")
    assert Scrubber.for_config({}).names == ()


# --- rotation ---------------------------------------------------------------------------


def test_a_rotated_value_is_picked_up_within_the_refresh_interval_and_the_old_one_kept(
    creds: Path,
) -> None:
    env = {"CREDENTIALS_DIRECTORY": str(creds)}
    (creds / "K").write_text(KEY)
    clock = Clock()
    scrub = Scrubber(["K"], environ=env, clock=clock, refresh_s=1.0)
    assert scrub.text(KEY) == "[REDACTED:K]"
    rotated = KEY[::-1] + "-v2"
    (creds / "K").write_text(rotated)
    clock.now += 0.5
    assert scrub.text(rotated) == rotated  # not re-read yet: at most once per refresh_s
    clock.now += 0.5
    assert scrub.text(rotated) == "[REDACTED:K]"
    assert scrub.text(KEY) == "[REDACTED:K]"  # a call begun with the old key may echo it


def test_only_the_last_values_of_a_name_stay_scrubbed() -> None:
    env = {"K": KEY}
    clock = Clock()
    scrub = Scrubber(["K"], environ=env, clock=clock)
    values = [f"{KEY}-rotation-{n}" for n in range(MAX_VALUES_PER_NAME + 1)]
    for value in values:
        env["K"] = value
        clock.now += 1
        scrub.text("")
    assert scrub.text(KEY) == KEY  # the original fell out
    assert scrub.text(values[0]) == values[0]
    for value in values[1:]:
        assert scrub.text(value) == "[REDACTED:K]"


def test_refresh_costs_one_read_per_name_per_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    import gatewayd.secrets as secrets

    reads: list[str] = []
    real = secrets.read_secret

    def counting(name: str, environ: Any = None, **kwargs: Any) -> Any:
        reads.append(name)
        return real(name, environ, **kwargs)

    monkeypatch.setattr(secrets, "read_secret", counting)
    clock = Clock()
    scrub = Scrubber(["K", "F"], environ={"K": KEY, "F": FORGE}, clock=clock)
    for _ in range(100):
        scrub.found_in(b"x")
    assert reads == ["K", "F"]
    clock.now += 1
    scrub.found_in(b"x")
    assert reads == ["K", "F", "K", "F"]


# --- JSON and structured values ----------------------------------------------------------


def test_json_is_scrubbed_string_by_string_and_stays_the_same_shape() -> None:
    scrub = scrubber({"K": KEY})
    value = {"content": f"the key is {KEY}", KEY: [1, {"deep": b64(KEY)}], "n": 3.5}
    out = msgspec.json.decode(scrub.json(msgspec.json.encode(value)))
    assert out == {
        "content": "the key is [REDACTED:K]",
        "[REDACTED:K]": [1, {"deep": "[REDACTED:K]"}],
        "n": 3.5,
    }


def test_json_whose_syntax_a_secret_spans_is_refused_not_leaked() -> None:
    spanning = 'a","b":"c'  # only ever in the encoded bytes, never in one string
    scrub = scrubber({"S": spanning})
    with pytest.raises(UnscrubbableError):
        scrub.json(b'{"x":"a","b":"c"}')


def test_value_walks_structs_tuples_and_mappings() -> None:
    class Point(msgspec.Struct):
        label: str

    scrub = scrubber({"K": KEY})
    assert scrub.value((Point(label=KEY), {"k": (KEY,)})) == [
        {"label": "[REDACTED:K]"},
        {"k": ["[REDACTED:K]"]},
    ]


def test_redact_takes_one_value_out_whatever_its_length() -> None:
    assert redact("abc abc", "K", "abc") == "[REDACTED:K] [REDACTED:K]"
    assert redact("text", "K", "") == "text"
    # One pass: a replacement is never matched again (the value is part of the label).
    assert redact("RED", "RED", "RED") == "[REDACTED:RED]"


# --- the audit chain: the last line of defence ------------------------------------------


def test_every_field_of_an_audit_entry_is_scrubbed_and_the_line_still_verifies() -> None:
    chain = Chain(scrubber=scrubber({"K": KEY}))
    _, digest, line = chain.append(
        "call",
        {
            "runId": "run-1",
            "toolCallId": "c1",
            "tool": "model.chat",
            "argsSummary": {KEY: f"x {KEY}", "nested": [{"b64": b64(KEY)}]},
            "safeMessage": f"provider said {KEY}",
            "review": {"reason": json.dumps({"k": KEY})},
            "detail": {"url": f"https://h/?key={KEY}"},
            "peer": {"pid": 1, "uid": 2, "gid": 3},
        },
    )
    assert KEY.encode() not in line and b64(KEY).encode() not in line
    sealed = read_line(line.rstrip(b"\n"))  # the hash is over the scrubbed bytes
    assert sealed.hash == digest
    entry = sealed.entry
    assert entry.safeMessage == "provider said [REDACTED:K]"
    assert entry.argsSummary == {
        "[REDACTED:K]": "x [REDACTED:K]",
        "nested": [{"b64": "[REDACTED:K]"}],
    }
    assert entry.detail == {"url": "https://h/?key=[REDACTED:K]"}
    assert entry.peer is not None and entry.peer["uid"] == 2


def test_an_id_that_grows_past_its_limit_when_scrubbed_is_cut_to_fit() -> None:
    long_name = "A_VERY_LONG_SECRET_VARIABLE_NAME_" + "X" * 90
    chain = Chain(scrubber=scrubber({long_name: KEY}))
    tool_call_id = KEY + "-" + "c" * (MAX_ID_CHARS - len(KEY) - 1)
    line = chain.append("result", {"toolCallId": tool_call_id, "errorCode": "internal"})[2]
    entry = read_line(line.rstrip(b"\n")).entry
    assert KEY.encode() not in line
    assert entry.toolCallId is not None and len(entry.toolCallId) == MAX_ID_CHARS
    assert entry.toolCallId.startswith("[REDACTED:A_VERY_LONG")


@pytest.mark.parametrize("kind", ["event", "result"])
def test_an_entry_a_secret_spans_is_withheld_not_written_with_it(kind: str) -> None:
    spanning = '"tool":"fs.read'  # spans a key and its value in the encoded line
    chain = Chain(scrubber=scrubber({"S": spanning}))
    fields: dict[str, Any] = {"tool": "fs.read", "runId": "run-1"}
    if kind == "event":
        fields["event"] = "run_created"
    seq, digest, line = chain.append(kind, fields)
    assert spanning.encode() not in line
    sealed = read_line(line.rstrip(b"\n"))
    assert (sealed.entry.seq, sealed.hash) == (seq, digest)
    assert sealed.entry.detail == {"withheld": WITHHELD_REASON}
    assert sealed.entry.runId is None and sealed.entry.tool is None
    if kind == "event":
        assert sealed.entry.event == "entry_withheld"
    # The chain goes on from the withheld entry.
    nxt = read_line(chain.append("result", {"runId": "run-2"})[2].rstrip(b"\n"))
    assert nxt.entry.prev == digest


def test_an_audit_entry_without_a_secret_is_byte_for_byte_what_it_was() -> None:
    fields = {"runId": "run-1", "tool": "fs.read", "safeMessage": "no secrets here"}
    plain = Chain(clock=lambda: 0).append("call", fields)
    scrubbed = Chain(clock=lambda: 0, scrubber=scrubber({"K": KEY})).append("call", fields)
    assert plain == scrubbed


async def test_the_audit_file_never_holds_a_secret_and_verifies(tmp_path: Path) -> None:
    path = tmp_path / "audit" / "audit.jsonl"
    scrub = scrubber({"K": KEY, "FORGE": FORGE})
    async with open_audit_log(path, fsync=False, scrubber=scrub) as audit:
        await audit.append(
            "event", event=AuditEvent.RUN_CREATED, detail={"k": KEY, "f": b64(FORGE)}
        )
        await audit.append("result", runId="run-1", errorCode="tool_failed", safeMessage=KEY)
    raw = path.read_bytes()
    for secret in (KEY, FORGE):
        assert secret.encode() not in raw and b64(secret).encode() not in raw
    assert b"[REDACTED:K]" in raw and b"[REDACTED:FORGE]" in raw
    assert verify_file(path).ok
    results = [e for e in read_entries(path) if e["kind"] == "result"]
    assert [e["safeMessage"] for e in results] == ["[REDACTED:K]"]


# --- gatewayd's own log ---------------------------------------------------------------------


@pytest.fixture
def fresh_logging() -> Iterator[None]:
    yield
    structlog.reset_defaults()


@pytest.mark.usefixtures("fresh_logging")
def test_the_daemon_log_lines_are_scrubbed_and_stay_json(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configure_logging(scrubber=scrubber({"K": KEY}))
    log = structlog.get_logger("test")
    log.warning("provider_answer", body=f"echo {KEY}", nested={"b": b64(KEY)})
    try:
        raise RuntimeError(f"boom with {KEY}")
    except RuntimeError:
        log.exception("crashed")
    written = capsys.readouterr().err
    lines = written.splitlines()
    assert len(lines) == 2
    assert KEY not in written and b64(KEY) not in written
    first = json.loads(lines[0])
    assert first["body"] == "echo [REDACTED:K]" and first["nested"] == {"b": "[REDACTED:K]"}
    assert "boom with [REDACTED:K]" in json.loads(lines[1])["exception"]


@pytest.mark.usefixtures("fresh_logging")
def test_the_daemon_log_without_secrets_is_unchanged(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging()
    structlog.get_logger("test").warning("plain", value=KEY)
    assert json.loads(capsys.readouterr().err)["value"] == KEY
