"""The host-owned agent run (reference note 004's P0 flow): the host clones, the host
talks to the model, the sandbox only executes, the host pushes.

:func:`run_agent` does one run from start to end:

1. fetch the repository into a host-private mirror (credentials from the host's
   environment, sent as a header: never in a file, a URL or an argument) and check out
   the commit as the workspace base;
2. open a workspace session over it (``overlay``: the base is the overlay's lower
   directory, the run writes only the upper one; ``host``: the base itself, with a
   snapshot) and start a gatewayd run on it, with the run's OS sandbox;
3. the conversation: the model is offered ``read``, ``write``, ``edit``, ``list`` and
   ``exec``; each call it makes becomes one request to the run's :class:`Dispatcher`,
   exactly as if ``cogni-tool`` had sent it (allowlist, policy, review, audit; exec runs
   in the run's sandbox). Limits: turns, tokens, wall time;
4. the run ends; the host diffs the workspace, turns the changes into a git patch in a
   fresh clone where nothing the sandbox wrote can act (gatewayd/agent/repo.py), and, if
   the task finished, pushes it to ``cogni/<run-id>`` and opens a pull request when asked.

The result is reference note 004's ``SandboxRunResult``: ``{ok, bundle: {patches,
commitMessages}, logs, auditLog, errorCode}`` plus what the operator needs (run id,
branch, counts). A run that stops early keeps what it did: the patch of its changes is in
the bundle, and nothing is pushed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import secrets as stdlib_secrets
import shutil
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import msgspec
import structlog
import trio

from gatewayd import model_client, strictjson
from gatewayd.agent.repo import (
    BRANCH_PREFIX,
    MAX_PATCH_INPUT_BYTES,
    RepoCredentials,
    RepoError,
    checkout_at,
    fetch_mirror,
    open_pull_request,
    patch_from_tree,
    push_branch_from_patches,
)
from gatewayd.audit.entry import Peer
from gatewayd.audit.events import AuditEvent
from gatewayd.audit.query import read_log
from gatewayd.errors import GatewayError
from gatewayd.model_client import ModelCallError
from gatewayd.protocol import PROTOCOL_VERSION, Request, Response
from gatewayd.runs import Grant, Run, RunLimits, RunRequest
from gatewayd.sandbox.lease import lend, mount_points_under
from gatewayd.sandbox.lendable import LendableRoots
from gatewayd.workspace import HostWorkspace, OverlayWorkspace, WorkspaceDiff, WorkspaceSession
from gatewayd.workspace.overlay import unmount

if TYPE_CHECKING:
    from gatewayd.daemon import Daemon

log = structlog.get_logger("gatewayd.agent")

Backend = Literal["overlay", "host"]
ErrorCodeName = Literal["timeout", "oom_killed", "internal", "task_failed"]

# The model's tool names and the gateway tools they are (one dispatch path for both).
TOOL_MAP: Final[Mapping[str, str]] = {
    "read": "fs.read",
    "write": "fs.write",
    "edit": "fs.edit",
    "list": "fs.list",
    "exec": "sandbox.exec",
}
# A run may call these and nothing else, whatever else its policy allows.
RUN_TOOL_IDS: Final = tuple(TOOL_MAP.values())
# One tool result, as the model sees it: enough for a test run's tail, not a flood.
MAX_TOOL_RESULT_CHARS: Final = 32_000
MAX_COMMIT_MESSAGE_CHARS: Final = 10_000
# Tool calls run per answer; more are refused (the conversation is held in memory).
MAX_CALLS_PER_TURN: Final = 32
DEFAULT_MAX_WORKSPACE_BYTES: Final = 1 << 30
# A work directory of agent_dir: its name, the marker that says gatewayd made it, and
# the lock its run holds (the start-up sweep removes only unlocked, marked ones).
_WORK_NAME_RE: Final = re.compile(r"[0-9a-f]{16}")
WORK_MARKER: Final = ".cogni-agent-run"
_CONTROL_RE: Final = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# The largest answer asked for per turn (the token limit may ask for less).
MAX_TURN_COMPLETION_TOKENS: Final = 8192

SYSTEM_PROMPT: Final = """\
You are a software engineer working on a git repository checked out at /workspace.
You have these tools: read (a file), write (a whole file), edit (replace one exact
occurrence in a file), list (a directory) and exec (a /bin/sh command run in /workspace
inside a sandbox with no network). Paths are relative to /workspace.
Work step by step: look at the code, change it, run the repository's tests with exec.
When the task is done, answer WITHOUT a tool call: the answer is the commit message
(a short first line, a blank line, then what you changed and why). Do not run git
commit or push; the host commits and pushes your changes.
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentLimits:
    max_turns: int = 40
    max_tokens: int = 400_000
    max_wall_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_tokens < 1 or not self.max_wall_s > 0:
            raise ValueError("agent limits must be positive: turns, tokens and wall seconds")


@dataclass(frozen=True, slots=True, kw_only=True)
class PullRequestSpec:
    """Where to open the pull request (a GitHub-style API): only when asked."""

    api_base: str
    repository: str  # owner/name
    target_branch: str
    token_env: str


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentTask:
    repo_url: str
    sha: str
    task: str
    model: str  # an alias of gatewayd's configuration
    policy: str
    backend: Backend = "overlay"
    push: bool = True
    pull_request: PullRequestSpec | None = None
    credentials: RepoCredentials = field(default_factory=RepoCredentials)
    limits: AgentLimits = field(default_factory=AgentLimits)
    actor: str = "operator"
    tenant: str = "local"
    max_memory_mb: int = 2048
    max_patch_bytes: int = MAX_PATCH_INPUT_BYTES
    # overlay: what the run may write in all (a private tmpfs, so in memory); 0: no
    # limit (the delta on disk, beside the state directory).
    max_workspace_bytes: int = DEFAULT_MAX_WORKSPACE_BYTES


@dataclass(kw_only=True)
class AgentResult:
    ok: bool
    error_code: ErrorCodeName | None = None
    message: str = ""
    run_id: str | None = None
    patches: list[str] = field(default_factory=list)
    commit_messages: list[str] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)
    audit_log: list[dict[str, Any]] = field(default_factory=list)
    branch: str | None = None
    head_sha: str | None = None
    pull_request_url: str | None = None
    turns: int = 0
    tokens: int = 0
    skipped: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """Reference note 004's run result, plus what the operator needs."""
        return {
            "ok": self.ok,
            "bundle": {"patches": self.patches, "commitMessages": self.commit_messages},
            "logs": "\n".join(self.logs),
            "auditLog": self.audit_log,
            "errorCode": self.error_code,
            "message": self.message,
            "runId": self.run_id,
            "branch": self.branch,
            "headSha": self.head_sha,
            "pullRequest": self.pull_request_url,
            "turns": self.turns,
            "tokens": self.tokens,
            "skipped": self.skipped,
        }


class AgentDirError(GatewayError):
    """agent_dir is not gatewayd's private directory (a misconfiguration)."""


class _Stop(Exception):
    """The loop ends early: a limit, or the model cannot go on."""

    def __init__(self, code: ErrorCodeName, message: str) -> None:
        super().__init__(message)
        self.code = code


def tool_definitions(daemon: Daemon) -> list[dict[str, Any]]:
    """The five tools as OpenAI function definitions, their parameters the gateway
    tools' own argument schemas (one source of truth for what a call may carry)."""
    out = []
    for name, tool in TOOL_MAP.items():
        manifest = daemon.dispatcher.tools[tool].manifest
        schema = manifest.args_schema
        ref = schema.get("$ref", "")
        params = dict(schema.get("$defs", {}).get(ref.rsplit("/", 1)[-1], schema))
        if len(schema.get("$defs", {})) > 1:
            params["$defs"] = schema["$defs"]
        out.append(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": params.pop("description", manifest.summary),
                    "parameters": params,
                },
            }
        )
    return out


class _Conversation:
    """One run's model loop: turns, tool calls through the dispatcher, limits."""

    def __init__(
        self,
        daemon: Daemon,
        run: Run,
        task: AgentTask,
        say: Callable[[str], None],
    ) -> None:
        self.daemon = daemon
        self.run = run
        self.task = task
        self.say = say
        self.turns = 0
        self.tokens = 0
        self.oom_killed = False
        self.final_text: str | None = None
        self.peer = Peer(pid=os.getpid(), uid=os.getuid(), gid=os.getgid())
        self.tools = tool_definitions(daemon)
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": task.task},
        ]

    async def go(self) -> None:
        limits = self.task.limits
        alias = self.daemon.config.models[self.task.model]
        deadline = trio.current_time() + limits.max_wall_s
        while True:
            if self.turns >= limits.max_turns:
                raise _Stop(
                    "task_failed",
                    f"the turn limit ({limits.max_turns}) was reached before the model "
                    "finished; raise --max-turns or narrow the task",
                )
            if self.tokens >= limits.max_tokens:
                raise _Stop(
                    "task_failed",
                    f"the token limit ({limits.max_tokens}) was spent ({self.tokens} "
                    "tokens) before the model finished; raise --max-tokens",
                )
            self.turns += 1
            remaining = max(deadline - trio.current_time(), 0.001)
            asked = min(MAX_TURN_COMPLETION_TOKENS, limits.max_tokens - self.tokens)
            try:
                answer = await model_client.complete(
                    alias,
                    self.messages,
                    tools=self.tools,
                    timeout_s=min(remaining, alias.timeout_s),
                    max_tokens=asked,
                    alias_name=self.task.model,
                )
            except ModelCallError as exc:
                if exc.kind is model_client.ModelCallKind.TIMEOUT and remaining < alias.timeout_s:
                    raise _Stop(
                        "timeout",
                        f"the wall time limit ({limits.max_wall_s:g} s) passed during a model "
                        "call; raise --max-wall-s",
                    ) from None
                raise _Stop("internal", f"the model call failed ({exc.kind}): {exc}") from None
            if answer.prompt_tokens is None and answer.completion_tokens is None:
                used = asked  # no usage reported: charge the most the answer could be
            else:  # a provider's negative count must not give tokens back
                used = max(answer.prompt_tokens or 0, 0) + max(answer.completion_tokens or 0, 0)
            self.tokens += used
            await self.daemon.audit.append(
                "event",
                event=AuditEvent.AGENT_TURN,
                runId=self.run.run_id,
                detail={
                    "turn": self.turns,
                    "model": self.task.model,
                    "promptTokens": answer.prompt_tokens,
                    "completionTokens": answer.completion_tokens,
                    "finishReason": answer.finish_reason,
                    "toolCalls": [call.name[:64] for call in answer.tool_calls],
                    "textBytes": len(answer.text.encode()),
                    "textDigest": "sha256:" + hashlib.sha256(answer.text.encode()).hexdigest(),
                },
            )
            if not answer.tool_calls:
                self.say(f"turn {self.turns}: the model finished ({self.tokens} tokens)")
                self.final_text = answer.text
                return
            self.messages.append(_assistant_message(answer))
            for n, call in enumerate(answer.tool_calls):
                if n >= MAX_CALLS_PER_TURN:
                    content = await self._refuse(
                        call,
                        f"turn {self.turns}: {call.name[:32]}",
                        f"at most {MAX_CALLS_PER_TURN} tool calls are run per answer; "
                        "ask for the rest in the next one",
                    )
                else:
                    content = await self._call(call, n)
                self.messages.append({"role": "tool", "tool_call_id": call.id, "content": content})

    async def _call(self, call: model_client.ToolCall, n: int) -> str:
        """One tool call, through the dispatcher; returns what the model is told."""
        tool = TOOL_MAP.get(call.name)
        where = f"turn {self.turns}: {call.name[:32]}"
        if tool is None:
            return await self._refuse(
                call,
                where,
                f"there is no tool {call.name[:64]!r}; the tools are {', '.join(TOOL_MAP)}",
            )
        try:
            # The model's text, under the same JSON discipline as a frame on the socket.
            args = strictjson.loads(call.arguments or "{}")
        except strictjson.JsonInputError as exc:
            return await self._refuse(
                call, where, f"the arguments are not a JSON object ({exc}); send them as one"
            )
        if not isinstance(args, dict):
            return await self._refuse(
                call, where, "the arguments are not a JSON object; send them as one"
            )
        request = Request(
            v=PROTOCOL_VERSION,
            runId=self.run.run_id,
            toolCallId=f"agent.t{self.turns}.{n}",
            tool=tool,
            args=args,
        )
        response = await self.daemon.dispatcher.handle(self.run, request, self.peer)
        self.say(f"{where} {_brief(args)} -> {_verdict(response)}")
        if not response.ok:
            return json.dumps({"error": str(response.errorCode), "message": response.safeMessage})
        text = _raw_text(response.value)
        if tool == "sandbox.exec" and '"errorCode":"oom_killed"' in text.replace(" ", ""):
            self.oom_killed = True
        if len(text) > MAX_TOOL_RESULT_CHARS:
            text = text[:MAX_TOOL_RESULT_CHARS] + f"... [cut: {len(text)} characters in all]"
        return text

    async def _refuse(self, call: model_client.ToolCall, where: str, why: str) -> str:
        """A call that never became a request (no such tool, arguments not an object):
        audited as an event, and the model is told why."""
        await self.daemon.audit.append(
            "event",
            event=AuditEvent.AGENT_CALL_REFUSED,
            runId=self.run.run_id,
            detail={"turn": self.turns, "tool": call.name[:64], "reason": why},
        )
        self.say(f"{where} -> refused: {why}")
        return json.dumps({"error": "bad_request", "message": why})


def _assistant_message(answer: model_client.Completion) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": answer.text or None,
        "tool_calls": [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in answer.tool_calls
        ],
    }


def _raw_text(value: Any) -> str:
    if isinstance(value, msgspec.Raw):
        return bytes(value).decode("utf-8", "replace")
    return json.dumps(value)


def _brief(args: Mapping[str, Any]) -> str:
    """The call's main argument for the progress line."""
    for key in ("command", "path"):
        value = args.get(key)
        if isinstance(value, str):
            text = value if len(value) <= 60 else value[:57] + "..."
            return json.dumps(text)
    return ""


def _verdict(response: Response) -> str:
    if not response.ok:
        return f"denied ({response.errorCode})"
    text = _raw_text(response.value)
    if text.startswith('{"exitCode":'):
        with contextlib.suppress(ValueError):
            value = json.loads(text)
            suffix = f", {value['errorCode']}" if value.get("errorCode") else ""
            return f"allowed (exit {value['exitCode']}{suffix})"
    return "allowed"


# --- the run ----------------------------------------------------------------------------


async def run_agent(
    daemon: Daemon, task: AgentTask, progress: Callable[[str], None] | None = None
) -> AgentResult:
    """One agent run, start to end; never raises for the task's own failures (the result
    says what happened), and always removes its workspace.

    Error handling: an unknown model alias or an unusable ``agent_dir`` is refused before
    anything is fetched (audited as ``agent_run_refused``); a commit the mirror does not
    hold fails the checkout. Either way: ``ok`` false, ``errorCode`` ``internal``, the
    reason in ``message``. gatewayd's own failures end the run the same way.
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
    if task.model not in daemon.config.models:
        known = ", ".join(sorted(daemon.config.models)) or "none configured"
        refusal = (
            f"model alias {task.model!r} is not in gatewayd's configuration (aliases: {known})"
        )
    else:
        try:
            work, lock = _make_work_dir(daemon.config.resolved_agent_dir)
        except (AgentDirError, OSError) as exc:
            refusal = f"the agent's work directory could not be made: {exc}"
    if refusal is not None:
        result.error_code, result.message = "internal", refusal
        say(refusal)
        await daemon.audit.append(
            "event",
            event=AuditEvent.AGENT_RUN_REFUSED,
            errorCode="internal",
            safeMessage=refusal,
            detail={"repo": _public_url(task.repo_url), "sha": task.sha, "model": task.model},
        )
        return result
    try:
        await _run_in(_Job(daemon=daemon, task=task, result=result, say=say, work=work))
    except Exception as exc:  # gatewayd's own failure: the result says so, the log has it
        log.exception("agent_run_failed", run_id=result.run_id)
        result.ok, result.error_code = False, "internal"
        result.message = (
            f"gatewayd failed during the run ({type(exc).__name__}); gatewayd's log has the details"
        )
        say(result.message)
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(_remove_tree, work)
            os.close(lock)
    return result


def _make_work_dir(parent: Path) -> tuple[Path, int]:
    """A fresh work directory, marked as gatewayd's and locked while the run lives
    (returns the lock's descriptor; closing it releases the lock)."""
    try:
        parent.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        st = os.lstat(parent)
        if (
            not stat.S_ISDIR(st.st_mode)
            or st.st_uid != os.geteuid()
            or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        ):
            raise AgentDirError(
                f"agent_dir {parent} must be a directory of gatewayd's own user that no one "
                "else may write (as gatewayd makes it: mode 0700); choose another agent_dir"
            ) from None
    work = parent / stdlib_secrets.token_hex(8)
    work.mkdir(mode=0o700)
    lock = os.open(work / WORK_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    return work, lock


@dataclass(frozen=True, slots=True, kw_only=True)
class _Job:
    """One agent run's parts, as the steps below share them."""

    daemon: Daemon
    task: AgentTask
    result: AgentResult
    say: Callable[[str], None]
    work: Path  # the run's work directory in agent_dir

    @property
    def mirror(self) -> Path:
        return self.work / "mirror.git"

    @property
    def base(self) -> Path:
        return self.work / "base"


async def _run_in(job: _Job) -> None:
    daemon, task, result, say = job.daemon, job.task, job.result, job.say
    started = time.monotonic()
    first_seq = daemon.audit.last_seq + 1  # the run's entries all come after this
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
        await daemon.audit.append(
            "event",
            event=AuditEvent.AGENT_RUN_REFUSED,
            errorCode="internal",
            safeMessage=result.message,
            detail={"repo": _public_url(task.repo_url), "sha": task.sha},
        )
        return
    session, run = await _start(job)
    if session is None or run is None:
        return
    try:
        await _converse_and_collect(job, session, run)
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(session.close)
    if result.run_id is not None:
        await daemon.audit.append(
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
        result.audit_log = await _run_entries(daemon, result.run_id, first_seq)
    say(
        f"run {result.run_id} {'finished' if result.ok else 'stopped'}"
        + (f" ({result.error_code}: {result.message})" if not result.ok else "")
    )


async def _start(job: _Job) -> tuple[WorkspaceSession | None, Run | None]:
    """The workspace session and the run on it; (None, None) when either is refused."""
    daemon, task, result, say = job.daemon, job.task, job.result, job.say
    work, base = job.work, job.base
    request = RunRequest(
        workspacePath=str(base),
        policy=task.policy,
        actorId=task.actor,
        tenantId=task.tenant,
        grant=Grant(allowSandbox=True),  # the operator starting the agent is the grant
        toolIds=RUN_TOOL_IDS,
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
            user = daemon.uid_pool.acquire()
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
            run = await daemon.start_run(
                request, sandbox_user=user, lend_workspace=False, policy_paths=True, own_root=work
            )
        else:
            session = await trio.to_thread.run_sync(lambda: HostWorkspace.create(base, state))
            run = await daemon.start_run(request, policy_paths=True, own_root=work)
    except (GatewayError, ValueError, OSError) as exc:
        if user is not None:
            daemon.uid_pool.release(user)
        if session is not None:
            await trio.to_thread.run_sync(session.close)
        result.error_code, result.message = "internal", f"the run could not start: {exc}"
        say(result.message)
        return None, None
    result.run_id = run.run_id
    if run.sandbox is None:
        await daemon.end_run(run.run_id, reason="agent_needs_sandbox")
        await trio.to_thread.run_sync(session.close)
        result.error_code = "internal"
        result.message = (
            f"agent runs execute commands only in an OS sandbox, and this run has none "
            f"({run.degraded})"
        )
        say(result.message)
        await daemon.audit.append(
            "event",
            event=AuditEvent.AGENT_RUN_REFUSED,
            runId=run.run_id,
            errorCode="internal",
            safeMessage=result.message,
            detail={"repo": _public_url(task.repo_url), "sha": task.sha, "model": task.model},
        )
        return None, None
    await daemon.audit.append(
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
    daemon, task, result, say = job.daemon, job.task, job.result, job.say
    work, mirror = job.work, job.mirror
    conversation = _Conversation(daemon, run, task, say)
    try:
        with trio.move_on_after(task.limits.max_wall_s) as wall:
            await conversation.go()
        if wall.cancelled_caught:
            raise _Stop(
                "timeout",
                f"the wall time limit ({task.limits.max_wall_s:g} s) passed before the model "
                "finished; raise --max-wall-s",
            )
        result.ok = True
    except _Stop as stop:
        result.error_code, result.message = stop.code, str(stop)
        if stop.code == "task_failed" and conversation.oom_killed:
            result.error_code = "oom_killed"
            result.message += "; a command was killed for running out of memory"
    finally:
        result.turns, result.tokens = conversation.turns, conversation.tokens
        # Whatever happened above, the run ends here: its sandbox stops before the host
        # reads the tree (and a failure below never leaves the run serving).
        with trio.CancelScope(shield=True):
            reason = "agent_finished" if result.ok else "agent_stopped"
            await daemon.end_run(run.run_id, reason=reason)

    # The sandbox is gone: nothing changes the workspace while the host reads it.
    diff, git_paths = _without_git_metadata(await trio.to_thread.run_sync(session.diff))
    if git_paths:
        # The model ran git inside (status, add, commit): its metadata stays behind.
        say(f"{git_paths} changed path(s) under .git left out: the host takes files, not git's")
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
    await daemon.audit.append(
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
    daemon, task, result, say = job.daemon, job.task, job.result, job.say
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
        await daemon.audit.append(
            "event",
            event=AuditEvent.AGENT_PUSH,
            runId=run.run_id,
            errorCode="internal",
            safeMessage=result.message,
            detail={"branch": branch},
        )
        return
    result.branch, result.head_sha = pushed.branch, pushed.head_sha
    await daemon.audit.append(
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
        await daemon.audit.append(
            "event",
            event=AuditEvent.AGENT_PULL_REQUEST,
            runId=run.run_id,
            errorCode="internal",
            safeMessage=result.message,
            detail={"branch": pushed.branch, "repository": spec.repository},
        )
        return
    result.pull_request_url = url
    await daemon.audit.append(
        "event", event=AuditEvent.AGENT_PULL_REQUEST, runId=run.run_id, detail={"url": url}
    )
    say(f"pull request {url}")


def _forge_token(spec: PullRequestSpec) -> str:
    from gatewayd.secrets import read_secret

    return read_secret(spec.token_env, holds="the forge's API token").value


def _without_git_metadata(diff: WorkspaceDiff) -> tuple[WorkspaceDiff, int]:
    """``diff`` without the top-level ``.git`` directory (what git inside the sandbox
    changed), and how many paths that left out. A ``.git`` anywhere else is still in the
    diff, and the patch refuses it by name (repo.py)."""

    def ours(rel: str) -> bool:
        return rel != ".git/" and not rel.startswith(".git/")

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


async def _run_entries(daemon: Daemon, run_id: str, since_seq: int) -> list[dict[str, Any]]:
    """The run's entries of the audit log, as written (after they are durable), read
    from the segment holding ``since_seq`` on (the run's first entry is later)."""
    audit = daemon.audit
    await audit.durable(audit.last_seq)
    path = daemon.config.resolved_audit_path

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


def remove_leftovers(agent_dir: Path) -> list[str]:
    """What a crashed agent run left in ``agent_dir`` (an overlay still mounted, a
    checkout still the run uid's): unmounted and removed. Called at daemon start. Only
    directories gatewayd made are touched (a 16-hex name and the marker inside), and only
    when no live run holds the marker's lock: an ``agent_dir`` pointed at the wrong place
    or shared with another daemon loses nothing. Returns the work directories removed."""
    if not agent_dir.is_dir():
        return []
    removed = []
    for entry in sorted(agent_dir.iterdir()):
        if entry.is_symlink() or not entry.is_dir() or not _WORK_NAME_RE.fullmatch(entry.name):
            continue
        if not _abandoned(entry):
            continue
        # Deepest first: the merged view before anything mounted beneath its directory.
        for point in sorted(mount_points_under(entry), key=len, reverse=True):
            unmount(Path(point), detach=True)
        _remove_tree(entry)
        removed.append(entry.name)
    return removed


def _abandoned(work: Path) -> bool:
    """Does ``work`` carry gatewayd's marker, with no live run holding its lock?"""
    try:
        fd = os.open(work / WORK_MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def _remove_tree(path: Path) -> None:
    """The agent's work directory, whoever owns what in it (the run's uid did)."""
    shutil.rmtree(path, ignore_errors=True)
