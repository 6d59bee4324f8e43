"""`gatewayd audit verify|show|export|stats|tail|run`: reading the audit log, the active
file and its closed segments."""

from __future__ import annotations

import argparse
import json
import os
import sys

from gatewayd.cli import audit_tree, audit_witness
from gatewayd.cli.command import EXIT_FAILED, EXIT_OK
from gatewayd.cli.options import whole_number

# typing's flag without importing typing: client commands start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, Final

    from gatewayd.audit.query import EntryFilter
    from gatewayd.cli.command import Subparsers


_LOG_HELP: Final = "the log's active file (e.g. audit.jsonl); its segments FILE.NNNNNN are read too"


class _LaterArguments(argparse.ArgumentParser):
    """A parser whose arguments are added when it first parses (``build``): `gatewayd
    audit verify` adds the options of one command, not its ten siblings' hundred (about
    a tenth of the command's start). Help lists every command as before: argparse lists
    them by the names and help lines given to ``add_parser``."""

    def __init__(
        self,
        *args: Any,
        build: Callable[[argparse.ArgumentParser], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.build = build

    @property
    def built(self) -> bool:
        """Whether its arguments are added (it parsed once, or never had any to add)."""
        return self.build is None

    def parse_known_args(  # type: ignore[override]
        self, args: Any = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        # argparse parses a subcommand's words with its parser's parse_known_args.
        if self.build is not None:
            build, self.build = self.build, None
            build(self)
        return super().parse_known_args(args, namespace)


def _later_arguments(parent: argparse.ArgumentParser) -> type[argparse.ArgumentParser]:
    """The class of the audit commands' parsers: :class:`_LaterArguments` over the
    parent's class (gatewayd's, which reports an error as the whole command line's)."""
    return type("AuditCommandParser", (_LaterArguments, type(parent)), {})


def add_parsers(sub: Subparsers) -> None:
    parser = sub.add_parser(
        "audit", help="read the audit log (the active file and its closed segments)"
    )
    audit = parser.add_subparsers(
        dest="audit_command", required=True, parser_class=_later_arguments(parser)
    )
    commands: list[tuple[str, str, Callable[[argparse.ArgumentParser], None]]] = [
        (
            "verify",
            "check the hash chain across every segment; exit 0 intact, 1 broken or a "
            "segment missing, 3 intact but the oldest segments are gone",
            _verify_options,
        ),
        ("show", "print the audit log as a table", _show_options),
        ("export", "print the chosen entries as JSON lines or CSV", _export_options),
        (
            "stats",
            "calls, denials by error code, top tools, per-run counts and durations",
            _stats_options,
        ),
        (
            "tail",
            "print the last entries; with -f, follow new ones (across rotations)",
            _tail_options,
        ),
        (
            "run",
            "a run's result bundle as JSON: ok, logs, auditLog, errorCode (the shape of "
            "an agent run's result), from the audit log alone",
            _run_options,
        ),
        *audit_tree.subcommands(_LOG_HELP),
    ]
    for name, help_line, build in commands:
        audit.add_parser(name, help=help_line, build=build)


def _verify_options(verify: argparse.ArgumentParser) -> None:
    audit_tree.add_verify_options(verify)
    audit_witness.add_verify_options(verify)
    verify.add_argument("file", help=_LOG_HELP)


def _show_options(show: argparse.ArgumentParser) -> None:
    _add_audit_filters(show)
    show.add_argument("file", help=_LOG_HELP)


def _export_options(export: argparse.ArgumentParser) -> None:
    export.add_argument(
        "--format",
        choices=("jsonl", "csv"),
        default="jsonl",
        help="jsonl: the lines as written (hashes included); csv: fixed columns (docs/audit.md)",
    )
    _add_audit_filters(export)
    export.add_argument("file", help=_LOG_HELP)


def _stats_options(stats: argparse.ArgumentParser) -> None:
    stats.add_argument("--json", action="store_true", help="print the figures as JSON")
    stats.add_argument(
        "--top", type=whole_number, default=10, help="how many tools to list (default 10)"
    )
    _add_audit_filters(stats)
    stats.add_argument("file", help=_LOG_HELP)


def _tail_options(tail: argparse.ArgumentParser) -> None:
    tail.add_argument("-f", "--follow", action="store_true", help="keep printing new entries")
    tail.add_argument(
        "-n",
        "--lines",
        type=whole_number,
        default=10,
        help="start with the last N lines (default 10)",
    )
    tail.add_argument("--json", action="store_true", help="print the lines as written")
    _add_audit_filters(tail)
    tail.add_argument("file", help=_LOG_HELP)


def _run_options(result: argparse.ArgumentParser) -> None:
    result.add_argument("run_id", metavar="RUN", help="the run id, or a unique prefix of it")
    result.add_argument("file", help=_LOG_HELP)


def main(args: argparse.Namespace) -> int:
    return _audit(args)


def _iso_time(text: str) -> str:
    from gatewayd.audit.query import parse_time

    try:
        return parse_time(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _app_id(text: str) -> str:
    from gatewayd.apps.manifest import app_id_problem

    problem = app_id_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


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
    p.add_argument(
        "--app",
        type=_app_id,
        default=None,
        help="only this app (its id, e.g. note-taker): its events, the calls of its tool, "
        "and every entry of its invocations' child runs",
    )
    p.add_argument("--denied", action="store_true", help="only denied or failed entries")


def _audit(args: argparse.Namespace) -> int:
    """`gatewayd audit verify|show|export|stats|tail|run` over every segment of a log.

    The log's path is a string (no pathlib: the readers start without it)."""
    from gatewayd.audit.segments import log_files

    if args.audit_command in audit_tree.WITHOUT_LOG:
        return audit_tree.main(args)
    if args.audit_command == "prove":
        args.file = args.operands[-1]
    try:
        # Listing the segments reads the log's directory: a path through a file
        # ("audit.jsonl/") is an unreadable log, said as one.
        if args.audit_command == "tail":
            if not args.follow and not log_files(args.file):
                return _no_audit_log(args.file)
            return _audit_tail(args)
        if not log_files(args.file):
            return _no_audit_log(args.file)
        return _AUDIT_COMMANDS[args.audit_command](args)
    except BrokenPipeError:  # `gatewayd audit show … | head`: the reader has enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except OSError as exc:
        return _unreadable_audit_log(args.file, exc)


# `gatewayd audit verify`: intact, but its oldest segments are gone (deleted for
# retention?): neither OK (0) nor broken (1), so a script must decide.
EXIT_PARTIAL: Final = 3


def _no_audit_log(path: str) -> int:
    print(
        f"gatewayd: no audit log at {path} (no such file, and no closed segment "
        f"{os.path.basename(path)}.NNNNNN beside it)",
        file=sys.stderr,
    )
    return EXIT_FAILED


def _unreadable_audit_log(path: str, exc: OSError) -> int:
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
        app=args.app,
        denied=args.denied,
    )


def _audit_verify(args: argparse.Namespace) -> int:
    from gatewayd.audit import verify_file

    report = verify_file(args.file)
    print(report.render())
    if args.checkpoint is not None and (code := audit_tree.verify_checkpoint(args)) != EXIT_OK:
        return code
    if args.witness and audit_witness.verify_witnesses(args) != EXIT_OK:
        return EXIT_FAILED
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
    from gatewayd.audit.query import Record, index_runs, read_log, run_index
    from gatewayd.audit.segments import log_files
    from gatewayd.audit.show import format_row, table_header

    where = _audit_filter(args)
    runs = run_index(read_log(args.file)) if where.needs_runs and log_files(args.file) else {}

    def emit(records: list[Record]) -> None:
        for record in records:
            entry = record.entry
            if entry is not None and where.needs_runs:
                index_runs(runs, [record])  # runs created since the index was made
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
    "checkpoint": audit_tree.main,
    "prove": audit_tree.main,
}
