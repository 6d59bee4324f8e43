"""A host-owned model conversation whose tool calls go through the chokepoint.

The model is offered ``read``, ``write``, ``edit``, ``list`` and ``exec``; each call it
makes becomes one request to the run's :class:`~gatewayd.dispatch.Dispatcher`, exactly
as if ``cogni-tool`` had sent it (allowlist, policy, review, audit; exec runs in the
run's sandbox). The conversation stops at its limits (turns, tokens, wall time, and
optionally tool calls) with a :class:`ConversationStop` naming the limit, and keeps
what the model said last, so a stopped conversation still has a partial answer.

Two front doors use it: an agent run (:mod:`gatewayd.agent.conversation`: a coding
task in a repository) and an app's invocation (:mod:`gatewayd.apps.invoke`: the app's
system prompt, its folder as the base of relative paths, its caller's model budget).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgspec
import trio

from gatewayd import model_client, strictjson
from gatewayd.audit import AuditLog
from gatewayd.audit.entry import Peer
from gatewayd.audit.events import AuditEvent
from gatewayd.config import ModelAlias
from gatewayd.dispatch import Dispatcher
from gatewayd.model_client import ModelCallError
from gatewayd.protocol import PROTOCOL_VERSION, Request, Response
from gatewayd.runs import ModelBudget, Run
from gatewayd.tools.manifest import ToolManifest
from gatewayd.tools.registry import ToolRegistry

# The model's tool names and the gateway tools they are (one dispatch path for both).
TOOL_MAP: Final[Mapping[str, str]] = {
    "read": "fs.read",
    "write": "fs.write",
    "edit": "fs.edit",
    "list": "fs.list",
    "exec": "sandbox.exec",
}
# A conversation's run may call these and nothing else, whatever else its policy allows.
RUN_TOOL_IDS: Final = tuple(TOOL_MAP.values())
# One tool result, as the model sees it: enough for a test run's tail, not a flood.
MAX_TOOL_RESULT_CHARS: Final = 32_000
# Tool calls run per answer; more are refused (the conversation is held in memory).
MAX_CALLS_PER_TURN: Final = 32
# The largest answer asked for per turn (the token limit may ask for less).
MAX_TURN_COMPLETION_TOKENS: Final = 8192
# Why a conversation stopped: a wall time limit, gatewayd or the model failing, another
# limit, or a model budget (its caller's) spent.
StopCode = Literal["timeout", "internal", "task_failed", "rate_limited", "cancelled"]
# The fs tools whose ``path`` argument is rebased when the conversation has a base.
_PATH_TOOLS: Final = frozenset({"read", "write", "edit", "list"})
# What model providers take as a function's name (OpenAI's and Anthropic's rule:
# [a-zA-Z0-9_-], at most 64). Gateway names have dots (mcp.time.get_current_time):
# each becomes a hyphen, which no gateway name holds, so two tools never share a name.
MAX_FUNCTION_NAME_CHARS: Final = 64
# A longer name keeps its start and ends in a digest of the whole, this long.
_NAME_DIGEST_CHARS: Final = 8


def function_name(tool: str) -> str:
    """The name the model calls the gateway tool ``tool`` by: ``app_x`` stays as it is,
    ``mcp.time.now`` is ``mcp-time-now``; one over MAX_FUNCTION_NAME_CHARS is cut and
    ends in a digest of the whole name."""
    name = tool.replace(".", "-")
    if len(name) <= MAX_FUNCTION_NAME_CHARS:
        return name
    digest = hashlib.sha256(tool.encode()).hexdigest()[:_NAME_DIGEST_CHARS]
    return f"{name[: MAX_FUNCTION_NAME_CHARS - _NAME_DIGEST_CHARS - 1]}-{digest}"


@dataclass(frozen=True, slots=True, kw_only=True)
class ConversationLimits:
    """What one conversation may use; the first limit reached stops it. ``tool_calls``:
    None for no limit of its own (each turn still runs at most MAX_CALLS_PER_TURN)."""

    turns: int
    tokens: int
    wall_s: float
    tool_calls: int | None = None

    def __post_init__(self) -> None:
        if self.turns < 1 or self.tokens < 1 or not self.wall_s > 0:
            raise ValueError("conversation limits must be positive: turns, tokens, wall seconds")
        if self.tool_calls is not None and self.tool_calls < 1:
            raise ValueError("a tool call limit must be at least 1")


@dataclass(frozen=True, slots=True, kw_only=True)
class LimitHints:
    """How to raise each limit, said to whoever reads a stop (an operator's flag, an
    APP.md field)."""

    turns: str
    tokens: str
    wall: str
    tool_calls: str = ""


class ConversationStop(Exception):
    """The conversation ends early: a limit (``limit`` names it: turns, tokens,
    wall_time, tool_calls, model_budget), or the model cannot go on (``limit`` None)."""

    def __init__(self, code: StopCode, message: str, *, limit: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.limit = limit


def tool_definitions(
    tools: ToolRegistry, extra: Sequence[ToolManifest] = ()
) -> list[dict[str, Any]]:
    """The five tools, then each of ``extra`` (a run's apps and MCP tools) by its
    :func:`function_name`, as OpenAI function definitions, their parameters the gateway
    tools' own argument schemas (one source of truth for what a call may carry)."""
    named = [(name, tools[tool].manifest) for name, tool in TOOL_MAP.items()]
    named += [(function_name(manifest.name), manifest) for manifest in extra]
    return [_function(name, manifest) for name, manifest in named]


def _function(name: str, manifest: ToolManifest) -> dict[str, Any]:
    schema = manifest.args_schema
    ref = schema.get("$ref", "")
    params = dict(schema.get("$defs", {}).get(ref.rsplit("/", 1)[-1], schema))
    if len(schema.get("$defs", {})) > 1:
        params["$defs"] = schema["$defs"]
    description = params.pop("description", None)
    return {
        "type": "function",
        "function": {
            "name": name,
            # An app's own summary says what it does; a built-in's Struct doc says more.
            "description": manifest.summary
            if name not in TOOL_MAP
            else description or manifest.summary,
            "parameters": params,
        },
    }


class Conversation:
    """One model loop: turns, tool calls through ``dispatcher`` on ``run``, limits.

    ``alias``/``alias_name``: the model; ``system``/``prompt``: the first two messages;
    ``audit`` records each turn and each call refused before it became a request;
    ``extra``: tools offered besides the five (the apps and MCP tools a run may call),
    each by its :func:`function_name`;
    ``path_base``: where a relative ``path`` of the fs tools starts (None: the workspace,
    dispatch's own default); ``budget``: a model budget charged with every turn besides
    the limits (an app's caller's); ``call_prefix``: the tool call ids' prefix.
    """

    def __init__(
        self,
        *,
        dispatcher: Dispatcher,
        audit: AuditLog,
        alias: ModelAlias,
        alias_name: str,
        run: Run,
        system: str,
        prompt: str,
        limits: ConversationLimits,
        hints: LimitHints,
        say: Callable[[str], None],
        path_base: str | None = None,
        budget: ModelBudget | None = None,
        call_prefix: str = "agent",
        extra: Sequence[ToolManifest] = (),
    ) -> None:
        self.dispatcher = dispatcher
        self.audit = audit
        self.alias = alias
        self.alias_name = alias_name
        self.run = run
        self.limits = limits
        self.hints = hints
        self.say = say
        self.path_base = path_base
        self.budget = budget
        self.call_prefix = call_prefix
        self.turns = 0
        self.tokens = 0
        self.tool_calls = 0
        self.oom_killed = False
        self.final_text: str | None = None
        # What the model said last (with or without tool calls): a stopped
        # conversation's partial answer.
        self.last_text = ""
        self.peer = Peer(pid=os.getpid(), uid=os.getuid(), gid=os.getgid())
        self.tools = tool_definitions(dispatcher.tools, extra)
        # The model's name of each extra tool, and the gateway tool it is.
        self.extra = {function_name(manifest.name): manifest.name for manifest in extra}
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": system},
            {"role": "user", "content": prompt},
        ]

    async def go(self) -> None:
        """Converse until the model answers without a tool call (``final_text``).

        Error handling: ConversationStop at a limit or when the model call fails."""
        limits, hints = self.limits, self.hints
        alias = self.alias
        deadline = trio.current_time() + limits.wall_s
        while True:
            if self.turns >= limits.turns:
                raise ConversationStop(
                    "task_failed",
                    f"the turn limit ({limits.turns}) was reached before the model "
                    f"finished; {hints.turns}",
                    limit="turns",
                )
            if self.tokens >= limits.tokens:
                raise ConversationStop(
                    "task_failed",
                    f"the token limit ({limits.tokens}) was spent ({self.tokens} "
                    f"tokens) before the model finished; {hints.tokens}",
                    limit="tokens",
                )
            spent = self.budget.spent() if self.budget is not None else None
            if spent is not None:
                raise ConversationStop("rate_limited", spent, limit="model_budget")
            self.turns += 1
            remaining = max(deadline - trio.current_time(), 0.001)
            asked = min(MAX_TURN_COMPLETION_TOKENS, limits.tokens - self.tokens)
            if self.budget is not None:
                asked = max(min(asked, self.budget.max_tokens - self.budget.tokens), 1)
            try:
                answer = await model_client.complete(
                    alias,
                    self.messages,
                    tools=self.tools,
                    timeout_s=min(remaining, alias.timeout_s),
                    max_tokens=asked,
                    alias_name=self.alias_name,
                )
            except ModelCallError as exc:
                if exc.kind is model_client.ModelCallKind.TIMEOUT and remaining < alias.timeout_s:
                    raise ConversationStop(
                        "timeout",
                        f"the wall time limit ({limits.wall_s:g} s) passed during a model "
                        f"call; {hints.wall}",
                        limit="wall_time",
                    ) from None
                raise ConversationStop(
                    "internal", f"the model call failed ({exc.kind}): {exc}"
                ) from None
            if answer.prompt_tokens is None and answer.completion_tokens is None:
                used = asked  # no usage reported: charge the most the answer could be
            else:  # a provider's negative count must not give tokens back
                used = max(answer.prompt_tokens or 0, 0) + max(answer.completion_tokens or 0, 0)
            self.tokens += used
            if self.budget is not None:
                self.budget.requests += 1
                self.budget.tokens += used
            if answer.text:
                self.last_text = answer.text
            await self.audit.append(
                "event",
                event=AuditEvent.AGENT_TURN,
                runId=self.run.run_id,
                detail={
                    "turn": self.turns,
                    "model": self.alias_name,
                    "promptTokens": answer.prompt_tokens,
                    "completionTokens": answer.completion_tokens,
                    "finishReason": answer.finish_reason,
                    "toolCalls": [call.name[:64] for call in answer.tool_calls],
                    "textBytes": len(answer.text.encode()),
                    "textDigest": "sha256:" + hashlib.sha256(answer.text.encode()).hexdigest(),
                },
            )
            if not answer.tool_calls:
                self.say(f"turn {self.turns}: the model finished ({self.tokens} tokens)")
                self.final_text = answer.text
                return
            self.messages.append(_assistant_message(answer))
            for n, call in enumerate(answer.tool_calls):
                if n >= MAX_CALLS_PER_TURN:
                    content = await self._refuse(
                        call,
                        f"turn {self.turns}: {call.name[:32]}",
                        f"at most {MAX_CALLS_PER_TURN} tool calls are run per answer; "
                        "ask for the rest in the next one",
                    )
                elif limits.tool_calls is not None and self.tool_calls >= limits.tool_calls:
                    raise ConversationStop(
                        "task_failed",
                        f"the tool call limit ({limits.tool_calls}) was reached before the "
                        f"model finished; {hints.tool_calls}",
                        limit="tool_calls",
                    )
                else:
                    self.tool_calls += 1
                    content = await self._call(call, n)
                self.messages.append({"role": "tool", "tool_call_id": call.id, "content": content})

    async def _call(self, call: model_client.ToolCall, n: int) -> str:
        """One tool call, through the dispatcher; returns what the model is told."""
        tool = TOOL_MAP.get(call.name) or self.extra.get(call.name)
        where = f"turn {self.turns}: {call.name[:32]}"
        if tool is None:
            names = ", ".join((*TOOL_MAP, *sorted(self.extra)))
            return await self._refuse(
                call, where, f"there is no tool {call.name[:64]!r}; the tools are {names}"
            )
        try:
            # The model's text, under the same JSON discipline as a frame on the socket.
            args = strictjson.loads(call.arguments or "{}")
        except strictjson.JsonInputError as exc:
            return await self._refuse(
                call, where, f"the arguments are not a JSON object ({exc}); send them as one"
            )
        if not isinstance(args, dict):
            return await self._refuse(
                call, where, "the arguments are not a JSON object; send them as one"
            )
        if self.path_base is not None and call.name in _PATH_TOOLS:
            args = rebase_path(args, self.path_base, listing=call.name == "list")
        request = Request(
            v=PROTOCOL_VERSION,
            runId=self.run.run_id,
            toolCallId=f"{self.call_prefix}.t{self.turns}.{n}",
            tool=tool,
            args=args,
        )
        response = await self.dispatcher.handle(self.run, request, self.peer)
        self.say(f"{where} {_brief(args)} -> {_verdict(response)}")
        if not response.ok:
            return json.dumps({"error": str(response.errorCode), "message": response.safeMessage})
        text = _raw_text(response.value)
        if tool == "sandbox.exec" and '"errorCode":"oom_killed"' in text.replace(" ", ""):
            self.oom_killed = True
        if len(text) > MAX_TOOL_RESULT_CHARS:
            text = text[:MAX_TOOL_RESULT_CHARS] + f"... [cut: {len(text)} characters in all]"
        return text

    async def _refuse(self, call: model_client.ToolCall, where: str, why: str) -> str:
        """A call that never became a request (no such tool, arguments not an object):
        audited as an event, and the model is told why."""
        await self.audit.append(
            "event",
            event=AuditEvent.AGENT_CALL_REFUSED,
            runId=self.run.run_id,
            detail={"turn": self.turns, "tool": call.name[:64], "reason": why},
        )
        self.say(f"{where} -> refused: {why}")
        return json.dumps({"error": "bad_request", "message": why})


def rebase_path(args: dict[str, Any], base: str, *, listing: bool = False) -> dict[str, Any]:
    """``args`` with a relative ``path`` made absolute beneath ``base`` (and, for a
    ``listing``, a missing one: it lists ``base``). Only the start changes: ``..`` and the
    rest are the policy step's to judge, lexically, as for any path."""
    path = args.get("path")
    if path is None and listing:
        return {**args, "path": base}
    if isinstance(path, str) and not path.startswith("/"):
        return {**args, "path": f"{base}/{path}" if path else base}
    return args


def _assistant_message(answer: model_client.Completion) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": answer.text or None,
        "tool_calls": [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in answer.tool_calls
        ],
    }


def _raw_text(value: Any) -> str:
    if isinstance(value, msgspec.Raw):
        return bytes(value).decode("utf-8", "replace")
    return json.dumps(value)


def _brief(args: Mapping[str, Any]) -> str:
    """The call's main argument for the progress line."""
    for key in ("command", "path"):
        value = args.get(key)
        if isinstance(value, str):
            text = value if len(value) <= 60 else value[:57] + "..."
            return json.dumps(text)
    return ""


def _verdict(response: Response) -> str:
    if not response.ok:
        return f"denied ({response.errorCode})"
    text = _raw_text(response.value)
    if text.startswith('{"exitCode":'):
        with contextlib.suppress(ValueError):
            value = json.loads(text)
            suffix = f", {value['errorCode']}" if value.get("errorCode") else ""
            return f"allowed (exit {value['exitCode']}{suffix})"
    return "allowed"
