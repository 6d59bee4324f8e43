"""`gatewayd tools run NAME ARGS --workspace W`: one call of one tool from a tool folder,
one shot, as a run would make it.

Like `gatewayd run`, it opens an in-process daemon (the configuration's ``tool_dirs``
and models, its audit log), starts a run, and ends it: the run's policy is made for the
call (:func:`one_shot_policy`: the tool allowed, W read-write, and the model aliases,
domains and environment names the tool's manifest declares, so the tool gets what it
asks for and no more), the call goes through the dispatcher (``Dispatcher.handle``:
allowlist, argument schema, capabilities, audit, the tool's runner), and its answer is
printed as JSON on stdout. A refused or failed call prints its error code and message
on stderr and exits with the code cogni-tool's table gives it
(:data:`cogni_tool.client.WIRE_EXIT_CODES`), so a script tells ``policy_denied`` (15)
from ``limit_exceeded`` (24) the same way whether it calls the tool from a sandbox or
tries it here.

Workspace modes (``--workspace-mode``, default the configuration's ``workspace_mode``):

- ``overlay``: the run works on an overlay of W (gatewayd/workspace/overlay.py), so W is
  not written during the call; afterwards the changes are printed on stderr as a diff
  and discarded, unless ``--commit`` applies them to W.
- ``host``: the run works on W itself, as `gatewayd run --workspace-mode host` does.

A configured ``workspace_mode: agentfs`` means ``overlay`` here (one call needs no
AgentFS database, and host would write W during the call).

The overlay's run has no sandbox uid of its own lent W's files (an agent run lends its
private clone; W is the operator's): a wasm tool writes as gatewayd does, so its
writes land in the overlay, while a *process* tool runs as the run's sandbox uid and can
write only where W's modes let any user write. `--workspace-mode host` lends W to the
run as `gatewayd run` does.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from gatewayd.cli.command import EXIT_FAILED, EXIT_OK, EXIT_USAGE, refusing
from gatewayd.cli.options import add_daemon_options, config_from_options, log_scrubber
from gatewayd.frame_limits import MAX_FRAME_BYTES

if TYPE_CHECKING:
    from gatewayd.cli.command import Subparsers
    from gatewayd.config import GatewaydConfig
    from gatewayd.daemon import Daemon
    from gatewayd.protocol import Response
    from gatewayd.runs import Run
    from gatewayd.tools.manifest import ToolManifest
    from gatewayd.workspace import WorkspaceDiff, WorkspaceSession

# The call's id in the audit log: one call per one-shot run.
TOOL_CALL_ID: Final = "tools-run-1"
# The arguments are one request's: the largest frame gatewayd ever takes (max_frame_bytes'
# ceiling) bounds them, whatever the configuration says.
MAX_ARGS_BYTES: Final = MAX_FRAME_BYTES
# The one-shot run ends this long after the call's own limit at the latest (a margin
# for the run's start and end around the call).
RUN_MARGIN_S: Final = 60
# A diff printed on stderr is cut here: the summary lines above it name every path.
MAX_SHOWN_DIFF_CHARS: Final = 200_000
# Control characters shown escaped on the operator's terminal: a tool writes what it
# likes into a file, and its diff must not drive the terminal (escape sequences). The
# diff keeps its newlines and tabs.
_CONTROL_RE: Final = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def add_run_parser(tools_sub: Subparsers) -> None:
    """Add `run` to `gatewayd tools`'s subcommands."""
    run = tools_sub.add_parser(
        "run",
        help="one shot: call a tool of the configured tool_dirs once against a workspace, "
        "through the chokepoint (policy, audit), and print its answer as JSON",
    )
    add_daemon_options(run)
    run.add_argument("name", metavar="NAME", help="the tool's name (e.g. text.wordcount)")
    run.add_argument(
        "arguments",
        metavar="ARGS",
        help="the call's arguments: a JSON object, or - to read it from stdin",
    )
    run.add_argument("--workspace", type=Path, required=True, help="the run's workspace directory")
    run.add_argument(
        "--workspace-mode",
        choices=("host", "overlay"),
        default=None,
        help="overlay: the tool works on an overlay of the workspace, whose changes are "
        "shown and discarded unless --commit; host: on the workspace itself (default: "
        "the configuration's workspace_mode)",
    )
    run.add_argument(
        "--commit",
        action="store_true",
        help="overlay mode: apply the tool's changes to the workspace after the call",
    )
    run.add_argument("--actor", default=os.environ.get("USER", "operator"))


def run_tool(args: argparse.Namespace) -> int:
    """`gatewayd tools run`; returns gatewayd's exit status."""
    return refusing(_run_tool, args)


def one_shot_policy(manifest: ToolManifest, config: GatewaydConfig) -> dict[str, Any]:
    """The policy of a one-shot call of ``manifest``'s tool: that tool allowed, the
    workspace read-write, and what the manifest declares besides (its model aliases that
    gatewayd configures, with ``model.chat``, which its model requests are; its domains;
    its environment names); the tool's own time limit is the run's per-call limit, so
    the manifest's governs. A process tool needs the OS sandbox; a wasm tool runs in
    gatewayd and does not."""
    from gatewayd.tools.manifest import RunnerKind

    caps = manifest.capabilities
    timeout_s = manifest.limits.timeout_s or config.tool_timeout_s
    policy: dict[str, Any] = {
        "version": 1,
        "name": "tools-run",
        "description": f"gatewayd tools run: one call of {manifest.name}",
        "tools": {"allow": [manifest.name]},
        "filesystem": {"paths": {"workspace": {"root": ".", "mode": "rw"}}},
        "limits": {"call_timeout_s": timeout_s},
        "require_os_sandbox": manifest.runner is RunnerKind.PROCESS,
    }
    models = [alias for alias in caps.model_access if alias in config.models]
    if models:
        policy["model_access"] = {"models": models}
        # The tool's model requests are model.chat calls of the run (policy, audit, budget).
        policy["tools"]["allow"].append("model.chat")
    if caps.network:
        # Only a process tool declares domains; its call reaches them through a proxy of
        # its own, which a run gives only where its policy turns the run's proxy on.
        policy["network"] = {"allow_domains": list(caps.network), "proxy": {"enabled": True}}
    if caps.env:
        policy["env"] = {"allow": list(caps.env)}
    return policy


def _read_arguments(text: str) -> dict[str, Any]:
    """ARGS as a JSON object (strict: no key twice, bounded); a bad one ends the command
    with its reason and EXIT_USAGE."""
    from gatewayd import strictjson

    raw = sys.stdin.buffer.read(MAX_ARGS_BYTES + 1) if text == "-" else text.encode()
    problem = None
    if len(raw) > MAX_ARGS_BYTES:
        problem = f"ARGS is longer than {MAX_ARGS_BYTES} bytes"
    else:
        try:
            value = strictjson.loads(raw)
        except strictjson.JsonInputError as exc:
            problem = f"ARGS is not JSON: {exc}"
        else:
            if isinstance(value, dict):
                return value
            problem = 'ARGS must be a JSON object, e.g. \'{"text": "hello"}\''
    print(f"gatewayd tools run: {problem}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


def _printable(text: str) -> str:
    return _CONTROL_RE.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def _say(line: str) -> None:
    print(f"gatewayd: {_printable(line)}", file=sys.stderr, flush=True)


def _run_tool(args: argparse.Namespace) -> int:
    import trio

    from gatewayd.logs import configure_logging

    config = config_from_options(args)
    mode = args.workspace_mode or config.workspace_mode
    if mode == "agentfs":
        # One call needs no AgentFS database: the configured virtual mode becomes the
        # overlay (never host, which would write W during the call).
        _say("workspace_mode agentfs: `tools run` keeps the tool's changes in an overlay")
        mode = "overlay"
    if args.commit and mode != "overlay":
        print(
            "gatewayd tools run: --commit applies an overlay's changes; the workspace "
            "mode here is host (the tool writes the workspace itself)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    arguments = _read_arguments(args.arguments)
    workspace = args.workspace.resolve()
    if not workspace.is_dir():
        print(f"gatewayd tools run: the workspace {workspace} is not a directory", file=sys.stderr)
        return EXIT_USAGE
    configure_logging(logging.WARNING, scrubber=log_scrubber(config))
    status = EXIT_FAILED

    async def one_shot() -> None:
        nonlocal status
        from gatewayd.daemon import open_daemon

        # This one call's own: the libraries its run can reach (_call_once), not every
        # tool's.
        async with open_daemon(config, preload=False) as daemon:
            status = await _call_once(daemon, args, arguments, workspace, mode)

    trio.run(one_shot)
    return status


async def _call_once(
    daemon: Daemon,
    args: argparse.Namespace,
    arguments: dict[str, Any],
    workspace: Path,
    mode: str,
) -> int:
    """Start the run, make the call, end the run; returns the exit status."""
    import trio

    from cogni_tool.client import WIRE_EXIT_CODES
    from gatewayd.daemon import load_for_run
    from gatewayd.errors import GatewayError
    from gatewayd.policy import PolicyError
    from gatewayd.runners.spec import FOLDER_RUNNERS
    from gatewayd.runs import Grant, RunLimits, RunRequest
    from gatewayd.workspace import OverlayWorkspace

    tool = daemon.dispatcher.tools.get(args.name)
    if tool is None or tool.manifest.runner not in FOLDER_RUNNERS:
        dirs = ", ".join(str(d) for d in daemon.config.tool_dirs) or "none configured"
        _say(
            f"unknown_tool: no tool {args.name!r} in the tool directories ({dirs}); "
            "`gatewayd tools list` shows them, `gatewayd tools check` what is wrong"
        )
        return WIRE_EXIT_CODES["unknown_tool"]
    manifest = tool.manifest
    unknown = [a for a in manifest.capabilities.model_access if a not in daemon.config.models]
    if unknown:
        _say(
            f"{manifest.name} declares model alias(es) {', '.join(unknown)} that gatewayd's "
            "configuration (models) does not define: the run is not granted them"
        )
    private = Path(tempfile.mkdtemp(prefix="gatewayd-tools-run-"))
    session: WorkspaceSession | None = None
    try:
        policy = private / "policy.yaml"
        rules = one_shot_policy(manifest, daemon.config)
        # JSON is YAML: the policy loader reads it as any policy file.
        policy.write_text(json.dumps(rules))
        root = workspace
        if mode == "overlay":
            _say(f"overlay of {workspace}: the tool's changes are kept apart from it")
            session = await trio.to_thread.run_sync(
                lambda: OverlayWorkspace.create(workspace, private / "session")
            )
            root = session.root
        timeout_s = manifest.limits.timeout_s or daemon.config.tool_timeout_s
        request = RunRequest(
            workspacePath=str(root),
            policy=str(policy),
            actorId=args.actor,
            tenantId="local",
            grant=Grant(allowSandbox=True),  # the operator at the host's command line
            toolIds=tuple(rules["tools"]["allow"]),
            limits=RunLimits(maxRuntimeSec=int(timeout_s) + RUN_MARGIN_S),
            graphId="tools-run",
        )
        try:
            if session is not None:
                # W is the operator's: not lent to a sandbox uid (see the module doc).
                run = await daemon.runs.start(
                    request,
                    policy_paths=True,
                    lend_workspace=False,
                    own_root=private,
                    workspace_session=False,
                )
            else:
                # The mode is this command's own (--workspace-mode), not a session's.
                run = await daemon.runs.start(request, policy_paths=True, workspace_session=False)
        except GatewayError as exc:
            _say(f"{exc.code}: the run could not start: {exc}")
            return EXIT_FAILED
        except (PolicyError, ValueError) as exc:
            _say(f"run refused: {exc}")
            return EXIT_FAILED
        _say(
            f"run {run.run_id} started ({mode} workspace"
            + (f"; NO OS sandbox: {run.degraded}" if run.degraded else "")
            + f"); calling {manifest.name} ({manifest.runner}, {manifest.version})"
        )
        try:
            # What the run can reach (its egress proxy's HTTP libraries, say), off the
            # loop, before its one call.
            await load_for_run(run)
            response = await _call(daemon, run, manifest.name, arguments)
        finally:
            with trio.CancelScope(shield=True):
                await daemon.runs.end(run.run_id, reason="tool_called")
        status = _report(response, WIRE_EXIT_CODES)
        if session is not None:
            status = await _finish_overlay(session, workspace, commit=args.commit, status=status)
        _say(f"audit log {daemon.config.resolved_audit_path}")
        return status
    finally:
        with trio.CancelScope(shield=True):
            if session is not None:
                await trio.to_thread.run_sync(session.close)
            shutil.rmtree(private, ignore_errors=True)


async def _call(daemon: Daemon, run: Run, name: str, arguments: dict[str, Any]) -> Response:
    """The call, as the run's socket would hand it to the dispatcher; the peer is this
    process (the operator's command)."""
    from gatewayd.audit import Peer
    from gatewayd.protocol import PROTOCOL_VERSION, Request

    request = Request(
        v=PROTOCOL_VERSION, runId=run.run_id, toolCallId=TOOL_CALL_ID, tool=name, args=arguments
    )
    peer = Peer(pid=os.getpid(), uid=os.getuid(), gid=os.getgid())
    started = time.monotonic()
    response = await daemon.dispatcher.handle(run, request, peer)
    _say(f"{name} answered in {(time.monotonic() - started) * 1000:.1f} ms")
    return response


def _report(response: Response, exit_codes: dict[str, int]) -> int:
    """The answer's value on stdout, or its error on stderr; the exit status."""
    import msgspec

    if response.ok:
        sys.stdout.buffer.write(msgspec.json.format(msgspec.json.encode(response.value)) + b"\n")
        sys.stdout.flush()
        return EXIT_OK
    code = str(response.errorCode)
    print(f"gatewayd tools run: {code}: {_printable(str(response.safeMessage))}", file=sys.stderr)
    return exit_codes.get(code, EXIT_FAILED)


async def _finish_overlay(
    session: WorkspaceSession, workspace: Path, *, commit: bool, status: int
) -> int:
    """Show the overlay's changes on stderr; apply them with ``commit``, else drop them."""
    import trio

    from gatewayd.workspace import WorkspaceError

    diff = await trio.to_thread.run_sync(session.diff)
    if diff.empty:
        _say(f"no changes to {workspace}")
        return status
    _show_diff(diff)
    if not commit:
        await trio.to_thread.run_sync(session.discard)
        _say(f"changes discarded; {workspace} is as it was (--commit applies them)")
        return status
    from gatewayd.workspace.commit_rules import HeldBack, held_back

    # As every commit of a run's session: git metadata is never written into the
    # workspace (gatewayd/workspace/commit_rules.py); links leading out are named.
    ops = getattr(session, "delta_operations", None)
    held = (
        await trio.to_thread.run_sync(held_back, workspace, ops()) if callable(ops) else HeldBack()
    )
    try:
        await trio.to_thread.run_sync(lambda: session.commit(leave_out=held.ops))
    except (WorkspaceError, OSError) as exc:
        _say(f"the changes could not be applied to {workspace}: {exc}")
        return EXIT_FAILED
    for path, reason in sorted(held.paths.items()):
        _say(f"left out of the commit: {path}: {reason}")
    for path, target in diff.links_out:
        _say(f"a link leading out of the workspace was committed: {path} -> {target}")
    _say(f"changes committed to {workspace}")
    return status


def _show_diff(diff: WorkspaceDiff) -> None:
    for label, paths in (
        ("added", diff.added),
        ("modified", diff.modified),
        ("removed", diff.removed),
        ("renamed", [f"{old} -> {new}" for old, new in diff.renamed]),
        ("binary", diff.binary),
    ):
        if paths:
            _say(f"{label}: {', '.join(paths)}")
    text = diff.unified
    if len(text) > MAX_SHOWN_DIFF_CHARS:
        text = text[:MAX_SHOWN_DIFF_CHARS] + "\n[diff cut]\n"
    sys.stderr.write(_printable(text))
    sys.stderr.flush()
