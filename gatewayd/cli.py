"""`gatewayd` command line: serve, run, exec, rules, image check, policy check, audit.

Heavy imports (trio, the daemon) happen inside the commands that need them, so
`gatewayd audit verify` and `gatewayd policy check` start fast.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from gatewayd.config import GatewaydConfig
    from gatewayd.daemon import Daemon, DaemonConfig
    from gatewayd.runs import Run, RunRequest
    from gatewayd.secrets import Scrubber

# Exit codes of gatewayd itself (a one-shot run exits with its command's status).
EXIT_OK: Final = 0
EXIT_FAILED: Final = 1  # verify found a problem, policy invalid, run refused
EXIT_USAGE: Final = 2
# A child killed by signal N exits 128 + N, like a shell reports it.
SIGNAL_EXIT_BASE: Final = 128
# Variables a run's command may inherit from gatewayd's environment; everything else
# is dropped (invariant SECRETS_HOST_ONLY), and the two COGNI_ variables are added.
ENV_ALLOWLIST: Final = ("PATH", "HOME", "LANG", "LC_ALL", "TERM", "TZ")
# A frame must hold a request header (the decoder refuses less than 64 bytes); more
# than 64 MiB per frame is not a tool call but a way to make the daemon buffer memory.
MIN_FRAME_BYTES: Final = 64
MAX_FRAME_BYTES: Final = 64 << 20
# Like timeout(1): the run's command was stopped because the run ran out of time.
EXIT_MAX_RUNTIME: Final = 124


def _add_daemon_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--state-dir",
        type=Path,
        default=Path(os.environ.get("GATEWAYD_STATE_DIR", "/var/lib/gatewayd")),
        help="private state directory (runs, sockets, audit); default $GATEWAYD_STATE_DIR "
        "or /var/lib/gatewayd",
    )
    p.add_argument(
        "--audit", type=Path, default=None, help="audit log (default STATE_DIR/audit/audit.jsonl)"
    )
    p.add_argument(
        "--policy-dir",
        type=Path,
        action="append",
        default=[],
        help="directory searched for policies named without a path (repeatable)",
    )
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help="gatewayd's configuration file (model aliases); default $GATEWAYD_CONFIG, "
        "else /etc/gatewayd/gatewayd.yaml when it exists",
    )
    p.add_argument(
        "--no-os-sandbox",
        action="store_true",
        help="act as on a host without bubblewrap: only runs whose policy says "
        "require_os_sandbox: false start, without isolation (development only)",
    )
    p.add_argument(
        "--netns-prefix",
        default=os.environ.get("GATEWAYD_NETNS_PREFIX", "cogni-"),
        help="prefix of the runs' network namespaces; another daemon on this host needs "
        "another one (default $GATEWAYD_NETNS_PREFIX or cogni-)",
    )
    p.add_argument(
        "--sandbox-uids",
        type=_uid_range,
        default=None,
        help="BASE+COUNT: host uids the sandboxes run as, one per live run "
        "(default 1800000000+1024)",
    )
    p.add_argument(
        "--max-frame-bytes",
        type=_frame_bytes,
        default=None,
        help=f"largest request frame ({MIN_FRAME_BYTES}..{MAX_FRAME_BYTES}; default 1 MiB)",
    )


def _frame_bytes(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of bytes: {text!r}") from None
    if not MIN_FRAME_BYTES <= value <= MAX_FRAME_BYTES:
        raise argparse.ArgumentTypeError(
            f"{value} is outside {MIN_FRAME_BYTES}..{MAX_FRAME_BYTES} bytes"
        )
    return value


def _uid_range(text: str) -> tuple[int, int]:
    base, sep, count = text.partition("+")
    try:
        if not sep:
            raise ValueError
        return int(base), int(count)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a uid range: {text!r}; write BASE+COUNT, e.g. 1800000000+1024"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gatewayd", description="The cogni gateway host daemon.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the long-lived daemon with its control socket")
    _add_daemon_options(serve)
    serve.add_argument(
        "--control-socket", type=Path, default=None, help="default STATE_DIR/control.sock"
    )

    run = sub.add_parser(
        "run",
        help="one shot: create a run, start CMD with COGNI_GATEWAY_SOCK set, report, exit",
    )
    _add_daemon_options(run)
    run.add_argument("--policy", help="policy file, or the name of a shipped policy")
    run.add_argument("--workspace", type=Path, help="the run's workspace directory")
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
        type=Path,
        default=None,
        help="a root filesystem directory for the sandbox instead of the host's system "
        "directories (see sandbox_image/README.md; check it with `gatewayd image check`)",
    )
    run.add_argument(
        "--spec",
        type=Path,
        default=None,
        help="a JSON RunRequest file instead of --policy/--workspace (grant included)",
    )
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")

    execute = sub.add_parser(
        "exec",
        help="run a command in a live run's sandbox (through gatewayd serve's control socket)",
    )
    execute.add_argument(
        "--state-dir",
        type=Path,
        default=Path(os.environ.get("GATEWAYD_STATE_DIR", "/var/lib/gatewayd")),
        help="the daemon's state directory (to find its control socket)",
    )
    execute.add_argument(
        "--control-socket", type=Path, default=None, help="default STATE_DIR/control.sock"
    )
    execute.add_argument(
        "--timeout", type=float, default=None, help="seconds (at most the policy's timeout)"
    )
    execute.add_argument(
        "-i", "--stdin", action="store_true", help="pass this command's standard input"
    )
    execute.add_argument("run_id", metavar="RUN", help="the run id (32 hex digits)")
    execute.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ARGS...")

    rules = sub.add_parser(
        "rules", help="review rules of a policy, through gatewayd serve's control socket"
    ).add_subparsers(dest="rules_command", required=True)
    for name, helptext in (
        ("show", "print a policy's allow and deny rules"),
        ("add-deny", "add a deny rule (takes effect at once)"),
        ("remove-allow", "remove an allow rule (takes effect at once)"),
        ("add-allow", "add an allow rule (pending until confirmed)"),
        ("remove-deny", "remove a deny rule (pending until confirmed)"),
        ("pending", "list changes waiting for confirmation"),
        ("confirm", "apply a pending change"),
        ("cancel", "drop a pending change"),
    ):
        cmd = rules.add_parser(name, help=helptext)
        cmd.add_argument(
            "--state-dir",
            type=Path,
            default=Path(os.environ.get("GATEWAYD_STATE_DIR", "/var/lib/gatewayd")),
        )
        cmd.add_argument("--control-socket", type=Path, default=None)
        if name in ("confirm", "cancel"):
            cmd.add_argument("confirmation_id", metavar="ID")
        elif name != "pending":
            cmd.add_argument("--policy", required=True, help="policy name or file")
            if name != "show":
                cmd.add_argument("rule", help="the rule's text, in quotes")
                cmd.add_argument("--by", default=os.environ.get("USER"), help="who adds it")

    image = sub.add_parser("image", help="sandbox root filesystem images").add_subparsers(
        dest="image_command", required=True
    )
    image_check = image.add_parser(
        "check", help="can DIR be a sandbox root? lists every problem with its fix"
    )
    image_check.add_argument("dir", type=Path)

    policy = sub.add_parser("policy", help="policy files").add_subparsers(
        dest="policy_command", required=True
    )
    check = policy.add_parser("check", help="validate a policy file and summarize it")
    check.add_argument("file", type=Path)

    audit = sub.add_parser("audit", help="read the audit log").add_subparsers(
        dest="audit_command", required=True
    )
    verify = audit.add_parser("verify", help="check the hash chain; prints OK or the first break")
    verify.add_argument("file", type=Path)
    show = audit.add_parser("show", help="print the audit log as a table")
    show.add_argument("file", type=Path)
    show.add_argument("--run", default=None, help="only this run id")
    show.add_argument("--denied", action="store_true", help="only denied or failed calls")

    review = sub.add_parser("review", help="evaluate review rules").add_subparsers(
        dest="review_command", required=True
    )
    replay = review.add_parser(
        "replay",
        help="review recorded calls (JSON lines: tool, args, optional expect) under a "
        "policy's rules with the configured model; report agreement, false allows and "
        "denies, latency; exit 1 on any disagreement or failed review",
    )
    replay.add_argument("calls", type=Path, metavar="CALLS.jsonl")
    replay.add_argument(
        "--policy", required=True, help="policy file, or the name of a shipped policy"
    )
    replay.add_argument(
        "--policy-dir",
        type=Path,
        action="append",
        default=[],
        help="directory searched for policies named without a path (repeatable)",
    )
    replay.add_argument(
        "--config",
        type=Path,
        default=None,
        help="gatewayd's configuration file (model aliases); default $GATEWAYD_CONFIG, "
        "else /etc/gatewayd/gatewayd.yaml when it exists",
    )
    replay.add_argument(
        "--concurrency", type=int, default=None, help="reviews at a time (1-64, default 4)"
    )
    replay.add_argument("--json", action="store_true", help="print the results and summary as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "policy":
        return _policy_check(args.file)
    if args.command == "audit":
        return _audit(args)
    if args.command == "serve":
        return _serve(args)
    if args.command == "run":
        return _run(args)
    if args.command == "exec":
        return _exec(args)
    if args.command == "image":
        return _image_check(args.dir)
    if args.command == "rules":
        return _rules(args)
    if args.command == "review":
        return _review_replay(args)
    return EXIT_USAGE  # pragma: no cover (argparse enforces the choices)


def _policy_check(path: Path) -> int:
    from gatewayd.policy import PolicyError, load_policy, summarize, unmatched_patterns
    from gatewayd.tools import builtin_tools

    try:
        policy = load_policy(path)
    except PolicyError as exc:
        print(f"invalid policy: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(summarize(policy, str(path)))
    # Not an error (a later gatewayd may know the tool), but most likely a typo.
    for pattern in unmatched_patterns(policy.tools.allow, builtin_tools()):
        print(
            f"warning: tools.allow entry {pattern!r} matches no tool this gatewayd has",
            file=sys.stderr,
        )
    return EXIT_OK


def _rules(args: argparse.Namespace) -> int:
    """`gatewayd rules ...`: one request to the control socket, its answer in words."""
    from urllib.parse import quote

    control = args.control_socket or args.state_dir / "control.sock"
    command = args.rules_command
    try:
        if command == "show":
            status, answer = control_request(
                control, "GET", f"/v1/rules?policy={quote(args.policy, safe='')}"
            )
        elif command == "pending":
            status, answer = control_request(control, "GET", "/v1/rules/pending")
        elif command == "confirm":
            target = f"/v1/rules/pending/{args.confirmation_id}/confirm"
            status, answer = control_request(control, "POST", target, {})
        elif command == "cancel":
            target = f"/v1/rules/pending/{args.confirmation_id}"
            status, answer = control_request(control, "DELETE", target)
        else:
            body = {
                "policy": args.policy,
                "action": command.replace("-", "_"),
                "rule": args.rule,
                "addedBy": args.by,
            }
            status, answer = control_request(control, "POST", "/v1/rules", body)
    except OSError as exc:
        print(f"gatewayd rules: cannot reach gatewayd at {control}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if not answer.get("ok"):
        print(
            f"gatewayd rules: {answer.get('errorCode', status)}: {answer.get('message')}",
            file=sys.stderr,
        )
        return EXIT_FAILED
    if "pending" in answer and isinstance(answer["pending"], dict):
        pending = answer["pending"]
        print(
            f"PENDING {pending['confirmationId']}: {pending['change']['action']} "
            f"{pending['change']['rule']!r} waits for confirmation; apply it with "
            f"`gatewayd rules confirm {pending['confirmationId']}`"
        )
    elif "applied" in answer:
        applied = answer["applied"]
        print(f"APPLIED {applied['action']} {applied['rule']!r} to {applied['policy']}")
    elif "pending" in answer:
        for item in answer["pending"]:
            change = item["change"]
            where = change["policy"]
            print(f"{item['confirmationId']}  {change['action']}  {change['rule']!r}  ({where})")
    elif "cancelled" in answer:
        print(f"CANCELLED {answer['cancelled']['action']} {answer['cancelled']['rule']!r}")
    else:
        print(f"policy {answer['policy']} (rule set {answer['ruleset'][:12]})")
        for side in ("allow", "deny"):
            print(f"{side}:")
            for number, text in enumerate(answer[side], 1):
                print(f"  {number}. {text}")
    return EXIT_OK


def _review_replay(args: argparse.Namespace) -> int:
    """`gatewayd review replay`: every recorded call reviewed afresh, a verdict table
    and the summary; EXIT_FAILED on a disagreement or a failed review, so CI can gate a
    rule-set change on it; EXIT_USAGE when the replay cannot start."""
    import shutil
    import time

    import trio

    from gatewayd import model_client
    from gatewayd.daemon import SHIPPED_POLICY_DIR
    from gatewayd.policy import PolicyError
    from gatewayd.review import replay
    from gatewayd.review.ruleset import RuleSet
    from gatewayd.runs import PolicyLoader
    from gatewayd.tools import builtin_tools

    def usage(message: str) -> int:
        print(f"gatewayd review replay: {message}", file=sys.stderr)
        return EXIT_USAGE

    concurrency = replay.DEFAULT_CONCURRENCY if args.concurrency is None else args.concurrency
    if not 1 <= concurrency <= replay.MAX_CONCURRENCY:
        return usage(f"--concurrency must be 1..{replay.MAX_CONCURRENCY}, not {concurrency}")
    policy_dirs = tuple(args.policy_dir) or (SHIPPED_POLICY_DIR, SHIPPED_POLICY_DIR / "examples")
    try:
        policy, policy_source = PolicyLoader(policy_dirs)(args.policy)
    except PolicyError as exc:
        return usage(f"invalid policy:\n{exc}")
    section = policy.review
    if section.mode != "llm":
        return usage(
            f"policy {policy.name} ({policy_source}) has review.mode {section.mode}; "
            "a replay evaluates a policy with review.mode: llm and a review.model"
        )
    try:
        settings = load_settings(args.config)
    except SystemExit as exc:  # a named configuration that is missing or invalid
        return usage(str(exc.code).removeprefix("gatewayd: "))
    alias = settings.models.get(section.model or "")
    if alias is None:
        known = ", ".join(sorted(settings.models)) or "none"
        return usage(
            f"policy {policy.name} reviews with model alias {section.model!r}, which "
            f"gatewayd's configuration does not define (known: {known}); give --config"
        )
    if alias.api_key_env is not None:
        from gatewayd.secrets import SecretError, read_secret

        try:  # where the daemon looks: the variable, then the systemd credential
            read_secret(alias.api_key_env, holds="its key")
        except SecretError as exc:
            return usage(f"model alias {section.model!r} has no key here: {exc}")
    try:
        calls = replay.load_calls(args.calls, tools=builtin_tools())
    except replay.CallsFileError as exc:
        return usage(f"refused the calls file (nothing was reviewed):\n{exc}")

    def progress(done: int, total: int) -> None:
        if total > replay.PROGRESS_EVERY and (done % replay.PROGRESS_EVERY == 0 or done == total):
            print(f"gatewayd review replay: {done}/{total} reviewed", file=sys.stderr)

    reviewer = replay.replay_reviewer(settings.models)
    # litellm's import takes seconds: paid before the clock starts, not counted as replay.
    model_client.preload()
    started = time.monotonic()
    results = trio.run(
        lambda: replay.replay_calls(
            calls, reviewer, section, concurrency=concurrency, on_progress=progress
        )
    )
    elapsed_s = time.monotonic() - started
    summary = replay.summarize_results(results)
    try:
        if args.json:
            document = {
                "policy": policy.name,
                "policySource": policy_source,
                "ruleset": RuleSet.from_section(section).digest,
                "model": section.model,
                "concurrency": concurrency,
                "elapsedS": round(elapsed_s, 3),
                "results": [replay.result_json(r) for r in results],
                "summary": replay.summary_json(summary),
            }
            print(json.dumps(document, indent=2))
        else:
            width = shutil.get_terminal_size((120, 24)).columns
            print(replay.render_table(results, width))
            print()
            print(
                f"policy {policy.name} ({policy_source}), model alias {section.model!r}, "
                f"{elapsed_s:.1f} s at concurrency {concurrency}"
            )
            print(replay.render_summary(summary))
    except BrokenPipeError:  # `... | head`: the reader has enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_OK if summary.passed else EXIT_FAILED


def _image_check(path: Path) -> int:
    from gatewayd.sandbox.image import check_image

    report = check_image(path)  # as given: a relative path gets its own message
    print(report.render())
    return EXIT_OK if report.ok else EXIT_FAILED


def _audit(args: argparse.Namespace) -> int:
    from gatewayd.audit import format_table, read_entries, verify_file

    if not args.file.is_file():
        print(f"gatewayd: no audit log at {args.file}", file=sys.stderr)
        return EXIT_FAILED
    if args.audit_command == "verify":
        report = verify_file(args.file)
        print(report.render())
        return EXIT_OK if report.ok else EXIT_FAILED
    try:
        print(format_table(read_entries(args.file), run_id=args.run, denied_only=args.denied))
    except BrokenPipeError:  # `gatewayd audit show … | head`: the reader has enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_OK


def _config(args: argparse.Namespace) -> DaemonConfig:
    from gatewayd.daemon import SHIPPED_POLICY_DIR, DaemonConfig
    from gatewayd.protocol import DEFAULT_MAX_FRAME_BYTES
    from gatewayd.sandbox.uids import UidRange

    policy_dirs = tuple(args.policy_dir) or (SHIPPED_POLICY_DIR, SHIPPED_POLICY_DIR / "examples")
    try:
        uids = UidRange(*args.sandbox_uids) if args.sandbox_uids else UidRange()
    except ValueError as exc:
        raise SystemExit(f"gatewayd: --sandbox-uids: {exc}") from None
    settings = load_settings(args.config)
    return DaemonConfig(
        models=settings.models,
        secret_env=settings.secret_env,
        state_dir=args.state_dir.absolute(),
        audit_path=args.audit.absolute() if args.audit else None,
        policy_dirs=policy_dirs,
        max_frame_bytes=args.max_frame_bytes or DEFAULT_MAX_FRAME_BYTES,
        os_sandbox=not args.no_os_sandbox,
        netns_prefix=args.netns_prefix,
        sandbox_uids=uids,
    )


def _log_scrubber(config: DaemonConfig) -> Scrubber:
    """The log's own scrubber of the daemon's secrets (the daemon's warns for both)."""
    from gatewayd.secrets import Scrubber

    return Scrubber.for_config(config.models, config.secret_env, warn=False)


def load_settings(path: Path | None) -> GatewaydConfig:
    """gatewayd's configuration: ``path``, else $GATEWAYD_CONFIG, else the default file
    when it exists, else an empty configuration. A named file that is missing or invalid
    ends the command with the problems listed."""
    from gatewayd.config import DEFAULT_CONFIG_PATH, ConfigError, GatewaydConfig, load_config

    named = path or (
        Path(os.environ["GATEWAYD_CONFIG"]) if os.environ.get("GATEWAYD_CONFIG") else None
    )
    if named is None:
        if not DEFAULT_CONFIG_PATH.exists():
            return GatewaydConfig()
        named = DEFAULT_CONFIG_PATH
    try:
        return load_config(named)
    except ConfigError as exc:
        raise SystemExit(f"gatewayd: bad configuration: {exc}") from None


def _serve(args: argparse.Namespace) -> int:
    import trio

    from gatewayd.control import ControlServer
    from gatewayd.daemon import open_daemon
    from gatewayd.logs import configure_logging
    from gatewayd.sdnotify import notify

    config = _config(args)
    configure_logging(logging.INFO, scrubber=_log_scrubber(config))
    control_path = args.control_socket or config.state_dir / "control.sock"

    async def serve() -> None:
        async with open_daemon(config) as daemon, trio.open_nursery() as nursery:
            await nursery.start(ControlServer(daemon).serve, control_path)
            print(f"gatewayd: serving; control socket {control_path}", file=sys.stderr)
            notify(f"READY=1\nSTATUS=serving; control socket {control_path}")
            stops = (signal.SIGTERM, signal.SIGINT)
            with trio.open_signal_receiver(*stops, signal.SIGHUP) as signals:
                async for signum in signals:
                    if signum in stops:
                        break
                    notify("RELOADING=1\nSTATUS=reloading policies and configuration")
                    await _reload(daemon, args)
                    notify(f"READY=1\nSTATUS=serving; control socket {control_path}")
            notify("STOPPING=1\nSTATUS=stopping: ending every run")
            nursery.cancel_scope.cancel()

    trio.run(serve)
    return EXIT_OK


async def _reload(daemon: Daemon, args: argparse.Namespace) -> None:
    """SIGHUP: re-read gatewayd's configuration and every live run's policy. A bad file
    changes nothing (logged and audited); live runs and their connections go on."""
    import structlog

    log = structlog.get_logger("gatewayd.reload")
    try:
        config = _config(args)
    except SystemExit as exc:  # _config's way of saying the file is bad
        log.error("config_reload_failed", error=str(exc.code))
        await daemon.audit.append(
            "event", event="config_reload_failed", safeMessage=str(exc.code)[:500]
        )
    else:
        await daemon.reload_config(config)
    outcomes = await daemon.reload_policies()
    log.info("reloaded", runs=len(outcomes), outcomes=outcomes)


def _run_request(args: argparse.Namespace) -> RunRequest:
    import pydantic

    from gatewayd.runs import Grant, RunLimits, RunRequest, format_validation_error

    if args.spec is not None:
        try:
            return RunRequest.model_validate(json.loads(args.spec.read_text()))
        except (OSError, ValueError) as exc:
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
        workspacePath=str(args.workspace.resolve()),
        policy=args.policy,
        actorId=args.actor,
        tenantId=args.tenant,
        grant=Grant(allowSandbox=True),
        toolIds=tuple(args.tools) if args.tools else None,
        limits=RunLimits(maxRuntimeSec=args.max_runtime)
        if args.max_runtime is not None
        else RunLimits(),
        sandboxImage=str(args.image.absolute()) if args.image else None,
    )


def child_environment(run: Run) -> dict[str, str]:
    """The environment of a run's command: an allowlist plus the two COGNI_ variables.

    The directory of this interpreter goes first on PATH so ``cogni-tool`` is found.
    """
    env = {k: v for k, v in os.environ.items() if k in ENV_ALLOWLIST}
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "/usr/local/bin:/usr/bin:/bin")
    env["COGNI_GATEWAY_SOCK"] = str(run.socket_path)
    env["COGNI_RUN_ID"] = run.run_id
    return env


def _run(args: argparse.Namespace) -> int:
    import trio

    from gatewayd.daemon import open_daemon
    from gatewayd.errors import GatewayError
    from gatewayd.logs import configure_logging
    from gatewayd.policy import PolicyError

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("gatewayd run: give the command after --, e.g. -- python3 agent.py", file=sys.stderr)
        return EXIT_USAGE
    request = _run_request(args)
    config = _config(args)
    configure_logging(logging.WARNING, scrubber=_log_scrubber(config))
    status = EXIT_FAILED

    async def one_shot() -> None:
        nonlocal status
        async with open_daemon(config) as daemon:
            try:
                run = await daemon.start_run(request)
            except GatewayError as exc:  # no grant, no sandbox, a workspace out of reach
                print(f"gatewayd: {exc.code}: {exc}", file=sys.stderr)
                return
            except (PolicyError, ValueError) as exc:
                print(f"gatewayd: run refused: {exc}", file=sys.stderr)
                return
            print(
                f"gatewayd: run {run.run_id} started (policy {run.spec.policy.name})",
                file=sys.stderr,
            )
            max_runtime = run.spec.request.limits.maxRuntimeSec
            if run.sandbox is not None:
                status = await _run_in_sandbox(daemon, run, cmd, max_runtime)
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
                event="exec_started",
                runId=run.run_id,
                detail={"command": cmd[:64], "timeoutS": max_runtime},
                degraded=run.degraded,
            )
            # Cancelling run_process stops the command (SIGTERM, then SIGKILL).
            with trio.move_on_after(max_runtime) as scope:
                proc = await trio.run_process(
                    cmd,
                    cwd=str(run.spec.workspace),
                    env=child_environment(run),
                    check=False,
                    start_new_session=True,
                )
            if scope.cancelled_caught:
                print(
                    f"gatewayd: run {run.run_id} exceeded its {max_runtime} s "
                    "(maxRuntimeSec); its command was stopped",
                    file=sys.stderr,
                )
                rc, status = -1, EXIT_MAX_RUNTIME
            else:
                rc = proc.returncode
                status = SIGNAL_EXIT_BASE - rc if rc < 0 else rc
            daemon.audit.record(
                "event",
                event="exec_ended",
                runId=run.run_id,
                detail={
                    "exitCode": rc if rc >= 0 else None,
                    "signal": -rc if rc < 0 and not scope.cancelled_caught else None,
                    "errorCode": "timeout" if scope.cancelled_caught else None,
                },
                degraded=run.degraded,
            )
            await _end_one_shot(daemon, run, f"exit {rc}")

    trio.run(one_shot)
    return status


async def _end_one_shot(daemon: Daemon, run: Run, outcome: str) -> None:
    # The run may already have ended (maxRuntimeSec); its counters stay on it.
    await daemon.end_run(run.run_id, reason="command_exited")
    by_code = ", ".join(f"{k}: {v}" for k, v in sorted(run.denied_by_code.items()))
    print(
        f"gatewayd: run {run.run_id} ended: {outcome}; {run.calls} calls, "
        f"{run.allowed} allowed, {run.denied} denied" + (f" ({by_code})" if by_code else ""),
        file=sys.stderr,
    )
    print(f"gatewayd: audit log {daemon.config.resolved_audit_path}", file=sys.stderr)


async def _run_in_sandbox(daemon: Daemon, run: Run, cmd: list[str], max_runtime: int) -> int:
    """The one-shot run's command, in the run's sandbox; returns gatewayd's exit status."""
    from gatewayd.errors import GatewayError

    sys.stdout.flush()
    sys.stderr.flush()
    # The command's output is shown as it comes (all of it; the result keeps the cap).
    echo = (_writer(sys.stdout.fileno()), _writer(sys.stderr.fileno()))
    try:
        result = await daemon.exec_in_run(run.run_id, cmd, timeout_s=max_runtime, echo=echo)
    except GatewayError as exc:
        print(f"gatewayd: the sandbox could not start: {exc}", file=sys.stderr)
        await _end_one_shot(daemon, run, "not started")
        return EXIT_FAILED
    status = _exec_status(result.exitCode, result.signal, _str_or_none(result.errorCode))
    outcome = _describe_exec(result.exitCode, result.signal, _str_or_none(result.errorCode))
    await _end_one_shot(daemon, run, outcome)
    return status


def _str_or_none(value: object) -> str | None:
    return None if value is None else str(value)


def _writer(fd: int) -> Callable[[bytes], None]:
    def write(data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]

    return write


def _write_output(stdout: bytes, stderr: bytes) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    _writer(sys.stdout.fileno())(stdout)
    _writer(sys.stderr.fileno())(stderr)


def _exec_status(exit_code: int | None, sig: int | None, error: str | None) -> int:
    """gatewayd's exit status for a sandboxed command: its own, 128+N for a signal,
    124 when it ran out of time (like timeout(1))."""
    if error == "timeout":
        return EXIT_MAX_RUNTIME
    if sig is not None:
        return SIGNAL_EXIT_BASE + sig
    return exit_code if exit_code is not None else EXIT_FAILED


def _describe_exec(exit_code: int | None, sig: int | None, error: str | None) -> str:
    what = f"signal {sig}" if sig is not None else f"exit {exit_code}"
    return f"{what} ({error})" if error else what


def _exec(args: argparse.Namespace) -> int:
    """`gatewayd exec RUN -- CMD`: POST the command to the control socket, print its
    output, exit with its status."""
    import base64

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("gatewayd exec: give the command after --, e.g. RUN -- make test", file=sys.stderr)
        return EXIT_USAGE
    body: dict[str, object] = {"command": cmd}
    if args.timeout is not None:
        body["timeoutSec"] = args.timeout
    if args.stdin:
        body["stdin"] = sys.stdin.buffer.read().decode("utf-8", errors="replace")
    control = args.control_socket or args.state_dir / "control.sock"
    try:
        status, payload = control_request(control, "POST", f"/v1/runs/{args.run_id}/exec", body)
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
        data = base64.b64decode(text) if result[f"{name}Encoding"] == "base64" else text.encode()
        streams.append(data)
    _write_output(streams[0], streams[1])
    for name in ("stdout", "stderr"):
        if result[f"{name}Truncated"]:
            print(f"gatewayd exec: {name} was cut at the run's output limit", file=sys.stderr)
    if result["errorCode"]:
        print(
            "gatewayd exec: "
            + _describe_exec(result["exitCode"], result["signal"], result["errorCode"]),
            file=sys.stderr,
        )
    return _exec_status(result["exitCode"], result["signal"], result["errorCode"])


def control_request(
    path: Path, method: str, target: str, body: object | None = None
) -> tuple[int, dict[str, Any]]:
    """One JSON request to the control socket at ``path``; (status, decoded body)."""
    import http.client
    import socket

    class UnixConnection(http.client.HTTPConnection):
        def connect(self) -> None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(os.fspath(path))
            self.sock = sock

    conn = UnixConnection("gatewayd")
    try:
        data = None if body is None else json.dumps(body).encode()
        headers = {"content-type": "application/json"} if data is not None else {}
        conn.request(method, target, body=data, headers=headers)
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    try:
        decoded = json.loads(raw)
    except ValueError:
        decoded = {"ok": False, "message": raw.decode(errors="replace")}
    return response.status, decoded if isinstance(decoded, dict) else {"ok": False}


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
