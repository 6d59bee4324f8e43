"""`gatewayd apps list|show|check|install|rules`: the apps of a workspace, as gatewayd
finds them, installing one, and changing an app's rules.

Without a daemon: each command reads the folders itself, with the same checks a run's
start applies (gatewayd/apps/discovery.py), so what `apps list` shows is what a run is
offered. `install` writes (gatewayd/apps/install.py) but audits nothing: the daemon
holds its audit log locked for itself (a second writer would fork the chain), so the
audited install is the daemon's own. `rules` talks to `gatewayd serve`'s control socket
(gatewayd/apps/ruledesk.py), which confirms the loosening changes runs asked for.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gatewayd.cli.command import EXIT_FAILED, EXIT_OK

# The actions `apps rules change` takes: gatewayd.policy.rule_action.RuleAction's values
# (a test holds them equal), spelled out so that building the parser imports no policy
# module (every gatewayd command builds every parser).
RULE_ACTIONS = ("add_deny", "remove_allow", "add_allow", "remove_deny")

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
    # The workspace is recorded in gatewayd's state directory as holding apps, so no
    # run holds its apps folder: the daemon's directory, read as the daemon reads it.
    install.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="gatewayd's state directory, where the workspace is recorded as holding apps "
        "(default: the configuration's state_dir, as `gatewayd serve` finds it)",
    )
    install.add_argument(
        "--config",
        type=Path,
        default=None,
        help="gatewayd's configuration file (default $GATEWAYD_CONFIG, else "
        "/etc/gatewayd/gatewayd.yaml when it exists)",
    )
    _add_rules_parsers(apps)


def _add_rules_parsers(apps: Subparsers) -> None:
    """`gatewayd apps rules ...`: through `gatewayd serve`'s control socket."""
    rules = apps.add_parser(
        "rules",
        help="an app's rules, through gatewayd serve's control socket: confirm or cancel "
        "the loosening changes runs asked for, or change a rule yourself",
    ).add_subparsers(dest="app_rules_command", required=True)
    for name, helptext in (
        ("pending", "list the loosening changes runs asked for, waiting for confirmation"),
        ("confirm", "apply a pending change"),
        ("cancel", "drop a pending change"),
        ("change", "change an app's rule yourself: applied at once, whichever way it goes"),
    ):
        cmd = rules.add_parser(name, help=helptext)
        cmd.add_argument("--state-dir", type=Path, default=None)
        cmd.add_argument("--control-socket", type=Path, default=None)
        cmd.add_argument("--config", type=Path, default=None)
        if name in ("confirm", "cancel"):
            cmd.add_argument("confirmation_id", metavar="ID")
        if name in ("confirm", "change"):
            cmd.add_argument(
                "--by", default=os.environ.get("USER"), help="who you are, for the record"
            )
        if name == "change":
            cmd.add_argument("app_id", metavar="APP", help="the app's id")
            cmd.add_argument("action", choices=RULE_ACTIONS)
            cmd.add_argument("rule", help="the rule's text, in quotes")
            cmd.add_argument("--workspace", type=Path, required=True, help="the workspace folder")


def main(args: argparse.Namespace) -> int:
    from gatewayd.apps.discovery import DiscoveryError

    if args.apps_command == "rules":
        return _rules(args)

    try:
        if args.apps_command == "list":
            return _list(args.workspace)
        if args.apps_command == "show":
            return _show(args.workspace, args.app_id, as_json=args.json)
        if args.apps_command == "install":
            from gatewayd.cli.options import settings_from_options

            state_dir = settings_from_options(args).config.state_dir
            return _install(args.src, args.workspace, replace=args.replace, state_dir=state_dir)
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


def _install(source: Path, workspace: Path, *, replace: bool, state_dir: Path) -> int:
    from gatewayd.apps.install import InstallError, install_app
    from gatewayd.runs.registry import PASS_THROUGH_DIR_MODE, make_private_dir

    try:
        # As the daemon makes it: an install may come before the daemon's first start.
        state_dir.mkdir(mode=PASS_THROUGH_DIR_MODE, parents=True, exist_ok=True)
        make_private_dir(state_dir, PASS_THROUGH_DIR_MODE)
    except (OSError, RuntimeError) as exc:
        print(
            f"gatewayd apps install: cannot use the state directory {state_dir}, where the "
            f"workspace is recorded as holding apps: {exc}; nothing was installed",
            file=sys.stderr,
        )
        return EXIT_FAILED
    try:
        installed = install_app(source, workspace, replace=replace, state_dir=state_dir)
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


def _rules(args: argparse.Namespace) -> int:
    """`gatewayd apps rules ...`: one request to the control socket, its answer in words."""
    from urllib.parse import quote

    from gatewayd.cli.control_client import control_request
    from gatewayd.cli.options import control_socket_of

    control = control_socket_of(args)
    command = args.app_rules_command
    try:
        if command == "pending":
            status, answer = control_request(control, "GET", "/v1/apps/rules/pending")
        elif command == "confirm":
            target = f"/v1/apps/rules/pending/{quote(args.confirmation_id, safe='')}/confirm"
            status, answer = control_request(control, "POST", target, {"by": args.by})
        elif command == "cancel":
            target = f"/v1/apps/rules/pending/{quote(args.confirmation_id, safe='')}"
            status, answer = control_request(control, "DELETE", target)
        else:
            body = {
                # The daemon's working directory is not ours: an absolute path.
                "workspace": os.path.abspath(args.workspace),
                "app": args.app_id,
                "action": args.action,
                "rule": args.rule,
                "addedBy": args.by,
            }
            status, answer = control_request(control, "POST", "/v1/apps/rules", body)
    except OSError as exc:
        print(f"gatewayd apps rules: cannot reach gatewayd at {control}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if not answer.get("ok"):
        print(
            f"gatewayd apps rules: {answer.get('errorCode', status)}: {answer.get('message')}",
            file=sys.stderr,
        )
        return EXIT_FAILED
    if "applied" in answer:
        applied = answer["applied"]
        print(
            f"APPLIED {applied['action']} {applied['rule']!r} to app {applied['app']} in "
            f"{applied['workspace']}"
        )
    elif "cancelled" in answer:
        cancelled = answer["cancelled"]
        print(f"CANCELLED {cancelled['action']} {cancelled['rule']!r} (app {cancelled['app']})")
    elif not answer["pending"]:
        print("no app rule changes wait for confirmation")
    else:
        for item in answer["pending"]:
            asked = f"run {item['runId']}" if item.get("runId") else "the operator"
            print(
                f"{item['confirmationId']}  {item['action']}  {item['rule']!r}  app "
                f"{item['app']} in {item['workspace']}  (asked by {asked}, addedBy "
                f"{item['addedBy']})"
            )
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
