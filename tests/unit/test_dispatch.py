"""The chokepoint on its own: table-driven ``Dispatcher`` tests, no sockets, no wall time.

Every kind of answer a call can get (allowed; each error code it can be refused or fail
with; the rule review's allow, deny and failure; an audit log that fails; a call that is
cancelled) is one row, checked for its answer, the ``call`` and ``result`` entries it
leaves, whether its tool ran, and when its entries were made durable relative to its
answer (invariant RESULT_BEFORE_REPLY, and the ``reply_after_result`` opt-out).

The pieces around the dispatcher are fakes, each for a reason:

- the tools are tiny built-in ``Tool``s that note when they run and what the log had
  made durable by then (so write-ahead is checked, not assumed);
- the audit log is :class:`FakeAuditLog`: the real sans-IO ``Chain`` seals and validates
  every entry exactly as the writer would (a field the writer would refuse fails here
  too), but the flush is simulated, with no file and no flusher thread. That makes every
  ``durable()`` wait countable in order, and the log can fail or stall at the exact step
  a row needs, which the real writer only allows through its file descriptor.
  :func:`test_the_real_audit_log_holds_what_the_fake_one_does` runs the same table
  through the real ``AuditLog`` so the two cannot drift apart;
- the reviewer subclasses the real ``Reviewer``, answering what the row says;
- time is trio's ``MockClock`` (pytest-trio's ``autojump_clock``), given to the
  dispatcher as its clock too: a call that runs past its limit is stopped after exactly
  ``CALL_TIMEOUT_S`` virtual seconds, in no wall time.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, Unpack, cast

import msgspec
import pytest
import trio
import trio.lowlevel
from trio.testing import MockClock

from gatewayd.argsummary import args_digest, sha256_digest
from gatewayd.audit import (
    AuditLog,
    AuditWriteError,
    EntryFields,
    Peer,
    open_audit_log,
    read_entries,
    verify_file,
)
from gatewayd.audit.chain import Chain, read_line
from gatewayd.audit.entry import build_body
from gatewayd.dispatch import CANCELLED_MESSAGE, TOOLS_LIST, Dispatcher
from gatewayd.errors import InvalidArguments, ToolFailed
from gatewayd.metrics import GatewayMetrics
from gatewayd.policy import RunRules, TokenBucket, load_policy_text
from gatewayd.policy.capabilities import (
    EVERY_PATH,
    NO_CAPABILITIES,
    Capabilities,
    CapabilityRequest,
    FileCapability,
    no_request,
)
from gatewayd.policy.paths import (
    WORKSPACE_VISIBLE_ROOT,
    PathAccess,
    PathGrant,
    PathMode,
    ResolvedPath,
)
from gatewayd.policy.review_section import ReviewSection
from gatewayd.protocol import ErrorCode, FrameError, Request, Response
from gatewayd.review.reviewer import (
    CRASHED_WORDS,
    Reviewer,
    ReviewOutcome,
    Source,
    review_crashed,
    review_failed_reason,
)
from gatewayd.review.ruleset import RuleSet
from gatewayd.runs import Grant, Run, RunRequest, RunSpec
from gatewayd.secrets import Scrubber
from gatewayd.tools.builtin import builtin_tool
from gatewayd.tools.registry import Tool, ToolContext, ToolRegistry

PEER: Final = Peer(pid=4242, uid=1000, gid=1000)
RUN_ID: Final = "0123456789abcdef0123456789abcdef"
TOOL_CALL_ID: Final = "c1"
# Virtual seconds (MockClock): the slow tool sleeps twice as long, so only the call's
# own limit can stop it.
CALL_TIMEOUT_S: Final = 5.0
SLOW_TOOL_S: Final = 2 * CALL_TIMEOUT_S
# Small, so a row can take every slot of the run and see the next call wait for one.
MAX_CONCURRENT_CALLS: Final = 2
# Room for tools.list's answer (every fake tool with its schema); the oversized tool
# returns a string of this many characters, two quotes past the limit.
MAX_OUTPUT_BYTES: Final = 16 * 1024
CALLS_PER_SECOND: Final = 1
BURST: Final = 4
# A configured secret: the scrubber must take it out of every value and message.
SECRET_NAME: Final = "COGNI_UNIT_SECRET"
SECRET: Final = "sk-unit-0123456789abcdef"
REDACTED: Final = f"[REDACTED:{SECRET_NAME}]"
REVIEWER_ALIAS: Final = "reviewer"
AUDIT_DOWN: Final = "the audit log cannot be written, so no call can run; tell the operator"
# Long enough that the real log's own timer never writes during a test: only waiters
# make it flush, so what is durable when an answer leaves is what the answer waited for.
# Also how long (virtual) a cancellation test waits for its call to reach its step.
NEVER_DUE_S: Final = 3600.0

POLICY: Final = f"""
version: 1
name: dispatch-unit
tools:
  allow: ["test.*"]
limits:
  call_timeout_s: {CALL_TIMEOUT_S}
  max_output_bytes: {MAX_OUTPUT_BYTES}
  calls_per_second: {CALLS_PER_SECOND}
  burst: {BURST}
  max_concurrent_calls: {MAX_CONCURRENT_CALLS}
require_os_sandbox: false
review:
  mode: llm
  model: {REVIEWER_ALIAS}
  rules:
    deny: [Writing anything that looks like a credential]
"""


# --- the audit log ---------------------------------------------------------------------


# The time of the entries FakeAuditLog builds both ways to compare (any will do).
WHEN: Final = "2026-11-27T12:00:00.000000Z"


class FakeAuditLog:
    """The audit log as the dispatcher uses it: ``record()`` and ``durable()``.

    ``record()`` seals each entry with the real chain (validated and hashed as on disk)
    and keeps it, like the writer queues it; ``durable(seq)`` is one flush of every entry
    up to ``seq``, noted in :attr:`waits`. ``failure`` set: the log has failed, as the
    writer does after a write error (nothing more is kept, every wait raises).
    ``stall`` set: the next wait never ends (a flush in progress), after setting
    :attr:`stalled`.
    """

    def __init__(self) -> None:
        self._chain = Chain()
        self.entries: list[dict[str, Any]] = []
        self.durable_seq = 0
        self.waits: list[int] = []
        self.failure: str | None = None
        self.stall = False
        self.stalled = trio.Event()

    @property
    def last_seq(self) -> int:
        return self._chain.position.seq

    def record(self, kind: str, *, checked: bool = True, **fields: Unpack[EntryFields]) -> int:
        if not checked:
            # An entry the dispatcher records unchecked is the one the checks would pass.
            after = self._chain.position
            unchecked = build_body(after.seq + 1, WHEN, kind, fields, after.hash, checked=False)
            assert unchecked == build_body(after.seq + 1, WHEN, kind, fields, after.hash)
        seq, _, line = self._chain.append(kind, fields, checked=checked)
        if self.failure is None:
            read_line(line.rstrip(b"\n"))  # the seal is sound
            self.entries.append(json.loads(line))
        return seq

    async def durable(self, seq: int) -> None:
        if not 0 <= seq <= self.last_seq:
            raise ValueError(f"seq {seq} was never recorded (last is {self.last_seq})")
        await trio.lowlevel.checkpoint_if_cancelled()
        self.waits.append(seq)
        if self.failure is not None:
            raise AuditWriteError(self.failure)
        if self.stall:
            self.stalled.set()
            await trio.sleep_forever()
        await trio.lowlevel.checkpoint()  # a flush is a wait
        self.durable_seq = max(self.durable_seq, seq)


# --- the tools -------------------------------------------------------------------------


class TextArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    text: str = "hello"


class NoArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class WriteArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    path: str
    text: str = ""


class CountArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    count: int = 0

    def __post_init__(self) -> None:
        if self.count < 0:
            raise InvalidArguments("count must be 0 or more; it counts lines")


def write_request(args: WriteArgs) -> CapabilityRequest:
    return CapabilityRequest(
        paths=(PathAccess(path=args.path, access="write", size=len(args.text.encode())),)
    )


WRITES_FILES: Final = Capabilities(files=(FileCapability(path=EVERY_PATH, mode=PathMode.RW),))


@dataclass
class Seen:
    """What the fake tools saw: each run as (tool, the log's durable seq as it started),
    and ``started`` set once any tool has started."""

    durable_seq: Callable[[], int]
    runs: list[tuple[str, int]] = field(default_factory=list)
    started: trio.Event = field(default_factory=trio.Event)

    def ran(self, tool: str) -> None:
        self.runs.append((tool, self.durable_seq()))
        self.started.set()


Runner = Callable[[Any, ToolContext], Awaitable[Any]]


def fake_tools(seen: Seen, *, breaks_log: FakeAuditLog | None = None) -> ToolRegistry:
    """The tool table: one tool per way a runner can end. ``breaks_log``: the log that
    ``test.breaks_log`` fails while it runs."""

    def tool(
        name: str,
        result: Callable[[Any, tuple[ResolvedPath, ...]], Any],
        args_type: type[msgspec.Struct] = NoArgs,
        *,
        side_effects: bool = False,
        requests: Callable[[Any], CapabilityRequest] = no_request,
        capabilities: Capabilities = NO_CAPABILITIES,
        sleep_s: float = 0.0,
    ) -> Tool[Any]:
        async def run(args: Any, ctx: ToolContext) -> Any:
            seen.ran(name)
            await trio.sleep(sleep_s)
            return result(args, ctx.resolved)

        return builtin_tool(
            name=name,
            summary=f"{name} (a fake tool)",
            args_type=args_type,
            run=run,
            side_effects=side_effects,
            requests=requests,
            capabilities=capabilities,
        )

    def fail(message: str) -> Callable[[Any, Any], Any]:
        def raising(_args: Any, _resolved: Any) -> Any:
            raise ToolFailed(message)

        return raising

    def crash(_args: Any, _resolved: Any) -> Any:
        raise RuntimeError("a bug whose text names /srv/host/detail")

    def break_log(_args: Any, _resolved: Any) -> Any:
        assert breaks_log is not None
        breaks_log.failure = "disk full"
        return {"secret": "the-tools-value"}

    async def hang(_args: Any, _ctx: ToolContext) -> Any:
        seen.ran("test.hang")
        await trio.sleep_forever()

    specs = [
        tool("test.echo", lambda a, _r: {"echo": a.text}, TextArgs),
        tool(
            "test.write",
            lambda _a, r: {"wrote": r[0].visible},
            WriteArgs,
            side_effects=True,
            requests=write_request,
            capabilities=WRITES_FILES,
        ),
        tool("test.checked", lambda a, _r: {"count": a.count}, CountArgs),
        tool("test.leak", lambda _a, _r: {"key": SECRET}),
        tool("test.fail", fail("nothing at /workspace/absent.txt; fs.list shows what is")),
        tool("test.fail_leak", fail(f"upstream answered {SECRET}")),
        tool("test.big", lambda _a, _r: "x" * MAX_OUTPUT_BYTES),
        tool("test.slow", lambda _a, _r: {}, sleep_s=SLOW_TOOL_S),
        tool("test.crash", crash, side_effects=True),
        tool("test.unencodable", lambda _a, _r: object()),
        tool("test.breaks_log", break_log),
        tool("test.breaks_log_effect", break_log, side_effects=True),
        builtin_tool(name="test.hang", summary="never returns", args_type=NoArgs, run=hang),
        # A tool gatewayd has that this run's policy does not allow.
        tool("other.tool", lambda _a, _r: {}),
    ]
    return ToolRegistry(specs)


# --- the run, the reviewer, the dispatcher --------------------------------------------


def path_grants(workspace: Path) -> tuple[PathGrant, ...]:
    """The run's paths: /workspace writable (.txt files only) except /workspace/docs.
    Made by hand, not bound on the host: the fake tools open nothing, and the policy
    step decides on visible paths alone."""
    return (
        PathGrant(
            name="workspace",
            host_root=workspace,
            root_id=(0, 0),
            holds_nested=True,
            visible_root=WORKSPACE_VISIBLE_ROOT,
            mode=PathMode.RW,
            suffixes=(".txt",),
        ),
        PathGrant(
            name="docs",
            host_root=workspace / "docs",
            root_id=(0, 0),
            holds_nested=False,
            visible_root=WORKSPACE_VISIBLE_ROOT / "docs",
            mode=PathMode.RO,
        ),
    )


def make_run(workspace: Path, *, grant: bool = True) -> Run:
    """A run as the registry makes one, minus its directory and socket (never made)."""
    policy = load_policy_text(POLICY, "dispatch-unit.yaml")
    grants = path_grants(workspace)
    request = RunRequest(
        workspacePath=str(workspace),
        policy=policy.name,
        actorId="tester",
        tenantId="t1",
        grant=Grant(allowSandbox=grant),
    )
    spec = RunSpec(
        runId=RUN_ID,
        request=request,
        workspace=workspace,
        policy=policy,
        policy_source="dispatch-unit.yaml",
        grants=grants,
        rules=RunRules(tool_patterns=policy.tools.allow, run_tool_ids=None, grants=grants),
    )
    limits = policy.limits
    return Run(
        spec=spec,
        directory=workspace / "run",
        socket_path=workspace / "run" / "gateway.sock",
        bucket=TokenBucket(rate=limits.calls_per_second, burst=limits.burst),
        limiter=trio.CapacityLimiter(limits.max_concurrent_calls),
    )


class FakeReviewer(Reviewer):
    """Answers every review with ``answer`` (an exception is raised); notes what it was
    asked. ``hang``: the review never ends, after setting :attr:`reviewing`."""

    def __init__(
        self,
        answer: ReviewOutcome | Exception | None,
        *,
        applies: bool = True,
        hang: bool = False,
    ) -> None:
        super().__init__({}, metrics=GatewayMetrics())
        self.answer = answer
        self.reviews_calls = applies
        self.hang = hang
        self.asked: list[tuple[str, dict[str, Any]]] = []
        self.reviewing = trio.Event()

    def applies(self, section: ReviewSection, tool: str) -> bool:
        return self.reviews_calls

    async def review(
        self, tool: str, args: Mapping[str, Any], section: ReviewSection, rules: RuleSet
    ) -> ReviewOutcome | None:
        self.asked.append((tool, dict(args)))
        self.reviewing.set()
        if self.hang:
            await trio.sleep_forever()
        await trio.lowlevel.checkpoint()
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def make_dispatcher(
    log: FakeAuditLog | AuditLog,
    tools: ToolRegistry,
    clock: MockClock,
    *,
    reviewer: Reviewer | None = None,
    reply_after_result: bool = True,
) -> Dispatcher:
    return Dispatcher(
        # The dispatcher needs only record() and durable() of its log.
        cast("AuditLog", log),
        tools,
        clock=clock.current_time,
        reviewer=reviewer,
        scrubber=Scrubber([SECRET_NAME], environ={SECRET_NAME: SECRET}),
        metrics=GatewayMetrics(),
        reply_after_result=reply_after_result,
    )


def call(tool: str, args: dict[str, Any] | None = None, *, run_id: str = RUN_ID) -> Request:
    return Request(v=1, runId=run_id, toolCallId=TOOL_CALL_ID, tool=tool, args=args or {})


def drain_bucket(run: Run, now: float) -> None:
    """Spend the run's call budget: the next call is over its rate."""
    while run.bucket.try_take(now):
        pass


def take_every_call_slot(run: Run, _now: float) -> None:
    """Fill the run's concurrent calls: the next call waits for a slot."""
    for _ in range(MAX_CONCURRENT_CALLS):
        run.limiter.acquire_on_behalf_of_nowait(object())


def nothing(_run: Run, _now: float) -> None:
    pass


# --- every way a call ends --------------------------------------------------------------

Decision = Literal["allow", "deny"]


@dataclass(frozen=True, kw_only=True)
class Case:
    """One call and how it must end.

    ``code`` None: answered ok with ``value`` (compared after ``shown``). Otherwise
    answered ``code`` with a message containing ``says``. ``decision``: the call entry's
    (deny: refused before it ran). ``ran``: whether its tool started.
    """

    id: str
    tool: str
    args: dict[str, Any] = field(default_factory=dict)
    code: ErrorCode | None = None
    says: str = ""
    value: Any = None
    shown: Callable[[Any], Any] = lambda value: value
    decision: Decision = "allow"
    ran: bool = True
    duration_ms: float = 0.0
    run_id: str = RUN_ID
    grant: bool = True
    prepare: Callable[[Run, float], None] = nothing


def tool_names(value: Any) -> list[str]:
    return [tool["name"] for tool in value]


CASES: Final = [
    # Allowed, answered with the tool's value.
    Case(id="ok-side-effect-free", tool="test.echo", args={"text": "hi"}, value={"echo": "hi"}),
    Case(
        id="ok-side-effect",
        tool="test.write",
        args={"path": "notes.txt", "text": "x"},
        value={"wrote": "/workspace/notes.txt"},
    ),
    Case(
        id="ok-tools-list",
        tool=TOOLS_LIST,
        value=[TOOLS_LIST, *sorted(n for n in fake_tools(Seen(int)) if n.startswith("test."))],
        shown=tool_names,
        ran=False,
    ),
    Case(id="ok-secret-scrubbed", tool="test.leak", value={"key": REDACTED}),
    # Refused before anything ran, one row per step that refuses.
    Case(
        id="rate_limited",
        tool="test.echo",
        code=ErrorCode.RATE_LIMITED,
        says=f"this run may make {CALLS_PER_SECOND} calls per second (burst {BURST}); "
        "retry after 1.000 s",
        decision="deny",
        ran=False,
        prepare=drain_bucket,
    ),
    Case(
        id="run_mismatch",
        tool="test.echo",
        run_id="run-other",
        code=ErrorCode.RUN_MISMATCH,
        says="runId does not match the run this socket serves; send the value of COGNI_RUN_ID",
        decision="deny",
        ran=False,
    ),
    Case(
        id="authz_denied",
        tool="test.echo",
        grant=False,
        code=ErrorCode.AUTHZ_DENIED,
        says="this run has no sandbox grant",
        decision="deny",
        ran=False,
    ),
    Case(
        id="unknown_tool",
        tool="no.such",
        code=ErrorCode.UNKNOWN_TOOL,
        says="there is no tool named 'no.such'. Tools this run may call: tools.list, test.",
        decision="deny",
        ran=False,
    ),
    Case(
        id="policy_denied-off-the-allowlist",
        tool="other.tool",
        code=ErrorCode.POLICY_DENIED,
        says="tool 'other.tool' is not allowed for this run. Tools this run may call: "
        "tools.list, test.",
        decision="deny",
        ran=False,
    ),
    Case(
        id="policy_denied-outside-the-paths",
        tool="test.write",
        args={"path": "/etc/cron.txt"},
        code=ErrorCode.POLICY_DENIED,
        says="Cannot write to '/etc/cron.txt': path is outside the writable paths.\n"
        "Writable paths: /workspace (except /workspace/docs)",
        decision="deny",
        ran=False,
    ),
    Case(
        id="policy_denied-read-only-path",
        tool="test.write",
        args={"path": "docs/x.txt"},
        code=ErrorCode.POLICY_DENIED,
        says="Cannot write to 'docs/x.txt': path is read-only.",
        decision="deny",
        ran=False,
    ),
    Case(
        id="policy_denied-suffix",
        tool="test.write",
        args={"path": "run.sh"},
        code=ErrorCode.POLICY_DENIED,
        says="Cannot access 'run.sh': suffix not allowed.\nAllowed suffixes: .txt",
        decision="deny",
        ran=False,
    ),
    Case(
        id="invalid_args-wrong-type",
        tool="test.echo",
        args={"text": 5},
        code=ErrorCode.INVALID_ARGS,
        says="invalid arguments for test.echo: Expected `str`, got `int` - at `$.text`. "
        "The schema is in tools.list.",
        decision="deny",
        ran=False,
    ),
    Case(
        id="invalid_args-unknown-field",
        tool="test.echo",
        args={"txt": "hi"},
        code=ErrorCode.INVALID_ARGS,
        says="invalid arguments for test.echo: Object contains unknown field `txt`",
        decision="deny",
        ran=False,
    ),
    Case(
        id="invalid_args-refused-by-the-struct",
        tool="test.checked",
        args={"count": -1},
        code=ErrorCode.INVALID_ARGS,
        says="count must be 0 or more; it counts lines",
        decision="deny",
        ran=False,
    ),
    Case(
        id="invalid_args-tools-list-with-arguments",
        tool=TOOLS_LIST,
        args={"all": True},
        code=ErrorCode.INVALID_ARGS,
        says="tools.list takes no arguments: send {}",
        decision="deny",
        ran=False,
    ),
    # Allowed, then failed while or after running.
    Case(
        id="tool_failed",
        tool="test.fail",
        code=ErrorCode.TOOL_FAILED,
        says="nothing at /workspace/absent.txt; fs.list shows what is",
    ),
    Case(
        id="tool_failed-secret-scrubbed-from-the-message",
        tool="test.fail_leak",
        code=ErrorCode.TOOL_FAILED,
        says=f"upstream answered {REDACTED}",
    ),
    Case(
        id="tool_failed-output-over-the-limit",
        tool="test.big",
        code=ErrorCode.TOOL_FAILED,
        says=f"output of {MAX_OUTPUT_BYTES + 2} bytes is over this run's limit of "
        f"{MAX_OUTPUT_BYTES} bytes (limits.max_output_bytes)",
    ),
    Case(
        id="timeout",
        tool="test.slow",
        code=ErrorCode.TIMEOUT,
        says=f"test.slow ran past this run's limit of {CALL_TIMEOUT_S:g} s per call "
        "(limits.call_timeout_s) and was stopped",
        duration_ms=CALL_TIMEOUT_S * 1000,
    ),
    Case(
        id="timeout-waiting-for-a-call-slot",
        tool="test.echo",
        code=ErrorCode.TIMEOUT,
        says=f"test.echo ran past this run's limit of {CALL_TIMEOUT_S:g} s per call",
        ran=False,
        duration_ms=CALL_TIMEOUT_S * 1000,
        prepare=take_every_call_slot,
    ),
    Case(
        id="internal-tool-crashed",
        tool="test.crash",
        code=ErrorCode.INTERNAL,
        says="test.crash failed inside gatewayd; the operator's log has details",
    ),
    Case(
        id="internal-unencodable-value",
        tool="test.unencodable",
        code=ErrorCode.INTERNAL,
        says="test.unencodable failed inside gatewayd; the operator's log has details",
    ),
]


def writes_ahead(case: Case, tools: Mapping[str, Tool[Any]], reply_after_result: bool) -> bool:
    """Whether the call's entry must be durable before its tool runs: every allowed call
    with the opt-out, otherwise only a tool with side effects."""
    if case.decision == "deny":
        return False
    spec = tools.get(case.tool)
    return not reply_after_result or (spec is not None and spec.manifest.side_effects)


def assert_answer(case: Case, response: Response) -> None:
    assert response.toolCallId == TOOL_CALL_ID
    if case.code is None:
        assert response.ok, response
        assert response.errorCode is None
        assert isinstance(response.value, msgspec.Raw)
        assert case.shown(msgspec.json.decode(response.value)) == case.value
    else:
        assert not response.ok
        assert response.errorCode is case.code, response
        assert response.safeMessage is not None
        assert case.says in response.safeMessage, response.safeMessage
        assert SECRET not in response.safeMessage
        assert response.value is None


def assert_entries(
    case: Case, entries: list[dict[str, Any]], response: Response, run: Run
) -> tuple[int, int]:
    """The call's two entries, as the audit log holds them; returns their seqs."""
    assert [e["kind"] for e in entries] == ["call", "result"], entries
    call_entry, result_entry = entries
    for entry in entries:
        assert entry["runId"] == run.run_id  # the run the socket serves, never the claim
        assert entry["toolCallId"] == TOOL_CALL_ID
        assert entry["tool"] == case.tool
    assert call_entry["decision"] == case.decision
    assert call_entry["argsDigest"] == args_digest(case.args)
    assert call_entry["peer"] == msgspec.to_builtins(PEER)
    assert result_entry["durationMs"] == case.duration_ms
    if case.code is None:
        assert isinstance(response.value, msgspec.Raw)
        payload = bytes(response.value)
        assert "errorCode" not in call_entry and "errorCode" not in result_entry
        assert result_entry["outputDigest"] == sha256_digest(payload)
        assert result_entry["outputBytes"] == len(payload)
    elif case.decision == "deny":
        # Refused before it ran: the call entry says why; the result only how it ended.
        assert call_entry["errorCode"] == str(case.code)
        assert call_entry["safeMessage"] == response.safeMessage
        assert result_entry["errorCode"] == str(case.code)
        assert "safeMessage" not in result_entry
    else:
        # Allowed, then failed: the call entry is the allow written before it ran.
        assert "errorCode" not in call_entry
        assert result_entry["errorCode"] == str(case.code)
        assert result_entry["safeMessage"] == response.safeMessage
        assert "outputDigest" not in result_entry
    return call_entry["seq"], result_entry["seq"]


def assert_counted_once(case: Case, run: Run) -> None:
    assert run.calls == 1
    if case.code is None:
        assert (run.allowed, run.denied_by_code) == (1, {})
    else:
        assert (run.allowed, run.denied_by_code) == (0, {str(case.code): 1})


@pytest.mark.parametrize("reply_after_result", [True, False], ids=["reply-after-result", "opt-out"])
@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
async def test_each_call_gets_its_answer_its_two_entries_and_waits_for_them_as_it_must(
    case: Case, reply_after_result: bool, tmp_path: Path, autojump_clock: MockClock
) -> None:
    log = FakeAuditLog()
    seen = Seen(lambda: log.durable_seq)
    tools = fake_tools(seen)
    run = make_run(tmp_path, grant=case.grant)
    dispatcher = make_dispatcher(log, tools, autojump_clock, reply_after_result=reply_after_result)
    case.prepare(run, autojump_clock.current_time())

    response = await dispatcher.handle(run, call(case.tool, case.args, run_id=case.run_id), PEER)

    assert_answer(case, response)
    call_seq, result_seq = assert_entries(case, log.entries, response, run)
    assert_counted_once(case, run)
    assert [tool for tool, _ in seen.runs] == ([case.tool] if case.ran else [])
    write_ahead = writes_ahead(case, tools, reply_after_result)
    if case.ran:
        # Write-ahead: a tool with effects starts only once its call entry is durable;
        # one without waits for nothing (its answer waits for both entries at once).
        [(_, durable_at_start)] = seen.runs
        assert (durable_at_start >= call_seq) is write_ahead
    if reply_after_result:
        # RESULT_BEFORE_REPLY: answered only once the result entry is durable.
        assert log.waits == [call_seq, result_seq] if write_ahead else [result_seq]
        assert log.durable_seq >= result_seq
    else:
        assert log.waits == ([call_seq] if write_ahead else [])
        assert log.durable_seq < result_seq


async def test_a_refusal_names_every_tool_the_run_may_call(
    tmp_path: Path, autojump_clock: MockClock
) -> None:
    """ACTIONABLE_ERRORS: an unknown or disallowed tool's answer lists what is allowed
    (tools.list first, then the allowed tools, sorted), never the tools it may not call."""
    tools = fake_tools(Seen(int))
    dispatcher = make_dispatcher(FakeAuditLog(), tools, autojump_clock)
    allowed = sorted(name for name in tools if name.startswith("test."))
    sentence = f"Tools this run may call: {', '.join([TOOLS_LIST, *allowed])}."
    for tool in ("no.such", "other.tool"):
        response = await dispatcher.handle(make_run(tmp_path), call(tool), PEER)
        assert response.safeMessage is not None
        assert response.safeMessage.endswith(sentence)
        assert response.safeMessage.count("other.tool") == (tool == "other.tool")


async def test_the_real_audit_log_holds_what_the_fake_one_does(
    tmp_path: Path, autojump_clock: MockClock
) -> None:
    """Every row of the table through the real writer (a file, its flusher thread, no
    fsync): the same two entries per call, durable before each answer, and a chain that
    verifies. The fake log stands in for this one everywhere else."""
    path = tmp_path / "audit" / "audit.jsonl"
    async with open_audit_log(path, fsync=False, sync_delay_s=NEVER_DUE_S) as audit:
        for i, case in enumerate(CASES):
            seen = Seen(lambda: audit.durable_seq)
            dispatcher = make_dispatcher(audit, fake_tools(seen), autojump_clock)
            run = make_run(tmp_path / f"ws{i}", grant=case.grant)
            case.prepare(run, autojump_clock.current_time())
            first = audit.last_seq + 1
            request = call(case.tool, case.args, run_id=case.run_id)
            response = await dispatcher.handle(run, request, PEER)
            assert audit.durable_seq == audit.last_seq, case.id
            assert_answer(case, response)
            written = [e for e in read_entries(path) if e["seq"] >= first]
            assert_entries(case, written, response, run)
    assert verify_file(path).ok


# --- the rule review --------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ReviewCase:
    """A reviewable call (test.write on notes.txt) and what the reviewer answers."""

    id: str
    answer: ReviewOutcome | Exception | None
    applies: bool = True
    code: ErrorCode | None = None
    says: str = ""
    asked: bool = True
    # The call entry's ``review`` (before its ``ruleset``); None: no review field.
    audited: ReviewOutcome | None = None
    duration_ms: float = 0.0
    prepare: Callable[[Run, float], None] = nothing


ALLOW: Final = ReviewOutcome(
    allowed=True, reason="notes are fine", source=Source.MODEL, model=REVIEWER_ALIAS
)
DENY: Final = ReviewOutcome(
    allowed=False, reason="it looks like a credential", source=Source.MODEL, model=REVIEWER_ALIAS
)
DENY_WITHOUT_REASON: Final = ReviewOutcome(allowed=False, reason="", source=Source.STRUCTURED)
FAILED: Final = ReviewOutcome(
    allowed=False,
    reason=review_failed_reason("the reviewer did not answer in time", transient=True),
    source=Source.FAILED,
    model=REVIEWER_ALIAS,
    failure="no answer within 15 s",
)
CRASHED: Final = review_crashed(RuntimeError(), model=REVIEWER_ALIAS, latency_ms=0.0)

REVIEW_CASES: Final = [
    ReviewCase(id="allow", answer=ALLOW, audited=ALLOW),
    ReviewCase(
        id="deny",
        answer=DENY,
        code=ErrorCode.REVIEW_DENIED,
        says="the rule review denied this call: it looks like a credential",
        audited=DENY,
    ),
    ReviewCase(
        id="deny-without-a-reason",
        answer=DENY_WITHOUT_REASON,
        code=ErrorCode.REVIEW_DENIED,
        says="the rule review denied this call: no reason given",
        audited=DENY_WITHOUT_REASON,
    ),
    # FAIL_CLOSED: a review that fails is a deny that says the review failed.
    ReviewCase(
        id="failure",
        answer=FAILED,
        code=ErrorCode.REVIEW_DENIED,
        says=FAILED.reason,
        audited=FAILED,
    ),
    ReviewCase(
        id="reviewer-raises",
        answer=RuntimeError("a reply the reviewer could not survive"),
        code=ErrorCode.REVIEW_DENIED,
        says=review_failed_reason(CRASHED_WORDS[0], transient=CRASHED_WORDS[1]),
        audited=CRASHED,
    ),
    ReviewCase(id="nothing-reviews-this-call", answer=None),
    ReviewCase(id="review-does-not-apply", answer=DENY, applies=False, asked=False),
    ReviewCase(
        id="timeout-waiting-for-a-call-slot",
        answer=ALLOW,
        code=ErrorCode.TIMEOUT,
        says=f"no free call slot within {CALL_TIMEOUT_S:g} s (limits.max_concurrent_calls); "
        "try again when fewer calls are in flight",
        asked=False,
        duration_ms=CALL_TIMEOUT_S * 1000,
        prepare=take_every_call_slot,
    ),
]


@pytest.mark.parametrize("case", REVIEW_CASES, ids=[case.id for case in REVIEW_CASES])
async def test_the_rule_review_decides_a_call_and_the_call_entry_records_it(
    case: ReviewCase, tmp_path: Path, autojump_clock: MockClock
) -> None:
    log = FakeAuditLog()
    seen = Seen(lambda: log.durable_seq)
    reviewer = FakeReviewer(case.answer, applies=case.applies)
    dispatcher = make_dispatcher(log, fake_tools(seen), autojump_clock, reviewer=reviewer)
    run = make_run(tmp_path)
    case.prepare(run, autojump_clock.current_time())
    args = {"path": "notes.txt"}

    response = await dispatcher.handle(run, call("test.write", args), PEER)

    # Asked with the arguments as the tool will use them, defaults filled in.
    asked = [("test.write", {"path": "notes.txt", "text": ""})]
    assert reviewer.asked == (asked if case.asked else [])
    call_entry, result_entry = log.entries
    if case.audited is None:
        assert "review" not in call_entry
    else:
        ruleset = RuleSet.from_section(run.spec.policy.review).digest
        assert call_entry["review"] == {**case.audited.audit(), "ruleset": ruleset}
    assert result_entry["durationMs"] == case.duration_ms
    assert run.calls == 1
    if case.code is None:
        assert response.ok, response
        assert call_entry["decision"] == "allow"
        assert [tool for tool, _ in seen.runs] == ["test.write"]
    else:
        assert (response.errorCode, response.safeMessage) == (case.code, case.says)
        assert call_entry["decision"] == "deny"
        assert call_entry["errorCode"] == result_entry["errorCode"] == str(case.code)
        assert call_entry["safeMessage"] == case.says
        assert seen.runs == []
        assert run.denied_by_code == {str(case.code): 1}


@pytest.mark.parametrize(
    ("tool", "args"),
    [
        ("test.write", {"path": "/etc/cron.txt"}),  # refused by the policy first
        ("test.echo", {"text": 5}),  # refused by the schema first
        (TOOLS_LIST, {}),  # reveals only what the run may already do
    ],
)
async def test_no_call_is_reviewed_that_the_review_could_not_let_through_or_need_not(
    tool: str, args: dict[str, Any], tmp_path: Path, autojump_clock: MockClock
) -> None:
    reviewer = FakeReviewer(ALLOW)
    dispatcher = make_dispatcher(
        FakeAuditLog(), fake_tools(Seen(int)), autojump_clock, reviewer=reviewer
    )
    await dispatcher.handle(make_run(tmp_path), call(tool, args), PEER)
    assert reviewer.asked == []


# --- an audit log that fails ------------------------------------------------------------


@pytest.mark.parametrize("reply_after_result", [True, False], ids=["reply-after-result", "opt-out"])
@pytest.mark.parametrize(
    ("tool", "args", "refused_with"),
    [
        ("test.write", {"path": "notes.txt"}, None),
        ("test.echo", {}, None),
        (TOOLS_LIST, {}, None),
        ("no.such", {}, ErrorCode.UNKNOWN_TOOL),
        ("test.write", {"path": "/etc/cron.txt"}, ErrorCode.POLICY_DENIED),
    ],
)
async def test_a_failed_audit_log_answers_internal_and_runs_nothing_that_has_an_effect(
    tool: str,
    args: dict[str, Any],
    refused_with: ErrorCode | None,
    reply_after_result: bool,
    tmp_path: Path,
    autojump_clock: MockClock,
) -> None:
    """Fail closed: no call with an effect runs, and no value leaves. A side-effect-free
    tool still runs when answers wait for their result entry (nothing of it leaves
    gatewayd but its answer, and that is withheld). With the opt-out a refused call
    waits for nothing, so it is answered with its refusal, as docs/configuration.md
    says (its entries may be lost; nothing ran)."""
    log = FakeAuditLog()
    log.failure = "writing the audit log failed: [Errno 28] No space left on device"
    seen = Seen(lambda: log.durable_seq)
    tools = fake_tools(seen)
    dispatcher = make_dispatcher(log, tools, autojump_clock, reply_after_result=reply_after_result)
    run = make_run(tmp_path)

    response = await dispatcher.handle(run, call(tool, args), PEER)

    code = ErrorCode.INTERNAL
    if refused_with is not None and not reply_after_result:
        code = refused_with
    assert response.errorCode is code, response
    if code is ErrorCode.INTERNAL:
        assert response.safeMessage == AUDIT_DOWN
    assert (response.toolCallId, response.value) == (TOOL_CALL_ID, None)
    assert log.entries == []
    side_effect_free_ran = tool == "test.echo" and reply_after_result
    assert [ran for ran, _ in seen.runs] == (["test.echo"] if side_effect_free_ran else [])
    assert (run.calls, run.denied_by_code) == (1, {str(code): 1})


@pytest.mark.parametrize("tool", ["test.breaks_log", "test.breaks_log_effect"])
async def test_a_result_that_cannot_be_made_durable_is_answered_internal_never_with_its_value(
    tool: str, tmp_path: Path, autojump_clock: MockClock
) -> None:
    """The log fails while the tool runs: its value is withheld and the call is counted
    once, as internal."""
    log = FakeAuditLog()
    dispatcher = make_dispatcher(log, fake_tools(Seen(int), breaks_log=log), autojump_clock)
    run = make_run(tmp_path)

    response = await dispatcher.handle(run, call(tool), PEER)

    assert (response.errorCode, response.safeMessage) == (ErrorCode.INTERNAL, AUDIT_DOWN)
    assert "the-tools-value" not in msgspec.json.encode(response).decode()
    assert [e["kind"] for e in log.entries] == ["call"]  # the result was never kept
    assert (run.calls, run.denied_by_code) == (1, {"internal": 1})


# --- frames that never became requests --------------------------------------------------

BAD_FRAME: Final = b'{"v": 1, "tool": 5}'


@pytest.mark.parametrize("reply_after_result", [True, False], ids=["reply-after-result", "opt-out"])
@pytest.mark.parametrize(
    ("prepare", "code", "says"),
    [
        (nothing, ErrorCode.BAD_REQUEST, "tool must be a string"),
        (
            drain_bucket,
            ErrorCode.RATE_LIMITED,
            f"this run may make {CALLS_PER_SECOND} calls per second (burst {BURST}); retry "
            "after 1.000 s; malformed frames count too, and this connection is closed",
        ),
    ],
    ids=["bad_request", "rate_limited"],
)
async def test_a_bad_frame_is_answered_and_leaves_its_two_entries(
    prepare: Callable[[Run, float], None],
    code: ErrorCode,
    says: str,
    reply_after_result: bool,
    tmp_path: Path,
    autojump_clock: MockClock,
) -> None:
    log = FakeAuditLog()
    dispatcher = make_dispatcher(
        log, fake_tools(Seen(int)), autojump_clock, reply_after_result=reply_after_result
    )
    run = make_run(tmp_path)
    prepare(run, autojump_clock.current_time())
    err = FrameError(
        code=ErrorCode.BAD_REQUEST,
        message="tool must be a string",
        tool_call_id="bad",
        fatal=False,
        raw=BAD_FRAME,
    )

    response = await dispatcher.refuse_frame(run, err, PEER)

    assert (response.toolCallId, response.errorCode, response.safeMessage) == ("bad", code, says)
    call_entry, result_entry = log.entries
    assert (call_entry["kind"], call_entry["decision"], call_entry["errorCode"]) == (
        "call",
        "deny",
        str(code),
    )
    assert call_entry["detail"] == {
        "frameBytes": len(BAD_FRAME),
        "frameDigest": sha256_digest(BAD_FRAME),
    }
    assert (result_entry["kind"], result_entry["errorCode"]) == ("result", str(code))
    # Nothing ran, so nothing is written ahead: one flush for both, or none (opt-out).
    assert log.waits == ([result_entry["seq"]] if reply_after_result else [])
    assert (run.calls, run.denied_by_code) == (1, {str(code): 1})


async def test_a_bad_frame_on_a_failed_log_is_answered_internal(
    tmp_path: Path, autojump_clock: MockClock
) -> None:
    log = FakeAuditLog()
    log.failure = "disk full"
    dispatcher = make_dispatcher(log, fake_tools(Seen(int)), autojump_clock)
    run = make_run(tmp_path)
    err = FrameError(code=ErrorCode.BAD_REQUEST, message="bad", tool_call_id="bad", fatal=False)
    response = await dispatcher.refuse_frame(run, err, PEER)
    assert (response.toolCallId, response.errorCode, response.safeMessage) == (
        "bad",
        ErrorCode.INTERNAL,
        AUDIT_DOWN,
    )
    assert (run.calls, run.denied_by_code) == (1, {"internal": 1})


# --- cancellation -----------------------------------------------------------------------

Where = Literal["tool", "review", "call-entry", "result-entry"]


@dataclass(frozen=True, kw_only=True)
class CancelCase:
    """Where a call is when its run (or gatewayd) is cancelled, and what the log must
    hold afterwards."""

    where: Where
    tool: str
    args: dict[str, Any] = field(default_factory=dict)
    decision: Decision = "allow"
    # The result entry's errorCode (None: it ran and says what happened).
    result_code: str | None = str(ErrorCode.INTERNAL)
    ran: bool = False


CANCEL_CASES: Final = [
    CancelCase(where="tool", tool="test.hang", ran=True),
    CancelCase(where="review", tool="test.echo", decision="deny"),
    # Waiting for its write-ahead entry: it never ran.
    CancelCase(where="call-entry", tool="test.write", args={"path": "notes.txt"}),
    # Ran, then waited for its result entry: the result says what happened.
    CancelCase(where="result-entry", tool="test.echo", result_code=None, ran=True),
]


@pytest.mark.parametrize("case", CANCEL_CASES, ids=[case.where for case in CANCEL_CASES])
async def test_a_cancelled_call_is_not_answered_and_still_gets_its_result_entry(
    case: CancelCase, tmp_path: Path, autojump_clock: MockClock
) -> None:
    """The run or gatewayd ends under a call: no answer, both entries recorded (the
    flusher writes what is queued), the call counted once."""
    log = FakeAuditLog()
    seen = Seen(lambda: log.durable_seq)
    reviewer = FakeReviewer(None, hang=True) if case.where == "review" else None
    dispatcher = make_dispatcher(log, fake_tools(seen), autojump_clock, reviewer=reviewer)
    run = make_run(tmp_path)
    reached = {
        "tool": seen.started,
        "review": reviewer.reviewing if reviewer is not None else None,
        "call-entry": log.stalled,
        "result-entry": log.stalled,
    }[case.where]
    assert reached is not None
    log.stall = case.where in ("call-entry", "result-entry")
    answers: list[Response] = []

    async def ask() -> None:
        answers.append(await dispatcher.handle(run, call(case.tool, case.args), PEER))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask)
        # Virtual time: a call that never gets there fails the test at once, no hang.
        with trio.fail_after(NEVER_DUE_S):
            await reached.wait()
        nursery.cancel_scope.cancel()

    assert answers == []
    call_entry, result_entry = log.entries
    assert (call_entry["kind"], call_entry["decision"]) == ("call", case.decision)
    assert result_entry["kind"] == "result"
    assert result_entry.get("errorCode") == case.result_code
    if case.result_code is not None:
        stopped = call_entry if case.decision == "deny" else result_entry
        assert stopped["safeMessage"] == CANCELLED_MESSAGE
    assert [tool for tool, _ in seen.runs] == ([case.tool] if case.ran else [])
    assert run.calls == 1
    assert run.denied_by_code == ({} if case.result_code is None else {case.result_code: 1})
