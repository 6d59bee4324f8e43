"""Calls answered at once (``Dispatcher.handle_now``, then ``release``): the same
chokepoint as ``handle``, only without a task of their own.

Every row of test_dispatch's table is taken the way the server takes it (``handle_now``,
and ``handle`` when it declines) against tools that also have an ``immediate`` function:
the answers, the two entries, the tally and the flushes must be those ``handle`` gives,
and the path must be the one the rules say (at once only with no wait on the way).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, cast

import pytest
import trio
from trio.testing import MockClock

from gatewayd.audit import open_audit_log, verify_file
from gatewayd.dispatch import RULES_MAX_AGE_AT_ONCE_S, Answered, Dispatcher
from gatewayd.errors import ToolFailed
from gatewayd.policy import load_policy_text
from gatewayd.policy.review_section import ReviewSection
from gatewayd.protocol import ErrorCode, Request
from gatewayd.review import rulebook
from gatewayd.review.reviewer import Reviewer
from gatewayd.review.rulebook import RuleBook
from gatewayd.runs import Run
from gatewayd.runs.reload import _apply_policy
from gatewayd.tools.registry import TOOLS_LIST, Tool, ToolContext, ToolRegistry
from gatewayd.tracing import Tracer
from tests.unit.test_dispatch import (
    AUDIT_DOWN,
    BURST,
    CASES,
    MAX_OUTPUT_BYTES,
    NEVER_DUE_S,
    PEER,
    POLICY,
    SECRET,
    TOOL_CALL_ID,
    Case,
    FakeAuditLog,
    FakeReviewer,
    Seen,
    assert_answer,
    assert_counted_once,
    assert_entries,
    call,
    fake_tools,
    make_dispatcher,
    make_run,
    writes_ahead,
)

Immediate = Callable[[Any, ToolContext], Any]


def _fail(message: str) -> Immediate:
    def raising(_args: Any, _ctx: ToolContext) -> Any:
        raise ToolFailed(message)

    return raising


# What test_dispatch's side-effect-free tools return, as plain functions.
IMMEDIATE: Final[dict[str, Immediate]] = {
    "test.echo": lambda args, _ctx: {"echo": args.text},
    "test.checked": lambda args, _ctx: {"count": args.count},
    "test.leak": lambda _args, _ctx: {"key": SECRET},
    "test.fail": _fail("nothing at /workspace/absent.txt; fs.list shows what is"),
    "test.fail_leak": _fail(f"upstream answered {SECRET}"),
    "test.big": lambda _args, _ctx: "x" * MAX_OUTPUT_BYTES,
    "test.unencodable": lambda _args, _ctx: object(),
}


def immediate_tools(seen: Seen) -> ToolRegistry:
    """test_dispatch's tools, those in IMMEDIATE with their immediate function (noting
    in ``seen`` when it runs, as their runners do)."""

    def noting(name: str, function: Immediate) -> Immediate:
        def immediate(args: Any, ctx: ToolContext) -> Any:
            seen.ran(name)
            return function(args, ctx)

        return immediate

    tools: list[Tool[Any]] = []
    for tool in fake_tools(seen).values():
        function = IMMEDIATE.get(tool.name)
        if function is None:
            tools.append(tool)
        else:
            tools.append(dataclasses.replace(tool, immediate=noting(tool.name, function)))
    return ToolRegistry(tools)


def at_once(case: Case, tools: ToolRegistry) -> bool:
    """Whether the server may answer ``case`` without a task: tools.list, a tool gatewayd
    does not have (refused at once), or an immediate side-effect-free tool with a call
    slot free."""
    spec = tools.get(case.tool)
    if case.tool == TOOLS_LIST or spec is None:
        return True
    slot_taken = case.prepare.__name__ == "take_every_call_slot"
    return spec.immediate is not None and not spec.manifest.side_effects and not slot_taken


async def serve_one(dispatcher: Dispatcher, run: Run, request: Request) -> tuple[bool, Any]:
    """One call the way the server takes it; (answered at once?, response)."""
    answered = dispatcher.handle_now(run, request, PEER)
    if answered is None:
        return False, await dispatcher.handle(run, request, PEER)
    [response] = await dispatcher.release([answered])
    return True, response


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
async def test_a_call_answered_at_once_gets_the_answer_entries_and_flush_of_handle(
    case: Case, tmp_path: Path, autojump_clock: MockClock
) -> None:
    log = FakeAuditLog()
    seen = Seen(lambda: log.durable_seq)
    tools = immediate_tools(seen)
    run = make_run(tmp_path, grant=case.grant)
    dispatcher = make_dispatcher(log, tools, autojump_clock)
    case.prepare(run, autojump_clock.current_time())

    now, response = await serve_one(dispatcher, run, call(case.tool, case.args, run_id=case.run_id))

    assert now is at_once(case, tools)
    assert_answer(case, response)
    call_seq, result_seq = assert_entries(case, log.entries, response, run)
    assert_counted_once(case, run)
    assert [tool for tool, _ in seen.runs] == ([case.tool] if case.ran else [])
    write_ahead = writes_ahead(case, tools, reply_after_result=True)
    if now:
        # No side effect: nothing written ahead, one flush for both entries.
        assert not write_ahead
        assert log.waits == [result_seq]
        if case.ran:
            [(_, durable_at_start)] = seen.runs
            assert durable_at_start < call_seq
    else:
        assert log.waits == ([call_seq, result_seq] if write_ahead else [result_seq])


def _marked(run: Run) -> Run:
    marked = POLICY + "\napprovals:\n  required:\n    - {tool: test.write, reason: it writes}\n"
    run.spec = dataclasses.replace(run.spec, policy=load_policy_text(marked, "marked.yaml"))
    return run


def _traced(dispatcher: Dispatcher) -> None:
    dispatcher.tracer = cast("Tracer", object())  # never used: handle_now declines first


DECLINED: Final = [
    # (id, tool, args, how the dispatcher or the run is set up)
    ("side-effect", "test.write", {"path": "notes.txt", "content": "x"}, None),
    ("no-immediate-function", "test.slow", {}, None),
    ("review-applies", "test.echo", {"text": "hi"}, "review"),
    ("approvals-in-policy", "test.echo", {"text": "hi"}, "approvals"),
    ("no-call-slot-free", "test.echo", {"text": "hi"}, "slots"),
    ("tracing-on", "test.echo", {"text": "hi"}, "tracing"),
    ("answers-do-not-wait", "test.echo", {"text": "hi"}, "opt-out"),
]


@pytest.mark.parametrize(
    ("tool", "args", "setup"), [d[1:] for d in DECLINED], ids=[d[0] for d in DECLINED]
)
async def test_a_call_that_may_wait_is_declined_before_any_step(
    tool: str, args: dict[str, Any], setup: str | None, tmp_path: Path, autojump_clock: MockClock
) -> None:
    """Declining changes nothing: no entry, no budget spent, nothing counted, no tool run;
    the call then goes through ``handle`` from its first step."""
    log = FakeAuditLog()
    seen = Seen(lambda: log.durable_seq)
    run = make_run(tmp_path)
    reviewer = FakeReviewer(None, applies=True) if setup == "review" else None
    dispatcher = make_dispatcher(
        log,
        immediate_tools(seen),
        autojump_clock,
        reviewer=reviewer,
        reply_after_result=setup != "opt-out",
    )
    if setup == "approvals":
        _marked(run)
    elif setup == "slots":
        run.limiter.acquire_on_behalf_of_nowait(object())
        run.limiter.acquire_on_behalf_of_nowait(object())
    elif setup == "tracing":
        _traced(dispatcher)
    budget = run.bucket._tokens

    assert dispatcher.handle_now(run, call(tool, args), PEER) is None

    assert log.entries == [] and log.waits == []
    assert run.bucket._tokens == budget
    assert run.calls == 0
    assert seen.runs == []


async def test_a_review_that_does_not_apply_lets_the_call_be_answered_at_once(
    tmp_path: Path, autojump_clock: MockClock
) -> None:
    log = FakeAuditLog()
    reviewer = FakeReviewer(None, applies=False)
    dispatcher = make_dispatcher(log, immediate_tools(Seen(int)), autojump_clock, reviewer=reviewer)
    answered = dispatcher.handle_now(make_run(tmp_path), call("test.echo", {"text": "hi"}), PEER)
    assert answered is not None
    assert reviewer.asked == []
    [response] = await dispatcher.release([answered])
    assert response.ok


async def test_calls_answered_at_once_share_one_flush_and_each_is_answered_once(
    tmp_path: Path, autojump_clock: MockClock
) -> None:
    """The server's batch: the calls of one read are released together, after one
    durable() wait for the last result entry; each answer has its own id."""
    log = FakeAuditLog()
    run = make_run(tmp_path)
    dispatcher = make_dispatcher(log, immediate_tools(Seen(int)), autojump_clock)
    requests = [
        Request(v=1, runId=run.run_id, toolCallId=f"c{i}", tool="test.echo", args={"text": str(i)})
        for i in range(4)
    ]
    answered = [dispatcher.handle_now(run, request, PEER) for request in requests]
    assert all(isinstance(a, Answered) for a in answered)
    assert run.calls == 0  # tallied when released, like handle's after its flush

    responses = await dispatcher.release(cast("list[Answered]", answered))

    assert [r.toolCallId for r in responses] == ["c0", "c1", "c2", "c3"]
    assert all(r.ok for r in responses)
    assert log.waits == [log.last_seq]  # one flush, for all eight entries
    assert [e["kind"] for e in log.entries] == ["call", "result"] * 4
    assert (run.calls, run.allowed) == (4, 4)


async def test_a_batch_whose_flush_fails_is_answered_internal_every_one(
    tmp_path: Path, autojump_clock: MockClock
) -> None:
    log = FakeAuditLog()
    run = make_run(tmp_path)
    dispatcher = make_dispatcher(log, immediate_tools(Seen(int)), autojump_clock)
    answered = [
        dispatcher.handle_now(run, call("test.echo", {"text": "hi"}), PEER) for _ in range(2)
    ]
    log.failure = "disk full"

    responses = await dispatcher.release(cast("list[Answered]", answered))

    assert [(r.ok, r.errorCode, r.safeMessage) for r in responses] == [
        (False, ErrorCode.INTERNAL, AUDIT_DOWN)
    ] * 2
    assert all(r.value is None for r in responses)  # never the value the log lost
    assert (run.calls, run.denied_by_code) == (2, {str(ErrorCode.INTERNAL): 2})


async def test_a_batch_cancelled_while_it_waits_is_counted_and_its_entries_stay(
    tmp_path: Path, autojump_clock: MockClock
) -> None:
    log = FakeAuditLog()
    log.stall = True
    run = make_run(tmp_path)
    dispatcher = make_dispatcher(log, immediate_tools(Seen(int)), autojump_clock)
    answered = dispatcher.handle_now(run, call("test.echo", {"text": "hi"}), PEER)
    assert answered is not None
    with trio.move_on_after(1) as scope:
        await dispatcher.release([answered])
    assert scope.cancelled_caught
    assert [e["kind"] for e in log.entries] == ["call", "result"]
    assert (run.calls, run.allowed) == (1, 1)
    # Dropped unsent (a connection cancelled before releasing): counted the same way.
    other = dispatcher.handle_now(run, call("test.echo", {"text": "hi"}), PEER)
    assert other is not None
    dispatcher.drop([other])
    assert (run.calls, run.allowed) == (2, 2)


async def test_calls_answered_at_once_through_the_real_log_share_one_fdatasync(
    tmp_path: Path, autojump_clock: MockClock
) -> None:
    path = tmp_path / "audit" / "audit.jsonl"
    async with open_audit_log(path, fsync=True, sync_delay_s=NEVER_DUE_S) as audit:
        run = make_run(tmp_path / "ws")
        dispatcher = make_dispatcher(audit, immediate_tools(Seen(int)), autojump_clock)
        syncs = audit.fsync_count
        answered = [
            dispatcher.handle_now(run, call("test.echo", {"text": str(i)}), PEER)
            for i in range(BURST)
        ]
        responses = await dispatcher.release(cast("list[Answered]", answered))
        assert all(r.ok and r.toolCallId == TOOL_CALL_ID for r in responses)
        assert audit.durable_seq == audit.last_seq
        assert audit.fsync_count == syncs + 1
    assert verify_file(path).ok


async def test_calls_answered_at_once_look_at_the_policy_file_once_per_interval(
    tmp_path: Path, autojump_clock: MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether a review applies to a call answered at once is asked of the rules as
    looked at up to RULES_MAX_AGE_AT_ONCE_S ago: a stat per call on the event loop's
    thread would hand the interpreter to the audit flusher and back at every call."""
    path = tmp_path / "dispatch-unit.yaml"
    path.write_text(POLICY)
    run = make_run(tmp_path)
    run.spec = dataclasses.replace(run.spec, policy_source=str(path))
    looks: list[str] = []
    identity = rulebook._identity

    def counting(policy: str) -> tuple[int, int, int]:
        looks.append(policy)
        return identity(policy)

    monkeypatch.setattr(rulebook, "_identity", counting)
    reviewer = FakeReviewer(None, applies=False)
    dispatcher = make_dispatcher(
        FakeAuditLog(), immediate_tools(Seen(int)), autojump_clock, reviewer=reviewer
    )
    dispatcher.rules = RuleBook(clock=autojump_clock.current_time)
    for i in range(5):
        assert dispatcher.handle_now(run, call("test.echo", {"text": str(i)}), PEER) is not None
    assert looks == [str(path)]
    autojump_clock.jump(RULES_MAX_AGE_AT_ONCE_S * 2)
    assert dispatcher.handle_now(run, call("test.echo", {"text": "later"}), PEER) is not None
    assert looks == [str(path)] * 2


async def test_a_replaced_spec_is_in_force_from_the_next_call(
    tmp_path: Path, autojump_clock: MockClock
) -> None:
    """What the steps keep of a run between calls (its allowed tools, its rights, its
    part of a tool's context) is made again once its spec is replaced, as a policy
    reload replaces it."""
    run = make_run(tmp_path)
    dispatcher = make_dispatcher(FakeAuditLog(), immediate_tools(Seen(int)), autojump_clock)
    first = dispatcher.handle_now(run, call("test.echo", {"text": "a"}), PEER)
    assert first is not None and first.code is None
    narrowed = dataclasses.replace(run.spec.rules, tool_patterns=("test.checked",))
    run.spec = dataclasses.replace(run.spec, rules=narrowed)
    second = dispatcher.handle_now(run, call("test.echo", {"text": "b"}), PEER)
    assert second is not None and second.code is ErrorCode.POLICY_DENIED


class _SectionReviewer(FakeReviewer):
    """Applies to a call as the real reviewer does: by the review section it is given."""

    def applies(self, section: ReviewSection, tool: str) -> bool:
        return Reviewer.applies(self, section, tool)


async def test_a_policy_reload_is_in_force_at_the_next_call_within_the_rules_age(
    tmp_path: Path, autojump_clock: MockClock
) -> None:
    """A reload that has a review apply to a tool holds from the run's next call, even one
    made within RULES_MAX_AGE_AT_ONCE_S of the last look at the policy file (a busy run
    makes every call within that age)."""
    path = tmp_path / "dispatch-unit.yaml"
    reviewed = POLICY + "  tools: [test.checked]\n"
    path.write_text(reviewed)
    run = make_run(tmp_path)
    run.spec = dataclasses.replace(
        run.spec, policy=load_policy_text(reviewed, str(path)), policy_source=str(path)
    )
    log = tmp_path / "audit" / "audit.jsonl"
    async with open_audit_log(log, fsync=False) as audit:
        dispatcher = make_dispatcher(
            audit, immediate_tools(Seen(int)), autojump_clock, reviewer=_SectionReviewer(None)
        )
        dispatcher.rules = RuleBook(clock=autojump_clock.current_time)
        first = dispatcher.handle_now(run, call("test.echo", {"text": "a"}), PEER)
        assert first is not None
        await dispatcher.release([first])
        reviewed = POLICY + "  tools: [test.checked, test.echo]\n"
        path.write_text(reviewed)
        _apply_policy(run, load_policy_text(reviewed, str(path)))  # as `gatewayd reload` does
        # No time has passed: only a look at the file now sees the reload.
        assert dispatcher.handle_now(run, call("test.echo", {"text": "b"}), PEER) is None
    assert verify_file(log).ok
