"""Which in-sandbox services a run gets (gatewayd/runs/services.py, ``services_for``),
decided from its policy, its tool ids and the tools this gatewayd has, without a sandbox:
the OpenAI endpoint only for a run that may call model.chat with an alias, the egress
proxy only for a policy that turns it on and allows a domain."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Final

import pytest
import trio

from gatewayd.policy import RunRules, TokenBucket, load_policy_text
from gatewayd.runs import Run, RunRequest, RunSpec
from gatewayd.runs.services import services_for
from gatewayd.sandbox.plan import Services

RUN_ID: Final = "0123456789abcdef0123456789abcdef"
MODELS: Final = "model_access: {models: [r]}\n"
CHAT: Final = "tools: {allow: [model.chat]}\n"
PROXY: Final = "network: {allow_domains: [example.org], proxy: {enabled: true}}\n"
EVERY_TOOL: Final = frozenset({"model.chat", "time.now"})

# (case, policy sections, the run's tool ids, the tools gatewayd has, the services)
CASES: Final = [
    ("nothing asked", "", None, EVERY_TOOL, Services()),
    ("model.chat and an alias", CHAT + MODELS, None, EVERY_TOOL, Services(model_endpoint=True)),
    ("an alias, model.chat not allowed", MODELS, None, EVERY_TOOL, Services()),
    ("model.chat allowed, no alias", CHAT, None, EVERY_TOOL, Services()),
    ("model.chat not among the run's tool ids", CHAT + MODELS, ("time.now",), EVERY_TOOL,
     Services()),
    ("this gatewayd has no model.chat", CHAT + MODELS, None, frozenset({"time.now"}),
     Services()),
    ("the proxy on, a domain allowed", PROXY, None, EVERY_TOOL, Services(egress_proxy=True)),
    ("the proxy on, no domain", "network: {proxy: {enabled: true}}\n", None, EVERY_TOOL,
     Services()),
    ("a domain, the proxy off", "network: {allow_domains: [example.org]}\n", None, EVERY_TOOL,
     Services()),
    ("both", CHAT + MODELS + PROXY, None, EVERY_TOOL,
     Services(model_endpoint=True, egress_proxy=True)),
]  # fmt: skip


def run_with(sections: str, tool_ids: tuple[str, ...] | None) -> Run:
    """A run (no directory, no socket: neither is made) under a policy of ``sections``."""
    text = "version: 1\nname: services\n" + textwrap.dedent(sections)
    policy = load_policy_text(text, "services.yaml")
    spec = RunSpec(
        runId=RUN_ID,
        request=RunRequest(
            workspacePath="/nonexistent/ws", policy=policy.name, actorId="a", tenantId="t"
        ),
        workspace=Path("/nonexistent/ws"),
        policy=policy,
        policy_source="services.yaml",
        grants=(),
        rules=RunRules(tool_patterns=tuple(policy.tools.allow), run_tool_ids=tool_ids, grants=()),
    )
    return Run(
        spec=spec,
        directory=Path("/nonexistent/run"),
        socket_path=Path("/nonexistent/run/gateway.sock"),
        bucket=TokenBucket(rate=1, burst=1),
        limiter=trio.CapacityLimiter(1),
    )


@pytest.mark.parametrize(
    ("sections", "tool_ids", "tools", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_a_run_gets_the_services_its_policy_and_tools_give_it(
    sections: str,
    tool_ids: tuple[str, ...] | None,
    tools: frozenset[str],
    expected: Services,
) -> None:
    assert services_for(run_with(sections, tool_ids), tools) == expected
