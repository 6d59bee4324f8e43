"""The policy's ``approvals`` section: which calls wait for a person's approval, and how
long (reference note 003: approvals are a UX layer, apart from the sandbox and the
tools; an approval never grants anything).

```yaml
approvals:
  required:
    - tool: sandbox.exec                      # exact, family ("fs.*"), prefix ("app_*") or "*"
      args: {command: '\\bgit\\s+push\\b'}    # optional: argument name -> regex (re.search)
      reason: pushes leave this machine        # optional: shown to the operator
    - tool: fs.write
  timeout_s: 300                               # nobody answered by then: denied
```

A call needs approval when some entry's ``tool`` matches its tool and every one of the
entry's ``args`` patterns finds a match (``re.search``) in that argument, read as the tool
will use it (defaults filled in): a string as it is, a list of strings joined with single
spaces (``["git", "push"]`` reads ``git push``), any other value as its canonical JSON.
An argument the call does not have (or null) matches no pattern: that entry does not ask.

Approval gates what the policy already allows and nothing else: a call the policy or the
review refuses is refused before anyone is asked, and an approved call runs with exactly
the rights it would have had anyway. The patterns are the operator's convenience, not a
boundary (a command can be spelt many ways): where a call must never run unseen, require
approval for the whole tool.

Only the models and the pure matching live here; the waiting is :mod:`gatewayd.approvals`'.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Final

from pydantic import Field

from gatewayd.policy.review_section import ArgName, Pattern, ToolGlob, tool_glob_matches
from gatewayd.policy.section import Section, StrictStr

if TYPE_CHECKING:
    import msgspec

# A person answers in minutes; five of them leave time to read the call without letting
# an agent sit blocked for long when nobody is there.
DEFAULT_APPROVAL_TIMEOUT_S: Final = 300.0
# An hour: a call still unanswered by then has nobody watching it, and the agent (and
# its connection, and its run's wall time) should move on instead of waiting longer.
MAX_APPROVAL_TIMEOUT_S: Final = 3600.0
# Entries and patterns per entry: an approval list is a handful of risky calls; hundreds
# would be a policy written by a program, and each is matched on every call.
MAX_APPROVAL_RULES: Final = 64
MAX_ARG_PATTERNS: Final = 16
# What the operator is shown as the entry's reason (a sentence).
MAX_APPROVAL_REASON_CHARS: Final = 500


@functools.cache
def _canonical() -> msgspec.json.Encoder:
    """The encoder of a non-text argument, made at its first use: a daemon has msgspec
    (the wire's codec) loaded by then, and `gatewayd policy check` never gets here."""
    import msgspec

    return msgspec.json.Encoder(order="sorted")


class ApprovalRule(Section):
    """One kind of call that waits for approval: ``tool`` and every ``args`` pattern."""

    tool: ToolGlob
    args: Annotated[dict[ArgName, Pattern], Field(max_length=MAX_ARG_PATTERNS)] = Field(
        default_factory=dict
    )
    reason: Annotated[StrictStr, Field(max_length=MAX_APPROVAL_REASON_CHARS)] = ""


class ApprovalsSection(Section):
    """Calls that wait for the operator's approval (none by default)."""

    required: Annotated[tuple[ApprovalRule, ...], Field(max_length=MAX_APPROVAL_RULES)] = ()
    timeout_s: Annotated[
        float, Field(strict=True, gt=0, le=MAX_APPROVAL_TIMEOUT_S, allow_inf_nan=False)
    ] = DEFAULT_APPROVAL_TIMEOUT_S


@dataclass(frozen=True, slots=True)
class RequiredApproval:
    """Why a call waits: the first matching entry (``index`` counts from 1, as the
    operator reads the file) and the section's timeout."""

    index: int
    rule: ApprovalRule
    timeout_s: float

    def describe(self) -> dict[str, Any]:
        """The entry as the audit log and the operator see it."""
        return {
            "index": self.index,
            "tool": self.rule.tool,
            "args": dict(self.rule.args),
            "reason": self.rule.reason,
        }


def argument_text(value: Any) -> str | None:
    """An argument as the patterns read it (None: absent, so no pattern matches)."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list | tuple) and all(isinstance(item, str) for item in value):
        return " ".join(value)
    return _canonical().encode(value).decode()


def required_approval(
    section: ApprovalsSection, tool: str, args: Mapping[str, Any]
) -> RequiredApproval | None:
    """The first entry of ``section`` that makes a call of ``tool`` with ``args`` wait for
    approval, or None. ``args``: the arguments as the tool will use them."""
    for index, rule in enumerate(section.required, 1):
        if not tool_glob_matches(rule.tool, tool):
            continue
        if all(_found(pattern, args.get(name)) for name, pattern in rule.args.items()):
            return RequiredApproval(index=index, rule=rule, timeout_s=section.timeout_s)
    return None


def _found(pattern: str, value: Any) -> bool:
    text = argument_text(value)
    # re caches compiled patterns; the section's patterns were compiled when validated.
    return text is not None and re.search(pattern, text) is not None
