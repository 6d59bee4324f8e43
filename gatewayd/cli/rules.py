"""`gatewayd rules ...`: a policy's review rules, read and changed through `gatewayd
serve`'s control socket (tightening at once, loosening once confirmed)."""

from __future__ import annotations

import argparse
import os
import sys

from gatewayd.cli.command import EXIT_FAILED, EXIT_OK
from gatewayd.cli.control_client import control_request
from gatewayd.cli.options import control_socket_of

# typing's flag without importing typing: client commands start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from gatewayd.cli.command import Subparsers


def add_parsers(sub: Subparsers) -> None:
    rules = sub.add_parser(
        "rules", help="review rules of a policy, through gatewayd serve's control socket"
    ).add_subparsers(dest="rules_command", required=True)
    for name, helptext in (
        ("show", "print a policy's allow and deny rules"),
        ("add-deny", "add a deny rule (takes effect at once)"),
        ("remove-allow", "remove an allow rule (takes effect at once)"),
        ("add-allow", "add an allow rule (pending until confirmed)"),
        ("remove-deny", "remove a deny rule (pending until confirmed)"),
        ("pending", "list changes waiting for confirmation"),
        ("confirm", "apply a pending change"),
        ("cancel", "drop a pending change"),
    ):
        cmd = rules.add_parser(name, help=helptext)
        cmd.add_argument("--state-dir", default=None)
        cmd.add_argument("--control-socket", default=None)
        if name in ("confirm", "cancel"):
            cmd.add_argument("confirmation_id", metavar="ID")
        elif name != "pending":
            cmd.add_argument("--policy", required=True, help="policy name or file")
            if name != "show":
                cmd.add_argument("rule", help="the rule's text, in quotes")
                cmd.add_argument("--by", default=os.environ.get("USER"), help="who adds it")


def main(args: argparse.Namespace) -> int:
    return _rules(args)


def _quoted(text: str) -> str:
    """``text`` as one percent-encoded path segment or query value (urllib.parse is
    imported only by the commands that send one: `rules pending` sends none)."""
    from urllib.parse import quote

    return quote(text, safe="")


def _rules(args: argparse.Namespace) -> int:
    """`gatewayd rules ...`: one request to the control socket, its answer in words."""
    control = control_socket_of(args)
    command = args.rules_command
    try:
        if command == "show":
            status, answer = control_request(
                control, "GET", f"/v1/rules?policy={_quoted(args.policy)}"
            )
        elif command == "pending":
            status, answer = control_request(control, "GET", "/v1/rules/pending")
        elif command == "confirm":
            target = f"/v1/rules/pending/{_quoted(args.confirmation_id)}/confirm"
            status, answer = control_request(control, "POST", target, {})
        elif command == "cancel":
            target = f"/v1/rules/pending/{_quoted(args.confirmation_id)}"
            status, answer = control_request(control, "DELETE", target)
        else:
            body = {
                "policy": args.policy,
                "action": command.replace("-", "_"),
                "rule": args.rule,
                "addedBy": args.by,
            }
            status, answer = control_request(control, "POST", "/v1/rules", body)
    except OSError as exc:
        print(f"gatewayd rules: cannot reach gatewayd at {control}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if not answer.get("ok"):
        print(
            f"gatewayd rules: {answer.get('errorCode', status)}: {answer.get('message')}",
            file=sys.stderr,
        )
        return EXIT_FAILED
    if "pending" in answer and isinstance(answer["pending"], dict):
        pending = answer["pending"]
        print(
            f"PENDING {pending['confirmationId']}: {pending['change']['action']} "
            f"{pending['change']['rule']!r} waits for confirmation; apply it with "
            f"`gatewayd rules confirm {pending['confirmationId']}`"
        )
    elif "applied" in answer:
        applied = answer["applied"]
        print(f"APPLIED {applied['action']} {applied['rule']!r} to {applied['policy']}")
    elif "pending" in answer:
        for item in answer["pending"]:
            change = item["change"]
            where = change["policy"]
            print(f"{item['confirmationId']}  {change['action']}  {change['rule']!r}  ({where})")
    elif "cancelled" in answer:
        print(f"CANCELLED {answer['cancelled']['action']} {answer['cancelled']['rule']!r}")
    else:
        print(f"policy {answer['policy']} (rule set {answer['ruleset'][:12]})")
        for side in ("allow", "deny"):
            print(f"{side}:")
            for number, text in enumerate(answer[side], 1):
                print(f"  {number}. {text}")
    return EXIT_OK
