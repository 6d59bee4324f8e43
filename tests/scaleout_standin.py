"""A stand-in ``AgentRunWorkflow`` for the clients' tests: registered under the real
workflow's type name, taking and giving the real spec and outcome, with no activity
and no sandbox, so the clients (CLI, control socket) are tested against a real
Temporal server in well under a second per run. The real workflow and worker are
tests/integration/test_scaleout.py's and the credentials test's.

What it does is said by the task: ``echo`` completes at once with the spec it received
in ``logs`` (as JSON); ``hold`` waits until cancelled and then completes with a
cancelled outcome (as the real workflow does); ``fail`` fails the workflow.

Its own module, importing only temporalio and gatewayd.scaleout.spec: the SDK's
workflow sandbox re-imports the module a workflow is defined in.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from temporalio import workflow
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

with workflow.unsafe.imports_passed_through():
    from gatewayd.scaleout.spec import AgentRunOutcome, AgentRunSpec

HOST = "standin-host"


@workflow.defn(name="AgentRunWorkflow")
class StandInAgentRunWorkflow:
    def __init__(self) -> None:
        self._state = "queued"

    @workflow.run
    async def run(self, spec: AgentRunSpec) -> AgentRunOutcome:
        if spec.task_input == "fail":
            raise ApplicationError("the stand-in failed", type="task_failed", non_retryable=True)
        if spec.task_input == "hold":
            self._state = "running"
            try:
                await workflow.wait_condition(lambda: False)
            except asyncio.CancelledError:
                self._state = "cancelled"
                return AgentRunOutcome(
                    ok=False, error_code="cancelled", host=HOST, logs=["cancelled"]
                )
        self._state = "done"
        return AgentRunOutcome(
            ok=True,
            run_id="0" * 32,
            host=HOST,
            audit_head="ab" * 32,
            audit_seq=7,
            bundle={"patches": [], "commitMessages": []},
            logs=[json.dumps(dataclasses.asdict(spec))],
        )

    @workflow.query
    def progress(self) -> dict[str, Any]:
        return {"state": self._state, "turn": 0, "tool": None, "host": HOST}


@workflow.defn(name="SomeOtherWorkflow")
class SomeOtherWorkflow:
    """Another team's workflow in the same namespace: never the clients' to touch."""

    @workflow.run
    async def run(self) -> str:
        await workflow.wait_condition(lambda: False)
        return "never"


@contextmanager
def standin_worker(address: str, namespace: str, task_queue: str) -> Iterator[None]:
    """A worker of the stand-in workflows polling ``task_queue``, on an asyncio loop of
    its own thread (the tests are sync, under trio's pytest mode)."""
    ready = threading.Event()
    stop: list[asyncio.Event] = []
    failed: list[BaseException] = []

    async def main() -> None:
        try:
            client = await Client.connect(address, namespace=namespace)
            stop.append(asyncio.Event())
            async with Worker(
                client,
                task_queue=task_queue,
                workflows=[StandInAgentRunWorkflow, SomeOtherWorkflow],
            ):
                ready.set()
                await stop[0].wait()
        except BaseException as exc:
            failed.append(exc)
            ready.set()
            raise

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    ready.wait(60)
    if failed:
        raise RuntimeError(f"the stand-in worker did not start: {failed[0]!r}")
    try:
        yield
    finally:
        loop.call_soon_threadsafe(stop[0].set)
        thread.join(30)
        loop.close()
