"""The built-in tools' capabilities are decided in the policy step, before the rule review:
a model alias the run is not granted, a spent model budget, a host off the allowlist and a
command in a run without an OS sandbox are refused there, audited as refused calls, and
never reviewed (so they cost no review model call) nor run.

Through the Dispatcher with the real built-in tools, the fake audit log and reviewer of
tests/unit/test_dispatch.py, and no sockets.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import pytest
from trio.testing import MockClock

from gatewayd.config import ModelAlias
from gatewayd.errors import RateLimited
from gatewayd.policy import RunRules, load_policy_text
from gatewayd.protocol import ErrorCode
from gatewayd.runs import ModelBudget, Run
from gatewayd.tools import builtin_tools
from gatewayd.tools.model import MODEL_CHAT, ChatArgs, ChatMessage
from gatewayd.tools.registry import ToolContext
from tests.unit.test_dispatch import (
    ALLOW,
    PEER,
    REVIEWER_ALIAS,
    FakeAuditLog,
    FakeReviewer,
    call,
    make_dispatcher,
    make_run,
)

POLICY: Final = f"""
version: 1
name: capabilities-unit
tools:
  allow: [model.chat, http.fetch, sandbox.exec]
require_os_sandbox: false
model_access:
  models: [assistant]
  max_requests: 2
network:
  allow_domains: [example.org]
review:
  mode: llm
  model: {REVIEWER_ALIAS}
  rules:
    deny: [Anything that looks like a credential]
"""
CHAT: Final = {"messages": [{"role": "user", "content": "hi"}]}


def spend_the_budget(run: Run) -> None:
    run.model_budget = ModelBudget(max_requests=2, max_tokens=1000, requests=2)


def nothing(_run: Run) -> None:
    pass


@dataclass(frozen=True, kw_only=True)
class Row:
    id: str
    tool: str
    args: dict[str, Any]
    code: ErrorCode
    says: str
    prepare: Any = nothing


ROWS: Final = [
    Row(
        id="model-not-granted",
        tool="model.chat",
        args={**CHAT, "model": "other"},
        code=ErrorCode.POLICY_DENIED,
        says="model 'other' is not granted to this run; models it may use: assistant",
    ),
    Row(
        id="model-budget-spent",
        tool="model.chat",
        args={**CHAT, "model": "assistant"},
        code=ErrorCode.RATE_LIMITED,
        says="this run's 2 model requests are spent (model_access.max_requests / max_tokens)",
        prepare=spend_the_budget,
    ),
    Row(
        id="host-off-the-allowlist",
        tool="http.fetch",
        args={"url": "https://evil.example/steal"},
        code=ErrorCode.POLICY_DENIED,
        says="host 'evil.example' is not allowed; allowed domains: example.org",
    ),
    Row(
        id="command-without-an-os-sandbox",
        tool="sandbox.exec",
        args={"command": "id"},
        code=ErrorCode.POLICY_DENIED,
        says="sandbox.exec runs commands only inside an OS sandbox, and this run has none "
        "(no sandbox); the file tools still work",
    ),
]


def capabilities_run(tmp_path: Path) -> Run:
    run = make_run(tmp_path)
    policy = load_policy_text(POLICY, "capabilities-unit.yaml")
    rules = RunRules(tool_patterns=policy.tools.allow, run_tool_ids=None, grants=run.spec.grants)
    run.spec = dataclasses.replace(run.spec, policy=policy, rules=rules)
    return run


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
async def test_a_capability_the_run_lacks_is_refused_before_review_and_audited(
    row: Row, tmp_path: Path, autojump_clock: MockClock
) -> None:
    log = FakeAuditLog()
    reviewer = FakeReviewer(ALLOW)
    dispatcher = make_dispatcher(log, builtin_tools(), autojump_clock, reviewer=reviewer)
    run = capabilities_run(tmp_path)
    row.prepare(run)

    response = await dispatcher.handle(run, call(row.tool, row.args), PEER)

    assert response.errorCode is row.code, response
    assert response.safeMessage is not None and response.safeMessage.startswith(row.says)
    assert reviewer.asked == []
    call_entry, result_entry = log.entries
    assert (call_entry["decision"], call_entry["errorCode"]) == ("deny", str(row.code))
    assert result_entry["errorCode"] == str(row.code)
    assert run.model_budget.requests == (2 if row.prepare is spend_the_budget else 0)


async def test_model_chat_takes_its_request_itself_and_refuses_a_budget_spent_meanwhile() -> None:
    """Calls of a run run side by side: one allowed by the policy step may find the
    budget spent by the time it runs, and then makes no model request."""
    budget = ModelBudget(max_requests=1, max_tokens=1000, requests=1)
    ctx = ToolContext(
        run_id="r",
        grants=(),
        max_output_bytes=1 << 20,
        models={"assistant": ModelAlias(provider="openai", model="fake")},
        model_budget=budget,
    )
    args = ChatArgs(model="assistant", messages=[ChatMessage(role="user", content="hi")])
    with pytest.raises(RateLimited) as caught:
        await MODEL_CHAT.runner.run(args, ctx)
    assert str(caught.value) == (
        "this run's 1 model requests are spent (model_access.max_requests / max_tokens)"
    )
    assert budget.requests == 1
