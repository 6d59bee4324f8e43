"""The closed set of error codes on the wire, and whose fault each is.

Its own module, free of msgspec, so that what names an error code without speaking the
wire (the errors, the policy's decisions, `gatewayd policy check`) does not import the
codec; :mod:`gatewayd.protocol` names them too, as it always has.
"""

from __future__ import annotations

import enum
from types import MappingProxyType

# typing's flag without importing typing: the readers of the audit log start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Final


class Fault(enum.StrEnum):
    """Whose fault an error is, which says what a program can do about it."""

    CALLER = "caller"  # the request is wrong: fix it before calling again
    POLICY = "policy"  # the run's policy or grant says no (a rule, a limit, a budget)
    GATEWAYD = "gatewayd"  # gatewayd failed (a bug, the audit log): the operator must look
    UPSTREAM = "upstream"  # what ran the call (a host tool, a provider) failed or took too long


class ErrorCode(enum.StrEnum):
    """The closed set of error codes on the wire; ``fault`` says whose fault each is."""

    BAD_REQUEST = "bad_request"  # the frame or request is malformed
    TOO_LARGE = "too_large"  # a frame over the size limit (connection closes)
    RUN_MISMATCH = "run_mismatch"  # runId is not the run this socket serves
    AUTHZ_DENIED = "authz_denied"  # the run has no system grant for this
    UNKNOWN_TOOL = "unknown_tool"  # no tool has this name
    POLICY_DENIED = "policy_denied"  # allowlist, paths, suffixes, sizes
    INVALID_ARGS = "invalid_args"  # arguments do not fit the tool's schema
    REVIEW_DENIED = "review_denied"  # the rule review said no, or failed
    RATE_LIMITED = "rate_limited"  # the run's call rate or budget is spent
    TIMEOUT = "timeout"  # the call ran past its time limit
    TOOL_FAILED = "tool_failed"  # the tool ran and failed
    INTERNAL = "internal"  # our bug; details are in the daemon log only
    # A loosening rule change asked from inside a run: it waits for the operator's
    # confirmation (the message holds its id and the command that confirms it).
    CONFIRMATION_REQUIRED = "confirmation_required"
    # A tool's own budget ran out: a wasm tool's fuel or memory, a process tool's memory,
    # CPU time or file size (the message says which).
    LIMIT_EXCEEDED = "limit_exceeded"
    # A call the policy marks for a person's approval was not approved: the operator
    # denied it, nobody answered in time, or nobody could be asked (the message says which).
    APPROVAL_DENIED = "approval_denied"

    @property
    def fault(self) -> Fault:
        """Whose fault a call refused or failed with this code is (docs/protocol.md)."""
        return FAULT_OF[self]


# Every code's fault; tests/unit/test_error_faults.py holds it total and equal to
# docs/protocol.md's "whose" column.
FAULT_OF: Final[Mapping[ErrorCode, Fault]] = MappingProxyType(
    {
        ErrorCode.BAD_REQUEST: Fault.CALLER,
        ErrorCode.TOO_LARGE: Fault.CALLER,
        ErrorCode.RUN_MISMATCH: Fault.CALLER,
        # The grant is the operator's, part of the run's rights like its policy; the
        # sandbox cannot earn it by asking differently.
        ErrorCode.AUTHZ_DENIED: Fault.POLICY,
        ErrorCode.UNKNOWN_TOOL: Fault.CALLER,
        ErrorCode.POLICY_DENIED: Fault.POLICY,
        ErrorCode.INVALID_ARGS: Fault.CALLER,
        # The policy asks for the review and a deny applies its rules. A failed review
        # is a deny too (fail closed) and the code does not tell them apart, so it is
        # not upstream: a program must not read it as "retry" (the message says whether).
        ErrorCode.REVIEW_DENIED: Fault.POLICY,
        ErrorCode.RATE_LIMITED: Fault.POLICY,
        # The runner behind the call: a host tool, a model provider.
        ErrorCode.TIMEOUT: Fault.UPSTREAM,
        ErrorCode.TOOL_FAILED: Fault.UPSTREAM,
        ErrorCode.INTERNAL: Fault.GATEWAYD,
        # Invariant LOOSENING_NEEDS_CONFIRMATION: no request from inside a run loosens
        # rules; asking again changes nothing, only the operator's confirmation does.
        ErrorCode.CONFIRMATION_REQUIRED: Fault.POLICY,
        ErrorCode.LIMIT_EXCEEDED: Fault.POLICY,
        # The policy asks for a person's approval, and it was not given: asking again
        # the same way changes nothing by itself, only the operator's answer does.
        ErrorCode.APPROVAL_DENIED: Fault.POLICY,
    }
)
