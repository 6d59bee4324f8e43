"""The host-owned agent run: the host clones, the host
talks to the model, the sandbox only executes, the host pushes.

:func:`run_agent` does one run from start to end:

1. fetch the repository into a host-private mirror (credentials from the host's
   environment, sent as a header: never in a file, a URL or an argument) and check out
   the commit as the workspace base;
2. open a workspace session over it (``overlay``: the base is the overlay's lower
   directory, the run writes only the upper one; ``host``: the base itself, with a
   snapshot) and start a gatewayd run on it, with the run's OS sandbox;
3. the conversation (:mod:`gatewayd.agent.conversation`): the model is offered ``read``,
   ``write``, ``edit``, ``list`` and ``exec``; each call it makes becomes one request to
   the run's :class:`Dispatcher`, exactly as if ``cogni-tool`` had sent it (allowlist,
   policy, review, audit; exec runs in the run's sandbox). Limits: turns, tokens, wall
   time;
4. the run ends; the host diffs the workspace, turns the changes into a git patch in a
   fresh clone where nothing the sandbox wrote can act (gatewayd/agent/patches.py), and, if
   the task finished, pushes it to ``cogni/<run-id>`` and opens a pull request when asked.

The result is the run result: ``{ok, bundle: {patches,
commitMessages}, logs, auditLog, errorCode}`` plus what the operator needs (run id,
branch, counts). A run that stops early keeps what it did: the patch of its changes is in
the bundle, and nothing is pushed.

The task and its result are in :mod:`gatewayd.agent.task`, the run's work directory in
:mod:`gatewayd.agent.workdir`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import structlog
import trio

from gatewayd.agent.conversation import RUN_TOOL_IDS, AgentStop, agent_conversation
from gatewayd.agent.forge import open_pull_request
from gatewayd.agent.patches import BRANCH_PREFIX, patch_from_tree, push_branch_from_patches
from gatewayd.agent.repo import RepoError, checkout_at, fetch_mirror
from gatewayd.agent.task import AgentResult, AgentTask, PullRequestSpec, RunCancel
from gatewayd.agent.workdir import AgentDirError, make_work_dir, remove_tree
from gatewayd.apps.discovery import discover_apps
from gatewayd.audit.events import AuditEvent
from gatewayd.audit.query import read_log
from gatewayd.dispatch import Dispatcher
from gatewayd.errors import GatewayError
from gatewayd.mcp.tools import McpTools
from gatewayd.policy import tool_allowed
from gatewayd.policy.appsfolder import is_apps_name
from gatewayd.runs import Grant, Run, RunLimits, RunRequest
from gatewayd.runs.lifecycle import RunManager
from gatewayd.sandbox.lease import lend
from gatewayd.sandbox.lendable import LendableRoots
from gatewayd.workspace import HostWorkspace, OverlayWorkspace, WorkspaceDiff, WorkspaceSession

log = structlog.get_logger("gatewayd.agent")

MAX_COMMIT_MESSAGE_CHARS: Final = 10_000
# Control characters of a progress line, shown escaped (never sent to a terminal).
_CONTROL_RE: Final = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


async def run_agent(
    runs: RunManager,
    dispatcher: Dispatcher,
    task: AgentTask,
    progress: Callable[[str], None] | None = None,
    *,
    mcp: McpTools | None = None,
    folder_tools: tuple[str, ...] = (),
    cancel: RunCancel | None = None,
) -> AgentResult:
    """One agent run, start to end; never raises for the task's own failures (the result
    says what happened), and always removes its workspace.

    Error handling: an unknown model alias or an unusable ``agent_dir`` is refused before
    anything is fetched (audited as ``agent_run_refused``); a commit the mirror does not
    hold fails the checkout. Either way: ``ok`` false, ``errorCode`` ``internal``, the
    reason in ``message``. gatewayd's own failures end the run the same way.

    ``mcp``: the daemon's MCP tools; their pinned tools are offered to the model beside
    the five and the apps (None: none), and the run's policy still decides each call.
    ``folder_tools``: the names of the daemon's tool folders' tools, offered the same way.
    ``cancel``: lets the caller end the run early (a workflow's cancellation): the
    conversation stops, the sandbox is killed, the patch of what was done is kept, nothing
    is pushed, and the result's ``errorCode`` is ``cancelled``.
    """
    result = AgentResult(ok=False)

    def say(line: str) -> None:
        # The model names tools and git quotes servers: neither may drive the operator's
        # terminal (escape sequences), so control characters are shown, not sent.
        line = _CONTROL_RE.sub(lambda m: f"\\x{ord(m.group()):02x}", line)
        result.logs.append(line)
        log.info("agent_progress", line=line)
        if progress is not None:
            progress(line)

    refusal: str | None = None
    if task.model not in runs.config.models:
        known = ", ".join(sorted(runs.config.models)) or "none configured"
        refusal = (
            f"model alias {task.model!r} is not in gatewayd's configuration (aliases: {known})"
        )
    else:
        try:
            work, lock = make_work_dir(runs.config.resolved_agent_dir)
        except (AgentDirError, OSError) as exc:
            refusal = f"the agent's work directory could not be made: {exc}"
    if refusal is not None:
        result.error_code, result.message = "internal", refusal
        say(refusal)
        await runs.audit.append(
            "event",
            event=AuditEvent.AGENT_RUN_REFUSED,
            errorCode="internal",
            safeMessage=refusal,
            detail={"repo": _public_url(task.repo_url), "sha": task.sha, "model": task.model},
        )
        return result
    try:
        await _run_in(
            _Job(
                runs=runs,
                dispatcher=dispatcher,
                task=task,
                result=result,
                say=say,
                work=work,
                mcp=() if mcp is None else await trio.to_thread.run_sync(mcp.tool_names),
                folder=folder_tools,
                cancel=cancel,
            )
        )
    except Exception as exc:  # gatewayd's own failure: the result says so, the log has it
        log.exception("agent_run_failed", run_id=result.run_id)
        result.ok, result.error_code = False, "internal"
        result.message = (
            f"gatewayd failed during the run ({type(exc).__name__}); gatewayd's log has the details"
        )
        say(result.message)
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(remove_tree, work)
            os.close(lock)
    return result


@dataclass(frozen=True, slots=True, kw_only=True)
class _Job:
    """One agent run's parts, as the steps below share them."""

    runs: RunManager
    dispatcher: Dispatcher
    task: AgentTask
    result: AgentResult
    say: Callable[[str], None]
    work: Path  # the run's work directory in agent_dir
    # The tools of the checkout's apps (found once it is checked out), which the run may
    # call besides the five when its policy allows them.
    apps: tuple[str, ...] = ()
    # The pinned MCP tools (mcp.<server>.<tool>) when the run starts, offered like apps.
    mcp: tuple[str, ...] = ()
    # The tool folders' tools (wasm and process tools), offered like apps.
    folder: tuple[str, ...] = ()
    cancel: RunCancel | None = None

    @property
    def mirror(self) -> Path:
        return self.work / "mirror.git"

    @property
    def base(self) -> Path:
        return self.work / "base"


async def _run_in(job: _Job) -> None:
    runs, task, result, say = job.runs, job.task, job.result, job.say
    started = time.monotonic()
    first_seq = runs.audit.last_seq + 1  # the run's entries all come after this
    mirror, base = job.mirror, job.base
    say(f"fetching {_public_url(task.repo_url)} at {task.sha[:12]}")
    try:
        await trio.to_thread.run_sync(
            lambda: fetch_mirror(task.repo_url, mirror, credentials=task.credentials)
        )
        await trio.to_thread.run_sync(lambda: checkout_at(mirror, task.sha, base))
    except RepoError as exc:
        result.error_code, result.message = "internal", f"the repository could not be cloned: {exc}"
        say(result.message)
        await runs.audit.append(
            "event",
            event=AuditEvent.AGENT_RUN_REFUSED,
            errorCode="internal",
            safeMessage=result.message,
            detail={"repo": _public_url(task.repo_url), "sha": task.sha},
        )
        return
    found = await trio.to_thread.run_sync(discover_apps, base)
    job = dataclasses.replace(job, apps=tuple(app.tool_name for app in found.apps))
    session, run = await _start(job)
    if session is None or run is None:
        return
    try:
        await _converse_and_collect(job, session, run)
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(session.close)
    if result.run_id is not None:
        await runs.audit.append(
            "event",
            event=AuditEvent.AGENT_RUN_ENDED,
            runId=result.run_id,
            detail={
                "ok": result.ok,
                # The run result's code (timeout, oom_killed, internal, task_failed): not a
                # wire error code, so in the detail (the audit's errorCode is the wire's).
                "errorCode": result.error_code,
                "message": result.message,
                "turns": result.turns,
                "tokens": result.tokens,
                "patches": len(result.patches),
                "branch": result.branch,
                "headSha": result.head_sha,
                "pullRequest": result.pull_request_url,
                "durationMs": round((time.monotonic() - started) * 1000),
            },
        )
        result.audit_log = await _run_entries(runs, result.run_id, first_seq)
    say(
        f"run {result.run_id} {'finished' if result.ok else 'stopped'}"
        + (f" ({result.error_code}: {result.message})" if not result.ok else "")
    )


def run_tools(offered: tuple[str, ...], wanted: tuple[str, ...]) -> tuple[str, ...]:
    """The run's tool ids: ``offered``, narrowed to ``wanted`` when it names any. A
    wanted id the run does not offer is refused (ValueError naming it and what is
    offered): a task that counts on a tool must not run without it."""
    if not wanted:
        return offered
    missing = sorted(set(wanted) - set(offered))
    if missing:
        raise ValueError(
            f"tool ids {', '.join(missing)} are not offered to this run (offered: "
            f"{', '.join(offered)})"
        )
    return tuple(tool for tool in offered if tool in set(wanted))


async def _start(job: _Job) -> tuple[WorkspaceSession | None, Run | None]:
    """The workspace session and the run on it; (None, None) when either is refused."""
    runs, task, result, say = job.runs, job.task, job.result, job.say
    work, base = job.work, job.base
    try:
        tool_ids = run_tools((*RUN_TOOL_IDS, *job.apps, *job.mcp, *job.folder), task.tool_ids)
    except ValueError as exc:  # the task counts on a tool this run cannot offer
        result.error_code, result.message = "task_failed", f"the run could not start: {exc}"
        say(result.message)
        return None, None
    request = RunRequest(
        workspacePath=str(base),
        policy=task.policy,
        actorId=task.actor,
        tenantId=task.tenant,
        grant=Grant(allowSandbox=True),  # the operator starting the agent is the grant
        # The five, the apps of the checkout and the pinned MCP tools, narrowed to the
        # task's tool ids when it names some (the policy still decides each).
        toolIds=tool_ids,
        limits=RunLimits(
            maxRuntimeSec=int(task.limits.max_wall_s) + 60, maxMemoryMb=task.max_memory_mb
        ),
        taskInput=task.task,
        graphId="sandbox:agent",
    )
    state = work / "session"
    session: WorkspaceSession | None = None
    user = None
    try:
        if task.backend == "overlay":
            # The overlay's lower directory is this run's own clone: it becomes the run
            # uid's before the mount (changing a lower layer under a live overlay is
            # undefined), so the sandbox can write the merged view without a copy-up of
            # every file; the whole tree is removed after the run.
            user = runs.uid_pool.acquire()
            owner = user
            # The clone lies in the run's own work directory (gatewayd's, 0700): the one
            # root it may be lent beneath, wherever agent_dir is.
            roots = LendableRoots(configured=(), own=(work,))
            await trio.to_thread.run_sync(lambda: lend([base], owner, work, roots=roots))
            limit = task.max_workspace_bytes or None
            session = await trio.to_thread.run_sync(
                lambda: OverlayWorkspace.create(base, state, max_delta_bytes=limit)
            )
            os.chown(session.root, user.uid, user.gid)
            request = request.model_copy(update={"workspacePath": str(session.root)})
            # The session is the agent's own (its clone's overlay or snapshot).
            run = await runs.start(
                request,
                sandbox_user=user,
                lend_workspace=False,
                policy_paths=True,
                own_root=work,
                workspace_session=False,
            )
        else:
            session = await trio.to_thread.run_sync(lambda: HostWorkspace.create(base, state))
            run = await runs.start(
                request, policy_paths=True, own_root=work, workspace_session=False
            )
    except (GatewayError, ValueError, OSError) as exc:
        if user is not None:
            runs.uid_pool.release(user)
        if session is not None:
            await trio.to_thread.run_sync(session.close)
        result.error_code, result.message = "internal", f"the run could not start: {exc}"
        say(result.message)
        return None, None
    result.run_id = run.run_id
    if run.sandbox is None:
        await runs.end(run.run_id, reason="agent_needs_sandbox")
        await trio.to_thread.run_sync(session.close)
        result.error_code = "internal"
        result.message = (
            f"agent runs execute commands only in an OS sandbox, and this run has none "
            f"({run.degraded})"
        )
        say(result.message)
        await runs.audit.append(
            "event",
            event=AuditEvent.AGENT_RUN_REFUSED,
            runId=run.run_id,
            errorCode="internal",
            safeMessage=result.message,
            detail={"repo": _public_url(task.repo_url), "sha": task.sha, "model": task.model},
        )
        return None, None
    await runs.audit.append(
        "event",
        event=AuditEvent.AGENT_RUN_STARTED,
        runId=run.run_id,
        detail={
            "repo": _public_url(task.repo_url),
            "sha": task.sha,
            "model": task.model,
            "backend": task.backend,
            "taskBytes": len(task.task.encode()),
            "taskDigest": "sha256:" + hashlib.sha256(task.task.encode()).hexdigest(),
            "limits": {
                **dataclasses.asdict(task.limits),
                "maxMemoryMb": task.max_memory_mb,
                "maxPatchBytes": task.max_patch_bytes,
                "maxWorkspaceBytes": task.max_workspace_bytes
                if task.backend == "overlay"
                else None,
            },
            "push": task.push,
            "pullRequest": task.pull_request is not None,
        },
    )
    say(f"run {run.run_id} started ({task.backend} workspace, policy {run.spec.policy.name})")
    return session, run


async def _converse_and_collect(job: _Job, session: WorkspaceSession, run: Run) -> None:
    runs, task, result, say = job.runs, job.task, job.result, job.say
    work, mirror = job.work, job.mirror
    apps, mcp, folder = (
        [
            tool.manifest
            for name in names
            if tool_allowed(name, run.spec.rules)
            and (tool := job.dispatcher.tool_for(run, name)) is not None
        ]
        for names in (job.apps, job.mcp, job.folder)
    )
    for what, manifests in (("apps", apps), ("MCP tools", mcp), ("folder tools", folder)):
        if manifests:
            say(f"{what} offered: " + ", ".join(manifest.name for manifest in manifests))
    offered = [*apps, *mcp, *folder]
    conversation = agent_conversation(
        apps=offered,
        dispatcher=job.dispatcher,
        audit=runs.audit,
        alias=runs.config.models[task.model],
        run=run,
        task=task,
        say=say,
    )
    try:
        with trio.move_on_after(task.limits.max_wall_s) as wall:
            if job.cancel is not None:
                job.cancel.attach(wall)
            try:
                await conversation.go()
            finally:
                if job.cancel is not None:
                    job.cancel.attach(None)
        if wall.cancelled_caught and job.cancel is not None and job.cancel.requested:
            raise AgentStop(
                "cancelled",
                f"the run was cancelled ({job.cancel.reason}) before the model finished; "
                "the bundle holds what it had done",
            )
        if wall.cancelled_caught:
            raise AgentStop(
                "timeout",
                f"the wall time limit ({task.limits.max_wall_s:g} s) passed before the model "
                "finished; raise --max-wall-s",
            )
        result.ok = True
    except AgentStop as stop:
        # An agent run has no budget besides its limits: never rate_limited.
        result.error_code = "task_failed" if stop.code == "rate_limited" else stop.code
        result.message = str(stop)
        if stop.code == "task_failed" and conversation.oom_killed:
            result.error_code = "oom_killed"
            result.message += "; a command was killed for running out of memory"
    finally:
        result.turns, result.tokens = conversation.turns, conversation.tokens
        # Whatever happened above, the run ends here: its sandbox stops before the host
        # reads the tree (and a failure below never leaves the run serving).
        with trio.CancelScope(shield=True):
            reason = "agent_finished" if result.ok else "agent_stopped"
            await runs.end(run.run_id, reason=reason)

    # The sandbox is gone: nothing changes the workspace while the host reads it.
    diff, git_paths = _without_git_metadata(await trio.to_thread.run_sync(session.diff))
    if git_paths:
        # The model ran git inside (status, add, commit), or an app kept state: both
        # stay behind.
        say(
            f"{git_paths} changed path(s) under .git or apps/ left out: the host takes the "
            "agent's files, not git's metadata nor the apps' data"
        )
    if diff.empty:
        say("no changes in the workspace")
        if result.ok and task.push:
            result.ok, result.error_code = False, "task_failed"
            result.message = "the model finished without changing anything; nothing to push"
        return
    message = _commit_message(conversation.final_text, run.run_id, result)
    try:
        made = await trio.to_thread.run_sync(
            lambda: patch_from_tree(
                mirror,
                task.sha,
                session.root,
                diff,
                message=message,
                scratch=work / "patch",
                max_bytes=task.max_patch_bytes,
                exclude=run.spec.policy.patches.exclude,
            )
        )
    except RepoError as exc:
        result.ok, result.error_code = False, "internal"
        result.message = f"the changes could not be made into a patch: {exc}"
        say(result.message)
        return
    result.skipped = list(made.skipped)
    if made.patch:
        result.patches.append(made.patch)
        result.commit_messages.append(message)
    await runs.audit.append(
        "event",
        event=AuditEvent.AGENT_PATCH,
        runId=run.run_id,
        detail={
            "files": len(diff.added) + len(diff.removed) + len(diff.modified) + len(diff.renamed),
            "patchBytes": len(made.patch.encode()),
            "patchDigest": "sha256:" + hashlib.sha256(made.patch.encode()).hexdigest(),
            "skipped": result.skipped[:100],
        },
    )
    say(f"patch: {len(made.patch.encode())} bytes" + _skipped_note(result.skipped))
    if result.ok and task.push and not result.patches:
        result.ok, result.error_code = False, "task_failed"
        result.message = (
            "every change was left out of the patch (ignored by .gitignore, or in skipped); "
            "nothing to push"
        )
        say(result.message)
    if result.ok and task.push and result.patches:
        await _push(job, run)


async def _push(job: _Job, run: Run) -> None:
    runs, task, result, say = job.runs, job.task, job.result, job.say
    work, mirror = job.work, job.mirror
    branch = BRANCH_PREFIX + run.run_id
    try:
        pushed = await trio.to_thread.run_sync(
            lambda: push_branch_from_patches(
                task.repo_url,
                mirror,
                task.sha,
                result.patches,
                branch,
                credentials=task.credentials,
                scratch=work / "push",
            )
        )
    except RepoError as exc:
        result.ok, result.error_code = False, "internal"
        result.message = f"the branch could not be pushed: {exc}"
        say(result.message)
        await runs.audit.append(
            "event",
            event=AuditEvent.AGENT_PUSH,
            runId=run.run_id,
            errorCode="internal",
            safeMessage=result.message,
            detail={"branch": branch},
        )
        return
    result.branch, result.head_sha = pushed.branch, pushed.head_sha
    await runs.audit.append(
        "event",
        event=AuditEvent.AGENT_PUSH,
        runId=run.run_id,
        detail={"branch": pushed.branch, "headSha": pushed.head_sha},
    )
    say(f"pushed {pushed.branch} ({pushed.head_sha[:12]})")
    spec = task.pull_request
    if spec is None:
        return
    try:
        token = _forge_token(spec)
        url = await trio.to_thread.run_sync(
            lambda: open_pull_request(
                spec.api_base,
                spec.repository,
                source_branch=pushed.branch,
                target_branch=spec.target_branch,
                title=result.commit_messages[0].splitlines()[0][:200],
                body=result.commit_messages[0],
                token=token,
            )
        )
    except Exception as exc:
        # The branch is pushed whatever happens here: the result and the audit say so,
        # and that the pull request failed, even for a failure gatewayd did not expect.
        if isinstance(exc, (RepoError, GatewayError)):
            why = str(exc)
        else:
            log.exception("agent_pull_request_failed", run_id=run.run_id)
            why = f"gatewayd failed opening it ({type(exc).__name__}); its log has the details"
        result.ok, result.error_code = False, "internal"
        result.message = f"the branch was pushed, but the pull request failed: {why}"
        say(result.message)
        await runs.audit.append(
            "event",
            event=AuditEvent.AGENT_PULL_REQUEST,
            runId=run.run_id,
            errorCode="internal",
            safeMessage=result.message,
            detail={"branch": pushed.branch, "repository": spec.repository},
        )
        return
    result.pull_request_url = url
    await runs.audit.append(
        "event", event=AuditEvent.AGENT_PULL_REQUEST, runId=run.run_id, detail={"url": url}
    )
    say(f"pull request {url}")


def _forge_token(spec: PullRequestSpec) -> str:
    from gatewayd.secrets import read_secret

    return read_secret(spec.token_env, holds="the forge's API token").value


def _without_git_metadata(diff: WorkspaceDiff) -> tuple[WorkspaceDiff, int]:
    """``diff`` without the top-level ``.git`` directory (what git inside the sandbox
    changed) and the top-level apps folder (what the checkout's apps kept in their data
    folders: their state, never the agent's work, which cannot reach the folder), and how
    many paths that left out. A ``.git`` anywhere else is still in the diff, and the
    patch refuses it by name (repo.py)."""

    def ours(rel: str) -> bool:
        top = rel.split("/", 1)[0]
        return top != ".git" and not (is_apps_name(top) and "/" in rel)

    # A rename across the boundary (.git/x -> x) keeps its side outside .git.
    added = [r for r in diff.added if ours(r)] + [
        new for old, new in diff.renamed if ours(new) and not ours(old)
    ]
    removed = [r for r in diff.removed if ours(r)] + [
        old for old, new in diff.renamed if ours(old) and not ours(new)
    ]
    kept = WorkspaceDiff(
        unified=diff.unified,
        added=sorted(added),
        removed=sorted(removed),
        modified=[r for r in diff.modified if ours(r)],
        renamed=[(a, b) for a, b in diff.renamed if ours(a) and ours(b)],
        binary=[r for r in diff.binary if ours(r)],
    )
    every = len(diff.added) + len(diff.removed) + len(diff.modified) + 2 * len(diff.renamed)
    kept_count = len(added) + len(removed) + len(kept.modified) + 2 * len(kept.renamed)
    return kept, every - kept_count


def _commit_message(final_text: str | None, run_id: str, result: AgentResult) -> str:
    text = (final_text or "").strip()
    if not result.ok or not text:
        why = "" if result.ok else f" (stopped: {result.error_code})"
        text = f"cogni agent run {run_id}{why}" + (f"\n\n{text}" if text else "")
    if len(text) > MAX_COMMIT_MESSAGE_CHARS:
        text = text[:MAX_COMMIT_MESSAGE_CHARS]
    return text + "\n"


def _skipped_note(skipped: list[str]) -> str:
    return f"; {len(skipped)} path(s) left out: {', '.join(skipped[:5])}" if skipped else ""


async def _run_entries(runs: RunManager, run_id: str, since_seq: int) -> list[dict[str, Any]]:
    """The run's entries of the audit log, as written (after they are durable), read
    from the segment holding ``since_seq`` on (the run's first entry is later)."""
    audit = runs.audit
    await audit.durable(audit.last_seq)
    path = runs.config.resolved_audit_path

    def read() -> list[dict[str, Any]]:
        return [
            record.entry
            for record in read_log(path, since_seq=since_seq)
            if record.entry is not None and record.entry.get("runId") == run_id
        ]

    return await trio.to_thread.run_sync(read)


def _public_url(url: str) -> str:
    """The URL as it may be shown (repo.py refuses URLs with credentials anyway)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.username or parts.password:
        host = parts.hostname or ""
        parts = parts._replace(netloc=host + (f":{parts.port}" if parts.port else ""))
    return urlunsplit(parts)
