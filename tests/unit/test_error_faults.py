"""Every wire error code says whose fault it is (``ErrorCode.fault``), as data a
program reads; docs/protocol.md's "whose" column says the same; the control socket's
HTTP status of a refused run follows the fault."""

from __future__ import annotations

from pathlib import Path

import pytest

from gatewayd.control import _STATUS
from gatewayd.protocol import FAULT_OF, ErrorCode, Fault

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
ERROR_CODES_HEADING = "Error codes"

# code, its wire value (never changes), whose fault it is.
CODES = [
    (ErrorCode.BAD_REQUEST, "bad_request", Fault.CALLER),
    (ErrorCode.TOO_LARGE, "too_large", Fault.CALLER),
    (ErrorCode.RUN_MISMATCH, "run_mismatch", Fault.CALLER),
    (ErrorCode.AUTHZ_DENIED, "authz_denied", Fault.POLICY),
    (ErrorCode.UNKNOWN_TOOL, "unknown_tool", Fault.CALLER),
    (ErrorCode.POLICY_DENIED, "policy_denied", Fault.POLICY),
    (ErrorCode.INVALID_ARGS, "invalid_args", Fault.CALLER),
    (ErrorCode.REVIEW_DENIED, "review_denied", Fault.POLICY),
    (ErrorCode.RATE_LIMITED, "rate_limited", Fault.POLICY),
    (ErrorCode.TIMEOUT, "timeout", Fault.UPSTREAM),
    (ErrorCode.TOOL_FAILED, "tool_failed", Fault.UPSTREAM),
    (ErrorCode.INTERNAL, "internal", Fault.GATEWAYD),
    (ErrorCode.CONFIRMATION_REQUIRED, "confirmation_required", Fault.POLICY),
    (ErrorCode.LIMIT_EXCEEDED, "limit_exceeded", Fault.POLICY),
    (ErrorCode.APPROVAL_DENIED, "approval_denied", Fault.POLICY),
]


@pytest.mark.parametrize(("code", "wire", "fault"), CODES)
def test_each_code_keeps_its_wire_value_and_says_whose_fault_it_is(
    code: ErrorCode, wire: str, fault: Fault
) -> None:
    assert code.value == wire
    assert ErrorCode(wire) is code
    assert code.fault is fault


def test_every_code_has_exactly_one_fault() -> None:
    assert [c for c, _, _ in CODES] == list(ErrorCode)
    assert set(FAULT_OF) == set(ErrorCode)
    assert all(isinstance(f, Fault) for f in FAULT_OF.values())


def test_every_fault_is_some_code_s() -> None:
    assert {c.fault for c in ErrorCode} == set(Fault)


# --- docs/protocol.md -----------------------------------------------------------------------


def documented_faults(text: str) -> dict[str, str]:
    """Code -> its "whose" cell, from the table of the "Error codes" section."""
    rows: dict[str, str] = {}
    inside = False
    for line in text.splitlines():
        if line.startswith("#"):
            inside = line.lstrip("#").strip() == ERROR_CODES_HEADING
        elif inside and line.startswith("| `"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            rows[cells[0].strip("`")] = cells[1]
    return rows


def test_the_docs_whose_column_is_each_code_s_fault() -> None:
    assert documented_faults(DOC.read_text()) == {c.value: c.fault.value for c in ErrorCode}


def test_the_docs_check_sees_a_whose_cell_that_differs() -> None:
    text = DOC.read_text().replace("| `timeout` | upstream |", "| `timeout` | runner |")
    assert documented_faults(text)["timeout"] == "runner"
    assert documented_faults(text) != {c.value: c.fault.value for c in ErrorCode}


def test_the_docs_define_every_fault() -> None:
    text = DOC.read_text()
    section = text[text.index(f"## {ERROR_CODES_HEADING}") :].split("\n## ", 1)[0]
    for fault in Fault:
        assert f"- `{fault.value}`: " in section


# --- the control socket ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "status"),
    [
        # A run start can be refused with these (AuthzDenied, PolicyViolation,
        # SandboxUnavailable, a bad request): their statuses stay what they were.
        (ErrorCode.BAD_REQUEST, 400),
        (ErrorCode.AUTHZ_DENIED, 403),
        (ErrorCode.POLICY_DENIED, 403),
        (ErrorCode.INTERNAL, 500),
        # Any other code gets its fault's status, never a KeyError.
        (ErrorCode.INVALID_ARGS, 400),
        (ErrorCode.RATE_LIMITED, 403),
        (ErrorCode.TOOL_FAILED, 502),
        (ErrorCode.TIMEOUT, 502),
    ],
)
def test_a_refused_run_start_gets_the_http_status_of_its_fault(
    code: ErrorCode, status: int
) -> None:
    assert _STATUS[code.fault] == status


def test_every_fault_has_an_http_status() -> None:
    assert set(_STATUS) == set(Fault)


def test_the_protocol_s_codes_are_the_msgspec_free_module_s_own() -> None:
    # gatewayd.error_codes holds them (the errors and the policy import no codec); the
    # protocol names the very same objects, so a code compares and hashes as ever.
    from gatewayd import error_codes, frame_limits, protocol

    assert protocol.ErrorCode is error_codes.ErrorCode
    assert protocol.Fault is error_codes.Fault
    assert protocol.FAULT_OF is error_codes.FAULT_OF
    assert protocol.MAX_ID_CHARS == frame_limits.MAX_ID_CHARS == 128
