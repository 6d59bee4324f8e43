"""The run model: the request a caller submits, the spec gatewayd makes of it, the live
run, and the table of a run's legal states.

A caller (the control socket, `gatewayd run`) submits a :class:`RunRequest`. gatewayd
makes the run id itself (128 random bits; invariant HOST_GENERATED_RUN_ID); the registry
(:mod:`gatewayd.runs.registry`) binds the policy's paths and gives the run its directory.

The legal states of a run live in one table (:data:`TRANSITIONS`); anything else
raises and moves the run to FAILED.
"""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import pydantic
import trio

from gatewayd.policy import Policy, RunRules, TokenBucket
from gatewayd.policy.paths import PathGrant
from gatewayd.policy.workspace_section import (
    MAX_DELTA_MB,
    MAX_KEEP_FOR_S,
    MIN_DELTA_MB,
    OnEndName,
    WorkspaceModeName,
)

if TYPE_CHECKING:
    from gatewayd.sandbox.session import RunSandbox
    from gatewayd.workspace.store import RunWorkspace

# 16 random bytes = 128 bits: unguessable, so a run id alone names exactly one run.
RUN_ID_BYTES: Final = 16
# PATH_MAX: a longer path cannot name a file, so a request carrying one is not a request.
MAX_PATH_CHARS: Final = 4096


class RunState(enum.StrEnum):
    CREATED = "created"  # directory made, socket not yet listening
    SERVING = "serving"  # socket listening, calls accepted
    ENDING = "ending"  # no new connections; in-flight calls finishing
    ENDED = "ended"  # socket and directory removed
    FAILED = "failed"  # something went wrong; treated as ended, nothing served


TRANSITIONS: Final[dict[RunState, frozenset[RunState]]] = {
    RunState.CREATED: frozenset({RunState.SERVING, RunState.ENDING, RunState.FAILED}),
    RunState.SERVING: frozenset({RunState.ENDING, RunState.FAILED}),
    RunState.ENDING: frozenset({RunState.ENDED, RunState.FAILED}),
    RunState.ENDED: frozenset(),
    RunState.FAILED: frozenset({RunState.ENDED}),
}


class IllegalTransition(RuntimeError):
    """A run was asked to move to a state its table does not allow (a gatewayd bug)."""


class _Strict(pydantic.BaseModel):
    # strict: a request says what it means ("allowSandbox": "yes" is an error, not true).
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, strict=True)


class Grant(_Strict):
    """The system grant behind a run."""

    allowSandbox: bool = False


class RunLimits(_Strict):
    maxRuntimeSec: int = pydantic.Field(default=3600, gt=0, le=7 * 24 * 3600)
    # At least 64 MiB: bwrap and the sandbox's init need that much to start at all.
    maxMemoryMb: int = pydantic.Field(default=2048, ge=64, le=1 << 20)


class WorkspaceRequest(_Strict):
    """What a run request may ask of its workspace; each field unset takes the policy's
    (gatewayd/runs/workspaces.py decides). A mode must be one of the policy's
    ``workspace.request_modes``; ``keepForSec`` and ``maxDeltaMb`` may only narrow the
    policy's."""

    mode: WorkspaceModeName | None = None
    onEnd: OnEndName | None = None
    keepForSec: int | None = pydantic.Field(default=None, ge=1, le=MAX_KEEP_FOR_S)
    maxDeltaMb: int | None = pydantic.Field(default=None, ge=MIN_DELTA_MB, le=MAX_DELTA_MB)


class RunRequest(_Strict):
    """What a caller may ask for. It has no runId field: gatewayd makes the id."""

    workspacePath: str = pydantic.Field(min_length=1, max_length=MAX_PATH_CHARS)
    # A policy's name, looked up in the configured policy directories. Only gatewayd's
    # own command line may name a file instead (``RunManager.start(policy_paths=True)``).
    policy: str = pydantic.Field(min_length=1, max_length=MAX_PATH_CHARS)
    actorId: str = pydantic.Field(min_length=1, max_length=200)
    tenantId: str = pydantic.Field(min_length=1, max_length=200)
    grant: Grant = Grant()
    toolIds: tuple[str, ...] | None = None
    limits: RunLimits = RunLimits()
    taskInput: str = ""
    graphId: str = pydantic.Field(default="sandbox:task", max_length=200)
    billingAccountId: str | None = pydantic.Field(default=None, max_length=200)
    # A root filesystem for the sandbox instead of the host's system directories
    # (sandbox_image/README.md); an absolute host path, checked when the run starts.
    sandboxImage: str | None = pydantic.Field(default=None, max_length=MAX_PATH_CHARS)
    # The run's virtual workspace (mode, what happens at its end); None: the policy's.
    workspace: WorkspaceRequest | None = None

    @pydantic.model_validator(mode="before")
    @classmethod
    def _no_run_id(cls, data: object) -> object:
        if isinstance(data, dict) and "runId" in data:
            raise ValueError("runId is assigned by gatewayd and cannot be supplied by the caller")
        return data


def format_validation_error(exc: pydantic.ValidationError) -> str:
    """One line per problem, naming the field by its dotted path."""
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(request)"
        lines.append(f"{where}: {err['msg']}")
    return "; ".join(lines)


def new_run_id() -> str:
    """A fresh run id: 32 lowercase hex characters from the OS CSPRNG."""
    return secrets.token_hex(RUN_ID_BYTES)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSpec:
    """A run as gatewayd made it: the request plus what gatewayd decided."""

    runId: str
    request: RunRequest
    workspace: Path
    policy: Policy
    policy_source: str
    grants: tuple[PathGrant, ...]
    rules: RunRules
    # A child run (an app's invocation, an MCP server's instance): the run whose call
    # made it (None: gatewayd's own, a shared MCP server), and what it was made for. A
    # child gets no more than its parent (gatewayd/apps/child.py, gatewayd/mcp/child.py).
    parent_run_id: str | None = None
    made_for: MadeFor | None = None

    @property
    def app(self) -> str | None:
        """The app this run is an invocation of, if it is one."""
        made_for = self.made_for
        return made_for.name if made_for and made_for.kind is ChildKind.APP else None


class ChildKind(enum.StrEnum):
    """What gatewayd makes a run for, besides a caller asking for one; the key under
    which ``run_created``, ``run_refused`` and the run's summary name it."""

    APP = "app"  # an app's invocation
    MCP_SERVER = "mcpServer"  # an instance of a declared MCP server


@dataclass(frozen=True, slots=True, kw_only=True)
class MadeFor:
    """What a built run is: an app's invocation, an MCP server's instance, and whose."""

    kind: ChildKind
    name: str

    def label(self) -> dict[str, str]:
        """How the audit and the summary name it: ``{"app": "notes"}``."""
        return {str(self.kind): self.name}


@dataclass(frozen=True, slots=True, kw_only=True)
class ChildSpec:
    """What a child run is made of, decided by whoever makes it (an app's invocation,
    an MCP server's instance): its policy and grants are built, never loaded, and hold
    no more than the parent's (``parent_run_id`` None: a run gatewayd makes for itself,
    a shared MCP server, with a workspace of its own). ``source`` labels the policy in
    the audit (no file behind it)."""

    parent_run_id: str | None
    made_for: MadeFor
    request: RunRequest
    workspace: Path
    policy: Policy
    source: str
    grants: tuple[PathGrant, ...]


@dataclass(eq=False, kw_only=True)
class ModelBudget:
    """What a run's model.chat calls have spent, against its policy's limits."""

    max_requests: int
    max_tokens: int
    requests: int = 0
    tokens: int = 0

    def spent(self) -> str | None:
        """Why no further request may be made, or None."""
        if self.requests >= self.max_requests:
            return f"this run's {self.max_requests} model requests are spent"
        if self.tokens >= self.max_tokens:
            return f"this run's {self.max_tokens} model tokens are spent"
        return None


@dataclass(eq=False, kw_only=True)
class Run:
    """A live run: its spec, its directory and socket, and what it has done so far."""

    spec: RunSpec
    directory: Path
    socket_path: Path
    state: RunState = RunState.CREATED
    bucket: TokenBucket
    limiter: trio.CapacityLimiter
    calls: int = 0
    allowed: int = 0
    denied: int = 0
    denied_by_code: dict[str, int] = field(default_factory=dict)
    cancel_scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    finished: trio.Event = field(default_factory=trio.Event)
    end_reason: str = "ended"
    model_budget: ModelBudget = field(
        default_factory=lambda: ModelBudget(max_requests=0, max_tokens=0)
    )
    # The run's OS sandbox; None when the run is degraded (see ``degraded``).
    sandbox: RunSandbox | None = None
    # Why the run has no OS sandbox (its policy allowed that); None when it has one.
    degraded: str | None = None
    # The run's egress proxy (gatewayd/egress.py) when its policy turns it on.
    egress: Any = None
    # The run's workspace session (gatewayd/runs/workspaces.py); None: the run works on
    # its workspace directory as it is (an agent run's own session, a child run).
    workspace: RunWorkspace | None = None
    # What becomes of that session when the run ends (keep, commit, discard), and, once
    # it ended, what became of it ("kept until <time>", "committed", "discarded").
    workspace_on_end: str | None = None
    workspace_fate: str | None = None
    # Who chose the session's mode: request, policy, configuration or default.
    workspace_mode_from: str | None = None
    # On trio's clock: when the run began serving, and when its wall-time limit
    # (limits.maxRuntimeSec) ends it; None until it serves (sandbox.usage reports both).
    serving_since: float | None = None
    deadline: float | None = None
    # The seq of its creation's entries (run_created, workspace_opened), once recorded.
    created_seq: int | None = None
    # What the dispatcher derives from the run once instead of at every call (its own
    # business: gatewayd/dispatch.py makes it, and makes it again when the spec changes).
    dispatch_memo: Any = None

    @property
    def run_id(self) -> str:
        return self.spec.runId

    def move_to(self, new: RunState) -> None:
        """Change state by the table; an illegal move fails the run and raises."""
        if new not in TRANSITIONS[self.state]:
            old = self.state
            if RunState.FAILED in TRANSITIONS[old]:
                self.state = RunState.FAILED
            raise IllegalTransition(f"run {self.run_id}: {old} -> {new} is not allowed")
        self.state = new

    def count(self, error_code: str | None) -> None:
        """Tally one finished call."""
        self.calls += 1
        if error_code is None:
            self.allowed += 1
        else:
            self.denied += 1
            self.denied_by_code[error_code] = self.denied_by_code.get(error_code, 0) + 1

    @property
    def workspace_base(self) -> Path:
        """The host directory the run was asked to work on (its session's base)."""
        return self.workspace.base if self.workspace is not None else self.spec.workspace

    def workspace_summary(self) -> dict[str, object]:
        """The run's workspace as the summary shows it: its mode (None: no session of
        gatewayd's: the directory as it is), base, root (what the sandbox sees), what
        happens at the end and, once ended, what happened."""
        return {
            "mode": self.workspace.mode if self.workspace is not None else None,
            "base": str(self.workspace_base),
            "root": str(self.spec.workspace),
            "onEnd": self.workspace_on_end,
            **({"fate": self.workspace_fate} if self.workspace_fate is not None else {}),
        }

    def summary(self) -> dict[str, object]:
        """What the control socket and `gatewayd run` show about a run."""
        return {
            "runId": self.run_id,
            "state": str(self.state),
            "actorId": self.spec.request.actorId,
            "tenantId": self.spec.request.tenantId,
            "policy": self.spec.policy.name,
            "workspace": self.workspace_summary(),
            "socket": str(self.socket_path),
            "osSandbox": self.sandbox is not None,
            "degraded": self.degraded,
            "calls": self.calls,
            "allowed": self.allowed,
            "denied": self.denied,
            "deniedByCode": dict(self.denied_by_code),
            **(
                {"parentRunId": self.spec.parent_run_id, **self.spec.made_for.label()}
                if self.spec.made_for is not None
                else {}
            ),
        }
