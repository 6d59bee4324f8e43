"""One change to an app's rules, applied to its manifest: a new :class:`AppManifest`.

The four actions and their asymmetry are the review rules' own
(:class:`~gatewayd.policy.rule_action.RuleAction`: add_deny and remove_allow tighten,
add_allow and remove_deny loosen); who may apply which, and when, is the desk's
(:mod:`gatewayd.apps.ruledesk`). Here only what the change does to the manifest:

* a rule is matched by its exact text as APP.md holds it (each line stripped, as the
  manifest reads it); a rule to remove must be there, or the error lists the rules of
  that side (and the closest one);
* adding a rule that is already on that side is an error, not a no-op: the caller
  learns that nothing changed, and a confirmation is never asked for a change that does
  nothing;
* an added rule carries ``addedBy`` (who asked for it), written into APP.md as its
  ``<!-- addedBy: NAME -->`` marker; a side holds at most :data:`MAX_RULES` rules;
* the changed manifest must still render to an APP.md that reads back the same and
  fits :data:`MAX_MANIFEST_BYTES` (:func:`render_changed`).

Pure: no I/O.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any, Final

from pydantic import ValidationError

from gatewayd.apps.manifest import (
    MANIFEST_FILE,
    MAX_ADDED_BY_CHARS,
    AppManifest,
    AppRule,
    AppRules,
    parse_manifest,
    render_manifest,
)
from gatewayd.apps.problems import ManifestError
from gatewayd.apps.sections import normalize_rule_text
from gatewayd.errors import GatewayError
from gatewayd.policy.review_section import MAX_RULES
from gatewayd.policy.rule_action import RuleAction
from gatewayd.protocol import ErrorCode

# A "no such rule" message lists the side's rules so the caller can pick the right
# one; a side may hold MAX_RULES rules of 2000 characters, far more than a message (or
# the audit entry quoting it) should carry.
MAX_LISTED_RULES: Final = 20
MAX_LISTED_RULE_CHARS: Final = 120

# What an actor id becomes as an addedBy marker: anything outside the marker's
# characters (manifest.ADDED_BY_RE) is a hyphen.
_NOT_ADDED_BY: Final = re.compile(r"[^A-Za-z0-9_.@+]+")


class AppRuleChangeError(GatewayError):
    """The change cannot be made to this app's rules as asked (the rule is not there, is
    already there, is no valid rule, or a side is full): the caller's request is at
    fault, and ``str(exc)`` says what the rules are."""

    code = ErrorCode.INVALID_ARGS


@dataclass(frozen=True, slots=True, kw_only=True)
class AppRuleChange:
    """One change to one app's rules, as asked: by a run (``run_id``) or the operator."""

    workspace: str  # the workspace's host path, as the desk was given it
    app: str
    action: RuleAction
    rule: str
    added_by: str | None = None
    run_id: str | None = None

    def describe(self) -> dict[str, Any]:
        """The change as audit details and control-socket answers name it."""
        return {
            "app": self.app,
            "workspace": self.workspace,
            "action": str(self.action),
            "rule": self.rule,
            "addedBy": self.added_by,
            "runId": self.run_id,
        }


def added_by_of(actor: str) -> str | None:
    """``actor`` (a run's actorId: any text) as a valid ``addedBy`` marker: every run of
    other characters a hyphen, cut to :data:`MAX_ADDED_BY_CHARS`; None when nothing is
    left. The change's audit entries name the run, whose ``run_created`` holds the actor
    as it is."""
    # Each run of other characters is one hyphen, so no '--' (it would end the comment).
    marker = _NOT_ADDED_BY.sub("-", actor)[:MAX_ADDED_BY_CHARS].strip("-")
    return marker or None


def apply_rule_change(
    manifest: AppManifest, action: RuleAction, text: str, added_by: str | None
) -> AppManifest:
    """``manifest`` with ``action`` applied to the rule ``text`` (see the module
    docstring); the other fields as they were.

    Error handling: :class:`AppRuleChangeError` naming the rule and, for a rule that is
    not there, the rules of that side.
    """
    side = action.side
    rules = manifest.rules.deny if side == "deny" else manifest.rules.allow
    wanted = normalize_rule_text(text)
    if action.adds:
        if any(rule.text == wanted for rule in rules):
            raise AppRuleChangeError(
                f"app {manifest.name!r} already has the {side} rule {_cut(wanted)!r}; "
                "nothing was changed"
            )
        if len(rules) >= MAX_RULES:
            raise AppRuleChangeError(
                f"app {manifest.name!r} has {len(rules)} {side} rules, the most an app may "
                f"have ({MAX_RULES}); remove one first"
            )
        try:
            added = AppRule(text=text, added_by=added_by)
        except ValidationError as exc:
            first = exc.errors()[0]
            what = "addedBy" if first["loc"] == ("added_by",) else "the rule"
            reason = first["msg"].removeprefix("Value error, ")
            raise AppRuleChangeError(
                f"{what} cannot be written to the {MANIFEST_FILE} of app {manifest.name!r}: "
                f"{reason}"
            ) from None
        changed = (*rules, added)
    else:
        changed = tuple(rule for rule in rules if rule.text != wanted)
        if len(changed) == len(rules):
            raise AppRuleChangeError(_not_there(manifest.name, side, wanted, rules))
    new_rules = AppRules(
        allow=changed if side == "allow" else manifest.rules.allow,
        deny=changed if side == "deny" else manifest.rules.deny,
    )
    return manifest.model_copy(update={"rules": new_rules})


def loosened_by(old: AppManifest, new: AppManifest) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What putting ``new`` in the place of ``old`` (a replacement) loosens, by rule text:
    the allow rules it adds and the deny rules it drops. Both empty: the replacement's
    rules are the same or tighter (a changed prompt, model or limits is no rule)."""
    old_allow = {rule.text for rule in old.rules.allow}
    new_deny = {rule.text for rule in new.rules.deny}
    added = tuple(rule.text for rule in new.rules.allow if rule.text not in old_allow)
    dropped = tuple(rule.text for rule in old.rules.deny if rule.text not in new_deny)
    return added, dropped


def render_changed(manifest: AppManifest) -> str:
    """``manifest`` as APP.md text, checked to read back as the same manifest.

    Error handling: :class:`AppRuleChangeError` when the text would not be a valid
    APP.md (larger than the manifest's cap, most likely).
    """
    text = render_manifest(manifest)
    try:
        again = parse_manifest(text, MANIFEST_FILE)
    except ManifestError as exc:
        reason = "; ".join(problem.reason for problem in exc.problems[:1])
        raise AppRuleChangeError(
            f"with this change the {MANIFEST_FILE} of app {manifest.name!r} would not be "
            f"valid ({reason}); nothing was changed"
        ) from None
    if again != manifest:  # render_manifest's promise; a guard, never an assert
        raise AppRuleChangeError(
            f"the {MANIFEST_FILE} of app {manifest.name!r} would not read back as written "
            "with this change; nothing was changed"
        )
    return text


def _cut(text: str) -> str:
    if len(text) <= MAX_LISTED_RULE_CHARS:
        return text
    return text[: MAX_LISTED_RULE_CHARS - 3] + "..."


def _not_there(app: str, side: str, wanted: str, rules: tuple[AppRule, ...]) -> str:
    message = f"app {app!r} has no {side} rule {_cut(wanted)!r}"
    if not rules:
        return f"{message}; it has no {side} rules"
    texts = [rule.text for rule in rules]
    close = difflib.get_close_matches(wanted, texts, n=1)
    hint = f" (did you mean {_cut(close[0])!r}?)" if close else ""
    listed = "; ".join(
        f"{number}. {_cut(text)!r}" for number, text in enumerate(texts[:MAX_LISTED_RULES], 1)
    )
    more = f"; and {len(texts) - MAX_LISTED_RULES} more" if len(texts) > MAX_LISTED_RULES else ""
    return (
        f"{message}{hint}; a rule is removed by its exact text, and its {side} rules are: "
        f"{listed}{more}"
    )
