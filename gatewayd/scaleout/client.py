"""Clients of agent runs on Temporal: submit one, read its status and result, cancel it.

An agent run submitted here is a Temporal workflow (``AgentRunWorkflow``, run by the
gatewayd workers of :mod:`gatewayd.scaleout.worker`); this module only talks to the
Temporal frontend, over the maintained SDK (``temporalio.client``). ``gatewayd agent
submit|status|result|cancel`` call the four coroutines below in ``asyncio.run``; the
control socket (trio) calls them through :class:`AgentRunsService`, which keeps one
Temporal connection on an asyncio loop of its own thread, because the SDK's client is
asyncio's and gatewayd's daemon is trio's (docs/scale-out.md).

What a submission may carry, and the errors, are :mod:`gatewayd.scaleout.submission`'s
(no credential ever: the history keeps everything a client sends).

Only workflows of this kind are answered: a workflow id must be ``agent-run-`` and 32
hex digits, and a workflow of another type under such an id is "not found", so the
control socket cannot read or cancel any other workflow of the namespace.

Error handling: every failure is an :class:`AgentRunsError` whose ``kind`` says whose
fault it is (the request, a missing or unfinished run, Temporal unreachable or slow)
and whose message says what to do.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from datetime import datetime, timedelta
from typing import Any, Final, TypeVar

import trio
from temporalio.client import (
    Client,
    WorkflowExecutionDescription,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowQueryFailedError,
    WorkflowQueryRejectedError,
)
from temporalio.common import WorkflowIDReusePolicy
from temporalio.exceptions import ApplicationError, CancelledError, FailureError
from temporalio.service import RPCError, RPCStatusCode

from gatewayd.scaleout.spec import PROGRESS_QUERY, WORKFLOW_NAME, AgentRunOutcome
from gatewayd.scaleout.submission import (
    AgentRunsError,
    AgentSubmission,
    ErrorKind,
    TemporalTarget,
    check_workflow_id,
    new_workflow_id,
)

# A frontend that has not answered a connect in this long is reported unreachable; a
# real cluster answers in milliseconds, and an operator's request must not hang.
CONNECT_TIMEOUT_S: Final = 10.0
# One call to the frontend (start, describe, cancel, a finished run's result).
RPC_TIMEOUT_S: Final = 10.0
# The progress query is answered by a worker: with none polling the queue it would
# wait for one, so the status is given without progress after this long.
QUERY_TIMEOUT_S: Final = 5.0

# The run result's error code of a workflow that ended without an outcome, by how it
# ended (an activity's own failure type, when it names one, says more).
_FAILED_CODES: Final[dict[WorkflowExecutionStatus, str]] = {
    WorkflowExecutionStatus.CANCELED: "cancelled",
    WorkflowExecutionStatus.TIMED_OUT: "timeout",
    WorkflowExecutionStatus.TERMINATED: "terminated",
}

_T = TypeVar("_T")


# --- the four operations (asyncio) -------------------------------------------------------


async def connect(target: TemporalTarget) -> Client:
    """A client of ``target``'s namespace. Error handling: UNREACHABLE when the
    frontend refuses or fails the connection, TIMEOUT when it does not answer."""
    try:
        return await asyncio.wait_for(
            Client.connect(
                target.address,
                namespace=target.namespace,
                connect_timeout=timedelta(seconds=CONNECT_TIMEOUT_S),
                identity=f"gatewayd-client@{_host_name()}",
            ),
            CONNECT_TIMEOUT_S + 1,
        )
    except TimeoutError:
        raise AgentRunsError(
            ErrorKind.TIMEOUT,
            f"Temporal at {target.address} did not answer within {CONNECT_TIMEOUT_S:.0f} s: "
            "check temporal_address (or --temporal) and that the frontend is up",
        ) from None
    except (RuntimeError, RPCError) as exc:
        raise AgentRunsError(
            ErrorKind.UNREACHABLE,
            f"cannot connect to Temporal at {target.address} (namespace "
            f"{target.namespace}): {_first_line(exc)}; check temporal_address (or "
            "--temporal) and that the frontend is up",
        ) from None


async def submit(client: Client, target: TemporalTarget, submission: AgentSubmission) -> str:
    """Start the workflow of one agent run; its workflow id."""
    workflow_id = new_workflow_id()
    with _translated(target, "start the agent run"):
        await client.start_workflow(
            WORKFLOW_NAME,
            submission.spec(),
            id=workflow_id,
            task_queue=target.task_queue,
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
            rpc_timeout=timedelta(seconds=RPC_TIMEOUT_S),
        )
    return workflow_id


async def status(client: Client, target: TemporalTarget, workflow_id: str) -> dict[str, Any]:
    """Where the run is: Temporal's status of its workflow and, while it runs, the
    worker's progress (``{state, turn, tool, host}``; null when no worker answered)."""
    handle, described = await _described(client, target, workflow_id)
    answer: dict[str, Any] = {
        "ok": True,
        "workflowId": workflow_id,
        "status": _status_name(described.status),
        "taskQueue": described.task_queue,
        "startTime": _iso(described.start_time),
        "closeTime": _iso(described.close_time),
        "progress": None,
    }
    if described.status == WorkflowExecutionStatus.RUNNING:
        try:
            progress = await handle.query(
                PROGRESS_QUERY, rpc_timeout=timedelta(seconds=QUERY_TIMEOUT_S)
            )
        except (RPCError, WorkflowQueryFailedError, WorkflowQueryRejectedError) as exc:
            answer["progressError"] = (
                f"no worker answered the progress query within {QUERY_TIMEOUT_S:.0f} s "
                f"({_first_line(exc)}); the run is queued or its worker is busy or gone"
            )
        else:
            answer["progress"] = progress if isinstance(progress, dict) else None
    return answer


async def result(
    client: Client, target: TemporalTarget, workflow_id: str, *, wait: bool = False
) -> dict[str, Any]:
    """The run's result once it has ended: its outcome (``ok``, the bundle, logs, the
    audit bundle, ``errorCode``, the host and its audit chain's head) when the workflow
    completed; ``ok`` false with Temporal's status and message when it failed, was
    cancelled, terminated or timed out. ``wait``: wait for the end (else CONFLICT while
    it runs)."""
    handle, described = await _described(client, target, workflow_id)
    if described.status == WorkflowExecutionStatus.RUNNING and not wait:
        raise AgentRunsError(
            ErrorKind.CONFLICT,
            f"agent run {workflow_id} has not finished (status running): ask again "
            "later, or wait for it (gatewayd agent result --wait)",
        )
    try:
        with _translated(target, "read the agent run's result"):
            outcome = await handle.result(
                rpc_timeout=None if wait else timedelta(seconds=RPC_TIMEOUT_S),
            )
    except WorkflowFailureError as exc:
        # Read again for the status it ended with: Temporal can fail this call too.
        with _translated(target, f"look up agent run {workflow_id}", workflow_id=workflow_id):
            described = await handle.describe(rpc_timeout=timedelta(seconds=RPC_TIMEOUT_S))
        return _failure_json(workflow_id, described.status, exc.cause)
    return {
        "workflowId": workflow_id,
        "status": "completed",
        **outcome_json(outcome),
    }


async def cancel(client: Client, target: TemporalTarget, workflow_id: str) -> dict[str, Any]:
    """Ask for the run's cancellation: its worker ends the run (sandbox killed,
    audited) and the workflow ends with the partial result. CONFLICT when it has
    already ended."""
    handle, described = await _described(client, target, workflow_id)
    if described.status != WorkflowExecutionStatus.RUNNING:
        raise AgentRunsError(
            ErrorKind.CONFLICT,
            f"agent run {workflow_id} has already ended "
            f"(status {_status_name(described.status)}); nothing to cancel",
        )
    with _translated(target, "cancel the agent run"):
        await handle.cancel(rpc_timeout=timedelta(seconds=RPC_TIMEOUT_S))
    return {"ok": True, "workflowId": workflow_id, "cancelRequested": True}


def outcome_json(outcome: AgentRunOutcome) -> dict[str, Any]:
    """The outcome with the run spec's camelCase names (``errorCode``, ``auditHead``...)."""
    return {_camel(name): value for name, value in dataclasses.asdict(outcome).items()}


# --- for the daemon: the same from trio ----------------------------------------------------


class AgentRunsService:
    """The four operations for a trio caller (the control socket), over one connection
    to Temporal kept by an asyncio loop in a thread of its own.

    Resource handling: made and closed by :func:`open_agent_runs`; the connection is
    made on the first request (a Temporal down at gatewayd's start does not stop
    gatewayd) and made again on a later request after a failed one. A trio caller
    cancelled while waiting cancels its coroutine on the loop.
    """

    def __init__(self, target: TemporalTarget, loop: asyncio.AbstractEventLoop) -> None:
        self.target = target
        self._loop = loop
        self._client: Client | None = None
        self._connecting = asyncio.Lock()  # one connection, however many ask at once

    async def _client_now(self) -> Client:
        async with self._connecting:
            if self._client is None:
                self._client = await connect(self.target)
            return self._client

    async def _run(self, make: Callable[[Client], Awaitable[_T]]) -> _T:
        async def call() -> _T:
            return await make(await self._client_now())

        future = asyncio.run_coroutine_threadsafe(call(), self._loop)
        done = trio.Event()
        token = trio.lowlevel.current_trio_token()

        def wake(_: object) -> None:
            # A trio run that has ended has no one waiting any more.
            with suppress(trio.RunFinishedError):
                token.run_sync_soon(done.set)

        future.add_done_callback(wake)
        try:
            await done.wait()
        except trio.Cancelled:
            future.cancel()
            raise
        return future.result()

    async def submit(self, submission: AgentSubmission) -> str:
        return await self._run(lambda client: submit(client, self.target, submission))

    async def status(self, workflow_id: str) -> dict[str, Any]:
        return await self._run(lambda client: status(client, self.target, workflow_id))

    async def result(self, workflow_id: str) -> dict[str, Any]:
        return await self._run(lambda client: result(client, self.target, workflow_id))

    async def cancel(self, workflow_id: str) -> dict[str, Any]:
        return await self._run(lambda client: cancel(client, self.target, workflow_id))


@asynccontextmanager
async def open_agent_runs(target: TemporalTarget) -> AsyncIterator[AgentRunsService]:
    """An :class:`AgentRunsService` for ``target``, its asyncio loop's thread stopped
    (requests still on it cancelled) on exit."""
    ready = threading.Event()
    loops: list[asyncio.AbstractEventLoop] = []
    stop: list[asyncio.Event] = []

    async def main() -> None:
        stop.append(asyncio.Event())
        loops.append(asyncio.get_running_loop())
        ready.set()
        await stop[0].wait()

    thread = threading.Thread(target=asyncio.run, args=(main(),), name="gatewayd-temporal")
    thread.daemon = True  # never keeps a stopping gatewayd alive
    thread.start()
    await trio.to_thread.run_sync(ready.wait)
    try:
        yield AgentRunsService(target, loops[0])
    finally:
        with trio.CancelScope(shield=True):
            loops[0].call_soon_threadsafe(stop[0].set)
            # asyncio.run cancels the tasks still on the loop, then returns.
            await trio.to_thread.run_sync(thread.join)


# --- small pieces --------------------------------------------------------------------------


async def _described(
    client: Client, target: TemporalTarget, workflow_id: str
) -> tuple[WorkflowHandle[Any, Any], WorkflowExecutionDescription]:
    """The handle of the agent run ``workflow_id`` and its description; NOT_FOUND when
    there is none, or the workflow under that id is not an agent run."""
    check_workflow_id(workflow_id)
    handle = client.get_workflow_handle(workflow_id, result_type=AgentRunOutcome)
    with _translated(target, f"look up agent run {workflow_id}", workflow_id=workflow_id):
        described = await handle.describe(rpc_timeout=timedelta(seconds=RPC_TIMEOUT_S))
    if described.workflow_type != WORKFLOW_NAME:
        raise AgentRunsError(
            ErrorKind.NOT_FOUND, f"no agent run {workflow_id} in namespace {target.namespace}"
        )
    return handle, described


@contextmanager
def _translated(target: TemporalTarget, doing: str, *, workflow_id: str = "") -> Iterator[None]:
    """Temporal's errors as :class:`AgentRunsError`s, with what was being done."""
    where = f"Temporal at {target.address} (namespace {target.namespace})"
    try:
        yield
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND and workflow_id:
            raise AgentRunsError(
                ErrorKind.NOT_FOUND, f"no agent run {workflow_id} in namespace {target.namespace}"
            ) from None
        if exc.status == RPCStatusCode.NOT_FOUND:  # the namespace
            raise AgentRunsError(
                ErrorKind.UNREACHABLE,
                f"could not {doing}: {where} says {_first_line(exc)}; check "
                "temporal_namespace (or --namespace)",
            ) from None
        if exc.status == RPCStatusCode.DEADLINE_EXCEEDED:
            raise AgentRunsError(
                ErrorKind.TIMEOUT,
                f"could not {doing}: {where} did not answer within {RPC_TIMEOUT_S:.0f} s",
            ) from None
        raise AgentRunsError(
            ErrorKind.UNREACHABLE, f"could not {doing}: {where}: {_first_line(exc)}"
        ) from None
    except RuntimeError as exc:  # the SDK's bridge: a connection lost and not regained
        raise AgentRunsError(
            ErrorKind.UNREACHABLE, f"could not {doing}: {where}: {_first_line(exc)}"
        ) from None


def _failure_json(
    workflow_id: str, state: WorkflowExecutionStatus | None, cause: BaseException
) -> dict[str, Any]:
    """A run whose workflow did not complete: ``ok`` false, Temporal's status, the
    failure's message and, when the workflow attached one, its partial outcome."""
    answer: dict[str, Any] = {
        "workflowId": workflow_id,
        "status": _status_name(state),
        "ok": False,
        "errorCode": "task_failed" if state is None else _FAILED_CODES.get(state, "task_failed"),
        "message": _first_line(cause),
    }
    details: tuple[Any, ...] = ()
    if isinstance(cause, ApplicationError | CancelledError):
        details = tuple(cause.details)
        if isinstance(cause, ApplicationError) and cause.type:
            answer["errorCode"] = cause.type
    while not details and isinstance(cause, FailureError) and cause.cause is not None:
        cause = cause.cause  # an activity's failure carries the activity's details
        if isinstance(cause, ApplicationError | CancelledError):
            details = tuple(cause.details)
    if details and isinstance(details[0], dict):
        answer["partial"] = {_camel(key): value for key, value in details[0].items()}
    return answer


def _status_name(state: WorkflowExecutionStatus | None) -> str:
    return "unknown" if state is None else state.name.lower()


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat()


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:500]


def _host_name() -> str:
    return socket.gethostname()
