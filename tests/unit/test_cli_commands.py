"""The `gatewayd` command line as a package (gatewayd/cli/): one table from command to
the module that runs it, every subcommand in it, and no module of the package reading
another's private names."""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path
from typing import Final

import pytest

import gatewayd.cli
from gatewayd.cli import COMMANDS, build_parser

CLI_DIR: Final = Path(gatewayd.cli.__file__).parent
# One command line per command: what it takes at the least to parse.
MINIMAL_ARGV: Final[dict[str, list[str]]] = {
    "serve": ["serve"],
    "run": ["run", "--", "true"],
    "exec": ["exec", "0" * 32, "--", "true"],
    "rules": ["rules", "pending"],
    "image": ["image", "check", "/srv/image"],
    "config": ["config", "check", "/etc/gatewayd/gatewayd.yaml"],
    "policy": ["policy", "check", "policy.yaml"],
    "audit": ["audit", "verify", "audit.jsonl"],
    "install-systemd": ["install-systemd"],
    "agent": ["agent", "run", "--repo", "r", "--sha", "a" * 40, "--task", "t", "--model", "m"],
    "review": ["review", "replay", "calls.jsonl", "--policy", "p"],
    "apps": ["apps", "check", "apps/examples/note-taker"],
    "mcp": ["mcp", "list"],
    "tools": ["tools", "list"],
    "approvals": ["approvals", "list"],
    "workspace": ["workspace", "list"],
    "witness": ["witness", "keygen", "w.example/1", "--key-file", "w.key"],
    "worker": ["worker", "--temporal", "127.0.0.1:7233"],
}


def _subcommands(parser: argparse.ArgumentParser) -> list[str]:
    [action] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return list(action.choices)


def test_the_table_names_every_command_in_the_order_help_lists_them() -> None:
    assert _subcommands(build_parser()) == list(COMMANDS) == list(MINIMAL_ARGV)


@pytest.mark.parametrize("command", list(MINIMAL_ARGV))
def test_each_command_parses_and_its_module_runs_it(command: str) -> None:
    args = build_parser().parse_args(MINIMAL_ARGV[command])
    assert args.command == command
    module = COMMANDS[command]
    assert module.__name__.startswith("gatewayd.cli.")
    assert callable(module.main) and callable(module.add_parsers)


def _private_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gatewayd"):
            found += [
                f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")
            ]
    return found


def test_no_module_of_the_cli_imports_a_private_name() -> None:
    modules = sorted(CLI_DIR.glob("*.py"))
    assert len(modules) > len(set(COMMANDS.values()))
    assert [hit for path in modules for hit in _private_imports(path)] == []


def test_python_m_gatewayd_cli_is_the_gatewayd_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gatewayd.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: gatewayd ")
