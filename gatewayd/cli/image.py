"""`gatewayd image check DIR`: can DIR be a sandbox's root filesystem?"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from gatewayd.cli.command import EXIT_FAILED, EXIT_OK

if TYPE_CHECKING:
    from gatewayd.cli.command import Subparsers


def add_parsers(sub: Subparsers) -> None:
    image = sub.add_parser("image", help="sandbox root filesystem images").add_subparsers(
        dest="image_command", required=True
    )
    image_check = image.add_parser(
        "check", help="can DIR be a sandbox root? lists every problem with its fix"
    )
    image_check.add_argument("dir", type=Path)


def main(args: argparse.Namespace) -> int:
    return _image_check(args.dir)


def _image_check(path: Path) -> int:
    from gatewayd.sandbox.image import check_image

    report = check_image(path)  # as given: a relative path gets its own message
    print(report.render())
    return EXIT_OK if report.ok else EXIT_FAILED
