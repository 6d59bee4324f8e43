"""Operational logs: structlog JSON lines, one object per line.

``gatewayd serve`` writes them to stdout (journald takes stdout under systemd);
``gatewayd run`` to stderr, because its stdout is the command's. Always JSON, also on a
terminal: one format for the operator, ``jq``, and the tests; the scrubber covers the one
renderer. Every line logged while a run is handled carries ``run_id`` (bound with
structlog.contextvars where the run's tasks start, see daemon.py).

These are for the operator and are separate from the audit log, which has its own
append-only writer (gatewayd.audit). Configured once, at start-up. docs/metrics.md,
"Logs", says what the lines hold.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

from gatewayd.secrets import Scrubber


class ScrubbedJSONRenderer:
    """structlog's JSON renderer, then every configured secret replaced in the line.

    The rendered line is scrubbed as text, so every field (the event, values, a
    formatted traceback) is covered by one substring test per form when no secret is in
    it. The replacement is JSON-safe, so the line stays valid JSON unless a secret spans
    the JSON's own syntax (a value holding quotes), where leaving no secret wins.
    """

    def __init__(self, scrubber: Scrubber) -> None:
        self._render = structlog.processors.JSONRenderer()
        self._scrubber = scrubber

    def __call__(self, logger: WrappedLogger, name: str, event_dict: EventDict) -> Any:
        line = self._render(logger, name, event_dict)
        return self._scrubber.text(line) if isinstance(line, str) else line


class _StdlibJSONHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Marks the handler configure_logging puts on the root logger (replaced, not stacked,
    when it is called again)."""


def configure_logging(
    level: int = logging.INFO,
    *,
    scrubber: Scrubber | None = None,
    stream: TextIO | None = None,
) -> None:
    """JSON lines to ``stream`` (default: stderr) at ``level`` and above, with
    ``scrubber``'s secrets replaced (default: none configured, nothing replaced).

    Records of the standard ``logging`` module that reach the root logger (libraries)
    become the same JSON lines, scrubbed the same way.
    """
    out = stream if stream is not None else sys.stderr
    render = ScrubbedJSONRenderer(scrubber or Scrubber())
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, render],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=True,
    )
    handler = _StdlibJSONHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                render,
            ],
        )
    )
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _StdlibJSONHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
