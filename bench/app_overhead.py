"""Where the time of an app's invocation goes: the app's model, the review of its calls
(a miss and a cache hit), its tools, its sandbox, and the gateway's own work per
reviewed call beside the same call without review, measured in the same run.

    .venv/bin/python bench/app_overhead.py [--reps 25] [--plain-reads 10] [--no-fsync]

Needs root and /usr/bin/bwrap. One in-process gatewayd with the real OS sandbox (its own
network-namespace prefix and sandbox uid range) and two fake providers
(``tests/fakeprovider.py``, real OpenAI-compatible HTTP servers on loopback, in one child
process of their own so serving them takes no GIL from the daemon):

- the **app's model**, scripted by the conversation so far (the number of tool results
  it has been sent picks the next step, so one stateless script serves every
  invocation): 10 tool calls, one per turn (``list`` twice, ``read`` four times,
  ``write`` twice, ``edit`` once, ``exec`` once), then a final answer: 11 turns;
- the **reviewer**, answering ``ALLOW`` at once.

A workspace holds one app (``APP.md`` written here, installed with ``install_app``),
and a caller run with review off whose policy allows ``app_*``. The app's tool is
called **through the dispatcher** (``Dispatcher.handle`` on the caller run, as the
caller's socket would; not through ``cogni-tool``, which would add the caller's own
sandbox start and Python start-up to every figure). Each repetition makes the same
invocation twice: first with the decision cache emptied (every one of the 10 reviews
asks the reviewer: a **miss**), then again (the same calls with the same arguments under
the same rules: every review is a **cache hit**). Then the same ``fs.read`` (a workspace
file the app reads too) through the dispatcher on the caller run, whose policy has review
off: ``--plain-reads`` calls back to back, and as many each right after a model call of
the app's alias (not counted in the figure), since each call of the app follows its
model turn and meets the caches that turn left cold: that is the baseline the app's
calls are compared with. The first repetition warms up and is not counted.

Measured from outside gatewayd's code, by wrappers this script puts around it (wall time
and the trio thread's CPU time of each await): the dispatcher's ``handle`` (each call's
whole dispatch, the app call's and the child's) and its review step, step 7 (the app's
live rules, a call slot, the reviewer); each built-in tool's runner (the tool's own
work); the reviewer's ``review`` (cache lookup included); ``model_client.complete`` as
the conversation and the reviewer call it (the model calls, by alias); the run manager's
``start_child`` and ``end`` (the child run's sandbox: uid, network namespace, lease,
socket, audit entries); and the audit log's ``durable`` (the waits for a flush). The
gateway's own part of a call is its dispatch less its tool and step 7: admission,
policy, audit entries (durable: every ``fdatasync`` is in it), the limiter, encoding and
scrubbing the answer. The trio thread's CPU time is the steadier figure for a cache hit,
which does no I/O: one ``fdatasync`` moves a call's wall time by more than a hit costs.

Prints medians over the counted repetitions; never asserts on time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final, TypeVar

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import ROOT, env_info, percentile

from gatewayd import model_client
from gatewayd.apps.install import install_app
from gatewayd.audit import Peer
from gatewayd.config import GatewaydConfig, ModelAlias, SandboxUids
from gatewayd.daemon import Daemon, open_daemon
from gatewayd.logs import configure_logging
from gatewayd.protocol import PROTOCOL_VERSION, Request, Response
from gatewayd.review import reviewer as reviewer_module
from gatewayd.review.reviewer import ReviewOutcome, Source
from gatewayd.runs import Grant, Run, RunLimits, RunRequest
from gatewayd.tools.registry import ToolContext, ToolRegistry, ToolRunner

T = TypeVar("T")

APP_ID: Final = "bench-app"
APP_TOOL: Final = "app_bench_app"
APP_MODEL: Final = "app-model"
REVIEWER: Final = "reviewer"
# Sandbox uids of this benchmark: a random 64-uid slice of 1.6e9..1.65e9, as
# bench/sandbox_launch.py takes (away from the tests' 1.7e9.. and the default 1.8e9).
UID_REGION_BASE: Final = 1_600_000_000
UID_REGION_SLICES: Final = 50_000
UID_COUNT: Final = 64
# The caller's workspace file the app and the plain run both read.
NOTES: Final = "notes.md"
NOTES_TEXT: Final = "- the workspace's own note\n" * 20
# The app's read of it: the same fs.read as the plain run's, compared call for call.
SAME_READ: Final = f"/workspace/{NOTES}"

# The app's model's steps: (its tool, the arguments), one call per turn; then it answers.
# Paths are relative to /app (the conversation rebases them), except the workspace's.
STEPS: Final[tuple[tuple[str, dict[str, Any]], ...]] = (
    ("list", {"path": "data"}),
    ("write", {"path": "data/first.md", "content": "- first note\n"}),
    ("read", {"path": "data/first.md"}),
    ("edit", {"path": "data/first.md", "old": "first", "new": "edited"}),
    ("read", {"path": SAME_READ}),
    ("list", {}),
    ("read", {"path": "APP.md"}),
    ("write", {"path": "data/second.md", "content": "- second note\n"}),
    ("read", {"path": "data/second.md"}),
    ("exec", {"command": "ls -l /app/data"}),
)
FINAL_ANSWER: Final = "Stored two notes in data/ and listed them."

APP_MD: Final = f"""\
---
name: {APP_ID}
title: Bench App
description: Keeps two notes in data/ and lists them; the app of bench/app_overhead.py.
limits:
  turns: 16
  tool_calls: 16
  tokens: 200000
  wall_time_s: 120
---

## System Prompt

You keep notes in data/ and list what you kept.

## Rules

### Allow
- Listing, reading, writing and editing files in data/
- Reading the app's own files and the caller's workspace
- Listing data/ with ls

### Deny
- Writing, editing or creating any file outside data/
- Storing anything that looks like a password, a private key or an access token
"""

CALLER_POLICY: Final = f"""\
version: 1
name: bench-app-caller
description: the caller of bench/app_overhead.py; review off, limits out of the way.
tools:
  allow: [fs.read, app_*]
filesystem:
  paths:
    workspace: {{root: ., mode: rw}}
model_access:  # the budget pays for every invocation's turns (--reps of them): out of the way
  models: [{APP_MODEL}]
  max_requests: 1000000
  max_tokens: 1000000000
review: {{mode: "off", model: {REVIEWER}}}
limits: {{call_timeout_s: 120, calls_per_second: 1000000, burst: 1000000}}
sandbox: {{timeout_s: 60, cpu_s: 30, max_processes: 64}}
"""

# The two fakes in one child process: argv[1] is the repository root, argv[2] the app's
# steps as JSON. It prints the two ports and serves until stdin closes.
FAKES: Final = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from tests.fakeprovider import Call, FakeProvider, Text
steps = json.loads(sys.argv[2])
final = sys.argv[3]

def app_model(body):
    done = sum(1 for m in body["messages"] if m.get("role") == "tool")
    if done >= len(steps):
        return Text(content=final)
    name, args = steps[done]
    return Text(content=None, calls=(Call(name=name, arguments=args),))

with FakeProvider() as model, FakeProvider() as reviewer:
    model.respond = app_model
    reviewer.respond = lambda body: Text(content="ALLOW")
    print(model.port, reviewer.port, flush=True)
    sys.stdin.read()
"""


@contextmanager
def fakes() -> Iterator[tuple[int, int]]:
    """The app's model and the reviewer in a child process; yields their ports."""
    proc = subprocess.Popen(
        [sys.executable, "-c", FAKES, str(ROOT), json.dumps(STEPS), FINAL_ANSWER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ports = proc.stdout.readline().split()
        if len(ports) != 2 or not all(p.isdigit() for p in ports):
            raise RuntimeError(f"the fake providers did not start (printed {ports!r})")
        yield int(ports[0]), int(ports[1])
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --- instrumentation: wrappers put around gatewayd's objects, no code of its changed ----


@dataclasses.dataclass
class Span:
    """One timed await: what it was, for which run, when it started and how long it
    took (seconds, ``time.perf_counter``)."""

    what: str
    run_id: str
    start: float
    seconds: float
    # The trio thread's CPU time meanwhile (time.thread_time): all of it this await's,
    # since the bench makes one call at a time; work handed to a worker thread (a file
    # tool's I/O, litellm) or the audit's flusher thread is not in it.
    cpu: float
    source: str = ""  # a review's outcome source (model, cache), a call's tool
    path: str = ""  # a call's path argument, as the dispatcher got it

    def inside(self, other: Span) -> bool:
        """Did this await start and end within ``other``?"""
        end = other.start + other.seconds
        return other.start <= self.start and self.start + self.seconds <= end


@dataclasses.dataclass
class Recorder:
    """Every span since the last :meth:`take`."""

    spans: list[Span] = dataclasses.field(default_factory=list)

    def take(self) -> list[Span]:
        out, self.spans = self.spans, []
        return out

    async def time(
        self, what: str, run_id: str, call: Awaitable[T], source: str = ""
    ) -> tuple[T, Span]:
        t, c = time.perf_counter(), time.thread_time()
        try:
            value = await call
        finally:
            span = Span(what, run_id, t, time.perf_counter() - t, time.thread_time() - c, source)
            self.spans.append(span)
        return value, span


@dataclasses.dataclass(frozen=True)
class TimedRunner:
    """A tool's runner, timed: the tool's own work."""

    inner: ToolRunner[Any]
    tool: str
    recorder: Recorder

    async def run(self, args: Any, ctx: ToolContext) -> Any:
        value, _ = await self.recorder.time(
            "tool", ctx.run_id, self.inner.run(args, ctx), source=self.tool
        )
        return value


def instrument(daemon: Daemon, recorder: Recorder) -> None:
    """Wrap the dispatcher, the built-in tools' runners, the reviewer, the model calls
    and the child runs' start and end, each recording into ``recorder``."""
    dispatcher = daemon.dispatcher
    handle = dispatcher.handle

    async def timed_handle(
        run: Run, req: Request, peer: Peer, *, caller_gone: Callable[[], bool] | None = None
    ) -> Response:
        response, span = await recorder.time(
            "dispatch", run.run_id, handle(run, req, peer, caller_gone=caller_gone), source=req.tool
        )
        path = req.args.get("path") if isinstance(req.args, dict) else None
        span.path = path if isinstance(path, str) else ""
        return response

    dispatcher.handle = timed_handle  # type: ignore[method-assign]
    dispatcher.tools = ToolRegistry(
        dataclasses.replace(tool, runner=TimedRunner(tool.runner, name, recorder))
        for name, tool in dispatcher.tools.items()
    )

    # Step 7 whole: the app's rules as they are now (a stat of its APP.md), a call slot,
    # and the reviewer.
    step7 = dispatcher._review

    async def timed_step7(
        run: Run, req: Request, args: Any
    ) -> tuple[ReviewOutcome | None, str | None]:
        value, _ = await recorder.time("step7", run.run_id, step7(run, req, args))
        return value

    dispatcher._review = timed_step7  # type: ignore[method-assign]

    reviewer = daemon.reviewer
    review = reviewer.review

    async def timed_review(*args: Any, **kwargs: Any) -> ReviewOutcome | None:
        outcome, span = await recorder.time("review", "", review(*args, **kwargs))
        span.source = str(outcome.source) if outcome is not None else "none"
        return outcome

    reviewer.review = timed_review  # type: ignore[method-assign]

    complete = model_client.complete

    async def timed_complete(*args: Any, **kwargs: Any) -> model_client.Completion:
        alias = str(kwargs.get("alias_name", ""))
        answer, _ = await recorder.time("model", "", complete(*args, **kwargs), source=alias)
        return answer

    # The conversation calls model_client.complete; the reviewer its own import of it.
    model_client.complete = timed_complete
    reviewer_module.complete = timed_complete  # type: ignore[attr-defined]

    # Waits for the audit log's flush (the entries before them made durable).
    audit = daemon.audit
    durable = audit.durable

    async def timed_durable(seq: int) -> None:
        await recorder.time("durable", "", durable(seq))

    audit.durable = timed_durable  # type: ignore[method-assign]

    runs = daemon.runs
    start_child, end = runs.start_child, runs.end

    async def timed_start_child(*args: Any, **kwargs: Any) -> Run:
        child, span = await recorder.time("child_start", "", start_child(*args, **kwargs))
        span.run_id = child.run_id
        return child

    async def timed_end(run_id: str, reason: str = "ended") -> dict[str, Any] | None:
        summary, _ = await recorder.time("run_end", run_id, end(run_id, reason))
        return summary

    runs.start_child = timed_start_child  # type: ignore[method-assign]
    runs.end = timed_end  # type: ignore[method-assign]


# --- one invocation's figures ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CallSpans:
    """One call through the dispatcher: its whole dispatch, its tool's own run, and for
    a reviewed call its step 7 and the reviewer's part of that."""

    dispatch: Span
    tool: Span
    step7: Span | None = None
    review: Span | None = None

    @property
    def name(self) -> str:
        return self.dispatch.source

    @property
    def less_tool(self) -> float:
        """The gateway's whole part of the call, its review included (wall clock)."""
        return self.dispatch.seconds - self.tool.seconds

    @property
    def cpu_less_tool(self) -> float:
        """The same in the trio thread's CPU time."""
        return self.dispatch.cpu - self.tool.cpu

    @property
    def gateway(self) -> float:
        """The dispatch less the tool and step 7."""
        return self.less_tool - (self.step7.seconds if self.step7 is not None else 0.0)


@dataclasses.dataclass
class Invocation:
    """The parts of one invocation, in seconds, from its spans."""

    total: float
    model: float
    model_turns: int
    review: float
    step7: float
    reviewer_model: float
    own_audit_waits: int
    own_audit: float
    fsyncs: int
    review_sources: list[str]
    fs: float
    fs_calls: int
    exec: float
    child_start: float
    child_end: float
    calls_dispatch: float
    calls: int
    per_call: list[CallSpans]

    @property
    def gateway(self) -> float:
        """The child's calls' dispatch less their tools and the reviewer (step 7's own
        work, its line in the report, stays in it)."""
        return self.calls_dispatch - self.fs - self.exec - self.review

    @property
    def rest(self) -> float:
        """The invocation less everything above: the app call's own dispatch, its
        audit entries, data/ compared before and after, the conversation's work."""
        return self.total - self.model - self.calls_dispatch - self.child_start - self.child_end


def summarize(spans: list[Span], caller_id: str, fsyncs: int) -> Invocation:
    (app_call,) = [s for s in spans if s.what == "dispatch" and s.run_id == caller_id]
    (start,) = [s for s in spans if s.what == "child_start"]
    child = start.run_id
    (end,) = [s for s in spans if s.what == "run_end" and s.run_id == child]
    calls = [s for s in spans if s.what == "dispatch" and s.run_id == child]
    tools = [s for s in spans if s.what == "tool" and s.run_id == child]
    reviews = [s for s in spans if s.what == "review"]
    step7 = [s for s in spans if s.what == "step7" and s.run_id == child]
    models = [s for s in spans if s.what == "model"]
    if not len(tools) == len(reviews) == len(step7) == len(calls):
        raise RuntimeError(
            f"{len(calls)} calls, {len(tools)} tools run, {len(reviews)} reviews: every call "
            "of the app should have been reviewed and run (is the reviewer allowing?)"
        )
    fs = [s for s in tools if s.source != "sandbox.exec"]
    # The invocation's own waits for the audit log (app_invoked, each turn's agent_turn,
    # app_result), not those inside its calls' dispatch or its child run's start and end.
    inner = [*calls, start, end]
    own_audit = [
        s
        for s in spans
        if s.what == "durable" and s.inside(app_call) and not any(s.inside(o) for o in inner)
    ]
    app_turns = [s for s in models if s.source == APP_MODEL]
    return Invocation(
        total=app_call.seconds,
        model=sum(s.seconds for s in app_turns),
        model_turns=len(app_turns),
        review=sum(s.seconds for s in reviews),
        step7=sum(s.seconds for s in step7),
        reviewer_model=sum(s.seconds for s in models if s.source == REVIEWER),
        own_audit_waits=len(own_audit),
        own_audit=sum(s.seconds for s in own_audit),
        fsyncs=fsyncs,
        review_sources=[s.source for s in reviews],
        fs=sum(s.seconds for s in fs),
        fs_calls=len(fs),
        exec=sum(s.seconds for s in tools if s.source == "sandbox.exec"),
        child_start=start.seconds,
        child_end=end.seconds,
        calls_dispatch=sum(s.seconds for s in calls),
        calls=len(calls),
        per_call=[
            CallSpans(dispatch=c, tool=t, step7=st, review=rv)
            for c, t, st, rv in zip(calls, tools, step7, reviews, strict=True)
        ],
    )


# --- the run ------------------------------------------------------------------------


def bench_config(base: Path, model_port: int, reviewer_port: int, fsync: bool) -> GatewaydConfig:
    """A daemon with the OS sandbox, its own namespace prefix and uids, and the two
    fakes as model aliases."""
    uids = UID_REGION_BASE + secrets.randbelow(UID_REGION_SLICES) * 1024

    def alias(port: int) -> ModelAlias:
        return ModelAlias(
            provider="openai", model="fake-model", api_base=f"http://127.0.0.1:{port}/v1"
        )

    return GatewaydConfig(
        state_dir=base / "state",
        policy_dirs=(base,),
        netns_prefix=f"cgtb{secrets.token_hex(4)}-",
        sandbox_uids=SandboxUids(base=uids, count=UID_COUNT),
        models={APP_MODEL: alias(model_port), REVIEWER: alias(reviewer_port)},
        audit_fsync=fsync,
    )


async def measure(args: argparse.Namespace, ports: tuple[int, int], base: Path) -> dict[str, Any]:
    ws = base / "ws"
    ws.mkdir()
    (ws / NOTES).write_text(NOTES_TEXT)
    source = base / "app-source"
    source.mkdir()
    (source / "APP.md").write_text(APP_MD)
    install_app(source, ws)
    policy = base / "caller.yaml"
    policy.write_text(CALLER_POLICY)
    recorder = Recorder()
    peer = Peer(pid=os.getpid(), uid=os.getuid(), gid=os.getgid())
    out: dict[str, Any] = {"miss": [], "hit": [], "plain": [], "plain_after_model": []}
    async with open_daemon(
        bench_config(base, *ports, fsync=not args.no_fsync), preload=True
    ) as daemon:
        if not daemon.runs.support.available:
            raise RuntimeError(f"no OS sandbox here: {daemon.runs.support.reason}")
        await trio.to_thread.run_sync(model_client.preload)  # as at daemon start
        caller = await daemon.runs.start(
            RunRequest(
                workspacePath=str(ws),
                policy=str(policy),
                actorId="bench",
                tenantId="bench",
                grant=Grant(allowSandbox=True),
                limits=RunLimits(maxMemoryMb=2048),
            ),
            policy_paths=True,
        )
        instrument(daemon, recorder)
        handle: Callable[[Run, Request, Peer], Awaitable[Response]] = daemon.dispatcher.handle
        seq = 0

        async def call(tool: str, call_args: dict[str, Any]) -> Response:
            nonlocal seq
            seq += 1
            request = Request(
                v=PROTOCOL_VERSION,
                runId=caller.run_id,
                toolCallId=f"bench.{seq}",
                tool=tool,
                args=call_args,
            )
            response = await handle(caller, request, peer)
            if not response.ok:
                raise RuntimeError(f"{tool} failed: {response.errorCode}: {response.safeMessage}")
            return response

        async def invoke() -> Invocation:
            recorder.take()
            fsyncs = daemon.audit.fsync_count
            response = await call(APP_TOOL, {"prompt": "Keep two notes and list them."})
            value = json.loads(bytes(response.value))
            if not value.get("ok") or value.get("answer") != FINAL_ANSWER:
                raise RuntimeError(f"the invocation did not finish as scripted: {value}")
            return summarize(recorder.take(), caller.run_id, daemon.audit.fsync_count - fsyncs)

        alias = daemon.runs.config.models[APP_MODEL]
        turn = [{"role": "user", "content": "Keep two notes and list them."}]

        async def plain_reads(after_model: bool) -> list[CallSpans]:
            """The baseline fs.read calls on the caller run (review off): back to back,
            or each right after a model call as each call of the app's follows one (so
            both meet the same cold caches; the model call is not in the figure)."""
            recorder.take()
            for _ in range(args.plain_reads):
                if after_model:
                    await model_client.complete(
                        alias, turn, timeout_s=30, max_tokens=64, alias_name=APP_MODEL
                    )
                await call("fs.read", {"path": NOTES})
            spans = [s for s in recorder.take() if s.run_id == caller.run_id]
            dispatch = [s for s in spans if s.what == "dispatch"]
            tool = [s for s in spans if s.what == "tool"]
            return [CallSpans(dispatch=d, tool=t) for d, t in zip(dispatch, tool, strict=True)]

        for rep in range(args.reps + 1):
            daemon.reviewer.cache.clear()  # every review of the first invocation asks
            miss = await invoke()
            hit = await invoke()
            plain = await plain_reads(after_model=False)
            plain_after_model = await plain_reads(after_model=True)
            if rep == 0:
                continue  # warm-up
            if set(miss.review_sources) != {str(Source.MODEL)}:
                raise RuntimeError(f"the first invocation's reviews: {miss.review_sources}")
            if set(hit.review_sources) != {str(Source.CACHE)}:
                raise RuntimeError(f"the second invocation's reviews: {hit.review_sources}")
            # A wrapper that no longer sits where gatewayd calls would time nothing.
            if miss.model_turns != len(STEPS) + 1 or miss.reviewer_model <= 0:
                raise RuntimeError(
                    f"{miss.model_turns} app model turns and {miss.reviewer_model:.4f} s of "
                    "reviewer model calls were timed: a model_client.complete wrapper is not "
                    "where the conversation or the reviewer calls it any more"
                )
            out["miss"].append(miss)
            out["hit"].append(hit)
            out["plain"] += plain
            out["plain_after_model"] += plain_after_model
        await daemon.runs.end(caller.run_id)
        out["fsyncs"] = daemon.audit.fsync_count
    return out


# --- the report ---------------------------------------------------------------------


def median(values: list[float]) -> float:
    return percentile(values, 50)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms"


def us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f} us"


def report(args: argparse.Namespace, r: dict[str, Any]) -> None:
    miss: list[Invocation] = r["miss"]
    hit: list[Invocation] = r["hit"]
    one = miss[0]

    def row(label: str, get: Callable[[Invocation], float], fmt: Callable[[float], str]) -> None:
        m, h = median([get(i) for i in miss]), median([get(i) for i in hit])
        print(f"  {label:<52}{fmt(m):>14}{fmt(h):>14}")

    print(
        f"\none invocation, {one.calls} tool calls ({one.fs_calls} fs, "
        f"{one.calls - one.fs_calls} exec), {one.model_turns} model turns; medians over "
        f"{len(miss)} repetitions\n  {'':<52}{'review miss':>14}{'cache hit':>14}"
    )
    row("the app call, whole (Dispatcher.handle on the caller)", lambda i: i.total, ms)
    row(f"model: the app's {one.model_turns} turns", lambda i: i.model, ms)
    row("  per turn", lambda i: i.model / i.model_turns, ms)
    row(f"review: {one.calls} reviews", lambda i: i.review, ms)
    row("  of which the reviewer model's calls", lambda i: i.reviewer_model, ms)
    row("  per review", lambda i: i.review / i.calls, ms)
    row("  step 7 beside it (the app's live rules, a call slot)", lambda i: i.step7 - i.review, ms)
    row(f"tools: {one.fs_calls} fs calls", lambda i: i.fs, ms)
    row("tools: 1 exec (sandbox.exec, a bwrap start)", lambda i: i.exec, ms)
    row("sandbox: child run start (RunManager.start_child)", lambda i: i.child_start, ms)
    row("sandbox: child run end (RunManager.end)", lambda i: i.child_end, ms)
    row(f"gateway: the {one.calls} calls' dispatch less tools, reviewer", lambda i: i.gateway, ms)
    row("  per call", lambda i: i.gateway / i.calls, us)
    row("rest of the invocation (by difference)", lambda i: i.rest, ms)
    row(
        f"  of which its {one.own_audit_waits} waits for the audit log (see below)",
        lambda i: i.own_audit,
        ms,
    )
    row("fdatasyncs of the audit log per invocation", lambda i: i.fsyncs, lambda v: f"{v:.0f}")
    print(
        "  (each row is its own median; they need not add up. gateway: step 7's own work "
        "is in it.\n   rest: the app call's own "
        "dispatch and audit entries, data/ compared before and after, the conversation;\n   its "
        "waits for the audit log: the app call's call and result entries, app_invoked, each "
        "turn's agent_turn, app_result)"
    )

    plain: list[CallSpans] = r["plain_after_model"]
    wall_off, cpu_off = (
        median([c.less_tool for c in plain]),
        median([c.cpu_less_tool for c in plain]),
    )
    print(
        f"\nfs.read through Dispatcher.handle, per call (medians)\n"
        f"  {'':<42}{'calls':>6}{'whole':>10}{'tool':>10}{'step 7':>10}{'review':>10}"
        f"{'gateway':>10}{'less tool':>11}{'vs off':>8}{'CPU less tool':>15}{'vs off':>8}"
    )

    def dash(value: float | None) -> str:
        return "-" if value is None else us(value)

    def same(calls: list[CallSpans]) -> list[CallSpans]:
        """The app's read of the workspace file the plain run reads."""
        return [c for c in calls if c.name == "fs.read" and c.dispatch.path == SAME_READ]

    every_miss = [c for i in miss for c in i.per_call if c.name == "fs.read"]
    every_hit = [c for i in hit for c in i.per_call if c.name == "fs.read"]
    for label, reads in (
        ("plain run, review off, back to back", r["plain"]),
        ("plain run, review off, after a model call", plain),
        ("app's child run, review miss", same(every_miss)),
        ("app's child run, cache hit", same(every_hit)),
        (f"  miss, all {len(every_miss) // len(miss)} of its fs.reads", every_miss),
        (f"  hit, all {len(every_hit) // len(hit)} of its fs.reads", every_hit),
    ):
        step7 = [c.step7.seconds for c in reads if c.step7 is not None]
        review = [c.review.seconds for c in reads if c.review is not None]
        less_tool = median([c.less_tool for c in reads])
        cpu = median([c.cpu_less_tool for c in reads])
        print(
            f"  {label:<42}{len(reads):>6}{us(median([c.dispatch.seconds for c in reads])):>10}"
            f"{us(median([c.tool.seconds for c in reads])):>10}"
            f"{dash(median(step7) if step7 else None):>10}"
            f"{dash(median(review) if review else None):>10}"
            f"{us(median([c.gateway for c in reads])):>10}{us(less_tool):>11}"
            f"{less_tool / wall_off:>7.2f}x{us(cpu):>15}{cpu / cpu_off:>7.2f}x"
        )
    print(
        "  (step 7: dispatch's review step whole, the app's live rules and a call slot "
        "included; review: the reviewer's part of it;\n   gateway: the dispatch less the "
        "tool and step 7; less tool: the gateway's whole part of the call, its review "
        "included;\n   CPU less tool: the same in the trio thread's CPU time (a miss's "
        "litellm work runs in a worker thread, not in it);\n   vs off: against the plain "
        "run's calls made each after a model call, as each call of the app is;\n   the "
        f"app's rows: its read of {SAME_READ}, as the plain run's; then all its fs.reads)"
    )
    print(f"{r['fsyncs']} fdatasyncs in all")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--reps", type=int, default=25, help="counted repetitions (a miss and a hit invocation)"
    )
    ap.add_argument(
        "--plain-reads", type=int, default=10, help="baseline fs.read calls per repetition"
    )
    ap.add_argument(
        "--no-fsync",
        action="store_true",
        help="diagnostic: audit entries written but not fdatasynced (not gatewayd)",
    )
    args = ap.parse_args()
    if os.geteuid() != 0 or not Path("/usr/bin/bwrap").exists():
        print("app_overhead needs root and /usr/bin/bwrap (the real OS sandbox)")
        return 2
    configure_logging(logging.ERROR)  # the app's progress lines are not the figures
    print(
        f"app_overhead: {env_info()}; in-process gatewayd, OS sandbox on, durable audit "
        f"{'OFF (diagnostic)' if args.no_fsync else 'on'}; the app tool called through "
        f"Dispatcher.handle; {args.reps} repetitions after 1 warm-up"
    )
    base = Path(tempfile.mkdtemp(prefix="cg-bapp-", dir="/tmp"))
    base.chmod(0o711)  # the sandbox uid passes through to its workspace and socket
    started = time.monotonic()
    try:
        with fakes() as ports:
            results = trio.run(measure, args, ports, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report(args, results)
    print(f"({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
