"""Policy files: pydantic models and the YAML text they are parsed from.

A policy is a YAML file validated into frozen models with ``extra="forbid"`` at every
level, so a misspelt key is an error rather than a silently ignored rule. Errors are
collected into one :class:`PolicyError` that names the file and every bad field by its
dotted path (``filesystem.paths.workspace.mode``), with what was found.

Each section is one model and one field of :class:`Policy`; a later section (review,
network, ...) is added the same way. Nothing here touches the filesystem: reading a
policy file is :mod:`gatewayd.policyfile`'s, binding its path rules to host directories
:mod:`gatewayd.hostpaths.binding`'s.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import re
from collections.abc import Iterable, Mapping
from pathlib import PurePosixPath
from typing import Annotated, Any, Final, Literal

from pydantic import (
    AfterValidator,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from gatewayd import strictyaml
from gatewayd.policy.approvals_section import ApprovalsSection
from gatewayd.policy.package_managers import package_manager_domains, unknown_package_manager
from gatewayd.policy.patches_section import PatchesSection
from gatewayd.policy.paths import WORKSPACE_VISIBLE_ROOT
from gatewayd.policy.review_section import Domain, ReviewSection
from gatewayd.policy.section import (
    ModelAliasName,
    PositiveInt,
    Section,
    StrictBool,
    StrictStr,
    ToolPattern,
    model_at,
)
from gatewayd.policy.workspace_section import WorkspaceSection

POLICY_VERSION: Final = 1

# --- limit defaults and bounds (the reason beside each) ------------------------------

# Long enough for a model call through the gateway (often 10-30 s), short enough that
# a stuck tool gives its concurrency slot back within a minute.
DEFAULT_CALL_TIMEOUT_S: Final = 30.0
# An hour: anything longer is a job, not a tool call, and should be split.
MAX_CALL_TIMEOUT_S: Final = 3600.0
# One response value; matches the protocol's default frame size, so a default run
# never produces a value the frame limit would refuse anyway.
DEFAULT_MAX_OUTPUT_BYTES: Final = 1 << 20
# Below 1 KiB even an error-free directory listing is cut; above 16 MiB one call
# makes the daemon hold too much memory for one run.
MIN_MAX_OUTPUT_BYTES: Final = 1024
MAX_MAX_OUTPUT_BYTES: Final = 16 << 20
# An agent loop rarely makes more than a few calls a second; 50 leaves room for
# scripted bursts while stopping a runaway loop from flooding the audit log.
DEFAULT_CALLS_PER_SECOND: Final = 50.0
# Enough parallel calls for a fan-out (read 16 files at once) without letting one run
# hold most of the daemon's tasks and file descriptors.
DEFAULT_MAX_CONCURRENT_CALLS: Final = 16
# Each concurrent call may hold a task and a few descriptors; past this one run could
# exhaust the daemon's descriptor limit.
MAX_MAX_CONCURRENT_CALLS: Final = 1024


def default_burst(calls_per_second: float) -> int:
    """The token bucket size when the policy gives none: two seconds' worth of calls."""
    return max(1, math.ceil(2 * calls_per_second))


# Where the sandbox's own machinery lives: a mount at, above or below one of these
# would hide or replace it (/workspace is the run's workspace; relative roots go there).
RESERVED_VISIBLE_ROOTS: Final = tuple(
    PurePosixPath(p) for p in ("/workspace", "/proc", "/dev", "/sys", "/run/cogni", "/tmp")
)

# A policy's name, and so its file's name in a policy directory: never a path.
POLICY_NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_PATH_NAME_RE: Final = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")
_SUFFIX_RE: Final = re.compile(r"(\.[A-Za-z0-9_+~-]+)+")


class PolicyError(Exception):
    """A policy file that cannot be read, parsed, validated or bound.

    ``str(exc)`` is one line per problem, each starting with ``source`` (the file).
    """

    def __init__(self, source: str, problems: Iterable[str]) -> None:
        self.source = source
        self.problems = tuple(problems) or ("invalid policy",)
        super().__init__("\n".join(f"{source}: {p}" for p in self.problems))


# --- field types ----------------------------------------------------------------------


def _check_name(value: str) -> str:
    if not POLICY_NAME_RE.fullmatch(value):
        raise ValueError(
            f"name {value!r} must be 1-64 letters, digits and ._- starting with a letter or digit"
        )
    return value


def _check_path_name(value: str) -> str:
    if not _PATH_NAME_RE.fullmatch(value):
        raise ValueError(
            f"path rule name {value!r} must be 1-64 letters, digits, _ and -, "
            "starting with a letter"
        )
    return value


def _check_suffix(value: str) -> str:
    if not _SUFFIX_RE.fullmatch(value):
        raise ValueError(
            f"suffix {value!r} must be '.' followed by letters, digits or _+~- "
            "(e.g. '.md', '.tar.gz')"
        )
    return value


def _plain_parts(value: str, what: str) -> list[str]:
    """The components of a path written in a policy, which must not climb with '..'."""
    parts = [p for p in value.split("/") if p not in ("", ".")]
    if not value or "\x00" in value or ".." in parts:
        raise ValueError(f"{what} {value!r} must be a non-empty path without '..' or NUL")
    return parts


PolicyName = Annotated[StrictStr, AfterValidator(_check_name)]
PathRuleName = Annotated[StrictStr, AfterValidator(_check_path_name)]
Suffix = Annotated[StrictStr, AfterValidator(_check_suffix)]


# --- models ---------------------------------------------------------------------------


class ToolsSection(Section):
    """Which tools the run may call. Empty: none (DENY_BY_DEFAULT)."""

    allow: tuple[ToolPattern, ...] = ()


class PathRule(Section):
    """One directory the run may reach, and how."""

    root: StrictStr
    mode: Literal["ro", "rw"]
    suffixes: tuple[Suffix, ...] = ()
    max_file_bytes: PositiveInt | None = None
    mount: StrictStr | None = None

    @field_validator("root")
    @classmethod
    def _normalize_root(cls, value: str) -> str:
        parts = _plain_parts(value, "root")
        if value.startswith("/"):
            return "/" + "/".join(parts)
        return "/".join(parts) or "."

    @field_validator("mount")
    @classmethod
    def _normalize_mount(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = _plain_parts(value, "mount")
        if not value.startswith("/"):
            raise ValueError(f"mount {value!r} must be an absolute path")
        return "/" + "/".join(parts)

    @model_validator(mode="after")
    def _check_visible_root(self) -> PathRule:
        if self.mount is not None and not self.is_absolute:
            raise ValueError(
                f"mount is only for absolute roots; the relative root {self.root!r} "
                f"always appears at {self.visible_root}"
            )
        if self.is_absolute:
            visible = self.visible_root
            for reserved in RESERVED_VISIBLE_ROOTS:
                if visible.is_relative_to(reserved) or reserved.is_relative_to(visible):
                    where = (
                        f"mount {str(visible)!r}"
                        if self.mount is not None
                        else f"root {str(visible)!r} (seen at the same path: no mount given)"
                    )
                    raise ValueError(
                        f"{where} would overlap {reserved}; reserved "
                        "in the sandbox: " + ", ".join(str(r) for r in RESERVED_VISIBLE_ROOTS)
                    )
        return self

    @property
    def is_absolute(self) -> bool:
        """An absolute root is a host directory; a relative one is inside the workspace."""
        return self.root.startswith("/")

    @property
    def visible_root(self) -> PurePosixPath:
        """Where the sandbox (and the agent's paths) see this directory."""
        if not self.is_absolute:
            return WORKSPACE_VISIBLE_ROOT / self.root  # pathlib drops a lone "."
        return PurePosixPath(self.mount if self.mount is not None else self.root)


class FilesystemSection(Section):
    """Named path rules. Empty: no file is reachable."""

    paths: dict[PathRuleName, PathRule] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_rule_per_visible_root(self) -> FilesystemSection:
        seen: dict[PurePosixPath, str] = {}
        for name, rule in self.paths.items():
            other = seen.setdefault(rule.visible_root, name)
            if other != name:
                raise ValueError(
                    f"paths {other!r} and {name!r} both appear at {rule.visible_root}; "
                    "give one of them a different root or mount"
                )
        return self


class Limits(Section):
    """Per-call and per-run limits; every one has a default."""

    call_timeout_s: Annotated[
        float, Field(strict=True, gt=0, le=MAX_CALL_TIMEOUT_S, allow_inf_nan=False)
    ] = DEFAULT_CALL_TIMEOUT_S
    max_output_bytes: Annotated[
        int, Field(strict=True, ge=MIN_MAX_OUTPUT_BYTES, le=MAX_MAX_OUTPUT_BYTES)
    ] = DEFAULT_MAX_OUTPUT_BYTES
    calls_per_second: Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)] = (
        DEFAULT_CALLS_PER_SECOND
    )
    burst: PositiveInt = default_burst(DEFAULT_CALLS_PER_SECOND)
    max_concurrent_calls: Annotated[int, Field(strict=True, ge=1, le=MAX_MAX_CONCURRENT_CALLS)] = (
        DEFAULT_MAX_CONCURRENT_CALLS
    )

    @model_validator(mode="before")
    @classmethod
    def _burst_follows_rate(cls, data: Any) -> Any:
        # The default burst depends on the rate the policy chose, not the default rate.
        if isinstance(data, dict) and data.get("burst") is None:
            rate = data.get("calls_per_second")
            if (
                isinstance(rate, int | float)
                and not isinstance(rate, bool)
                and math.isfinite(rate)
                and rate > 0
            ):
                data = {**data, "burst": default_burst(rate)}
        return data


# Names gatewayd sets itself in the sandbox; a policy cannot pass them through.
RESERVED_ENV_NAMES: Final = ("PATH", "HOME", "COGNI_GATEWAY_SOCK", "COGNI_RUN_ID")
_ENV_NAME_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


def _env_name(value: str) -> str:
    if not _ENV_NAME_RE.fullmatch(value):
        raise ValueError(f"{value!r} is not an environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
    if value in RESERVED_ENV_NAMES:
        raise ValueError(
            f"{value} is set by gatewayd in every sandbox and cannot be passed through; "
            f"reserved: {', '.join(RESERVED_ENV_NAMES)}"
        )
    return value


EnvName = Annotated[StrictStr, AfterValidator(_env_name)]


class EnvSection(Section):
    """Host environment variables a sandboxed command may see, by name (invariant
    SECRETS_HOST_ONLY: nothing else of gatewayd's environment enters)."""

    allow: tuple[EnvName, ...] = ()


# Sandboxed command limits: enough for a build or a test suite; the reason for each
# bound is the host's safety, not the command's comfort.
DEFAULT_SANDBOX_TIMEOUT_S: Final = 600.0
MAX_SANDBOX_TIMEOUT_S: Final = 24 * 3600.0
DEFAULT_SANDBOX_CPU_S: Final = 300
DEFAULT_SANDBOX_MAX_PROCESSES: Final = 256
DEFAULT_SANDBOX_MAX_FILE_MB: Final = 1024
DEFAULT_SANDBOX_MAX_OPEN_FILES: Final = 1024
DEFAULT_SANDBOX_MAX_OUTPUT_BYTES: Final = 1 << 20
# /tmp and /dev/shm are memory: without a cap each could take half the host's RAM, and
# RLIMIT_AS does not count it (a memory cgroup does).
DEFAULT_SANDBOX_TMP_MB: Final = 512
# A run's model budget: enough for an agent's working session, small enough that a loop
# calling the model cannot run up a provider bill unnoticed.
DEFAULT_MODEL_REQUESTS: Final = 200
DEFAULT_MODEL_TOKENS: Final = 1_000_000


class SandboxSection(Section):
    """Limits of each command run in the run's sandbox (``gatewayd run``/``exec``).
    Memory comes from the run request's ``limits.maxMemoryMb``."""

    timeout_s: Annotated[
        float, Field(strict=True, gt=0, le=MAX_SANDBOX_TIMEOUT_S, allow_inf_nan=False)
    ] = DEFAULT_SANDBOX_TIMEOUT_S
    cpu_s: Annotated[int, Field(strict=True, ge=1)] = DEFAULT_SANDBOX_CPU_S
    max_processes: Annotated[int, Field(strict=True, ge=4, le=65536)] = (
        DEFAULT_SANDBOX_MAX_PROCESSES
    )
    max_file_mb: Annotated[int, Field(strict=True, ge=1)] = DEFAULT_SANDBOX_MAX_FILE_MB
    max_open_files: Annotated[int, Field(strict=True, ge=16, le=1 << 20)] = (
        DEFAULT_SANDBOX_MAX_OPEN_FILES
    )
    max_output_bytes: Annotated[int, Field(strict=True, ge=0, le=64 << 20)] = (
        DEFAULT_SANDBOX_MAX_OUTPUT_BYTES
    )
    tmp_mb: Annotated[int, Field(strict=True, ge=1, le=1 << 20)] = DEFAULT_SANDBOX_TMP_MB


class ModelAccessSection(Section):
    """Which of gatewayd's model aliases the run's ``model.chat`` may use, and the run's
    budget for them. Empty: no model."""

    models: tuple[ModelAliasName, ...] = ()
    # Per run, over all its model.chat calls: spent means rate_limited.
    max_requests: Annotated[int, Field(strict=True, ge=1)] = DEFAULT_MODEL_REQUESTS
    max_tokens: Annotated[int, Field(strict=True, ge=1)] = DEFAULT_MODEL_TOKENS


# http.fetch: a page or an API answer, not a download; the result travels back in one
# frame (limits.max_output_bytes), so larger bodies would be refused there anyway.
DEFAULT_MAX_REQUEST_BYTES: Final = 1 << 20
DEFAULT_MAX_RESPONSE_BYTES: Final = 5 << 20
# Past 64 MiB one fetch makes the daemon hold too much memory for one run.
MAX_MAX_BODY_BYTES: Final = 64 << 20
# A slow site still answers within half a minute; a stuck one frees the slot.
DEFAULT_FETCH_TIMEOUT_S: Final = 30.0
# Enough for http->https and a login bounce; a longer chain is a loop or a maze.
DEFAULT_MAX_REDIRECTS: Final = 5
MAX_MAX_REDIRECTS: Final = 20
HttpMethod = Literal["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


def _check_private_entry(value: str) -> str:
    """A host name (exact or ``*.`` wildcard) or an IP network such as ``10.0.0.0/8``."""
    try:
        return str(ipaddress.ip_network(value, strict=False))
    except ValueError:
        pass
    if not re.fullmatch(r"(\*\.)?[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?", value):
        raise ValueError(
            f"allow_private entry {value!r} must be a lowercase host name ('localhost', "
            "'*.corp.internal') or an IP network ('10.0.0.0/8', '127.0.0.1')"
        )
    return value


PrivateEntry = Annotated[StrictStr, AfterValidator(_check_private_entry)]


def _check_package_manager(value: str) -> str:
    refusal = unknown_package_manager(value)
    if refusal is not None:
        raise ValueError(refusal)
    return value


PackageManagerName = Annotated[StrictStr, AfterValidator(_check_package_manager)]
Port = Annotated[int, Field(strict=True, ge=1, le=65535)]

# The standard web ports: what package indexes and APIs listen on. Anything else (a
# database, an SSH server, an internal admin port) must be named by the policy.
DEFAULT_PORTS: Final = (80, 443)
# Egress proxy (docs/egress.md). A package manager opens a handful of parallel
# downloads; 32 leaves room for that while one run cannot hold hundreds of sockets.
DEFAULT_PROXY_MAX_CONNECTIONS: Final = 32
DEFAULT_PROXY_CONNECTIONS_PER_SECOND: Final = 20.0
DEFAULT_PROXY_CONNECTION_BURST: Final = 64
MAX_PROXY_CONNECTIONS_PER_SECOND: Final = 10_000.0
# Past this one run could exhaust the daemon's descriptor limit (two per connection).
MAX_PROXY_MAX_CONNECTIONS: Final = 1024
# A client keeps an idle pooled connection for about a minute; a tunnel silent for
# longer is abandoned and gives its slot and sockets back.
DEFAULT_PROXY_IDLE_TIMEOUT_S: Final = 60.0
# Larger than any one package or model download a run needs (both directions summed);
# a connection moving more is a leak or a loop, and is cut.
DEFAULT_PROXY_MAX_CONNECTION_BYTES: Final = 1 << 30
# A terabyte on one connection is never a download; the cap must stay a cap.
MAX_PROXY_MAX_CONNECTION_BYTES: Final = 1 << 40


class ProxySection(Section):
    """The run's HTTP egress proxy (``HTTP_PROXY``/``HTTPS_PROXY`` in the sandbox): off
    unless ``enabled`` and ``network.allow_domains`` is non-empty. It reaches exactly what
    ``http.fetch`` may reach (domains, schemes, methods, ports, ``allow_private``), within
    these per-connection limits."""

    enabled: StrictBool = False
    max_connections: Annotated[int, Field(strict=True, ge=1, le=MAX_PROXY_MAX_CONNECTIONS)] = (
        DEFAULT_PROXY_MAX_CONNECTIONS
    )
    idle_timeout_s: Annotated[
        float, Field(strict=True, gt=0, le=MAX_CALL_TIMEOUT_S, allow_inf_nan=False)
    ] = DEFAULT_PROXY_IDLE_TIMEOUT_S
    max_connection_bytes: Annotated[
        int, Field(strict=True, ge=1, le=MAX_PROXY_MAX_CONNECTION_BYTES)
    ] = DEFAULT_PROXY_MAX_CONNECTION_BYTES
    # New connections a second (token bucket): every connection is an audit entry, so
    # this bounds how fast a run can grow the shared audit log through its proxy.
    connections_per_second: Annotated[
        float, Field(strict=True, gt=0, le=MAX_PROXY_CONNECTIONS_PER_SECOND, allow_inf_nan=False)
    ] = DEFAULT_PROXY_CONNECTIONS_PER_SECOND
    connection_burst: Annotated[int, Field(strict=True, ge=1, le=MAX_PROXY_MAX_CONNECTIONS)] = (
        DEFAULT_PROXY_CONNECTION_BURST
    )


class NetworkSection(Section):
    """What the run's ``http.fetch`` and egress proxy may reach. Empty ``allow_domains``:
    nothing (NETWORK_DEFAULT_DENY). ``ports``: the destination ports allowed (a URL without
    one means 80 or 443). ``allow_private`` names hosts or networks that may resolve to
    private, loopback or link-local addresses (the SSRF guard refuses them otherwise).
    ``package_managers`` names registry sets whose domains are reachable too."""

    allow_domains: tuple[Domain, ...] = ()
    schemes: tuple[Literal["http", "https"], ...] = ("https",)
    methods: tuple[HttpMethod, ...] = ("GET", "HEAD")
    max_request_bytes: Annotated[int, Field(strict=True, ge=0, le=MAX_MAX_BODY_BYTES)] = (
        DEFAULT_MAX_REQUEST_BYTES
    )
    max_response_bytes: Annotated[int, Field(strict=True, ge=1, le=MAX_MAX_BODY_BYTES)] = (
        DEFAULT_MAX_RESPONSE_BYTES
    )
    timeout_s: Annotated[
        float, Field(strict=True, gt=0, le=MAX_CALL_TIMEOUT_S, allow_inf_nan=False)
    ] = DEFAULT_FETCH_TIMEOUT_S
    max_redirects: Annotated[int, Field(strict=True, ge=0, le=MAX_MAX_REDIRECTS)] = (
        DEFAULT_MAX_REDIRECTS
    )
    allow_private: tuple[PrivateEntry, ...] = ()
    ports: tuple[Port, ...] = DEFAULT_PORTS
    proxy: ProxySection = Field(default_factory=ProxySection)
    # Named sets of registry domains (gatewayd.policy.package_managers): their domains
    # join allow_domains (reachable_domains), and an exec may narrow to them by name.
    package_managers: tuple[PackageManagerName, ...] = ()

    @property
    def reachable_domains(self) -> tuple[str, ...]:
        """``allow_domains`` and the domains of ``package_managers``, each once: every
        host http.fetch and the egress proxy may reach."""
        extra = package_manager_domains(self.package_managers)
        return (*self.allow_domains, *(d for d in extra if d not in self.allow_domains))

    @property
    def proxy_enabled(self) -> bool:
        """Does the run's sandbox get the egress proxy? Only when it could reach a host."""
        return self.proxy.enabled and bool(self.reachable_domains)


class Policy(Section):
    """A whole policy file. Only ``version`` and ``name`` are required."""

    version: Annotated[int, Field(strict=True)]
    name: PolicyName
    description: StrictStr = ""
    tools: ToolsSection = Field(default_factory=ToolsSection)
    filesystem: FilesystemSection = Field(default_factory=FilesystemSection)
    limits: Limits = Field(default_factory=Limits)
    # Without bubblewrap or namespaces the run is refused, unless the
    # policy accepts a degraded run (then every call is audited as degraded).
    require_os_sandbox: StrictBool = True
    env: EnvSection = Field(default_factory=EnvSection)
    sandbox: SandboxSection = Field(default_factory=SandboxSection)
    review: ReviewSection = Field(default_factory=ReviewSection)
    model_access: ModelAccessSection = Field(default_factory=ModelAccessSection)
    network: NetworkSection = Field(default_factory=NetworkSection)
    # Calls that wait for the operator's approval (gatewayd/policy/approvals_section.py).
    approvals: ApprovalsSection = Field(default_factory=ApprovalsSection)
    # The run's virtual workspace: its mode and what becomes of it at the run's end.
    workspace: WorkspaceSection = Field(default_factory=WorkspaceSection)
    # What an agent run's patch leaves out besides the repository's .gitignore.
    patches: PatchesSection = Field(default_factory=PatchesSection)

    @field_validator("version")
    @classmethod
    def _supported_version(cls, value: int) -> int:
        if value != POLICY_VERSION:
            raise ValueError(
                f"unsupported policy version {value}; this gateway reads version {POLICY_VERSION}"
            )
        return value


# --- parsing --------------------------------------------------------------------------


def load_policy_text(text: str, source: str) -> Policy:
    """Parse and validate policy YAML; ``source`` names it in errors (usually the path)."""
    return validate_policy(parse_policy_text(text, source), source)


def parse_policy_text(text: str, source: str) -> dict[str, Any]:
    """Policy YAML parsed strictly into its top-level mapping (not validated).

    A document that does not say it is a policy (no top-level ``version`` key) is
    refused with one message that quotes nothing of it: a name that leads to another
    file (``/etc/shadow``) must not answer with that file's lines as "unknown fields".
    """
    try:
        data = strictyaml.load(text)
    except strictyaml.YamlInputError as exc:
        raise PolicyError(source, [str(exc)]) from None
    if data is None:
        raise PolicyError(
            source, ["the file is empty; a policy needs at least 'version: 1' and 'name: ...'"]
        )
    if not isinstance(data, dict):
        raise PolicyError(
            source,
            [
                f"the top level must be a mapping of keys (version, name, tools, ...), "
                f"not a {_yaml_kind(data)}"
            ],
        )
    if "version" not in data:
        raise PolicyError(
            source,
            [
                "not a policy: it has no top-level 'version' key (a policy starts with "
                f"'version: {POLICY_VERSION}' and 'name: ...'); its content is not shown"
            ],
        )
    return data


def validate_policy(data: Mapping[str, Any], source: str) -> Policy:
    """A parsed policy mapping validated into a :class:`Policy`."""
    try:
        return Policy.model_validate(data)
    except ValidationError as exc:
        raise PolicyError(source, [_field_problem(e) for e in exc.errors()]) from None


def _yaml_kind(value: object) -> str:
    if isinstance(value, list):
        return "list"
    if isinstance(value, str):
        return "string"
    return type(value).__name__


# Repr of a bad value is shown, but a whole mapping pasted into an error helps nobody.
_MAX_SHOWN_INPUT_CHARS: Final = 80


def _field_problem(error: ErrorDetails) -> str:
    # A bad mapping key is reported at the key itself ('paths.Bad!', not 'paths.Bad!.[key]').
    loc = tuple(p for p in error["loc"] if p != "[key]")
    where = ".".join(str(p) for p in loc) or "(top level)"
    kind = error["type"]
    if kind == "missing":
        return f"{where}: required field is missing"
    if kind == "extra_forbidden":
        return f"{where}: unknown field{_allowed_fields_hint(loc)}"
    if kind == "value_error":  # our own checks: their messages already name the value
        return f"{where}: {error['msg'].removeprefix('Value error, ')}"
    shown = repr(error["input"])
    if len(shown) > _MAX_SHOWN_INPUT_CHARS:
        shown = shown[: _MAX_SHOWN_INPUT_CHARS - 3] + "..."
    return f"{where}: {error['msg']} (got {shown})"


def _allowed_fields_hint(loc: tuple[int | str, ...]) -> str:
    """'; allowed fields: ...' (and a close match) for an unknown key at ``loc``."""
    model = model_at(Policy, loc[:-1])
    if model is None:
        return ""
    names = list(model.model_fields)
    hint = "; allowed fields: " + ", ".join(names)
    close = difflib.get_close_matches(str(loc[-1]), names, n=1)
    return hint + (f" (did you mean {close[0]!r}?)" if close else "")
