"""One ExecResult, four readers: every form's JSON pinned byte for byte, key order included
(the control socket's answer, sandbox.exec's value, and two audit details)."""

from __future__ import annotations

import json

import msgspec
import pytest

from gatewayd.sandbox.launch import RESULT_FIELDS, ExecResult, ResultForm, exec_result_json
from gatewayd.sandbox.limits import ErrorKind, LimitMechanism
from gatewayd.sandbox.passthrough import StreamedBytes

# Valid UTF-8 on stdout, not on stderr: the forms differ exactly there.
TIMED_OUT = ExecResult(
    exitCode=None,
    signal=9,
    stdout="héllo\n".encode(),
    stderr=b"bad \xff byte",
    stdoutTruncated=True,
    stderrTruncated=False,
    durationMs=1500,
    errorCode=ErrorKind.TIMEOUT,
    memoryLimit=LimitMechanism.CGROUP,
    processLimit=LimitMechanism.RLIMIT,
)
EXITED = ExecResult(
    exitCode=0,
    signal=None,
    stdout=b"",
    stderr=b"",
    stdoutTruncated=False,
    stderrTruncated=False,
    durationMs=3,
    errorCode=None,
    memoryLimit=LimitMechanism.RLIMIT,
    processLimit=LimitMechanism.RLIMIT,
)


@pytest.mark.parametrize(
    ("result", "form", "expected"),
    [
        (
            TIMED_OUT,
            ResultForm.CONTROL,
            '{"exitCode": null, "signal": 9, "durationMs": 1500, "errorCode": "timeout", '
            '"memoryLimit": "cgroup", "processLimit": "rlimit", "stdout": "h\\u00e9llo\\n", '
            '"stdoutEncoding": "utf-8", "stdoutTruncated": true, "stderr": "YmFkIP8gYnl0ZQ==", '
            '"stderrEncoding": "base64", "stderrTruncated": false, "failed": true, "hint": null}',
        ),
        (
            EXITED,
            ResultForm.CONTROL,
            '{"exitCode": 0, "signal": null, "durationMs": 3, "errorCode": null, '
            '"memoryLimit": "rlimit", "processLimit": "rlimit", "stdout": "", '
            '"stdoutEncoding": "utf-8", "stdoutTruncated": false, "stderr": "", '
            '"stderrEncoding": "utf-8", "stderrTruncated": false, "failed": false, "hint": null}',
        ),
        (
            TIMED_OUT,
            ResultForm.TOOL,
            '{"exitCode": null, "signal": 9, "errorCode": "timeout", "stdout": "h\\u00e9llo\\n", '
            '"stderr": "bad \\ufffd byte", "stdoutTruncated": true, "stderrTruncated": false, '
            '"durationMs": 1500, "failed": true, "hint": null}',
        ),
        (
            EXITED,
            ResultForm.TOOL,
            '{"exitCode": 0, "signal": null, "errorCode": null, "stdout": "", "stderr": "", '
            '"stdoutTruncated": false, "stderrTruncated": false, "durationMs": 3, "failed": false, '
            '"hint": null}',
        ),
        (
            TIMED_OUT,
            ResultForm.AUDIT,
            '{"memoryLimit": "cgroup", "processLimit": "rlimit", "exitCode": null, "signal": 9, '
            '"errorCode": "timeout", "stdoutBytes": 7, "stderrBytes": 10, '
            '"stdoutTruncated": true, "stderrTruncated": false}',
        ),
        (
            EXITED,
            ResultForm.AUDIT,
            '{"memoryLimit": "rlimit", "processLimit": "rlimit", "exitCode": 0, "signal": null, '
            '"errorCode": null, "stdoutBytes": 0, "stderrBytes": 0, '
            '"stdoutTruncated": false, "stderrTruncated": false}',
        ),
        (TIMED_OUT, ResultForm.EXIT, '{"exitCode": null, "signal": 9}'),
        (EXITED, ResultForm.EXIT, '{"exitCode": 0, "signal": null}'),
    ],
)
def test_each_form_has_its_readers_fields_in_their_order(
    result: ExecResult, form: ResultForm, expected: str
) -> None:
    assert json.dumps(exec_result_json(result, form)) == expected


@pytest.mark.parametrize("form", list(ResultForm))
def test_every_form_is_plain_json_with_exactly_its_listed_keys(form: ResultForm) -> None:
    value = exec_result_json(TIMED_OUT, form)
    assert tuple(value) == RESULT_FIELDS[form]
    # The audit writer and the dispatcher encode with msgspec: no enum or bytes may remain.
    assert msgspec.json.decode(msgspec.json.encode(value)) == value


def test_the_audit_forms_never_hold_output() -> None:
    for form in (ResultForm.AUDIT, ResultForm.EXIT):
        encoded = json.dumps(exec_result_json(TIMED_OUT, form))
        assert "llo" not in encoded and "bad" not in encoded


def test_control_output_round_trips_exactly() -> None:
    value = exec_result_json(TIMED_OUT, ResultForm.CONTROL)
    assert value["stdout"].encode() == TIMED_OUT.stdout
    assert msgspec.json.decode(f'"{value["stderr"]}"'.encode(), type=bytes) == TIMED_OUT.stderr


def test_the_tool_value_starts_with_the_exit_code() -> None:
    # The agent loop recognises sandbox.exec's answer by this prefix.
    encoded = msgspec.json.encode(exec_result_json(EXITED, ResultForm.TOOL))
    assert encoded.startswith(b'{"exitCode":')


STREAMED = ExecResult(
    exitCode=0,
    signal=None,
    stdout=b"",
    stderr=b"",
    stdoutTruncated=False,
    stderrTruncated=False,
    durationMs=8,
    errorCode=None,
    memoryLimit=LimitMechanism.CGROUP,
    processLimit=LimitMechanism.CGROUP,
    streamed=StreamedBytes(stdin=52_428_800, stdout=52_428_800, stderr=12),
)


def test_a_streamed_commands_audit_counts_what_crossed_each_stream() -> None:
    # Passed through, nothing was kept: the byte counts are the streams' own totals,
    # far beyond any output cap, and no truncation flag pretends something was cut.
    assert json.dumps(exec_result_json(STREAMED, ResultForm.STREAMED_AUDIT)) == (
        '{"memoryLimit": "cgroup", "processLimit": "cgroup", "exitCode": 0, "signal": null, '
        '"errorCode": null, "stdinBytes": 52428800, "stdoutBytes": 52428800, '
        '"stderrBytes": 12}'
    )
    # A captured command's input is its caller's, not counted here.
    assert exec_result_json(EXITED, ResultForm.STREAMED_AUDIT)["stdinBytes"] is None


@pytest.mark.parametrize(
    ("exit_code", "sig", "error", "failed"),
    [
        (0, None, None, False),
        (1, None, None, True),
        (None, 9, None, True),
        (None, 9, ErrorKind.TIMEOUT, True),
        # A limit ended it although it exited 0 (a SIGXFSZ caught, say): still failed.
        (0, None, ErrorKind.LIMIT_EXCEEDED, True),
    ],
)
def test_failed_is_a_non_zero_exit_a_signal_or_a_limit(
    exit_code: int | None, sig: int | None, error: ErrorKind | None, failed: bool
) -> None:
    result = ExecResult(
        exitCode=exit_code,
        signal=sig,
        stdout=b"",
        stderr=b"",
        stdoutTruncated=False,
        stderrTruncated=False,
        durationMs=1,
        errorCode=error,
        memoryLimit=LimitMechanism.CGROUP,
        processLimit=LimitMechanism.CGROUP,
    )
    for form in (ResultForm.CONTROL, ResultForm.TOOL):
        assert exec_result_json(result, form)["failed"] is failed


def test_the_hint_goes_to_the_control_and_tool_forms_only() -> None:
    for form in ResultForm:
        value = exec_result_json(TIMED_OUT, form, hint="why")
        assert (value.get("hint") == "why") is (form in (ResultForm.CONTROL, ResultForm.TOOL))
