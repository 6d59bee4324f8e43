"""gatewayd's own configuration: host-side settings no run can see or change.

:class:`GatewaydConfig` is the one configuration type: every setting, its default and
its checks, and the values derived from it (the audit log's path, the namespace prefix,
the sandbox uids, gatewayd's own directories). A configuration made in code is validated
as one read from a file. Where it is read from (the file, ``GATEWAYD_<NAME>`` variables,
command-line options) and how it is shown is :mod:`gatewayd.configsources`.
docs/configuration.md lists every setting; a test fails when one is missing there.

A model alias names a provider, model, endpoint, and the *name* of
the environment variable that holds the key; the key itself never enters a file gatewayd
writes, a run's sandbox, or the audit log:

```yaml
models:
  reviewer:
    provider: openai            # litellm's provider prefix: openai, anthropic, ollama, ...
    model: gpt-4o-mini
    api_base: http://127.0.0.1:11434/v1   # optional: a local or proxy endpoint
    api_key_env: OPENAI_API_KEY           # optional: where gatewayd finds the key
    timeout_s: 60
secret_env: [FORGE_TOKEN]               # optional: more secrets to scrub from all output
```

Every alias's ``api_key_env`` and every ``secret_env`` name is looked up in gatewayd's
environment, else as a systemd credential (gatewayd/secrets.py), and its value is
scrubbed from tool output, error messages, the audit log and gatewayd's own log.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from gatewayd.configdefaults import DEFAULT_STATE_DIR, agent_dir_for
from gatewayd.frame_limits import DEFAULT_MAX_FRAME_BYTES, MAX_FRAME_BYTES, MIN_FRAME_BYTES
from gatewayd.mcp.declaration import McpServerDeclaration, ServerName, declared_secret_names
from gatewayd.policy.section import MODEL_ALIAS_RE
from gatewayd.sandbox.daemons import DaemonShare, derived_netns_prefix, derived_uid_range
from gatewayd.sandbox.lendable import SETTING_HINT, OwnDirectory
from gatewayd.sandbox.lendroots import DEFAULT_LENDABLE_ROOTS, real_root_problem
from gatewayd.sandbox.netns import _check_prefix
from gatewayd.sandbox.plan import BWRAP
from gatewayd.sandbox.uids import DEFAULT_UID_COUNT, UidRange, check_derivable_count
from gatewayd.secrets import NAME_RE as SECRET_NAME_RE
from gatewayd.shipped import shipped_path
from gatewayd.tracing import MAX_ENDPOINT_CHARS, check_endpoint

# Shipped policies: package data (the checkout's policies/ in a checkout).
SHIPPED_POLICY_DIR: Final = shipped_path("policies")
SHIPPED_POLICY_DIRS: Final = (SHIPPED_POLICY_DIR, SHIPPED_POLICY_DIR / "examples")
# The audit log's active file rotates before it passes this: big enough that a busy
# daemon rotates a few times a day, not every minute; small enough that a segment is
# copied, verified or archived in seconds.
DEFAULT_AUDIT_MAX_BYTES: Final = 64 * 1024 * 1024
# One model call; the reviewer's own (shorter) timeout comes from the policy.
DEFAULT_MODEL_TIMEOUT_S: Final = 60.0
# The most of one model reply gatewayd reads (decoded bytes; past it the call fails).
# The longest answers models write (~128k tokens, ~0.5 MiB of text) fit many times over,
# even as tool call arguments JSON-escaped twice; a reply is held whole while it is
# parsed, by every call in flight at once, so the cap is what bounds that memory.
DEFAULT_MAX_REPLY_BYTES: Final = 8 << 20
# An alias may set its own cap within these: below 64 KiB ordinary answers fail; above
# 256 MiB one call could take a host's memory.
MIN_REPLY_BYTES: Final = 64 << 10
MAX_REPLY_BYTES: Final = 256 << 20
# More policy directories than this is a pasted list, not a search path.
MAX_POLICY_DIRS: Final = 32
# Likewise for lendable roots: a few places where workspaces live.
MAX_LENDABLE_ROOTS: Final = 32
# What a running daemon takes from a re-read configuration (SIGHUP) at once; it was built
# from every other setting, so a change to one of those waits for a restart.
RELOADABLE_SETTINGS: Final = frozenset({"models"})
_PROVIDER_RE: Final = re.compile(r"[a-z][a-z0-9_]{0,31}")
# Scale-out on Temporal (docs/scale-out.md): a frontend's "host:port" (a DNS name or an
# address, IPv6 in brackets); the namespace and task queue names as Temporal allows them.
_TEMPORAL_ADDRESS_RE: Final = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]{1,253}):[0-9]{1,5}")
_TEMPORAL_NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
DEFAULT_TEMPORAL_NAMESPACE: Final = "default"
# The queue gatewayd workers poll and clients submit to unless told otherwise.
DEFAULT_TEMPORAL_TASK_QUEUE: Final = "gatewayd-agent-runs"
_ENV_RE: Final = SECRET_NAME_RE  # a variable name, and so a safe credential file name


class ConfigError(Exception):
    """The configuration is missing, unreadable or invalid; the message names the file,
    variable or option, and every bad field."""


def _check(pattern: re.Pattern[str], what: str) -> Any:
    def check(value: str) -> str:
        if not pattern.fullmatch(value):
            raise ValueError(f"{what} {value!r} is not allowed ({pattern.pattern})")
        return value

    return AfterValidator(check)


def _check_api_base(value: str) -> str:
    if not value.startswith(("http://", "https://")):
        raise ValueError(f"api_base {value!r} must be an http:// or https:// URL")
    return value.rstrip("/")


def _check_absolute(value: Path) -> Path:
    if not value.is_absolute():
        raise ValueError(f"{str(value)!r} must be an absolute path")
    return value


def _check_netns_prefix(value: str) -> str:
    _check_prefix(value)
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelAlias(_Strict):
    """A model gatewayd may call, under a name policies use."""

    provider: Annotated[str, Field(strict=True), _check(_PROVIDER_RE, "provider")]
    model: Annotated[str, Field(strict=True, min_length=1, max_length=200)]
    api_base: Annotated[str, Field(strict=True), AfterValidator(_check_api_base)] | None = None
    api_key_env: Annotated[str, Field(strict=True), _check(_ENV_RE, "api_key_env")] | None = None
    timeout_s: Annotated[float, Field(strict=True, gt=0, le=3600, allow_inf_nan=False)] = (
        DEFAULT_MODEL_TIMEOUT_S
    )
    max_reply_bytes: Annotated[int, Field(strict=True, ge=MIN_REPLY_BYTES, le=MAX_REPLY_BYTES)] = (
        DEFAULT_MAX_REPLY_BYTES
    )

    @property
    def litellm_model(self) -> str:
        """The ``provider/model`` string litellm routes by."""
        return f"{self.provider}/{self.model}"


class SandboxUids(_Strict):
    """``count`` host uids from ``base``: one per live sandboxed run (gid = uid). No
    ``base``: one derived from the state directory, so two daemons get two ranges."""

    base: Annotated[int, Field(strict=True)] | None = None
    count: Annotated[int, Field(strict=True)] = DEFAULT_UID_COUNT

    @model_validator(mode="after")
    def _usable(self) -> SandboxUids:
        # UidRange's own checks, with their own messages
        if self.base is None:
            check_derivable_count(self.count)
        else:
            UidRange(self.base, self.count)
        return self

    def as_range(self, state_dir: Path) -> UidRange:
        """The :class:`UidRange` the daemon's uid pool takes (``state_dir`` places it
        when ``base`` is not given)."""
        if self.base is None:
            return derived_uid_range(state_dir, self.count)
        return UidRange(self.base, self.count)


Alias = Annotated[str, Field(strict=True), _check(MODEL_ALIAS_RE, "model alias")]
SecretName = Annotated[str, Field(strict=True), _check(_ENV_RE, "secret_env name")]
AbsolutePath = Annotated[Path, AfterValidator(_check_absolute)]
NetnsPrefix = Annotated[str, Field(strict=True), AfterValidator(_check_netns_prefix)]
# A few tokens, not a vault: a longer list is a mistake (or a pasted file).
MAX_SECRET_NAMES: Final = 64
# Declared MCP servers: each is a sandbox and a process; more is a pasted catalogue.
MAX_MCP_SERVERS: Final = 64
# Tool directories: a few places where operators keep tool folders.
MAX_TOOL_DIRS: Final = 32
DEFAULT_TOOL_TIMEOUT_S: Final = 30.0
DEFAULT_TOOL_MEMORY_MB: Final = 256
# The bounds a tool's manifest may set (gatewayd.runners.manifest, which this module,
# below it, cannot import; a test holds them equal): an hour per call, 16 GiB.
MAX_TOOL_TIMEOUT_S: Final = 3600
MAX_TOOL_MEMORY_MIB: Final = 16 * 1024


def _check_list(value: Any) -> Any:
    if not isinstance(value, list | tuple):
        raise ValueError(  # noqa: TRY004 - pydantic reports ValueError, not TypeError
            f"must be a list of environment variable names, e.g. [FORGE_TOKEN], "
            f"not {type(value).__name__}"
        )
    return value


def _check_unique(names: tuple[str, ...]) -> tuple[str, ...]:
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"names a secret more than once: {', '.join(repeated)}")
    return names


_LENDABLE_ROOTS_HINT: Final = (
    f"a lendable root is a directory that holds workspaces, e.g. /srv/workspaces; change "
    f"{SETTING_HINT}"
)


def _check_listen(text: str) -> str:
    # The metrics server (with its HTTP library) loads only where one is configured.
    from gatewayd.metrics_server import parse_listen_address

    parse_listen_address(text)  # MetricsListenError is a ValueError: pydantic reports it
    return text


def _check_otel_endpoint(url: str) -> str:
    return check_endpoint(url, "otel_endpoint")  # TracingError is a ValueError


# Witnesses of the audit log's checkpoints: each is one HTTP request per checkpoint (at
# most one a second); a quorum is a handful, more is a pasted list.
MAX_AUDIT_WITNESSES: Final = 16
_WITNESS_URL_RE: Final = re.compile(r"https?://[A-Za-z0-9.\-\[\]:]+(/[A-Za-z0-9._~/%-]*)?")


def _check_witness_url(url: str) -> str:
    if not _WITNESS_URL_RE.fullmatch(url):
        raise ValueError(
            f"{url[:80]!r} is not a witness URL: http:// or https://, a host (and port), an "
            "optional path; no user, query or fragment (e.g. https://witness.example.com/w1)"
        )
    return url


class AuditWitness(_Strict):
    """A witness that cosigns the audit log's checkpoints (C2SP tlog-witness)."""

    # The witness's key name, as its verifier key and its cosignatures carry it.
    name: Annotated[str, Field(strict=True, min_length=1, max_length=255)]
    # The submission prefix: checkpoints go to <url>/add-checkpoint.
    url: Annotated[str, Field(strict=True, max_length=2048), AfterValidator(_check_witness_url)]
    # NAME+KEYID+BASE64 (`gatewayd witness keygen` prints it).
    verifier_key: Annotated[str, Field(strict=True, min_length=1, max_length=512)]

    @model_validator(mode="after")
    def _key_is_the_witness(self) -> AuditWitness:
        # cryptography loads only where a witness is configured.
        from gatewayd.audit.cosignature import CosignatureVerifier

        key = CosignatureVerifier.from_string(self.verifier_key)  # CosignatureError: ValueError
        if key.name != self.name:
            raise ValueError(
                f"verifier_key is the key of {key.name!r}, not of {self.name!r}: name is the "
                "witness's key name"
            )
        return self


def _unique_witnesses(witnesses: tuple[AuditWitness, ...]) -> tuple[AuditWitness, ...]:
    names = [w.name for w in witnesses]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"names a witness more than once: {', '.join(repeated)}")
    return witnesses


class GatewaydConfig(_Strict):
    """The whole file; every setting has a default, so an empty file is valid.

    The field order is the order of docs/configuration.md and of ``gatewayd config show``.
    """

    # -- paths
    state_dir: AbsolutePath = Path(DEFAULT_STATE_DIR)
    # None: <state_dir>/audit/audit.jsonl
    audit_path: AbsolutePath | None = None
    # None: <state_dir>/control.sock
    control_socket: AbsolutePath | None = None
    # None: <state_dir>-agent, a sibling (a sandbox may never bind anything inside state_dir)
    agent_dir: AbsolutePath | None = None
    policy_dirs: Annotated[tuple[AbsolutePath, ...], Field(max_length=MAX_POLICY_DIRS)] = (
        SHIPPED_POLICY_DIRS
    )
    # -- the audit log and the wire
    # False only for tests and benchmarks: an entry is then not durable before the effect.
    audit_fsync: Annotated[bool, Field(strict=True)] = True
    # False trades invariant RESULT_BEFORE_REPLY for speed: an answer no longer waits for
    # its result entry, which a crash can then lose (docs/audit.md).
    audit_reply_after_result: Annotated[bool, Field(strict=True)] = True
    # 0: never rotate.
    audit_max_bytes: Annotated[int, Field(strict=True, ge=0)] = DEFAULT_AUDIT_MAX_BYTES
    # The signer key of the audit log's checkpoints (`gatewayd audit keygen`), outside
    # the audit directory; None: the systemd credential audit-checkpoint-key if there is
    # one, else no checkpoints (docs/audit.md).
    audit_checkpoint_key: AbsolutePath | None = None
    # The witnesses each checkpoint is sent to; their cosignatures are kept beside the log
    # (docs/audit.md, "Witnesses"). Empty: none.
    audit_witnesses: Annotated[
        tuple[AuditWitness, ...],
        Field(max_length=MAX_AUDIT_WITNESSES),
        AfterValidator(_unique_witnesses),
    ] = ()
    max_frame_bytes: Annotated[int, Field(strict=True, ge=MIN_FRAME_BYTES, le=MAX_FRAME_BYTES)] = (
        DEFAULT_MAX_FRAME_BYTES
    )
    # -- the OS sandbox
    # False: behave as on a host without bubblewrap (runs need require_os_sandbox: false).
    os_sandbox: Annotated[bool, Field(strict=True)] = True
    bwrap: Annotated[str, Field(strict=True, min_length=1)] = BWRAP
    # None (both): derived from state_dir, so two daemons on one host get two of each.
    netns_prefix: NetnsPrefix | None = None
    sandbox_uids: SandboxUids | None = None
    # Workspaces and rw policy paths are lent (chowned to the run's uid) only strictly
    # beneath one of these; no system tree may be one (gatewayd/sandbox/lendable.py).
    lendable_roots: Annotated[tuple[AbsolutePath, ...], Field(max_length=MAX_LENDABLE_ROOTS)] = (
        tuple(Path(root) for root in DEFAULT_LENDABLE_ROOTS)
    )
    # -- models and secrets
    models: dict[Alias, ModelAlias] = Field(default_factory=dict)
    # Names of further secrets (environment variables or systemd credentials) whose
    # values are scrubbed like the aliases' keys; the values are never in this file.
    secret_env: Annotated[
        tuple[SecretName, ...],
        BeforeValidator(_check_list),
        Field(max_length=MAX_SECRET_NAMES),
        AfterValidator(_check_unique),
    ] = ()
    # -- MCP servers behind the chokepoint (gatewayd/mcp/declaration.py, docs/mcp.md)
    mcp_servers: Annotated[
        dict[ServerName, McpServerDeclaration], Field(max_length=MAX_MCP_SERVERS)
    ] = Field(default_factory=dict)
    # -- tool folders: operators' own tools (gatewayd/runners/, docs/tool-runners.md)
    tool_dirs: Annotated[tuple[AbsolutePath, ...], Field(max_length=MAX_TOOL_DIRS)] = ()
    # What a tool whose manifest sets no limit gets (the run's call_timeout_s still bounds
    # each call).
    tool_timeout_s: Annotated[
        float, Field(strict=True, gt=0, le=MAX_TOOL_TIMEOUT_S, allow_inf_nan=False)
    ] = DEFAULT_TOOL_TIMEOUT_S
    tool_memory_mb: Annotated[int, Field(strict=True, ge=1, le=MAX_TOOL_MEMORY_MIB)] = (
        DEFAULT_TOOL_MEMORY_MB
    )
    # The runner of a manifest that names no runtime.
    tool_default_runner: Literal["wasm", "process"] = "wasm"
    # None: <state_dir>/wasm-cache (compiled wasm modules, by digest).
    tool_cache_dir: AbsolutePath | None = None
    # The workspace mode of a run whose request and policy name none (docs/workspaces.md);
    # `gatewayd tools run`: a tool works on an overlay of the workspace (its changes
    # shown, kept only on --commit), or on the workspace itself.
    workspace_mode: Literal["host", "overlay", "agentfs"] = "overlay"
    # -- observability (docs/metrics.md): the Prometheus listener, "IP:PORT" (None: none;
    # the control socket's /v1/metrics serves the same), and the OTLP/HTTP collector
    # traces go to (None: the standard OTEL_EXPORTER_OTLP_* variables, else no traces).
    metrics_listen: (
        Annotated[str, Field(strict=True, max_length=64), AfterValidator(_check_listen)] | None
    ) = None
    otel_endpoint: (
        Annotated[
            str,
            Field(strict=True, max_length=MAX_ENDPOINT_CHARS),
            AfterValidator(_check_otel_endpoint),
        ]
        | None
    ) = None
    # -- scale-out on Temporal (docs/scale-out.md): where the control socket's
    # /v1/agent-runs routes submit; None: those routes answer 404.
    temporal_address: (
        Annotated[str, Field(strict=True), _check(_TEMPORAL_ADDRESS_RE, "temporal_address")] | None
    ) = None
    temporal_namespace: Annotated[
        str, Field(strict=True), _check(_TEMPORAL_NAME_RE, "temporal_namespace")
    ] = DEFAULT_TEMPORAL_NAMESPACE
    temporal_task_queue: Annotated[
        str, Field(strict=True), _check(_TEMPORAL_NAME_RE, "temporal_task_queue")
    ] = DEFAULT_TEMPORAL_TASK_QUEUE

    @model_validator(mode="after")
    def _agent_dir_outside_state_dir(self) -> GatewaydConfig:
        agent = self.resolved_agent_dir
        if agent == self.state_dir or self.state_dir in agent.parents:
            raise ValueError(
                f"agent_dir {agent} lies in state_dir {self.state_dir}: a sandbox binds the "
                "agent's checkout, and nothing under the state directory may be bound; "
                "put agent_dir beside it (the default is STATE_DIR-agent)"
            )
        return self

    @field_validator("lendable_roots")
    @classmethod
    def _no_system_tree_lendable(cls, roots: tuple[Path, ...]) -> tuple[Path, ...]:
        # On the real path too: /var/run/x is /run/x, which the daemon would refuse.
        for root in roots:
            problem = real_root_problem(root)
            if problem is not None:
                raise ValueError(f"{problem}; {_LENDABLE_ROOTS_HINT}")
        return roots

    @model_validator(mode="after")
    def _lendable_roots_outside_gatewayds_dirs(self) -> GatewaydConfig:
        # As configured and as they really are: a symlink on either side hides nothing.
        reserved: list[tuple[str, Path]] = []
        own = (("state_dir", self.state_dir), ("agent_dir", self.resolved_agent_dir))
        for setting, path in own:
            reserved += [(setting, path), (setting, _real(path))]
        for root in self.lendable_roots:
            problem = real_root_problem(root, reserved)
            if problem is not None:
                raise ValueError(f"lendable_roots: {problem}; {_LENDABLE_ROOTS_HINT}")
        return self

    @model_validator(mode="after")
    def _mcp_paths_outside_gatewayds_dirs(self) -> GatewaydConfig:
        # A server's read_only_paths are bound into its sandbox: none may show gatewayd's
        # own files (the audit log, other runs' sockets, the control socket), nor hold them.
        own = self.own_directories(control_socket=self.control_socket)
        for name, server in self.mcp_servers.items():
            for path in server.read_only_paths:
                for directory in own:
                    for candidate in (path, _real(path)):
                        if (
                            candidate == directory.path
                            or candidate.is_relative_to(directory.path)
                            or directory.path.is_relative_to(candidate)
                        ):
                            raise ValueError(
                                f"mcp_servers.{name}.read_only_paths: {path} is or holds or "
                                f"lies in gatewayd's {directory.setting} ({directory.path}), "
                                "which no sandbox may see; name the directories the server's "
                                "program needs (its virtualenv, its data) instead"
                            )
        return self

    @field_validator("bwrap")
    @classmethod
    def _bwrap_absolute(cls, value: str) -> str:
        # The daemon runs it as root-ish: a PATH lookup would let PATH pick the binary.
        if not value.startswith("/"):
            raise ValueError(f"bwrap {value!r} must be an absolute path")
        return value

    @property
    def scrubbed_secret_env(self) -> tuple[str, ...]:
        """Every secret gatewayd holds besides the models' keys: ``secret_env`` and
        those it hands to MCP servers (each server's ``secret_env``); all are scrubbed."""
        return tuple(dict.fromkeys((*self.secret_env, *declared_secret_names(self.mcp_servers))))

    @property
    def resolved_audit_path(self) -> Path:
        return self.audit_path or self.state_dir / "audit" / "audit.jsonl"

    @property
    def resolved_control_socket(self) -> Path:
        return self.control_socket or self.state_dir / "control.sock"

    @property
    def resolved_agent_dir(self) -> Path:
        return self.agent_dir or Path(agent_dir_for(str(self.state_dir)))

    @property
    def resolved_tool_cache_dir(self) -> Path:
        return self.tool_cache_dir or self.state_dir / "wasm-cache"

    @property
    def resolved_netns_prefix(self) -> str:
        return self.netns_prefix or derived_netns_prefix(self.state_dir)

    @property
    def resolved_sandbox_uids(self) -> UidRange:
        return (self.sandbox_uids or SandboxUids()).as_range(self.state_dir)

    def changed(self, **settings: Any) -> GatewaydConfig:
        """This configuration with ``settings`` replaced, validated as a file would be.

        Error handling: pydantic.ValidationError naming each bad setting."""
        given = {name: getattr(self, name) for name in self.model_fields_set}
        return type(self).model_validate({**given, **settings})

    def with_real_dirs(self) -> GatewaydConfig:
        """This configuration with gatewayd's own paths (the state and agent directories,
        the audit log's and the control socket's directories) as real paths, resolved once
        when the daemon starts: every later comparison of a path with them (the sandbox
        plan's, the lease's) is then of real paths, whatever symlink or '..' a setting
        holds. The namespace prefix and uid range stay those derived from the state
        directory as configured."""
        uids = self.resolved_sandbox_uids
        socket = self.control_socket
        # Not validated again: every value is this validated one's, made real.
        return self.model_copy(
            update={
                "state_dir": _real(self.state_dir),
                "audit_path": _real_parent(self.resolved_audit_path),
                "agent_dir": _real(self.resolved_agent_dir),
                "control_socket": None if socket is None else _real_parent(socket),
                "netns_prefix": self.resolved_netns_prefix,
                "sandbox_uids": SandboxUids(base=uids.base, count=uids.count),
            }
        )

    def own_directories(self, *, control_socket: Path | None) -> tuple[OwnDirectory, ...]:
        """gatewayd's own directories, by their real paths, with those of the
        ``control_socket`` the daemon serves (None: it serves none): no tree lent to a
        sandbox may hold one (the sandbox would write the audit log, the cogni-tool copy or
        the control socket's directory), and none may lie in the state or agent directory
        (other runs' files) but an agent run's own work directory."""
        found = [
            OwnDirectory(setting="state_dir", path=_real(self.state_dir), private=True),
            OwnDirectory(setting="agent_dir", path=_real(self.resolved_agent_dir), private=True),
            OwnDirectory(
                setting="audit_path's directory",
                path=_real(self.resolved_audit_path.parent),
                private=False,
            ),
        ]
        if control_socket is not None:
            found.append(
                OwnDirectory(
                    setting="control_socket's directory",
                    path=_real(control_socket.parent),
                    private=False,
                )
            )
        return tuple(found)

    def host_share(self, *, control_socket: Path | None) -> DaemonShare:
        """What a daemon of this configuration takes of the host (the registry's view):
        its directories, audit log and the ``control_socket`` it serves (None: none) as
        they really are, and, with the OS sandbox, its prefix and uids."""
        return DaemonShare(
            state_dir=_real(self.state_dir),
            agent_dir=_real(self.resolved_agent_dir),
            netns_prefix=self.resolved_netns_prefix if self.os_sandbox else None,
            uids=self.resolved_sandbox_uids if self.os_sandbox else None,
            audit_path=_real(self.resolved_audit_path),
            control_socket=None if control_socket is None else _real(control_socket),
        )

    def needs_restart(self, reread: GatewaydConfig) -> list[str]:
        """The settings, in file order, that ``reread`` (this configuration read again
        while a daemon runs on it) changes and only a restart applies: all but
        :data:`RELOADABLE_SETTINGS`. Both as :meth:`with_real_dirs` makes them."""
        return [
            name
            for name in type(self).model_fields
            if name not in RELOADABLE_SETTINGS and getattr(self, name) != getattr(reread, name)
        ]


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _real_parent(path: Path) -> Path:
    """``path`` in its directory's real path (a symlink at its own name is left to the
    code that opens it, which refuses one)."""
    return _real(path.parent) / path.name
