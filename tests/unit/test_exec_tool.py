"""sandbox.exec's own checks (its runs in real sandboxes are in test_agent_run.py)."""

from __future__ import annotations

import argparse

import msgspec
import pytest

from gatewayd.cli import build_parser
from gatewayd.cli.run import _exec_options
from gatewayd.errors import GatewayError, InvalidArguments, PolicyViolation
from gatewayd.policy.model import NetworkSection
from gatewayd.protocol import ErrorCode
from gatewayd.tools.exec import (
    MAX_ENV_VALUE_CHARS,
    SANDBOX_EXEC,
    ExecArgs,
    ExecOptions,
    prepare_exec,
    resolve_cwd,
)
from gatewayd.tools.registry import ToolContext


async def test_a_run_without_an_os_sandbox_runs_no_command() -> None:
    ctx = ToolContext(
        run_id="r", grants=(), max_output_bytes=1 << 20, sandbox=None, degraded="no bwrap"
    )
    with pytest.raises(PolicyViolation) as caught:
        await SANDBOX_EXEC.runner.run(ExecArgs(command="id"), ctx)
    assert caught.value.code is ErrorCode.POLICY_DENIED
    assert "only inside an OS sandbox" in str(caught.value) and "no bwrap" in str(caught.value)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"command": ""}, "command"),
        ({"command": "x" * 32_769}, "command"),
        ({"command": "id", "timeout_s": 0}, "timeout_s"),
        # note 002 took ``home`` out of exec: the sandbox owns it, a caller never sets it
        ({"command": "id", "home": "/"}, "home"),
        ({"command": "id", "cwd": ""}, "cwd"),
        ({"command": "id", "env": {"A": 1}}, "env"),
        ({"command": "id", "env": {f"V{i}": "" for i in range(65)}}, "env"),
        ({"command": "id", "env": {"A": "x" * 32_769}}, "env"),
        ({"command": "id", "allowedDomains": "example.org"}, "allowedDomains"),
        ({"command": "id", "allowedDomains": ["a.org"] * 65}, "allowedDomains"),
        ({"command": "id", "packageManagers": ["pypi"] * 7}, "packageManagers"),
    ],
)
def test_bad_arguments_are_refused_naming_the_field(args: dict[str, object], field: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=field):
        msgspec.convert(args, ExecArgs)


def test_the_schema_describes_every_field() -> None:
    schema = SANDBOX_EXEC.manifest.args_schema["$defs"]["ExecArgs"]
    assert set(schema["properties"]) == {
        "command",
        "stdin",
        "timeout_s",
        "cwd",
        "env",
        "allowedDomains",
        "packageManagers",
    }
    assert all("description" in p for p in schema["properties"].values())


def _cli(*argv: str) -> argparse.Namespace:
    parser = build_parser()
    return parser.parse_args(["exec", *argv, "0" * 32, "--", "true"])


def test_gatewayd_exec_flags_become_the_requests_options() -> None:
    args = _cli(
        "--cwd",
        "sub",
        "--env",
        "A=1",
        "--env",
        "B=x=y",
        "--allow-domain",
        "example.org",
        "--package-manager",
        "pypi",
    )
    assert _exec_options(args) == {
        "cwd": "sub",
        "env": {"A": "1", "B": "x=y"},
        "allowedDomains": ["example.org"],
        "packageManagers": ["pypi"],
    }
    assert _exec_options(_cli()) == {}  # none given: the run's, as before
    assert _exec_options(_cli("--no-network")) == {"allowedDomains": []}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--env", "NOEQUALS"), "give NAME=VALUE"),
        (("--env", "=v"), "give NAME=VALUE"),
        (("--env", "A=1", "--env", "A=2"), "names A twice"),
        (("--no-network", "--allow-domain", "x.org"), "--no-network gives no network"),
    ],
)
def test_gatewayd_exec_refuses_flags_that_cannot_be_options(
    argv: tuple[str, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _exec_options(_cli(*argv))


@pytest.mark.parametrize(
    ("env", "code", "phrase"),
    [
        ({"SECRET_TOKEN": "x"}, ErrorCode.POLICY_DENIED, "allowed: GREETING, V0, V1"),
        ({"GREETING": "a\0b"}, ErrorCode.INVALID_ARGS, "NUL byte"),
        ({"GREETING": "x" * (MAX_ENV_VALUE_CHARS + 1)}, ErrorCode.INVALID_ARGS, "at most"),
        # Each value within its bound, all of them past what bwrap's arguments can carry.
        (
            {f"V{i}": "x" * MAX_ENV_VALUE_CHARS for i in range(9)},
            ErrorCode.INVALID_ARGS,
            "in all",
        ),
    ],
)
def test_variables_are_checked_against_env_allow_and_bounded(
    env: dict[str, str], code: ErrorCode, phrase: str
) -> None:
    # The control socket's request reaches prepare_exec without the tool's schema.
    with pytest.raises(GatewayError) as caught:
        prepare_exec(
            ExecOptions(env=env),
            grants=(),
            env_allow=("GREETING", *(f"V{i}" for i in range(9))),
            network=NetworkSection(),
        )
    assert caught.value.code is code and phrase in str(caught.value)


@pytest.mark.parametrize("cwd", ["/", "/etc", "..", "../x", "/workspacex", "/tmp"])
def test_a_cwd_outside_the_workspace_is_invalid_args(cwd: str) -> None:
    with pytest.raises(InvalidArguments, match="outside /workspace"):
        resolve_cwd(cwd, ())


def test_a_cwd_beneath_the_workspace_but_outside_every_grant_is_policy_denied() -> None:
    with pytest.raises(PolicyViolation, match="Readable paths: none"):
        resolve_cwd("sub", ())
