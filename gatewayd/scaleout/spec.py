"""What an agent run workflow takes and gives: the run spec and the run's outcome.

Plain dataclasses that temporalio's default data converter turns into JSON and back
(field names as written here). Both travel through Temporal's history, so neither holds a
credential: the git token and the model keys are read on the host that runs the
activity, from its own environment and configuration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

# The workflow's type name, and its activities', signal's and query's names (the workflow
# refers to the activities by name: it never imports them, nor anything they import).
WORKFLOW_NAME: Final = "AgentRunWorkflow"
VALIDATE_GRANT: Final = "validate_grant"
EXECUTE_RUN: Final = "execute_run"
PUSH_BRANCH: Final = "push_branch"
RECORD_RUN_COMPLETE: Final = "record_run_complete"
PROGRESS_SIGNAL: Final = "run_progress"
PROGRESS_QUERY: Final = "progress"
# ApplicationError types the workflow never retries, and what the outcome calls them.
ERROR_TYPE_AUTHZ: Final = "AuthzDenied"
ERROR_TYPE_INVALID_SPEC: Final = "InvalidRunSpec"
ERROR_TYPE_PUSH_REFUSED: Final = "PushRefused"

# The run's limits, by the name the spec's ``limits`` carries them under.
LIMIT_MAX_TURNS: Final = "maxTurns"
LIMIT_MAX_TOKENS: Final = "maxTokens"
LIMIT_WALL_TIME_SEC: Final = "wallTimeSec"
LIMIT_MAX_MEMORY_MB: Final = "maxMemoryMb"
LIMIT_MAX_PATCH_BYTES: Final = "maxPatchBytes"
LIMIT_MAX_WORKSPACE_BYTES: Final = "maxWorkspaceBytes"
LIMIT_NAMES: Final = frozenset(
    {
        LIMIT_MAX_TURNS,
        LIMIT_MAX_TOKENS,
        LIMIT_WALL_TIME_SEC,
        LIMIT_MAX_MEMORY_MB,
        LIMIT_MAX_PATCH_BYTES,
        LIMIT_MAX_WORKSPACE_BYTES,
    }
)
# `gatewayd agent run`'s defaults, so a spec without limits runs as that command would.
DEFAULT_WALL_TIME_SEC: Final = 1800
# A patch travels in the workflow's history, and Temporal refuses a payload over 2 MiB
# (its default blob size limit): the bundle stays well below it by default.
DEFAULT_MAX_PATCH_BYTES: Final = 1 << 20

# The run result's error codes (the agent run's, plus the workflow's own two).
ERROR_AUTHZ_DENIED: Final = "authz_denied"  # the grant lacks allowSandbox: refused
ERROR_CANCELLED: Final = "cancelled"  # the workflow was cancelled; the result is partial

# The outcome's states, as the `progress` query reports them.
STATE_QUEUED: Final = "queued"
STATE_VALIDATING: Final = "validating"
STATE_RUNNING: Final = "running"
STATE_PUSHING: Final = "pushing"
STATE_RECORDING: Final = "recording"
STATE_DONE: Final = "done"
STATE_REFUSED: Final = "refused"
STATE_CANCELLED: Final = "cancelled"


@dataclass
class AgentRunSpec:
    """One agent run, as a client asks for it (reference note 004's run spec).

    ``run_id``: the caller's own id for the run, recorded beside the host's run id (the
    host always makes the run id itself: a retry gets a fresh one). ``grant``: the
    caller's execution grant; the first activity refuses a run without
    ``allowSandbox: true``. ``branch``: where to push (``cogni/<name>``; None: ``cogni/``
    and the host's run id); pushed only when ``push``.
    """

    repo: str
    sha: str
    task_input: str
    actor_id: str
    tenant_id: str
    model: str
    policy: str = "agent"
    run_id: str | None = None
    tool_ids: list[str] = field(default_factory=list)
    limits: dict[str, int] = field(default_factory=dict)
    push: bool = False
    branch: str | None = None
    pull_request: bool = False
    grant: dict[str, bool] = field(default_factory=dict)
    backend: str = "overlay"

    def limit(self, name: str, default: int) -> int:
        return int(self.limits.get(name, default))

    @property
    def wall_time_sec(self) -> int:
        return self.limit(LIMIT_WALL_TIME_SEC, DEFAULT_WALL_TIME_SEC)


@dataclass
class AgentRunOutcome:
    """What the run did (reference note 004's run result), where, and how to verify it:
    ``host`` ran it, and ``audit_head``/``audit_seq`` are the hash and sequence number of
    that host's audit entry ending the run, so a reviewer checks the run's entries
    (``audit_bundle``) against the chain on that host (``gatewayd audit verify``)."""

    ok: bool
    error_code: str | None = None
    message: str = ""
    run_id: str = ""
    host: str = ""
    audit_head: str = ""
    audit_seq: int = 0
    # {"patches": [...], "commitMessages": [...]}
    bundle: dict[str, Any] = field(default_factory=dict)
    logs: list[str] = field(default_factory=list)
    # {"entries": [...], "count": n, "truncated": bool}
    audit_bundle: dict[str, Any] = field(default_factory=dict)
    branch: str | None = None
    pushed: bool = False
    head_sha: str | None = None
    turns: int = 0
    tokens: int = 0
    # Which attempt of the execute activity made this outcome (above 1: a worker died
    # mid-run and another host ran it again, with a fresh run id).
    attempt: int = 1

    @property
    def patches(self) -> list[str]:
        return list(self.bundle.get("patches", []))


@dataclass
class PushRequest:
    """The push_branch activity's input: the patches of a finished run, onto ``sha``."""

    repo: str
    sha: str
    patches: list[str]
    branch: str
    run_id: str


@dataclass
class PushOutcome:
    branch: str
    head_sha: str
    # True when an earlier attempt of this push had already created the branch with
    # exactly these patches (its worker died before reporting): nothing pushed twice.
    already: bool = False
    host: str = ""


@dataclass
class RunRecord:
    """The record_run_complete activity's input: the workflow's final word on the run."""

    workflow_id: str
    outcome: AgentRunOutcome
    refused: bool = False


@dataclass
class Progress:
    """A heartbeat's (and the progress signal's) details: where the run is."""

    state: str
    turn: int = 0
    tool: str | None = None
    host: str = ""
    run_id: str = ""
    line: str = ""
