"""`audit_witnesses` in gatewayd's configuration, and `gatewayd witness serve`'s options:
each refusal says what is wrong."""

from __future__ import annotations

import re
from typing import Any

import pytest
from pydantic import ValidationError

from gatewayd.audit.note import generate_key
from gatewayd.cli.witness import WitnessStartRefused, parse_listen, parse_logs
from gatewayd.config import MAX_AUDIT_WITNESSES, AuditWitness, GatewaydConfig

KEY = "w.example/1+865d03be+BDdfF6OR1N7dL+XjaTG4/2rPUAHXKJ74KcweZD4m078L"


def witness(**changes: Any) -> dict[str, Any]:
    return {"name": "w.example/1", "url": "https://w.example/1", "verifier_key": KEY, **changes}


def test_a_witness_is_read() -> None:
    config = GatewaydConfig.model_validate({"audit_witnesses": [witness()]})
    assert config.audit_witnesses == (AuditWitness(**witness()),)


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        (witness(url="ftp://w.example/1"), "is not a witness URL"),
        (witness(url="https://user:pw@w.example/1"), "no user, query or fragment"),
        (witness(url="https://w.example/1?x=1"), "is not a witness URL"),
        (
            witness(name="w.example/2"),
            "verifier_key is the key of 'w.example/1', not of 'w.example/2'",
        ),
        (witness(verifier_key="w.example/1+865d03be+AAAA"), "not an Ed25519 witness key"),
        (witness(verifier_key=KEY.replace("865d03be", "865d03bf")), "does not match its name"),
        (witness(extra=1), "Extra inputs are not permitted"),
        ({"name": "w.example/1"}, "Field required"),
    ],
)
def test_a_bad_witness_is_refused_saying_why(entry: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError) as caught:
        GatewaydConfig.model_validate({"audit_witnesses": [entry]})
    assert says in str(caught.value)


def test_a_witness_named_twice_or_too_many_are_refused() -> None:
    with pytest.raises(ValidationError, match=r"names a witness more than once: w\.example/1"):
        GatewaydConfig.model_validate({"audit_witnesses": [witness(), witness()]})
    with pytest.raises(ValidationError, match=f"at most {MAX_AUDIT_WITNESSES} items"):
        GatewaydConfig.model_validate({"audit_witnesses": [witness()] * (MAX_AUDIT_WITNESSES + 1)})


# --- `gatewayd witness serve`'s options ----------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:7380", ("127.0.0.1", 7380)),
        ("[::1]:0", ("::1", 0)),
        ("0.0.0.0:80", ("0.0.0.0", 80)),
    ],
)
def test_listen_addresses_parse(text: str, expected: tuple[str, int]) -> None:
    assert parse_listen(text) == expected


@pytest.mark.parametrize("text", ["7380", "host:", ":7380", "host:70000", "host:http"])
def test_a_bad_listen_address_says_the_form(text: str) -> None:
    with pytest.raises(
        WitnessStartRefused, match=re.escape("expected HOST:PORT, e.g. 127.0.0.1:7380")
    ):
        parse_listen(text)


def test_two_keys_of_one_log_are_both_trusted() -> None:
    first, second = generate_key("log.example/a")[1], generate_key("log.example/a")[1]
    logs = parse_logs([first, second, generate_key("log.example/b")[1]])
    assert sorted(logs) == ["log.example/a", "log.example/b"]
    assert [v.to_string() for v in logs["log.example/a"]] == [first, second]
