"""`gatewayd approvals list|approve|deny`: calls waiting for a person's approval, seen
and answered through `gatewayd serve`'s control socket.

A waiting call lives in the daemon that holds its caller's connection, so there is no
answering it without that daemon: when nothing serves the control socket this says so
(and that a daemon which died denied its waiting calls at its next start).

What is printed of a call comes from inside a sandbox: its arguments are printed as
JSON with every non-ASCII and control character escaped, so no terminal escape or
right-to-left override in them can change what the operator reads.
"""

from __future__ import annotations

import argparse
import errno
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from gatewayd.cli.command import EXIT_FAILED, EXIT_OK
from gatewayd.cli.control_client import NO_DAEMON, control_request, lacks_routes, print_refusal
from gatewayd.cli.options import control_socket_of, who_answers

if TYPE_CHECKING:
    from gatewayd.cli.command import Subparsers

# connect() errors that mean nothing serves the socket (rather than something refusing
# us); a path that is no socket too, as there is nothing to fall back to here.
_NO_DAEMON: Final = NO_DAEMON | {errno.ENOTSOCK}


def add_parsers(sub: Subparsers) -> None:
    approvals = sub.add_parser(
        "approvals",
        help="calls waiting for the operator's approval, through gatewayd serve's control socket",
    ).add_subparsers(dest="approvals_command", required=True)
    for name, helptext in (
        ("list", "print the calls waiting for approval, their arguments in full"),
        ("approve", "let a waiting call go on (with the rights its policy gives it, no more)"),
        ("deny", "refuse a waiting call (approval_denied, with your reason)"),
    ):
        cmd = approvals.add_parser(name, help=helptext)
        cmd.add_argument("--state-dir", type=Path, default=None)
        cmd.add_argument("--control-socket", type=Path, default=None)
        if name == "list":
            cmd.add_argument("--json", action="store_true", help="print the answer as JSON")
        else:
            cmd.add_argument("approval_id", metavar="ID", help="the id `approvals list` shows")
            cmd.add_argument(
                "--reason", default=None, help="why (a denial's reason is shown to the agent)"
            )
            cmd.add_argument("--by", default=None, help="who answers (default: your user name)")


def main(args: argparse.Namespace) -> int:
    from urllib.parse import quote

    control = control_socket_of(args)
    command: str = args.approvals_command
    try:
        if command == "list":
            status, answer = control_request(control, "GET", "/v1/approvals")
        else:
            body = {"by": who_answers(args), "reason": args.reason}
            target = f"/v1/approvals/{quote(args.approval_id, safe='')}/{command}"
            status, answer = control_request(control, "POST", target, body)
    except OSError as exc:
        if exc.errno in _NO_DAEMON:
            print(
                f"gatewayd approvals: no gatewayd serves the control socket {control} "
                f"({exc.strerror}); a call waits for approval only inside the `gatewayd "
                "serve` that holds it (one that stopped denied its waiting calls when it "
                "started again). Start it, or give --state-dir or --control-socket",
                file=sys.stderr,
            )
        else:
            print(f"gatewayd approvals: cannot reach gatewayd at {control}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if lacks_routes(status, answer):
        print(
            f"gatewayd approvals: the gatewayd at {control} has no approval routes (an "
            "older version?), or the id is not 32 hex digits: "
            f"{answer.get('message')}",
            file=sys.stderr,
        )
        return EXIT_FAILED
    if print_refusal(f"gatewayd approvals {command}", answer, code=status):
        return EXIT_FAILED
    if command == "list":
        _print_list(answer["approvals"], as_json=args.json)
    else:
        decided = answer["decided"]
        print(
            f"{str(decided['verdict']).upper()} {decided['approvalId']}: {decided['tool']} "
            f"of run {decided['runId']} (call {decided['toolCallId']})"
        )
    return EXIT_OK


def _shown(value: Any) -> str:
    """A value from inside a sandbox, safe for a terminal: JSON, ASCII only."""
    return json.dumps(value, ensure_ascii=True, sort_keys=True)


def _print_list(approvals: list[dict[str, Any]], *, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"approvals": approvals}, ensure_ascii=True, indent=2, sort_keys=True))
        return
    if not approvals:
        print("no calls wait for approval")
        return
    for item in approvals:
        rule = item["rule"]
        why = f" ({_shown(rule['reason'])})" if rule.get("reason") else ""
        print(
            f"{item['approvalId']}  run {item['runId']}  {item['tool']}  call "
            f"{item['toolCallId']}  waiting since {item['requestedAt']}, denied at "
            f"{item['expiresAt']} unless answered"
        )
        print(f"  rule {rule['index']}: {rule['tool']} {_shown(rule['args'])}{why}")
        print(f"  args: {_shown(item['args'])}")
        print(f"  answer: gatewayd approvals approve|deny {item['approvalId']} [--reason TEXT]")
