"""`gatewayd install-systemd`: the systemd unit, a starting configuration and the
policy directory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gatewayd.cli.command import EXIT_FAILED, EXIT_OK

if TYPE_CHECKING:
    from gatewayd.cli.command import Subparsers


def add_parsers(sub: Subparsers) -> None:
    installer = sub.add_parser(
        "install-systemd",
        help="install the systemd unit, a starting configuration and the policy directory",
    )
    installer.add_argument(
        "--root", type=Path, default=Path("/"), help="install under this directory (default /)"
    )
    installer.add_argument(
        "--force", action="store_true", help="replace a unit that differs from this version's"
    )
    installer.add_argument(
        "--program",
        type=Path,
        help="the gatewayd program ExecStart names, as the service sees it (under --root); "
        "default: this one",
    )


def main(args: argparse.Namespace) -> int:
    return _install_systemd(args)


def _install_systemd(args: argparse.Namespace) -> int:
    from gatewayd.install import InstallError, install_systemd

    try:
        done = install_systemd(args.root, program=args.program, force=args.force)
    except InstallError as exc:
        print(f"gatewayd install-systemd: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as exc:
        print(f"gatewayd install-systemd: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return EXIT_FAILED
    for action, path in done.actions:
        print(f"{action:>9}  {path}")
    if done.next_steps:
        print("next:")
        for step in done.next_steps:
            print(f"  {step}")
    return EXIT_OK
