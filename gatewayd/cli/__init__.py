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
import os
import sys
from collections.abc import Iterator, Mapping

# typing's flag without importing typing: client commands start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Final, NoReturn

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


def _terminal_columns() -> int:
    """The width help is wrapped to, as argparse finds it (``shutil.get_terminal_size``:
    $COLUMNS, else the terminal on stdout, else 80), without importing shutil, which
    brings zlib, bz2, lzma and fnmatch into every command's start for this one number."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns > 0:
        return columns
    try:
        return os.get_terminal_size(sys.__stdout__.fileno()).columns or 80  # type: ignore[union-attr]
    except (AttributeError, ValueError, OSError):
        return 80


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, told the terminal's width: argparse makes one at every
    ``add_argument`` (to check the metavar), and one told no width imports shutil."""

    def __init__(
        self,
        prog: str,
        indent_increment: int = 2,
        max_help_position: int = 24,
        width: int | None = None,
    ) -> None:
        if width is None:
            width = _terminal_columns() - 2  # as argparse leaves a margin
        super().__init__(prog, indent_increment, max_help_position, width)


class _Parser(argparse.ArgumentParser):
    """gatewayd's parsers: argparse's, with :class:`_HelpFormatter` unless told another
    (subparsers are of their parent's class, so every command's parser has it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


class _PartialParserError(Exception):
    """A command line the parser of one command refused: the whole parser says why."""


class _PartialParser(_Parser):
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
    parser: argparse.ArgumentParser = (_PartialParser if partial else _Parser)(
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
