"""APP.md's Markdown body read into its sections and rules, by markdown-it's tokens.

markdown-it-py is a CommonMark parser: a ``##`` inside a code block, an indented line or
a list item is what CommonMark says it is, so sections are found by the parser's
heading tokens and rules by its list-item tokens, never by a regular expression over
lines. The body is two top-level sections, in any order:

- ``## System Prompt``: its source text, verbatim (``###`` headings and anything else
  CommonMark allows, but no ``#`` or ``##`` heading, which would open a section, and
  nothing a Markdown viewer hides: no HTML, no link reference definition, no image and
  no link but an autolink ``<https://...>``, which shows its own destination);
- ``## Rules``: ``### Allow`` and ``### Deny``, each a bullet list (or nothing), each
  item one paragraph of plain text, and at its end at most the marker
  ``<!-- addedBy: NAME -->``. Any other HTML, any link or image is refused: a Markdown
  viewer hides it, so a reader would not see what the reviewer reads.

A link reference definition (``[x]: /url "title"``) is shown by no viewer anywhere:
it is refused wherever it is.

The work is bounded before the cap on rules: a list's items past :data:`MAX_RULES` are
counted, not read into rules (each rule is later parsed again to prove it reads back).

Nothing here validates a value; :mod:`gatewayd.apps.manifest` does, and uses
:func:`read_body` to prove that a rule or a prompt reads back the same from the text it
renders to. Pure.
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from gatewayd.apps.problems import ManifestProblem, invisible_character, invisible_reason
from gatewayd.policy.review_section import MAX_RULES

if TYPE_CHECKING:
    from markdown_it import MarkdownIt
    from markdown_it.token import Token

SYSTEM_PROMPT_HEADING: Final = "System Prompt"
RULES_HEADING: Final = "Rules"
ALLOW_HEADING: Final = "Allow"
DENY_HEADING: Final = "Deny"
SECTIONS: Final = (SYSTEM_PROMPT_HEADING, RULES_HEADING)
RULE_LISTS: Final = {ALLOW_HEADING: "allow", DENY_HEADING: "deny"}

# Inline tokens that show a reader something other than their source text.
_HIDING_INLINE: Final = frozenset({"link_open", "image"})
# markdown-it's markup of a link written <https://...>: its text is its destination.
_AUTOLINK_MARKUP: Final = "autolink"
_ADDED_BY_COMMENT_RE: Final = re.compile(r"<!--\s*addedBy:\s*(.*?)\s*-->", re.DOTALL)
# A heading's text quoted in a message: enough to recognise it.
_MAX_SHOWN_HEADING_CHARS: Final = 80


# The CommonMark preset: strict CommonMark, raw HTML recognised as HTML tokens (which
# the refusal of HTML in rules needs), no typographic replacements or link guessing.
# ``inline_definitions``: a link reference definition becomes a ``definition`` token
# with its lines, instead of vanishing into the parser's environment, so it can be
# refused where it stands. Made at the first manifest read: what only names this module's
# headings (the run registry, every daemon) does not load markdown-it (gatewayd.libraries).
@functools.cache
def _markdown() -> MarkdownIt:
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark", {"inline_definitions": True})


# A line that may open a top-level bullet list item: at most three spaces, then '-', '+'
# or '*' and a space, a tab or the line's end. Every list item at the document's top
# level starts such a line (a deeper one may not, but is never a rule).
_BULLET_LINE_RE: Final = re.compile(r"^ {0,3}[-+*](?:[ \t]|$)", re.MULTILINE)


def normalize_rule_text(text: str) -> str:
    """Each line stripped: CommonMark drops a continuation line's indentation, and the
    spaces at a line's end change nothing a reviewer reads."""
    return "\n".join(line.strip() for line in text.strip().split("\n"))


def strip_blank_lines(text: str) -> str:
    """``text`` without its leading and trailing blank lines (a line's own indentation
    is kept: it may be Markdown)."""
    lines = text.split("\n")
    while lines and not lines[0].strip():
        lines.pop(0)
    while lines and not lines[-1].strip():
        lines.pop()
    return "\n".join(lines)


def bullet_lines(text: str) -> Iterator[int]:
    """The 0-based number of each line of ``text`` that may open a top-level bullet list
    item: more than the items there are (a thematic break ``* * *``, a line in a code
    block), never fewer. One pass of a regular expression, before the Markdown parser."""
    line = 0
    last = 0
    for match in _BULLET_LINE_RE.finditer(text):
        line += text.count("\n", last, match.start())
        last = match.start()
        yield line


@dataclass(frozen=True, slots=True)
class RawRule:
    """A rule as the body holds it, not yet validated."""

    text: str
    added_by: str | None
    line: int
    where: str  # its field name: rules.allow[3]


@dataclass(slots=True)
class Body:
    """What the Markdown body holds, before validation; ``lines`` maps a field name to
    its line for validation errors."""

    system_prompt: str = ""
    allow: list[RawRule] = field(default_factory=list)
    deny: list[RawRule] = field(default_factory=list)
    problems: list[ManifestProblem] = field(default_factory=list)
    lines: dict[str, int] = field(default_factory=dict)
    items: dict[str, int] = field(default_factory=dict)  # list items seen, per side


@dataclass(frozen=True, slots=True)
class _Span:
    """A top-level ``#``/``##`` heading: the section it opens (None: not one of ours),
    its first line and the line after it (0-based; a setext heading has two), and its
    token's index."""

    section: str | None
    first_line: int
    after_line: int
    index: int


def _top_level(tokens: list[Token]) -> Iterator[tuple[int, Token]]:
    """Index and token of each block at the document's top level (openers and leaves)."""
    for index, token in enumerate(tokens):
        if token.level == 0 and token.nesting >= 0:
            yield index, token


def _heading_text(tokens: list[Token], index: int) -> str:
    return tokens[index + 1].content.strip()


def read_body(text: str, offset: int) -> Body:
    """The body's sections (``offset``: the file's 0-based line where the body starts)."""
    body = Body()
    source_lines = text.split("\n")
    tokens = _markdown().parse(text)
    _check_entities(tokens, offset, body.problems)
    # Top-level h1/h2 headings split the body into sections.
    spans: list[_Span] = []
    seen: set[str] = set()
    preamble = False  # something before the first section (reported once)
    for index, token in _top_level(tokens):
        line = offset + _line0(token) + 1
        if token.type == "heading_open" and token.tag in ("h1", "h2"):
            name = _heading_text(tokens, index)
            section = _section_of(token.tag, name, line, seen, body.problems)
            first, after = token.map or (0, 1)
            spans.append(_Span(section, first, after, index))
        elif not spans and not preamble:
            preamble = True
            body.problems.append(
                ManifestProblem(
                    line,
                    None,
                    f"the body starts with the heading '## {SYSTEM_PROMPT_HEADING}'; "
                    f"found {_kind(token)} before it",
                )
            )
    for number, span in enumerate(spans):
        last = number + 1 == len(spans)
        end0 = len(source_lines) if last else spans[number + 1].first_line
        end_index = len(tokens) if last else spans[number + 1].index
        heading0 = span.first_line
        if span.section == SYSTEM_PROMPT_HEADING:
            text_lines = source_lines[span.after_line : end0]
            body.system_prompt = strip_blank_lines("\n".join(text_lines))
            body.lines["system_prompt"] = offset + heading0 + 1
            _check_prompt_hides_nothing(tokens, span.index + 3, end_index, offset, body.problems)
        elif span.section == RULES_HEADING:
            body.lines["rules"] = offset + heading0 + 1
            # heading_open, its inline text, heading_close: the section's blocks follow.
            _read_rules(tokens, span.index + 3, end_index, offset, body)
    for name, field_name in ((SYSTEM_PROMPT_HEADING, "system_prompt"), (RULES_HEADING, "rules")):
        if name not in seen:
            body.problems.append(
                ManifestProblem(
                    None,
                    field_name,
                    f"there is no '## {name}' section (if it is there, a code fence or an "
                    "HTML block above it is never closed and holds it)",
                )
            )
    return body


def _check_prompt_hides_nothing(
    tokens: list[Token], start: int, end: int, offset: int, problems: list[ManifestProblem]
) -> None:
    """The first thing in the system prompt (``tokens[start:end]``) that a Markdown
    viewer hides from a person vetting the app while its model reads it, as a problem at
    its line: HTML (a comment, ``<details>``, ``<div hidden>``), a link reference
    definition, an image (its alt text), a link other than an autolink (its destination
    and title)."""
    line = 0
    for token in tokens[start:end]:
        line = offset + _line0(token) + 1 if token.map else line
        what: str | None = None
        if token.type == "html_block":
            what = "HTML"
        elif token.type == "definition":
            what = "a link reference definition"
        elif token.type == "inline":
            hidden = _hidden_inline(token.children or (), autolinks=True)
            if hidden is not None:
                what = _inline_kind(hidden)
                # The line of a paragraph's HTML: where its text first appears (a guess
                # only when the same text comes earlier; never a line outside it).
                at = token.content.find(hidden.content) if hidden.content else -1
                line += token.content.count("\n", 0, max(at, 0))
        if what is not None:
            problems.append(
                ManifestProblem(
                    line,
                    "system_prompt",
                    f"the system prompt holds {what}, which a Markdown viewer hides or "
                    "changes, so a person reading APP.md would not see what the app's model "
                    "reads; write it as plain text, or in a code span or block (`<tag>`, "
                    "`[x]: url`), or a link as <https://...>",
                )
            )
            return


def _hidden_inline(children: Sequence[Token], *, autolinks: bool) -> Token | None:
    """The first inline token that shows a reader something other than its source:
    HTML, an image, a link (an autolink ``<https://...>`` passes when ``autolinks``)."""
    for child in children:
        if child.type == "html_inline":
            return child
        if child.type in _HIDING_INLINE:
            if autolinks and child.type == "link_open" and child.markup == _AUTOLINK_MARKUP:
                continue
            return child
    return None


def _inline_kind(token: Token) -> str:
    kinds = {"html_inline": "HTML", "image": "an image", "link_open": "a link"}
    return kinds.get(token.type, token.type)


def _check_entities(tokens: list[Token], offset: int, problems: list[ManifestProblem]) -> None:
    """An HTML entity (``&#x202E;``) that a Markdown viewer turns into an invisible
    character is refused like the character itself (the text was checked already)."""
    for token in tokens:
        for child in token.children or ():
            found = invisible_character(child.content) if child.type == "text" else None
            if found is not None:
                problems.append(
                    ManifestProblem(
                        offset + _line0(token) + 1,
                        None,
                        invisible_reason(f"an HTML entity for {found[1]}"),
                    )
                )
                return


def _line0(token: Token) -> int:
    return token.map[0] if token.map else 0


def _kind(token: Token) -> str:
    kinds = {
        "paragraph_open": "text",
        "bullet_list_open": "a list",
        "ordered_list_open": "a numbered list",
        "heading_open": f"a heading '{token.markup} '",
        "fence": "a code block",
        "code_block": "an indented code block",
        "blockquote_open": "a quote",
        "html_block": "HTML (hidden when Markdown is shown)",
        "definition": "a link reference definition (hidden when Markdown is shown)",
        "hr": "a horizontal rule",
    }
    return kinds.get(token.type, token.type)


def _section_of(
    tag: str, name: str, line: int, seen: set[str], problems: list[ManifestProblem]
) -> str | None:
    """Which section a top-level heading opens (None: not one of ours; a problem added)."""
    if tag == "h1":
        problems.append(
            ManifestProblem(
                line,
                None,
                f"a '# ' heading; the body has two '## ' sections, '{SYSTEM_PROMPT_HEADING}' and "
                f"'{RULES_HEADING}' (use '###' for headings inside the system prompt)",
            )
        )
        return None
    if name not in SECTIONS:
        close = difflib.get_close_matches(name, SECTIONS, n=1, cutoff=0.5)
        hint = f" (did you mean '## {close[0]}'?)" if close else ""
        problems.append(
            ManifestProblem(
                line,
                None,
                f"unknown section '## {name[:_MAX_SHOWN_HEADING_CHARS]}'{hint}; the body has "
                f"'## {SYSTEM_PROMPT_HEADING}' and '## {RULES_HEADING}' (use '###' for "
                "headings inside the system prompt)",
            )
        )
        return None
    if name in seen:
        problems.append(
            ManifestProblem(line, None, f"a second '## {name}' section; there is one of each")
        )
        return None
    seen.add(name)
    return name


def _read_rules(tokens: list[Token], start: int, end: int, offset: int, body: Body) -> None:
    """The ``### Allow`` and ``### Deny`` lists in ``tokens[start:end]``."""
    side: str | None = None  # "allow" or "deny" once under its heading
    seen: set[str] = set()
    refused_side = False  # under an unknown or repeated heading: its content is not read
    for index in range(start, end):
        token = tokens[index]
        if token.level != 0 or token.nesting < 0:
            continue
        line = offset + _line0(token) + 1
        if token.type == "heading_open":
            name = _heading_text(tokens, index)
            side, refused_side = _rule_list_of(token, name, line, seen, body)
        elif refused_side:
            continue
        elif side is None:
            body.problems.append(
                ManifestProblem(
                    line,
                    "rules",
                    f"rules go in a bullet list under '### {ALLOW_HEADING}' or "
                    f"'### {DENY_HEADING}'; found {_kind(token)} before either",
                )
            )
            refused_side = True
        elif token.type == "bullet_list_open":
            _read_list(tokens, index, offset, side, body)
        else:
            bullet = "a bullet list ('- rule')"
            body.problems.append(
                ManifestProblem(
                    line,
                    f"rules.{side}",
                    f"only {bullet} belongs under '### {_heading_of(side)}'; found {_kind(token)}",
                )
            )
    for name, side_name in RULE_LISTS.items():
        if name not in seen:
            body.problems.append(
                ManifestProblem(
                    None,  # nothing is there to point at
                    f"rules.{side_name}",
                    f"there is no '### {name}' under '## {RULES_HEADING}' (an empty list is "
                    "the heading alone)",
                )
            )


def _heading_of(side: str) -> str:
    return ALLOW_HEADING if side == "allow" else DENY_HEADING


def _rule_list_of(
    token: Token, name: str, line: int, seen: set[str], body: Body
) -> tuple[str | None, bool]:
    """(the list a heading under Rules opens, whether its content is refused)."""
    if token.tag != "h3" or name not in RULE_LISTS:
        close = difflib.get_close_matches(name, list(RULE_LISTS), n=1, cutoff=0.5)
        hint = f" (did you mean '### {close[0]}'?)" if close else ""
        body.problems.append(
            ManifestProblem(
                line,
                "rules",
                f"unknown heading '{token.markup} {name[:_MAX_SHOWN_HEADING_CHARS]}'{hint}; "
                f"'## {RULES_HEADING}' holds '### {ALLOW_HEADING}' and '### {DENY_HEADING}'",
            )
        )
        return None, True
    side = RULE_LISTS[name]
    if name in seen:
        body.problems.append(
            ManifestProblem(
                line, f"rules.{side}", f"a second '### {name}'; put all its rules in one list"
            )
        )
        return None, True
    seen.add(name)
    body.lines[f"rules.{side}"] = line
    return side, False


def _read_list(tokens: list[Token], start: int, offset: int, side: str, body: Body) -> None:
    """The rules of the bullet list opened at ``tokens[start]``; past :data:`MAX_RULES`
    items on a side, the first one over is a problem and the rest are only counted."""
    rules = body.allow if side == "allow" else body.deny
    index = start + 1
    while tokens[index].type != "bullet_list_close" or tokens[index].level != 0:
        item = tokens[index]  # list_item_open, level 1
        close = index + 1
        while tokens[close].type != "list_item_close" or tokens[close].level != 1:
            close += 1
        line = offset + _line0(item) + 1
        body.items[side] = number = body.items.get(side, 0) + 1
        if number == MAX_RULES + 1:
            body.problems.append(
                ManifestProblem(
                    line,
                    f"rules.{side}",
                    f"more than {MAX_RULES} rules under '### {_heading_of(side)}' (this is "
                    f"rule {number}); a list holds at most {MAX_RULES} rules: every rule goes "
                    "with every reviewed call, so merge or drop some",
                )
            )
        if number <= MAX_RULES:
            where = f"rules.{side}[{number}]"
            body.lines[where] = line
            rule = _rule_in_item(tokens[index + 1 : close], line, where, body.problems)
            if rule is not None:
                rules.append(rule)
        index = close + 1


def _rule_in_item(
    inner: list[Token], line: int, where: str, problems: list[ManifestProblem]
) -> RawRule | None:
    """The rule one list item holds: exactly one paragraph, plain text, and at its end
    at most the ``<!-- addedBy: NAME -->`` marker."""
    kinds = [t.type for t in inner if t.level == 2 and t.nesting >= 0]
    if not kinds:
        problems.append(ManifestProblem(line, where, "the rule is empty"))
        return None
    if kinds != ["paragraph_open"]:
        other = next(
            (t for t in inner if t.level == 2 and t.nesting >= 0 and t.type != "paragraph_open"),
            None,
        )
        what = "more than one paragraph" if other is None else _kind(other)
        problems.append(
            ManifestProblem(
                line,
                where,
                f"a rule is one paragraph of text in one list item; this one holds {what}",
            )
        )
        return None
    inline = inner[1]
    children = list(inline.children or ())
    added_by: str | None = None
    content = inline.content
    if children and children[-1].type == "html_inline":
        marker = _ADDED_BY_COMMENT_RE.fullmatch(children[-1].content)
        if marker is not None:
            added_by = marker.group(1)
            content = content[: len(content) - len(children[-1].content)]
            children.pop()
    if any(child.type == "html_inline" for child in children):
        problems.append(
            ManifestProblem(
                line,
                where,
                "a rule holds HTML, which is hidden when Markdown is shown, so a reader "
                "would not see what the reviewer reads; only a trailing "
                "'<!-- addedBy: NAME -->' is allowed",
            )
        )
        return None
    # A link's title and destination and an image's alt text are hidden or changed when
    # Markdown is shown, like HTML: a rule is plain text, so what a person reads is what
    # the reviewer reads.
    hidden = _hidden_inline(children, autolinks=False)
    if hidden is not None:
        kind = _inline_kind(hidden)
        problems.append(
            ManifestProblem(
                line,
                where,
                f"a rule holds {kind}, whose target, title or alt text is hidden or changed "
                "when Markdown is shown, so a reader would not see what the reviewer reads; "
                "write the rule as plain text (paths as `data/notes.md`)",
            )
        )
        return None
    text = normalize_rule_text(content)
    if not text:
        problems.append(ManifestProblem(line, where, "the rule is empty"))
        return None
    return RawRule(text, added_by, line, where)


def rule_item(text: str, added_by: str | None) -> str:
    """One rule as its list item (continuation lines indented under the bullet), the
    shape :func:`read_body` reads back."""
    first, *rest = text.split("\n")
    lines = [f"- {first}", *(f"  {line}" for line in rest)]
    if added_by is not None:
        lines[-1] += f" <!-- addedBy: {added_by} -->"
    return "\n".join(lines) + "\n"
