"""Where gatewayd's configuration comes from, and how it is shown.

One file, ``/etc/gatewayd/gatewayd.yaml`` (or ``--config`` / ``$GATEWAYD_CONFIG``), validated
strictly: unknown keys are errors with a "did you mean" hint, types are not coerced. Every
setting has a default, so an empty file (or none) is valid, and every setting can be
overridden by an environment variable ``GATEWAYD_<NAME>`` and, where ``gatewayd serve|run``
has one, by a command-line option. Precedence, highest first::

    command-line option  >  environment variable  >  file  >  default

:func:`resolve_settings` merges the layers into one :class:`~gatewayd.config.GatewaydConfig`
and says where each value came from (`gatewayd config show`, :func:`shown_values`).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit, urlunsplit

import pydantic
from pydantic import BaseModel
from pydantic_core import ErrorDetails

from gatewayd import strictyaml
from gatewayd.config import ConfigError, GatewaydConfig
from gatewayd.configdefaults import CONFIG_ENV, DEFAULT_CONFIG_PATH, ENV_PREFIX
from gatewayd.inputfile import InputFileError, read_input_file
from gatewayd.policy.section import model_at

# A configuration is a page of YAML; a bigger file is a wrong path, not a configuration.
MAX_CONFIG_BYTES: Final = 1 << 20


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


def _env_number(text: str) -> Any:
    try:
        return float(text.strip().replace("_", ""))
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None


def _env_yaml(text: str, kind: type[list[Any]] | type[dict[str, Any]], example: str) -> Any:
    """A variable holding YAML or JSON of one ``kind``. The value is never echoed: a
    pasted key would land in the error message."""
    what = "list" if kind is list else "mapping"
    try:
        value = strictyaml.load(text)
    except strictyaml.YamlInputError as exc:
        raise ValueError(f"not a YAML or JSON {what} ({exc})") from None
    if not isinstance(value, kind):
        raise ValueError(  # noqa: TRY004 - pydantic reports ValueError
            f"must be a YAML or JSON {what}, e.g. {example}"
        )
    return value


def _env_mapping_list(text: str) -> Any:
    return _env_yaml(text, list, "[{name: ..., url: ..., verifier_key: ...}]")


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
    return _env_yaml(text, dict, "{reviewer: {provider: ...}}")


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
    "audit_checkpoint_key": EnvSyntax(_env_text, "/etc/gatewayd/audit-checkpoint.key"),
    "audit_witnesses": EnvSyntax(
        _env_mapping_list,
        "[{name: w.example/1, url: 'https://w.example/1', verifier_key: "
        "'w.example/1+865d03be+BDdfF6OR1N7dL+XjaTG4/2rPUAHXKJ74KcweZD4m078L'}]",
    ),
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
    "mcp_servers": EnvSyntax(
        _env_mapping, "{time: {command: [/opt/mcp/bin/mcp-server-time], share: shared}}"
    ),
    "tool_dirs": EnvSyntax(_env_path_list, "/etc/gatewayd/tools:/srv/tools"),
    "tool_timeout_s": EnvSyntax(_env_number, "10"),
    "tool_memory_mb": EnvSyntax(_env_int, "128"),
    "tool_default_runner": EnvSyntax(_env_text, "process"),
    "tool_cache_dir": EnvSyntax(_env_text, "/var/cache/gatewayd/wasm"),
    "workspace_mode": EnvSyntax(_env_text, "host"),
    "metrics_listen": EnvSyntax(_env_text, "127.0.0.1:9464"),
    "otel_endpoint": EnvSyntax(_env_text, "http://127.0.0.1:4318"),
    "temporal_address": EnvSyntax(_env_text, "temporal.internal:7233"),
    "temporal_namespace": EnvSyntax(_env_text, "agents"),
    "temporal_task_queue": EnvSyntax(_env_text, "gatewayd-agent-runs-gpu"),
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


def config_file(option: str | os.PathLike[str] | None, environ: Mapping[str, str]) -> Path | None:
    """The file to read: ``--config``, else ``$GATEWAYD_CONFIG``, else the default file
    when it exists, else none (every setting then comes from variables and defaults)."""
    if option is not None:
        return Path(option)
    if environ.get(CONFIG_ENV):
        return Path(environ[CONFIG_ENV])
    return Path(DEFAULT_CONFIG_PATH) if os.path.exists(DEFAULT_CONFIG_PATH) else None


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
        elif name == "tool_cache_dir":
            value = config.resolved_tool_cache_dir
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
        elif name == "mcp_servers":
            value = {
                server: {
                    **entry.model_dump(mode="json"),
                    "url": redact_url(entry.url) if entry.url else None,
                }
                for server, entry in config.mcp_servers.items()
            }
        elif isinstance(value, BaseModel):
            value = value.model_dump()
        elif isinstance(value, tuple):
            value = [
                str(v)
                if isinstance(v, Path)
                else v.model_dump(mode="json")
                if isinstance(v, BaseModel)
                else v
                for v in value
            ]
        elif isinstance(value, Path):
            value = str(value)
        shown[name] = value
    return shown
