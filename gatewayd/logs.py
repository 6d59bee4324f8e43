"""Operational logs: structlog JSON lines on stderr (journald picks them up).

These are for the operator and are separate from the audit log, which has its own
append-only writer (gatewayd.audit). Configured once, at start-up.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog
from structlog.typing import EventDict, WrappedLogger

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


def configure_logging(level: int = logging.INFO, *, scrubber: Scrubber | None = None) -> None:
    """JSON lines to stderr at ``level`` and above, with ``scrubber``'s secrets replaced
    (default: none configured, nothing replaced)."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            ScrubbedJSONRenderer(scrubber or Scrubber()),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
