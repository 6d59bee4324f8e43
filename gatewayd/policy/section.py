"""The base of every policy model and the field types several sections share.

Kept apart from :mod:`.model` so that sections living in their own modules (the review
section) use the same base without an import cycle.
"""

from __future__ import annotations

import re
import typing
from typing import Annotated, Any, Final

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from gatewayd.frame_limits import MAX_ID_CHARS

# A tool name: lowercase segments, dotted ("fs.read", "app_note_taker").
_TOOL_NAME: Final = r"[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)*"
# An exact tool name, a family wildcard ("fs.*") or a prefix wildcard ("app_*"); see
# tool_pattern_matches. Nothing broader: a bare "*" would allow every tool, including
# ones added to gatewayd later, in one character.
_TOOL_PATTERN_RE: Final = re.compile(_TOOL_NAME + r"(\.\*|_\*)?")
# The two wildcard endings: a family takes every name below a dot, a prefix wildcard
# every name that goes on after an underscore within the same dotted segment.
FAMILY_WILDCARD: Final = ".*"
PREFIX_WILDCARD: Final = "_*"
# The tools that manage a workspace's apps (gatewayd/apps/admintools.py): changing an
# app's rules, installing an app. They change what other tools do, so only an exact
# tools.allow entry grants them; no wildcard does ("app_*", meant for calling apps, would
# otherwise grant app_rules, and "install_*" install_app). No app may take one's name.
MANAGING_TOOLS: Final = frozenset({"app_rules", "install_app"})


def tool_pattern_matches(pattern: str, tool: str) -> bool:
    """Does the ``tools.allow`` entry ``pattern`` match the tool name ``tool``?

    ``fs.read`` matches itself only; ``fs.*`` every tool whose name starts ``fs.``;
    ``app_*`` every tool whose name starts ``app_`` and goes on without another dot
    (``app_note_taker``, not ``app_``, ``apps.x``, ``application`` nor ``app_x.y``):
    app tools are one segment, so the wildcard reaches no further than that segment.
    No wildcard matches a tool of :data:`MANAGING_TOOLS` (``app_rules``): only its name.
    """
    if pattern != tool and tool in MANAGING_TOOLS:
        return False
    if pattern.endswith(FAMILY_WILDCARD):
        return tool.startswith(pattern[:-1])
    if pattern.endswith(PREFIX_WILDCARD):
        prefix = pattern[:-1]
        rest = tool[len(prefix) :]
        return tool.startswith(prefix) and bool(rest) and "." not in rest
    return tool == pattern


def _tool_pattern_hint(value: str) -> str:
    """A did-you-mean for a tools.allow entry the grammar refuses ("" when none fits)."""
    if value.strip("*. _") == "":
        return (
            "; no pattern allows every tool (one that gatewayd adds later would be allowed "
            "too): list the tools or their families"
        )
    lowered = value.lower()
    if lowered != value and _TOOL_PATTERN_RE.fullmatch(lowered):
        return f"; did you mean {lowered!r}? (tool names are lowercase)"
    if value.endswith("*") and not value.endswith((FAMILY_WILDCARD, PREFIX_WILDCARD)):
        stem = value.rstrip("*").rstrip("._")
        if stem and _TOOL_PATTERN_RE.fullmatch(stem):
            return (
                f"; did you mean {stem + FAMILY_WILDCARD!r} (the {stem} family) or "
                f"{stem + PREFIX_WILDCARD!r} (names starting {stem + '_'!r})?"
            )
    return ""


def _check_tool_pattern(value: str) -> str:
    if len(value) > MAX_ID_CHARS or not _TOOL_PATTERN_RE.fullmatch(value):
        raise ValueError(
            f"{value!r} is neither an exact tool name such as 'fs.read' nor a family "
            "wildcard such as 'fs.*' nor a prefix wildcard such as 'app_*' (lowercase, "
            f"dotted; '*' only at the end, after '.' or '_'){_tool_pattern_hint(value)}"
        )
    return value


# A model's name under gatewayd's configuration ``models:``; a policy names one to use it.
MODEL_ALIAS_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _check_model_alias(value: str) -> str:
    if not MODEL_ALIAS_RE.fullmatch(value):
        raise ValueError(f"model alias {value!r} must be 1-64 letters, digits and ._-")
    return value


StrictStr = Annotated[str, Field(strict=True)]
StrictBool = Annotated[bool, Field(strict=True)]
ToolPattern = Annotated[StrictStr, AfterValidator(_check_tool_pattern)]
PositiveInt = Annotated[int, Field(strict=True, ge=1)]
ModelAliasName = Annotated[StrictStr, AfterValidator(_check_model_alias)]


class Section(BaseModel):
    """Base of every policy model: frozen, unknown keys refused, empty keys default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _empty_means_default(cls, value: Any, info: ValidationInfo) -> Any:
        # In YAML "allow:" with nothing after it is null; for an optional field that
        # reads as "not set", so it takes its default (never a looser one).
        if value is None and info.field_name is not None:
            field = cls.model_fields[info.field_name]
            if not field.is_required():
                return field.get_default(call_default_factory=True)
        return value


def model_at(root: type[BaseModel], loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The model class that validates the mapping found at ``loc`` inside ``root``'s data
    (for "unknown key" hints naming the keys that model allows); None past a leaf."""
    current: Any = root
    for part in loc:
        current = _unless_none(current)
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(str(part))
            if field is None:
                return None
            current = field.annotation
        elif typing.get_origin(current) is dict:
            current = typing.get_args(current)[1]
        else:
            return None
    current = _unless_none(current)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _unless_none(annotation: Any) -> Any:
    """``X`` for an optional ``X | None`` (a setting whose default is derived)."""
    args = typing.get_args(annotation)
    if type(None) in args and len(args) == 2:
        return next(arg for arg in args if arg is not type(None))
    return annotation
