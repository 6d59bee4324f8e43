"""`gatewayd audit` adds the arguments of the one command it is given: its ten commands'
hundred options were a tenth of `gatewayd audit verify`'s start. Every command still parses, and help still lists and explains them."""

from __future__ import annotations

import argparse
from typing import Final

import pytest

from gatewayd.cli import build_parser

# Each audit command, with what it takes at the least to parse, and an option of its own.
COMMANDS: Final[dict[str, tuple[list[str], str]]] = {
    "verify": (["audit.jsonl"], "--checkpoint"),
    "show": (["audit.jsonl"], "--denied"),
    "export": (["audit.jsonl"], "--format"),
    "stats": (["audit.jsonl"], "--top"),
    "tail": (["audit.jsonl"], "--follow"),
    "run": (["RUN", "audit.jsonl"], "RUN"),
    "keygen": (["--out", "key"], "--out"),
    "checkpoint": (["--key", "key", "audit.jsonl"], "--key"),
    "prove": (["--key", "k", "7", "audit.jsonl"], "--consistency"),
    "verify-proof": (["--key", "k", "bundle.json"], "bundle"),
}


def subcommands(parser: argparse.ArgumentParser) -> dict[str, bool]:
    """The audit commands, each with whether its parser's arguments are added."""
    [top] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    audit = top.choices["audit"]
    [action] = [a for a in audit._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: made.built for name, made in action.choices.items()}


def test_help_lists_every_audit_command_and_none_is_made_for_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_parser("audit")
    assert list(subcommands(parser)) == list(COMMANDS)
    with pytest.raises(SystemExit):
        parser.parse_args(["audit", "--help"])
    listed = capsys.readouterr().out
    assert all(f"    {name} " in listed for name in COMMANDS), listed
    assert "check the hash chain across every segment" in listed
    assert set(subcommands(parser).values()) == {False}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_an_audit_command_line_makes_its_command_s_parser_alone(command: str) -> None:
    parser = build_parser("audit")
    words, _ = COMMANDS[command]
    args = parser.parse_args(["audit", command, *words])
    assert args.audit_command == command
    made = {name for name, built in subcommands(parser).items() if built}
    assert made == {command}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_each_audit_command_s_help_is_its_own(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["audit", command, "--help"])
    assert done.value.code == 0
    shown = capsys.readouterr().out
    assert shown.startswith(f"usage: gatewayd audit {command} [-h]"), shown
    assert COMMANDS[command][1] in shown
