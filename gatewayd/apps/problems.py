"""What is wrong with an app's manifest, said so an operator can fix it: the file, the
line, the field and the reason; and the one check every part of APP.md shares, that it
holds nothing a reader would not see. Pure."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

# Categories refused anywhere: control (Cc, but tab and newline), format (Cf: zero-width,
# bidi overrides, tag characters), surrogates (Cs), private use (Co), line and paragraph
# separators (Zl, Zp: a line break to some readers, not to others).
_INVISIBLE_CATEGORIES: Final = frozenset({"Cc", "Cf", "Cs", "Co", "Zl", "Zp"})
_CANDIDATE_RE: Final = re.compile(r"[^\t\n\x20-\x7e]")  # only these need a category lookup


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
    use, line and paragraph separators."""
    for match in _CANDIDATE_RE.finditer(text):
        char = match.group()
        if unicodedata.category(char) in _INVISIBLE_CATEGORIES:
            name = unicodedata.name(char, "a control character")
            return match.start(), f"U+{ord(char):04X} ({name})"
    return None


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
