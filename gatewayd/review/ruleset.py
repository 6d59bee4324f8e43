"""A run's review rules as the reviewer sees them, and the hash that names them.

The hash covers exactly what can change a verdict, and nothing else:

- the plain rules' text, in order (the prompt numbers them, so order is visible);
- the structured rules, every field (a changed ``reason`` changes what a deny says);
- the reviewer model's alias and ``max_value_chars`` (both change the answer);
- :data:`REVIEW_FORMAT`, bumped whenever the prompt or the matching changes meaning.

Left out on purpose: ``addedBy`` (who added a rule is for the rule history, not shown to
the reviewer, so it cannot change a verdict), ``mode`` and ``tools`` (whether a call is
reviewed, not how), ``timeout_s`` (a timeout is a deny that is never remembered) and the
cache settings. Editing any of those keeps the cache warm; editing a rule empties it
for that rule set, because no old entry carries the new hash.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from gatewayd.policy.review_section import ReviewSection, StructuredRule
from gatewayd.review.structured import CompiledRules, compile_rules

# Version of what a hash means: the prompt's wording and the structured matchers' rules.
# Bump it with any change to either, so a stored or logged hash never names two meanings.
REVIEW_FORMAT: Final = 1
_canonical: Final = msgspec.json.Encoder(order="sorted")


@dataclass(frozen=True, slots=True, kw_only=True)
class RuleSet:
    """The inputs of a verdict, fixed when a run's policy is loaded.

    ``structured_compiled`` holds the parsed globs and compiled regexes, built once;
    ``digest`` is :func:`ruleset_hash` of the section this came from.
    """

    allow: tuple[str, ...]
    deny: tuple[str, ...]
    structured: tuple[StructuredRule, ...]
    model: str | None
    max_value_chars: int
    digest: str
    structured_compiled: CompiledRules = field(compare=False, repr=False)

    # Whose calls these rules review, named in the reviewer's instructions ("the app
    # note-taker"); None: a run's, under its policy.
    subject: str | None = None

    @classmethod
    def from_section(cls, section: ReviewSection, *, subject: str | None = None) -> RuleSet:
        """The rule set of a policy's ``review`` section (or an app's rules, made into
        one, with the app as its ``subject``)."""
        return cls(
            allow=tuple(rule.text for rule in section.rules.allow),
            deny=tuple(rule.text for rule in section.rules.deny),
            structured=section.structured,
            model=section.model,
            max_value_chars=section.max_value_chars,
            digest=ruleset_hash(section, subject=subject),
            structured_compiled=compile_rules(section.structured),
            subject=subject,
        )


def _hashed_fields(section: ReviewSection, subject: str | None) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "format": REVIEW_FORMAT,
        "allow": [rule.text for rule in section.rules.allow],
        "deny": [rule.text for rule in section.rules.deny],
        "structured": [rule.model_dump(mode="json") for rule in section.structured],
        "model": section.model,
        "maxValueChars": section.max_value_chars,
    }
    # Only when there is one, so every policy's hash stays what it was.
    if subject is not None:
        fields["subject"] = subject
    return fields


def ruleset_hash(section: ReviewSection, *, subject: str | None = None) -> str:
    """sha256 (hex) of the canonical JSON of what in ``section`` can change a verdict.

    Stable across processes and Python versions: sorted keys, no whitespace, and floats
    written by msgspec in their shortest exact form.
    """
    return hashlib.sha256(_canonical.encode(_hashed_fields(section, subject))).hexdigest()
