"""``AgentRunWorkflow``: one agent run as a Temporal workflow (reference note 004's
"Temporal Integration"): validate the grant, execute the run on some host's worker, push
the branch when asked, record completion.

Workflow code must replay to the same commands from its history, so it is deterministic:
no clock, no randomness, no I/O, nothing of gatewayd but the spec's dataclasses; it runs
in Temporal's workflow sandbox (left on). The activities are referred to by name.

Failure behaviour (docs/scale-out.md):

- a refused grant or a spec the host cannot run: never retried; the outcome says
  ``authz_denied`` (or ``bad_request``) and nothing ran;
- a worker that dies mid-run stops heartbeating: after ``HEARTBEAT_TIMEOUT`` Temporal
  runs the activity again, on whichever worker polls first, as a fresh run with a fresh
  run id; the dead run pushed nothing (only the workflow pushes, after a run finished);
- the run's wall time bounds the activity: its start-to-close timeout is the wall time
  plus what cloning, starting the sandbox and making the patch may take;
- a cancellation reaches the running activity at its next heartbeat: the run ends
  (sandbox killed, audited), and the workflow completes with the partial outcome
  (``cancelled``), pushing nothing; cancelled while no attempt runs (queued, or between
  attempts), it completes with ``cancelled`` too;
- a run whose every attempt failed is recorded (``internal``), then fails the workflow.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any, Final

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError, FailureError

with workflow.unsafe.imports_passed_through():
    from gatewayd.scaleout.spec import (
        ERROR_AUTHZ_DENIED,
        ERROR_CANCELLED,
        ERROR_TYPE_AUTHZ,
        ERROR_TYPE_INVALID_SPEC,
        ERROR_TYPE_PUSH_REFUSED,
        EXECUTE_RUN,
        PROGRESS_QUERY,
        PROGRESS_SIGNAL,
        PUSH_BRANCH,
        RECORD_RUN_COMPLETE,
        STATE_CANCELLED,
        STATE_DONE,
        STATE_PUSHING,
        STATE_QUEUED,
        STATE_RECORDING,
        STATE_REFUSED,
        STATE_RUNNING,
        STATE_VALIDATING,
        VALIDATE_GRANT,
        WORKFLOW_NAME,
        AgentRunOutcome,
        AgentRunSpec,
        Progress,
        PushOutcome,
        PushRequest,
        RunRecord,
    )

# A worker that stops heartbeating this long is taken for dead and its run is given to
# another worker. The activity beats every 2 s (activities.HEARTBEAT_INTERVAL_S), so a
# busy host has several chances; a short timeout makes a crashed host's runs move soon.
HEARTBEAT_TIMEOUT: Final = timedelta(seconds=10)
# What an execute attempt may take besides the run's wall time: fetching the repository,
# starting the sandbox, making the patch, reading the run's audit entries.
EXECUTE_OVERHEAD: Final = timedelta(minutes=10)
# A run is tried this often in all: a first attempt and retries after crashed workers.
EXECUTE_ATTEMPTS: Final = 3
# Validation reads the spec and writes one audit entry; recording writes one entry.
SHORT_ACTIVITY_TIMEOUT: Final = timedelta(minutes=1)
# A push fetches the repository and pushes one branch.
PUSH_TIMEOUT: Final = timedelta(minutes=10)
SHORT_ATTEMPTS: Final = 5
RETRY_START: Final = timedelta(seconds=1)
RETRY_MAX_INTERVAL: Final = timedelta(seconds=30)
_NEVER_RETRIED: Final = [ERROR_TYPE_AUTHZ, ERROR_TYPE_INVALID_SPEC, ERROR_TYPE_PUSH_REFUSED]


def _retry(attempts: int) -> RetryPolicy:
    return RetryPolicy(
        initial_interval=RETRY_START,
        maximum_interval=RETRY_MAX_INTERVAL,
        maximum_attempts=attempts,
        non_retryable_error_types=_NEVER_RETRIED,
    )


def _was_cancelled(exc: BaseException) -> bool:
    return isinstance(exc, asyncio.CancelledError | CancelledError) or (
        isinstance(exc, ActivityError) and isinstance(exc.cause, CancelledError)
    )


@workflow.defn(name=WORKFLOW_NAME)
class AgentRunWorkflow:
    def __init__(self) -> None:
        self._progress = Progress(state=STATE_QUEUED)

    @workflow.query(name=PROGRESS_QUERY)
    def progress(self) -> dict[str, Any]:
        p = self._progress
        return {"state": p.state, "turn": p.turn, "tool": p.tool, "host": p.host, "runId": p.run_id}

    @workflow.signal(name=PROGRESS_SIGNAL)
    def run_progress(self, progress: Progress) -> None:
        """The running activity's progress (turn, tool), for the query."""
        if self._progress.state == STATE_RUNNING:
            self._progress.turn, self._progress.tool = progress.turn, progress.tool
            self._progress.host, self._progress.run_id = progress.host, progress.run_id

    @workflow.run
    async def run(self, spec: AgentRunSpec) -> AgentRunOutcome:
        self._progress.state = STATE_VALIDATING
        try:
            host = await workflow.execute_activity(
                VALIDATE_GRANT,
                spec,
                result_type=str,
                start_to_close_timeout=SHORT_ACTIVITY_TIMEOUT,
                retry_policy=_retry(SHORT_ATTEMPTS),
                cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
            )
        except (ActivityError, asyncio.CancelledError) as exc:
            if _was_cancelled(exc):
                return await self._end(
                    AgentRunOutcome(
                        ok=False,
                        error_code=ERROR_CANCELLED,
                        message="the workflow was cancelled before the run started",
                    ),
                    STATE_CANCELLED,
                )
            cause = exc.cause if isinstance(exc, ActivityError) else None
            if not isinstance(cause, ApplicationError) or cause.type not in (
                ERROR_TYPE_AUTHZ,
                ERROR_TYPE_INVALID_SPEC,
            ):
                raise
            refused = AgentRunOutcome(
                ok=False,
                error_code=ERROR_AUTHZ_DENIED if cause.type == ERROR_TYPE_AUTHZ else "bad_request",
                message=cause.message,
            )
            return await self._end(refused, STATE_REFUSED, refused=True)
        if workflow.cancellation_reason() is not None:
            # Cancelled while the grant was checked (that activity never sees it).
            return await self._end(
                AgentRunOutcome(
                    ok=False,
                    error_code=ERROR_CANCELLED,
                    message="the workflow was cancelled before the run started",
                    host=host,
                ),
                STATE_CANCELLED,
            )
        self._progress.state, self._progress.host = STATE_RUNNING, host
        try:
            outcome = await workflow.execute_activity(
                EXECUTE_RUN,
                spec,
                result_type=AgentRunOutcome,
                start_to_close_timeout=timedelta(seconds=spec.wall_time_sec) + EXECUTE_OVERHEAD,
                heartbeat_timeout=HEARTBEAT_TIMEOUT,
                retry_policy=_retry(EXECUTE_ATTEMPTS),
                # The activity ends the run and returns what it did: wait for that.
                cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
            )
        except (ActivityError, asyncio.CancelledError) as exc:
            if _was_cancelled(exc) and workflow.cancellation_reason() is not None:
                # Cancelled while no attempt ran (queued behind busy workers, or waiting
                # to be retried): no run, no sandbox; the outcome says so all the same.
                return await self._end(
                    AgentRunOutcome(
                        ok=False,
                        error_code=ERROR_CANCELLED,
                        message="the workflow was cancelled while the run waited for a worker",
                        host=host,
                    ),
                    STATE_CANCELLED,
                )
            # Every attempt failed (or one could not run the spec): recorded, then the
            # workflow fails with the activity's error for its caller to read.
            cause = exc.cause if isinstance(exc, ActivityError) else None
            failed = AgentRunOutcome(
                ok=False,
                error_code="internal",
                message=cause.message if isinstance(cause, FailureError) else str(exc),
                host=host,
            )
            await self._end(failed, STATE_DONE)
            raise
        self._progress.host, self._progress.run_id = outcome.host, outcome.run_id
        if outcome.error_code != ERROR_CANCELLED and workflow.cancellation_reason() is not None:
            # The run finished as the cancellation came: it stands, but nothing is pushed.
            outcome.ok, outcome.error_code = False, ERROR_CANCELLED
            outcome.message = "the workflow was cancelled as the run finished; nothing pushed"
        if outcome.error_code == ERROR_CANCELLED:
            return await self._end(outcome, STATE_CANCELLED)
        if outcome.ok and spec.push and outcome.patches:
            self._progress.state = STATE_PUSHING
            # The branch is the workflow's, not the attempt's: a retried push finds it.
            branch = spec.branch or f"cogni/{outcome.run_id}"
            try:
                pushed = await workflow.execute_activity(
                    PUSH_BRANCH,
                    PushRequest(spec.repo, spec.sha, outcome.patches, branch, outcome.run_id),
                    result_type=PushOutcome,
                    start_to_close_timeout=PUSH_TIMEOUT,
                    # A dead worker's push is retried soon (the branch lease makes the
                    # retry safe even if the first push went through).
                    heartbeat_timeout=HEARTBEAT_TIMEOUT,
                    retry_policy=_retry(SHORT_ATTEMPTS),
                    cancellation_type=(
                        workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED
                    ),
                )
            except ActivityError as exc:
                cause = exc.cause
                outcome.ok, outcome.error_code = False, "internal"
                outcome.message = cause.message if isinstance(cause, ApplicationError) else str(exc)
            else:
                outcome.branch, outcome.head_sha, outcome.pushed = (
                    pushed.branch,
                    pushed.head_sha,
                    True,
                )
        return await self._end(outcome, STATE_DONE)

    async def _end(
        self, outcome: AgentRunOutcome, state: str, *, refused: bool = False
    ) -> AgentRunOutcome:
        self._progress.state = STATE_RECORDING
        await workflow.execute_activity(
            RECORD_RUN_COMPLETE,
            RunRecord(workflow.info().workflow_id, outcome, refused),
            start_to_close_timeout=SHORT_ACTIVITY_TIMEOUT,
            retry_policy=_retry(SHORT_ATTEMPTS),
            cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
        )
        self._progress.state = state
        return outcome
