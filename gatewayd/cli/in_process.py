"""A command answered in a daemon opened in this process, for the commands that go
through `gatewayd serve`'s control socket when one answers there and otherwise open the
daemon themselves for the one command (`gatewayd mcp`, `gatewayd workspace`)."""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from gatewayd.cli.options import config_from_options, log_scrubber

if TYPE_CHECKING:
    from gatewayd.daemon import Daemon


def answer_in_process(
    args: argparse.Namespace, ask: Callable[[Daemon], Awaitable[dict[str, Any]]]
) -> dict[str, Any]:
    """What ``ask`` answers (as the control socket would) on a daemon opened with the
    command's options, warnings only in the log; the daemon is closed before this
    returns. Loaded only then: opening a daemon loads most of gatewayd."""
    import logging

    import trio

    from gatewayd.daemon import open_daemon
    from gatewayd.logs import configure_logging

    config = config_from_options(args)
    configure_logging(logging.WARNING, scrubber=log_scrubber(config))
    answer: dict[str, Any] = {}

    async def once() -> None:
        nonlocal answer
        # One command's: it serves no call, so it loads no tool's library at its start.
        async with open_daemon(config, preload=False) as daemon:
            answer = await ask(daemon)

    trio.run(once)
    return answer
