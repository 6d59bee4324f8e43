"""gatewayd's one way to call a model: one chat completion through litellm.

The rule reviewer uses it now and the ``model.chat`` tool will later. A
:class:`~gatewayd.config.ModelAlias` says where to go; :func:`complete` goes there once
(no retries: the caller decides, and a review must fail closed fast) and returns a
:class:`Completion` or raises :class:`ModelCallError`: the answer and every failure are
normalized here, whatever the provider sent.

litellm is imported lazily (:func:`preload` pays for it once at daemon start), and every
reply is read under the alias's ``max_reply_bytes``: both in :mod:`gatewayd.model_transport`,
which (with httpx) is itself imported with litellm, in a worker thread, so that a daemon
or a command that calls no model does not load it.

Secrets: the key is read at each call from the environment variable ``alias.api_key_env``,
else from the systemd credential of that name (gatewayd/secrets.py), handed to litellm for
that call only, and scrubbed (in every encoding gatewayd.secrets covers) from every error
message and from the answer's text. litellm itself keeps its HTTP clients (and so the
key) in an in-memory cache between calls.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import json
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit, urlunsplit

import trio

from gatewayd import strictjson
from gatewayd.config import ModelAlias
from gatewayd.errors import GatewayError
from gatewayd.protocol import ErrorCode
from gatewayd.secrets import MIN_SCRUB_CHARS, REDACTION_PREFIX, SecretError, read_secret, redact

# trio waits this long past litellm's own timeout before abandoning the call: litellm's
# timeout bounds each connect and each read, not the whole answer, so a provider that
# trickles its answer needs an outer bound; the grace lets litellm's cleaner error win.
TIMEOUT_GRACE_S: Final = 1.0
# Provider text quoted in an error is cut to this: enough to say what was wrong, and
# the message may reach the sandbox, so never a dump of the provider's answer.
MAX_PROVIDER_TEXT_CHARS: Final = 300
# What a key quoted back in a message starts with: "[REDACTED:<its variable>]".
REDACTED: Final = REDACTION_PREFIX
# The key sent when an alias names no key variable (keyless local endpoints). Without an
# explicit key litellm falls back to ambient variables such as OPENAI_API_KEY, and would
# send the host's key to whatever api_base the alias names.
KEYLESS_PLACEHOLDER: Final = "no-key"
# Bound on the __cause__/__context__ chain walked to classify an error.
MAX_CAUSE_CHAIN: Final = 32
# An error body is parsed for its message only up to this size: a provider's error is a
# sentence, and a body of megabytes (the reply cap allows 8 MiB) is quoted, not parsed,
# so explaining a failure costs neither the memory nor the time of a document.
MAX_ERROR_BODY_CHARS: Final = 64 << 10
# A usage count above this is no count (no model's context is near it) and is read as
# "not reported"; JSON readers of the audit log (JavaScript, jq) hold integers exactly
# only up to 2**53 - 1.
MAX_REPORTED_TOKENS: Final = (1 << 53) - 1
# litellm quotes a Python traceback (host paths of gatewayd's install) in some messages;
# the quoted text stops where it starts.
_TRACEBACK_MARK: Final = "Traceback (most recent call last)"
# "litellm.RateLimitError: RateLimitError: OpenAIException - " before the provider's text.
_LITELLM_PREFIX_RE: Final = re.compile(
    r"^(?:litellm\.\w+:\s*)?(?:\w+Error:\s*)?(?:\w+Exception\s*-\s*)?"
)


class ModelCallKind(enum.StrEnum):
    """What went wrong with a model call, for callers that act on it (and for the log)."""

    TIMEOUT = "timeout"  # no complete answer in time
    CONNECTION = "connection"  # refused, unreachable, or the connection broke
    AUTH = "auth"  # HTTP 401/403: the key was refused
    RATE_LIMITED = "rate_limited"  # HTTP 429
    BAD_REQUEST = "bad_request"  # other 4xx, or litellm refused the request before sending
    PROVIDER_ERROR = "provider_error"  # 5xx, or litellm failed in a way we do not know
    MALFORMED = "malformed"  # an answer came back but is not a readable chat completion
    MISSING_KEY = "missing_key"  # the alias's key is in neither gatewayd's env nor a credential
    TOO_LARGE = "too_large"  # the reply passed the alias's max_reply_bytes: not read further


class ModelCallError(GatewayError):
    """A model call failed; ``kind`` says how, ``str(exc)`` is safe to show anyone.

    The message names the alias and endpoint and says what to do; it never contains
    the key (it is scrubbed from any provider text quoted) nor an endpoint's userinfo.
    """

    code = ErrorCode.TOOL_FAILED

    def __init__(self, kind: ModelCallKind, message: str, *, where: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.where = where  # the prefix naming the alias and its endpoint

    def for_sandbox(self, alias_name: str) -> str:
        """The message for a sandbox: the alias by name only, no endpoint, variable or
        credential path (the operator's business; gatewayd's log has the full text)."""
        name = f"model alias {alias_name!r}"
        if self.kind is ModelCallKind.MISSING_KEY:
            return f"{name} has no key on the host; gatewayd's operator must provide it"
        if self.kind is ModelCallKind.AUTH:
            return f"{name}: the provider refused gatewayd's key; gatewayd's operator must fix it"
        text = str(self)
        if self.where is not None and text.startswith(self.where):
            return name + text[len(self.where) :]
        return f"{name}: the call failed ({self.kind})"


@dataclass(frozen=True, slots=True, kw_only=True)
class Completion:
    """One model answer.

    ``prompt_tokens`` and ``completion_tokens`` are None when the provider reported no
    usage (litellm reports a missing usage as zeros, so zeros read as None too).
    ``latency_ms`` is the call itself, not litellm's import.
    """

    text: str
    model: str
    prompt_tokens: int | None
    completion_tokens: int | None
    latency_ms: float
    # Only when the request offered ``tools``: the calls the model asked for, in order.
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCall:
    """One function call a model asked for; ``arguments`` is the JSON text it wrote
    (unparsed: a model may write invalid JSON, and the caller says so to the model)."""

    id: str
    name: str
    arguments: str


# litellm once :func:`preload` has imported it (empty: not yet).
_LITELLM: Final[list[Any]] = []


def is_loaded() -> bool:
    """Whether litellm is imported already (then :func:`preload` is a no-op)."""
    return bool(_LITELLM)


def preload() -> Any:
    """Import and configure litellm now (seconds, once per process), with
    :mod:`gatewayd.model_transport` and httpx; returns it.

    Blocking: run it in a thread at daemon start (``trio.to_thread.run_sync(preload)``)
    so the first review does not pay for the import. :func:`complete` works without it.
    """
    from gatewayd.model_transport import LITELLM

    _LITELLM[:] = [LITELLM.get()]  # the same module, whichever thread asked first
    return _LITELLM[0]


async def complete(
    alias: ModelAlias,
    messages: Sequence[Mapping[str, Any]],
    *,
    timeout_s: float,
    max_tokens: int | None = None,
    temperature: float | None = 0,
    alias_name: str | None = None,
    limiter: trio.CapacityLimiter | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> Completion:
    """Ask ``alias`` for one chat completion of ``messages``, once.

    The call may take ``min(timeout_s, alias.timeout_s)``: litellm is given that
    timeout, and trio abandons the call shortly after it in any case. ``temperature``
    or ``max_tokens`` None leaves the provider's default. ``alias_name`` (the alias's
    name in the configuration) is only used to name the alias in errors. ``limiter``:
    the worker-thread pool the call runs in (default: trio's shared one).

    Resource handling: litellm's blocking call runs in a worker thread; if the caller
    is cancelled or the outer deadline passes, the thread is abandoned and ends at
    litellm's own timeout. The first call imports litellm (in a thread, not counted
    against the timeout) unless :func:`preload` ran.

    Error handling: :class:`ModelCallError` for every failure of the call, with a
    ``kind`` and a message that is safe to show and free of the key; a reply past the
    alias's ``max_reply_bytes`` is ``too_large`` (read no further than the cap). Whatever
    the provider sends (any body, success or error, any shape, any nesting) ends as a
    ModelCallError: nothing else a reply could provoke (a RecursionError, a MemoryError,
    a KeyError in litellm or here) leaves this function, and a string of the answer that
    is not text (a lone UTF-16 surrogate) is ``malformed``.
    ValueError for a timeout that is not a positive number (a caller's bug).
    """
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds, not {timeout_s!r}")
    where = _describe(alias, alias_name)
    key = _read_key(alias, where)
    limit_s = min(timeout_s, alias.timeout_s)
    request: dict[str, Any] = {
        "model": alias.litellm_model,
        "messages": [dict(message) for message in messages],
        "api_key": key,
        "timeout": limit_s,
        "num_retries": 0,  # litellm's own retry loop
        "max_retries": 0,  # the OpenAI SDK's (it retries twice by default)
    }
    if alias.api_base is not None:
        request["api_base"] = alias.api_base
    if max_tokens is not None:
        request["max_tokens"] = max_tokens
    if temperature is not None:
        request["temperature"] = temperature
    if tools:
        request["tools"] = [dict(tool) for tool in tools]
        # litellm (1.7x+) looks for MCP tools in any tool list, importing its proxy's
        # MCP server (and the optional `mcp` package, not installed); ours are plain
        # functions, and gatewayd is no proxy.
        request["_skip_mcp_handler"] = True

    litellm = _LITELLM[0] if _LITELLM else await trio.to_thread.run_sync(preload)
    from gatewayd.model_transport import completion_without_success_logging  # loaded: preload

    started = time.perf_counter()
    try:
        with trio.fail_after(limit_s + TIMEOUT_GRACE_S):
            response = await trio.to_thread.run_sync(
                functools.partial(
                    completion_without_success_logging, litellm, request, alias.max_reply_bytes
                ),
                abandon_on_cancel=True,
                limiter=limiter,
            )
    except trio.TooSlowError:
        raise ModelCallError(
            ModelCallKind.TIMEOUT, _timeout_message(where, limit_s), where=where
        ) from None
    except Exception as exc:  # anything litellm raises becomes one safe, keyless error
        kind, message = _explain_safely(litellm, exc, alias, where, limit_s)
        # from None: the original's text may hold the key, and tracebacks print it.
        raise ModelCallError(kind, _scrub(message, key, alias.api_key_env), where=where) from None
    latency_ms = (time.perf_counter() - started) * 1000.0
    try:
        completion = _read_completion(response, alias, where, latency_ms)
    except ModelCallError:
        raise
    except Exception as exc:  # an answer of a shape neither litellm nor gatewayd expects
        raise ModelCallError(
            ModelCallKind.MALFORMED,
            f"{where}: the answer is not a readable chat completion ({type(exc).__name__} "
            "while reading it); check that the endpoint speaks the OpenAI-compatible chat API",
            where=where,
        ) from None
    if alias.api_key_env is not None and len(key) >= MIN_SCRUB_CHARS:
        # The key this call sent, out of its answer: the daemon's scrubber re-reads
        # keys once a second, and a key rotated within that second must not leak.
        # Tool call arguments too: they become file contents and commands in the sandbox.
        env = alias.api_key_env
        text = redact(completion.text, env, key)
        calls = tuple(
            dataclasses.replace(call, arguments=redact(call.arguments, env, key))
            for call in completion.tool_calls
        )
        if text is not completion.text or calls != completion.tool_calls:
            completion = dataclasses.replace(completion, text=text, tool_calls=calls)
    return completion


# --- inputs --------------------------------------------------------------------------


def _describe(alias: ModelAlias, alias_name: str | None) -> str:
    """How errors name the alias: model, endpoint without userinfo or query."""
    if alias.api_base is None:
        endpoint = f"{alias.provider}'s default endpoint"
    else:
        parts = urlsplit(alias.api_base)
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"  # an IPv6 literal
        netloc = f"{host}:{parts.port}" if parts.port is not None else host
        endpoint = urlunsplit((parts.scheme, netloc, parts.path, "", ""))
    described = f"{alias.litellm_model} at {endpoint}"
    return f"model alias {alias_name!r} ({described})" if alias_name else f"model {described}"


def _read_key(alias: ModelAlias, where: str) -> str:
    if alias.api_key_env is None:
        return KEYLESS_PLACEHOLDER
    try:
        return read_secret(alias.api_key_env, holds="its key").value
    except SecretError as exc:  # names the variable and the credential file, never a value
        raise ModelCallError(ModelCallKind.MISSING_KEY, f"{where}: {exc}", where=where) from None


def _scrub(text: str, key: str, name: str | None) -> str:
    """``text`` without the key just sent, in any encoding gatewayd.secrets covers.

    The exact key of this call is scrubbed whatever its length (unlike the daemon-wide
    scrubber's minimum): this message is about that key, so every mention of it goes.
    """
    if name is None or key == KEYLESS_PLACEHOLDER:
        return text
    return redact(text, name, key)


def _cap(text: str) -> str:
    text = " ".join(text.split())
    if len(text) <= MAX_PROVIDER_TEXT_CHARS:
        return text
    return text[: MAX_PROVIDER_TEXT_CHARS - 3] + "..."


# --- the answer ----------------------------------------------------------------------


def _read_completion(response: Any, alias: ModelAlias, where: str, latency_ms: float) -> Completion:
    try:
        choice = response.choices[0]
        content = choice.message.content
    except (AttributeError, IndexError, TypeError):
        content = None
        choice = None
    tool_calls = _tool_calls(choice, where)
    if content is None and tool_calls:
        content = ""
    if not isinstance(content, str):
        reason = getattr(choice, "finish_reason", None)
        raise ModelCallError(
            ModelCallKind.MALFORMED,
            f"{where}: the answer has no text content (finish_reason {reason!r}); "
            "the model gave no text, or the endpoint is not a chat completion API",
            where=where,
        )
    usage = getattr(response, "usage", None)
    prompt_tokens = _tokens(usage, "prompt_tokens")
    completion_tokens = _tokens(usage, "completion_tokens")
    if not prompt_tokens and not completion_tokens:
        prompt_tokens = completion_tokens = None  # litellm's stand-in for "not reported"
    model = getattr(response, "model", None)
    finish_reason = getattr(choice, "finish_reason", None)
    completion = Completion(
        text=content,
        model=model if isinstance(model, str) and model else alias.model,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        latency_ms=latency_ms,
        tool_calls=tool_calls,
        finish_reason=finish_reason if isinstance(finish_reason, str) else None,
    )
    _require_text(completion, where)
    return completion


def _require_text(completion: Completion, where: str) -> None:
    """Refuse an answer with a string that is not text: JSON's ``"\\ud800"`` decodes to a
    lone surrogate no UTF-8 encoder can write, so the answer could reach neither the
    sandbox (the reply frame) nor the audit log (the entry naming it)."""
    strings = [completion.text, completion.model, completion.finish_reason or ""]
    for call in completion.tool_calls:
        strings += (call.id, call.name, call.arguments)
    for value in strings:
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ModelCallError(
                    ModelCallKind.MALFORMED,
                    f"{where}: the answer holds a lone UTF-16 surrogate escape "
                    "(\\ud800-\\udfff), which is not text; check the endpoint",
                    where=where,
                ) from None


def _tool_calls(choice: Any, where: str) -> tuple[ToolCall, ...]:
    """The answer's function calls; a call without an id or a name is malformed."""
    raw = getattr(getattr(choice, "message", None), "tool_calls", None) or ()
    calls = []
    for item in raw:
        function = getattr(item, "function", None)
        name = getattr(function, "name", None)
        call_id = getattr(item, "id", None)
        arguments = getattr(function, "arguments", None)
        if not (isinstance(name, str) and name and isinstance(call_id, str) and call_id):
            raise ModelCallError(
                ModelCallKind.MALFORMED,
                f"{where}: the answer holds a tool call without an id or a function name",
                where=where,
            )
        calls.append(
            ToolCall(
                id=call_id, name=name, arguments=arguments if isinstance(arguments, str) else ""
            )
        )
    return tuple(calls)


def _tokens(usage: Any, field: str) -> int | None:
    """A usage count, or None when it is absent or no count (not an integer, negative,
    past MAX_REPORTED_TOKENS): a budget is never given tokens back by a provider."""
    value = getattr(usage, field, None)
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    return value if 0 <= value <= MAX_REPORTED_TOKENS else None


# --- errors --------------------------------------------------------------------------


def _timeout_message(where: str, limit_s: float) -> str:
    return (
        f"{where}: no answer within {limit_s:g} s; the provider is slow or overloaded. "
        "Retry later, or raise the timeout if it is too tight for this model"
    )


def _explain_safely(
    litellm: Any, exc: Exception, alias: ModelAlias, where: str, limit_s: float
) -> tuple[ModelCallKind, str]:
    """:func:`_explain`, or a plain ``provider_error`` when explaining fails too: the
    evidence is the provider's reply, and no reply may turn a failed call into an
    exception of another type (it would escape the caller's handling)."""
    try:
        return _explain(litellm, exc, alias, where, limit_s)
    except Exception as failure:
        return ModelCallKind.PROVIDER_ERROR, (
            f"{where}: the provider failed ({type(exc).__name__}), and its reply could not "
            f"be read to say why ({type(failure).__name__}); retry later, and check the "
            "endpoint if it persists"
        )


def _explain(
    litellm: Any, exc: Exception, alias: ModelAlias, where: str, limit_s: float
) -> tuple[ModelCallKind, str]:
    """The kind of ``exc`` and the sentence for it (not yet scrubbed)."""
    kind, status, detail = _classify(litellm, exc)
    http = f"HTTP {status}" if status is not None else "no HTTP status"
    quoted = f"{http}: {detail}" if detail else http
    match kind:
        case ModelCallKind.TIMEOUT:
            return kind, _timeout_message(where, limit_s)
        case ModelCallKind.TOO_LARGE:
            return kind, (
                f"{where}: the provider's reply passed the cap of {alias.max_reply_bytes} "
                "bytes (the alias's max_reply_bytes), so gatewayd stopped reading it and "
                "the call failed; check the endpoint, or raise max_reply_bytes in "
                "gatewayd's configuration if this model's replies really are that large"
            )
        case ModelCallKind.CONNECTION:
            return kind, (
                f"{where}: could not reach the provider ({detail}); check that the "
                "endpoint is up and reachable from the gatewayd host"
            )
        case ModelCallKind.AUTH:
            # The provider's text is left out: some quote a masked part of the key.
            source = (
                f"the environment variable {alias.api_key_env} (or the systemd credential "
                "of that name) holds a valid key"
                if alias.api_key_env
                else "the alias needs a key: set api_key_env in gatewayd's configuration"
            )
            return kind, f"{where}: the provider refused the key ({http}); check that {source}"
        case ModelCallKind.RATE_LIMITED:
            return kind, (
                f"{where}: the provider is rate limiting ({quoted}); wait before calling again"
            )
        case ModelCallKind.BAD_REQUEST:
            return kind, (
                f"{where}: the provider refused the request ({quoted}); check the alias's "
                "model name and the request's size and parameters"
            )
        case ModelCallKind.MALFORMED:
            return kind, (
                f"{where}: the answer is not a readable chat completion ({detail}); check "
                "that the endpoint speaks the OpenAI-compatible chat API"
            )
        case _:
            return kind, f"{where}: the provider failed ({quoted}); retry later"


def _classify(litellm: Any, exc: Exception) -> tuple[ModelCallKind, int | None, str]:
    """Kind, HTTP status and provider detail, from the evidence in the cause chain.

    litellm's own exception classes are not reliable here (it reports an HTTP 500 as
    BadRequestError, a dropped connection as InternalServerError, and an answer it could
    not parse as APIConnectionError), so the chain is searched for what actually
    happened: a reply over the cap or in a coding gatewayd cannot read, a timeout, an HTTP
    status, a broken transport, an unparsable body - in that order.
    """
    import httpx  # loaded with litellm, as the model transport is

    from gatewayd.model_transport import ReplyTooLarge

    openai: Any = importlib.import_module("openai")
    links = _cause_chain(exc)
    # First: the SDK and litellm wrap it as a connection error, which it is not.
    if any(isinstance(link, ReplyTooLarge) for link in links):
        return ModelCallKind.TOO_LARGE, None, ""
    for link in links:
        if isinstance(link, httpx.DecodingError):
            return ModelCallKind.MALFORMED, None, _cap(str(link))
    timeouts = (litellm.Timeout, openai.APITimeoutError, httpx.TimeoutException, TimeoutError)
    if any(isinstance(link, timeouts) for link in links):
        return ModelCallKind.TIMEOUT, None, ""
    for link in links:
        if isinstance(link, httpx.HTTPStatusError):
            status = link.response.status_code
            return _kind_for_status(status), status, _provider_text(link.response)
    # The transport's own errors, not the SDK's or litellm's APIConnectionError: litellm
    # raises that one for an answer it could not parse too.
    broken = [link for link in links if isinstance(link, (httpx.TransportError, OSError))]
    if broken:
        return ModelCallKind.CONNECTION, None, _cap(str(broken[-1]) or type(broken[-1]).__name__)
    for link in links:
        if isinstance(link, json.JSONDecodeError):
            return ModelCallKind.MALFORMED, None, f"not JSON: {link.msg} at character {link.pos}"
        if isinstance(link, RecursionError):
            return ModelCallKind.MALFORMED, None, "the answer nests too deeply to be parsed"
        if isinstance(link, MemoryError):
            return ModelCallKind.MALFORMED, None, "parsing the answer ran out of memory"
    readers = (
        litellm.InternalServerError,
        litellm.APIError,
        litellm.APIResponseValidationError,
        openai.APIConnectionError,  # with no transport error in its chain (above)
    )
    if isinstance(exc, readers):  # litellm wraps "could not read the answer" like this
        return ModelCallKind.MALFORMED, None, _litellm_text(exc)
    reported = getattr(exc, "status_code", None)
    if isinstance(reported, int) and isinstance(exc, openai.OpenAIError):
        return _kind_for_status(reported), reported, _litellm_text(exc)
    return ModelCallKind.PROVIDER_ERROR, None, f"{type(exc).__name__}: {_litellm_text(exc)}"


def _kind_for_status(status: int) -> ModelCallKind:
    if status in {401, 403}:
        return ModelCallKind.AUTH
    if status == 429:
        return ModelCallKind.RATE_LIMITED
    if status == 408:
        return ModelCallKind.TIMEOUT
    if 400 <= status < 500:
        return ModelCallKind.BAD_REQUEST
    return ModelCallKind.PROVIDER_ERROR


def _cause_chain(exc: BaseException) -> list[BaseException]:
    links: list[BaseException] = []
    link: BaseException | None = exc
    while link is not None and len(links) < MAX_CAUSE_CHAIN and link not in links:
        links.append(link)
        link = link.__cause__ or link.__context__
    return links


def _provider_text(response: Any) -> str:
    """The ``error.message`` of an OpenAI-style error body, else the body's start.

    The body is parsed under gatewayd's JSON discipline (gatewayd/strictjson.py: no
    nesting deep enough to exhaust the parser), and only when it is small enough to be an
    error's sentence (MAX_ERROR_BODY_CHARS)."""
    try:
        text = str(response.text)
    except Exception:  # a streamed body not read, or not decodable: say nothing
        return ""
    if len(text) > MAX_ERROR_BODY_CHARS:
        return _cap(text)
    try:
        body = strictjson.loads(text)
    except strictjson.JsonInputError:
        return _cap(text)
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else error
    return _cap(message if isinstance(message, str) else text)


def _litellm_text(exc: BaseException) -> str:
    text = _LITELLM_PREFIX_RE.sub("", str(exc), count=1)
    return _cap(text.split(_TRACEBACK_MARK, 1)[0].strip() or type(exc).__name__)
