"""The declaration of an MCP server in gatewayd's configuration (gatewayd/mcp/declaration.py
and the mcp_servers setting): each refusal names the field and says what to do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pydantic
import pytest

from gatewayd.config import GatewaydConfig
from gatewayd.mcp.declaration import McpServerDeclaration, Mode, Share

TIME = ["/opt/mcp/bin/mcp-server-time", "--local-timezone", "UTC"]


def declare(**fields: Any) -> McpServerDeclaration:
    return McpServerDeclaration.model_validate(fields)


def refusal(**fields: Any) -> str:
    with pytest.raises(pydantic.ValidationError) as refused:
        declare(**fields)
    return str(refused.value)


def config_refusal(servers: dict[str, Any], **settings: Any) -> str:
    with pytest.raises(pydantic.ValidationError) as refused:
        GatewaydConfig.model_validate({"mcp_servers": servers, **settings})
    return str(refused.value)


def test_a_full_declaration_reads_as_the_file_says() -> None:
    declared = declare(
        command=TIME,
        read_only_paths=["/opt/mcp"],
        share="per_run",
        workspace_paths=[{"path": "repo", "mode": "rw"}, {"path": "docs/api"}],
        egress_domains=["example.org"],
        env={"TZ": "UTC"},
        secret_env=["GITHUB_TOKEN"],
        call_timeout_s=30,
        start_timeout_s=20,
    )
    assert declared.command == tuple(TIME)
    assert declared.read_only_paths == (Path("/opt/mcp"),)
    assert declared.share is Share.PER_RUN
    assert [(w.path, w.mode) for w in declared.workspace_paths] == [
        ("repo", Mode.RW),
        ("docs/api", Mode.RO),
    ]
    assert declared.call_timeout_s == 30.0 and not declared.is_remote
    assert declare(url="https://mcp.example.org/mcp").is_remote


@pytest.mark.parametrize(
    ("fields", "said"),
    [
        ({}, "exactly one of command"),
        ({"command": TIME, "url": "https://x.example/mcp"}, "exactly one of command"),
        ({"command": ["mcp-server-time"]}, "must be an absolute path"),
        ({"command": []}, "at least 1 item"),
        ({"url": "ftp://x.example/mcp"}, "http:// or https://"),
        ({"url": "https://x.example/mcp", "env": {"A": "b"}}, "only a command server"),
        ({"url": "https://x.example/mcp", "egress_ports": [8443]}, "egress_ports: only a"),
        (
            {"command": TIME, "share": "shared", "workspace_paths": [{"path": "repo"}]},
            "a shared server serves every run at once",
        ),
        ({"command": TIME, "share": "everyone"}, "'shared' or 'per_run'"),
        ({"command": TIME, "workspace_paths": [{"path": "/etc"}]}, "must be relative"),
        ({"command": TIME, "workspace_paths": [{"path": "a/../../x"}]}, "without '..'"),
        ({"command": TIME, "workspace_paths": [{"path": "a", "mode": "rwx"}]}, "'ro' or 'rw'"),
        (
            {"command": TIME, "workspace_paths": [{"path": "a"}, {"path": "a"}]},
            "names a more than once",
        ),
        ({"command": TIME, "read_only_paths": ["opt/mcp"]}, "must be an absolute host path"),
        ({"command": TIME, "env": {"PATH": "/x"}}, "set by gatewayd"),
        ({"command": TIME, "env": {"A": "1"}, "secret_env": ["A"]}, "in both env and secret_env"),
        ({"command": TIME, "secret_env": ["not a name"]}, "secret_env name"),
        ({"command": TIME, "egress_domains": ["Example.ORG"]}, "lowercase host name"),
        ({"command": TIME, "egress_allow_private": ["db.corp"]}, "without egress_domains"),
        ({"command": TIME, "egress_domains": ["a.org"], "egress_ports": []}, "at least 1 item"),
        ({"command": TIME, "egress_domains": ["a.org"], "egress_ports": [0]}, "greater than"),
        ({"command": TIME, "call_timeout_s": 0}, "greater than 0"),
        ({"command": TIME, "call_timeout_s": "30"}, "valid number"),
        ({"command": TIME, "start_timeout_s": 601}, "less than or equal to 600"),
        ({"command": TIME, "comand": TIME}, "Extra inputs are not permitted"),
    ],
)
def test_a_bad_declaration_is_refused_saying_why(fields: dict[str, Any], said: str) -> None:
    assert said in refusal(**fields)


@pytest.mark.parametrize("name", ["Time", "1time", "t-x", "a" * 33, ""])
def test_a_server_name_must_fit_a_tool_name(name: str) -> None:
    message = config_refusal({name: {"command": TIME}})
    assert "mcp.<server>.<tool>" in message


@pytest.mark.parametrize(
    ("path", "setting"),
    [
        ("{state}", "state_dir"),
        ("{state}/runs", "state_dir"),
        ("/", "state_dir"),
        ("{state}-agent/x", "agent_dir"),
        ("{audit}", "audit_path's directory"),
    ],
)
def test_read_only_paths_never_show_gatewayds_own_directories(
    tmp_path: Path, path: str, setting: str
) -> None:
    state, audit = tmp_path / "state", tmp_path / "logs"
    given = path.format(state=state, audit=audit)
    message = config_refusal(
        {"t": {"command": TIME, "read_only_paths": [given]}},
        state_dir=str(state),
        audit_path=str(audit / "audit.jsonl"),
    )
    assert f"mcp_servers.t.read_only_paths: {given}" in message
    assert f"gatewayd's {setting}" in message and "no sandbox may see" in message


def test_read_only_paths_beside_gatewayds_directories_are_fine(tmp_path: Path) -> None:
    config = GatewaydConfig.model_validate(
        {
            "state_dir": str(tmp_path / "state"),
            "mcp_servers": {"t": {"command": TIME, "read_only_paths": [str(tmp_path / "venv")]}},
        }
    )
    assert config.mcp_servers["t"].read_only_paths == (tmp_path / "venv",)


def test_every_servers_secret_is_scrubbed_with_the_others() -> None:
    config = GatewaydConfig.model_validate(
        {
            "secret_env": ["FORGE_TOKEN"],
            "mcp_servers": {
                "a": {"command": TIME, "secret_env": ["GITHUB_TOKEN", "FORGE_TOKEN"]},
                "b": {"command": TIME, "secret_env": ["SLACK_TOKEN"]},
            },
        }
    )
    assert config.scrubbed_secret_env == ("FORGE_TOKEN", "GITHUB_TOKEN", "SLACK_TOKEN")
