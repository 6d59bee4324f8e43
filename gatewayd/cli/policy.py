"""`gatewayd policy check FILE`: validate a policy file and summarize it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gatewayd.cli.command import EXIT_FAILED, EXIT_OK

if TYPE_CHECKING:
    from gatewayd.cli.command import Subparsers


def add_parsers(sub: Subparsers) -> None:
    policy = sub.add_parser("policy", help="policy files").add_subparsers(
        dest="policy_command", required=True
    )
    check = policy.add_parser("check", help="validate a policy file and summarize it")
    check.add_argument("file", type=Path)


def main(args: argparse.Namespace) -> int:
    return _policy_check(args.file)


def _policy_check(path: Path) -> int:
    from gatewayd.builtin_tool_ids import BUILTIN_TOOL_IDS
    from gatewayd.policy import PolicyError, summarize, unmatched_patterns
    from gatewayd.policyfile import load_policy

    try:
        policy = load_policy(path)
    except PolicyError as exc:
        print(f"invalid policy: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(summarize(policy, str(path)))
    # Not an error (a later gatewayd may know the tool), but most likely a typo.
    for pattern in unmatched_patterns(policy.tools.allow, BUILTIN_TOOL_IDS):
        print(
            f"warning: tools.allow entry {pattern!r} matches no tool this gatewayd has",
            file=sys.stderr,
        )
    return EXIT_OK
