"""`gatewayd mcp list|show|diff|pin`: the declared MCP servers and the operator's
approval of their tools (pinning).

The daemon owns the servers (each runs in a sandbox of its own), so a command goes
through `gatewayd serve`'s control socket when one answers there (``/v1/mcp/...``);
when none does, it opens the daemon in this process, as `gatewayd run` does, for the
one command (:mod:`gatewayd.mcp.approval` does the work either way, and answers the
same). Exit status: 0 done; 1 refused or failed (the message says why and what to do);
for `diff`, 1 also when the live tools differ from their pins, so a script can check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import quote

from gatewayd.cli.command import EXIT_FAILED, EXIT_OK, refusing
from gatewayd.cli.control_client import ask_else_here, control_request, print_refusal
from gatewayd.cli.in_process import answer_in_process
from gatewayd.cli.options import (
    add_daemon_options,
    control_socket_of,
    who_answers,
)

if TYPE_CHECKING:
    from gatewayd.cli.command import Subparsers
    from gatewayd.daemon import Daemon
    from gatewayd.mcp.approval import Approval

# How much of a pinned description `show` prints per tool (the pin file has it whole).
SHOW_DESCRIPTION_CHARS: Final = 200


def add_parsers(sub: Subparsers) -> None:
    mcp = sub.add_parser(
        "mcp", help="declared MCP servers and their pinned tools (approve a server's tools)"
    ).add_subparsers(dest="mcp_command", required=True)
    for name, helptext in (
        ("list", "every declared server: transport, share mode, pinned tools, whether current"),
        ("show", "a server's pinned tools: gateway name, description, digest"),
        ("diff", "a server's live tools against its pins (starts it, sandboxed)"),
        (
            "pin",
            "approve a server's live tools (all, or --tool NAME...); re-pin to approve a change",
        ),
    ):
        cmd = mcp.add_parser(name, help=helptext)
        add_daemon_options(cmd)
        cmd.add_argument(
            "--control-socket",
            type=Path,
            default=None,
            help="the control socket of the running gatewayd (default: the configuration's)",
        )
        if name != "list":
            cmd.add_argument("server", metavar="SERVER", help="the server's name in mcp_servers")
        if name == "pin":
            cmd.add_argument(
                "--tool",
                action="append",
                default=None,
                metavar="NAME",
                help="pin only this tool, by its MCP name (repeatable); the other pins stay",
            )
            cmd.add_argument("--by", default=None, help="who approves (default: your user name)")


def main(args: argparse.Namespace) -> int:
    return refusing(_mcp, args)


def _mcp(args: argparse.Namespace) -> int:
    from gatewayd.mcp.pinset import PinError, check_server_name

    command: str = args.mcp_command
    if command != "list":
        try:
            check_server_name(args.server)
        except PinError as exc:
            print(f"gatewayd mcp {command}: bad_request: {exc}", file=sys.stderr)
            return EXIT_FAILED
    control = control_socket_of(args)
    answer = ask_else_here(
        "gatewayd mcp",
        control,
        lambda: _through_control(control, args),
        lambda: _in_process(args),
        missing_routes="no MCP routes (an older version?); restart it to pin through it",
    )
    if answer is None or print_refusal(f"gatewayd mcp {command}", answer):
        return EXIT_FAILED
    return _print(command, answer)


def _through_control(control: str, args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    """The command as one request to the daemon's control socket. Error handling:
    OSError when nothing answers there."""
    command = args.mcp_command
    if command == "list":
        return control_request(control, "GET", "/v1/mcp/servers")
    target = f"/v1/mcp/servers/{quote(args.server, safe='')}"
    if command == "show":
        return control_request(control, "GET", f"{target}/pins")
    if command == "diff":
        return control_request(control, "GET", f"{target}/diff")
    body = {"tools": args.tool, "pinnedBy": who_answers(args)}
    return control_request(control, "POST", f"{target}/pins", body)


def _in_process(args: argparse.Namespace) -> dict[str, Any]:
    """The command in a daemon opened for it (no `gatewayd serve` answers)."""
    from gatewayd.mcp.approval import Approval, ApprovalError

    async def ask(daemon: Daemon) -> dict[str, Any]:
        approval = Approval(daemon.mcp_tools)
        try:
            return await _ask(approval, args)
        except ApprovalError as exc:
            return {"ok": False, "errorCode": str(exc.code), "message": exc.message}

    return answer_in_process(args, ask)


async def _ask(approval: Approval, args: argparse.Namespace) -> dict[str, Any]:
    command = args.mcp_command
    if command == "list":
        return await approval.servers()
    if command == "show":
        return await approval.show(args.server)
    if command == "diff":
        return await approval.diff(args.server)
    tools = tuple(args.tool) if args.tool is not None else None
    return await approval.pin(args.server, tools=tools, by=who_answers(args))


def _print(command: str, answer: dict[str, Any]) -> int:
    if command == "list":
        servers = answer["servers"]
        if not servers:
            print("no MCP servers are declared (mcp_servers in gatewayd's configuration)")
        for entry in servers:
            pins = f"{entry['pinned']} pinned"
            if entry.get("pinProblem"):
                pins = f"pin file refused: {entry['pinProblem']}"
            print(
                f"{entry['server']}  {entry['transport']}  {entry['share']}  {pins}  "
                f"({entry['live']})"
            )
        return EXIT_OK
    if command == "show":
        tools = answer["tools"]
        print(f"server {answer['server']}: {len(tools)} pinned tool(s) ({answer['path']})")
        for tool in tools:
            description = " ".join(tool["description"].split())
            if len(description) > SHOW_DESCRIPTION_CHARS:
                description = description[:SHOW_DESCRIPTION_CHARS] + "…"
            print(f"  {tool['gatewayName']}  {tool['digest']}")
            print(f"      {description!r}  (pinned {tool['pinnedAt']} by {tool['pinnedBy']})")
        return EXIT_OK
    if command == "diff":
        changes = answer["changes"]
        print(
            f"server {answer['server']}: {answer['offered']} tool(s) offered, "
            f"{answer['pinned']} pinned, {len(changes)} difference(s)"
        )
        for change in changes:
            name = change["gatewayName"] or change["mcpName"]
            print(f"  {change['kind']:>12}  {name}: {change['detail']}")
        if changes:
            print(f"approve with: gatewayd mcp pin {answer['server']} [--tool NAME]")
        return EXIT_FAILED if changes else EXIT_OK
    print(f"pinned {len(answer['tools'])} tool(s) of server {answer['server']} in {answer['path']}")
    for what in ("added", "changed", "removed"):
        if answer.get(what):
            print(f"  {what}: {', '.join(answer[what])}")
    if answer.get("replacedUnusableFile"):
        print(f"  replaced a pin file that failed its checks: {answer['replacedUnusableFile']}")
    for tool in answer["tools"]:
        print(f"  {tool['gatewayName']}  {tool['digest']}")
    return EXIT_OK
