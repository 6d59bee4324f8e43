"""Policies: YAML text validated into frozen models, and pure decisions over them.

Nothing in this package does I/O: reading a policy file is :mod:`gatewayd.policyfile`'s,
binding its path rules to host directories :mod:`gatewayd.hostpaths.binding`'s.

- :mod:`.model` — the policy file's models, :func:`load_policy_text`
- :mod:`.decide` — may this run call this tool on these paths? (no I/O)
- :mod:`.capabilities` — what a tool declares, what a call requests, and whether the
  run grants it: the policy step of every call, whatever runs its tool
- :mod:`.network` — may this run reach this scheme, method, host, port and address?
- :mod:`.rate` — the per-run token bucket (clock passed in)
- :mod:`.summary` — the human summary behind ``gatewayd policy check``
- :mod:`.paths` — the grant and path types shared with the tools
"""

from gatewayd.policy.decide import (
    Allow,
    Decision,
    Deny,
    RunRules,
    allowed_tools,
    check_path,
    check_read_size,
    decide,
    resolve_path,
    tool_allowed,
    tool_matches,
    unmatched_patterns,
)
from gatewayd.policy.model import (
    EnvSection,
    FilesystemSection,
    Limits,
    PathRule,
    Policy,
    PolicyError,
    SandboxSection,
    ToolsSection,
    load_policy_text,
)
from gatewayd.policy.paths import (
    WORKSPACE_VISIBLE_ROOT,
    Access,
    PathAccess,
    PathGrant,
    PathMode,
    ResolvedPath,
)
from gatewayd.policy.rate import TokenBucket
from gatewayd.policy.summary import summarize

__all__ = [
    "WORKSPACE_VISIBLE_ROOT",
    "Access",
    "Allow",
    "Decision",
    "Deny",
    "EnvSection",
    "FilesystemSection",
    "Limits",
    "PathAccess",
    "PathGrant",
    "PathMode",
    "PathRule",
    "Policy",
    "PolicyError",
    "ResolvedPath",
    "RunRules",
    "SandboxSection",
    "TokenBucket",
    "ToolsSection",
    "allowed_tools",
    "check_path",
    "check_read_size",
    "decide",
    "load_policy_text",
    "resolve_path",
    "summarize",
    "tool_allowed",
    "tool_matches",
    "unmatched_patterns",
]
