"""``gatewayd worker``: this host executes agent run workflows from a Temporal task
queue (docs/scale-out.md). Runs until SIGTERM or SIGINT; exit status 0 then, 1 when it
could not start (another daemon holds this one's state, Temporal unreachable), 2 for a
usage error. Temporal's address, namespace and task queue default to the configuration's
``temporal_address``, ``temporal_namespace`` and ``temporal_task_queue``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from datetime import timedelta
from typing import TYPE_CHECKING, Final, NoReturn

from gatewayd.cli.command import EXIT_FAILED, EXIT_OK, EXIT_USAGE, refusing
from gatewayd.cli.options import add_daemon_options, config_from_options, log_scrubber

if TYPE_CHECKING:
    from gatewayd.cli.command import Subparsers

# The longest probe interval or shutdown grace taken: a day (a longer one is a typo, and
# trio and Temporal's durations must hold it; NaN and infinity are refused with it).
MAX_SECONDS_OPTION: Final = 86400.0


def add_parsers(sub: Subparsers) -> None:
    worker = sub.add_parser(
        "worker",
        help="execute agent run workflows from a Temporal task queue (docs/scale-out.md)",
    )
    add_daemon_options(worker)
    worker.add_argument(
        "--temporal",
        metavar="ADDRESS",
        help="Temporal's frontend, host:port (default: the configuration's temporal_address)",
    )
    worker.add_argument(
        "--namespace", help="Temporal namespace (default: temporal_namespace, 'default')"
    )
    worker.add_argument(
        "--task-queue",
        help="the task queue to poll (default: temporal_task_queue, 'gatewayd-agent-runs')",
    )
    worker.add_argument(
        "--max-runs",
        type=int,
        default=None,
        help="agent runs at once at most (default: one per core, as memory allows)",
    )
    worker.add_argument(
        "--host-name",
        default=None,
        help="this host's name in run outcomes (default: the host name)",
    )
    worker.add_argument(
        "--git-token-env",
        default=None,
        help="variable (or systemd credential) holding the git token, read on this host "
        "only (default COGNI_GIT_TOKEN; unset: no credentials)",
    )
    worker.add_argument(
        "--git-username", default="x-access-token", help="the user name sent with the token"
    )
    worker.add_argument(
        "--probe-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="how often the sandbox probe runs again (60); polling stops while it fails",
    )
    worker.add_argument(
        "--shutdown-grace",
        type=float,
        default=None,
        metavar="SECONDS",
        help="on SIGTERM, how long running runs may go on before they are ended and "
        "retried on another worker (30; keep systemd's TimeoutStopSec above it)",
    )


def main(args: argparse.Namespace) -> int:
    return refusing(_worker, args)


def _worker(args: argparse.Namespace) -> int:
    import trio

    from gatewayd.logs import configure_logging
    from gatewayd.scaleout.activities import DEFAULT_GIT_TOKEN_ENV
    from gatewayd.scaleout.worker import (
        GRACEFUL_SHUTDOWN,
        PROBE_INTERVAL_S,
        TemporalUnreachable,
        WorkerOptions,
        default_host_name,
        default_max_runs,
        serve_worker,
    )

    def usage(message: str) -> int:
        print(f"gatewayd worker: {message}", file=sys.stderr)
        return EXIT_USAGE

    if args.max_runs is not None and args.max_runs < 1:
        return usage("--max-runs must be 1 or more")
    for flag, seconds in (
        ("--probe-interval", args.probe_interval),
        ("--shutdown-grace", args.shutdown_grace),
    ):
        if seconds is not None and not 0 < seconds <= MAX_SECONDS_OPTION:
            return usage(f"{flag} must be above 0 and at most {MAX_SECONDS_OPTION} seconds")
    config = config_from_options(args)
    address = args.temporal if args.temporal is not None else config.temporal_address
    namespace = args.namespace if args.namespace is not None else config.temporal_namespace
    queue = args.task_queue if args.task_queue is not None else config.temporal_task_queue
    if address is None:
        return usage(
            "no Temporal address: pass --temporal HOST:PORT or set temporal_address "
            "(GATEWAYD_TEMPORAL_ADDRESS)"
        )
    if not address.strip() or not namespace.strip() or not queue.strip():
        return usage("--temporal, --namespace and --task-queue must not be empty")
    token_env = args.git_token_env or DEFAULT_GIT_TOKEN_ENV
    # The git token is this process's secret too: scrubbed from every output.
    config = config.changed(secret_env=tuple(dict.fromkeys([*config.secret_env, token_env])))
    configure_logging(logging.INFO, scrubber=log_scrubber(config))
    options = WorkerOptions(
        address=address,
        namespace=namespace,
        task_queue=queue,
        max_runs=args.max_runs or default_max_runs(),
        host=args.host_name or default_host_name(),
        git_token_env=token_env,
        git_username=args.git_username,
        probe_interval_s=args.probe_interval or PROBE_INTERVAL_S,
        shutdown_grace=(
            timedelta(seconds=args.shutdown_grace) if args.shutdown_grace else GRACEFUL_SHUTDOWN
        ),
    )
    failures: list[str] = []
    try:
        trio.run(serve_worker, config, options)
    except* TemporalUnreachable as group:  # raised in the worker's nursery: grouped
        failures.extend(str(exc) for exc in _leaves(group))
    for failure in failures:
        print(f"gatewayd worker: {failure}", file=sys.stderr)
    _exit_now(EXIT_FAILED if failures else EXIT_OK)


def _exit_now(status: int) -> NoReturn:
    """End the process without the interpreter's teardown: the Temporal SDK's Rust
    threads outlive the event loop, and an exit after using its client aborts there now
    and then ("PyGILState_Release: thread state must be current", a known crash of the
    SDK). Everything of the worker is closed by now: the daemon ended its runs and closed
    the audit log when serve_worker returned; only the output is flushed here."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    """The exceptions in ``group`` and the groups nested in it (trio's nurseries nest)."""
    found: list[BaseException] = []
    for exc in group.exceptions:
        found.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return found
