"""Live review rules, and changing them asymmetrically: tightening at once, loosening
only on confirmation.

| change | takes effect |
| --- | --- |
| add a deny rule, remove an allow rule (tightening) | at once |
| add an allow rule, remove a deny rule (loosening) | only once confirmed on the control socket |

Invariant LOOSENING_NEEDS_CONFIRMATION: a loosening change returns a pending confirmation
(its id and the exact change); nothing changes until ``confirm`` is called with that id.
Only the control socket (root, never a sandbox) reaches this module.

Every applied change is written to the policy file atomically (a temporary file, fsync,
rename, fsync of the directory), validated as a whole policy before it replaces the old
one, and becomes the rules of every live run of that policy for its next call: a new
rule-set hash, so no cached verdict of the old rules is used again. The file is
rewritten from its parsed form: comments and key order in it are not kept.

An edit by hand reaches them too: every call that goes through the review step asks
:meth:`RuleBook.current`, which looks at the file (one ``stat``) and reads it again when
it changed. A call answered at once (dispatch's ``handle_now``: no side effect, no I/O,
and no review under the rules in force) only asks whether a review applies, and takes
the answer from rules looked at up to ``max_age_s`` ago (dispatch's
``RULES_MAX_AGE_AT_ONCE_S``, 10 ms): a ``stat`` on the event loop's thread hands the
interpreter to the audit flusher and back, which under load cost more than the rest
of such a call's policy step. So an edit by hand that makes such a call reviewed
reaches it within that time, or at the next call that goes through the review step,
whichever comes first; every other edit reaches the next reviewed call.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

import yaml

from gatewayd.errors import GatewayError
from gatewayd.files import write_atomically
from gatewayd.policy import PolicyError, load_policy_text
from gatewayd.policy.model import validate_policy
from gatewayd.policy.review_section import ReviewSection
from gatewayd.policy.rule_action import RuleAction
from gatewayd.policyfile import read_policy_mapping
from gatewayd.protocol import ErrorCode
from gatewayd.review.ruleset import RuleSet

# A confirmation id: unguessable, so only who was shown it can confirm it.
CONFIRMATION_ID_BYTES: Final = 16
# Loosening changes nobody confirms do not pile up forever.
MAX_PENDING: Final = 100


class RuleChangeError(GatewayError):
    """A rule change that cannot be made (no such rule, already there, bad policy)."""

    code = ErrorCode.BAD_REQUEST


@dataclass(frozen=True, slots=True, kw_only=True)
class RuleChange:
    """One change to one policy's plain-language review rules."""

    policy: str  # the policy file's path, as runs name it (their policySource)
    action: RuleAction
    text: str
    added_by: str | None = None

    def describe(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "action": str(self.action),
            "rule": self.text,
            "addedBy": self.added_by,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Applied:
    change: RuleChange
    before: str  # rule-set hashes
    after: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Pending:
    confirmation_id: str
    change: RuleChange


class RuleBook:
    """The live review section of every policy file this daemon's runs use."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        # Per policy file (its real path): its review rules as last read, and the file's
        # identity then. Review rules are live: a change through gatewayd or an edit by
        # hand reaches every run of the policy at its next reviewed call.
        self._live: dict[str, tuple[ReviewSection, RuleSet, tuple[int, int, int]]] = {}
        # Per policy file: when (on ``clock``) its identity was last looked at.
        self._looked: dict[str, float] = {}
        self._real: dict[str, str] = {}
        self._pending: dict[str, RuleChange] = {}
        self._clock = clock

    def current(
        self, policy: str, loaded: ReviewSection, *, max_age_s: float = 0.0
    ) -> tuple[ReviewSection, RuleSet]:
        """The review rules of ``policy`` now: the file's, re-read when it changed (one
        stat per call otherwise). A file that cannot be read or no longer validates keeps
        the rules last read (or, never read, those the run ``loaded``).

        ``max_age_s``: the rules as last read may be returned without a look at the file
        when that look was at most this long ago (0, the default: look now)."""
        key = self._real.get(policy)
        if key is None:
            key = self._real.setdefault(policy, _key(policy))
        live = self._live.get(key)
        now = self._clock()
        if live is not None and max_age_s > 0 and now - self._looked[key] <= max_age_s:
            return live[0], live[1]
        identity = _identity(key)
        if live is not None and live[2] == identity:
            self._looked[key] = now
            return live[0], live[1]
        try:
            section = _review_of(_read_policy(key), key)
        except RuleChangeError:
            return (live[0], live[1]) if live is not None else (loaded, _ruleset(loaded))
        ruleset = _ruleset(section)
        self._live[key] = (section, ruleset, identity)
        self._looked[key] = now
        return section, ruleset

    def request(self, change: RuleChange) -> Planned | Pending:
        """Plan a tightening change (apply it with :meth:`commit`, once audited); park a
        loosening one for confirmation.

        Error handling: :class:`RuleChangeError` when the rule to remove is not there,
        the rule to add already is, or the policy cannot be read or changed.
        """
        change = replace(change, policy=_key(change.policy), text=change.text.strip())
        if change.action.loosens:
            self._check(change)
            if len(self._pending) >= MAX_PENDING:
                raise RuleChangeError(
                    f"{MAX_PENDING} rule changes already wait for confirmation; confirm or "
                    "cancel some first"
                )
            confirmation_id = secrets.token_hex(CONFIRMATION_ID_BYTES)
            self._pending[confirmation_id] = change
            return Pending(confirmation_id=confirmation_id, change=change)
        return self._plan(change)

    def confirm(self, confirmation_id: str) -> Planned:
        """Plan a pending loosening change (checked again: the rules may have moved on);
        apply it with :meth:`commit`.

        Error handling: :class:`RuleChangeError` for an unknown id, or as ``request``.
        """
        change = self._pending.pop(confirmation_id, None)
        if change is None:
            raise RuleChangeError(
                f"no pending rule change {confirmation_id!r}; list them with GET /v1/rules/pending"
            )
        return self._plan(change)

    def cancel(self, confirmation_id: str) -> RuleChange:
        change = self._pending.pop(confirmation_id, None)
        if change is None:
            raise RuleChangeError(f"no pending rule change {confirmation_id!r}")
        return change

    def pending(self) -> dict[str, RuleChange]:
        return dict(self._pending)

    def commit(self, planned: Planned) -> Applied:
        """Write the planned policy file and make its rules live. Call it once the change
        is audited (durable before its effect).

        Error handling: :class:`RuleChangeError` when the file cannot be written (or was
        changed since the plan); the old file and rules stay then.
        """
        path = Path(planned.change.policy)
        if _identity(planned.change.policy) != planned.file_identity:
            raise RuleChangeError(
                f"{path} changed since this rule change was planned; ask for it again"
            )
        try:
            write_atomically(path, planned.text.encode(), path.stat().st_mode & 0o777)
        except OSError as exc:
            raise RuleChangeError(f"cannot write {path}: {exc.strerror}") from None
        ruleset = _ruleset(planned.section)
        self._live[planned.change.policy] = (
            planned.section,
            ruleset,
            _identity(planned.change.policy),
        )
        self._looked[planned.change.policy] = self._clock()
        return Applied(change=planned.change, before=planned.before, after=ruleset.digest)

    def _check(self, change: RuleChange) -> dict[str, Any]:
        raw = _read_policy(change.policy)
        section = _review_of(raw, change.policy)
        rules = section.rules.deny if change.action.side == "deny" else section.rules.allow
        present = any(rule.text == change.text for rule in rules)
        if change.action.adds and present:
            raise RuleChangeError(
                f"the {change.action.side} rule is already there: {change.text!r}"
            )
        if not change.action.adds and not present:
            texts = "; ".join(repr(rule.text) for rule in rules) or "none"
            raise RuleChangeError(
                f"no {change.action.side} rule {change.text!r} in {change.policy}; its "
                f"{change.action.side} rules: {texts}"
            )
        return raw

    def _plan(self, change: RuleChange) -> Planned:
        identity = _identity(change.policy)
        raw = self._check(change)
        before = _ruleset(_review_of(raw, change.policy)).digest
        text = yaml.safe_dump(_edited(raw, change), sort_keys=False, allow_unicode=True)
        try:
            policy = load_policy_text(text, change.policy)
        except PolicyError as exc:
            raise RuleChangeError(f"the changed policy would not load: {exc}") from None
        after = _ruleset(policy.review).digest
        return Planned(
            change=change,
            text=text,
            section=policy.review,
            before=before,
            after=after,
            file_identity=identity,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Planned:
    """A change checked and rendered, not yet written: audit it, then commit it."""

    change: RuleChange
    text: str
    section: ReviewSection
    before: str
    after: str
    file_identity: tuple[int, int, int]


def _key(policy: str) -> str:
    """One name per policy file, however it was spelled (relative, with symlinks)."""
    return os.path.realpath(policy)


def _identity(path: str) -> tuple[int, int, int]:
    try:
        st = os.stat(path)
    except OSError:
        return (0, 0, 0)
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _ruleset(section: ReviewSection) -> RuleSet:
    return RuleSet.from_section(section)


def _read_policy(path: str) -> dict[str, Any]:
    """The policy file parsed as gatewayd loads policies (size cap, strict YAML)."""
    try:
        return read_policy_mapping(Path(path))
    except PolicyError as exc:
        raise RuleChangeError(f"cannot read policy {path}: {exc}") from None


def _review_of(raw: Mapping[str, Any], source: str) -> ReviewSection:
    """The review section of a parsed policy, validated as part of the whole policy: a
    file that would not load as a policy gives no rules either."""
    try:
        return validate_policy(raw, source).review
    except PolicyError as exc:
        raise RuleChangeError(f"the policy does not validate: {exc}") from None


def _edited(raw: dict[str, Any], change: RuleChange) -> dict[str, Any]:
    review = dict(raw.get("review") or {})
    rules = dict(review.get("rules") or {})
    side = list(rules.get(change.action.side) or [])
    text = change.text.strip()
    if change.action.adds:
        entry: Any = {"text": text, "addedBy": change.added_by} if change.added_by else text
        side.append(entry)
    else:
        side = [rule for rule in side if _rule_text(rule) != text]
    rules[change.action.side] = side
    review["rules"] = rules
    return {**raw, "review": review}


def _rule_text(rule: Any) -> str:
    if isinstance(rule, str):
        return rule.strip()
    if isinstance(rule, dict):
        return str(rule.get("text", "")).strip()
    return ""
