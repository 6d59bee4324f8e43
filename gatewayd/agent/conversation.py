"""The model conversation of an agent run: a coding task in a repository checked out at
/workspace, with the five tools of :mod:`gatewayd.conversation` (each call one request
to the run's dispatcher) and the agent's limits (turns, tokens, wall time).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

from gatewayd.agent.task import AgentTask
from gatewayd.audit import AuditLog
from gatewayd.config import ModelAlias
from gatewayd.conversation import (
    MAX_CALLS_PER_TURN,
    RUN_TOOL_IDS,
    TOOL_MAP,
    Conversation,
    ConversationLimits,
    ConversationStop,
    LimitHints,
)
from gatewayd.dispatch import Dispatcher
from gatewayd.runs import Run
from gatewayd.tools.manifest import ToolManifest

__all__ = [
    "MAX_CALLS_PER_TURN",
    "RUN_TOOL_IDS",
    "SYSTEM_PROMPT",
    "TOOL_MAP",
    "AgentStop",
    "agent_conversation",
]

# An agent run stops the way any conversation does.
AgentStop = ConversationStop

SYSTEM_PROMPT: Final = """\
You are a software engineer working on a git repository checked out at /workspace.
You have these tools: read (a file), write (a whole file), edit (replace one exact
occurrence in a file), list (a directory) and exec (a /bin/sh command run in /workspace
inside a sandbox with no network). Paths are relative to /workspace.
Work step by step: look at the code, change it, run the repository's tests with exec.
When the task is done, answer WITHOUT a tool call: the answer is the commit message
(a short first line, a blank line, then what you changed and why). Do not run git
commit or push; the host commits and pushes your changes.
"""

# How an operator raises each limit of `gatewayd agent run`.
AGENT_HINTS: Final = LimitHints(
    turns="raise --max-turns or narrow the task",
    tokens="raise --max-tokens",
    wall="raise --max-wall-s",
)


def agent_conversation(
    *,
    dispatcher: Dispatcher,
    audit: AuditLog,
    alias: ModelAlias,
    run: Run,
    task: AgentTask,
    say: Callable[[str], None],
    apps: Sequence[ToolManifest] = (),
) -> Conversation:
    """The conversation of the agent run ``run`` doing ``task``; ``apps``: the apps of
    its workspace and the MCP tools it may call, offered to the model by their tool
    names (dots made hyphens: :func:`gatewayd.conversation.function_name`)."""
    limits = task.limits
    return Conversation(
        dispatcher=dispatcher,
        audit=audit,
        alias=alias,
        alias_name=task.model,
        run=run,
        system=SYSTEM_PROMPT,
        prompt=task.task,
        limits=ConversationLimits(
            turns=limits.max_turns, tokens=limits.max_tokens, wall_s=limits.max_wall_s
        ),
        hints=AGENT_HINTS,
        say=say,
        extra=apps,
    )
