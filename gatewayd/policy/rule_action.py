"""The four changes to a set of plain-language allow and deny rules, and which of them
loosen it.

| action | what it does | |
| --- | --- | --- |
| ``add_deny`` | add a deny rule | tightens: applied at once |
| ``remove_allow`` | remove an allow rule | tightens: applied at once |
| ``add_allow`` | add an allow rule | loosens: only once confirmed |
| ``remove_deny`` | remove a deny rule | loosens: only once confirmed |

Invariant LOOSENING_NEEDS_CONFIRMATION: a loosening change needs a confirmation from
outside the sandbox. A policy's review rules (:mod:`gatewayd.review.rulebook`) and an
app's rules (:mod:`gatewayd.apps.rulechange`) are changed by the same four actions and
held to the same asymmetry. Pure: no I/O.
"""

from __future__ import annotations

import enum


class RuleAction(enum.StrEnum):
    ADD_DENY = "add_deny"
    REMOVE_ALLOW = "remove_allow"
    ADD_ALLOW = "add_allow"
    REMOVE_DENY = "remove_deny"

    @property
    def loosens(self) -> bool:
        return self in (RuleAction.ADD_ALLOW, RuleAction.REMOVE_DENY)

    @property
    def side(self) -> str:
        return "deny" if self in (RuleAction.ADD_DENY, RuleAction.REMOVE_DENY) else "allow"

    @property
    def adds(self) -> bool:
        return self in (RuleAction.ADD_DENY, RuleAction.ADD_ALLOW)
