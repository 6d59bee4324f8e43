"""What every `gatewayd` command module is, and what the commands share: their exit
statuses, and how a command that starts a daemon reports a refused start.

A command module (``gatewayd.cli.serve``, ``gatewayd.cli.audit``...) adds its
subcommands to the parser (``add_parsers``) and runs one (``main``); heavy imports
(trio, the daemon) happen inside ``main``'s callees, so `gatewayd audit verify` and
`gatewayd policy check` start fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from gatewayd.exitstatus import EXIT_FAILED, EXIT_OK, EXIT_USAGE

# typing's flag without importing typing: client commands start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Protocol

    # argparse's own (private) name for what ``add_subparsers`` returns.
    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]

    class CommandModule(Protocol):
        """A module of ``gatewayd.cli``: its subcommands' parsers and their handler (a
        name for the type checker only: the modules are looked up by name)."""

        def add_parsers(self, sub: Subparsers) -> None:
            """Add this module's commands to ``gatewayd``'s subcommands."""

        def main(self, args: argparse.Namespace) -> int:
            """Run the command ``args`` names; returns gatewayd's exit status."""


# Exit codes of gatewayd itself (gatewayd/exitstatus.py; a one-shot run exits with its
# command's status).
__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "refusing"]


def refusing(command: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a command that starts a daemon; a refused start (another daemon on this host
    holds what this one would use, the host's registry of daemons cannot be used, the
    audit log cannot be continued, the control socket's path is taken, the socket
    systemd passed is not one to serve on, the metrics listener's address cannot be
    bound, a tracing endpoint in the environment is not a URL, or the audit checkpoint
    key cannot be used) is its message and EXIT_FAILED, not a traceback."""
    try:
        return command(args)
    except (Exception, BaseExceptionGroup) as exc:
        # The refusals' modules are the daemon's: loaded only once something failed,
        # so a command that ends before its daemon starts (a usage error) loads none.
        refusals = _refusals()
        if isinstance(exc, refusals):
            # AuditOpenError: the audit log is another daemon's (locked) or cannot be
            # continued.
            print(f"gatewayd: refused to start: {exc}", file=sys.stderr)
            return EXIT_FAILED
        if not isinstance(exc, BaseExceptionGroup):
            raise
        # Raised inside the daemon's nursery (a control socket path something else
        # holds, ControlServer.serve): a refusal still, if that is all the group holds.
        refused, rest = exc.split(refusals)
        if refused is None or rest is not None:
            raise
        first: BaseException = refused
        while isinstance(first, BaseExceptionGroup):
            first = first.exceptions[0]
        print(f"gatewayd: refused to start: {first}", file=sys.stderr)
        return EXIT_FAILED


def _refusals() -> tuple[type[Exception], ...]:
    from gatewayd.approvals import ApprovalStoreError
    from gatewayd.audit import AuditOpenError
    from gatewayd.audit.checkpointer import CheckpointKeyError
    from gatewayd.control import ControlSocketInUse
    from gatewayd.metrics_server import MetricsListenError
    from gatewayd.sandbox.daemons import DaemonRegistryError
    from gatewayd.sdlisten import PassedSocketError
    from gatewayd.tracing import TracingError

    return (
        DaemonRegistryError,
        AuditOpenError,
        ControlSocketInUse,
        ApprovalStoreError,
        PassedSocketError,
        MetricsListenError,
        TracingError,
        CheckpointKeyError,
    )
