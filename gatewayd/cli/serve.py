"""`gatewayd serve`: the long-lived daemon with its control socket; SIGHUP reloads the
configuration and every live run's policy, SIGTERM or SIGINT ends every run and stops."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gatewayd.cli.command import EXIT_OK, refusing
from gatewayd.cli.options import (
    add_daemon_options,
    config_from_options,
    log_scrubber,
    whole_number,
)

if TYPE_CHECKING:
    from gatewayd.cli.command import Subparsers
    from gatewayd.daemon import Daemon


def add_parsers(sub: Subparsers) -> None:
    serve = sub.add_parser("serve", help="run the long-lived daemon with its control socket")
    add_daemon_options(serve)
    serve.add_argument(
        "--audit-max-bytes",
        type=whole_number,
        default=None,
        help="rotate the audit log's active file before it grows past this many bytes "
        "(0: never); default: the configuration's audit_max_bytes (64 MiB); docs/audit.md",
    )
    serve.add_argument(
        "--control-socket", type=Path, default=None, help="default STATE_DIR/control.sock"
    )


def main(args: argparse.Namespace) -> int:
    return refusing(_serve, args)


def _serve(args: argparse.Namespace) -> int:
    import structlog
    import trio

    from gatewayd.daemon import open_daemon
    from gatewayd.logs import configure_logging
    from gatewayd.sdlisten import listen_fds, passed_control_socket
    from gatewayd.sdnotify import notify

    config = config_from_options(args)
    control_path = config.resolved_control_socket
    # JSON lines on stdout: journald's under systemd (docs/metrics.md, "Logs").
    configure_logging(logging.INFO, scrubber=log_scrubber(config), stream=sys.stdout)
    # Under gatewayd.socket systemd holds the control socket and passes it (its path
    # then outlives restarts); started any other way, gatewayd binds the path itself.
    passed = passed_control_socket(listen_fds(), control_path)

    async def serve() -> None:
        # Registered and served by the daemon: a second daemon that would bind it (or a
        # file of this one's audit log) is refused before it touches anything.
        async with open_daemon(
            config, control_socket=control_path, control_listener=passed, preload=True
        ) as daemon:
            structlog.get_logger("gatewayd.serve").info(
                "serving",
                control_socket=str(control_path),
                state_dir=str(config.state_dir),
                socket_activated=passed is not None,
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

    trio.run(serve)
    return EXIT_OK


async def _reload(daemon: Daemon, args: argparse.Namespace) -> None:
    """SIGHUP: re-read gatewayd's configuration and every live run's policy. A bad file
    changes nothing (logged and audited); live runs and their connections go on."""
    import structlog
    import trio

    from gatewayd.audit import AuditEvent
    from gatewayd.runs.reload import reload_config, reload_policies

    log = structlog.get_logger("gatewayd.reload")
    try:
        # Off the event loop: it reads files, and validating them may import (the
        # witnesses' keys load cryptography); live runs' calls go on meanwhile.
        config = await trio.to_thread.run_sync(config_from_options, args)
    except SystemExit as exc:  # config_from_options' way of saying the file is bad
        log.error("config_reload_failed", error=str(exc.code))
        await daemon.audit.append(
            "event", event=AuditEvent.CONFIG_RELOAD_FAILED, safeMessage=str(exc.code)[:500]
        )
    else:
        await reload_config(
            config,
            runs=daemon.runs,
            dispatcher=daemon.dispatcher,
            reviewer=daemon.reviewer,
            audit=daemon.audit,
        )
    outcomes = await reload_policies(daemon.registry, daemon.audit)
    log.info("reloaded", runs=len(outcomes), outcomes=outcomes)
