"""`gatewayd` command line: serve, run, exec, rules, image, config, policy, audit,
install-systemd, agent, review, apps, mcp, tools, approvals, workspace, witness, worker.

Each command group is a module of this package (:class:`~gatewayd.cli.command.CommandModule`):
it adds its parsers and runs its commands; :data:`COMMANDS` says which module runs
which command. What several share is public in :mod:`gatewayd.cli.command` (exit
statuses, a refused start), :mod:`gatewayd.cli.options` (settings from options, the
log scrubber) and :mod:`gatewayd.cli.control_client`.

A command's start is mostly imports (docs/performance.md, "CLI start"), so a command
line loads only what its command needs: :func:`main` imports the one module that runs
the command it names and builds only that module's parsers (``gatewayd --help`` and an
unknown command still build them all), and the modules import trio, the daemon and the
heavy libraries inside the commands that need them. tests/unit/test_cli_imports.py
keeps the heavy modules out of the client commands.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterator, Mapping

# typing's flag without importing typing: client commands start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Final, NoReturn

    from gatewayd.cli.command import CommandModule

# Command -> the module (of this package) that runs it, in the order `gatewayd --help`
# lists them. Names, not modules: importing them all would load every command's imports.
_COMMAND_MODULES: Final[Mapping[str, str]] = {
    "serve": "serve",
    "run": "run",
    "exec": "run",
    "rules": "rules",
    "image": "image",
    "config": "config",
    "policy": "policy",
    "audit": "audit",
    "install-systemd": "install",
    "agent": "agent",
    "review": "review",
    "apps": "apps",
    "mcp": "mcp",
    "tools": "tools",
    "approvals": "approvals",
    "workspace": "workspace",
    "witness": "witness",
    "worker": "worker",
}


class _CommandTable(Mapping[str, "CommandModule"]):
    """Command -> the module that runs it, each module imported when first looked up."""

    def __getitem__(self, command: str) -> CommandModule:
        return _load(_COMMAND_MODULES[command])

    def __iter__(self) -> Iterator[str]:
        return iter(_COMMAND_MODULES)

    def __len__(self) -> int:
        return len(_COMMAND_MODULES)


COMMANDS: Final[Mapping[str, CommandModule]] = _CommandTable()


def _load(name: str) -> CommandModule:
    return importlib.import_module(f"{__name__}.{name}")  # a module is a CommandModule


class _PartialParserError(Exception):
    """A command line the parser of one command refused: the whole parser says why."""


class _PartialParser(argparse.ArgumentParser):
    """The parser of one command's line (its subparsers are of this class too), which
    leaves every error to the whole parser: its message starts with the usage of
    ``gatewayd`` itself, which lists every command."""

    def error(self, message: str) -> NoReturn:
        raise _PartialParserError(message)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """``gatewayd``'s parser: with ``command`` (one of :data:`COMMANDS`), only the
    parsers of the module that runs it, which parse that command's line as the whole
    parser would and raise :class:`_PartialParserError` where it would print an error;
    else every command's."""
    partial = command is not None and command in _COMMAND_MODULES
    parser = (_PartialParser if partial else argparse.ArgumentParser)(
        prog="gatewayd", description="The cogni gateway host daemon."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    if command is not None and partial:
        names = [_COMMAND_MODULES[command]]
    else:
        names = list(dict.fromkeys(_COMMAND_MODULES.values()))  # once each, in order
    for name in names:
        _load(name).add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    # The command is the first word: gatewayd itself takes no option but --help.
    try:
        args = build_parser(words[0] if words else None).parse_args(words)
    except _PartialParserError:
        # Printed by the whole parser, as it always was (exit status 2).
        args = build_parser().parse_args(words)
    return COMMANDS[args.command].main(args)
