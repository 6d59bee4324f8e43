"""`gatewayd` command line: serve, run, exec, rules, image check, policy check, audit.

Heavy imports (trio, the daemon) happen inside the commands that need them, so
`gatewayd audit verify` and `gatewayd policy check` start fast.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from gatewayd.protocol import MAX_FRAME_BYTES, MIN_FRAME_BYTES

if TYPE_CHECKING:
    from gatewayd.audit.query import EntryFilter
    from gatewayd.config import GatewaydConfig, Settings
    from gatewayd.daemon import Daemon
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
# Like timeout(1): the run's command was stopped because the run ran out of time.
EXIT_MAX_RUNTIME: Final = 124
# A run spec is a few hundred bytes, like the control socket's run request (whose body
# cap this is): anything bigger is not a spec.
MAX_SPEC_BYTES: Final = 1 << 20


def _add_daemon_options(p: argparse.ArgumentParser) -> None:
    # Defaults are None: an option given wins over $GATEWAYD_<NAME> and the file
    # (gatewayd/config.py merges them; `gatewayd config show` says which one won).
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="private state directory (runs, sockets, audit); default: state_dir of the "
        "configuration ($GATEWAYD_STATE_DIR, the file), else /var/lib/gatewayd",
    )
    p.add_argument(
        "--audit",
        type=Path,
        default=None,
        help="audit log (configuration: audit_path; default STATE_DIR/audit/audit.jsonl)",
    )
    p.add_argument(
        "--policy-dir",
        type=Path,
        action="append",
        default=[],
        help="directory searched for policies named without a path (repeatable; replaces "
        "the configuration's policy_dirs)",
    )
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help="gatewayd's configuration file (docs/configuration.md); default $GATEWAYD_CONFIG, "
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
        default=None,
        help="prefix of the runs' network namespaces; no two live daemons on this host may "
        "share one (configuration: netns_prefix; default: cogni-<8 hex> derived from the "
        "state directory)",
    )
    p.add_argument(
        "--sandbox-uids",
        type=_uid_range,
        default=None,
        help="BASE+COUNT: host uids the sandboxes run as, one per live run; no two live "
        "daemons on this host may overlap (configuration: sandbox_uids; default: 1024 uids "
        "placed by the state directory)",
    )
    p.add_argument(
        "--lendable-root",
        type=Path,
        action="append",
        default=[],
        help="a directory beneath which workspaces and rw policy paths may be lent to runs "
        "(repeatable; replaces the configuration's lendable_roots; default /home, /tmp, "
        "/var/tmp); never a system tree",
    )
    p.add_argument(
        "--max-frame-bytes",
        type=_frame_bytes,
        default=None,
        help=f"largest request frame ({MIN_FRAME_BYTES}..{MAX_FRAME_BYTES}; configuration: "
        "max_frame_bytes; default 1 MiB)",
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


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is below 0")
    return value


def _iso_time(text: str) -> str:
    from gatewayd.audit.query import parse_time

    try:
        return parse_time(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_audit_filters(p: argparse.ArgumentParser) -> None:
    """The filters of `gatewayd audit show|export|stats|tail` (gatewayd.audit.query)."""
    p.add_argument("--run", default=None, help="only this run (its id or a prefix of it)")
    p.add_argument("--tool", default=None, help="only this tool (a name or pattern: 'fs.*')")
    p.add_argument(
        "--decision", choices=("allow", "deny"), default=None, help="only calls so decided"
    )
    p.add_argument(
        "--kind", choices=("call", "result", "event"), default=None, help="only this kind"
    )
    p.add_argument("--event", default=None, help="only this event (e.g. run_ended)")
    p.add_argument(
        "--error-code", default=None, help="only this error code (e.g. policy_denied, timeout)"
    )
    p.add_argument(
        "--since",
        type=_iso_time,
        default=None,
        help="only from this time (ISO 8601; UTC by default)",
    )
    p.add_argument("--until", type=_iso_time, default=None, help="only before this time (ISO 8601)")
    p.add_argument("--actor", default=None, help="only runs for this actorId (run_created)")
    p.add_argument("--tenant", default=None, help="only runs for this tenantId (run_created)")
    p.add_argument("--denied", action="store_true", help="only denied or failed entries")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gatewayd", description="The cogni gateway host daemon.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the long-lived daemon with its control socket")
    _add_daemon_options(serve)
    serve.add_argument(
        "--audit-max-bytes",
        type=_count,
        default=None,
        help="rotate the audit log's active file before it grows past this many bytes "
        "(0: never); default: the configuration's audit_max_bytes (64 MiB); docs/audit.md",
    )
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
        default=None,
        help="the daemon's state directory (to find its control socket); default: the "
        "configuration's",
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
        cmd.add_argument("--state-dir", type=Path, default=None)
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

    config = sub.add_parser(
        "config", help="gatewayd's configuration (docs/configuration.md)"
    ).add_subparsers(dest="config_command", required=True)
    config_show = config.add_parser(
        "show",
        help="print the effective configuration (options > $GATEWAYD_<NAME> > file > "
        "defaults) and where each value came from; no secret is printed",
    )
    _add_daemon_options(config_show)
    config_show.add_argument("--control-socket", type=Path, default=None)
    config_show.add_argument("--json", action="store_true", help="as JSON")
    config_check = config.add_parser(
        "check", help="validate a configuration file (exit 0 valid, 1 invalid)"
    )
    config_check.add_argument("file", type=Path)

    policy = sub.add_parser("policy", help="policy files").add_subparsers(
        dest="policy_command", required=True
    )
    check = policy.add_parser("check", help="validate a policy file and summarize it")
    check.add_argument("file", type=Path)

    audit = sub.add_parser(
        "audit", help="read the audit log (the active file and its closed segments)"
    ).add_subparsers(dest="audit_command", required=True)
    log_help = "the log's active file (e.g. audit.jsonl); its segments FILE.NNNNNN are read too"
    verify = audit.add_parser(
        "verify",
        help="check the hash chain across every segment; exit 0 intact, 1 broken or a "
        "segment missing, 3 intact but the oldest segments are gone",
    )
    verify.add_argument("file", type=Path, help=log_help)
    show = audit.add_parser("show", help="print the audit log as a table")
    _add_audit_filters(show)
    show.add_argument("file", type=Path, help=log_help)
    export = audit.add_parser("export", help="print the chosen entries as JSON lines or CSV")
    export.add_argument(
        "--format",
        choices=("jsonl", "csv"),
        default="jsonl",
        help="jsonl: the lines as written (hashes included); csv: fixed columns (docs/audit.md)",
    )
    _add_audit_filters(export)
    export.add_argument("file", type=Path, help=log_help)
    stats = audit.add_parser(
        "stats", help="calls, denials by error code, top tools, per-run counts and durations"
    )
    stats.add_argument("--json", action="store_true", help="print the figures as JSON")
    stats.add_argument("--top", type=_count, default=10, help="how many tools to list (default 10)")
    _add_audit_filters(stats)
    stats.add_argument("file", type=Path, help=log_help)
    tail = audit.add_parser(
        "tail", help="print the last entries; with -f, follow new ones (across rotations)"
    )
    tail.add_argument("-f", "--follow", action="store_true", help="keep printing new entries")
    tail.add_argument(
        "-n", "--lines", type=_count, default=10, help="start with the last N lines (default 10)"
    )
    tail.add_argument("--json", action="store_true", help="print the lines as written")
    _add_audit_filters(tail)
    tail.add_argument("file", type=Path, help=log_help)
    result = audit.add_parser(
        "run",
        help="a run's result bundle as JSON: ok, logs, auditLog, errorCode (reference "
        "note 004's SandboxRunResult), from the audit log alone",
    )
    result.add_argument("run_id", metavar="RUN", help="the run id, or a unique prefix of it")
    result.add_argument("file", type=Path, help=log_help)

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

    from gatewayd.agent import cli as agent_cli

    agent_cli.add_parser(sub, _add_daemon_options)

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
    if args.command == "config":
        return _config_command(args)
    if args.command == "audit":
        return _audit(args)
    if args.command == "serve":
        return _refusing(_serve, args)
    if args.command == "run":
        return _refusing(_run, args)
    if args.command == "exec":
        return _exec(args)
    if args.command == "image":
        return _image_check(args.dir)
    if args.command == "rules":
        return _rules(args)
    if args.command == "install-systemd":
        return _install_systemd(args)
    if args.command == "review":
        return _review_replay(args)
    if args.command == "agent":
        from gatewayd.agent import cli as agent_cli

        return _refusing(agent_cli.main, args)
    return EXIT_USAGE  # pragma: no cover (argparse enforces the choices)


def _refusing(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a command that starts a daemon; a refused start (another daemon on this host
    holds what this one would use, the host's registry of daemons cannot be used, the
    audit log cannot be continued, or the control socket's path is taken) is its message
    and EXIT_FAILED, not a traceback."""
    from gatewayd.audit.writer import AuditOpenError
    from gatewayd.control import ControlSocketInUse
    from gatewayd.sandbox.daemons import DaemonRegistryError

    refusals = (DaemonRegistryError, AuditOpenError, ControlSocketInUse)
    try:
        return command(args)
    except refusals as exc:
        # AuditOpenError: the audit log is another daemon's (locked) or cannot be continued.
        print(f"gatewayd: refused to start: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except BaseExceptionGroup as group:
        # Raised inside the daemon's nursery (a control socket path something else
        # holds, ControlServer.serve): a refusal still, if that is all the group holds.
        refused, rest = group.split(refusals)
        if refused is None or rest is not None:
            raise
        first: BaseException = refused
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        print(f"gatewayd: refused to start: {first}", file=sys.stderr)
        return EXIT_FAILED


def _policy_check(path: Path) -> int:
    from gatewayd.policy import PolicyError, summarize, unmatched_patterns
    from gatewayd.policyfile import load_policy
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

    control = _control_socket(args)
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
    from gatewayd.config import SHIPPED_POLICY_DIRS
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
    policy_dirs = tuple(args.policy_dir) or SHIPPED_POLICY_DIRS
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
    """`gatewayd audit verify|show|export|stats|tail|run` over every segment of a log."""
    from gatewayd.audit.segments import log_files

    if args.audit_command == "tail":
        if not args.follow and not log_files(args.file):
            return _no_audit_log(args.file)
        return _audit_tail(args)
    if not log_files(args.file):
        return _no_audit_log(args.file)
    try:
        return _AUDIT_COMMANDS[args.audit_command](args)
    except BrokenPipeError:  # `gatewayd audit show … | head`: the reader has enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except OSError as exc:
        return _unreadable_audit_log(args.file, exc)


# `gatewayd audit verify`: intact, but its oldest segments are gone (deleted for
# retention?): neither OK (0) nor broken (1), so a script must decide.
EXIT_PARTIAL: Final = 3


def _no_audit_log(path: Path) -> int:
    print(
        f"gatewayd: no audit log at {path} (no such file, and no closed segment "
        f"{path.name}.NNNNNN beside it)",
        file=sys.stderr,
    )
    return EXIT_FAILED


def _unreadable_audit_log(path: Path, exc: OSError) -> int:
    where = exc.filename or path
    print(f"gatewayd: cannot read the audit log {where}: {exc.strerror or exc}", file=sys.stderr)
    return EXIT_FAILED


def _audit_filter(args: argparse.Namespace) -> EntryFilter:
    from gatewayd.audit.query import EntryFilter

    return EntryFilter(
        run=args.run,
        tool=args.tool,
        decision=args.decision,
        kind=args.kind,
        event=args.event,
        error_code=args.error_code,
        since=args.since,
        until=args.until,
        actor=args.actor,
        tenant=args.tenant,
        denied=args.denied,
    )


def _audit_verify(args: argparse.Namespace) -> int:
    from gatewayd.audit import verify_file

    report = verify_file(args.file)
    print(report.render())
    if not report.ok:
        return EXIT_FAILED
    return EXIT_PARTIAL if report.partial_from is not None else EXIT_OK


def _audit_show(args: argparse.Namespace) -> int:
    from gatewayd.audit import format_table
    from gatewayd.audit.query import read_log, run_index

    where = _audit_filter(args)
    runs = run_index(read_log(args.file)) if where.needs_runs else {}
    entries = (record.as_dict() for record in read_log(args.file))
    print(format_table(entries, keep=lambda entry: where.keeps(entry, runs)))
    return EXIT_OK


def _audit_export(args: argparse.Namespace) -> int:
    from gatewayd.audit.export import write_csv, write_jsonl
    from gatewayd.audit.query import select

    write = write_csv if args.format == "csv" else write_jsonl
    write(select(args.file, _audit_filter(args)), sys.stdout)
    sys.stdout.flush()
    return EXIT_OK


def _audit_stats(args: argparse.Namespace) -> int:
    from gatewayd.audit.query import read_log, run_index, select
    from gatewayd.audit.report import render_stats, stats

    runs = run_index(read_log(args.file))
    entries = (record.as_dict() for record in select(args.file, _audit_filter(args)))
    figures = stats(entries, runs, top=args.top)
    print(json.dumps(figures, indent=2) if args.json else render_stats(figures))
    return EXIT_OK


def _audit_run(args: argparse.Namespace) -> int:
    from gatewayd.audit.query import read_log
    from gatewayd.audit.report import run_result

    wanted: str = args.run_id
    found: set[str] = set()
    for record in read_log(args.file):
        run = record.entry.get("runId") if record.entry is not None else None
        if isinstance(run, str) and wanted and run.startswith(wanted):
            found.add(run)
    if wanted not in found and len(found) != 1:
        if found:
            listed = ", ".join(sorted(found)[:5]) + ("…" if len(found) > 5 else "")
            why = f"{len(found)} runs start with {wanted!r} ({listed}); give more of the id"
        else:
            why = f"no run {wanted!r} in it (`gatewayd audit stats {args.file}` lists the runs)"
        print(f"gatewayd: audit log {args.file}: {why}", file=sys.stderr)
        return EXIT_FAILED
    run_id = wanted if wanted in found else found.pop()
    entries = (
        record.entry
        for record in read_log(args.file)
        if record.entry is not None and record.entry.get("runId") == run_id
    )
    print(json.dumps(run_result(run_id, entries), indent=2))
    return EXIT_OK


def _audit_tail(args: argparse.Namespace) -> int:
    import time

    from gatewayd.audit.follow import POLL_INTERVAL_S, Follower
    from gatewayd.audit.query import Record, read_log, run_index
    from gatewayd.audit.segments import log_files
    from gatewayd.audit.show import format_row, table_header

    where = _audit_filter(args)
    runs = run_index(read_log(args.file)) if where.needs_runs and log_files(args.file) else {}

    def emit(records: list[Record]) -> None:
        for record in records:
            entry = record.entry
            if entry is not None and where.needs_runs:
                runs.update(run_index([record]))  # runs created since the index was made
            if entry is not None and not where.keeps(entry, runs):
                continue
            if not args.json:
                print(format_row(record.as_dict()))
            elif entry is not None:
                print(record.raw.decode("utf-8", "replace"))
            else:
                print(json.dumps(record.as_dict()))
        sys.stdout.flush()

    follower = Follower(args.file)
    try:
        if not args.json:
            print(table_header())
        emit(follower.last(args.lines))
        while args.follow:
            time.sleep(POLL_INTERVAL_S)
            emit(follower.poll())
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except OSError as exc:
        return _unreadable_audit_log(args.file, exc)
    finally:
        follower.close()
    return EXIT_OK


_AUDIT_COMMANDS: Final[dict[str, Callable[[argparse.Namespace], int]]] = {
    "verify": _audit_verify,
    "show": _audit_show,
    "export": _audit_export,
    "stats": _audit_stats,
    "run": _audit_run,
}


# Command-line options that set a configuration setting: (option, setting, how to read it).
_SETTING_OPTIONS: Final = (
    ("--state-dir", "state_dir", lambda v: v.absolute()),
    ("--audit", "audit_path", lambda v: v.absolute()),
    ("--control-socket", "control_socket", lambda v: v.absolute()),
    ("--policy-dir", "policy_dirs", lambda v: tuple(p.absolute() for p in v) or None),
    ("--max-frame-bytes", "max_frame_bytes", lambda v: v),
    ("--audit-max-bytes", "audit_max_bytes", lambda v: v),
    ("--netns-prefix", "netns_prefix", lambda v: v),
    ("--sandbox-uids", "sandbox_uids", lambda v: {"base": v[0], "count": v[1]}),
    # Normalized: a relative root is taken from the current directory, ".." included.
    (
        "--lendable-root",
        "lendable_roots",
        lambda v: tuple(Path(os.path.abspath(p)) for p in v) or None,
    ),
    ("--no-os-sandbox", "os_sandbox", lambda v: False if v else None),
)


def _settings(args: argparse.Namespace, *, warn: bool = True) -> Settings:
    """The effective configuration: this command's options over $GATEWAYD_<NAME>
    variables over the file over the defaults. A bad value anywhere ends the command
    with every problem listed, each under the option, variable or file it came from."""
    from gatewayd.config import ConfigError, config_file, resolve_settings

    options: dict[str, tuple[str, Any]] = {}
    for option, setting, read in _SETTING_OPTIONS:
        given = getattr(args, option.removeprefix("--").replace("-", "_"), None)
        value = read(given) if given is not None else None
        if value is not None:
            options[setting] = (option, value)
    try:
        settings = resolve_settings(
            file=config_file(getattr(args, "config", None), os.environ),
            environ=os.environ,
            options=options,
        )
    except ConfigError as exc:
        raise SystemExit(f"gatewayd: bad configuration: {exc}") from None
    for note in settings.unknown_env if warn else ():
        print(f"gatewayd: warning: {note}", file=sys.stderr)
    return settings


def _config(args: argparse.Namespace) -> GatewaydConfig:
    """The configuration the daemon is built from: :func:`_settings`' effective one."""
    return _settings(args).config


def _control_socket(args: argparse.Namespace) -> Path:
    """``--control-socket``, else the configuration's (STATE_DIR/control.sock)."""
    if args.control_socket is not None:
        return Path(args.control_socket)
    return _settings(args, warn=False).config.resolved_control_socket


def _log_scrubber(config: GatewaydConfig) -> Scrubber:
    """The log's own scrubber of the daemon's secrets (the daemon's warns for both)."""
    from gatewayd.secrets import Scrubber

    return Scrubber.for_config(config.models, config.secret_env, warn=False)


def load_settings(path: Path | None) -> GatewaydConfig:
    """gatewayd's configuration without command-line options: ``path``, else
    $GATEWAYD_CONFIG, else the default file when it exists, with $GATEWAYD_<NAME>
    variables over it. A file that is missing or invalid, or a bad variable, ends the
    command with the problems listed."""
    from gatewayd.config import ConfigError, config_file, resolve_settings

    try:
        return resolve_settings(file=config_file(path, os.environ), environ=os.environ).config
    except ConfigError as exc:
        raise SystemExit(f"gatewayd: bad configuration: {exc}") from None


def _config_command(args: argparse.Namespace) -> int:
    """`gatewayd config show|check`."""
    from gatewayd.config import ConfigError, GatewaydConfig, load_config, shown_values

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
    settings = _settings(args)
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


def _serve(args: argparse.Namespace) -> int:
    import structlog
    import trio

    from gatewayd.control import ControlServer
    from gatewayd.daemon import open_daemon
    from gatewayd.logs import configure_logging
    from gatewayd.sdnotify import notify

    config = _config(args)
    control_path = config.resolved_control_socket
    # JSON lines on stdout: journald's under systemd (docs/metrics.md, "Logs").
    configure_logging(logging.INFO, scrubber=_log_scrubber(config), stream=sys.stdout)

    async def serve() -> None:
        # Registered with the daemon: a second daemon that would bind it (or a file of this
        # one's audit log) is refused before it touches anything.
        async with (
            open_daemon(config, control_socket=control_path) as daemon,
            trio.open_nursery() as nursery,
        ):
            await nursery.start(ControlServer(daemon).serve, control_path)
            structlog.get_logger("gatewayd.serve").info(
                "serving", control_socket=str(control_path), state_dir=str(config.state_dir)
            )
            stops = (signal.SIGTERM, signal.SIGINT)
            with trio.open_signal_receiver(*stops, signal.SIGHUP) as signals:
                # Ready only once a stop or reload signal is ours to handle.
                notify(f"READY=1\nSTATUS=serving; control socket {control_path}")
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


def _install_systemd(args: argparse.Namespace) -> int:
    from gatewayd.install import InstallError, install_systemd

    try:
        done = install_systemd(args.root, force=args.force)
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


async def _reload(daemon: Daemon, args: argparse.Namespace) -> None:
    """SIGHUP: re-read gatewayd's configuration and every live run's policy. A bad file
    changes nothing (logged and audited); live runs and their connections go on."""
    import structlog

    from gatewayd.audit import AuditEvent

    log = structlog.get_logger("gatewayd.reload")
    try:
        config = _config(args)
    except SystemExit as exc:  # _config's way of saying the file is bad
        log.error("config_reload_failed", error=str(exc.code))
        await daemon.audit.append(
            "event", event=AuditEvent.CONFIG_RELOAD_FAILED, safeMessage=str(exc.code)[:500]
        )
    else:
        await daemon.reload_config(config)
    outcomes = await daemon.reload_policies()
    log.info("reloaded", runs=len(outcomes), outcomes=outcomes)


def _run_request(args: argparse.Namespace) -> RunRequest:
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

    from gatewayd.audit import AuditEvent, AuditWriteError
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
                run = await daemon.start_run(request, policy_paths=True)
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
                event=AuditEvent.EXEC_STARTED,
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
                await daemon.durable_before_answer(seq)
            except AuditWriteError as exc:
                print(_exec_end_not_audited(exc.detail), file=sys.stderr)
                status = EXIT_FAILED
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
    from gatewayd.audit import AuditWriteError
    from gatewayd.errors import GatewayError

    sys.stdout.flush()
    sys.stderr.flush()
    # The command's output is shown as it comes (all of it; the result keeps the cap).
    echo = (_writer(sys.stdout.fileno()), _writer(sys.stderr.fileno()))
    try:
        result = await daemon.exec_in_run(run.run_id, cmd, timeout_s=max_runtime, echo=echo)
    except AuditWriteError as exc:
        print(_exec_end_not_audited(exc.detail), file=sys.stderr)
        await _end_one_shot(daemon, run, "its end not audited")
        return EXIT_FAILED
    except GatewayError as exc:
        print(f"gatewayd: the sandbox could not start: {exc}", file=sys.stderr)
        await _end_one_shot(daemon, run, "not started")
        return EXIT_FAILED
    status = _exec_status(result.exitCode, result.signal, _str_or_none(result.errorCode))
    outcome = _describe_exec(result.exitCode, result.signal, _str_or_none(result.errorCode))
    await _end_one_shot(daemon, run, outcome)
    return status


def _exec_end_not_audited(detail: str) -> str:
    """`gatewayd run`'s word when its command's end cannot be made durable: the
    command's exit status is not passed on (EXIT_FAILED instead), as a call's value is
    withheld."""
    return (
        f"gatewayd: the audit log cannot be written ({detail}), so the command's exit "
        f"status is not passed on (exit {EXIT_FAILED}); fix the audit log"
    )


def _str_or_none(value: object) -> str | None:
    return None if value is None else str(value)


def _writer(fd: int) -> Callable[[bytes], None]:
    from gatewayd.files import write_all

    return functools.partial(write_all, fd)


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
    control = _control_socket(args)
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
