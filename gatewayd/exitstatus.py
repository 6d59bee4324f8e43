"""gatewayd's exit statuses, and how a sandboxed command's end becomes one: shared by the
client commands (`gatewayd exec`), the one-shot run in gatewayd's own process and the one
a serving daemon runs for an attached `gatewayd run`. No imports (not even typing's):
every client command loads it."""

from __future__ import annotations

# typing's flag without importing typing: client commands start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Final

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1  # verify found a problem, policy invalid, run refused
EXIT_USAGE: Final = 2
# Like timeout(1): the run's command was stopped because the run ran out of time.
EXIT_MAX_RUNTIME: Final = 124
# A child killed by signal N exits 128 + N, like a shell reports it.
SIGNAL_EXIT_BASE: Final = 128


def exec_status(exit_code: int | None, sig: int | None, error: str | None) -> int:
    """gatewayd's exit status for a sandboxed command: its own, 128+N for a signal,
    124 when it ran out of time (like timeout(1))."""
    if error == "timeout":
        return EXIT_MAX_RUNTIME
    if sig is not None:
        return SIGNAL_EXIT_BASE + sig
    return exit_code if exit_code is not None else EXIT_FAILED


def describe_exec(exit_code: int | None, sig: int | None, error: str | None) -> str:
    """How a sandboxed command ended, in words: ``exit 3``, ``signal 9 (timeout)``."""
    what = f"signal {sig}" if sig is not None else f"exit {exit_code}"
    return f"{what} ({error})" if error else what
