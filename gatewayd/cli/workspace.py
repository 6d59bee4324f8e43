"""`gatewayd workspace list|diff|commit|discard [RUN]`: the runs' workspace sessions.

A run's session outlives it when its on-end is ``keep`` (the default): the host
directory is untouched until the operator commits it. A command goes through `gatewayd
serve`'s control socket when one answers there (``/v1/workspaces/...``); when none does,
it opens the daemon in this process for the one command, as `gatewayd mcp` does (the
audit entries go through the same writer either way, and sessions a crash left are
recovered first). The session's lock keeps a command and a daemon from working on one
session at once: the second is refused, never interleaved. `list` discards kept sessions
past their keep time first (audited ``workspace_expired``), as the daemon does every
minute.

Exit status: 0 done; 1 refused or failed (the message says why and what to do).
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from gatewayd.cli.command import EXIT_FAILED, EXIT_OK, refusing
from gatewayd.cli.control_client import ask_else_here, control_request, print_refusal
from gatewayd.cli.in_process import answer_in_process
from gatewayd.cli.options import add_daemon_options, control_socket_of

if TYPE_CHECKING:
    from gatewayd.cli.command import Subparsers
    from gatewayd.daemon import Daemon

# A run id: the store's RUN_ID_PATTERN (a test holds them equal), not imported from it,
# since the store loads the workspace backends (most of a second) for a command that
# only asks the daemon.
RUN_ID_PATTERN: Final = re.compile(r"[0-9a-f]{32}")
# The counts `list` shows, in this order.
_COUNTS: Final = ("added", "removed", "modified", "renamed")


def add_parsers(sub: Subparsers) -> None:
    workspace = sub.add_parser(
        "workspace",
        help="the runs' workspace sessions: list, diff, commit or discard what a run wrote",
    ).add_subparsers(dest="workspace_command", required=True)
    for name, helptext in (
        ("list", "every kept or live session (or RUN's): mode, base, state, until when kept"),
        ("diff", "what RUN's session changed, against its base (a unified diff)"),
        ("commit", "write RUN's kept session into its base; refused if the base changed there"),
        ("discard", "drop RUN's kept session; the base stays as it was before the run"),
    ):
        cmd = workspace.add_parser(name, help=helptext)
        add_daemon_options(cmd)
        cmd.add_argument(
            "--control-socket",
            type=Path,
            default=None,
            help="the control socket of the running gatewayd (default: the configuration's)",
        )
        cmd.add_argument(
            "run_id",
            metavar="RUN",
            nargs="?" if name == "list" else None,
            help="the run's id (32 hex characters, as `gatewayd workspace list` shows)",
        )
        cmd.add_argument("--json", action="store_true", help="print the answer as JSON")
        if name in ("commit", "discard"):
            cmd.add_argument("--by", default=None, help="who does it (default: your user name)")


def main(args: argparse.Namespace) -> int:
    return refusing(_workspace, args)


def _workspace(args: argparse.Namespace) -> int:
    command: str = args.workspace_command
    if args.run_id is not None and RUN_ID_PATTERN.fullmatch(args.run_id) is None:
        print(
            f"gatewayd workspace {command}: bad_request: {args.run_id[:80]!r} is not a run id "
            "(32 lowercase hex characters, as `gatewayd workspace list` shows them)",
            file=sys.stderr,
        )
        return EXIT_FAILED
    control = control_socket_of(args)
    answer = ask_else_here(
        "gatewayd workspace",
        control,
        lambda: _through_control(control, args),
        lambda: _in_process(args),
        missing_routes="no workspace routes (an older version?); restart it",
    )
    if answer is None or print_refusal(f"gatewayd workspace {command}", answer):
        return EXIT_FAILED
    if args.json:
        print(json.dumps(answer, indent=2, sort_keys=True))
        return EXIT_OK
    # The hints name the state directory when the command was given one.
    where = f" --state-dir {args.state_dir}" if args.state_dir is not None else ""
    return _print(command, answer, where)


def _who(args: argparse.Namespace) -> str:
    """Who commits or discards, as they name themselves: ``--by``, else the user this
    command runs as. A name proves nothing, so whoever records it adds the uid: the
    daemon the peer's, :func:`_ask` this process's."""
    if args.by:
        return str(args.by)
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "unknown"


def _through_control(control: str, args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    """The command as one request to the daemon's control socket. Error handling:
    OSError when nothing answers there."""
    from urllib.parse import quote

    command: str = args.workspace_command
    if command == "list":
        if args.run_id is None:
            return control_request(control, "GET", "/v1/workspaces")
        return control_request(control, "GET", f"/v1/workspaces/{quote(args.run_id, safe='')}")
    target = f"/v1/workspaces/{quote(args.run_id, safe='')}/{command}"
    if command == "diff":
        return control_request(control, "GET", target)
    return control_request(control, "POST", target, {"by": _who(args)})


def _in_process(args: argparse.Namespace) -> dict[str, Any]:
    """The command in a daemon opened for it (no `gatewayd serve` answers)."""
    import trio

    async def ask(daemon: Daemon) -> dict[str, Any]:
        # The store's work blocks (file system, locks): off the daemon's trio thread.
        return await trio.to_thread.run_sync(_ask, daemon, args)

    return answer_in_process(args, ask)


def _ask(daemon: Daemon, args: argparse.Namespace) -> dict[str, Any]:
    """The command on the daemon's store, answered as the control socket would."""
    from gatewayd.errors import GatewayError
    from gatewayd.workspace.store import diff_json

    store = daemon.workspaces
    command: str = args.workspace_command
    run_id: str | None = args.run_id
    try:
        if command == "list" and run_id is None:
            store.expire()
            return {"ok": True, "workspaces": [info.to_json() for info in store.list()]}
        if run_id is None:
            return {"ok": False, "errorCode": "bad_request", "message": "give the run's id"}
        if command == "list":
            return {"ok": True, "workspace": store.info(run_id).to_json()}
        if command == "diff":
            mode = store.info(run_id).mode
            diff = diff_json(store.diff(run_id))
            return {"ok": True, "runId": run_id, "mode": mode, "diff": diff}
        by = f"{_who(args)} (uid {os.getuid()}) via gatewayd workspace"
        if command == "commit":
            return {
                "ok": True,
                "runId": run_id,
                "committed": diff_json(store.commit(run_id, by=by)),
            }
        store.discard(run_id, by=by)
        return {"ok": True, "runId": run_id, "discarded": True}
    except GatewayError as exc:
        return {"ok": False, "errorCode": str(exc.code), "message": str(exc)}


def _counts(counts: dict[str, int]) -> str:
    return " ".join(f"{counts.get(name, 0)} {name}" for name in _COUNTS)


def _describe(info: dict[str, Any]) -> str:
    fate = {
        "live": "live (its run is on it)",
        "kept": f"kept until {info.get('keepUntil')}",
    }.get(str(info["state"]), str(info["state"]))
    line = f"{info['runId']}  {info['mode']:<7}  {fate}  {info['base']}"
    if info.get("counts"):
        line += f"  ({_counts(info['counts'])})"
    if info.get("note"):
        line += f"\n    note: {info['note']}"
    return line


def _marks(diff: dict[str, Any], *, host: bool) -> list[str]:
    """The lines that flag what the person committing must see: what the commit leaves
    out, the git metadata a host run wrote into the base itself, links leading out."""
    lines = []
    left_out = diff.get("leftOut") or []
    if left_out:
        lines.append("left out of the commit (never written into the base):")
        lines += [f"  {item['path']}: {item['reason']}" for item in left_out]
    git = diff.get("gitMetadata") or []
    if host and git:
        lines.append(
            "git metadata the run wrote into the base itself (mode host writes the directory "
            "during the run, so nothing can be left out; look before running git there):"
        )
        lines += [f"  {path}" for path in git]
    links = diff.get("linksOut") or []
    if links:
        lines.append("links leading out of the workspace:")
        lines += [f"  {item['path']} -> {item['target']}" for item in links]
    return lines


def _print(command: str, answer: dict[str, Any], where: str) -> int:
    if command == "list":
        sessions = answer["workspaces"] if "workspaces" in answer else [answer["workspace"]]
        if not sessions:
            print("no workspace sessions (none kept, none live)")
        for info in sessions:
            print(_describe(info))
        return EXIT_OK
    run_id = answer["runId"]
    if command == "diff":
        diff = answer["diff"]
        sys.stdout.write(diff["unified"])
        for old, new in diff["renamed"]:
            print(f"renamed: {old} -> {new}")
        for path in diff["binary"]:
            print(f"binary: {path}")
        for line in _marks(diff, host=answer.get("mode") == "host"):
            print(line)
        print(
            f"run {run_id}: {len(diff['added'])} added, {len(diff['removed'])} removed, "
            f"{len(diff['modified'])} modified, {len(diff['renamed'])} renamed"
        )
        if any(diff[name] for name in _COUNTS):
            print(
                f"commit with `gatewayd workspace commit{where} {run_id}`, or drop with "
                f"`gatewayd workspace discard{where} {run_id}`"
            )
        return EXIT_OK
    if command == "commit":
        done = answer["committed"]
        print(
            f"committed run {run_id}'s session: {len(done['added'])} added, "
            f"{len(done['removed'])} removed, {len(done['modified'])} modified, "
            f"{len(done['renamed'])} renamed"
        )
        for line in _marks(done, host=False):
            print(line)
        return EXIT_OK
    print(f"discarded run {run_id}'s session; its base is as it was before the run")
    return EXIT_OK
