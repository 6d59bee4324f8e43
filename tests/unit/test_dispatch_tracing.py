"""The chokepoint's call spans (gatewayd/dispatch.py with a tracer): one span per call,
ended once, with the verdict and error code the call's tally gives, whichever way the
call ends; the tool a span names is the metrics' label. The dispatcher and its fakes
are tests/unit/test_dispatch.py's; the real SDK and exporter are test_tracing.py's and
tests/integration/test_observability.py's."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
from trio.testing import MockClock

from gatewayd.protocol import ErrorCode
from tests.unit.test_dispatch import (
    PEER,
    RUN_ID,
    FakeAuditLog,
    Seen,
    call,
    fake_tools,
    make_dispatcher,
    make_run,
)


@dataclass
class FakeSpan:
    run_id: str
    tool: str
    outcomes: list[tuple[str, str | None]] = field(default_factory=list)
    ended: int = 0

    def outcome(self, verdict: str, error_code: str | None) -> None:
        self.outcomes.append((verdict, error_code))

    def end(self) -> None:
        self.ended += 1


@dataclass
class FakeTracer:
    spans: list[FakeSpan] = field(default_factory=list)

    def run_started(self, run_id: str, policy: str) -> None:
        raise AssertionError("the dispatcher starts no run span")

    def run_ended(self, run_id: str, reason: str, error_code: str) -> None:
        raise AssertionError("the dispatcher ends no run span")

    def call(self, run_id: str, tool: str) -> FakeSpan:
        span = FakeSpan(run_id, tool)
        self.spans.append(span)
        return span

    def shutdown(self) -> None:
        pass


@pytest.mark.parametrize(
    ("tool", "args", "span_tool", "outcome"),
    [
        ("test.echo", {"text": "hi"}, "test.echo", ("allowed", None)),
        ("test.fail", {}, "test.fail", ("allowed", "tool_failed")),
        ("test.crash", {}, "test.crash", ("allowed", "internal")),
        ("test.echo", {"bogus": 1}, "test.echo", ("denied", "invalid_args")),
        ("other.tool", {}, "other.tool", ("denied", "policy_denied")),
        ("made.up.tool", {}, "unknown", ("denied", "unknown_tool")),
    ],
)
async def test_each_call_is_one_span_with_its_verdict(
    tool: str,
    args: dict[str, object],
    span_tool: str,
    outcome: tuple[str, str | None],
    tmp_path: Path,
    autojump_clock: MockClock,
) -> None:
    log = FakeAuditLog()
    dispatcher = make_dispatcher(log, fake_tools(Seen(lambda: log.durable_seq)), autojump_clock)
    tracer = FakeTracer()
    dispatcher.tracer = tracer
    response = await dispatcher.handle(make_run(tmp_path), call(tool, args), PEER)
    assert (response.errorCode or None) == outcome[1]
    [span] = tracer.spans
    assert (span.run_id, span.tool) == (RUN_ID, span_tool)
    assert span.outcomes == [outcome]
    assert span.ended == 1


async def test_a_call_on_a_failed_audit_log_is_a_denied_internal_span(
    tmp_path: Path, autojump_clock: MockClock
) -> None:
    log = FakeAuditLog()
    log.failure = "disk full"
    dispatcher = make_dispatcher(log, fake_tools(Seen(lambda: log.durable_seq)), autojump_clock)
    tracer = FakeTracer()
    dispatcher.tracer = tracer
    response = await dispatcher.handle(make_run(tmp_path), call("test.write", {}), PEER)
    assert response.errorCode == ErrorCode.INTERNAL
    [span] = tracer.spans
    assert span.outcomes[-1] == ("denied", "internal")
    assert span.ended == 1


async def test_a_call_that_raises_still_ends_its_span(
    tmp_path: Path, autojump_clock: MockClock
) -> None:
    log = FakeAuditLog()
    dispatcher = make_dispatcher(log, fake_tools(Seen(lambda: log.durable_seq)), autojump_clock)
    tracer = FakeTracer()
    dispatcher.tracer = tracer

    def broken(*_args: object) -> object:
        raise RuntimeError("a bug in a step")

    dispatcher._admit = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="a bug in a step"):
        await dispatcher.handle(make_run(tmp_path), call("test.echo", {"text": "x"}), PEER)
    [span] = tracer.spans
    assert span.ended == 1


async def test_without_a_tracer_nothing_is_traced(
    tmp_path: Path, autojump_clock: MockClock
) -> None:
    log = FakeAuditLog()
    dispatcher = make_dispatcher(log, fake_tools(Seen(lambda: log.durable_seq)), autojump_clock)
    assert dispatcher.tracer is None
    response = await dispatcher.handle(make_run(tmp_path), call("test.echo", {"text": "hi"}), PEER)
    assert response.ok
