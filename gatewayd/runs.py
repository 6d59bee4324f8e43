"""Runs: the spec a caller asks for, the run gatewayd makes of it, and the run registry.

A caller (the control socket, `gatewayd run`) submits a :class:`RunRequest`. gatewayd
refuses it unless its grant says ``allowSandbox: true``, makes the run id itself
(128 random bits; invariant HOST_GENERATED_RUN_ID), binds the policy's paths to the
workspace, and gives the run a private directory holding its socket.

The legal states of a run live in one table (:data:`TRANSITIONS`); anything else
raises and moves the run to FAILED.
"""

from __future__ import annotations

import enum
import os
import secrets
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import pydantic
import trio

from gatewayd.errors import AuthzDenied
from gatewayd.hostpaths.binding import bind_paths
from gatewayd.policy import Policy, RunRules, TokenBucket
from gatewayd.policy.model import POLICY_NAME_RE
from gatewayd.policy.paths import PathGrant
from gatewayd.sandbox.plan import SOCKET_NAME

if TYPE_CHECKING:
    from gatewayd.sandbox.session import RunSandbox

# 16 random bytes = 128 bits: unguessable, so a run id alone names exactly one run.
RUN_ID_BYTES: Final = 16
# A unix socket path must fit in sun_path (108 bytes including the NUL).
MAX_SOCKET_PATH: Final = 107
# PATH_MAX: a longer path cannot name a file, so a request carrying one is not a request.
MAX_PATH_CHARS: Final = 4096
# A policy named by its name is the file ``<name>.yaml`` in a policy directory
# (policy.model's POLICY_NAME_RE: the characters of a policy's own ``name`` field).
POLICY_SUFFIX: Final = ".yaml"
PRIVATE_DIR_MODE: Final = 0o700
# The state directory and runs/: nobody but root may list or create anything, but a
# run's uid may pass through to its own directory (root:<run gid> 0710), whose socket
# bwrap binds into the sandbox while running as that uid. Run ids are 128-bit secrets,
# so passing through without listing reveals nothing.
PASS_THROUGH_DIR_MODE: Final = 0o711


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
    """The system grant behind a run (reference note 004's ExecutionGrant)."""

    allowSandbox: bool = False


class RunLimits(_Strict):
    maxRuntimeSec: int = pydantic.Field(default=3600, gt=0, le=7 * 24 * 3600)
    # At least 64 MiB: bwrap and the sandbox's init need that much to start at all.
    maxMemoryMb: int = pydantic.Field(default=2048, ge=64, le=1 << 20)


class RunRequest(_Strict):
    """What a caller may ask for. It has no runId field: gatewayd makes the id."""

    workspacePath: str = pydantic.Field(min_length=1, max_length=MAX_PATH_CHARS)
    # A policy's name, looked up in the configured policy directories. Only gatewayd's
    # own command line may name a file instead (``Daemon.start_run(policy_paths=True)``).
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

    def summary(self) -> dict[str, object]:
        """What the control socket and `gatewayd run` show about a run."""
        return {
            "runId": self.run_id,
            "state": str(self.state),
            "actorId": self.spec.request.actorId,
            "tenantId": self.spec.request.tenantId,
            "policy": self.spec.policy.name,
            "workspace": str(self.spec.workspace),
            "socket": str(self.socket_path),
            "osSandbox": self.sandbox is not None,
            "degraded": self.degraded,
            "calls": self.calls,
            "allowed": self.allowed,
            "denied": self.denied,
            "deniedByCode": dict(self.denied_by_code),
        }


def make_private_dir(path: Path, mode: int = PRIVATE_DIR_MODE) -> None:
    """Create ``path`` as a ``mode`` directory owned by us, refusing anything else there."""
    path.mkdir(mode=mode, parents=False, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise RuntimeError(f"{path} exists and is not a directory owned by uid {os.geteuid()}")
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)


class RunRegistry:
    """The runs this daemon serves, under ``state_dir/runs/<runId>/``."""

    def __init__(self, state_dir: Path, *, policy_loader: PolicyLoader) -> None:
        self.state_dir = state_dir
        self.runs_dir = state_dir / "runs"
        self._load_policy = policy_loader
        self._runs: dict[str, Run] = {}
        state_dir.mkdir(mode=PASS_THROUGH_DIR_MODE, parents=True, exist_ok=True)
        make_private_dir(state_dir, PASS_THROUGH_DIR_MODE)
        make_private_dir(self.runs_dir, PASS_THROUGH_DIR_MODE)

    def load_policy(self, ref: str) -> tuple[Policy, str]:
        """A policy by name or by path (gatewayd's own use: a live run's source file, the
        local command line): (policy, source path)."""
        return self._load_policy(ref)

    def load_policy_by_name(self, name: str) -> tuple[Policy, str]:
        """A policy by name only, from the configured policy directories (what the
        control socket may ask for): (policy, source path)."""
        return self._load_policy.by_name(name)

    def get(self, run_id: str) -> Run | None:
        return self._runs.get(run_id)

    def all(self) -> list[Run]:
        return list(self._runs.values())

    def create(self, request: RunRequest, *, policy_paths: bool = False) -> Run:
        """Make a run from ``request``; raises AuthzDenied without the sandbox grant.
        ``policy_paths``: the request's ``policy`` may name a file (gatewayd's own
        command line); otherwise it is a name in the configured policy directories.

        Error handling: AuthzDenied when the grant lacks allowSandbox; PolicyError when
        the policy cannot be loaded or bound; ValueError for a bad workspace.
        """
        if not request.grant.allowSandbox:
            raise AuthzDenied(
                "run refused: its grant lacks allowSandbox: true. Sandbox runs need a "
                "system grant; they cannot be started from a user-facing request."
            )
        workspace = Path(request.workspacePath)
        if not workspace.is_absolute():
            raise ValueError(f"workspacePath must be absolute, got {request.workspacePath!r}")
        if not workspace.is_dir():
            raise ValueError(f"workspacePath {request.workspacePath!r} is not a directory")
        workspace = workspace.resolve(strict=True)
        if policy_paths:
            policy, source = self._load_policy(request.policy)
        else:
            policy, source = self._load_policy.by_name(request.policy)
        grants = bind_paths(policy, workspace)
        rules = RunRules(
            tool_patterns=tuple(policy.tools.allow),
            run_tool_ids=request.toolIds,
            grants=grants,
        )
        run_id = new_run_id()
        directory = self.runs_dir / run_id
        socket_path = directory / SOCKET_NAME
        if len(os.fsencode(socket_path)) > MAX_SOCKET_PATH:
            raise ValueError(
                f"state directory {self.state_dir} is too long for a unix socket path; "
                "choose a shorter --state-dir"
            )
        directory.mkdir(mode=0o700)  # a fresh id: an existing directory is an error
        limits = policy.limits
        run = Run(
            spec=RunSpec(
                runId=run_id,
                request=request,
                workspace=workspace,
                policy=policy,
                policy_source=source,
                grants=grants,
                rules=rules,
            ),
            directory=directory,
            socket_path=socket_path,
            bucket=TokenBucket(rate=limits.calls_per_second, burst=limits.burst),
            model_budget=ModelBudget(
                max_requests=policy.model_access.max_requests,
                max_tokens=policy.model_access.max_tokens,
            ),
            limiter=trio.CapacityLimiter(limits.max_concurrent_calls),
        )
        self._runs[run_id] = run
        return run

    def remove(self, run: Run) -> None:
        """Forget ``run`` and delete its directory (socket included)."""
        self._runs.pop(run.run_id, None)
        shutil.rmtree(run.directory, ignore_errors=True)

    def forget(self, run: Run) -> None:
        """Forget ``run`` but keep its directory: it holds a lease record that the next
        daemon start must still give back."""
        self._runs.pop(run.run_id, None)
        (run.directory / SOCKET_NAME).unlink(missing_ok=True)


class PolicyLoader:
    """Turns a request's ``policy`` string into a loaded policy: (policy, source path).

    :meth:`by_name` looks a name up as ``<name>.yaml`` in the configured policy
    directories, in order, and nothing else: what a control-socket caller may ask for.
    Calling the loader also takes a path (anything with a ``/`` or a ``.yaml``/``.yml``
    suffix), for gatewayd's own command line and a live run's recorded source.
    """

    def __init__(self, search_dirs: tuple[Path, ...]) -> None:
        self.search_dirs = search_dirs

    def by_name(self, name: str) -> tuple[Policy, str]:
        """The policy called ``name`` in the policy directories.

        Error handling: PolicyError for a string that is not a policy name (a path, a
        long string: nothing is looked up) or a name no directory holds.
        """
        from gatewayd.policy import PolicyError
        from gatewayd.policyfile import load_policy

        if not POLICY_NAME_RE.fullmatch(name):
            shown = (
                repr(name) if len(name) <= 70 else repr(name[:64]) + f"... ({len(name)} characters)"
            )
            raise PolicyError(
                "policy",
                [
                    f"{shown} is not a policy name: give the name of a policy in the "
                    f"policy directories ({self._where()}), 1-64 letters, digits and ._- "
                    "(e.g. 'demo'); a path is not accepted here"
                ],
            )
        for directory in self.search_dirs:
            path = directory / f"{name}{POLICY_SUFFIX}"
            if os.path.lexists(path):
                # The source is the file itself: what the audit names and a reload reads.
                return load_policy(path), os.path.realpath(path)
        hint = ""
        if name.endswith((".yaml", ".yml")):
            stem = name.rsplit(".", 1)[0]
            hint = f" (a policy's name is its file's name without the suffix: {stem!r})"
        raise PolicyError(name, [f"no policy named {name!r} in {self._where()}{hint}"])

    def __call__(self, ref: str) -> tuple[Policy, str]:
        from gatewayd.policyfile import load_policy

        if "/" in ref or ref.endswith((".yaml", ".yml")):
            path = Path(ref)
            return load_policy(path), str(path)
        return self.by_name(ref)

    def _where(self) -> str:
        return ", ".join(str(d) for d in self.search_dirs) or "(no policy directory configured)"
