"""Steps 3-12 of a tool call, in one place (DESIGN.md, "Data flow of one tool call").

identify -> authorize -> rate -> validate -> policy -> review -> approval (a call the
policy marks waits for the operator: gatewayd/approvals.py) -> audit (write-ahead,
durable) -> run (with the call's time limit) -> scrub secrets -> cap output -> audit
result (durable) -> respond.

Tools come from a :class:`~gatewayd.tools.registry.ToolRegistry` whatever runs them:
each step reads the tool's manifest, decoder, capability request and runner, never its
runner kind, so a new kind of tool needs no change here. The policy step checks what
the call requests against its manifest and the run's rights
(:func:`gatewayd.policy.capabilities.check_call`).

Every call, allowed or not, leaves a ``call`` entry and a ``result`` entry in the
audit log, and by default its answer is returned only once its ``result`` entry is
durable (invariant RESULT_BEFORE_REPLY): whatever a client saw answered, the log holds
in full after a crash. Errors are values: each refusal maps to one ErrorCode with a
message that says what is allowed; exceptions never reach the socket.

The call and result entries are recorded unchecked (``AuditLog.record(checked=False)``):
every field is built here from typed values (ids the protocol checked, digests, sizes,
enums, the connection's Peer), so the entry schema's validation would only cost each
call again what cannot fail; the tests hold both paths to the same bytes.

Secrets: every value on its way out (a tool's output, every error message) passes the
scrubber here, so no configured secret (gatewayd/secrets.py) reaches the sandbox even if
a provider or tool echoes it; the audit log scrubs each entry again on its own.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import structlog
import trio

from gatewayd.approvals import ApprovalRefused, Approvals
from gatewayd.argsummary import args_digest, sha256_digest, summarize

# Who is on the other end of a connection (SO_PEERCRED at accept), as the audit records it.
from gatewayd.audit import AuditLog, AuditWriteError, Peer
from gatewayd.config import ModelAlias
from gatewayd.errors import ArgumentsRejected, GatewayError
from gatewayd.metrics import ALLOWED, DENIED, METRICS, UNKNOWN_TOOL, GatewayMetrics, ToolMeter
from gatewayd.policy import Allow, allowed_tools, tool_allowed
from gatewayd.policy.approvals_section import required_approval
from gatewayd.policy.capabilities import RunRights, check_call
from gatewayd.policy.review_section import ReviewSection
from gatewayd.protocol import (
    MAX_ID_CHARS,
    PROTOCOL_VERSION,
    ErrorCode,
    FrameError,
    Request,
    Response,
    encode_json,
    error_response,
    ok_response,
)
from gatewayd.review.reviewer import Reviewer, ReviewOutcome, Source, review_crashed
from gatewayd.review.rulebook import RuleBook
from gatewayd.review.ruleset import RuleSet
from gatewayd.runs import ModelBudget, Run
from gatewayd.secrets import Scrubber, UnscrubbableError
from gatewayd.tools.builtin import TOOLS_LIST_MANIFEST
from gatewayd.tools.manifest import ToolManifest
from gatewayd.tools.registry import (
    TOOLS_LIST,
    CallEgress,
    DuplicateToolError,
    NestedCall,
    Tool,
    ToolContext,
    ToolRegistry,
)
from gatewayd.tracing import CallSpan, Tracer

log = structlog.get_logger("gatewayd.dispatch")

# The run whose call slot the current task's call holds: a call a runner makes for
# that call (a wasm tool's model request, :meth:`Dispatcher._nested_for`) runs in the
# slot of the call it serves. Taking a second one could wait forever in a run of one
# slot (limits.max_concurrent_calls: 1), and trio's limiter refuses a borrower twice.
_SLOT_HELD: ContextVar[str | None] = ContextVar("gatewayd_slot_held", default=None)
# The span of the call the current task handles (tracing on), where its tally writes
# the verdict: the call's steps need not carry it.
_CALL_SPAN: ContextVar[CallSpan | None] = ContextVar("gatewayd_call_span", default=None)

# Whether a review applies to a call that could be answered at once (no side effect,
# no I/O: handle_now) is asked of the review rules as looked at up to this long ago,
# not of a fresh look at the policy file (a stat per call on the event loop's thread,
# and a hand-off of the interpreter to the audit flusher and back). A call that goes
# through the review step looks at the file every time (gatewayd/review/rulebook.py).
RULES_MAX_AGE_AT_ONCE_S: Final = 0.01

CANCELLED_MESSAGE: Final = "stopped before it finished: the run or gatewayd is shutting down"
WITHDRAWN_MESSAGE: Final = (
    "withdrawn while it waited for approval: the run or gatewayd is shutting down; it never ran"
)


class _Refusal(Exception):
    """Internal: a step refused the call. Carries exactly one code and a safe message."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True, kw_only=True)
class RunReview:
    """Review rules of one run's own, in place of its policy's: an app's child run is
    reviewed under the app's rules. ``rules`` is called at each call (the app's rules as
    they are now: a tightening applies at once); ``app``: the app's id, recorded with each
    review; ``subject``: how messages name it."""

    app: str
    subject: str
    rules: Callable[[], tuple[ReviewSection, RuleSet]]
    # The model budget each review the model answers is charged to (the caller's).
    budget: ModelBudget | None = None


class Answered(msgspec.Struct, frozen=True):
    """A call taken through every step without waiting (:meth:`Dispatcher.handle_now`):
    its entries are recorded, and ``response`` may leave once entry ``seq`` (its
    ``result``) is durable; :meth:`Dispatcher.release` waits for that and tallies it.
    (A Struct: one is made per call, at a tenth of a frozen dataclass's cost.)"""

    seq: int
    response: Response
    run: Run
    tool: str
    code: ErrorCode | None
    ran_s: float | None

    @property
    def call_id(self) -> str | None:
        return self.response.toolCallId


class _RunMemo:
    """What the steps derive from a run once, not at every call: which tools its policy
    allows (by name, as asked), what it may grant a call (its rights), and the parts of
    a tool's context that are the run's. Kept on the run (``Run.dispatch_memo``) and made
    again when what it was made from changes: the run's spec (a policy reload replaces
    it), its sandbox, its reason for having none, the daemon's model aliases (a
    configuration reload), or the dispatcher asking. The model budget in the rights and
    the context is the run's own live object, so what is spent counts at once."""

    __slots__ = (
        "allowed",
        "context",
        "degraded",
        "dispatcher",
        "models",
        "rights",
        "sandbox",
        "spec",
    )

    def __init__(self, dispatcher: Dispatcher, run: Run) -> None:
        self.dispatcher = dispatcher
        spec = self.spec = run.spec
        self.sandbox = run.sandbox
        self.degraded = run.degraded
        self.models = dispatcher.models
        self.allowed: dict[str, bool] = {}
        policy = spec.policy
        self.rights = RunRights(
            grants=spec.rules.grants,
            models=policy.model_access.models,
            model_budget=run.model_budget,
            network=policy.network,
            env=policy.env.allow,
            without_sandbox=None if run.sandbox is not None else run.degraded or "no sandbox",
        )
        # Every call's context is this one with the call's own fields replaced.
        self.context = ToolContext(
            run_id=run.run_id,
            grants=spec.grants,
            max_output_bytes=policy.limits.max_output_bytes,
            models=dispatcher.models,
            model_budget=run.model_budget,
            network=policy.network,
            resolve=dispatcher.resolve,
            sandbox=run.sandbox,
            degraded=run.degraded,
            env=policy.env.allow,
            model_access=policy.model_access.models,
            run=run,
            allowed_tools=lambda: allowed_tools(dispatcher.known_tools(run), run.spec.rules),
            call_egress=dispatcher.call_egress,
        )

    def tool_allowed(self, tool: str) -> bool:
        """:func:`gatewayd.policy.tool_allowed` under the run's rules, answered once per
        name (only names of tools gatewayd has are asked: a run cannot grow this)."""
        allowed = self.allowed.get(tool)
        if allowed is None:
            allowed = self.allowed[tool] = tool_allowed(tool, self.spec.rules)
        return allowed


class Dispatcher:
    """Runs tool calls for any run: the single chokepoint (invariant SINGLE_CHOKEPOINT)."""

    def __init__(
        self,
        audit: AuditLog,
        tools: ToolRegistry,
        *,
        clock: Callable[[], float] = time.monotonic,
        reviewer: Reviewer | None = None,
        rules: RuleBook | None = None,
        models: Mapping[str, ModelAlias] | None = None,
        scrubber: Scrubber | None = None,
        resolve: Callable[[str, int], Awaitable[tuple[Any, ...]]] | None = None,
        metrics: GatewayMetrics = METRICS,
        reply_after_result: bool = True,
        approvals: Approvals | None = None,
        call_egress: CallEgress | None = None,
    ) -> None:
        self.audit = audit
        # Calls the run's policy marks for a person's approval wait here (None: this
        # dispatcher asks nobody, and such a call is denied: see _approval).
        self.approvals = approvals
        # How a sandbox.exec narrowed to some domains gets its own egress proxy.
        self.call_egress = call_egress
        # True: every answer waits until its result entry is durable. False (the
        # operator's audit_reply_after_result: false): answers leave at once and the
        # result entries ride the audit log's next flush, so a crash can lose the
        # results of calls already answered (never the call entry of one that ran).
        self.reply_after_result = reply_after_result
        self.tools = tools
        self.clock = clock
        self.reviewer = reviewer
        self.rules = rules
        self.models: Mapping[str, ModelAlias] = models or {}
        self.resolve = resolve
        # Default: the keys of the models given (none given: a scrubber that does nothing).
        self.scrubber = scrubber if scrubber is not None else Scrubber.for_config(self.models)
        # Metric series held here, so counting a call is a dict lookup and an add.
        self.metrics = metrics
        self._meters = {name: metrics.tool_meter(name) for name in (TOOLS_LIST, *tools)}
        self._unknown_meter = metrics.tool_meter(UNKNOWN_TOOL)
        # Tools of one run alone (its workspace's apps, and the tools that manage them),
        # by run id: set when the run starts, dropped when it ends. A run's own tool
        # never shadows one of the daemon's (:meth:`set_run_tools` refuses the name).
        self._run_tools: dict[str, ToolRegistry] = {}
        # The same tools by where they come from ("apps", "mcp"): each source replaces
        # only its own set, and _run_tools is their union.
        self._run_sources: dict[str, dict[str, ToolRegistry]] = {}
        # Runner kinds' hints for a name no tool has (an MCP tool not pinned yet): the
        # first that says something is added to the unknown_tool message.
        self.unknown_tool_hints: list[Callable[[str], str | None]] = []
        # Runs whose calls are reviewed under rules of their own, not their policy's (an
        # app's child run: the app's rules, always, whatever the policy says).
        self._run_reviews: dict[str, RunReview] = {}
        self._denials = {code: metrics.denials.labels(str(code)) for code in ErrorCode}
        # The series of failed calls and of reviews, each looked up (labels(), slow) at
        # its first use only: made then, so the exposition holds no series before it.
        self._failures: dict[ErrorCode, Any] = {}
        self._reviews: dict[str, Any] = {}
        # The peer of the calls runners make for a call (:meth:`_nested_for`): gatewayd.
        self._own_peer = Peer(pid=os.getpid(), uid=os.getuid(), gid=os.getgid())
        # Spans of calls (None, the default: tracing is off, and a call pays one test).
        self.tracer: Tracer | None = None

    # -- the tools of one run --------------------------------------------------

    def set_run_tools(self, run_id: str, tools: ToolRegistry, *, source: str = "apps") -> None:
        """Make ``tools`` callable by the run ``run_id`` alone, as the tools of
        ``source`` (replacing what that source gave it before: a rediscovery after an
        install; the other sources' tools stay).

        Error handling: DuplicateToolError for a tool of the daemon's name, which a
        run's own tool may never shadow, or of a name another source gave the run
        (neither may shadow the other); the run's tools are then unchanged.
        """
        for name in tools:
            if name in self.tools:
                raise DuplicateToolError(
                    f"a run's own tool cannot take the name {name!r}: the daemon's tool "
                    "of that name is registered"
                )
        sources = {**self._run_sources.get(run_id, {}), source: tools}
        merged = ToolRegistry()
        origin: dict[str, str] = {}
        for name_of_source, registry in sources.items():
            for tool in registry.values():
                if tool.name in origin:
                    raise DuplicateToolError(
                        f"the run's tool {tool.name!r} comes from both {origin[tool.name]} "
                        f"and {name_of_source}; neither may shadow the other"
                    )
                origin[tool.name] = name_of_source
                merged.register(tool)
        self._run_sources[run_id] = sources
        self._run_tools[run_id] = merged

    def drop_run_tools(self, run_id: str) -> None:
        """Forget the run's own tools and review rules (it ended)."""
        self._run_tools.pop(run_id, None)
        self._run_sources.pop(run_id, None)
        self._run_reviews.pop(run_id, None)

    def set_run_review(self, run_id: str, review: RunReview) -> None:
        """Review every call of the run ``run_id`` under ``review``'s rules (read at each
        call), never its policy's: an app's child run. Set before the run serves."""
        self._run_reviews[run_id] = review

    def run_tools(self, run_id: str, source: str | None = None) -> ToolRegistry | None:
        """The run's own tools (``source``: those it gave the run), if it has any."""
        if source is not None:
            return self._run_sources.get(run_id, {}).get(source)
        return self._run_tools.get(run_id)

    def tool_for(self, run: Run, name: str) -> Tool[Any] | None:
        """The tool ``name`` as ``run`` sees it: the daemon's, else the run's own."""
        tool = self.tools.get(name)
        if tool is None:
            own = self._run_tools.get(run.run_id)
            if own is not None:
                tool = own.get(name)
        return tool

    def known_tools(self, run: Run) -> tuple[str, ...]:
        """The names of every tool ``run`` could be allowed: the daemon's and its own."""
        own = self._run_tools.get(run.run_id)
        return (*self.tools, *own) if own else tuple(self.tools)

    def _memo(self, run: Run) -> _RunMemo:
        """The run's memo (:class:`_RunMemo`), made again when what it holds changed."""
        memo: _RunMemo | None = run.dispatch_memo
        if (
            memo is None
            or memo.dispatcher is not self
            or memo.spec is not run.spec
            or memo.sandbox is not run.sandbox
            or memo.degraded is not run.degraded
            or memo.models is not self.models
        ):
            memo = run.dispatch_memo = _RunMemo(self, run)
        return memo

    def _meter(self, tool: str) -> ToolMeter:
        """A tool's series; a name not in a tool table counts as ``unknown``, so no
        name a run makes up becomes a series (a run's own tools, apps, are installed by
        an operator or a policy that allows installing)."""
        meter = self._meters.get(tool)
        if meter is None:
            if tool not in self.tools and not any(tool in t for t in self._run_tools.values()):
                return self._unknown_meter
            meter = self._meters[tool] = self.metrics.tool_meter(tool)
        return meter

    def _count_denied(self, tool: str, code: ErrorCode) -> None:
        (self._meters.get(tool) or self._meter(tool)).denied.inc()
        self._denials[code].inc()
        if self.tracer is not None:
            _trace_outcome(DENIED, code)

    def _count_allowed(self, tool: str, seconds: float, code: ErrorCode | None) -> None:
        meter = self._meters.get(tool) or self._meter(tool)
        meter.allowed.inc()
        meter.duration.observe(seconds)
        if code is not None:
            failures = self._failures.get(code)
            if failures is None:
                failures = self._failures[code] = self.metrics.call_failures.labels(str(code))
            failures.inc()
        if self.tracer is not None:
            _trace_outcome(ALLOWED, code)

    # -- frames that never became requests -------------------------------------

    async def refuse_frame(self, run: Run, err: FrameError, peer: Peer) -> Response:
        """Audit and answer a malformed or oversize frame.

        Its two entries share one flush, awaited before the answer is returned like
        any call's result (nothing ran, so there is nothing to write ahead of). A bad
        frame costs a token of the run's call budget like any call, so a flood of
        garbage is answered with ``rate_limited`` (and the connection closed by the
        server) instead of filling the audit disk at full speed.

        Error handling: a log that cannot be written makes the answer ``internal``.
        """
        if not run.bucket.try_take(self.clock()):
            err = FrameError(
                code=ErrorCode.RATE_LIMITED,
                message=self._rate_message(run)
                + "; malformed frames count too, and this connection is closed",
                tool_call_id=err.tool_call_id,
                fatal=True,
                raw=err.raw,
            )
        message = self.scrubber.text(err.message)
        detail: dict[str, Any] = {"frameBytes": len(err.raw)}
        if err.raw:
            detail["frameDigest"] = sha256_digest(err.raw)
        self.audit.record(
            "call",
            runId=run.run_id,
            toolCallId=err.tool_call_id,
            decision="deny",
            errorCode=str(err.code),
            safeMessage=message,
            peer=peer,
            detail=detail,
            degraded=run.degraded,
        )
        seq = self.audit.record(
            "result",
            runId=run.run_id,
            toolCallId=err.tool_call_id,
            errorCode=str(err.code),
            durationMs=0.0,
        )
        response = error_response(err.tool_call_id, err.code, message)
        try:
            return await self._answer(seq, response, run, "", err.code, None)
        except AuditWriteError:
            return self._audit_down(run, err.tool_call_id, None)

    # -- requests --------------------------------------------------------------

    async def handle(
        self,
        run: Run,
        req: Request,
        peer: Peer,
        *,
        caller_gone: Callable[[], bool] | None = None,
    ) -> Response:
        """Take one request through every step and return its response.

        ``caller_gone``: whether the caller has gone away (its connection closed), asked
        while a call waits for approval, so a call nobody waits for is withdrawn.

        Fails closed: when the audit log cannot be written, no call runs and every
        answer is ``internal`` until the operator fixes the log; a call whose result
        entry cannot be made durable is answered ``internal`` too, never with its value.
        """
        tracer = self.tracer
        if tracer is None:
            try:
                return await self._handle(run, req, peer, caller_gone)
            except AuditWriteError:
                return self._audit_down(run, req.toolCallId, req.tool)
        # The span's tool is the metrics' label: a name a run made up is "unknown".
        tool = req.tool if self._meter(req.tool) is not self._unknown_meter else UNKNOWN_TOOL
        span = tracer.call(run.run_id, tool)
        token = _CALL_SPAN.set(span)
        try:
            return await self._handle(run, req, peer, caller_gone)
        except AuditWriteError:
            return self._audit_down(run, req.toolCallId, req.tool)
        finally:
            _CALL_SPAN.reset(token)
            span.end()

    def answers_at_once(self, run: Run) -> bool:
        """Can any call of ``run`` be answered at once (:meth:`handle_now`)? Not with
        tracing on, with answers that do not wait for their result entries, or with a
        policy that marks calls for approval (whether a call is marked depends on its
        arguments): then it says None to every call."""
        return (
            self.tracer is None
            and self.reply_after_result
            and not run.spec.policy.approvals.required
        )

    def handle_now(self, run: Run, req: Request, peer: Peer) -> Answered | None:
        """Take one request through every step at once, if it needs no wait on the way:
        the call's answer (recorded, not yet durable), or None, having done nothing
        (then :meth:`handle` it, in a task of its own).

        At once means: tools.list, a refusal before the call runs, or a tool with an
        ``immediate`` function and no side effect (its call and result entries share
        one flush, which :meth:`release` waits for), when no rule review applies to it,
        the run's policy marks no call for approval, a call slot of the run is free,
        tracing is off and answers wait for their result entries. The steps, entries
        and answers are those of :meth:`handle`; only the task differs.
        """
        if not self.answers_at_once(run) or not self._runs_now(run, req.tool):
            return None
        started = self.clock()
        try:
            spec, admitted = self._admit(run, req)
            own = self._run_reviews.get(run.run_id)
            if spec is not None and own is not None and self.reviewer is None:
                raise _Refusal(
                    ErrorCode.REVIEW_DENIED,
                    f"{own.subject}'s calls are all reviewed, and this gatewayd has no reviewer",
                )
        except _Refusal as refusal:
            seq, message = self._record_denial(run, req, peer, refusal, started)
            response = error_response(req.toolCallId, refusal.code, message)
            return Answered(seq, response, run, req.tool, refusal.code, None)
        self._record_call(run, req, peer, None, None if spec is None else spec.audit_detail)
        try:
            value = (
                self.list_tools(run)
                if spec is None
                else self._run_now(run, spec, admitted, req.toolCallId)
            )
            payload = self._payload(run, req, value)
        except _Refusal as refusal:
            seq, response, elapsed = self._record_failure(run, req, refusal, started)
            return Answered(seq, response, run, req.tool, refusal.code, elapsed)
        seq, response, elapsed = self._record_success(run, req, payload, started)
        return Answered(seq, response, run, req.tool, None, elapsed)

    async def release(self, answered: list[Answered]) -> list[Response]:
        """The responses of calls :meth:`handle_now` answered, once every one's result
        entry is durable (one wait for all: the log is written in order), each call
        tallied. A log that cannot be written makes each answer ``internal``; a
        cancelled wait still tallies them (their entries stay queued and are written)."""
        if not answered:
            return []
        try:
            await self.audit.durable(max(a.seq for a in answered))
        except AuditWriteError:
            return [self._audit_down(a.run, a.response.toolCallId, a.tool) for a in answered]
        except BaseException:
            for a in answered:
                self._tally(a.run, a.tool, a.code, a.ran_s)
            raise
        for a in answered:
            self._tally(a.run, a.tool, a.code, a.ran_s)
        return [a.response for a in answered]

    def drop(self, answered: list[Answered]) -> None:
        """Tally calls :meth:`handle_now` answered whose answers will never be sent (the
        connection was cancelled first); their entries stay queued and are written."""
        for a in answered:
            self._tally(a.run, a.tool, a.code, a.ran_s)

    def _runs_now(self, run: Run, name: str) -> bool:
        """Can a call of ``name`` be answered without a wait (see :meth:`handle_now`)?
        Asked before any step, so it changes nothing: a call it says no to goes the
        usual way from the start. For a run :meth:`answers_at_once` says yes to."""
        if name == TOOLS_LIST:
            return True
        spec = self.tool_for(run, name)
        if spec is None:
            return True  # refused by the steps, at once
        if spec.immediate is None or spec.manifest.side_effects:
            return False
        if self.reviewer is not None:
            # A spec replaced since the run's last call (a policy reload, which read the
            # file again) is in force at this call: the file is looked at now.
            memo = run.dispatch_memo
            max_age_s = (
                RULES_MAX_AGE_AT_ONCE_S if memo is not None and memo.spec is run.spec else 0.0
            )
            try:
                section, _ = self._review_rules(run, max_age_s=max_age_s)
                if self.reviewer.applies(section, name):
                    return False
            except Exception:
                return False  # the review step makes this a failed review, audited
        return run.limiter.available_tokens >= 1

    def _audit_down(self, run: Run, tool_call_id: str | None, tool: str | None) -> Response:
        log.error("audit_unavailable", run_id=run.run_id, tool=tool)
        run.count(str(ErrorCode.INTERNAL))
        self._count_denied(tool or "", ErrorCode.INTERNAL)
        message = "the audit log cannot be written, so no call can run; tell the operator"
        return error_response(tool_call_id, ErrorCode.INTERNAL, message)

    async def _handle(
        self, run: Run, req: Request, peer: Peer, caller_gone: Callable[[], bool] | None
    ) -> Response:
        started = self.clock()
        try:
            spec, args = self._admit(run, req)
        except _Refusal as refusal:
            return await self._deny(run, req, peer, refusal, started)
        review: dict[str, Any] | None = None
        own = self._run_reviews.get(run.run_id)
        if spec is not None and own is not None and self.reviewer is None:
            # Rules that must review every call, and nothing here to review them: no.
            unreviewed = _Refusal(
                ErrorCode.REVIEW_DENIED,
                f"{own.subject}'s calls are all reviewed, and this gatewayd has no reviewer",
            )
            return await self._deny(run, req, peer, unreviewed, started)
        if spec is not None and self.reviewer is not None:
            try:
                outcome, ruleset = await self._review(run, req, args[0])
            except _Refusal as refusal:
                return await self._deny(run, req, peer, refusal, started)
            except BaseException as exc:
                if not is_cancellation(exc):
                    raise
                # No write-ahead entry yet: the call still gets its pair of entries
                # (record() never awaits; the flusher writes what is queued).
                stopped = _Refusal(ErrorCode.INTERNAL, CANCELLED_MESSAGE)
                self._record_denial(run, req, peer, stopped, started)
                self._tally(run, req.tool, stopped.code, None)
                raise
            if outcome is not None:
                review = outcome.audit()
                if ruleset is not None:
                    review["ruleset"] = ruleset
                if own is not None:
                    review["app"] = own.app
                if not outcome.allowed:
                    denied = _Refusal(ErrorCode.REVIEW_DENIED, _review_message(outcome))
                    return await self._deny(run, req, peer, denied, started, review=review)

        detail = None if spec is None else spec.audit_detail
        if spec is not None:
            # After the policy and the review allowed it, before its call entry: a call
            # the policy marks waits here for the operator (it holds no call slot, and its
            # time limit starts when it runs), then is checked against its rights again.
            try:
                approved = await self._approval(run, req, peer, spec, args, caller_gone)
            except _Refusal as refusal:
                return await self._deny(run, req, peer, refusal, started, review=review)
            except BaseException as exc:
                if not is_cancellation(exc):
                    raise
                # Withdrawn (audited by the approvals); the call's pair of entries still.
                stopped = _Refusal(ErrorCode.APPROVAL_DENIED, WITHDRAWN_MESSAGE)
                self._record_denial(run, req, peer, stopped, started, review=review)
                self._tally(run, req.tool, stopped.code, None)
                raise
            if approved is not None:
                approval_id, args = approved
                detail = {**(detail or {}), "approvalId": approval_id}
        call_seq = self._record_call(run, req, peer, review, detail)
        # Write-ahead: a call that can change or reveal anything outside gatewayd runs
        # only once its entry is durable. A side-effect-free one (tools.list, reads of
        # local state) skips that flush: nothing of it leaves gatewayd but its answer,
        # which waits for the result entry, and that one flush writes both entries.
        # When answers do not wait (the opt-out), every allowed call writes ahead.
        try:
            if (spec is not None and spec.manifest.side_effects) or not self.reply_after_result:
                await self.audit.durable(call_seq)
            value = await self._run(run, spec, args, req.toolCallId)
            payload = self._payload(run, req, value)
        except _Refusal as refusal:
            seq, response, elapsed = self._record_failure(run, req, refusal, started)
            return await self._answer(seq, response, run, req.tool, refusal.code, elapsed)
        except BaseException as exc:
            if not is_cancellation(exc):
                raise
            # The run or the daemon is ending under this call: its call entry still
            # gets a result (record() never awaits, so this cannot be cancelled; the
            # flusher writes what is queued, at the latest when the log closes).
            elapsed = self.clock() - started
            self.audit.record(
                "result",
                checked=False,
                runId=run.run_id,
                toolCallId=req.toolCallId,
                tool=req.tool,
                errorCode=str(ErrorCode.INTERNAL),
                safeMessage=CANCELLED_MESSAGE,
                durationMs=round(elapsed * 1000, 3),
            )
            self._tally(run, req.tool, ErrorCode.INTERNAL, elapsed)
            raise

        seq, response, elapsed = self._record_success(run, req, payload, started)
        return await self._answer(seq, response, run, req.tool, None, elapsed)

    def _record_call(
        self,
        run: Run,
        req: Request,
        peer: Peer,
        review: dict[str, Any] | None,
        detail: Mapping[str, Any] | None,
    ) -> int:
        """Record an allowed call's ``call`` entry (never awaits); returns its seq."""
        return self.audit.record(
            "call",
            checked=False,
            runId=run.run_id,
            toolCallId=req.toolCallId,
            tool=req.tool,
            argsDigest=args_digest(req.args),
            # Most calls have no arguments (time.now, tools.list): nothing to summarize.
            argsSummary=summarize(req.args) if req.args else {},
            decision="allow",
            peer=peer,
            review=review,
            degraded=run.degraded,
            detail=detail,
        )

    def _payload(self, run: Run, req: Request, value: Any) -> bytes:
        """Steps 10-11: the value as it leaves, scrubbed and within the run's output
        limit. Raises _Refusal."""
        try:
            payload = self._scrub_output(encode_json(value), req.tool)
        except _Refusal:
            raise
        except Exception:
            # A value gatewayd cannot encode is gatewayd's bug: the call still gets its
            # result entry and an answer, and the connection goes on.
            log.exception("output_unencodable", run_id=run.run_id, tool=req.tool)
            raise _Refusal(
                ErrorCode.INTERNAL,
                f"{req.tool} failed inside gatewayd; the operator's log has details",
            ) from None
        limit = run.spec.policy.limits.max_output_bytes
        if len(payload) > limit:
            raise _Refusal(
                ErrorCode.TOOL_FAILED,
                f"output of {len(payload)} bytes is over this run's limit of {limit} "
                "bytes (limits.max_output_bytes); ask for less, e.g. fs.read with a "
                "smaller limit or an offset",
            )
        return payload

    def _record_failure(
        self, run: Run, req: Request, refusal: _Refusal, started: float
    ) -> tuple[int, Response, float]:
        """Record the ``result`` entry of a call that ran and failed (never awaits);
        returns its seq, the answer and how long the call took."""
        message = self.scrubber.text(refusal.message)
        elapsed = self.clock() - started
        seq = self.audit.record(
            "result",
            checked=False,
            runId=run.run_id,
            toolCallId=req.toolCallId,
            tool=req.tool,
            errorCode=str(refusal.code),
            safeMessage=message,
            durationMs=round(elapsed * 1000, 3),
        )
        return seq, error_response(req.toolCallId, refusal.code, message), elapsed

    def _record_success(
        self, run: Run, req: Request, payload: bytes, started: float
    ) -> tuple[int, Response, float]:
        """Record the ``result`` entry of a call that returned ``payload`` (never
        awaits); returns its seq, the answer and how long the call took."""
        elapsed = self.clock() - started
        seq = self.audit.record(
            "result",
            checked=False,
            runId=run.run_id,
            toolCallId=req.toolCallId,
            tool=req.tool,
            durationMs=round(elapsed * 1000, 3),
            outputDigest=sha256_digest(payload),
            outputBytes=len(payload),
        )
        # The value goes out as the bytes just measured and digested: encoded once.
        return seq, ok_response(req.toolCallId, msgspec.Raw(payload)), elapsed

    async def _answer(
        self,
        seq: int,
        response: Response,
        run: Run,
        tool: str,
        code: ErrorCode | None,
        ran_s: float | None,
    ) -> Response:
        """Step 12: ``response`` once the call's result entry ``seq`` is durable
        (invariant RESULT_BEFORE_REPLY; at once when the operator opted out), and the
        call tallied (:meth:`_tally`).

        Error handling: AuditWriteError passes through untallied, so the caller answers
        ``internal`` instead of ``response`` and tallies that. A cancelled wait (the run
        or gatewayd is ending) still tallies the call: its entry stays queued and the
        flusher writes it anyway.
        """
        if self.reply_after_result:
            try:
                await self.audit.durable(seq)
            except AuditWriteError:
                raise
            except BaseException:
                self._tally(run, tool, code, ran_s)
                raise
        self._tally(run, tool, code, ran_s)
        return response

    def _tally(self, run: Run, tool: str, code: ErrorCode | None, ran_s: float | None) -> None:
        """Count one finished call: for its run, and in the metrics as refused before
        it ran (``ran_s`` None) or as run for ``ran_s`` seconds (failed with ``code``)."""
        run.count(None if code is None else str(code))
        if ran_s is not None:
            self._count_allowed(tool, ran_s, code)
        elif code is not None:
            self._count_denied(tool, code)

    def _scrub_output(self, payload: bytes, tool: str) -> bytes:
        """Step 10: the output with every configured secret replaced; withheld (a
        ``tool_failed``) when a secret cannot be taken out string by string."""
        try:
            return self.scrubber.json(payload)
        except UnscrubbableError:
            log.error("output_withheld", tool=tool, reason="a secret spans its JSON syntax")
            raise _Refusal(
                ErrorCode.TOOL_FAILED,
                f"the output of {tool} held a secret of gatewayd's that could not be "
                "removed, so it is withheld; the operator's log says so",
            ) from None

    def _admit(self, run: Run, req: Request) -> tuple[Tool[Any] | None, Any]:
        """Steps 3-6: identify, authorize, rate, validate, policy. Raises _Refusal."""
        # Rate first: every frame on the run's socket spends its budget, even one
        # that will be refused, so refusals cannot be used to flood the audit log.
        if not run.bucket.try_take(self.clock()):
            raise _Refusal(ErrorCode.RATE_LIMITED, self._rate_message(run))
        if req.runId != run.run_id:
            raise _Refusal(
                ErrorCode.RUN_MISMATCH,
                "runId does not match the run this socket serves; send the value of COGNI_RUN_ID",
            )
        if not run.spec.request.grant.allowSandbox:
            raise _Refusal(ErrorCode.AUTHZ_DENIED, "this run has no sandbox grant")
        if req.tool == TOOLS_LIST:
            if req.args:
                raise _Refusal(ErrorCode.INVALID_ARGS, "tools.list takes no arguments: send {}")
            return None, None
        spec = self.tool_for(run, req.tool)
        if spec is None:
            raise _Refusal(
                ErrorCode.UNKNOWN_TOOL,
                f"there is no tool named {req.tool!r}.{self._unknown_hint(req.tool)} "
                f"{self._allowed_sentence(run)}",
            )
        memo = self._memo(run)
        if not memo.tool_allowed(req.tool):
            raise _Refusal(
                ErrorCode.POLICY_DENIED,
                f"tool {req.tool!r} is not allowed for this run. {self._allowed_sentence(run)}",
            )
        try:
            args = spec.decode(req.args)
            request = spec.requests(args)
        except ArgumentsRejected as exc:
            raise _Refusal(
                ErrorCode.INVALID_ARGS,
                f"invalid arguments for {req.tool}: {exc}. The schema is in tools.list.",
            ) from None
        except GatewayError as exc:  # a decoder may refuse with a reason of its own
            raise _Refusal(exc.code, exc.safe_message) from None
        decision = check_call(req.tool, spec.manifest.capabilities, request, memo.rights)
        if not isinstance(decision, Allow):
            raise _Refusal(decision.code, decision.message)
        return spec, (args, decision.resolved)

    async def _approval(
        self,
        run: Run,
        req: Request,
        peer: Peer,
        spec: Tool[Any],
        admitted: Any,
        caller_gone: Callable[[], bool] | None,
    ) -> tuple[str, Any] | None:
        """The approval step: None when the run's policy does not mark this call; else
        the approval's id and the call's admitted arguments, checked again against the
        run's rights as they are after the wait (approval never widens: a policy reloaded
        meanwhile, or a budget spent, applies). Raises _Refusal."""
        args, _ = admitted
        section = run.spec.policy.approvals
        if not section.required:
            return None  # the common case: nothing to match
        plain = msgspec.to_builtins(args)
        required = required_approval(section, req.tool, plain if isinstance(plain, dict) else {})
        if required is None:
            return None
        approvals = self.approvals
        if approvals is None:
            # A marked call and nobody to ask (a dispatcher built without approvals): no.
            raise _Refusal(
                ErrorCode.APPROVAL_DENIED,
                f"this call of {req.tool} needs the operator's approval (approvals.required "
                f"entry {required.index} of this run's policy), and this gatewayd has no one "
                "to ask; it is denied",
            )
        try:
            approval_id = await approvals.ask(
                run, req, peer, required, plain, caller_gone=caller_gone
            )
        except ApprovalRefused as exc:
            raise _Refusal(exc.code, exc.message) from None
        memo = self._memo(run)
        if not memo.tool_allowed(req.tool):
            raise _Refusal(
                ErrorCode.POLICY_DENIED,
                f"tool {req.tool!r} was approved, and this run's policy no longer allows it "
                f"(it changed while the call waited). {self._allowed_sentence(run)}",
            )
        try:
            request = spec.requests(args)
        except GatewayError as exc:
            raise _Refusal(exc.code, exc.safe_message) from None
        decision = check_call(req.tool, spec.manifest.capabilities, request, memo.rights)
        if not isinstance(decision, Allow):
            raise _Refusal(decision.code, decision.message)
        return approval_id, (args, decision.resolved)

    def _unknown_hint(self, name: str) -> str:
        """A runner kind's hint for a name no tool has (" " and a sentence), or ""."""
        for hint in self.unknown_tool_hints:
            said = hint(name)
            if said:
                return " " + said
        return ""

    def _rate_message(self, run: Run) -> str:
        limits = run.spec.policy.limits
        return (
            f"this run may make {limits.calls_per_second:g} calls per second "
            f"(burst {limits.burst}); retry after {run.bucket.retry_after(self.clock()):.3f} s"
        )

    def _allowed_sentence(self, run: Run) -> str:
        names = allowed_tools(self.known_tools(run), run.spec.rules)
        if not names:
            return "This run's policy allows no tools (deny by default)."
        return "Tools this run may call: " + ", ".join((TOOLS_LIST, *names)) + "."

    def list_tools(self, run: Run) -> list[ToolManifest]:
        """The value of tools.list: tools.list's own manifest, then the manifest of each
        tool the run may call (name, version, summary, JSON Schema of the arguments,
        runner kind, capabilities, limits, side effects), sorted by name."""
        out = [TOOLS_LIST_MANIFEST]
        for name in allowed_tools(self.known_tools(run), run.spec.rules):
            tool = self.tool_for(run, name)
            if tool is not None:
                out.append(tool.manifest)
        return out

    async def _run(
        self, run: Run, spec: Tool[Any] | None, admitted: Any, tool_call_id: str | None = None
    ) -> Any:
        """Step 9: the runner, inside the run's concurrency bound and the call's time
        limit (the run's, or the tool's own when its manifest sets a shorter one)."""
        if spec is None:
            return self.list_tools(run)
        args, resolved = admitted
        limits = run.spec.policy.limits
        own_s = spec.manifest.limits.timeout_s
        timeout_s = limits.call_timeout_s if own_s is None else min(own_s, limits.call_timeout_s)
        ctx = self._context(run, resolved, timeout_s, tool_call_id)
        # The time limit covers waiting for a slot too: a saturated run fails fast.
        limiter = None if _SLOT_HELD.get() == run.run_id else run.limiter
        with trio.move_on_after(timeout_s):
            # A free slot is taken without a schedule point (the call has just waited
            # for its audit entry); only a full run waits, in line, under the timeout.
            if limiter is not None:
                try:
                    limiter.acquire_nowait()
                except trio.WouldBlock:
                    await limiter.acquire()
            held = _SLOT_HELD.set(run.run_id)
            try:
                return await spec.runner.run(args, ctx)
            except GatewayError as exc:
                raise _Refusal(exc.code, exc.safe_message) from None
            except trio.Cancelled:
                raise
            except Exception:
                log.exception("tool_crashed", run_id=run.run_id, tool=spec.name)
                raise _Refusal(
                    ErrorCode.INTERNAL,
                    f"{spec.name} failed inside gatewayd; the operator's log has details",
                ) from None
            finally:
                _SLOT_HELD.reset(held)
                if limiter is not None:
                    limiter.release()
        # Only a timeout leaves the block without returning or raising.
        if timeout_s < limits.call_timeout_s:
            limit = f"its own limit of {timeout_s:g} s per call (timeoutSeconds in its manifest)"
        else:
            limit = f"this run's limit of {timeout_s:g} s per call (limits.call_timeout_s)"
        raise _Refusal(ErrorCode.TIMEOUT, f"{spec.name} ran past {limit} and was stopped")

    def _context(
        self,
        run: Run,
        resolved: Any,
        timeout_s: float,
        tool_call_id: str | None,
        *,
        nested: bool = True,
    ) -> ToolContext:
        """What a runner may know about ``run`` and the call it serves (``nested``: may
        it make calls of its own): the run's part made once (:class:`_RunMemo`), the
        call's filled in."""
        return msgspec.structs.replace(
            self._memo(run).context,
            tool_call_id=tool_call_id,
            resolved=resolved,
            timeout_s=timeout_s,
            nested=None
            if tool_call_id is None or not nested
            else self._nested_for(run, tool_call_id),
        )

    def _run_now(self, run: Run, spec: Tool[Any], admitted: Any, tool_call_id: str) -> Any:
        """Step 9 for a tool with an ``immediate`` function (:meth:`handle_now`): called
        at once, in no slot of the run's (nothing else runs while it does) and with no
        time limit to arm (it does no I/O). Raises _Refusal as :meth:`_run` does."""
        assert spec.immediate is not None
        args, resolved = admitted
        limits = run.spec.policy.limits
        own_s = spec.manifest.limits.timeout_s
        timeout_s = limits.call_timeout_s if own_s is None else min(own_s, limits.call_timeout_s)
        try:
            ctx = self._context(run, resolved, timeout_s, tool_call_id, nested=False)
            return spec.immediate(args, ctx)
        except GatewayError as exc:
            raise _Refusal(exc.code, exc.safe_message) from None
        except Exception:
            log.exception("tool_crashed", run_id=run.run_id, tool=spec.name)
            raise _Refusal(
                ErrorCode.INTERNAL,
                f"{spec.name} failed inside gatewayd; the operator's log has details",
            ) from None

    def _nested_for(self, run: Run, parent_id: str) -> NestedCall:
        """The nested calls of call ``parent_id``: each a request of the same run, by
        gatewayd's own process, through every step of :meth:`handle`."""
        peer = self._own_peer

        async def nested(tool: str, args: Mapping[str, Any], suffix: str) -> Response:
            call_id = f"{parent_id}.{suffix}"
            if len(call_id) > MAX_ID_CHARS:
                # Still unique per call: the parent's id is cut, the suffix kept.
                call_id = f"{parent_id[: MAX_ID_CHARS - len(suffix) - 2]}~.{suffix}"
            request = Request(
                v=PROTOCOL_VERSION, runId=run.run_id, toolCallId=call_id, tool=tool, args=dict(args)
            )
            return await self.handle(run, request, peer)

        return nested

    async def _review(
        self, run: Run, req: Request, args: Any
    ) -> tuple[ReviewOutcome | None, str | None]:
        """Step 7: the rule review, if the run's (live) review rules cover this call;
        the outcome and the hash of the rule set it was made under.

        Error handling: _Refusal when no call slot frees in time. Any other exception of
        the step (a bug, or a reply the reviewer could not survive) is a failed review: a
        deny (invariant FAIL_CLOSED), audited and answered like any other, never an
        exception that would drop the connection and the calls in flight on it. The
        hash is None only when the rules themselves could not be read.
        """
        assert self.reviewer is not None
        started = self.clock()
        section = run.spec.policy.review
        digest: str | None = None
        own = self._run_reviews.get(run.run_id)
        try:
            section, rules = self._review_rules(run)
            digest = rules.digest
            if not self.reviewer.applies(section, req.tool):
                return None, digest
            outcome = await self._ask_reviewer(run, req, args, section, rules)
        except _Refusal:
            raise
        except Exception as exc:
            log.exception("review_crashed", run_id=run.run_id, tool=req.tool)
            outcome = review_crashed(
                exc, model=section.model, latency_ms=(self.clock() - started) * 1000
            )
        if outcome is not None:
            reviews = self._reviews.get(outcome.source)
            if reviews is None:
                source = str(outcome.source)
                reviews = self._reviews[source] = self.metrics.reviews.labels(source)
            reviews.observe(outcome.latency_ms / 1000)
            answered = outcome.source is Source.MODEL or outcome.prompt_tokens is not None
            if own is not None and own.budget is not None and answered:
                # An app's reviews are spent on its caller's behalf: its budget pays.
                own.budget.requests += 1
                own.budget.tokens += max(outcome.prompt_tokens or 0, 0) + max(
                    outcome.completion_tokens or 0, 0
                )
        return outcome, digest

    def _review_rules(self, run: Run, *, max_age_s: float = 0.0) -> tuple[ReviewSection, RuleSet]:
        """The review rules ``run``'s calls are reviewed under now: its own (an app's
        child run), else its policy file's as they are now (or as looked at up to
        ``max_age_s`` ago), else those it loaded."""
        own = self._run_reviews.get(run.run_id)
        if own is not None:
            return own.rules()
        section = run.spec.policy.review
        if self.rules is not None:
            return self.rules.current(run.spec.policy_source, section, max_age_s=max_age_s)
        return section, RuleSet.from_section(section)

    async def _ask_reviewer(
        self, run: Run, req: Request, args: Any, section: ReviewSection, rules: RuleSet
    ) -> ReviewOutcome | None:
        """The reviewer's outcome, within a call slot of the run."""
        assert self.reviewer is not None
        # The arguments as the tool will use them, defaults filled in: an fs.list without
        # a path lists /workspace, and a path rule must see that. A review counts against
        # the run's concurrent calls like the call itself.
        # A free slot is taken without a schedule point or a deadline (the common case,
        # and what a cache hit pays); waiting for one is bounded like the call itself.
        if _SLOT_HELD.get() == run.run_id:
            # A nested call's review runs in the slot of the call it serves.
            return await self.reviewer.review(req.tool, msgspec.to_builtins(args), section, rules)
        try:
            run.limiter.acquire_nowait()
        except trio.WouldBlock:
            wait = run.spec.policy.limits.call_timeout_s
            try:
                with trio.fail_after(wait):
                    await run.limiter.acquire()
            except trio.TooSlowError:
                raise _Refusal(
                    ErrorCode.TIMEOUT,
                    f"no free call slot within {wait:g} s (limits.max_concurrent_calls); "
                    "try again when fewer calls are in flight",
                ) from None
        try:
            return await self.reviewer.review(req.tool, msgspec.to_builtins(args), section, rules)
        finally:
            run.limiter.release()

    async def _deny(
        self,
        run: Run,
        req: Request,
        peer: Peer,
        refusal: _Refusal,
        started: float,
        *,
        review: dict[str, Any] | None = None,
    ) -> Response:
        """Audit a call refused before it ran and answer it once both of its entries
        are durable (one flush: nothing ran, so there is nothing to write ahead of)."""
        seq, message = self._record_denial(run, req, peer, refusal, started, review=review)
        response = error_response(req.toolCallId, refusal.code, message)
        return await self._answer(seq, response, run, req.tool, refusal.code, None)

    def _record_denial(
        self,
        run: Run,
        req: Request,
        peer: Peer,
        refusal: _Refusal,
        started: float,
        *,
        review: dict[str, Any] | None = None,
    ) -> tuple[int, str]:
        """Record a refused call's ``call`` and ``result`` entries (never awaits); returns
        the result's seq and the scrubbed message."""
        message = self.scrubber.text(refusal.message)
        common: dict[str, Any] = {
            "runId": run.run_id,
            "toolCallId": req.toolCallId,
            "tool": req.tool,
        }
        self.audit.record(
            "call",
            checked=False,
            **common,
            argsDigest=args_digest(req.args),
            argsSummary=summarize(req.args) if req.args else {},
            decision="deny",
            errorCode=str(refusal.code),
            safeMessage=message,
            peer=peer,
            review=review,
            degraded=run.degraded,
        )
        seq = self.audit.record(
            "result",
            checked=False,
            **common,
            errorCode=str(refusal.code),
            durationMs=round((self.clock() - started) * 1000, 3),
        )
        return seq, message


def _trace_outcome(verdict: str, code: ErrorCode | None) -> None:
    """Write a call's verdict on the span of the call this task handles (a frame that
    never became a request has none)."""
    span = _CALL_SPAN.get()
    if span is not None:
        span.outcome(verdict, None if code is None else str(code))


def is_cancellation(exc: BaseException) -> bool:
    """Is ``exc`` trio's cancellation: ``Cancelled`` itself, or a group of nothing else
    (a tool whose runner has a nursery, like sandbox.exec's, is cancelled with a group)."""
    if isinstance(exc, trio.Cancelled):
        return True
    if isinstance(exc, BaseExceptionGroup):
        _, rest = exc.split(trio.Cancelled)
        return rest is None
    return False


def _review_message(outcome: ReviewOutcome) -> str:
    """What the agent reads: the reviewer's own reason, so it can adapt; a failed review
    says it failed (the call may be fine), never that a rule said no."""
    if outcome.source is Source.FAILED:
        return outcome.reason
    return f"the rule review denied this call: {outcome.reason or 'no reason given'}"
