"""The agent run workflow's activities, as one host's `gatewayd worker` runs them
(reference note 004's four: validate the grant, execute the run, push the branch,
record completion).

The activities are asyncio (Temporal's worker); the host's gatewayd — its runs, audit
log, sandboxes — is trio, in the worker's main thread. Every call into gatewayd crosses
with :meth:`WorkerHost.in_trio` (``trio.from_thread.run`` on a thread of the worker's own
pool, so a long run never starves asyncio's default executor).

Credentials stay here: the git token is read from the host's environment (or systemd
credential) when an activity needs it, and the model keys are the host's configuration;
neither is in an activity's input or result, so neither reaches Temporal's history.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Final, TypeVar

import structlog
import trio
from temporalio import activity
from temporalio.exceptions import ApplicationError

from gatewayd.agent.loop import run_agent
from gatewayd.agent.patches import check_branch, push_branch_from_patches
from gatewayd.agent.repo import (
    SHA_RE,
    RepoCredentials,
    RepoError,
    check_url,
    clone_at,
    fetch_mirror,
    ls_remote,
    run_git,
)
from gatewayd.agent.task import AgentLimits, AgentResult, AgentTask, RunCancel
from gatewayd.agent.workdir import make_work_dir, remove_tree
from gatewayd.audit.events import AuditEvent
from gatewayd.dispatch import Dispatcher
from gatewayd.mcp.tools import McpTools
from gatewayd.runs.lifecycle import RunManager
from gatewayd.scaleout.spec import (
    DEFAULT_MAX_PATCH_BYTES,
    ERROR_AUTHZ_DENIED,
    ERROR_CANCELLED,
    ERROR_TYPE_AUTHZ,
    ERROR_TYPE_INVALID_SPEC,
    ERROR_TYPE_PUSH_REFUSED,
    EXECUTE_RUN,
    LIMIT_MAX_MEMORY_MB,
    LIMIT_MAX_PATCH_BYTES,
    LIMIT_MAX_TOKENS,
    LIMIT_MAX_TURNS,
    LIMIT_MAX_WORKSPACE_BYTES,
    LIMIT_NAMES,
    LIMIT_WALL_TIME_SEC,
    PROGRESS_SIGNAL,
    PUSH_BRANCH,
    RECORD_RUN_COMPLETE,
    STATE_RUNNING,
    VALIDATE_GRANT,
    AgentRunOutcome,
    AgentRunSpec,
    Progress,
    PushOutcome,
    PushRequest,
    RunRecord,
)
from gatewayd.secrets import SecretError, SecretMissing, read_secret

log = structlog.get_logger("gatewayd.scaleout")

T = TypeVar("T")

# A push that failed for what may pass (the remote unreachable): retried.
ERROR_TYPE_PUSH_FAILED: Final = "PushFailed"
# git's time limits for a push's steps besides those of gatewayd.agent.repo's calls.
LS_REMOTE_TIMEOUT_S: Final = 60.0
LOCAL_GIT_TIMEOUT_S: Final = 60.0

# How often a running execute_run heartbeats (with the run's turn and tool). The
# workflow's heartbeat timeout is a few of these, so one slow beat is no failure.
HEARTBEAT_INTERVAL_S: Final = 2.0
# Progress reaches the workflow (its `progress` query) as a signal, each an event in the
# history: at most one per this many seconds, and only when the turn or tool changed.
PROGRESS_SIGNAL_MIN_INTERVAL_S: Final = 2.0
# The run's audit entries travel in the outcome (Temporal's history, whose payloads are
# limited to 2 MiB by default): past this many bytes they are left out, and the outcome
# says so; the reviewer reads them on the host (audit_head, audit_seq).
MAX_AUDIT_BUNDLE_BYTES: Final = 512 * 1024
# The outcome's logs: the last lines only, for the same reason.
MAX_LOG_LINES: Final = 500
DEFAULT_GIT_TOKEN_ENV: Final = "COGNI_GIT_TOKEN"  # noqa: S105 (a variable's name)
# The longest wall time a spec may ask for. The workflow turns it into the execute
# activity's timeout, which Temporal must be able to hold (a huge number would fail the
# workflow's task on every try, a stuck workflow); a run longer than a week is a mistake.
MAX_WALL_TIME_SEC: Final = 7 * 24 * 3600
# Why the worker ended a run that the workflow did not cancel (the worker stopping, the
# attempt timed out): a retryable failure, so Temporal runs it again on another worker.
ERROR_TYPE_RUN_INTERRUPTED: Final = "RunInterrupted"
# A turn line of the run's progress: "turn 3: exec {...} -> allow".
_TURN_RE: Final = re.compile(r"turn (\d+): ([A-Za-z0-9_.-]+)")


@dataclass
class WorkerHost:
    """The parts of the host's gatewayd the activities use, and how to reach them."""

    runs: RunManager
    dispatcher: Dispatcher
    host: str  # this host's name in outcomes and progress
    trio_token: trio.lowlevel.TrioToken
    pool: concurrent.futures.ThreadPoolExecutor
    mcp: McpTools | None = None
    folder_tools: tuple[str, ...] = ()
    git_token_env: str = DEFAULT_GIT_TOKEN_ENV
    git_username: str = "x-access-token"

    async def in_trio(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``await fn(*args)`` on gatewayd's trio thread, from asyncio."""
        call = functools.partial(trio.from_thread.run, fn, *args, trio_token=self.trio_token)
        return await asyncio.get_running_loop().run_in_executor(self.pool, call)

    async def in_trio_sync(self, fn: Callable[..., T], *args: Any) -> T:
        call = functools.partial(trio.from_thread.run_sync, fn, *args, trio_token=self.trio_token)
        return await asyncio.get_running_loop().run_in_executor(self.pool, call)

    def credentials(self) -> RepoCredentials:
        """The git token of this host (none: a public or local repository)."""
        try:
            token: str | None = read_secret(self.git_token_env, holds="the git token").value
        except SecretMissing:
            token = None
        except (SecretError, ValueError) as exc:
            raise ApplicationError(
                f"this worker's git token ({self.git_token_env}) cannot be read: {exc}",
                type=ERROR_TYPE_INVALID_SPEC,
                non_retryable=True,
            ) from None
        return RepoCredentials(token=token, username=self.git_username)


@dataclass
class _Tracker:
    """The run's progress as its lines tell it (written on the trio thread, read on
    asyncio's: single attribute stores)."""

    host: str
    turn: int = 0
    tool: str | None = None
    run_id: str = ""
    line: str = ""
    lines: list[str] = field(default_factory=list)

    def say(self, line: str) -> None:
        self.line = line[:200]
        if (m := _TURN_RE.match(line)) is not None:
            self.turn, self.tool = int(m.group(1)), m.group(2)
        elif line.startswith("run ") and " started " in line:
            self.run_id = line.split()[1]

    def progress(self) -> Progress:
        return Progress(
            state=STATE_RUNNING,
            turn=self.turn,
            tool=self.tool,
            host=self.host,
            run_id=self.run_id,
            line=self.line,
        )


def spec_problems(spec: AgentRunSpec, models: Any) -> list[str]:
    """What is wrong with ``spec`` for this host, each with its fix (empty: nothing)."""
    problems: list[str] = []
    if not SHA_RE.fullmatch(spec.sha):
        problems.append(f"sha must be a full lowercase hex commit id, not {spec.sha[:80]!r}")
    try:
        check_url(spec.repo, None)
    except RepoError as exc:
        problems.append(str(exc))
    if not spec.task_input.strip():
        problems.append("task_input is empty: say what the agent should do")
    if spec.model not in models:
        known = ", ".join(sorted(models)) or "none configured"
        problems.append(f"model alias {spec.model!r} is not configured on this host ({known})")
    unknown = sorted(set(spec.limits) - LIMIT_NAMES)
    if unknown:
        problems.append(f"unknown limits {unknown}: the limits are {sorted(LIMIT_NAMES)}")
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in spec.limits.values()):
        problems.append("limits must be whole numbers, 1 or more")
    elif spec.wall_time_sec > MAX_WALL_TIME_SEC:
        problems.append(
            f"{LIMIT_WALL_TIME_SEC} {spec.wall_time_sec} is over {MAX_WALL_TIME_SEC} "
            "(a week): split the task"
        )
    if spec.backend not in ("overlay", "host"):
        problems.append(f"backend {spec.backend!r} is not overlay or host")
    if spec.branch is not None:
        try:
            check_branch(spec.branch)
        except RepoError as exc:
            problems.append(str(exc))
    if spec.pull_request:
        problems.append("pull requests are not opened by workers yet; ask for push only")
    return problems


def _task(spec: AgentRunSpec, credentials: RepoCredentials) -> AgentTask:
    """The host's agent task for ``spec``: never pushed by the run itself (the push is
    its own activity, after the run, so a retried run never pushes)."""
    try:
        limits = AgentLimits(
            max_turns=spec.limit(LIMIT_MAX_TURNS, 40),
            max_tokens=spec.limit(LIMIT_MAX_TOKENS, 400_000),
            max_wall_s=float(spec.wall_time_sec),
        )
    except ValueError as exc:
        raise ApplicationError(str(exc), type=ERROR_TYPE_INVALID_SPEC, non_retryable=True) from None
    return AgentTask(
        repo_url=spec.repo,
        sha=spec.sha,
        task=spec.task_input,
        model=spec.model,
        policy=spec.policy,
        backend="host" if spec.backend == "host" else "overlay",
        push=False,
        credentials=credentials,
        limits=limits,
        actor=spec.actor_id,
        tenant=spec.tenant_id,
        max_memory_mb=spec.limit(LIMIT_MAX_MEMORY_MB, 2048),
        max_patch_bytes=spec.limit(LIMIT_MAX_PATCH_BYTES, DEFAULT_MAX_PATCH_BYTES),
        max_workspace_bytes=spec.limit(LIMIT_MAX_WORKSPACE_BYTES, 1 << 30),
        tool_ids=tuple(spec.tool_ids),
    )


def _why_cancelled(details: activity.ActivityCancellationDetails | None) -> str:
    if details is None:
        return "the activity was cancelled"
    if details.cancel_requested:
        return "the workflow was cancelled"
    if details.worker_shutdown:
        return "the worker is stopping"
    if details.timed_out:
        return "the attempt timed out (Temporal gave the run to another worker)"
    if details.not_found:
        return "the workflow is gone"
    return "Temporal ended the attempt (paused or reset)"


def outcome_of(result: AgentResult, host: str, attempt: int) -> AgentRunOutcome:
    entries = result.audit_log
    last = entries[-1] if entries else {}
    bundle: dict[str, Any] = {"entries": entries, "count": len(entries), "truncated": False}
    if len(json.dumps(entries)) > MAX_AUDIT_BUNDLE_BYTES:
        bundle = {"entries": [], "count": len(entries), "truncated": True}
    return AgentRunOutcome(
        ok=result.ok,
        error_code=result.error_code,
        message=result.message,
        run_id=result.run_id or "",
        host=host,
        audit_head=str(last.get("hash", "")),
        audit_seq=int(last.get("seq", 0)),
        bundle={"patches": result.patches, "commitMessages": result.commit_messages},
        logs=result.logs[-MAX_LOG_LINES:],
        audit_bundle=bundle,
        turns=result.turns,
        tokens=result.tokens,
        attempt=attempt,
    )


class AgentRunActivities:
    """The four activities, bound to one host's gatewayd."""

    def __init__(self, host: WorkerHost) -> None:
        self.host = host

    def all(self) -> list[Callable[..., Any]]:
        return [self.validate_grant, self.execute_run, self.push_branch, self.record_run_complete]

    async def _audit(self, **fields: Any) -> None:
        async def append() -> None:
            await self.host.runs.audit.append("event", **fields)

        await self.host.in_trio(append)

    @activity.defn(name=VALIDATE_GRANT)
    async def validate_grant(self, spec: AgentRunSpec) -> str:
        """Refuse a run without the system grant (``allowSandbox: true``) or whose spec
        this host cannot run; returns this host's name. A refusal is audited here and
        never retried."""
        detail = {
            "repo": spec.repo[:500],
            "sha": spec.sha[:80],
            "model": spec.model[:100],
            "workflowId": activity.info().workflow_id,
            "callerRunId": spec.run_id,
            "actorId": spec.actor_id[:200],
            "tenantId": spec.tenant_id[:200],
        }
        if spec.grant.get("allowSandbox") is not True:
            message = (
                "the run has no system grant for a sandbox (grant.allowSandbox is not true): "
                "agent runs need an ExecutionGrant with allowSandbox: true"
            )
            await self._audit(
                event=AuditEvent.AGENT_RUN_REFUSED,
                errorCode=ERROR_AUTHZ_DENIED,
                safeMessage=message,
                detail=detail,
            )
            raise ApplicationError(message, type=ERROR_TYPE_AUTHZ, non_retryable=True)
        problems = spec_problems(spec, self.host.runs.config.models)
        if problems:
            message = "the run spec cannot run here: " + "; ".join(problems)
            await self._audit(
                event=AuditEvent.AGENT_RUN_REFUSED,
                errorCode="bad_request",
                safeMessage=message[:2000],
                detail=detail,
            )
            raise ApplicationError(message, type=ERROR_TYPE_INVALID_SPEC, non_retryable=True)
        return self.host.host

    @activity.defn(name=EXECUTE_RUN)
    async def execute_run(self, spec: AgentRunSpec) -> AgentRunOutcome:
        """The host-owned run of ``gatewayd agent run`` (clone at the commit, sandboxed
        tool calls, the patch; no push), heartbeating its progress.

        A cancellation the workflow asked for ends the run (sandbox killed, audited) and
        returns its partial outcome (``cancelled``). Any other cancellation (this worker
        shutting down, the attempt timed out) ends the run and fails the attempt
        (``RunInterrupted``, retryable), so Temporal runs it again elsewhere, as a fresh
        run with a fresh run id.
        """
        host = self.host
        info = activity.info()
        task = _task(spec, host.credentials())
        tracker = _Tracker(host=host.host)
        cancel = RunCancel()

        async def go() -> AgentResult:
            return await run_agent(
                host.runs,
                host.dispatcher,
                task,
                tracker.say,
                mcp=host.mcp,
                folder_tools=host.folder_tools,
                cancel=cancel,
            )

        running = asyncio.ensure_future(host.in_trio(go))
        signalled: tuple[int, str | None] = (0, None)
        last_signal = 0.0
        try:
            while not running.done():
                await asyncio.wait({running}, timeout=HEARTBEAT_INTERVAL_S)
                progress = tracker.progress()
                activity.heartbeat(progress)
                now = time.monotonic()
                if (progress.turn, progress.tool) != signalled and (
                    now - last_signal >= PROGRESS_SIGNAL_MIN_INTERVAL_S
                ):
                    signalled, last_signal = (progress.turn, progress.tool), now
                    if info.workflow_id:
                        await self._signal_progress(info.workflow_id, progress)
        except asyncio.CancelledError:
            details = activity.cancellation_details()
            asked = details is not None and details.cancel_requested
            why = _why_cancelled(details)
            await host.in_trio_sync(cancel.cancel, why)
            result = await asyncio.shield(running)
            if not asked:
                # Not the workflow's wish: a failure (a bare CancelledError would be
                # reported as the activity cancelled, which Temporal never retries).
                raise ApplicationError(
                    f"run {result.run_id or '(not started)'} on {host.host} was ended: {why}; "
                    "Temporal runs it again, on another worker, as a fresh run",
                    type=ERROR_TYPE_RUN_INTERRUPTED,
                ) from None
            outcome = outcome_of(result, host.host, info.attempt)
            if outcome.error_code is None or outcome.ok:
                outcome.ok, outcome.error_code = False, ERROR_CANCELLED
            return outcome
        return outcome_of(running.result(), host.host, info.attempt)

    async def _signal_progress(self, workflow_id: str, progress: Progress) -> None:
        try:
            handle = activity.client().get_workflow_handle(workflow_id)
            # Bounded: the heartbeat loop waits for it, and a late beat looks like a
            # dead worker.
            await handle.signal(
                PROGRESS_SIGNAL, progress, rpc_timeout=timedelta(seconds=HEARTBEAT_INTERVAL_S)
            )
        except Exception as exc:  # progress is best effort: the run goes on
            log.warning("progress_signal_failed", workflow_id=workflow_id, error=str(exc))

    @activity.defn(name=PUSH_BRANCH)
    async def push_branch(self, request: PushRequest) -> PushOutcome:
        """Push ``request.patches`` onto ``request.sha`` as the new branch
        ``request.branch`` (never the default branch, never an existing branch: the push
        is create-only). A retry of a push whose worker died after pushing finds the
        branch holding exactly these patches and reports it pushed, pushing nothing."""
        host = self.host
        credentials = host.credentials()
        work, lock = await asyncio.get_running_loop().run_in_executor(
            host.pool, make_work_dir, host.runs.config.resolved_agent_dir
        )
        try:
            pushing = asyncio.get_running_loop().run_in_executor(
                host.pool,
                functools.partial(push_branch_once, request, credentials, work, host.host),
            )
            # Heartbeats, so a push whose worker died is retried within the heartbeat
            # timeout, not the push's whole timeout. A cancellation (the workflow's, or
            # this worker stopping) lets the push finish: a git push is not stopped
            # halfway, and the workflow must hear whether the branch now exists.
            while True:
                try:
                    await asyncio.wait({pushing}, timeout=HEARTBEAT_INTERVAL_S)
                except asyncio.CancelledError:
                    return await asyncio.shield(pushing)
                if pushing.done():
                    return pushing.result()
                activity.heartbeat()
        finally:
            await asyncio.get_running_loop().run_in_executor(host.pool, remove_tree, work)
            os.close(lock)

    @activity.defn(name=RECORD_RUN_COMPLETE)
    async def record_run_complete(self, record: RunRecord) -> None:
        """The workflow's final word on the run, in this host's audit log."""
        outcome = record.outcome
        await self._audit(
            event=AuditEvent.AGENT_WORKFLOW_COMPLETED,
            runId=outcome.run_id or None,
            detail={
                "workflowId": record.workflow_id,
                "host": outcome.host,
                "ok": outcome.ok,
                "errorCode": outcome.error_code,
                "branch": outcome.branch,
                "pushed": outcome.pushed,
                "headSha": outcome.head_sha,
                "auditHead": outcome.audit_head,
                "auditSeq": outcome.audit_seq,
                "attempt": outcome.attempt,
                "refused": record.refused,
            },
        )


def push_branch_once(
    request: PushRequest, credentials: RepoCredentials, work: Path, host: str
) -> PushOutcome:
    """Blocking: push the branch, or find that an earlier attempt pushed exactly it.

    Error handling: ApplicationError, never retried (``PushRefused``) for a branch name
    outside ``cogni/``, the remote's default branch, or a branch that exists with other
    commits; retried (``PushFailed``) for what may pass (the remote unreachable).
    """
    mirror = work / "mirror.git"
    ref = f"refs/heads/{request.branch}"
    try:
        check_branch(request.branch)
    except RepoError as exc:
        raise ApplicationError(str(exc), type=ERROR_TYPE_PUSH_REFUSED, non_retryable=True) from None
    try:
        # The mirror first: it then holds the branch, if it exists, to compare with.
        fetch_mirror(request.repo, mirror, credentials=credentials)
        default, refs = ls_remote(request.repo, credentials, ["HEAD", ref], LS_REMOTE_TIMEOUT_S)
        if request.branch == default:
            raise ApplicationError(
                f"refusing to push to {request.branch!r}: it is the remote's default branch",
                type=ERROR_TYPE_PUSH_REFUSED,
                non_retryable=True,
            )
        if ref in refs:
            if _holds_exactly(mirror, request, refs[ref], work / "check"):
                return PushOutcome(request.branch, refs[ref], already=True, host=host)
            raise ApplicationError(
                f"branch {request.branch!r} already exists on the remote with other "
                "commits; agent runs never force-push: pick a new branch name",
                type=ERROR_TYPE_PUSH_REFUSED,
                non_retryable=True,
            )
        # Create-only (an empty lease): if another attempt creates the branch meanwhile,
        # this push fails, and the next attempt finds the branch and compares.
        pushed = push_branch_from_patches(
            request.repo,
            mirror,
            request.sha,
            request.patches,
            request.branch,
            credentials=credentials,
            scratch=work / "push",
        )
    except RepoError as exc:
        raise ApplicationError(
            f"the branch could not be pushed: {exc}", type=ERROR_TYPE_PUSH_FAILED
        ) from None
    return PushOutcome(pushed.branch, pushed.head_sha, host=host)


def _holds_exactly(mirror: Path, request: PushRequest, head: str, scratch: Path) -> bool:
    """Whether the remote's ``head`` (now in ``mirror``) is ``request.sha`` plus exactly
    ``request.patches``: the same number of commits on top of it, and the same tree as
    the patches give (commit ids differ with the time they were made; trees do not).
    A git failure here is a RepoError: the push is tried again, never taken as done."""
    git = ["--git-dir", str(mirror)]
    count = run_git(
        [*git, "rev-list", "--count", "--first-parent", f"{request.sha}..{head}"],
        what="counting the branch's commits",
    ).stdout.strip()
    base_ok = run_git(
        [*git, "merge-base", "--is-ancestor", request.sha, head],
        what="checking the branch's base",
        ok_codes=(0, 1),
    ).returncode
    if base_ok != 0 or int(count) != len(request.patches):
        return False
    clone_at(mirror, request.sha, scratch, LOCAL_GIT_TIMEOUT_S, "check directory")
    identity = {
        "GIT_AUTHOR_NAME": "cogni",
        "GIT_AUTHOR_EMAIL": "cogni@localhost",
        "GIT_COMMITTER_NAME": "cogni",
        "GIT_COMMITTER_EMAIL": "cogni@localhost",
    }
    for patch in request.patches:
        run_git(
            ["-C", str(scratch), "am", "--quiet", "--no-gpg-sign", "--keep-cr"],
            what="applying the patches to compare",
            stdin=patch.encode("utf-8", "surrogateescape"),
            extra_env=identity,
        )
    ours = run_git(["-C", str(scratch), "rev-parse", "HEAD^{tree}"], what="our tree")
    theirs = run_git([*git, "rev-parse", f"{head}^{{tree}}"], what="the branch's tree")
    return ours.stdout.strip() == theirs.stdout.strip()
