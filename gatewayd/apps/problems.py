"""What is wrong with an app's manifest, said so an operator can fix it: the file, the
line, the field and the reason; and the one check every part of APP.md shares, that it
holds nothing a reader would not see. Pure."""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import regex


# Refused anywhere (but tab and newline): the categories control (Cc), format (Cf:
# zero-width, bidi overrides, tag characters), surrogates (Cs), private use (Co), line and
# paragraph separators (Zl, Zp: a line break to some readers, not to others); and
# Unicode's Default_Ignorable_Code_Point, what a renderer shows as nothing whatever its
# category: the combining grapheme joiner U+034F, variation selectors (U+FE00-FE0F and
# U+E0100-E01EF, which can carry arbitrary bytes behind one visible character), Hangul
# fillers (U+115F, U+1160, U+3164, U+FFA0) and the unassigned rest of the tags block.
# U+2800 BRAILLE PATTERN BLANK is not ignorable but draws as blank space, so a name or
# path can end in it unseen. The ``regex`` library knows the property (the standard
# library's ``re`` and ``unicodedata`` do not), from a newer Unicode than Python's own.
# Compiled at the first text that is not plain ASCII: what only imports this module (the
# configuration's MCP declarations, every daemon) does not load ``regex``.
@functools.cache
def _invisible_re() -> regex.Pattern[str]:
    import regex

    return regex.compile(
        r"(?![\t\n])[\p{Cc}\p{Cf}\p{Cs}\p{Co}\p{Zl}\p{Zp}\p{Default_Ignorable_Code_Point}\u2800]"
    )


# Printable ASCII, tab and newline are never refused, and most of a manifest is just
# that: the standard library finds the first other character, ten times faster.
_CANDIDATE_RE: Final = re.compile(r"[^\t\n\x20-\x7e]")
# What a character without a Unicode name is, by its category.
_UNNAMED: Final = {
    "Cc": "a control character",
    "Cs": "a surrogate",
    "Co": "a private-use character",
    "Cn": "an unassigned code point",
}


@dataclass(frozen=True, slots=True)
class ManifestProblem:
    """One thing wrong with a manifest: where (``line``, 1-based, when known), which
    ``field`` (``name``, ``limits.turns``, ``system_prompt``, ``rules.allow[2]``) and why."""

    line: int | None
    field: str | None
    reason: str

    def describe(self, source: str) -> str:
        """``source:line: field: reason``, leaving out what is not known."""
        where = source if self.line is None else f"{source}:{self.line}"
        return f"{where}: {self.field}: {self.reason}" if self.field else f"{where}: {self.reason}"


class ManifestError(Exception):
    """An APP.md that cannot be used. ``str(exc)`` is one line per problem, each
    naming ``source`` (the file), the line and the field where known, and the reason;
    ``line``, ``field`` and ``reason`` are the first problem's."""

    def __init__(self, source: str, problems: Sequence[ManifestProblem]) -> None:
        self.source = source
        self.problems = tuple(problems) or (ManifestProblem(None, None, "invalid manifest"),)
        super().__init__("\n".join(p.describe(source) for p in self.problems))

    @property
    def line(self) -> int | None:
        return self.problems[0].line

    @property
    def field(self) -> str | None:
        return self.problems[0].field

    @property
    def reason(self) -> str:
        return self.problems[0].reason


def invisible_character(text: str) -> tuple[int, str] | None:
    """The index and description of the first character of ``text`` that a reader
    would not see, or None: control characters (but tab and newline), format characters
    (zero-width, bidirectional overrides, Unicode tag characters), surrogates, private
    use, line and paragraph separators, default-ignorable code points (variation
    selectors, the combining grapheme joiner, Hangul fillers) and the braille blank."""
    candidate = _CANDIDATE_RE.search(text)
    match = None if candidate is None else _invisible_re().search(text, candidate.start())
    if match is None:
        return None
    char = match.group()
    name = unicodedata.name(char, "") or _UNNAMED.get(
        unicodedata.category(char), "an unnamed character"
    )
    return match.start(), f"U+{ord(char):04X} ({name})"


def invisible_reason(what: str) -> str:
    """Why ``what`` (a character, described) is refused."""
    return (
        f"{what} is not allowed: invisible and control characters can make what a "
        "person reads differ from what a model reads"
    )


def check_visible(value: str) -> str:
    """``value``, or ValueError naming its first invisible character (a field validator)."""
    found = invisible_character(value)
    if found is not None:
        raise ValueError(invisible_reason(found[1]))
    return value
