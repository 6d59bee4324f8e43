"""Exceptions raised inside gatewayd that map to exactly one wire error code.

They never cross the socket: dispatch catches them and answers with
``error_response(code, safe_message)``. The message must be safe to show to the
sandbox (no host secrets) and should say what *is* allowed (invariant 10).
"""

from __future__ import annotations

from typing import ClassVar

from gatewayd.error_codes import ErrorCode


class GatewayError(Exception):
    """Base class: ``code`` is the wire error code, ``str(exc)`` the safe message."""

    code: ClassVar[ErrorCode] = ErrorCode.INTERNAL

    @property
    def safe_message(self) -> str:
        return str(self)


class PolicyViolation(GatewayError):
    """The policy forbids this call (path outside, read-only, suffix, size, tool)."""

    code = ErrorCode.POLICY_DENIED


class InvalidArguments(GatewayError):
    """The caller's arguments are wrong in a way the schema could not express."""

    code = ErrorCode.INVALID_ARGS


class ArgumentsRejected(InvalidArguments):
    """The arguments do not fit the tool's schema (a tool's decoder raises it, whatever
    its runner kind); ``str()`` says where and why, and dispatch adds the tool's name and
    where its schema is."""


class ToolFailed(GatewayError):
    """The tool ran and failed (missing file, not a directory, I/O error)."""

    code = ErrorCode.TOOL_FAILED


class ToolTimedOut(GatewayError):
    """The tool's runner gave up waiting for it (a hung MCP server); what was running was
    stopped."""

    code = ErrorCode.TIMEOUT


class LimitExceeded(GatewayError):
    """The tool ran past one of its own limits (memory; a wasm tool's fuel; a process
    tool's CPU time or file size) and was stopped; the message names which limit."""

    code = ErrorCode.LIMIT_EXCEEDED


class AuthzDenied(GatewayError):
    """The run lacks the system grant needed for this."""

    code = ErrorCode.AUTHZ_DENIED


class RateLimited(GatewayError):
    """The run's call rate or budget is spent."""

    code = ErrorCode.RATE_LIMITED


class ConfirmationRequired(GatewayError):
    """A loosening rule change asked from inside a run: it waits for the operator's
    confirmation; the message says how to give it."""

    code = ErrorCode.CONFIRMATION_REQUIRED
