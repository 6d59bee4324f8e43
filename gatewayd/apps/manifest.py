"""An app's manifest, ``APP.md``: text in, a validated :class:`AppManifest` out, and back.

```
---
name: note-taker                 # the app's id: its folder's name, its tool app_note_taker
title: Note Taker
description: Keeps notes for its caller in its data folder.
model: default                   # optional: the app's own model alias
review_model: reviewer           # optional: the alias of the model reviewing its calls
limits: {turns: 12, tool_calls: 24, tokens: 100000, wall_time_s: 300}   # optional
---

## System Prompt

You keep notes ...

## Rules

### Allow
- Reading and writing files in data/
- Listing the workspace <!-- addedBy: alice -->

### Deny
- Writing anything outside data/
```

The front matter is read with the project's YAML discipline (:mod:`gatewayd.strictyaml`)
and validated with pydantic; the body is read by a CommonMark parser
(:mod:`gatewayd.apps.sections`). CommonMark has no front matter: it is the text between
a first line ``---`` and the next line ``---``, as in static site generators.

Two rules keep what a person reads equal to what a model reads, which is what the
review of an app's calls rests on: invisible characters (zero-width, bidirectional
overrides, Unicode tag characters, control characters, variation selectors and other
default-ignorable code points) are refused anywhere in the file
(:mod:`gatewayd.apps.problems`), and neither a rule nor the system prompt may hold
what a Markdown viewer hides (HTML, link reference definitions, images, links; a rule
may end in its ``<!-- addedBy: NAME -->`` marker, who added it, never shown to the
reviewer; the prompt may hold autolinks, :mod:`gatewayd.apps.sections`).

:func:`render_manifest` writes a manifest back (rule changes are written back to
APP.md): ``parse_manifest(render_manifest(m)) == m`` for every valid manifest, because
each rule and the system prompt is checked, when a model is built, to read back the
same from the text it renders to. Pure: no I/O.
"""

from __future__ import annotations

import difflib
import re
from typing import Annotated, Any, Final

import yaml
from pydantic import AfterValidator, Field, ValidationError, model_validator
from pydantic_core import ErrorDetails

from gatewayd import strictyaml
from gatewayd.apps.problems import (
    ManifestError,
    ManifestProblem,
    check_visible,
    invisible_character,
    invisible_reason,
)
from gatewayd.apps.sections import (
    ALLOW_HEADING,
    DENY_HEADING,
    RULES_HEADING,
    SYSTEM_PROMPT_HEADING,
    RawRule,
    bullet_lines,
    normalize_rule_text,
    read_body,
    rule_item,
    strip_blank_lines,
)
from gatewayd.policy.review_section import MAX_RULES, RuleText
from gatewayd.policy.section import (
    MANAGING_TOOLS,
    ModelAliasName,
    Section,
    StrictStr,
    model_at,
)
from gatewayd.protocol import MAX_ID_CHARS, TOOL_NAME_RE

MANIFEST_FILE: Final = "APP.md"

# An app's manifest is a system prompt and a few dozen rules; every rule goes with every
# reviewed call and the prompt with every model turn, so a larger file is a mistake or
# an attack on the reviewer's context, and the cap bounds the parser's work.
MAX_MANIFEST_BYTES: Final = 256 * 1024

# The id is a folder name and, as app_<id>, a tool name; 63 is a DNS label's and a
# host name's length, so it can also name the app's sandbox. Lowercase letters, digits
# and single hyphens, starting with a letter: never a path ('..', 'a/b'), never two ids
# for one tool name (ids hold no '_', so 'a-b' -> app_a_b is one-to-one).
MAX_APP_ID_CHARS: Final = 63
APP_ID_RE: Final = re.compile(r"[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
TOOL_NAME_PREFIX: Final = "app_"

# One line in `gatewayd apps list`.
MAX_TITLE_CHARS: Final = 80
# It becomes the summary of the app's tool in tools.list (tools.manifest.MAX_SUMMARY_CHARS).
MAX_DESCRIPTION_CHARS: Final = 1000
# Sent with every model turn of the app: a long prompt is paid for on each.
MAX_SYSTEM_PROMPT_CHARS: Final = 32_000
# Lines of the body that may open a bullet list item, most any valid APP.md has: its
# rules (one line each at least) and a system prompt of nothing else ("-" and a newline
# per line). More is refused before the Markdown parser makes its tokens: 65,000
# one-character rules fit in MAX_MANIFEST_BYTES, and parsing them alone takes seconds.
MAX_BULLET_LINES: Final = 2 * MAX_RULES + MAX_SYSTEM_PROMPT_CHARS // 2
# A user or operator name inside an HTML comment: no '--' (it would end the comment).
MAX_ADDED_BY_CHARS: Final = 64
ADDED_BY_RE: Final = re.compile(r"[A-Za-z0-9_.@+]+(?:[ -][A-Za-z0-9_.@+]+)*")

# Per-invocation limits: (default, ceiling). An invocation is one task a caller asks
# for, smaller than an agent run, whose own defaults (40 turns, 400,000 tokens, 1800 s)
# are the ceilings here; every tool call is also a model review, hence its own cap.
DEFAULT_TURNS: Final = 12
MAX_TURNS: Final = 40
DEFAULT_TOOL_CALLS: Final = 24
MAX_TOOL_CALLS: Final = 100
DEFAULT_TOKENS: Final = 100_000
MAX_TOKENS: Final = 400_000
DEFAULT_WALL_TIME_S: Final = 300.0
MAX_WALL_TIME_S: Final = 1800.0

_FRONT_MATTER_FENCE: Final = "---"
# A bad value is quoted in a message; a pasted document helps nobody.
_MAX_SHOWN_VALUE_CHARS: Final = 80


# --- field types ----------------------------------------------------------------------


def _shown(value: str) -> str:
    text = (
        value
        if len(value) <= _MAX_SHOWN_VALUE_CHARS
        else value[: _MAX_SHOWN_VALUE_CHARS - 3] + "..."
    )
    return repr(text)


def app_id_problem(value: str) -> str | None:
    """Why ``value`` is not an app id, or None when it is one."""
    if APP_ID_RE.fullmatch(value) and len(value) <= MAX_APP_ID_CHARS:
        if tool_name_of(value) in MANAGING_TOOLS:
            return (
                f"{_shown(value)} is reserved: its tool would be "
                f"{tool_name_of(value)}, the name of gatewayd's own tool that manages "
                "apps; choose another id"
            )
        return None
    rule = (
        f"an app id is 1-{MAX_APP_ID_CHARS} lowercase letters, digits and single hyphens, "
        "starting with a letter and not ending with a hyphen (it names the app's folder and "
        "its tool app_<id>; never a path)"
    )
    if len(value) > MAX_APP_ID_CHARS:
        return f"{_shown(value)} has {len(value)} characters; {rule}"
    hint = ""
    suggestion = re.sub(r"[^a-z0-9]+", "-", value.lower()).strip("-")
    looks_like_a_path = "/" in value or value.startswith(".")  # no id to guess there
    if not looks_like_a_path and suggestion != value and app_id_problem(suggestion) is None:
        hint = f" (did you mean {suggestion!r}?)"
    return f"{_shown(value)} is not an app id{hint}: {rule}"


def _check_app_id(value: str) -> str:
    problem = app_id_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


def _check_title(value: str) -> str:
    title = check_visible(value).strip()
    if not title or "\n" in title or len(title) > MAX_TITLE_CHARS:
        raise ValueError(f"a title is one line of 1-{MAX_TITLE_CHARS} characters")
    return title


def _check_description(value: str) -> str:
    text = check_visible(value).strip()
    if not text or len(text) > MAX_DESCRIPTION_CHARS:
        raise ValueError(
            f"a description is 1-{MAX_DESCRIPTION_CHARS} characters (it is the summary of "
            "the app's tool that callers read in tools.list)"
        )
    return text


def _check_added_by(value: str) -> str:
    if len(value) > MAX_ADDED_BY_CHARS or not ADDED_BY_RE.fullmatch(value):
        raise ValueError(
            f"addedBy {_shown(value)} must be 1-{MAX_ADDED_BY_CHARS} letters, digits and "
            "_.@+, with single spaces or hyphens between them"
        )
    return value


def _check_rule_text(value: str) -> str:
    return normalize_rule_text(check_visible(value))


def _check_system_prompt(value: str) -> str:
    prompt = strip_blank_lines(check_visible(value))
    if not prompt:
        raise ValueError("the system prompt is empty; say what the app does and how")
    if len(prompt) > MAX_SYSTEM_PROMPT_CHARS:
        raise ValueError(
            f"the system prompt is at most {MAX_SYSTEM_PROMPT_CHARS} characters "
            f"(this one has {len(prompt)})"
        )
    document = (
        f"## {SYSTEM_PROMPT_HEADING}\n\n{prompt}\n\n## {RULES_HEADING}\n\n"
        f"### {ALLOW_HEADING}\n\n### {DENY_HEADING}\n"
    )
    body = read_body(document, 0)
    if body.problems and body.problems[0].field is None:  # a heading that opens a section
        raise ValueError(f"the system prompt holds {body.problems[0].reason}")
    hidden = [p for p in body.problems if p.field == "system_prompt"]
    if len(hidden) < len(body.problems) or body.system_prompt != prompt:
        raise ValueError(
            "the system prompt would not read back the same from APP.md: it holds a "
            "'#' or '##' heading, or a code fence or HTML block that runs past its end"
        )
    if hidden:  # something a Markdown viewer hides (sections._check_prompt_hides_nothing)
        raise ValueError(hidden[0].reason)
    return prompt


AppId = Annotated[StrictStr, AfterValidator(_check_app_id)]
Title = Annotated[StrictStr, AfterValidator(_check_title)]
Description = Annotated[StrictStr, AfterValidator(_check_description)]
AddedBy = Annotated[StrictStr, AfterValidator(_check_added_by)]
AppRuleText = Annotated[RuleText, AfterValidator(_check_rule_text)]
SystemPrompt = Annotated[StrictStr, AfterValidator(_check_system_prompt)]


# --- models ---------------------------------------------------------------------------


class AppLimits(Section):
    """What one invocation of the app may use; the first limit reached ends it."""

    turns: Annotated[int, Field(strict=True, ge=1, le=MAX_TURNS)] = DEFAULT_TURNS
    tool_calls: Annotated[int, Field(strict=True, ge=1, le=MAX_TOOL_CALLS)] = DEFAULT_TOOL_CALLS
    tokens: Annotated[int, Field(strict=True, ge=1, le=MAX_TOKENS)] = DEFAULT_TOKENS
    wall_time_s: Annotated[
        float, Field(strict=True, gt=0, le=MAX_WALL_TIME_S, allow_inf_nan=False)
    ] = DEFAULT_WALL_TIME_S


class AppFrontMatter(Section):
    """The YAML between the ``---`` lines."""

    name: AppId
    title: Title
    description: Description
    model: ModelAliasName | None = None
    review_model: ModelAliasName | None = None
    limits: AppLimits = AppLimits()


class AppRule(Section):
    """One rule: its text as the reviewer reads it, and who added it (not shown to it)."""

    text: AppRuleText
    added_by: AddedBy | None = None

    @model_validator(mode="after")
    def _reads_back(self) -> AppRule:
        document = (
            f"## {SYSTEM_PROMPT_HEADING}\n\nx\n\n## {RULES_HEADING}\n\n### {ALLOW_HEADING}\n\n"
            f"{rule_item(self.text, self.added_by)}\n### {DENY_HEADING}\n"
        )
        body = read_body(document, 0)
        if body.problems:
            raise ValueError(body.problems[0].reason)
        read = [(rule.text, rule.added_by) for rule in body.allow]
        if read != [(self.text, self.added_by)] or body.deny:
            raise ValueError(
                "this rule would not read back as one rule from APP.md: a rule is one "
                "paragraph of plain text (no blank line, and no line that starts a heading, "
                "a list, a quote or a code block)"
            )
        return self


class AppRules(Section):
    """The rules the reviewer checks each of the app's calls against."""

    allow: Annotated[tuple[AppRule, ...], Field(max_length=MAX_RULES)] = ()
    deny: Annotated[tuple[AppRule, ...], Field(max_length=MAX_RULES)] = ()


class AppManifest(AppFrontMatter):
    """A whole, valid APP.md."""

    system_prompt: SystemPrompt
    rules: AppRules = AppRules()

    @property
    def app_id(self) -> str:
        return self.name

    @property
    def tool_name(self) -> str:
        return tool_name_of(self.name)


def tool_name_of(app_id: str) -> str:
    """The tool an app is called by: ``app_<id>``, hyphens as underscores (a valid
    protocol tool name for every valid id; the map is one-to-one since ids hold no '_')."""
    name = TOOL_NAME_PREFIX + app_id.replace("-", "_")
    if len(name) > MAX_ID_CHARS or not TOOL_NAME_RE.fullmatch(name):  # a guard, see APP_ID_RE
        raise ValueError(f"{_shown(app_id)} gives no valid tool name")
    return name


# --- parsing --------------------------------------------------------------------------


def parse_manifest_bytes(data: bytes, source: str) -> AppManifest:
    """The manifest in ``data`` (a whole APP.md); ``source`` names it in messages.

    Error handling: :class:`ManifestError` for a file larger than
    :data:`MAX_MANIFEST_BYTES`, not UTF-8, or anything :func:`parse_manifest` refuses.
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise _too_large(source)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ManifestError(
            source,
            [
                ManifestProblem(
                    line,
                    None,
                    f"not UTF-8 (byte 0x{data[exc.start]:02x}); save {MANIFEST_FILE} as UTF-8",
                )
            ],
        ) from None
    return parse_manifest(text, source)


def parse_manifest(text: str, source: str) -> AppManifest:
    """The manifest in ``text``; ``source`` names it in messages (usually its path).

    Error handling: :class:`ManifestError` naming every problem found, each with its
    line and field where known.
    """
    # The same cap as on the file's bytes (a character is at least one byte, so a longer
    # text is refused before it is encoded).
    if len(text) > MAX_MANIFEST_BYTES or len(text.encode(errors="surrogatepass")) > (
        MAX_MANIFEST_BYTES
    ):
        raise _too_large(source)
    text = text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    found = invisible_character(text)
    if found is not None:
        line = text.count("\n", 0, found[0]) + 1
        raise ManifestError(source, [ManifestProblem(line, None, invisible_reason(found[1]))])
    lines = text.split("\n")
    if lines[0].rstrip() != _FRONT_MATTER_FENCE:
        raise ManifestError(
            source,
            [
                ManifestProblem(
                    1,
                    None,
                    f"{MANIFEST_FILE} starts with its front matter: a line '---', the fields "
                    "(name, title, description, ...) in YAML, and a closing line '---'",
                )
            ],
        )
    closing = next(
        (i for i in range(1, len(lines)) if lines[i].rstrip() == _FRONT_MATTER_FENCE), None
    )
    if closing is None:
        raise ManifestError(
            source,
            [
                ManifestProblem(
                    1, None, "the front matter opened by '---' on line 1 is never closed by '---'"
                )
            ],
        )
    problems: list[ManifestProblem] = []
    front = _read_front_matter("\n".join(lines[1:closing]), problems)
    body_text = "\n".join(lines[closing + 1 :])
    too_many = _too_many_bullet_lines(body_text, closing + 1)
    if too_many is not None:
        raise ManifestError(source, [*problems, too_many])
    body = read_body(body_text, closing + 1)
    problems += body.problems
    allow = _rules_of(body.allow, problems)
    deny = _rules_of(body.deny, problems)
    if problems or front is None:
        # In the order a reader meets them; those without a line (a missing field) last.
        problems.sort(key=lambda p: (p.line is None, p.line or 0))
        raise ManifestError(source, problems)
    try:
        # Only the fields the front matter set, so a rendering writes back what was written.
        given = {name: getattr(front, name) for name in front.model_fields_set}
        return AppManifest(
            **given,
            system_prompt=body.system_prompt,
            rules=AppRules(allow=allow, deny=deny),
        )
    except ValidationError as exc:
        raise ManifestError(
            source,
            [_model_problem(error, AppManifest, {}, body.lines) for error in exc.errors()],
        ) from None


def _too_large(source: str) -> ManifestError:
    reason = (
        f"{MANIFEST_FILE} is larger than {MAX_MANIFEST_BYTES} bytes; an app's manifest is "
        "a system prompt and its rules"
    )
    return ManifestError(source, [ManifestProblem(None, None, reason)])


def _too_many_bullet_lines(body: str, offset: int) -> ManifestProblem | None:
    """A problem at the first line past :data:`MAX_BULLET_LINES` that may open a bullet
    list item in ``body`` (``offset``: its first line's 0-based number in the file)."""
    count = 0
    first_over: int | None = None
    for line in bullet_lines(body):
        count += 1
        if count == MAX_BULLET_LINES + 1:
            first_over = line
    if first_over is None:
        return None
    return ManifestProblem(
        offset + first_over + 1,
        "rules",
        f"{count} lines start a bullet list item ('- ', '* ' or '+ '); a list holds at most "
        f"{MAX_RULES} rules, and no valid {MANIFEST_FILE} has more than {MAX_BULLET_LINES} "
        f"such lines ({MAX_RULES} rules under each of '### {ALLOW_HEADING}' and "
        f"'### {DENY_HEADING}', and a system prompt of at most {MAX_SYSTEM_PROMPT_CHARS} "
        "characters)",
    )


_FRONT_LINE_OFFSET: Final = 1  # the front matter's first line is the file's second


def _read_front_matter(text: str, problems: list[ManifestProblem]) -> AppFrontMatter | None:
    try:
        data = strictyaml.load(text)
    except strictyaml.YamlInputError as exc:
        line = None if exc.line is None else exc.line + _FRONT_LINE_OFFSET
        problems.append(ManifestProblem(line, None, exc.problem))
        return None
    if not isinstance(data, dict):
        what = "empty" if data is None else f"a {type(data).__name__}, not a mapping"
        problems.append(
            ManifestProblem(
                2,
                None,
                f"the front matter is {what}: it holds the fields name, title and "
                "description (and optionally model, review_model, limits)",
            )
        )
        return None
    try:
        return AppFrontMatter.model_validate(data)
    except ValidationError as exc:
        key_lines = {
            path: line + _FRONT_LINE_OFFSET for path, line in strictyaml.key_lines(text).items()
        }
        problems += [_model_problem(e, AppFrontMatter, key_lines, {}) for e in exc.errors()]
        return None


def _model_problem(
    error: ErrorDetails,
    root: type[Section],
    key_lines: dict[tuple[str | int, ...], int],
    body_lines: dict[str, int],
) -> ManifestProblem:
    loc = tuple(error["loc"])
    where = _field_name(loc)
    line = key_lines.get(loc) or body_lines.get(where)
    if line is None and loc:
        line = key_lines.get(loc[:-1]) or body_lines.get(_field_name(loc[:1]))
    kind = error["type"]
    if kind == "missing":
        return ManifestProblem(line, where, "required field is missing")
    if kind == "extra_forbidden":
        return ManifestProblem(line, where, "unknown field" + _allowed_fields_hint(root, loc))
    if kind == "value_error":  # our own checks: their messages name the value
        return ManifestProblem(line, where, error["msg"].removeprefix("Value error, "))
    shown = repr(error["input"])
    if len(shown) > _MAX_SHOWN_VALUE_CHARS:
        shown = shown[: _MAX_SHOWN_VALUE_CHARS - 3] + "..."
    return ManifestProblem(line, where, f"{error['msg']} (got {shown})")


def _field_name(loc: tuple[int | str, ...]) -> str:
    """``limits.turns``; a list position as ``rules.allow[3]`` (counted from 1)."""
    name = ""
    for part in loc:
        name += f"[{part + 1}]" if isinstance(part, int) else (f".{part}" if name else part)
    return name or "(front matter)"


def _allowed_fields_hint(root: type[Section], loc: tuple[int | str, ...]) -> str:
    model = model_at(root, loc[:-1])
    if model is None:
        return ""
    names = list(model.model_fields)
    hint = "; allowed fields: " + ", ".join(names)
    close = difflib.get_close_matches(str(loc[-1]), names, n=1)
    return hint + (f" (did you mean {close[0]!r}?)" if close else "")


def _rules_of(raws: list[RawRule], problems: list[ManifestProblem]) -> tuple[AppRule, ...]:
    """The validated rules of one list; each refused one is a problem, at its line."""
    rules = []
    for raw in raws:
        try:
            rules.append(AppRule(text=raw.text, added_by=raw.added_by))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = raw.where
            if first["loc"] == ("added_by",):
                where += ".addedBy"
            problems.append(
                ManifestProblem(raw.line, where, first["msg"].removeprefix("Value error, "))
            )
    return tuple(rules)


# --- rendering ------------------------------------------------------------------------


def render_manifest(manifest: AppManifest) -> str:
    """``manifest`` as APP.md text; :func:`parse_manifest` reads back an equal manifest.

    The front matter holds the fields the manifest was given (a default left unwritten
    stays unwritten), in the documented order.
    """
    front = manifest.model_dump(mode="json", exclude_unset=True, exclude={"system_prompt", "rules"})
    ordered = {name: front[name] for name in AppFrontMatter.model_fields if name in front}
    yaml_text = yaml.safe_dump(
        ordered, sort_keys=False, allow_unicode=True, default_flow_style=False
    )
    parts = [
        f"{_FRONT_MATTER_FENCE}\n{yaml_text}{_FRONT_MATTER_FENCE}\n",
        f"## {SYSTEM_PROMPT_HEADING}\n\n{manifest.system_prompt}\n",
        f"## {RULES_HEADING}\n",
    ]
    for heading, rules in (
        (ALLOW_HEADING, manifest.rules.allow),
        (DENY_HEADING, manifest.rules.deny),
    ):
        items = "".join(rule_item(rule.text, rule.added_by) for rule in rules)
        parts.append(f"### {heading}\n\n{items}" if items else f"### {heading}\n")
    return "\n".join(parts)


def manifest_summary(manifest: AppManifest) -> dict[str, Any]:
    """The manifest as JSON-able data (camelCase like the wire), for ``apps show --json``
    and for callers that describe an app."""
    return {
        "id": manifest.name,
        "tool": manifest.tool_name,
        "title": manifest.title,
        "description": manifest.description,
        "model": manifest.model,
        "reviewModel": manifest.review_model,
        "limits": {
            "turns": manifest.limits.turns,
            "toolCalls": manifest.limits.tool_calls,
            "tokens": manifest.limits.tokens,
            "wallTimeS": manifest.limits.wall_time_s,
        },
        "systemPrompt": manifest.system_prompt,
        "rules": {
            side: [{"text": r.text, "addedBy": r.added_by} for r in rules]
            for side, rules in (("allow", manifest.rules.allow), ("deny", manifest.rules.deny))
        },
    }
