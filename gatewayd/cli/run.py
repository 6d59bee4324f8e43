"""`gatewayd run` (one shot: create a run, start a command in its sandbox with its
standard streams passed through, report on stderr, exit with the command's status) and
`gatewayd exec` (a command in a live run's sandbox, through `gatewayd serve`'s control
socket)."""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
from collections.abc import AsyncIterator, Callable

from gatewayd.cli.command import EXIT_FAILED, EXIT_USAGE, refusing
from gatewayd.cli.control_client import control_request
from gatewayd.cli.options import (
    absolute_path,
    add_daemon_options,
    config_from_options,
    control_socket_of,
    log_scrubber,
)
from gatewayd.exitstatus import EXIT_MAX_RUNTIME, SIGNAL_EXIT_BASE, describe_exec, exec_status

# typing's flag without importing typing: client commands start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    import _socket
    import signal
    from typing import Final, TextIO

    import trio

    from gatewayd.cli.command import Subparsers
    from gatewayd.daemon import Daemon
    from gatewayd.runs import Run, RunRequest

# Variables a run's command may inherit from gatewayd's environment; everything else
# is dropped (invariant SECRETS_HOST_ONLY), and the two COGNI_ variables are added.
ENV_ALLOWLIST: Final = ("PATH", "HOME", "LANG", "LC_ALL", "TERM", "TZ")
# A run spec is a few hundred bytes, like the control socket's run request (whose body
# cap this is): anything bigger is not a spec.
MAX_SPEC_BYTES: Final = 1 << 20
# The choices of --workspace-mode and --on-end (gatewayd/policy/workspace_section.py;
# spelt here so the parser does not import the policy models).
WORKSPACE_MODES: Final = ("overlay", "agentfs", "host")
ON_END_CHOICES: Final = ("keep", "commit", "discard")
# A run id, as the run registry makes them (tests/unit/test_workspace_store.py holds it
# to the store's RUN_ID_PATTERN); checked here so a mistyped id is named before any request.
_RUN_ID: Final = re.compile(r"[0-9a-f]{32}")
# gatewayd/control_attach.py's route and protocol (spelt here so the client imports
# none of the daemon).
_ATTACH_TARGET: Final = "/v1/runs/attach"
_ATTACH_PROTOCOL: Final = "gatewayd-attach/1"
_ATTACH_READ_BYTES: Final = 64 * 1024
# The longest variable name or value an attach request carries (control_attach's
# MAX_ENV_CHARS).
_ATTACH_ENV_CHARS: Final = 128 * 1024
# Options that set up a daemon of this process; given, `gatewayd run` opens its own
# daemon instead of asking a serving one (which runs with its own configuration).
_OWN_DAEMON_OPTIONS: Final = (
    "audit",
    "policy_dir",
    "no_os_sandbox",
    "netns_prefix",
    "sandbox_uids",
    "lendable_root",
    "max_frame_bytes",
    "audit_max_bytes",
)
# Daemon options a later `gatewayd workspace ...` needs to find the same sessions.
_STORE_OPTIONS: Final = (("config", "--config"), ("state_dir", "--state-dir"))


def add_parsers(sub: Subparsers) -> None:
    run = sub.add_parser(
        "run",
        help="one shot: create a run, start CMD with COGNI_GATEWAY_SOCK set, its stdin, "
        "stdout and stderr streamed from and to this command's own, report on stderr, exit "
        "with CMD's status; with `gatewayd serve` on the state directory, that daemon runs "
        "it (attached), else this process does",
    )
    add_daemon_options(run)
    run.add_argument("--policy", help="policy file, or the name of a shipped policy")
    run.add_argument("--workspace", help="the run's workspace directory")
    run.add_argument("--actor", default=os.environ.get("USER", "operator"))
    run.add_argument("--tenant", default="local")
    run.add_argument(
        "--max-runtime",
        type=int,
        default=None,
        help="seconds before the run ends (default 3600); its command is also bounded by "
        "the policy's sandbox.timeout_s (default 600), whichever is shorter",
    )
    run.add_argument(
        "--tool",
        action="append",
        dest="tools",
        default=None,
        help="restrict the run to these tool ids (repeatable); default: the policy's list",
    )
    run.add_argument(
        "--image",
        default=None,
        help="a root filesystem directory for the sandbox instead of the host's system "
        "directories (see sandbox_image/README.md; check it with `gatewayd image check`)",
    )
    run.add_argument(
        "--spec",
        default=None,
        help="a JSON RunRequest file instead of --policy/--workspace (grant included)",
    )
    run.add_argument(
        "--workspace-mode",
        choices=WORKSPACE_MODES,
        default=None,
        help="how the run sees its workspace: overlay (its changes kept apart until "
        "`gatewayd workspace commit`), agentfs (likewise, in an AgentFS database), host "
        "(it writes the directory itself); default: the policy's workspace.mode, else the "
        "configuration's workspace_mode (overlay); the policy's workspace.request_modes "
        "must list it",
    )
    run.add_argument(
        "--on-end",
        choices=ON_END_CHOICES,
        default=None,
        help="what becomes of the run's workspace session when it ends: keep it for "
        "`gatewayd workspace diff|commit|discard RUN` (the policy's default), commit it "
        "into the directory, or discard it",
    )
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")

    execute = sub.add_parser(
        "exec",
        help="run a command in a live run's sandbox (through gatewayd serve's control socket)",
    )
    execute.add_argument(
        "--state-dir",
        default=None,
        help="the daemon's state directory (to find its control socket); default: the "
        "configuration's",
    )
    execute.add_argument("--control-socket", default=None, help="default STATE_DIR/control.sock")
    execute.add_argument(
        "--timeout", type=float, default=None, help="seconds (at most the policy's timeout)"
    )
    execute.add_argument(
        "-i", "--stdin", action="store_true", help="pass this command's standard input"
    )
    execute.add_argument(
        "--cwd", default=None, help="start in this directory: /workspace or beneath it"
    )
    execute.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a variable for the command (NAME from the policy's env.allow); repeatable",
    )
    execute.add_argument(
        "--allow-domain",
        action="append",
        default=None,
        metavar="DOMAIN",
        help="narrow the command's network to this domain (one the run may reach); repeatable",
    )
    execute.add_argument(
        "--package-manager",
        action="append",
        default=None,
        metavar="NAME",
        help="narrow the command's network to this registry's domains (one the policy's "
        "network.package_managers lists: pypi, npm, crates, go, rubygems, maven); repeatable",
    )
    execute.add_argument(
        "--no-network",
        action="store_true",
        help="give the command no network at all (not even the run's egress proxy)",
    )
    execute.add_argument("run_id", metavar="RUN", help="the run id (32 hex digits)")
    execute.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")


def main(args: argparse.Namespace) -> int:
    if args.command == "exec":
        return _exec(args)
    return refusing(_run, args)


def _run_request(args: argparse.Namespace) -> RunRequest:
    """The request from --spec or the flags, with --workspace-mode and --on-end laid
    over its ``workspace`` (they win over the spec's)."""
    from gatewayd.runs.model import WorkspaceRequest

    request = _base_request(args)
    asked = {
        key: value
        for key, value in (("mode", args.workspace_mode), ("onEnd", args.on_end))
        if value is not None
    }
    if not asked:
        return request
    workspace = (request.workspace or WorkspaceRequest()).model_copy(update=asked)
    return request.model_copy(update={"workspace": workspace})


def _base_request(args: argparse.Namespace) -> RunRequest:
    import pydantic

    from gatewayd.runs import Grant, RunLimits, RunRequest, format_validation_error

    if args.spec is not None:
        from gatewayd import strictjson
        from gatewayd.inputfile import InputFileError, read_input_file

        try:
            raw = read_input_file(args.spec, max_bytes=MAX_SPEC_BYTES, what="the run spec")
            strictjson.check(raw)
            return RunRequest.model_validate_json(raw, strict=True)
        except (InputFileError, strictjson.JsonInputError, pydantic.ValidationError) as exc:
            detail = (
                format_validation_error(exc)
                if isinstance(exc, pydantic.ValidationError)
                else str(exc)
            )
            raise SystemExit(f"gatewayd: bad --spec {args.spec}: {detail}") from None
    if not args.policy or not args.workspace:
        raise SystemExit("gatewayd run: --policy and --workspace are required (or --spec FILE)")
    # The operator starting a run from the host's command line is the system grant.
    return RunRequest(
        workspacePath=os.path.realpath(args.workspace),
        policy=args.policy,
        actorId=args.actor,
        tenantId=args.tenant,
        grant=Grant(allowSandbox=True),
        toolIds=tuple(args.tools) if args.tools else None,
        limits=RunLimits(maxRuntimeSec=args.max_runtime)
        if args.max_runtime is not None
        else RunLimits(),
        sandboxImage=str(absolute_path(args.image)) if args.image is not None else None,
    )


def child_environment(run: Run) -> dict[str, str]:
    """The environment of a run's command: an allowlist plus the two COGNI_ variables.

    The directory of this interpreter goes first on PATH so ``cogni-tool`` is found.
    """
    env = {k: v for k, v in os.environ.items() if k in ENV_ALLOWLIST}
    bindir = os.path.dirname(sys.executable)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "/usr/local/bin:/usr/bin:/bin")
    env["COGNI_GATEWAY_SOCK"] = str(run.socket_path)
    env["COGNI_RUN_ID"] = run.run_id
    return env


def _stop_signals() -> tuple[signal.Signals, ...]:
    """What stops a one-shot run early: an operator's ^C, a service manager's stop, a
    closed terminal. gatewayd then exits 128 + N like the command would. (signal is
    imported here: `gatewayd exec` needs none of it.)"""
    import signal

    return (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _run(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("gatewayd run: give the command after --, e.g. -- python3 agent.py", file=sys.stderr)
        return EXIT_USAGE
    for index, arg in enumerate(cmd):
        try:
            arg.encode()
        except UnicodeEncodeError:  # bytes that are not UTF-8, surrogate-escaped by Python
            print(
                f"gatewayd run: argument {index} of the command, {arg!r}, is not UTF-8 text; "
                "gatewayd records every command it runs as text in the audit log, so it "
                "runs only commands whose arguments are UTF-8",
                file=sys.stderr,
            )
            return EXIT_USAGE
    _keep_our_lines_off_stdout()
    attached = _run_attached(args, cmd)
    if attached is not None:
        return attached
    # The daemon this one-shot run opens, loaded only now: a usage error costs nothing.
    import logging

    import trio

    from gatewayd.audit import AuditEvent, AuditWriteError
    from gatewayd.daemon import load_for_run, open_daemon
    from gatewayd.errors import GatewayError
    from gatewayd.logs import configure_logging
    from gatewayd.policy import PolicyError
    from gatewayd.runs.lifecycle import AUDITED_COMMAND_ARGS
    from gatewayd.runs.oneshot import exec_end_not_audited, max_runtime_line, started_line

    request = _run_request(args)
    config = config_from_options(args)
    configure_logging(logging.WARNING, scrubber=log_scrubber(config))
    status = EXIT_FAILED

    async def work(daemon: Daemon) -> None:
        nonlocal status
        try:
            run = await daemon.runs.start(request, policy_paths=True)
        except GatewayError as exc:  # no grant, no sandbox, a workspace out of reach
            print(f"gatewayd: {exc.code}: {exc}", file=sys.stderr)
            return
        except (PolicyError, ValueError) as exc:
            print(f"gatewayd: run refused: {exc}", file=sys.stderr)
            return
        print(started_line(run), file=sys.stderr)
        max_runtime = run.spec.request.limits.maxRuntimeSec
        # What the run's policy can reach (the HTTP libraries, ...), loaded off the event
        # loop before its command can make a call; nothing when it reaches none of it.
        await load_for_run(run)
        if run.sandbox is not None:
            status = await _run_in_sandbox(daemon, run, cmd, max_runtime, args)
            return
        print(
            f"gatewayd: WARNING: run {run.run_id} has NO OS sandbox ({run.degraded}); "
            "its command runs on the host without isolation",
            file=sys.stderr,
        )
        # Audited like a sandboxed command, marked degraded: the reviewer sees what
        # ran without isolation.
        await daemon.audit.append(
            "event",
            event=AuditEvent.EXEC_STARTED,
            runId=run.run_id,
            detail={"command": cmd[:AUDITED_COMMAND_ARGS], "timeoutS": max_runtime},
            degraded=run.degraded,
        )
        # Cancelling run_process stops the command (SIGTERM, then SIGKILL).
        with trio.move_on_after(max_runtime) as scope:
            # Our own standard streams, as they are: without a sandbox the command
            # is on the host anyway.
            proc = await trio.run_process(
                cmd,
                stdin=None,
                cwd=str(run.spec.workspace),
                env=child_environment(run),
                check=False,
                start_new_session=True,
            )
        if scope.cancelled_caught:
            print(max_runtime_line(run, max_runtime), file=sys.stderr)
            rc, status = -1, EXIT_MAX_RUNTIME
        else:
            rc = proc.returncode
            status = SIGNAL_EXIT_BASE - rc if rc < 0 else rc
        seq = daemon.audit.record(
            "event",
            event=AuditEvent.EXEC_ENDED,
            runId=run.run_id,
            detail={
                "exitCode": rc if rc >= 0 else None,
                "signal": -rc if rc < 0 and not scope.cancelled_caught else None,
                "errorCode": "timeout" if scope.cancelled_caught else None,
            },
            degraded=run.degraded,
        )
        try:
            # The exit status says how the command ended: only once the log does.
            await daemon.runs.durable_before_answer(seq)
        except AuditWriteError as exc:
            print(exec_end_not_audited(exc.detail), file=sys.stderr)
            status = EXIT_FAILED
        await _end_one_shot(daemon, run, f"exit {rc}", args)

    async def one_shot() -> None:
        nonlocal status
        stopped_by: list[int] = []
        # This one run's own: the libraries its policy can reach, not every tool's.
        async with open_daemon(config, preload=False) as daemon:
            # A stop signal ends the run the way a daemon's stop does (command stopped,
            # overlay unmounted, base given back, the session kept): without this the
            # default action would kill gatewayd with its base still lent.
            with trio.open_signal_receiver(*_stop_signals()) as signals:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_cancel_on_signal, signals, nursery.cancel_scope, stopped_by)
                    await work(daemon)
                    nursery.cancel_scope.cancel()
            if stopped_by:
                import signal

                name = signal.Signals(stopped_by[0]).name
                print(
                    f"gatewayd: {name}: the run is being ended (its command stopped); "
                    "a workspace session is kept (gatewayd workspace list)",
                    file=sys.stderr,
                )
                status = SIGNAL_EXIT_BASE + stopped_by[0]

    trio.run(one_shot)
    return status


def _run_attached(args: argparse.Namespace, cmd: list[str]) -> int | None:
    """The run, by the daemon serving the state directory's control socket
    (gatewayd/control_attach.py says how): this process imports none of the daemon and
    relays nothing itself; gatewayd's exit status. None when no daemon serves it (the
    run is then this process's), or when an option sets something only a daemon of this
    process can take (``--audit``, ``--sandbox-uids``...: the serving daemon runs it
    with its own configuration)."""
    import json
    import signal

    from gatewayd.cli.control_client import NO_DAEMON
    from gatewayd.cli.unix_http import upgrade

    # Given: set (a path option given as "" included, as the current directory).
    if any(getattr(args, name, None) not in (None, False, []) for name in _OWN_DAEMON_OPTIONS):
        return None
    vars(args).setdefault("control_socket", None)
    control = control_socket_of(args)
    body = json.dumps(
        {
            "request": _attach_request(args),
            "command": cmd,
            "env": _sendable_environment(),
            "storeOptions": store_options(args),
        }
    ).encode()
    try:
        status, early, sock = upgrade(str(control), _ATTACH_TARGET, body, _ATTACH_PROTOCOL)
    except OSError as exc:
        if exc.errno in NO_DAEMON:
            return None
        print(f"gatewayd run: cannot reach gatewayd at {control}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:  # ^C before the daemon switched: no run was started
        print("gatewayd run: interrupted before the run started", file=sys.stderr)
        return SIGNAL_EXIT_BASE + signal.SIGINT
    if sock is None:
        try:
            answer = json.loads(early)
        except ValueError:
            answer = {}
        answer = answer if isinstance(answer, dict) else {}
        if status == 404 and "no route" in str(answer.get("message", "")):
            print(
                f"gatewayd run: the gatewayd serving {control} cannot run an attached "
                "command (it is older than this one): upgrade it, or stop it to run the "
                "command in this process",
                file=sys.stderr,
            )
        else:
            print(
                f"gatewayd run: {answer.get('errorCode', status)}: {answer.get('message')}",
                file=sys.stderr,
            )
        return EXIT_FAILED
    try:
        return _attached(sock, early)
    finally:
        sock.close()


def _attach_request(args: argparse.Namespace) -> dict[str, object]:
    """The run request as JSON, built without its models (the daemon checks it): from
    ``--spec`` or the flags, with --workspace-mode and --on-end over its workspace."""

    request: dict[str, object]
    if args.spec is not None:
        from gatewayd import strictjson
        from gatewayd.inputfile import InputFileError, read_input_file

        try:
            raw = read_input_file(args.spec, max_bytes=MAX_SPEC_BYTES, what="the run spec")
            request = strictjson.loads(raw)
        except (InputFileError, ValueError) as exc:
            raise SystemExit(f"gatewayd: bad --spec {args.spec}: {exc}") from None
        if not isinstance(request, dict):
            raise SystemExit(f"gatewayd: bad --spec {args.spec}: not a JSON object")
    else:
        if not args.policy or not args.workspace:
            raise SystemExit("gatewayd run: --policy and --workspace are required (or --spec FILE)")
        # The operator starting a run from the host's command line is the system grant.
        request = {
            "workspacePath": os.path.realpath(args.workspace),
            "policy": args.policy,
            "actorId": args.actor,
            "tenantId": args.tenant,
            "grant": {"allowSandbox": True},
            "toolIds": list(args.tools) if args.tools else None,
            "limits": {} if args.max_runtime is None else {"maxRuntimeSec": args.max_runtime},
            "sandboxImage": str(absolute_path(args.image)) if args.image is not None else None,
        }
    policy = request.get("policy")
    if isinstance(policy, str) and ("/" in policy or policy.endswith((".yaml", ".yml"))):
        request["policy"] = os.path.abspath(policy)  # a path: the daemon's is not our cwd
    asked = {
        key: value
        for key, value in (("mode", args.workspace_mode), ("onEnd", args.on_end))
        if value is not None
    }
    if asked:
        workspace = request.get("workspace")
        request["workspace"] = {**(workspace if isinstance(workspace, dict) else {}), **asked}
    return request


def _sendable_environment() -> dict[str, str]:
    """Our variables as the attach request carries them (they feed the policy's
    env.allow): one the request cannot hold (not UTF-8, or longer than the daemon takes)
    is left out rather than the whole run refused."""
    env = {}
    for name, value in os.environ.items():
        if len(name) > _ATTACH_ENV_CHARS or len(value) > _ATTACH_ENV_CHARS:
            continue
        try:
            name.encode()
            value.encode()
        except UnicodeEncodeError:  # bytes that are not UTF-8 (surrogate-escaped)
            continue
        env[name] = value
    return env


def _attached(sock: _socket.socket, early: bytes) -> int:
    """The attached exchange's client side, once the daemon switched: our standard
    streams passed, the daemon's lines printed, a stop signal passed on; the exit
    status the daemon says."""
    import _socket
    import json
    import signal

    stopped: list[int] = []
    passed = False

    def stop_message() -> None:
        try:  # noqa: SIM105 (contextlib is an import this client does without)
            sock.sendall(json.dumps({"stop": stopped[0]}).encode() + b"\n")
        except OSError:
            pass

    def pass_on(signum: int, _frame: object) -> None:
        if not stopped:  # the first ends the run; the daemon says when it has
            stopped.append(signum)
            if passed:  # else said once the streams are passed (it would take their place)
                stop_message()

    for signum in _stop_signals():
        signal.signal(signum, pass_on)
    # Everything from the daemon's 101 to the descriptors' sending is on the run's
    # critical path (the daemon waits for them): no import in between.
    opened: list[int] = []
    try:
        fds = [
            _terminal_read_here(_own_descriptor(sys.stdin, os.O_RDONLY, opened), opened),
            _own_descriptor(sys.stdout, os.O_WRONLY, opened),
            _own_descriptor(sys.stderr, os.O_WRONLY, opened),
        ]
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        # SCM_RIGHTS carries C ints, in the machine's order.
        rights = b"".join(fd.to_bytes(4, sys.byteorder, signed=True) for fd in fds)
        sock.sendmsg([b"\0"], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, rights)])
    finally:
        _close_all(opened)
    passed = True
    if stopped:
        stop_message()
    buffer = bytearray(early)
    while True:
        while b"\n" in buffer:
            line, _, rest = bytes(buffer).partition(b"\n")
            buffer[:] = rest
            message = json.loads(line)
            if "say" in message:
                print(message["say"], file=sys.stderr, flush=True)
            elif "exit" in message:
                return int(message["exit"])
        chunk = sock.recv(_ATTACH_READ_BYTES)
        if not chunk:
            print(
                "gatewayd run: gatewayd closed the connection before the run's end (its "
                "log says why; `gatewayd workspace list` shows a session it kept)",
                file=sys.stderr,
            )
            return EXIT_FAILED
        buffer += chunk


def _close_all(fds: list[int]) -> None:
    """Close the descriptors this process opened for its streams (the daemon holds its
    own copies once they are passed)."""
    for fd in fds:
        os.close(fd)


def _terminal_read_here(fd: int, opened: list[int]) -> int:
    """``fd``, or, when it is a terminal, a pipe this process feeds from it in a thread:
    the daemon never reads the operator's terminal itself. Job control then holds as for
    any command: `gatewayd run ... &` that reads its terminal is stopped (SIGTTIN) rather
    than taking lines typed for the shell (the daemon, in no session of that terminal,
    would be stopped by nothing); and nothing reads the terminal once this process is
    gone."""
    if not os.isatty(fd):
        return fd
    import threading

    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    opened.append(read_end)  # the daemon holds its own copy once passed

    def feed() -> None:
        from gatewayd.fdwrite import write_all

        try:
            while chunk := os.read(fd, _ATTACH_READ_BYTES):
                write_all(write_end, chunk)
        except OSError:  # a hung-up terminal (EIO), or the command stopped reading (EPIPE)
            pass
        finally:
            os.close(write_end)

    threading.Thread(target=feed, name="terminal-input", daemon=True).start()
    return read_end


async def _cancel_on_signal(
    signals: AsyncIterator[int], scope: trio.CancelScope, stopped_by: list[int]
) -> None:
    async for signum in signals:
        stopped_by.append(signum)
        scope.cancel()
        return


async def _end_one_shot(
    daemon: Daemon, run: Run, outcome: str, args: argparse.Namespace | None = None
) -> None:
    from gatewayd.runs.oneshot import end_one_shot

    await end_one_shot(
        daemon.runs,
        run,
        outcome,
        _say,
        audit_path=str(daemon.config.resolved_audit_path),
        store_options=store_options(args),
    )


def store_options(args: argparse.Namespace | None) -> str:
    """The options (each with a leading space) a later `gatewayd workspace ...` needs to
    find the same sessions as this command."""
    import shlex

    return "".join(
        f" {flag} {shlex.quote(str(getattr(args, name)))}"
        for name, flag in _STORE_OPTIONS
        if args is not None and getattr(args, name, None) is not None
    )


def _say(line: str) -> None:
    print(line, file=sys.stderr)


async def _run_in_sandbox(
    daemon: Daemon,
    run: Run,
    cmd: list[str],
    max_runtime: int,
    args: argparse.Namespace | None = None,
) -> int:
    """The one-shot run's command, in the run's sandbox; returns gatewayd's exit status."""
    from gatewayd.runs.oneshot import run_in_sandbox
    from gatewayd.sandbox.passthrough import Passthrough

    for stream in (sys.stdout, sys.stderr):
        if stream is not None:  # None: closed when gatewayd started
            stream.flush()
    opened: list[int] = []
    try:
        # The command is this process in a pipeline: our stdin is its stdin, its
        # output is ours, as it comes, through pipes (never our descriptors
        # themselves: one could be the operator's terminal). Nothing is kept, so no
        # output cap applies.
        streams = Passthrough(
            stdin=_own_descriptor(sys.stdin, os.O_RDONLY, opened),
            stdout=_own_descriptor(sys.stdout, os.O_WRONLY, opened),
            stderr=_own_descriptor(sys.stderr, os.O_WRONLY, opened),
        )
        return await run_in_sandbox(
            daemon.runs,
            run,
            cmd,
            max_runtime,
            streams,
            _say,
            audit_path=str(daemon.config.resolved_audit_path),
            store_options=store_options(args),
        )
    finally:
        _close_all(opened)


def _keep_our_lines_off_stdout() -> None:
    """Started with stderr closed, Python leaves ``sys.stderr`` None, and ``print(...,
    file=sys.stderr)`` then writes to stdout, which is the command's alone: our lines go
    to /dev/null instead (open for the rest of this one-shot process)."""
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115


def _own_descriptor(stream: TextIO | None, flags: int, opened: list[int]) -> int:
    """The descriptor behind one of our standard streams, or /dev/null (opened with
    ``flags``, added to ``opened`` for the caller to close) when it was closed when
    gatewayd started: Python then leaves the stream None, and the descriptor number may
    since name a file gatewayd opened itself (the audit log), which must never be
    relayed. A stream with no descriptor at all (replaced in-process, as a test harness
    or an embedding program does) is /dev/null too: there is nothing of ours to relay."""
    if stream is not None:
        try:
            return stream.fileno()
        except (OSError, ValueError):  # io.UnsupportedOperation is both
            pass
    fd = os.open(os.devnull, flags | os.O_CLOEXEC)
    opened.append(fd)
    return fd


def _writer(fd: int) -> Callable[[bytes], None]:
    from gatewayd.fdwrite import write_all

    return functools.partial(write_all, fd)


def _write_output(stdout: bytes, stderr: bytes) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    _writer(sys.stdout.fileno())(stdout)
    _writer(sys.stderr.fileno())(stderr)


def _exec(args: argparse.Namespace) -> int:
    """`gatewayd exec RUN -- CMD`: POST the command to the control socket, print its
    output, exit with its status."""
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("gatewayd exec: give the command after --, e.g. RUN -- make test", file=sys.stderr)
        return EXIT_USAGE
    if _RUN_ID.fullmatch(args.run_id) is None:
        print(
            f"gatewayd exec: bad_request: {args.run_id[:80]!r} is not a run id "
            "(32 lowercase hex characters, as `gatewayd run` and GET /v1/runs show them)",
            file=sys.stderr,
        )
        return EXIT_FAILED
    body: dict[str, object] = {"command": cmd}
    if args.timeout is not None:
        body["timeoutSec"] = args.timeout
    if args.stdin:
        body["stdin"] = sys.stdin.buffer.read().decode("utf-8", errors="replace")
    try:
        body.update(_exec_options(args))
    except ValueError as exc:
        print(f"gatewayd exec: {exc}", file=sys.stderr)
        return EXIT_USAGE
    control = control_socket_of(args)
    # The id is 32 hex digits (checked above): one path segment as it is.
    target = f"/v1/runs/{args.run_id}/exec"
    try:
        status, payload = control_request(control, "POST", target, body)
    except OSError as exc:
        print(f"gatewayd exec: cannot reach gatewayd at {control}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if status != 200 or not payload.get("ok"):
        print(
            f"gatewayd exec: {payload.get('errorCode', status)}: {payload.get('message')}",
            file=sys.stderr,
        )
        return EXIT_FAILED
    result = payload["result"]
    streams = []
    for name in ("stdout", "stderr"):
        text = result[name]
        if result[f"{name}Encoding"] == "base64":  # output that is not UTF-8 text
            import base64

            streams.append(base64.b64decode(text))
        else:
            streams.append(text.encode())
    _write_output(streams[0], streams[1])
    for name in ("stdout", "stderr"):
        if result[f"{name}Truncated"]:
            print(f"gatewayd exec: {name} was cut at the run's output limit", file=sys.stderr)
    if result["errorCode"]:
        print(
            "gatewayd exec: "
            + describe_exec(result["exitCode"], result["signal"], result["errorCode"]),
            file=sys.stderr,
        )
    if result.get("hint"):
        print(f"gatewayd exec: hint: {result['hint']}", file=sys.stderr)
    return exec_status(result["exitCode"], result["signal"], result["errorCode"])


def _exec_options(args: argparse.Namespace) -> dict[str, object]:
    """The exec request's options from ``gatewayd exec``'s flags (ValueError: a flag
    that cannot be one; gatewayd checks the rest, as it checks sandbox.exec's)."""
    options: dict[str, object] = {}
    if args.cwd is not None:
        options["cwd"] = args.cwd
    env: dict[str, str] = {}
    for item in args.env:
        name, equals, value = item.partition("=")
        if not equals or not name:
            raise ValueError(f"--env {item!r}: give NAME=VALUE")
        if name in env:
            raise ValueError(f"--env names {name} twice")
        env[name] = value
    if env:
        options["env"] = env
    if args.no_network and (args.allow_domain or args.package_manager):
        raise ValueError("--no-network gives no network: drop --allow-domain/--package-manager")
    if args.no_network or args.allow_domain is not None:
        options["allowedDomains"] = list(args.allow_domain or [])
    if args.package_manager is not None:
        options["packageManagers"] = list(args.package_manager)
    return options
