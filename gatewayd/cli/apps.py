"""`gatewayd apps list|show|check|install`: the apps of a workspace, as gatewayd finds
them, and installing one.

Without a daemon: each command reads the folders itself, with the same checks a run's
start applies (gatewayd/apps/discovery.py), so what `apps list` shows is what a run is
offered. `install` writes (gatewayd/apps/install.py) but audits nothing: the daemon
holds its audit log locked for itself (a second writer would fork the chain), so the
audited install is the daemon's own.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gatewayd.cli.command import EXIT_FAILED, EXIT_OK

if TYPE_CHECKING:
    from gatewayd.apps.discovery import DiscoveredApp, SkippedApp
    from gatewayd.cli.command import Subparsers


def add_parsers(sub: Subparsers) -> None:
    apps = sub.add_parser(
        "apps", help="apps: tools a caller prompts, one folder each under <workspace>/apps/"
    ).add_subparsers(dest="apps_command", required=True)
    listing = apps.add_parser(
        "list", help="the apps of a workspace (id, tool, title) and those skipped, with why"
    )
    listing.add_argument("--workspace", type=Path, required=True, help="the workspace folder")
    show = apps.add_parser("show", help="one app's manifest: fields, limits, prompt, rules")
    show.add_argument("app_id", metavar="ID")
    show.add_argument("--workspace", type=Path, required=True, help="the workspace folder")
    show.add_argument("--json", action="store_true", help="print the manifest as JSON")
    check = apps.add_parser(
        "check", help="validate one app folder (an install source) before installing it"
    )
    check.add_argument("dir", type=Path, metavar="DIR")
    install = apps.add_parser(
        "install",
        help="copy an app folder into <workspace>/apps/<id>/ (checked, capped, atomic); "
        "not audited: the daemon's audit log is its own",
    )
    install.add_argument("src", type=Path, metavar="SRC", help="the app folder (holds APP.md)")
    install.add_argument("--workspace", type=Path, required=True, help="the workspace folder")
    install.add_argument(
        "--replace",
        action="store_true",
        help="replace an installed app of the same id, keeping its data/",
    )


def main(args: argparse.Namespace) -> int:
    from gatewayd.apps.discovery import DiscoveryError

    try:
        if args.apps_command == "list":
            return _list(args.workspace)
        if args.apps_command == "show":
            return _show(args.workspace, args.app_id, as_json=args.json)
        if args.apps_command == "install":
            return _install(args.src, args.workspace, replace=args.replace)
        return _check(args.dir)
    except DiscoveryError as exc:
        print(f"gatewayd apps: {exc}", file=sys.stderr)
        return EXIT_FAILED


def _list(workspace: Path) -> int:
    from gatewayd.apps.discovery import discover_apps

    found = discover_apps(workspace)
    if not found.apps and not found.skipped:
        print(f"no apps in {workspace}/apps/")
    width = max((len(app.id) for app in found.apps), default=0)
    tool_width = max((len(app.tool_name) for app in found.apps), default=0)
    for app in found.apps:
        print(f"{app.id:<{width}}  {app.tool_name:<{tool_width}}  {app.manifest.title}")
    for skip in found.skipped:
        print(f"skipped: {skip.describe()}", file=sys.stderr)
    return EXIT_FAILED if found.skipped else EXIT_OK


def _show(workspace: Path, app_id: str, *, as_json: bool) -> int:
    from gatewayd.apps.discovery import DiscoveredApp, find_app
    from gatewayd.apps.manifest import app_id_problem, manifest_summary

    problem = app_id_problem(app_id)
    if problem is not None:
        print(f"gatewayd apps: {problem}", file=sys.stderr)
        return EXIT_FAILED
    found = find_app(workspace, app_id)
    if found is None:
        print(
            f"gatewayd apps: there is no app {app_id!r} in {workspace}/apps/ "
            f"(`gatewayd apps list --workspace {workspace}` lists them)",
            file=sys.stderr,
        )
        return EXIT_FAILED
    if not isinstance(found, DiscoveredApp):
        _print_problems(found)
        return EXIT_FAILED
    if as_json:
        print(json.dumps({**manifest_summary(found.manifest), "folder": str(found.folder)}))
    else:
        print(_describe(found))
    return EXIT_OK


def _check(folder: Path) -> int:
    from gatewayd.apps.discovery import DiscoveredApp, check_app_folder

    found = check_app_folder(folder)
    if not isinstance(found, DiscoveredApp):
        _print_problems(found)
        return EXIT_FAILED
    print(
        f"{folder}: ok: app {found.id} (tool {found.tool_name}): {found.manifest.title}; "
        f"{len(found.manifest.rules.allow)} allow and {len(found.manifest.rules.deny)} "
        "deny rules"
    )
    if folder.name != found.id:
        print(f"note: it installs as apps/{found.id}/, its manifest's name")
    return EXIT_OK


def _install(source: Path, workspace: Path, *, replace: bool) -> int:
    from gatewayd.apps.install import InstallError, install_app

    try:
        installed = install_app(source, workspace, replace=replace)
    except InstallError as exc:
        print(f"gatewayd apps install: {exc}", file=sys.stderr)
        return EXIT_FAILED
    for note in installed.recovered:
        print(f"note: {note}", file=sys.stderr)
    verb = "replaced" if installed.replaced else "installed"
    print(
        f"{verb} app {installed.id} (tool {installed.tool_name}) in {installed.app.folder}: "
        f"{installed.files} files, {installed.bytes} bytes"
    )
    if installed.replaced:
        kept = "its data/ kept" if installed.kept_data else "it had no data/; a new one made"
        print(f"  {kept}")
    return EXIT_OK


def _print_problems(skip: SkippedApp) -> None:
    for problem in skip.problems:
        print(problem.describe(skip.file), file=sys.stderr)


# What applies when the manifest names no model (docs/apps.md, "The manifest").
_DEFAULT_MODEL = "(not set: the policy's default alias)"
_DEFAULT_REVIEW_MODEL = "(not set: the policy's review model)"


def _describe(app: DiscoveredApp) -> str:
    """The manifest as an operator reads it; unset optional fields say what applies."""
    manifest = app.manifest
    limits = manifest.limits
    lines = [
        f"app {manifest.name} (tool {manifest.tool_name})",
        f"  folder: {app.folder}",
        f"  title: {manifest.title}",
        f"  description: {_indented(manifest.description)}",
        f"  model: {manifest.model or _DEFAULT_MODEL}",
        f"  review model: {manifest.review_model or _DEFAULT_REVIEW_MODEL}",
        f"  limits per invocation: {limits.turns} turns, {limits.tool_calls} tool calls, "
        f"{limits.tokens} tokens, {limits.wall_time_s:g} s",
        "system prompt:",
        *(f"  | {line}" for line in manifest.system_prompt.split("\n")),
        "rules:",
    ]
    for side, rules in (("allow", manifest.rules.allow), ("deny", manifest.rules.deny)):
        lines.append(f"  {side}:" if rules else f"  {side}: (none)")
        for number, rule in enumerate(rules, 1):
            added = f"  (added by {rule.added_by})" if rule.added_by else ""
            lines.append(f"    {number}. {_indented(rule.text, 7)}{added}")
    return "\n".join(lines)


def _indented(text: str, by: int = 4) -> str:
    return text.replace("\n", "\n" + " " * by)
