"""The policy's ``review`` section: plain-language rules a separate model checks each call
against, and deterministic rules decided
before any model is asked.

```yaml
review:
  mode: llm                  # off (default) | llm
  model: reviewer            # a model alias in gatewayd's configuration (host side only)
  timeout_s: 15              # a review slower than this is a deny (fail closed)
  tools: ["fs.write", "fs.edit"]   # reviewed tools; default: every tool when mode is llm
  rules:
    allow:
      - Writing Markdown notes in the workspace
      - {text: Reading any file, addedBy: alice}
    deny:
      - Writing anything that looks like a credential or a private key
  structured:                # decided in order, before the model; first match wins
    - {effect: deny, tool: "fs.*", path: "/workspace/.git/**", reason: git internals}
    - {effect: allow, tool: time.now, skip_model: true}
  cache: {max_entries: 10000, ttl_s: 600}
```

Only the models live here; the decisions are in :mod:`gatewayd.review`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from gatewayd.policy.section import (
    ModelAliasName,
    PositiveInt,
    Section,
    StrictBool,
    StrictStr,
    ToolPattern,
    tool_pattern_matches,
)

# A rule is a sentence or a short paragraph; anything longer is a document pasted by
# mistake, and every rule is sent with every reviewed call.
MAX_RULE_CHARS: Final = 2000
MAX_RULES: Final = 200
# Long enough for a model on a busy provider; short enough that a stuck review frees the
# call's slot (the call's own timeout still applies on top).
DEFAULT_REVIEW_TIMEOUT_S: Final = 15.0
MAX_REVIEW_TIMEOUT_S: Final = 300.0
# Each argument value is cut to this many characters in the prompt (with a marker): the
# reviewer needs the gist, and a huge value is where a prompt injection hides.
DEFAULT_MAX_VALUE_CHARS: Final = 2000
DEFAULT_CACHE_ENTRIES: Final = 10_000
DEFAULT_CACHE_TTL_S: Final = 600.0
_FIELD_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_DOMAIN_RE: Final = re.compile(r"(\*\.)?([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9-]{1,63}")


def _check_rule_text(value: str) -> str:
    text = value.strip()
    if not text:
        raise ValueError("a rule must say something (it is empty)")
    if len(text) > MAX_RULE_CHARS:
        raise ValueError(
            f"a rule is at most {MAX_RULE_CHARS} characters (this one has {len(text)})"
        )
    if any(ord(c) < 32 and c not in "\n\t" for c in text):
        raise ValueError("a rule may not hold control characters other than newline and tab")
    return text


def _check_tool_glob(value: str) -> str:
    if value == "*" or value.endswith(".*"):
        return value  # every tool, or a family
    if not re.fullmatch(r"[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)*(_\*)?", value):
        raise ValueError(
            f"tool {value!r} must be an exact tool name ('fs.write'), a family ('fs.*'), "
            "a prefix wildcard ('app_*') or '*'"
        )
    return value


def _check_field(value: str) -> str:
    if not _FIELD_RE.fullmatch(value):
        raise ValueError(f"argument name {value!r} must be a plain identifier")
    return value


def _check_regex(value: str) -> str:
    try:
        re.compile(value)
    except re.error as exc:
        raise ValueError(f"pattern {value!r} is not a valid regular expression: {exc}") from None
    return value


def _check_domain(value: str) -> str:
    if not _DOMAIN_RE.fullmatch(value):
        raise ValueError(
            f"domain {value!r} must be a lowercase host name ('example.org') or a "
            "subdomain wildcard ('*.example.org')"
        )
    return value


def _check_path_glob(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError(
            f"path glob {value!r} must be absolute, as the sandbox sees paths "
            "('/workspace/**/*.md')"
        )
    return value


RuleText = Annotated[StrictStr, AfterValidator(_check_rule_text)]
ToolGlob = Annotated[StrictStr, AfterValidator(_check_tool_glob)]
ArgName = Annotated[StrictStr, AfterValidator(_check_field)]
Pattern = Annotated[StrictStr, AfterValidator(_check_regex)]
Domain = Annotated[StrictStr, AfterValidator(_check_domain)]
PathGlob = Annotated[StrictStr, AfterValidator(_check_path_glob)]


class PlainRule(Section):
    """A plain-language rule; a bare string in YAML is its ``text``."""

    text: RuleText
    addedBy: StrictStr | None = None

    @model_validator(mode="before")
    @classmethod
    def _bare_string(cls, data: Any) -> Any:
        return {"text": data} if isinstance(data, str) else data


class RegexMatch(Section):
    """The string argument ``field`` contains a match of ``pattern`` (re.search)."""

    field: ArgName
    pattern: Pattern


class NumericBound(Section):
    """The numeric argument ``field`` is at most ``value`` (a missing field: no match)."""

    field: ArgName
    value: Annotated[float, Field(strict=False, allow_inf_nan=False)]


class StructuredRule(Section):
    """A deterministic rule: the tool glob and every matcher given must match the call.

    ``path`` matches any path argument (``path``, ``paths``...) as the agent's visible
    path, normalized, with ``*`` (within a name) and ``**`` (any depth); ``domain`` the
    host of a ``url`` or ``host`` argument; ``regex`` and ``max`` one named argument.
    """

    effect: Literal["allow", "deny"]
    tool: ToolGlob = "*"
    path: PathGlob | None = None
    regex: RegexMatch | None = None
    domain: Domain | None = None
    max: NumericBound | None = None
    # An allow that decides without the model (otherwise the model still reviews).
    skip_model: StrictBool = False
    # Shown to the agent with a deny, and in the audit log.
    reason: StrictStr = ""

    @model_validator(mode="after")
    def _skip_only_for_allow(self) -> StructuredRule:
        if self.skip_model and self.effect != "allow":
            raise ValueError("skip_model is for allow rules (a deny never asks the model)")
        return self


class ReviewRules(Section):
    allow: tuple[PlainRule, ...] = Field(default=(), max_length=MAX_RULES)
    deny: tuple[PlainRule, ...] = Field(default=(), max_length=MAX_RULES)


class CacheSettings(Section):
    """Reviews remembered per rule set, tool and arguments; 0 entries turns it off."""

    max_entries: Annotated[int, Field(strict=True, ge=0, le=1_000_000)] = DEFAULT_CACHE_ENTRIES
    ttl_s: Annotated[float, Field(strict=True, gt=0, le=7 * 24 * 3600, allow_inf_nan=False)] = (
        DEFAULT_CACHE_TTL_S
    )


class ReviewSection(Section):
    """How a run's calls are reviewed. The default is no review at all."""

    mode: Literal["off", "llm"] = "off"
    model: ModelAliasName | None = None
    timeout_s: Annotated[
        float, Field(strict=True, gt=0, le=MAX_REVIEW_TIMEOUT_S, allow_inf_nan=False)
    ] = DEFAULT_REVIEW_TIMEOUT_S
    tools: tuple[ToolPattern, ...] | None = None
    rules: ReviewRules = Field(default_factory=ReviewRules)
    structured: tuple[StructuredRule, ...] = Field(default=(), max_length=MAX_RULES)
    cache: CacheSettings = Field(default_factory=CacheSettings)
    max_value_chars: PositiveInt = DEFAULT_MAX_VALUE_CHARS

    @model_validator(mode="after")
    def _model_for_llm(self) -> ReviewSection:
        if self.mode == "llm" and self.model is None:
            raise ValueError(
                "mode llm needs a model: the alias of a reviewer model in gatewayd's "
                "configuration (models: {ALIAS: {...}})"
            )
        return self

    @field_validator("tools")
    @classmethod
    def _some_tools(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is not None and not value:
            raise ValueError("tools: [] reviews nothing; leave it out to review every tool")
        return value

    def reviews(self, tool: str) -> bool:
        """Does the model review calls of ``tool`` (mode llm and ``tools`` matches)?"""
        if self.mode != "llm":
            return False
        if self.tools is None:
            return True
        return any(tool_glob_matches(pattern, tool) for pattern in self.tools)


def tool_glob_matches(pattern: str, tool: str) -> bool:
    """``*`` (every tool), or a tools.allow pattern: an exact name, a family (``fs.*``),
    a prefix wildcard (``app_*``), matched as tools.allow matches it."""
    if pattern == "*":
        return True
    return tool_pattern_matches(pattern, tool)
