"""`gatewayd config show|check`: the effective configuration and where each value came
from; a configuration file validated."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gatewayd.cli.command import EXIT_FAILED, EXIT_OK
from gatewayd.cli.options import add_daemon_options, settings_from_options

if TYPE_CHECKING:
    from gatewayd.cli.command import Subparsers


def add_parsers(sub: Subparsers) -> None:
    config = sub.add_parser(
        "config", help="gatewayd's configuration (docs/configuration.md)"
    ).add_subparsers(dest="config_command", required=True)
    config_show = config.add_parser(
        "show",
        help="print the effective configuration (options > $GATEWAYD_<NAME> > file > "
        "defaults) and where each value came from; no secret is printed",
    )
    add_daemon_options(config_show)
    config_show.add_argument("--control-socket", type=Path, default=None)
    config_show.add_argument("--json", action="store_true", help="as JSON")
    config_check = config.add_parser(
        "check", help="validate a configuration file (exit 0 valid, 1 invalid)"
    )
    config_check.add_argument("file", type=Path)


def main(args: argparse.Namespace) -> int:
    return _config_command(args)


def _config_command(args: argparse.Namespace) -> int:
    """`gatewayd config show|check`."""
    from gatewayd.config import ConfigError, GatewaydConfig
    from gatewayd.configsources import load_config, shown_values

    if args.config_command == "check":
        try:
            config = load_config(args.file)
        except ConfigError as exc:
            print(f"gatewayd config check: invalid: {exc}", file=sys.stderr)
            return EXIT_FAILED
        given = [name for name in GatewaydConfig.model_fields if name in config.model_fields_set]
        print(f"{args.file}: OK; sets {', '.join(given) or 'nothing (every setting default)'}")
        if not config.audit_fsync:
            print(
                "warning: audit_fsync: false: an audit entry is not durable before its "
                "call's effect (for tests and benchmarks only)",
                file=sys.stderr,
            )
        if not config.audit_reply_after_result:
            print(
                "warning: audit_reply_after_result: false: answers leave before their "
                "result entry is durable, so a crash can lose the results of calls the "
                "sandbox saw answered (docs/audit.md)",
                file=sys.stderr,
            )
        return EXIT_OK
    settings = settings_from_options(args)
    shown = shown_values(settings.config)
    if args.json:
        document = {
            "file": str(settings.file) if settings.file else None,
            "settings": {
                name: {"value": value, "source": settings.sources[name]}
                for name, value in shown.items()
            },
        }
        print(json.dumps(document, indent=2))
        return EXIT_OK
    import yaml

    where = settings.file or "none (variables and defaults only)"
    lines = [
        f"# gatewayd's effective configuration; file: {where}",
        "# each setting's source: option > env > file > default",
    ]
    for name, value in shown.items():
        text = yaml.safe_dump({name: value}, default_flow_style=False, sort_keys=False)
        first, *rest = text.rstrip("\n").split("\n")
        lines += [f"{first}  # {settings.sources[name]}", *rest]
    try:
        print("\n".join(lines))
    except BrokenPipeError:  # `gatewayd config show | head`: the reader has enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_OK
