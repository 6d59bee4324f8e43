"""gatewayd's own configuration file: host-side settings no run can see or change.

Today it holds the model aliases (reference note 001: provider, model, endpoint, and the
*name* of the environment variable that holds the key; the key itself never enters a
file gatewayd writes, a run's sandbox, or the audit log):

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

import re
from pathlib import Path
from typing import Annotated, Any, Final

import pydantic
import yaml
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from gatewayd.secrets import NAME_RE as SECRET_NAME_RE

DEFAULT_CONFIG_PATH: Final = Path("/etc/gatewayd/gatewayd.yaml")
# One model call; the reviewer's own (shorter) timeout comes from the policy.
DEFAULT_MODEL_TIMEOUT_S: Final = 60.0
MAX_CONFIG_BYTES: Final = 1 << 20
_ALIAS_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_PROVIDER_RE: Final = re.compile(r"[a-z][a-z0-9_]{0,31}")
_ENV_RE: Final = SECRET_NAME_RE  # a variable name, and so a safe credential file name


class ConfigError(Exception):
    """The configuration file is missing, unreadable or invalid; the message names the
    file and every bad field."""


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

    @property
    def litellm_model(self) -> str:
        """The ``provider/model`` string litellm routes by."""
        return f"{self.provider}/{self.model}"


Alias = Annotated[str, Field(strict=True), _check(_ALIAS_RE, "model alias")]
SecretName = Annotated[str, Field(strict=True), _check(_ENV_RE, "secret_env name")]
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


class GatewaydConfig(_Strict):
    """The whole file; every section has a default, so an empty file is valid."""

    models: dict[Alias, ModelAlias] = Field(default_factory=dict)
    # Names of further secrets (environment variables or systemd credentials) whose
    # values are scrubbed like the aliases' keys; the values are never in this file.
    secret_env: Annotated[
        tuple[SecretName, ...],
        BeforeValidator(_check_list),
        Field(max_length=MAX_SECRET_NAMES),
        AfterValidator(_check_unique),
    ] = ()


def load_config(path: Path) -> GatewaydConfig:
    """Read and validate ``path``.

    Error handling: :class:`ConfigError` naming the file and each bad field by its
    dotted path.
    """
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the configuration: {exc.strerror}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: over {MAX_CONFIG_BYTES} bytes; this is not a config file")
    try:
        data = yaml.safe_load(raw) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    try:
        return GatewaydConfig.model_validate(data)
    except pydantic.ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(file)'}: {err['msg']}"
            for err in exc.errors()
        )
        raise ConfigError(f"{path}: {problems}") from None
