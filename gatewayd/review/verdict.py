"""The reviewer's answer, parsed strictly: a clean ``ALLOW`` or ``DENY: <reason>``.

Anything else is a deny (invariant FAIL_CLOSED), because a model that does not follow a
one-word answer format is not one whose judgement we can read. The match is
case-sensitive and exact: ``Allow``, ``ALLOW.``, ``**ALLOW**``, a fenced block,
``ALLOW because ...`` and a second line are all unparseable. Leniency could only ever
turn a deny into an allow or a reason into noise, so there is none.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Final

ALLOW_ANSWER: Final = "ALLOW"
DENY_PREFIX: Final = "DENY:"
# The reason an answer that is neither clean form gets, word for word (docs/review.md
# quotes it, and operators search the audit log for it).
UNPARSEABLE_REASON: Final = "unparseable review"
# The reason is shown to the agent and written to the audit log: one sentence is the
# format asked for, and a model that writes an essay should not fill either.
MAX_REASON_CHARS: Final = 500
# Only ASCII whitespace may surround an answer; an exotic space is not "exactly ALLOW".
_SURROUNDING: Final = " \t\r\n"
# Unicode categories removed from a reason: controls, format characters (bidi
# overrides, zero-width joiners), surrogates, private use, line and paragraph separators.
# They could rewrite how the agent's terminal or a log viewer shows the message.
_DROPPED_CATEGORIES: Final = frozenset({"Cc", "Cf", "Cs", "Co", "Zl", "Zp"})


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """What the reviewer decided.

    ``parse_ok`` is false when the answer was neither clean form; such a verdict is
    always a deny with :data:`UNPARSEABLE_REASON`. ``reason`` is empty for an allow.
    """

    allowed: bool
    reason: str
    parse_ok: bool


ALLOWED: Final = Verdict(allowed=True, reason="", parse_ok=True)
UNPARSEABLE: Final = Verdict(allowed=False, reason=UNPARSEABLE_REASON, parse_ok=False)


def _clean_reason(raw: str) -> str:
    kept = "".join(c for c in raw if unicodedata.category(c) not in _DROPPED_CATEGORIES)
    kept = kept.strip()
    if len(kept) > MAX_REASON_CHARS:
        kept = kept[: MAX_REASON_CHARS - 1].rstrip() + "…"
    return kept


def parse_verdict(text: str) -> Verdict:
    """The verdict in the reviewer's answer ``text``.

    Accepted, with optional ASCII whitespace around: exactly ``ALLOW``, or ``DENY:``
    followed by a reason on the same line. The reason loses control and format
    characters and is cut to :data:`MAX_REASON_CHARS`; if nothing is left, or the answer
    is anything else, the verdict is :data:`UNPARSEABLE` (a deny).
    """
    answer = text.strip(_SURROUNDING)
    if answer == ALLOW_ANSWER:
        return ALLOWED
    if not answer.startswith(DENY_PREFIX):
        return UNPARSEABLE
    raw = answer[len(DENY_PREFIX) :]
    if "\n" in raw or "\r" in raw:
        return UNPARSEABLE  # a second line is a second answer; which one was meant?
    reason = _clean_reason(raw)
    if not reason:
        return UNPARSEABLE
    return Verdict(allowed=False, reason=reason, parse_ok=True)
