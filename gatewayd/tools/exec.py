"""``sandbox.exec``: run a shell command inside the run's OS sandbox.

The host-owned agent loop (gatewayd/agent/loop.py) offers this to the model as ``exec``;
it is a tool like any other, so a call goes through the allowlist, the policy, review
and the audit log before the command starts. The command runs in a fresh sandbox of the
run (its uid, its network namespace, its workspace, its limits), never on the host: a run
without an OS sandbox (degraded) is refused.

Output comes back as text (invalid UTF-8 replaced), each stream cut at the run's
``sandbox.max_output_bytes`` like any sandboxed command.
"""

from __future__ import annotations

from typing import Annotated, Any, Final

import msgspec

from gatewayd.errors import PolicyViolation
from gatewayd.policy.capabilities import Capabilities, CapabilityRequest, no_sandbox_refusal
from gatewayd.sandbox.launch import ResultForm, exec_result_json
from gatewayd.tools.builtin import builtin_tool
from gatewayd.tools.registry import Tool, ToolContext

MAX_COMMAND_CHARS: Final = 32_768
MAX_STDIN_CHARS: Final = 1_000_000
# The sandbox's own per-command limit (sandbox.timeout_s) and the call's limit
# (limits.call_timeout_s) still apply; this only lets a call ask for less.
MAX_TIMEOUT_S: Final = 24 * 3600.0
SHELL: Final = "/bin/sh"


class ExecArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Run one shell command in the run's sandbox, in /workspace."""

    command: Annotated[
        str,
        msgspec.Meta(
            min_length=1,
            max_length=MAX_COMMAND_CHARS,
            description="A /bin/sh command line, run in /workspace inside the sandbox.",
        ),
    ]
    stdin: Annotated[
        str,
        msgspec.Meta(max_length=MAX_STDIN_CHARS, description="Text for the command's stdin."),
    ] = ""
    timeout_s: Annotated[
        Annotated[float, msgspec.Meta(gt=0, le=MAX_TIMEOUT_S)] | None,
        msgspec.Meta(description="Stop the command after this many seconds (default: the run's)."),
    ] = None


# Every call runs a command; the policy step refuses it in a run without an OS sandbox.
EXEC_REQUEST: Final = CapabilityRequest(exec=True)


def exec_request(_args: ExecArgs) -> CapabilityRequest:
    return EXEC_REQUEST


async def run_exec(args: ExecArgs, ctx: ToolContext) -> Any:
    if ctx.sandbox is None:
        # The policy step refused this already; the check stays where the sandbox is used.
        raise PolicyViolation(no_sandbox_refusal("sandbox.exec", ctx.degraded or "no sandbox"))
    result = await ctx.sandbox.exec(
        [SHELL, "-c", args.command],
        stdin=args.stdin.encode() if args.stdin else None,
        timeout_s=args.timeout_s,
        env_values={},
    )
    return exec_result_json(result, ResultForm.TOOL)


SANDBOX_EXEC: Tool[ExecArgs] = builtin_tool(
    name="sandbox.exec",
    summary="Run a shell command inside the run's sandbox (its uid, no network but the "
    "gateway, its workspace and limits); returns exit code and output.",
    args_type=ExecArgs,
    run=run_exec,
    requests=exec_request,
    capabilities=Capabilities(exec=True),
)
