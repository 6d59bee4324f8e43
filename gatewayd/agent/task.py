"""An agent run's task, its limits, and its result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final, Literal

import trio

from gatewayd.agent.patches import MAX_PATCH_INPUT_BYTES
from gatewayd.agent.repo import RepoCredentials

Backend = Literal["overlay", "host"]
# "cancelled": someone outside the run ended it early (a workflow's cancellation).
ErrorCodeName = Literal["timeout", "oom_killed", "internal", "task_failed", "cancelled"]

DEFAULT_MAX_WORKSPACE_BYTES: Final = 1 << 30


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
    # The tools the run may call, narrowed from what it offers (run spec ``toolIds``);
    # empty: every tool it offers. The policy still decides each call.
    tool_ids: tuple[str, ...] = ()


class RunCancel:
    """A request from outside a run to end it early, keeping what it did: the run's
    conversation stops as at its wall time (the sandbox is killed, the run audited, the
    patch of its changes made), and the result says ``cancelled``. Used from the run's
    trio thread only."""

    def __init__(self) -> None:
        self.requested = False
        self.reason = ""
        self._scope: trio.CancelScope | None = None

    def cancel(self, reason: str) -> None:
        self.requested, self.reason = True, reason
        if self._scope is not None:
            self._scope.cancel()

    def attach(self, scope: trio.CancelScope | None) -> None:
        """The scope a cancellation cancels from now on (None: none); cancelled at once
        when the request came before it."""
        self._scope = scope
        if scope is not None and self.requested:
            scope.cancel()


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
        """The run result (``ok``, the bundle, logs, ``errorCode``), plus what the operator
        needs."""
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
