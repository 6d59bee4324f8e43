"""`gatewayd worker`: this host's gatewayd, executing agent run workflows from a Temporal
task queue.

One process holds both halves: gatewayd (trio, the main thread: runs, sandboxes, the
audit log, signals) and Temporal's worker (asyncio, a thread of its own: it polls the
task queue and runs the workflow code and the activities, which call into gatewayd
through :class:`~gatewayd.scaleout.activities.WorkerHost`).

- The worker polls only while the host's sandbox probe passes: the probe runs at start
  and every ``PROBE_INTERVAL_S``; when it fails the Temporal worker is shut down (no
  more polling; the runs in progress get the shutdown grace to finish, then are ended
  and retried elsewhere), and a new one starts once it passes. A host whose probe failed
  at start never polls: its gatewayd set up no sandbox then (its runs would run without
  one), so it must be restarted once the host is fixed.
- At most ``max_runs`` activities at once (default: from the host's cores and memory).
- SIGTERM or SIGINT: polling stops, running activities get ``GRACEFUL_SHUTDOWN`` to
  finish; those still running then are ended (sandbox killed, audited) and fail, so
  Temporal runs them again on another worker. A failure on gatewayd's side stops the
  Temporal worker the same way, so the process never polls with its gatewayd gone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Final

import structlog
import trio
from temporalio.client import Client
from temporalio.worker import Worker

from gatewayd.config import GatewaydConfig
from gatewayd.daemon import Daemon, open_daemon
from gatewayd.sandbox.support import SandboxSupport, probe_os_sandbox
from gatewayd.sandbox.uids import UidPoolExhausted
from gatewayd.scaleout.activities import (
    DEFAULT_GIT_TOKEN_ENV,
    HEARTBEAT_INTERVAL_S,
    AgentRunActivities,
    WorkerHost,
)
from gatewayd.scaleout.workflow import AgentRunWorkflow

log = structlog.get_logger("gatewayd.scaleout")

# How often the sandbox probe runs again while the worker runs: a host whose sandbox
# broke (bwrap removed, user namespaces turned off) stops taking runs within this.
PROBE_INTERVAL_S: Final = 60.0
# What one agent run needs of the host, to size the default number of runs at once: a
# core for its commands, and the sandbox's default memory (agent run's --max-memory-mb).
RUN_MEMORY_BYTES: Final = 2048 << 20
# On stop, running activities get this long to finish before they are ended (and
# retried elsewhere).
GRACEFUL_SHUTDOWN: Final = timedelta(seconds=30)
# Threads of the bridge into gatewayd: one per running run (held for its whole run),
# plus a few for the short calls (audit entries, cancellation, pushes).
BRIDGE_SPARE_THREADS: Final = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerOptions:
    address: str  # host:port of Temporal's frontend
    namespace: str
    task_queue: str
    max_runs: int
    host: str  # this host's name in outcomes
    git_token_env: str = DEFAULT_GIT_TOKEN_ENV
    git_username: str = "x-access-token"
    probe_interval_s: float = PROBE_INTERVAL_S
    shutdown_grace: timedelta = GRACEFUL_SHUTDOWN


def default_max_runs(cpus: int | None = None, memory_bytes: int | None = None) -> int:
    """Runs at once from the host's size: one per core, as many as its memory holds at
    the default sandbox memory; at least one."""
    cpus = cpus if cpus is not None else len(os.sched_getaffinity(0))
    if memory_bytes is None:
        memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, min(cpus, memory_bytes // RUN_MEMORY_BYTES))


def default_host_name() -> str:
    return socket.gethostname()


class TemporalUnreachable(Exception):
    """The worker could not connect to Temporal; the message says where it tried."""


class _Gate:
    """Whether the worker may poll (the probe passes) and whether it should stop; set
    on the trio thread, awaited on asyncio's."""

    def __init__(self, loop: asyncio.AbstractEventLoop, probe: SandboxSupport) -> None:
        self.loop = loop
        self.changed = asyncio.Event()
        # The start-up probe's answer from the start: no "not polling" line before it.
        self.probe_ok, self.reason = probe.available, probe.reason
        self.stopping = False

    def set(self, *, probe: SandboxSupport | None = None, stop: bool = False) -> None:
        def apply() -> None:
            if probe is not None:
                self.probe_ok, self.reason = probe.available, probe.reason
            self.stopping = self.stopping or stop
            self.changed.set()

        # RuntimeError: the loop is closed, the Temporal worker has stopped already.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(apply)

    def may_poll(self) -> bool:
        return self.probe_ok

    async def wait(self) -> None:
        await self.changed.wait()
        self.changed.clear()


async def _probe(daemon: Daemon) -> SandboxSupport:
    """The start-up sandbox probe again (gatewayd.runs.startup), on this daemon's uids
    and namespace prefix. Never passes when the start-up probe failed: that gatewayd set
    up no sandbox (its runs would run without one, or not at all) until restarted."""
    config = daemon.config
    if not config.os_sandbox:
        return SandboxSupport(False, "the OS sandbox is turned off (os_sandbox: false)")
    if daemon.runs.sandbox_settings is None:
        return SandboxSupport(
            False,
            f"{daemon.runs.support.reason} (found when this worker started; restart it "
            "once the host is fixed)",
        )
    try:
        user = daemon.runs.uid_pool.acquire()
    except UidPoolExhausted as exc:
        return SandboxSupport(False, f"the probe found no free sandbox uid: {exc}")
    try:
        return await trio.to_thread.run_sync(
            probe_os_sandbox, config.bwrap, user, config.resolved_netns_prefix
        )
    finally:
        # Its bwrap has exited; what it started may still be dying: looked at again
        # before the uid is lent.
        daemon.runs.uid_pool.release(user, processes_gone=False)


async def serve_worker(
    config: GatewaydConfig,
    options: WorkerOptions,
    *,
    say: Callable[[str], None] | None = None,
) -> None:
    """Run this host's worker until SIGTERM/SIGINT. ``say``: one line per state change
    (polling, paused and why, stopping), for the operator."""
    tell = say or (lambda line: print(f"gatewayd worker: {line}", file=sys.stderr, flush=True))
    async with open_daemon(config, preload=True) as daemon:
        loop_ready = threading.Event()
        holder: dict[str, _Gate] = {}
        pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=options.max_runs + BRIDGE_SPARE_THREADS,
            thread_name_prefix="gatewayd-worker-bridge",
        )
        host = WorkerHost(
            runs=daemon.runs,
            dispatcher=daemon.dispatcher,
            host=options.host,
            trio_token=trio.lowlevel.current_trio_token(),
            pool=pool,
            mcp=daemon.mcp_tools,
            folder_tools=tuple(tool.name for tool in daemon.tool_folders.tools),
            git_token_env=options.git_token_env,
            git_username=options.git_username,
        )

        def temporal_thread() -> None:
            async def main() -> None:
                gate = _Gate(asyncio.get_running_loop(), daemon.runs.support)
                holder["gate"] = gate
                loop_ready.set()
                await _poll_while_allowed(options, host, gate, tell)

            asyncio.run(main())

        try:
            async with trio.open_nursery() as nursery:

                async def run_temporal() -> None:
                    try:
                        await trio.to_thread.run_sync(temporal_thread)
                    finally:
                        nursery.cancel_scope.cancel()

                nursery.start_soon(run_temporal)
                await trio.to_thread.run_sync(loop_ready.wait)
                gate = holder["gate"]

                async def reprobe() -> None:
                    while True:
                        await trio.sleep(options.probe_interval_s)
                        gate.set(probe=await _probe(daemon))

                async def on_signal() -> None:
                    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                        async for _ in signals:
                            tell(
                                "stopping: no more polling; running runs get "
                                f"{options.shutdown_grace.total_seconds():g} s"
                            )
                            gate.set(stop=True)

                async def stop_polling_when_cancelled() -> None:
                    # The nursery is cancelled when the Temporal thread ended, and when a
                    # task here failed: then the thread must end too (the nursery waits
                    # for it), and with it the polling.
                    try:
                        await trio.sleep_forever()
                    finally:
                        gate.set(stop=True)

                nursery.start_soon(reprobe)
                nursery.start_soon(on_signal)
                nursery.start_soon(stop_polling_when_cancelled)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)


async def _poll_while_allowed(
    options: WorkerOptions, host: WorkerHost, gate: _Gate, tell: Callable[[str], None]
) -> None:
    """Connect, then run a Temporal worker while the probe passes, until stopped."""
    try:
        client = await Client.connect(
            options.address, namespace=options.namespace, identity=_identity(options)
        )
    except RuntimeError as exc:  # the SDK's "Failed client connect: ..."
        raise TemporalUnreachable(
            f"cannot reach Temporal at {options.address} (namespace {options.namespace}): "
            f"{exc}; check --temporal and --namespace, and that the server runs"
        ) from None
    activities = AgentRunActivities(host)
    await _serve(options, client, activities, gate, tell)
    tell("stopped")


async def _serve(
    options: WorkerOptions,
    client: Client,
    activities: AgentRunActivities,
    gate: _Gate,
    tell: Callable[[str], None],
) -> None:
    while not gate.stopping:
        if not gate.may_poll():
            told = gate.reason
            tell(f"not polling {options.task_queue}: the sandbox probe fails: {told}")
            while not gate.stopping and not gate.may_poll():
                await gate.wait()
                if not gate.may_poll() and gate.reason != told:
                    told = gate.reason
                    tell(f"not polling {options.task_queue}: the sandbox probe fails: {told}")
            continue
        worker = Worker(
            client,
            task_queue=options.task_queue,
            workflows=[AgentRunWorkflow],
            activities=activities.all(),
            max_concurrent_activities=options.max_runs,
            graceful_shutdown_timeout=options.shutdown_grace,
            # Heartbeats (and so cancellations) reach the server at the activity's pace.
            max_heartbeat_throttle_interval=timedelta(seconds=HEARTBEAT_INTERVAL_S),
            default_heartbeat_throttle_interval=timedelta(seconds=HEARTBEAT_INTERVAL_S),
            identity=_identity(options),
        )
        async with worker:
            tell(
                f"polling {options.task_queue} on {options.address} "
                f"(namespace {options.namespace}) as {options.host}, "
                f"at most {options.max_runs} run(s) at once"
            )
            while not gate.stopping and gate.may_poll():
                await gate.wait()
            # Leaving the block shuts the worker down: polling stops, running
            # activities get the graceful shutdown time.


def _identity(options: WorkerOptions) -> str:
    return f"{options.host}/{os.getpid()}"
