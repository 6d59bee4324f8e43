"""What a client may ask of agent runs on Temporal, checked before anything is sent.

:class:`AgentSubmission` is one run to schedule: the run spec of reference note 004 (the
task, the repository and commit, the limits, the grant) and never a credential. The git
token and the model keys live on the hosts that run the activities, and Temporal keeps
everything a client sends in the workflow's history, so a submission naming a
credential field, or a repository URL with a user, password or query in it, is refused
here, before it reaches Temporal. Both the control socket (``POST /v1/agent-runs``) and
``gatewayd agent submit`` check a submission with this model.

Also here, without the Temporal SDK (so the control socket imports it at no cost): the
workflow ids clients make and answer, where runs go (:class:`TemporalTarget`), and the
error every client operation raises (:class:`AgentRunsError`, its ``kind`` saying whose
fault it is). The operations themselves are :mod:`gatewayd.scaleout.client`'s.
"""

from __future__ import annotations

import enum
import math
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal
from urllib.parse import urlsplit

import pydantic

from gatewayd.policy.section import MODEL_ALIAS_RE
from gatewayd.scaleout.spec import AgentRunSpec

# Workflow ids the clients make, and the only ones they answer for: a prefix of their
# own and 128 random bits, so an id names one agent run and is never guessed or reused.
WORKFLOW_ID_PREFIX: Final = "agent-run-"
WORKFLOW_ID_RE: Final = re.compile(r"agent-run-[0-9a-f]{32}")

# Temporal warns about payloads over 512 KiB and refuses them over 2 MiB; the task is
# most of a submission, and the history keeps it, so it stays well below.
MAX_TASK_BYTES: Final = 256 * 1024
MAX_REPO_URL_CHARS: Final = 2048
MAX_NAME_CHARS: Final = 200  # actor, tenant, policy, tool and branch names
MAX_TOOL_IDS: Final = 256
# A submission's limits and their bounds: each is checked again by the worker, whose
# host decides what it can give; these only keep nonsense out of the history.
MAX_TURNS: Final = 10_000
MAX_TOKENS: Final = 100_000_000
MAX_WALL_TIME_S: Final = 7 * 24 * 3600  # the longest activity a worker will hold
MIN_MEMORY_MB: Final = 64  # `gatewayd agent run`'s own floor
MAX_MEMORY_MB: Final = 1 << 20
# A patch travels back in the workflow's history, whose payloads Temporal refuses over
# 2 MiB: the bundle's patches must fit below it beside the logs and the audit bundle.
MAX_PATCH_BYTES: Final = 1536 * 1024
MAX_WORKSPACE_BYTES: Final = 1 << 40
# `gatewayd agent run`'s defaults, so a submission without limits runs as it would.
DEFAULT_LIMITS: Final[Mapping[str, int]] = {
    "maxTurns": 40,
    "maxTokens": 400_000,
    "wallTimeSec": 1800,
    "maxMemoryMb": 2048,
}
# Keys that name a credential, whatever their case or separators: refused by name with
# a message saying where credentials live, rather than as an unknown field.
_CREDENTIAL_KEY_RE: Final = re.compile(
    r"token|secret|password|passwd|credential|api_?key|auth|private_?key", re.IGNORECASE
)
# A git ref name a client may ask for: no "..", no control characters, no leading "-",
# no ref-lock or reflog syntax (git check-ref-format's rules, narrowed).
_BRANCH_RE: Final = re.compile(r"(?!-)(?!.*\.\.)(?!.*//)(?!.*@\{)[A-Za-z0-9._/-]+(?<![./])")
_NOT_BRANCHES: Final = frozenset({"HEAD", "main", "master"})
_DEFAULT_POLICY: Final = "agent"


class ErrorKind(enum.Enum):
    """Whose fault a failure is, which says the control socket's HTTP status."""

    BAD_REQUEST = 400  # the submission or the id
    NOT_FOUND = 404  # no agent run of this id in the namespace
    CONFLICT = 409  # not finished yet (result), already finished (cancel)
    UNREACHABLE = 502  # Temporal refused or failed the call
    TIMEOUT = 504  # Temporal did not answer in time


class AgentRunsError(Exception):
    """A refused or failed request; ``str(exc)`` says what to do."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


@dataclass(frozen=True, slots=True, kw_only=True)
class TemporalTarget:
    """Where agent runs go: the frontend's ``host:port``, the namespace, the task queue
    the workers poll (docs/scale-out.md: one queue per pool of like hosts)."""

    address: str
    namespace: str
    task_queue: str


def _no_control(value: str, what: str) -> str:
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in value):
        raise ValueError(f"{what} holds a control character")
    return value


Name = Annotated[str, pydantic.Field(min_length=1, max_length=MAX_NAME_CHARS)]


class Grant(pydantic.BaseModel):
    """The submitter's execution grant (reference note 004's ``ExecutionGrant``): the
    workflow's first activity refuses a run without ``allowSandbox: true``. Required
    over HTTP, so a service relaying its users' requests states it; ``gatewayd agent
    submit`` (the host's operator) sends it."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, strict=True)

    allowSandbox: bool


class SubmissionLimits(pydantic.BaseModel):
    """The run's limits, in the run spec's names (reference note 004); unset: the
    defaults of ``gatewayd agent run``."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, strict=True)

    maxTurns: int = pydantic.Field(default=DEFAULT_LIMITS["maxTurns"], ge=1, le=MAX_TURNS)
    maxTokens: int = pydantic.Field(default=DEFAULT_LIMITS["maxTokens"], ge=1, le=MAX_TOKENS)
    wallTimeSec: int = pydantic.Field(
        default=DEFAULT_LIMITS["wallTimeSec"], ge=1, le=MAX_WALL_TIME_S
    )
    maxMemoryMb: int = pydantic.Field(
        default=DEFAULT_LIMITS["maxMemoryMb"], ge=MIN_MEMORY_MB, le=MAX_MEMORY_MB
    )
    maxPatchBytes: int | None = pydantic.Field(default=None, ge=1, le=MAX_PATCH_BYTES)
    maxWorkspaceBytes: int | None = pydantic.Field(default=None, ge=0, le=MAX_WORKSPACE_BYTES)

    def as_spec(self) -> dict[str, int]:
        return {key: value for key, value in self.model_dump().items() if value is not None}


class AgentSubmission(pydantic.BaseModel):
    """``POST /v1/agent-runs`` and ``gatewayd agent submit``: one agent run to schedule.

    The run spec of reference note 004 without ``runId`` (the worker that runs it makes
    the run id; the workflow id names the submission) and without any credential (the
    worker's host holds the git token and the model keys; the history keeps everything
    a client sends). ``push`` defaults to true as with ``gatewayd agent run``.
    """

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, strict=True)

    grant: Grant
    repo: str = pydantic.Field(min_length=1, max_length=MAX_REPO_URL_CHARS)
    sha: str = pydantic.Field(pattern=r"^([0-9a-f]{40}|[0-9a-f]{64})$")
    taskInput: str = pydantic.Field(min_length=1)
    model: str = pydantic.Field(min_length=1, max_length=MAX_NAME_CHARS)
    policy: Name = _DEFAULT_POLICY
    actorId: Name = "operator"
    tenantId: Name = "local"
    toolIds: list[Name] = pydantic.Field(default_factory=list, max_length=MAX_TOOL_IDS)
    limits: SubmissionLimits = pydantic.Field(default_factory=SubmissionLimits)
    backend: Literal["overlay", "host"] = "overlay"
    push: bool = True
    branch: str | None = pydantic.Field(default=None, max_length=MAX_NAME_CHARS)
    pullRequest: bool = False

    @pydantic.model_validator(mode="before")
    @classmethod
    def _no_credentials(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            named = sorted(str(key) for key in data if _CREDENTIAL_KEY_RE.search(str(key)))
            if named:
                raise ValueError(
                    f"{', '.join(named)}: a submission carries no credential; the git "
                    "token and the model keys are the worker hosts' own (their "
                    "environment or systemd credentials), because everything submitted "
                    "is kept in the workflow's history"
                )
            if "runId" in data:
                raise ValueError(
                    "runId: run ids are made by the worker that runs the task, never "
                    "taken from a request; the workflow id identifies the submission"
                )
        return data

    @pydantic.field_validator("repo")
    @classmethod
    def _repo_without_credentials(cls, value: str) -> str:
        _no_control(value, "the repository URL")
        if value.startswith("-"):
            raise ValueError("the repository URL may not start with '-'")
        if value.startswith("/"):
            return value  # a path on the worker hosts (a shared or test repository)
        parts = urlsplit(value)
        if parts.scheme not in ("https", "http", "file"):
            raise ValueError(
                f"scheme {parts.scheme!r} is not supported: use https:// (or http:// to a "
                "loopback test server, file:// or an absolute path on the workers)"
            )
        if "@" in parts.netloc:
            raise ValueError(
                "the repository URL carries a user or password (user@ or user:password@): "
                "remove it; the workers send their own git token as a header"
            )
        if parts.query or parts.fragment:
            raise ValueError(
                "the repository URL has a query or fragment (?... or #...): remove it; a "
                "token there would be kept in the workflow's history"
            )
        return value

    @pydantic.field_validator("taskInput")
    @classmethod
    def _task_size(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("the task is empty")
        if len(value.encode()) > MAX_TASK_BYTES:
            raise ValueError(
                f"the task is over {MAX_TASK_BYTES} bytes: Temporal keeps it in the "
                "workflow's history, whose payloads are capped; shorten it or put the "
                "details in the repository"
            )
        return value

    @pydantic.field_validator("model")
    @classmethod
    def _model_alias(cls, value: str) -> str:
        if not MODEL_ALIAS_RE.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a model alias: the name of a model in the workers' "
                "gatewayd configuration (letters, digits, '-', '_', '.')"
            )
        return value

    @pydantic.field_validator("policy", "actorId", "tenantId")
    @classmethod
    def _plain_name(cls, value: str, info: pydantic.ValidationInfo) -> str:
        _no_control(value, info.field_name or "a name")
        if info.field_name == "policy" and ("/" in value or value.startswith(".")):
            raise ValueError(
                "the policy is the name of a policy on the workers (their policy_dirs), not a path"
            )
        return value

    @pydantic.field_validator("toolIds")
    @classmethod
    def _plain_tool_ids(cls, value: list[str]) -> list[str]:
        for tool_id in value:
            _no_control(tool_id, "a tool id")
        return value

    @pydantic.field_validator("pullRequest")
    @classmethod
    def _no_pull_request(cls, value: bool) -> bool:
        # The workers' first activity refuses it (they open no pull request yet):
        # refused here instead, before a workflow that can only fail is started.
        if value:
            raise ValueError(
                "pull requests are not opened by the workers yet: submit with push only "
                "and open the pull request from the pushed branch"
            )
        return value

    @pydantic.field_validator("branch")
    @classmethod
    def _branch_name(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not _BRANCH_RE.fullmatch(value) or value.endswith(".lock"):
            raise ValueError(
                f"{value!r} is not a branch name a run may push to: letters, digits, "
                "'.', '_', '-' and '/', no '..', not starting with '-'"
            )
        if value in _NOT_BRANCHES or value.startswith("refs/"):
            raise ValueError(
                f"{value!r}: a run never pushes to the default branch or a full ref; "
                "name a new branch (unset: cogni/<run-id>)"
            )
        return value

    def spec(self) -> AgentRunSpec:
        """The workflow's input: what was submitted, the run id left to the worker."""
        return AgentRunSpec(
            run_id=None,
            repo=self.repo,
            sha=self.sha,
            task_input=self.taskInput,
            actor_id=self.actorId,
            tenant_id=self.tenantId,
            tool_ids=list(self.toolIds),
            model=self.model,
            policy=self.policy,
            limits=self.limits.as_spec(),
            push=self.push,
            branch=self.branch,
            pull_request=self.pullRequest,
            grant={"allowSandbox": self.grant.allowSandbox},
            backend=self.backend,
        )


def wall_time_limit(seconds: float) -> int:
    """``--max-wall-s`` as the spec's whole seconds (never rounded down to less)."""
    return max(1, math.ceil(seconds))


def check_workflow_id(workflow_id: str) -> str:
    if not WORKFLOW_ID_RE.fullmatch(workflow_id):
        raise AgentRunsError(
            ErrorKind.BAD_REQUEST,
            f"{workflow_id[:80]!r} is not an agent run's workflow id: "
            f"{WORKFLOW_ID_PREFIX} and 32 lowercase hex digits, as submit printed it",
        )
    return workflow_id


def new_workflow_id() -> str:
    return WORKFLOW_ID_PREFIX + secrets.token_hex(16)
