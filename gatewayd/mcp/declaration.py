"""One MCP server as the operator declares it in gatewayd's configuration (``mcp_servers``).

A declaration is either a stdio program (``command``), which gatewayd runs in a sandbox
of its own (:mod:`gatewayd.mcp.servers`), or a remote streamable-HTTP server (``url``).
It is checked whole when the configuration is read: unknown keys, a relative program, a
shared server asking for a caller's workspace paths, a path that leaves the workspace,
an environment name gatewayd sets itself, are each refused with the field and the fix.
Paths that must stay out of every sandbox (gatewayd's own directories) are checked by
:class:`gatewayd.config.GatewaydConfig`, which knows them.

This module does no I/O: it is imported by the configuration.
"""

from __future__ import annotations

import enum
from pathlib import Path, PurePosixPath
from typing import Annotated, Final

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictStr, model_validator

from gatewayd.mcp.pinset import SERVER_NAME_RE
from gatewayd.policy.model import DEFAULT_PORTS, EnvName, Port, PrivateEntry
from gatewayd.policy.review_section import Domain
from gatewayd.secrets import NAME_RE as SECRET_NAME_RE

# An argv is a program and its options, not a script: past this it is a mistake.
MAX_COMMAND_ARGS: Final = 256
MAX_ARG_CHARS: Final = 4096
# A few host directories the program needs (its virtualenv, its data), not a filesystem.
MAX_READ_ONLY_PATHS: Final = 32
MAX_WORKSPACE_PATHS: Final = 32
MAX_EGRESS_DOMAINS: Final = 64
MAX_ENV: Final = 64
MAX_ENV_VALUE_CHARS: Final = 32 * 1024
MAX_SECRET_NAMES: Final = 16
# One tools/call: a server that needs longer is a batch job, not a tool.
DEFAULT_CALL_TIMEOUT_S: Final = 30.0
MAX_CALL_TIMEOUT_S: Final = 3600.0
# Process start (a cold interpreter, imports) and the initialize handshake.
DEFAULT_START_TIMEOUT_S: Final = 20.0
MAX_START_TIMEOUT_S: Final = 600.0
MAX_URL_CHARS: Final = 2048


class Share(enum.StrEnum):
    """Who an instance of the server serves."""

    SHARED = "shared"  # one instance for the whole daemon, with a private empty workspace
    PER_RUN = "per_run"  # one instance per calling run, a child run of it


class Mode(enum.StrEnum):
    RO = "ro"
    RW = "rw"


def _check_name(value: str) -> str:
    if not SERVER_NAME_RE.fullmatch(value):
        raise ValueError(
            f"MCP server name {value!r} is not allowed: it must match "
            f"{SERVER_NAME_RE.pattern} (it is part of the tools' names, mcp.<server>.<tool>)"
        )
    return value


def _check_relative(value: str) -> str:
    path = PurePosixPath(value)
    if not value or path.is_absolute() or ".." in path.parts or "\0" in value:
        raise ValueError(
            f"workspace path {value!r} must be relative to the calling run's workspace "
            "('repo', 'docs/api', or '.' for all of it), without '..'"
        )
    return str(path)


def _check_absolute(value: Path) -> Path:
    if not value.is_absolute() or ".." in value.parts:
        raise ValueError(f"{str(value)!r} must be an absolute host path without '..'")
    return value


def _check_url(value: str) -> str:
    if not value.startswith(("http://", "https://")):
        raise ValueError(f"url {value!r} must be an http:// or https:// URL")
    return value


def _check_secret_name(value: str) -> str:
    if not SECRET_NAME_RE.fullmatch(value):
        raise ValueError(f"secret_env name {value!r} is not allowed ({SECRET_NAME_RE.pattern})")
    return value


ServerName = Annotated[StrictStr, AfterValidator(_check_name)]
RelativePath = Annotated[StrictStr, AfterValidator(_check_relative)]
# Not strict: a file gives text, which strict mode would not take for a Path.
HostPath = Annotated[Path, Field(strict=False), AfterValidator(_check_absolute)]
SecretName = Annotated[StrictStr, AfterValidator(_check_secret_name)]
Arg = Annotated[StrictStr, Field(min_length=1, max_length=MAX_ARG_CHARS)]


class _Strict(BaseModel):
    # strict: "call_timeout_s: '30'" is an error, not 30; an unknown key is a typo.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class WorkspacePath(_Strict):
    """A path of the calling run's workspace the server sees, at the same place
    (``/workspace/<path>``), with at most this mode (and never more than the caller)."""

    path: RelativePath
    # Not strict: the file says 'rw', which strict mode would take for a str, not a Mode.
    mode: Annotated[Mode, Field(strict=False)] = Mode.RO


class McpServerDeclaration(_Strict):
    """One declared MCP server: a sandboxed stdio ``command`` or a remote ``url``."""

    command: Annotated[tuple[Arg, ...], Field(min_length=1, max_length=MAX_COMMAND_ARGS)] | None = (
        None
    )
    url: (
        Annotated[StrictStr, Field(max_length=MAX_URL_CHARS), AfterValidator(_check_url)] | None
    ) = None
    read_only_paths: Annotated[tuple[HostPath, ...], Field(max_length=MAX_READ_ONLY_PATHS)] = ()
    share: Annotated[Share, Field(strict=False)] = Share.PER_RUN
    workspace_paths: Annotated[
        tuple[WorkspacePath, ...], Field(max_length=MAX_WORKSPACE_PATHS)
    ] = ()
    egress_domains: Annotated[tuple[Domain, ...], Field(max_length=MAX_EGRESS_DOMAINS)] = ()
    # As a policy's network section says them: the ports the proxy connects to, and the
    # hosts or networks that may resolve to private addresses (an internal API).
    egress_ports: Annotated[
        tuple[Port, ...], Field(min_length=1, max_length=MAX_EGRESS_DOMAINS)
    ] = DEFAULT_PORTS
    egress_allow_private: Annotated[
        tuple[PrivateEntry, ...], Field(max_length=MAX_EGRESS_DOMAINS)
    ] = ()
    env: Annotated[
        dict[EnvName, Annotated[StrictStr, Field(max_length=MAX_ENV_VALUE_CHARS)]],
        Field(max_length=MAX_ENV),
    ] = Field(default_factory=dict)
    secret_env: Annotated[tuple[SecretName, ...], Field(max_length=MAX_SECRET_NAMES)] = ()
    call_timeout_s: Annotated[float, Field(gt=0, le=MAX_CALL_TIMEOUT_S, allow_inf_nan=False)] = (
        DEFAULT_CALL_TIMEOUT_S
    )
    start_timeout_s: Annotated[float, Field(gt=0, le=MAX_START_TIMEOUT_S, allow_inf_nan=False)] = (
        DEFAULT_START_TIMEOUT_S
    )

    @model_validator(mode="before")
    @classmethod
    def _yaml_lists(cls, data: object) -> object:
        # YAML gives lists where the model keeps tuples; strict mode would refuse them.
        if isinstance(data, dict):
            data = {
                key: tuple(value) if isinstance(value, list) else value
                for key, value in data.items()
            }
        return data

    @model_validator(mode="after")
    def _consistent(self) -> McpServerDeclaration:
        if (self.command is None) == (self.url is None):
            raise ValueError(
                "declare exactly one of command (a stdio program gatewayd runs in a sandbox "
                "of its own) and url (a remote streamable-HTTP server)"
            )
        if self.url is not None:
            local = [
                name
                for name in (
                    "read_only_paths",
                    "workspace_paths",
                    "egress_domains",
                    "egress_allow_private",
                    "env",
                    "secret_env",
                )
                if getattr(self, name)
            ]
            # Its default is not empty: only a value written in the file counts.
            if "egress_ports" in self.model_fields_set:
                local.append("egress_ports")
            if local:
                raise ValueError(
                    f"{', '.join(local)}: only a command server has these (they describe the "
                    "sandbox gatewayd runs it in); a url server runs elsewhere"
                )
        if self.command is not None and not self.command[0].startswith("/"):
            raise ValueError(
                f"command's program {self.command[0]!r} must be an absolute path: gatewayd "
                "never looks a program up in a PATH"
            )
        if self.share is Share.SHARED and self.workspace_paths:
            raise ValueError(
                "workspace_paths: a shared server serves every run at once, so it cannot "
                "take paths from one caller's workspace (it would show one run's files to "
                "the others); declare share: per_run to give it workspace paths"
            )
        if self.egress_allow_private and not self.egress_domains:
            raise ValueError(
                "egress_allow_private: the server reaches nothing without egress_domains; "
                "name the domains it may reach first"
            )
        clash = sorted(set(self.env) & set(self.secret_env))
        if clash:
            raise ValueError(
                f"{', '.join(clash)} is in both env and secret_env: a variable's value comes "
                "either from this file or from gatewayd's secrets, not both"
            )
        paths = [entry.path for entry in self.workspace_paths]
        repeated = sorted({p for p in paths if paths.count(p) > 1})
        if repeated:
            raise ValueError(f"workspace_paths names {', '.join(repeated)} more than once")
        return self

    @property
    def is_remote(self) -> bool:
        return self.url is not None


def declared_secret_names(servers: dict[str, McpServerDeclaration]) -> tuple[str, ...]:
    """Every secret some declared server is handed (to be scrubbed from all output)."""
    return tuple(dict.fromkeys(name for d in servers.values() for name in d.secret_env))
