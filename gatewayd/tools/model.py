"""``model.chat``: a model conversation served on the host, so the sandbox reaches a model
without any key or route of its own.

OpenAI-style messages and parameters in; a normalized answer out. The model is named by
one of gatewayd's aliases (its configuration file: provider, model, endpoint, the *name*
of the key's variable); a run may use only the aliases its policy's ``model_access``
grants, within the run's budget of requests and tokens. Both are the policy step's
decision (the call requests its alias: :mod:`gatewayd.policy.capabilities`); the runner
charges what the call spends. The key is read on the host at call time and scrubbed from
every error (gatewayd/model_client.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

import msgspec
import structlog

from gatewayd.errors import RateLimited, ToolFailed
from gatewayd.model_client import ModelCallError, ModelCallKind, complete
from gatewayd.policy.capabilities import ANY, Capabilities, CapabilityRequest, budget_refusal
from gatewayd.tools.builtin import builtin_tool
from gatewayd.tools.registry import Tool, ToolContext

log = structlog.get_logger("gatewayd.tools.model")

# Bounds of one request: a conversation, not a document dump (the frame limit applies too).
MAX_MESSAGES: Final = 256
MAX_CONTENT_CHARS: Final = 1_000_000
MAX_COMPLETION_TOKENS: Final = 32_768
# A model call may take long; the call's own timeout (limits.call_timeout_s) also applies.
DEFAULT_CHAT_TIMEOUT_S: Final = 120.0


class ChatMessage(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One message of the conversation."""

    role: Annotated[Literal["system", "user", "assistant"], msgspec.Meta(description="who speaks")]
    content: Annotated[
        str, msgspec.Meta(max_length=MAX_CONTENT_CHARS, description="the message's text")
    ]


class ChatArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Ask a model: the alias, the messages, and the usual knobs."""

    model: Annotated[
        str,
        msgspec.Meta(
            min_length=1, max_length=64, description="a model alias the run's policy grants"
        ),
    ]
    messages: Annotated[
        list[ChatMessage],
        msgspec.Meta(
            min_length=1, max_length=MAX_MESSAGES, description="the conversation, oldest first"
        ),
    ]
    max_tokens: Annotated[
        Annotated[int, msgspec.Meta(ge=1, le=MAX_COMPLETION_TOKENS)] | None,
        msgspec.Meta(description="longest answer, in tokens (default: the provider's)"),
    ] = None
    temperature: Annotated[
        Annotated[float, msgspec.Meta(ge=0, le=2)] | None,
        msgspec.Meta(description="sampling temperature (default: the provider's)"),
    ] = None


def chat_request(args: ChatArgs) -> CapabilityRequest:
    """A chat asks for its model alias: the policy step checks the grant and the budget."""
    return CapabilityRequest(models=(args.model,))


async def run_chat(args: ChatArgs, ctx: ToolContext) -> dict[str, Any]:
    """``{"model", "content", "usage": {"promptTokens", "completionTokens"}}``.

    Error handling: ToolFailed for an alias gatewayd does not configure and for a
    provider error (its kind and a keyless message); RateLimited when calls running
    beside this one spent the budget after the policy step allowed it.
    """
    alias = ctx.models.get(args.model)
    if alias is None:
        raise ToolFailed(
            f"model {args.model!r} is granted by the policy but gatewayd has no such alias; "
            "ask the operator to configure it"
        )
    # The policy step found the budget not spent, but calls of the run run side by side:
    # the request is taken here, with no await between the look and the take, so the
    # run never makes more requests than max_requests.
    budget = ctx.model_budget
    spent = budget_refusal(budget)
    if budget is None or spent is not None:
        raise RateLimited(spent or "this run has no model budget")
    budget.requests += 1
    try:
        answer = await complete(
            alias,
            [{"role": m.role, "content": m.content} for m in args.messages],
            timeout_s=DEFAULT_CHAT_TIMEOUT_S,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            alias_name=args.model,
        )
    except ModelCallError as exc:
        # The endpoint, the key's variable and credential path are the host's business:
        # the operator's log has the whole message, the sandbox what it can act on.
        event = (
            "model_key_missing" if exc.kind is ModelCallKind.MISSING_KEY else "model_call_failed"
        )
        log.warning(event, alias=args.model, run_id=ctx.run_id, kind=str(exc.kind), error=str(exc))
        raise ToolFailed(
            f"the model call failed ({exc.kind}): {exc.for_sandbox(args.model)}"
        ) from None
    budget.tokens += (answer.prompt_tokens or 0) + (answer.completion_tokens or 0)
    return {
        "model": args.model,
        "content": answer.text,
        "usage": {
            "promptTokens": answer.prompt_tokens,
            "completionTokens": answer.completion_tokens,
        },
    }


MODEL_CHAT: Tool[ChatArgs] = builtin_tool(
    name="model.chat",
    summary="Ask a model (one of the run's granted aliases) to answer OpenAI-style messages; "
    "served on the host, within the run's model budget.",
    args_type=ChatArgs,
    run=run_chat,
    requests=chat_request,
    capabilities=Capabilities(model_access=(ANY,)),
)
