"""gatewayd's own configuration: host-side settings no run can see or change.

One file, ``/etc/gatewayd/gatewayd.yaml`` (or ``--config`` / ``$GATEWAYD_CONFIG``), validated
strictly: unknown keys are errors with a "did you mean" hint, types are not coerced. Every
setting has a default, so an empty file (or none) is valid, and every setting can be
overridden by an environment variable ``GATEWAYD_<NAME>`` and, where ``gatewayd serve|run``
has one, by a command-line option. Precedence, highest first::

    command-line option  >  environment variable  >  file  >  default

docs/configuration.md lists every setting; a test fails when one is missing there.

The model aliases follow reference note 001 (provider, model, endpoint, and the *name* of
the environment variable that holds the key; the key itself never enters a file gatewayd
writes, a run's sandbox, or the audit log):

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

import difflib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Final
from urllib.parse import urlsplit, urlunsplit

import pydantic
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from gatewayd import strictyaml
from gatewayd.inputfile import InputFileError, read_input_file
from gatewayd.policy.section import MODEL_ALIAS_RE, model_at
from gatewayd.protocol import DEFAULT_MAX_FRAME_BYTES, MAX_FRAME_BYTES, MIN_FRAME_BYTES
from gatewayd.sandbox.daemons import DaemonShare, derived_netns_prefix, derived_uid_range
from gatewayd.sandbox.lendable import (
    DEFAULT_LENDABLE_ROOTS,
    SETTING_HINT,
    OwnDirectory,
    real_root_problem,
)
from gatewayd.sandbox.netns import _check_prefix
from gatewayd.sandbox.plan import BWRAP
from gatewayd.sandbox.uids import DEFAULT_UID_COUNT, UidRange, check_derivable_count
from gatewayd.secrets import NAME_RE as SECRET_NAME_RE

DEFAULT_CONFIG_PATH: Final = Path("/etc/gatewayd/gatewayd.yaml")
# The variable naming the file; it cannot be a setting in the file it names.
CONFIG_ENV: Final = "GATEWAYD_CONFIG"
ENV_PREFIX: Final = "GATEWAYD_"
DEFAULT_STATE_DIR: Final = Path("/var/lib/gatewayd")
# Shipped policies, next to the package in a source checkout.
SHIPPED_POLICY_DIR: Final = Path(__file__).resolve().parent.parent / "policies"
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
MAX_CONFIG_BYTES: Final = 1 << 20
# More policy directories than this is a pasted list, not a search path.
MAX_POLICY_DIRS: Final = 32
# Likewise for lendable roots: a few places where workspaces live.
MAX_LENDABLE_ROOTS: Final = 32
# What a running daemon takes from a re-read configuration (SIGHUP) at once; it was built
# from every other setting, so a change to one of those waits for a restart.
RELOADABLE_SETTINGS: Final = frozenset({"models"})
_PROVIDER_RE: Final = re.compile(r"[a-z][a-z0-9_]{0,31}")
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


class GatewaydConfig(_Strict):
    """The whole file; every setting has a default, so an empty file is valid.

    The field order is the order of docs/configuration.md and of ``gatewayd config show``.
    """

    # -- paths
    state_dir: AbsolutePath = DEFAULT_STATE_DIR
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
        DEFAULT_LENDABLE_ROOTS
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

    @field_validator("bwrap")
    @classmethod
    def _bwrap_absolute(cls, value: str) -> str:
        # The daemon runs it as root-ish: a PATH lookup would let PATH pick the binary.
        if not value.startswith("/"):
            raise ValueError(f"bwrap {value!r} must be an absolute path")
        return value

    @property
    def resolved_audit_path(self) -> Path:
        return self.audit_path or self.state_dir / "audit" / "audit.jsonl"

    @property
    def resolved_control_socket(self) -> Path:
        return self.control_socket or self.state_dir / "control.sock"

    @property
    def resolved_agent_dir(self) -> Path:
        return self.agent_dir or agent_dir_for(self.state_dir)

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


def agent_dir_for(state_dir: Path) -> Path:
    """Where agent runs keep their clones by default: beside the state directory."""
    if not state_dir.name:  # "/" has no name to put a sibling beside
        return state_dir / "gatewayd-agent"
    return state_dir.with_name(state_dir.name + "-agent")


def env_name(setting: str) -> str:
    """The environment variable that overrides ``setting``: ``GATEWAYD_<SETTING>``."""
    return ENV_PREFIX + setting.upper()


# --- the environment layer -------------------------------------------------------------
#
# One variable per setting, holding the whole value in a one-line syntax; a variable
# replaces the file's value, it never merges into it. An empty variable counts as unset
# (systemd's `Environment=NAME=` clears one that way).


def _env_text(text: str) -> Any:
    return text


def _env_bool(text: str) -> Any:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not a boolean; write true or false (1/0, yes/no, on/off)")


def _env_int(text: str) -> Any:
    try:
        return int(text.strip().replace("_", ""))
    except ValueError:
        raise ValueError(f"{text!r} is not a whole number") from None


def _env_path_list(text: str) -> Any:
    return [part for part in text.split(os.pathsep) if part]


def _env_name_list(text: str) -> Any:
    return [part.strip() for part in text.split(",") if part.strip()]


def _env_uid_range(text: str) -> Any:
    base, sep, count = text.strip().partition("+")
    if not sep:
        raise ValueError(f"{text!r} is not a uid range; write BASE+COUNT, e.g. 1800000000+1024")
    return {"base": _env_int(base), "count": _env_int(count)}


def _env_mapping(text: str) -> Any:
    # The value is never echoed: a pasted key would land in the error message.
    try:
        value = strictyaml.load(text)
    except strictyaml.YamlInputError as exc:
        raise ValueError(f"not a YAML or JSON mapping ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(  # noqa: TRY004 - pydantic reports ValueError
            "must be a YAML or JSON mapping, e.g. {reviewer: {provider: ...}}"
        )
    return value


@dataclass(frozen=True)
class EnvSyntax:
    """How one setting is written in its environment variable."""

    parse: Callable[[str], Any]
    example: str


ENV_SYNTAX: Final[Mapping[str, EnvSyntax]] = {
    "state_dir": EnvSyntax(_env_text, "/srv/gatewayd"),
    "audit_path": EnvSyntax(_env_text, "/var/log/gatewayd/audit.jsonl"),
    "control_socket": EnvSyntax(_env_text, "/run/gatewayd/control.sock"),
    "agent_dir": EnvSyntax(_env_text, "/srv/gatewayd-agent"),
    "policy_dirs": EnvSyntax(_env_path_list, "/etc/gatewayd/policies:/srv/policies"),
    "audit_fsync": EnvSyntax(_env_bool, "false"),
    "audit_reply_after_result": EnvSyntax(_env_bool, "false"),
    "audit_max_bytes": EnvSyntax(_env_int, "268435456"),
    "max_frame_bytes": EnvSyntax(_env_int, "4194304"),
    "os_sandbox": EnvSyntax(_env_bool, "false"),
    "bwrap": EnvSyntax(_env_text, "/usr/local/bin/bwrap"),
    "netns_prefix": EnvSyntax(_env_text, "gw2-"),
    "sandbox_uids": EnvSyntax(_env_uid_range, "1700000000+256"),
    "lendable_roots": EnvSyntax(_env_path_list, "/srv/workspaces:/home"),
    "models": EnvSyntax(
        _env_mapping, "{reviewer: {provider: openai, model: gpt-4o-mini, api_key_env: OPENAI_KEY}}"
    ),
    "secret_env": EnvSyntax(_env_name_list, "FORGE_TOKEN,PYPI_TOKEN"),
}


# --- reading and merging ---------------------------------------------------------------


# The source `gatewayd config show` names for a value derived from the state directory.
DERIVED_SOURCE: Final = "default (from state_dir)"


@dataclass(frozen=True)
class Settings:
    """The effective configuration and where each value came from.

    ``sources`` maps every setting to ``default``, ``file <path>``, ``env <NAME>`` or
    ``option <--flag>`` (:data:`DERIVED_SOURCE` for a default derived from the state
    directory); ``unknown_env`` lists ``GATEWAYD_`` variables that are no setting
    (most likely a typo), each with a hint.
    """

    config: GatewaydConfig
    sources: Mapping[str, str]
    file: Path | None
    unknown_env: tuple[str, ...] = ()


def config_file(option: Path | None, environ: Mapping[str, str]) -> Path | None:
    """The file to read: ``--config``, else ``$GATEWAYD_CONFIG``, else the default file
    when it exists, else none (every setting then comes from variables and defaults)."""
    if option is not None:
        return option
    if environ.get(CONFIG_ENV):
        return Path(environ[CONFIG_ENV])
    return DEFAULT_CONFIG_PATH if DEFAULT_CONFIG_PATH.exists() else None


def load_config(path: Path) -> GatewaydConfig:
    """Read and validate ``path``.

    Error handling: :class:`ConfigError` naming the file and each bad field by its
    dotted path (with the allowed fields and a close match for an unknown one).
    """
    try:
        raw = read_input_file(path, max_bytes=MAX_CONFIG_BYTES, what="the configuration")
    except InputFileError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    try:
        data = strictyaml.load(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (bad byte at offset {exc.start})") from None
    except strictyaml.YamlInputError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must be a mapping of settings, not {type(data).__name__}")
    try:
        return GatewaydConfig.model_validate(data)
    except pydantic.ValidationError as exc:
        raise ConfigError(f"{path}: {'; '.join(_problems(exc))}") from None


def resolve_settings(
    *,
    file: Path | None,
    environ: Mapping[str, str],
    options: Mapping[str, tuple[str, Any]] | None = None,
) -> Settings:
    """Merge the layers: ``options`` (setting -> (option, value), only those given) over
    the ``GATEWAYD_`` variables of ``environ`` over ``file`` over the defaults.

    Error handling: :class:`ConfigError` listing every bad value, each under the file,
    variable or option it came from; nothing is half-applied.
    """
    fields = GatewaydConfig.model_fields
    values: dict[str, Any] = {}
    sources = dict.fromkeys(fields, "default")
    problems: list[str] = []
    if file is not None:
        from_file = load_config(file)
        for name in from_file.model_fields_set:
            values[name] = getattr(from_file, name)
            sources[name] = f"file {file}"
    for name, syntax in ENV_SYNTAX.items():
        variable = env_name(name)
        text = environ.get(variable, "")
        if not text:
            continue
        try:
            values[name] = _validate_setting(name, syntax.parse(text))
            sources[name] = f"env {variable}"
        except ValueError as exc:
            problems.append(f"{variable}: {exc}")
    for name, (option, value) in (options or {}).items():
        try:
            values[name] = _validate_setting(name, value)
            sources[name] = f"option {option}"
        except ValueError as exc:
            problems.append(f"{option}: {exc}")
    if problems:
        raise ConfigError("; ".join(problems))
    try:
        config = GatewaydConfig.model_validate(values)
    except pydantic.ValidationError as exc:  # a combination no single layer shows
        raise ConfigError(f"the combined settings: {'; '.join(_problems(exc))}") from None
    if config.netns_prefix is None:
        sources["netns_prefix"] = DERIVED_SOURCE
    if config.sandbox_uids is None:
        sources["sandbox_uids"] = DERIVED_SOURCE
    elif config.sandbox_uids.base is None:
        sources["sandbox_uids"] += ", base from state_dir"
    return Settings(config, sources, file, _unknown_env(environ))


def _validate_setting(name: str, value: Any) -> Any:
    """``value`` checked as setting ``name``; ValueError with the problems otherwise."""
    try:
        return getattr(GatewaydConfig.model_validate({name: value}), name)
    except pydantic.ValidationError as exc:
        raise ValueError("; ".join(_problems(exc, drop=1))) from None


def _unknown_env(environ: Mapping[str, str]) -> tuple[str, ...]:
    known = [env_name(name) for name in ENV_SYNTAX] + [CONFIG_ENV]
    notes = []
    for variable in sorted(environ):
        if variable.startswith(ENV_PREFIX) and variable not in known:
            close = difflib.get_close_matches(variable, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            notes.append(f"{variable} is not a gatewayd setting and is ignored{hint}")
    return tuple(notes)


# --- error messages --------------------------------------------------------------------


def _problems(exc: pydantic.ValidationError, *, drop: int = 0) -> list[str]:
    """One line per error: the dotted field path and what is wrong (the bad value is
    shown only by our own checks, which choose what to show)."""
    lines = []
    for error in exc.errors():
        loc = error["loc"]
        where = ".".join(str(p) for p in loc[drop:] if p != "[key]")
        message = _message(error, loc)
        if drop:  # under a variable or option: its own wording, no pydantic prefix
            message = message.removeprefix("Value error, ")
        lines.append(f"{where}: {message}" if where else message)
    return lines


def _message(error: ErrorDetails, loc: tuple[int | str, ...]) -> str:
    if error["type"] == "extra_forbidden":
        return error["msg"] + _allowed_hint(loc)
    return error["msg"]


def _allowed_hint(loc: tuple[int | str, ...]) -> str:
    model = model_at(GatewaydConfig, loc[:-1])
    if model is None:
        return ""
    names = list(model.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"{hint}; allowed: {', '.join(names)}"


# --- showing ---------------------------------------------------------------------------


def redact_url(url: str) -> str:
    """``url`` without a password (an endpoint may carry ``user:pass@``)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def shown_values(config: GatewaydConfig) -> dict[str, Any]:
    """Every setting as plain data for ``gatewayd config show``: paths resolved against
    the state directory, no secret (an alias names its key's variable, never the key,
    and an endpoint's password is masked)."""
    shown: dict[str, Any] = {}
    for name in GatewaydConfig.model_fields:
        value = getattr(config, name)
        if name == "audit_path":
            value = config.resolved_audit_path
        elif name == "control_socket":
            value = config.resolved_control_socket
        elif name == "agent_dir":
            value = config.resolved_agent_dir
        elif name == "netns_prefix":
            value = config.resolved_netns_prefix
        elif name == "sandbox_uids":
            uids = config.resolved_sandbox_uids
            value = {"base": uids.base, "count": uids.count}
        if name == "models":
            value = {
                alias: {
                    **entry.model_dump(),
                    "api_base": redact_url(entry.api_base) if entry.api_base else None,
                }
                for alias, entry in config.models.items()
            }
        elif isinstance(value, BaseModel):
            value = value.model_dump()
        elif isinstance(value, tuple):
            value = [str(v) if isinstance(v, Path) else v for v in value]
        elif isinstance(value, Path):
            value = str(value)
        shown[name] = value
    return shown
