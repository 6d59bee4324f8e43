"""The approval step of dispatch on a virtual clock, with the fake audit log of
tests/unit/test_dispatch.py, so that the order of the records is checked exactly: the
record file and the ``approval_pending`` entry are durable before the operator sees the
call; the ``approval_decided`` entry is durable before the tool starts; an audit log that
fails while a call waits leaves the record for the next start and runs nothing. Real
sockets, the control socket and a real restart: tests/integration/test_approvals*.py.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Final, cast

import pytest
import trio
from trio.testing import MockClock, wait_all_tasks_blocked

import gatewayd.approvals
from gatewayd.approvals import Approvals, Operator
from gatewayd.audit import AuditLog, AuditWriteError
from gatewayd.dispatch import Dispatcher
from gatewayd.files import write_atomically
from gatewayd.policy import load_policy_text
from gatewayd.protocol import ErrorCode, Response
from gatewayd.runs import Run
from tests.unit.test_dispatch import (
    CALL_TIMEOUT_S,
    PEER,
    POLICY,
    FakeAuditLog,
    Seen,
    call,
    fake_tools,
    make_dispatcher,
    make_run,
)

MARKED = (
    POLICY
    + """
approvals:
  required:
    - {tool: test.write, reason: it writes}
    - {tool: test.echo, args: {text: '^danger'}}
"""
)
OPERATOR = Operator(uid=0, pid=1, name="op")
# Real seconds a call may take to be shown before a test gives up on it (a hang guard):
# its record file is written and fsynced in a worker thread, in real time.
SHOWN_WITHIN_S: Final = 60.0


def marked_run(workspace: Path) -> Run:
    run = make_run(workspace)
    run.spec = dataclasses.replace(run.spec, policy=load_policy_text(MARKED, "marked.yaml"))
    return run


def dispatching(
    clock: MockClock, log: FakeAuditLog | None = None
) -> tuple[FakeAuditLog, Seen, Dispatcher]:
    """A fake audit log (``log``, or a new one), the fake tools that note how far it was
    durable when each ran, and a dispatcher of both on ``clock``."""
    log = log or FakeAuditLog()
    durable = log
    seen = Seen(lambda: durable.durable_seq)
    return log, seen, make_dispatcher(log, fake_tools(seen), clock)


async def write_marked(dispatcher: Dispatcher, run: Run, answer: list[Response]) -> None:
    """The run's marked ``test.write`` call; its answer is appended to ``answer``."""
    request = call("test.write", {"path": "out.txt", "text": "x"})
    answer.append(await dispatcher.handle(run, request, PEER))


def with_approvals(dispatcher: Dispatcher, log: FakeAuditLog, state: Path) -> Approvals:
    approvals = Approvals(cast("AuditLog", log), state, answerable=True)
    dispatcher.approvals = approvals
    return approvals


async def first_waiting(approvals: Approvals) -> dict[str, Any]:
    """The first waiting call, once it is shown, with no virtual time passed meanwhile.

    On its way the call's record file is written in a worker thread, in real time, and
    the autojump clock jumps to the next deadline whenever every task waits (one waiting
    for a thread does): a virtual limit here, or a poll's sleep, would let virtual time
    run while the disk works, and a loaded disk would end this wait, or the approval's
    own timeout, before the call is shown. ``wait_all_tasks_blocked``'s cushion is real
    time and keeps the clock still.
    """
    give_up = time.monotonic() + SHOWN_WITHIN_S
    while not approvals.pending():
        assert time.monotonic() < give_up, f"no call was shown within {SHOWN_WITHIN_S:g} s"
        await wait_all_tasks_blocked(cushion=0.01)
    return approvals.pending()[0]


def events(log: FakeAuditLog, name: str) -> list[dict[str, Any]]:
    return [e for e in log.entries if e.get("event") == name]


async def test_without_anyone_to_ask_a_marked_call_is_denied_and_others_run(
    tmp_path: Path, autojump_clock: MockClock
) -> None:
    _log, seen, dispatcher = dispatching(autojump_clock)
    run = marked_run(tmp_path)
    refused = await dispatcher.handle(run, call("test.echo", {"text": "danger zone"}), PEER)
    assert refused.errorCode is ErrorCode.APPROVAL_DENIED
    assert refused.safeMessage is not None
    assert "approvals.required entry 2 of this run's policy" in refused.safeMessage
    fine = await dispatcher.handle(run, call("test.echo", {"text": "hello"}), PEER)
    assert fine.ok is True
    assert [tool for tool, _ in seen.runs] == ["test.echo"]


async def test_each_record_is_durable_before_the_next_step_and_the_tool_runs_last(
    tmp_path: Path, autojump_clock: MockClock
) -> None:
    log, seen, dispatcher = dispatching(autojump_clock)
    approvals = with_approvals(dispatcher, log, tmp_path / "state")
    run = marked_run(tmp_path)
    answer: list[Response] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(write_marked, dispatcher, run, answer)
        waiting = await first_waiting(approvals)
        (pending,) = events(log, "approval_pending")
        # Shown to the operator only once its record file and its entry are durable.
        assert log.durable_seq >= pending["seq"]
        record = tmp_path / "state" / "approvals" / f"{waiting['approvalId']}.json"
        assert record.is_file()
        assert seen.runs == []
        await trio.sleep(CALL_TIMEOUT_S * 10)  # past the call's own limit: not counted
        await approvals.decide(waiting["approvalId"], approve=True, by=OPERATOR)
    (decided,) = events(log, "approval_decided")
    [(_, durable_at_start)] = seen.runs
    assert durable_at_start >= decided["seq"]  # decided on the record before it ran
    assert answer[0].ok is True
    assert not record.exists()
    call_entry = next(e for e in log.entries if e["kind"] == "call")
    assert call_entry["seq"] > decided["seq"]
    assert call_entry["detail"]["approvalId"] == waiting["approvalId"]


async def test_the_default_timeout_denies_on_the_virtual_clock(
    tmp_path: Path, autojump_clock: MockClock
) -> None:
    log, seen, dispatcher = dispatching(autojump_clock)
    with_approvals(dispatcher, log, tmp_path / "state")
    run = marked_run(tmp_path)
    started = trio.current_time()
    response = await dispatcher.handle(run, call("test.echo", {"text": "danger"}), PEER)
    assert trio.current_time() - started >= 300  # approvals.timeout_s's default
    assert response.errorCode is ErrorCode.APPROVAL_DENIED
    assert seen.runs == []
    (decided,) = events(log, "approval_decided")
    assert decided["detail"]["decidedBy"] == {"kind": "timeout"}


async def test_a_record_file_slow_to_write_takes_no_virtual_time(
    tmp_path: Path, autojump_clock: MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loaded disk takes hundreds of milliseconds to write and fsync the record file:
    the virtual clock stands still meanwhile, so neither the test's wait for the call
    nor the approval's timeout can pass while the disk works."""
    moved: list[float] = []

    def slow_write(path: Path, data: bytes, mode: int) -> None:
        before = autojump_clock.current_time()
        time.sleep(0.05)
        moved.append(autojump_clock.current_time() - before)
        write_atomically(path, data, mode)

    monkeypatch.setattr(gatewayd.approvals, "write_atomically", slow_write)
    log, seen, dispatcher = dispatching(autojump_clock)
    approvals = with_approvals(dispatcher, log, tmp_path / "state")
    run = marked_run(tmp_path)
    answer: list[Response] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(write_marked, dispatcher, run, answer)
        waiting = await first_waiting(approvals)
        await approvals.decide(waiting["approvalId"], approve=True, by=OPERATOR)
    assert moved == [0.0]
    assert answer[0].ok is True
    assert [tool for tool, _ in seen.runs] == ["test.write"]


async def test_a_caller_gone_is_withdrawn_within_a_poll(
    tmp_path: Path, autojump_clock: MockClock
) -> None:
    log, seen, dispatcher = dispatching(autojump_clock)
    approvals = with_approvals(dispatcher, log, tmp_path / "state")
    run = marked_run(tmp_path)
    gone = False
    answer: list[Response] = []

    async def calling() -> None:
        request = call("test.echo", {"text": "danger"})
        answer.append(await dispatcher.handle(run, request, PEER, caller_gone=lambda: gone))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(calling)
        await first_waiting(approvals)
        gone = True
    assert answer[0].errorCode is ErrorCode.APPROVAL_DENIED
    (decided,) = events(log, "approval_decided")
    assert decided["detail"]["verdict"] == "withdrawn"
    assert seen.runs == []


async def test_an_audit_log_that_fails_while_a_call_waits_runs_nothing_and_keeps_the_record(
    tmp_path: Path, autojump_clock: MockClock
) -> None:
    log, seen, dispatcher = dispatching(autojump_clock)
    approvals = with_approvals(dispatcher, log, tmp_path / "state")
    run = marked_run(tmp_path)
    answer: list[Response] = []

    async def calling() -> None:
        answer.append(await dispatcher.handle(run, call("test.echo", {"text": "danger"}), PEER))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(calling)
        waiting = await first_waiting(approvals)
        log.failure = "disk full"
        nursery.start_soon(_approve_ignoring_failure, approvals, waiting["approvalId"])
    assert answer[0].errorCode is ErrorCode.INTERNAL
    assert seen.runs == []
    # The decision is not on the record: the next start denies the call from its file.
    assert (tmp_path / "state" / "approvals" / f"{waiting['approvalId']}.json").is_file()


async def _approve_ignoring_failure(approvals: Approvals, approval_id: str) -> None:
    # The operator is told the audit log failed (the control socket's 500).
    with pytest.raises(AuditWriteError):
        await approvals.decide(approval_id, approve=True, by=OPERATOR)


class SlowAuditLog(FakeAuditLog):
    """A log whose flushes take ``delay`` seconds once it is set (a slow disk)."""

    delay = 0.0

    async def durable(self, seq: int) -> None:
        await trio.sleep(self.delay)
        await super().durable(seq)


async def test_an_approval_whose_entry_is_slow_to_be_durable_still_runs_once(
    tmp_path: Path, autojump_clock: MockClock
) -> None:
    log = SlowAuditLog()
    _, seen, dispatcher = dispatching(autojump_clock, log)
    approvals = with_approvals(dispatcher, log, tmp_path / "state")
    run = marked_run(tmp_path)
    answer: list[Response] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(write_marked, dispatcher, run, answer)
        waiting = await first_waiting(approvals)
        log.delay = 30.0  # longer than a withdrawal would wait for its entry
        await approvals.decide(waiting["approvalId"], approve=True, by=OPERATOR)
    # What the operator was told happened: the call ran, once, and nothing is left for
    # the next start to deny (a second approval_decided).
    assert answer[0].ok is True, answer[0]
    assert [tool for tool, _ in seen.runs] == ["test.write"]
    assert list((tmp_path / "state" / "approvals").iterdir()) == []
    assert len(events(log, "approval_decided")) == 1
