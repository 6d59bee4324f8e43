"""sandbox.exec's own checks (its runs in real sandboxes are in test_agent_run.py)."""

from __future__ import annotations

import msgspec
import pytest

from gatewayd.errors import PolicyViolation
from gatewayd.protocol import ErrorCode
from gatewayd.tools.exec import SANDBOX_EXEC, ExecArgs
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
        ({"command": "id", "cwd": "/"}, "cwd"),
    ],
)
def test_bad_arguments_are_refused_naming_the_field(args: dict[str, object], field: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=field):
        msgspec.convert(args, ExecArgs)


def test_the_schema_describes_every_field() -> None:
    schema = SANDBOX_EXEC.manifest.args_schema["$defs"]["ExecArgs"]
    assert set(schema["properties"]) == {"command", "stdin", "timeout_s"}
    assert all("description" in p for p in schema["properties"].values())
