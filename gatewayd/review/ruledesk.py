"""The rule desk: where the operator reads and changes a policy's review rules, through
the control socket only (no run socket reaches it).

A tightening change is applied at once; a loosening one waits for a confirmation
(invariant LOOSENING_NEEDS_CONFIRMATION, :mod:`gatewayd.review.rulebook`). Every step is
audited, and the ``rule_changed`` entry is durable before the change takes effect.
"""

from __future__ import annotations

from typing import Any

import structlog

from gatewayd.audit import AuditEvent, AuditLog
from gatewayd.policy.review_section import ReviewSection
from gatewayd.policy.rule_action import RuleAction
from gatewayd.policyfile import PolicyLoader
from gatewayd.protocol import ErrorCode
from gatewayd.review.rulebook import (
    Applied,
    Pending,
    Planned,
    RuleBook,
    RuleChange,
    RuleChangeError,
)
from gatewayd.review.ruleset import RuleSet

log = structlog.get_logger("gatewayd.review.ruledesk")


class RuleDesk:
    """Reads and changes the review rules of the policies ``policies`` finds by name, in
    ``book`` (the rules every run's reviewed call reads), with ``audit`` recording each
    step."""

    def __init__(self, book: RuleBook, *, policies: PolicyLoader, audit: AuditLog) -> None:
        self.book = book
        self._policies = policies
        self._audit = audit

    def current(self, policy_name: str) -> tuple[str, ReviewSection, RuleSet]:
        """The review rules of the policy called ``policy_name`` now: (its file, its
        review section, the rule set's hash).

        Error handling: PolicyError for an unknown policy."""
        policy, source = self._policies.by_name(policy_name)
        section, rules = self.book.current(source, policy.review)
        return source, section, rules

    def pending(self) -> dict[str, RuleChange]:
        """Loosening changes waiting for confirmation, by confirmation id."""
        return self.book.pending()

    async def change(
        self, policy_name: str, action: RuleAction, text: str, added_by: str | None
    ) -> Applied | Pending:
        """Tighten at once, or park a loosening change for confirmation; audited, and
        the audit entry is durable before the change takes effect.

        Error handling: PolicyError for an unknown policy; RuleChangeError for a change
        that cannot be made (the message says why and what the rules are).
        """
        _, source = self._policies.by_name(policy_name)
        change = RuleChange(policy=source, action=action, text=text, added_by=added_by)
        outcome = self.book.request(change)
        if isinstance(outcome, Pending):
            await self._audit.append(
                "event",
                event=AuditEvent.RULE_CHANGE_PENDING,
                detail={"confirmationId": outcome.confirmation_id, **outcome.change.describe()},
            )
            return outcome
        return await self._commit(outcome, confirmation_id=None)

    async def confirm(self, confirmation_id: str) -> Applied:
        """Apply a pending loosening change (the confirmation from outside the sandbox).

        Error handling: RuleChangeError for an unknown id or a change that can no longer
        be made (audited as ``rule_change_failed`` when it was pending)."""
        change = self.book.pending().get(confirmation_id)
        try:
            planned = self.book.confirm(confirmation_id)
        except RuleChangeError as exc:
            if change is not None:  # it was pending: its end is on the record
                await self._audit.append(
                    "event",
                    event=AuditEvent.RULE_CHANGE_FAILED,
                    errorCode=str(ErrorCode.BAD_REQUEST),
                    safeMessage=str(exc),
                    detail={"confirmationId": confirmation_id, **change.describe()},
                )
            raise
        return await self._commit(planned, confirmation_id=confirmation_id)

    async def cancel(self, confirmation_id: str) -> RuleChange:
        """Drop a pending change; audited.

        Error handling: RuleChangeError for an unknown id."""
        change = self.book.cancel(confirmation_id)
        await self._audit.append(
            "event",
            event=AuditEvent.RULE_CHANGE_CANCELLED,
            detail={"confirmationId": confirmation_id, **change.describe()},
        )
        return change

    async def _commit(self, planned: Planned, *, confirmation_id: str | None) -> Applied:
        detail: dict[str, Any] = {
            **planned.change.describe(),
            "rulesetBefore": planned.before,
            "rulesetAfter": planned.after,
        }
        if confirmation_id is not None:
            detail["confirmationId"] = confirmation_id
        await self._audit.append("event", event=AuditEvent.RULE_CHANGED, detail=detail)
        try:
            applied = self.book.commit(planned)
        except RuleChangeError as exc:
            await self._audit.append(
                "event",
                event=AuditEvent.RULE_CHANGE_FAILED,
                errorCode=str(ErrorCode.BAD_REQUEST),
                safeMessage=str(exc),
                detail=detail,
            )
            raise
        log.info("rule_changed", **planned.change.describe())
        return applied
