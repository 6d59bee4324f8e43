"""The daemon: one audit log, one run registry, one dispatcher, and a nursery that owns
every run's listener. Used by `gatewayd serve` (with the control socket) and by
`gatewayd run` (one run, then exit).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import trio

from gatewayd.audit import AuditLog, AuditWriteError, open_audit_log
from gatewayd.dispatch import Dispatcher
from gatewayd.errors import AuthzDenied
from gatewayd.policy import PolicyError
from gatewayd.protocol import DEFAULT_MAX_FRAME_BYTES, ErrorCode
from gatewayd.runs import PolicyLoader, Run, RunRegistry, RunRequest, RunState
from gatewayd.server import serve_run
from gatewayd.tools import builtin_tools
from gatewayd.tools.registry import ToolSpec

log = structlog.get_logger("gatewayd.daemon")

DEFAULT_STATE_DIR = Path("/var/lib/gatewayd")
# Shipped policies, next to the package in a source checkout.
SHIPPED_POLICY_DIR = Path(__file__).resolve().parent.parent / "policies"


@dataclass(frozen=True, kw_only=True)
class DaemonConfig:
    state_dir: Path = DEFAULT_STATE_DIR
    audit_path: Path | None = None  # default: <state_dir>/audit/audit.jsonl
    policy_dirs: tuple[Path, ...] = field(
        default_factory=lambda: (SHIPPED_POLICY_DIR, SHIPPED_POLICY_DIR / "examples")
    )
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    audit_fsync: bool = True

    @property
    def resolved_audit_path(self) -> Path:
        return self.audit_path or self.state_dir / "audit" / "audit.jsonl"


class Daemon:
    """Creates, serves and ends runs. Every run's listener lives in ``self._nursery``."""

    def __init__(
        self,
        config: DaemonConfig,
        audit: AuditLog,
        nursery: trio.Nursery,
        *,
        tools: dict[str, ToolSpec[Any]] | None = None,
    ) -> None:
        self.config = config
        self.audit = audit
        self.registry = RunRegistry(
            config.state_dir, policy_loader=PolicyLoader(config.policy_dirs)
        )
        self.dispatcher = Dispatcher(audit, builtin_tools() if tools is None else tools)
        self._nursery = nursery

    async def start_run(self, request: RunRequest) -> Run:
        """Create a run and start serving its socket. Refusals are audited, then raised.

        Error handling: AuthzDenied (no sandbox grant), PolicyError (bad policy),
        ValueError (bad workspace), OSError (gatewayd could not make the run's files);
        each is recorded as a ``run_refused`` event with the matching code.
        """
        try:
            run = self.registry.create(request)
        except Exception as exc:
            await self.audit.append(
                "event",
                event="run_refused",
                errorCode=str(_refusal_code(exc)),
                safeMessage=str(exc),
                detail={
                    "actorId": request.actorId,
                    "tenantId": request.tenantId,
                    "policy": request.policy,
                    "workspacePath": request.workspacePath,
                    "allowSandbox": request.grant.allowSandbox,
                },
            )
            raise
        await self.audit.append(
            "event",
            event="run_created",
            runId=run.run_id,
            detail={
                "actorId": request.actorId,
                "tenantId": request.tenantId,
                "policy": run.spec.policy.name,
                "policySource": run.spec.policy_source,
                "workspace": str(run.spec.workspace),
                "toolIds": list(request.toolIds) if request.toolIds is not None else None,
            },
        )
        try:
            await self._nursery.start(self._serve, run)
        except BaseException:
            run.move_to(RunState.FAILED)
            self.registry.remove(run)
            raise
        log.info("run_started", run_id=run.run_id, policy=run.spec.policy.name)
        return run

    async def _serve(self, run: Run, *, task_status: trio.TaskStatus[None]) -> None:
        max_runtime = run.spec.request.limits.maxRuntimeSec
        try:
            with trio.move_on_after(max_runtime) as scope:
                await serve_run(
                    run,
                    self.dispatcher,
                    max_frame_bytes=self.config.max_frame_bytes,
                    task_status=task_status,
                )
            if scope.cancelled_caught:
                run.end_reason = "max_runtime_exceeded"
                log.warning("run_max_runtime", run_id=run.run_id, seconds=max_runtime)
        finally:
            with trio.CancelScope(shield=True):
                await self._finish(run)

    async def end_run(self, run_id: str, reason: str = "ended") -> dict[str, Any] | None:
        """Stop serving a run and remove its socket; returns its final summary."""
        run = self.registry.get(run_id)
        if run is None:
            return None
        run.end_reason = reason
        run.cancel_scope.cancel()
        await run.finished.wait()
        return run.summary()

    async def _finish(self, run: Run) -> None:
        if run.state in (RunState.CREATED, RunState.SERVING):
            run.move_to(RunState.ENDING)
        self.registry.remove(run)
        run.move_to(RunState.ENDED)  # from ENDING, or from FAILED
        try:
            await self.audit.append(
                "event",
                event="run_ended",
                runId=run.run_id,
                detail={"reason": run.end_reason, **_counts(run)},
            )
        except AuditWriteError:
            log.error("run_end_not_audited", run_id=run.run_id, reason=run.end_reason)
        finally:
            run.finished.set()
            log.info("run_ended", run_id=run.run_id, reason=run.end_reason)

    async def aclose(self) -> None:
        """End every run (used at shutdown)."""
        for run in self.registry.all():
            await self.end_run(run.run_id, reason="daemon_stopping")


def _refusal_code(exc: Exception) -> ErrorCode:
    """Whose fault a refused run was: the grant, the request, or gatewayd itself."""
    if isinstance(exc, AuthzDenied):
        return ErrorCode.AUTHZ_DENIED
    if isinstance(exc, PolicyError | ValueError):
        return ErrorCode.BAD_REQUEST
    return ErrorCode.INTERNAL


def _counts(run: Run) -> dict[str, Any]:
    return {
        "calls": run.calls,
        "allowed": run.allowed,
        "denied": run.denied,
        "deniedByCode": dict(run.denied_by_code),
    }


@asynccontextmanager
async def open_daemon(
    config: DaemonConfig, *, tools: dict[str, ToolSpec[Any]] | None = None
) -> AsyncIterator[Daemon]:
    """A running daemon; on exit every run is ended and the audit log closed.

    ``tools`` replaces the built-in tool table (tests add deliberately slow or
    failing tools to reach the timeout and internal paths).
    """
    async with (
        open_audit_log(config.resolved_audit_path, fsync=config.audit_fsync) as audit,
        trio.open_nursery() as nursery,
    ):
        daemon = Daemon(config, audit, nursery, tools=tools)
        try:
            yield daemon
        finally:
            with trio.CancelScope(shield=True):
                await daemon.aclose()
            nursery.cancel_scope.cancel()
