"""The model conversation of an agent run: the model is offered ``read``, ``write``,
``edit``, ``list`` and ``exec``, and each call it makes becomes one request to the run's
:class:`~gatewayd.dispatch.Dispatcher`, exactly as if ``cogni-tool`` had sent it
(allowlist, policy, review, audit; exec runs in the run's sandbox). Limits: turns, tokens,
wall time.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Mapping
from typing import Any, Final

import msgspec
import trio

from gatewayd import model_client, strictjson
from gatewayd.agent.task import AgentTask, ErrorCodeName
from gatewayd.audit import AuditLog
from gatewayd.audit.entry import Peer
from gatewayd.audit.events import AuditEvent
from gatewayd.config import ModelAlias
from gatewayd.dispatch import Dispatcher
from gatewayd.model_client import ModelCallError
from gatewayd.protocol import PROTOCOL_VERSION, Request, Response
from gatewayd.runs import Run
from gatewayd.tools.registry import ToolRegistry

# The model's tool names and the gateway tools they are (one dispatch path for both).
TOOL_MAP: Final[Mapping[str, str]] = {
    "read": "fs.read",
    "write": "fs.write",
    "edit": "fs.edit",
    "list": "fs.list",
    "exec": "sandbox.exec",
}
# A run may call these and nothing else, whatever else its policy allows.
RUN_TOOL_IDS: Final = tuple(TOOL_MAP.values())
# One tool result, as the model sees it: enough for a test run's tail, not a flood.
MAX_TOOL_RESULT_CHARS: Final = 32_000
# Tool calls run per answer; more are refused (the conversation is held in memory).
MAX_CALLS_PER_TURN: Final = 32
# The largest answer asked for per turn (the token limit may ask for less).
MAX_TURN_COMPLETION_TOKENS: Final = 8192

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


class AgentStop(Exception):
    """The loop ends early: a limit, or the model cannot go on."""

    def __init__(self, code: ErrorCodeName, message: str) -> None:
        super().__init__(message)
        self.code = code


def tool_definitions(tools: ToolRegistry) -> list[dict[str, Any]]:
    """The five tools as OpenAI function definitions, their parameters the gateway
    tools' own argument schemas (one source of truth for what a call may carry)."""
    out = []
    for name, tool in TOOL_MAP.items():
        manifest = tools[tool].manifest
        schema = manifest.args_schema
        ref = schema.get("$ref", "")
        params = dict(schema.get("$defs", {}).get(ref.rsplit("/", 1)[-1], schema))
        if len(schema.get("$defs", {})) > 1:
            params["$defs"] = schema["$defs"]
        out.append(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": params.pop("description", manifest.summary),
                    "parameters": params,
                },
            }
        )
    return out


class Conversation:
    """One run's model loop: turns, tool calls through ``dispatcher``, limits; ``alias``
    is the task's model, ``audit`` records each turn and each call refused before it
    became a request."""

    def __init__(
        self,
        *,
        dispatcher: Dispatcher,
        audit: AuditLog,
        alias: ModelAlias,
        run: Run,
        task: AgentTask,
        say: Callable[[str], None],
    ) -> None:
        self.dispatcher = dispatcher
        self.audit = audit
        self.alias = alias
        self.run = run
        self.task = task
        self.say = say
        self.turns = 0
        self.tokens = 0
        self.oom_killed = False
        self.final_text: str | None = None
        self.peer = Peer(pid=os.getpid(), uid=os.getuid(), gid=os.getgid())
        self.tools = tool_definitions(dispatcher.tools)
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": task.task},
        ]

    async def go(self) -> None:
        limits = self.task.limits
        alias = self.alias
        deadline = trio.current_time() + limits.max_wall_s
        while True:
            if self.turns >= limits.max_turns:
                raise AgentStop(
                    "task_failed",
                    f"the turn limit ({limits.max_turns}) was reached before the model "
                    "finished; raise --max-turns or narrow the task",
                )
            if self.tokens >= limits.max_tokens:
                raise AgentStop(
                    "task_failed",
                    f"the token limit ({limits.max_tokens}) was spent ({self.tokens} "
                    "tokens) before the model finished; raise --max-tokens",
                )
            self.turns += 1
            remaining = max(deadline - trio.current_time(), 0.001)
            asked = min(MAX_TURN_COMPLETION_TOKENS, limits.max_tokens - self.tokens)
            try:
                answer = await model_client.complete(
                    alias,
                    self.messages,
                    tools=self.tools,
                    timeout_s=min(remaining, alias.timeout_s),
                    max_tokens=asked,
                    alias_name=self.task.model,
                )
            except ModelCallError as exc:
                if exc.kind is model_client.ModelCallKind.TIMEOUT and remaining < alias.timeout_s:
                    raise AgentStop(
                        "timeout",
                        f"the wall time limit ({limits.max_wall_s:g} s) passed during a model "
                        "call; raise --max-wall-s",
                    ) from None
                raise AgentStop("internal", f"the model call failed ({exc.kind}): {exc}") from None
            if answer.prompt_tokens is None and answer.completion_tokens is None:
                used = asked  # no usage reported: charge the most the answer could be
            else:  # a provider's negative count must not give tokens back
                used = max(answer.prompt_tokens or 0, 0) + max(answer.completion_tokens or 0, 0)
            self.tokens += used
            await self.audit.append(
                "event",
                event=AuditEvent.AGENT_TURN,
                runId=self.run.run_id,
                detail={
                    "turn": self.turns,
                    "model": self.task.model,
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
                else:
                    content = await self._call(call, n)
                self.messages.append({"role": "tool", "tool_call_id": call.id, "content": content})

    async def _call(self, call: model_client.ToolCall, n: int) -> str:
        """One tool call, through the dispatcher; returns what the model is told."""
        tool = TOOL_MAP.get(call.name)
        where = f"turn {self.turns}: {call.name[:32]}"
        if tool is None:
            return await self._refuse(
                call,
                where,
                f"there is no tool {call.name[:64]!r}; the tools are {', '.join(TOOL_MAP)}",
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
        request = Request(
            v=PROTOCOL_VERSION,
            runId=self.run.run_id,
            toolCallId=f"agent.t{self.turns}.{n}",
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
