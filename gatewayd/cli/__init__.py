"""`gatewayd` command line: serve, run, exec, rules, image, config, policy, audit,
install-systemd, agent, review, apps, mcp, tools, approvals, workspace, witness, worker.

Each command group is a module of this package (:class:`~gatewayd.cli.command.CommandModule`):
it adds its parsers and runs its commands; :data:`COMMANDS` says which module runs
which command. What several share is public in :mod:`gatewayd.cli.command` (exit
statuses, a refused start), :mod:`gatewayd.cli.options` (settings from options, the
log scrubber) and :mod:`gatewayd.cli.control_client`. Heavy imports (trio, the daemon)
happen inside the commands that need them, so `gatewayd audit verify` and
`gatewayd policy check` start fast.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Final

from gatewayd.cli import (
    agent,
    approvals,
    apps,
    audit,
    config,
    image,
    install,
    mcp,
    policy,
    review,
    rules,
    run,
    serve,
    tools,
    witness,
    worker,
    workspace,
)
from gatewayd.cli.command import CommandModule

# Command -> the module that runs it, in the order `gatewayd --help` lists them.
COMMANDS: Final[Mapping[str, CommandModule]] = {
    "serve": serve,
    "run": run,
    "exec": run,
    "rules": rules,
    "image": image,
    "config": config,
    "policy": policy,
    "audit": audit,
    "install-systemd": install,
    "agent": agent,
    "review": review,
    "apps": apps,
    "mcp": mcp,
    "tools": tools,
    "approvals": approvals,
    "workspace": workspace,
    "witness": witness,
    "worker": worker,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gatewayd", description="The cogni gateway host daemon.")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in dict.fromkeys(COMMANDS.values()):  # once each, in the table's order
        module.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return COMMANDS[args.command].main(args)
