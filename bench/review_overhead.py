"""What the rule review (step 7) adds to a call, beside the same call without review,
measured in the same run.

    .venv/bin/python bench/review_overhead.py [--rounds 12] [--calls 1000] [--miss-calls 150]
                                              [--load-rounds 5] [--conns 8] [--seconds 2]
                                              [--profile] [--no-fsync]

One in-process gatewayd (durable audit on, no OS sandbox: the load generator is on the
host) with three runs calling ``time.now`` over their real unix sockets, driven by
``bench/load.py`` in a separate process:

- ``off``:  a policy without ``review`` (the baseline);
- ``hit``:  ``review: {mode: llm, model: reviewer, rules: ...}``; every call is identical,
  so after the warm-up every call is a decision-cache hit;
- ``miss``: the same rules with ``cache: {max_entries: 0}``, so every call asks the model:
  ``tests/fakeprovider.py`` (a real OpenAI-compatible HTTP server on loopback, in its own
  process so it does not take the daemon's GIL) answering ``ALLOW`` at once, reached
  through litellm exactly as a real provider would be.

The variants alternate in a freshly shuffled order every round. Latency is one sequential
connection; throughput is ``--conns`` connections with one call in flight on each.

Over the socket a round trip here varies by hundreds of microseconds from round to round
(mostly the audit's fdatasync), far more than a hit costs. So what a hit adds is also
measured in-process, without the socket: ``Dispatcher.handle`` (steps 3-12, the durable
audit included) for the hit and the baseline run in alternating batches, as the median of
the paired differences in wall time and in the trio thread's CPU time. A hit does no I/O
and waits only for the scheduler, so the CPU difference is what it adds to a call, and it
is steady where wall time is not: it decides MET / NOT MET. Then its parts: the
``Reviewer.review`` with the cache warm, dispatch's whole step 7, the audit entry's
``review`` field, and each piece of a hit alone; and a miss split into its parts (prompt,
litellm, bare HTTP, thread hand-off). ``--profile`` adds cProfile output for both.

Target: a cache hit adds at most 50 microseconds. Figures, never assertions.
"""

from __future__ import annotations

import argparse
import cProfile
import http.client
import json
import logging
import pstats
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import ROOT, env_info, percentile

from gatewayd import model_client, model_transport
from gatewayd.audit import Peer
from gatewayd.audit.entry import build_body, format_time
from gatewayd.audit.line import seal
from gatewayd.config import GatewaydConfig, ModelAlias
from gatewayd.daemon import Daemon, open_daemon
from gatewayd.logs import configure_logging
from gatewayd.protocol import Request
from gatewayd.review.cache import cache_key
from gatewayd.review.prompt import build_review_prompt
from gatewayd.review.reviewer import REVIEW_MAX_TOKENS, ReviewOutcome, Source
from gatewayd.review.structured import decide_structured
from gatewayd.runs import Grant, Run, RunRequest
from gatewayd.tools.clock import NowArgs

LOAD = str(ROOT / "bench" / "load.py")
TARGET_HIT_S = 50e-6
ALIAS = "reviewer"
VARIANTS = ("off", "hit", "miss")

POLICY_HEAD = """\
version: 1
name: bench-review-{name}
description: time.now with limits out of the way, for bench/review_overhead.py.
tools:
  allow: [time.now]
limits:
  call_timeout_s: 10
  calls_per_second: 1000000
  burst: 1000000
  max_concurrent_calls: 256
require_os_sandbox: false
"""
# Three rules of each kind: a small but realistic prompt; a hit's cost does not depend
# on them (the rule set is hashed once per policy load, not per call).
REVIEW = """\
review:
  mode: llm
  model: reviewer
  timeout_s: 15
  rules:
    allow:
      - Reading the host's clock
      - Reading and writing Markdown notes in the workspace
      - Listing files in the workspace
    deny:
      - Writing anything that looks like a credential or a private key
      - Reading files under .git
      - Fetching URLs outside example.org
"""
NO_CACHE = "  cache: {max_entries: 0}\n"

# The fake provider in its own process: argv[1] is the repository root; it prints its
# port, answers ALLOW to every chat request, and stops when stdin closes.
FAKE_SERVER = r"""
import sys
sys.path.insert(0, sys.argv[1])
from tests.fakeprovider import FakeProvider, Text
with FakeProvider() as fake:
    fake.respond = lambda body: Text(content="ALLOW")
    print(fake.port, flush=True)
    sys.stdin.read()
"""


@contextmanager
def fake_provider() -> Iterator[int]:
    """tests/fakeprovider.py answering ALLOW at once, in a child process; yields its port."""
    proc = subprocess.Popen(
        [sys.executable, "-c", FAKE_SERVER, str(ROOT)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.strip().isdigit():
            raise RuntimeError(f"the fake provider did not start (printed {line!r})")
        yield int(line)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --- statistics --------------------------------------------------------------------


def median(values: list[float]) -> float:
    return percentile(values, 50)


def p90(values: list[float]) -> float:
    return percentile(values, 90)


def us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} us"


async def per_call(fn: Callable[[], Awaitable[Any]], n: int) -> list[float]:
    """Seconds per await of ``fn()``, one sample per call."""
    out = []
    clock = time.perf_counter_ns
    for _ in range(n):
        t = clock()
        await fn()
        out.append((clock() - t) / 1e9)
    return out


def batched(fn: Callable[[], Any], batch: int = 2000, batches: int = 25) -> float:
    """Median over ``batches`` of the mean seconds per call of ``fn`` (for parts far
    shorter than a clock read's own overhead would allow timing one by one)."""
    means = []
    for _ in range(batches):
        t = time.perf_counter_ns()
        for _ in range(batch):
            fn()
        means.append((time.perf_counter_ns() - t) / 1e9 / batch)
    return median(means)


async def async_batched(
    fn: Callable[[], Awaitable[Any]], batch: int = 2000, batches: int = 25
) -> float:
    """:func:`batched` for an async ``fn``."""
    means = []
    for _ in range(batches):
        t = time.perf_counter_ns()
        for _ in range(batch):
            await fn()
        means.append((time.perf_counter_ns() - t) / 1e9 / batch)
    return median(means)


HANDLE_BATCH = 100


async def paired_handle(
    daemon: Daemon, runs: dict[str, Run], pairs: int, profiler: cProfile.Profile | None = None
) -> dict[str, Any]:
    """The whole of dispatch (steps 3-12, durable audit included, no socket) for the hit
    and the baseline run, in alternating batches: per-call means of wall time and of the
    trio thread's CPU time, and the paired differences (hit minus baseline: drift and the
    audit's group commits even out within a pair). With ``profiler``, the same under
    cProfile instead, for :func:`profile_diff`."""
    peer = Peer(pid=1, uid=0, gid=0)
    reqs = {
        name: Request(v=1, runId=runs[name].run_id, toolCallId="b1", tool="time.now", args={})
        for name in ("off", "hit")
    }
    wall: dict[str, list[float]] = {"off": [], "hit": []}
    cpu: dict[str, list[float]] = {"off": [], "hit": []}
    stats: dict[str, list[pstats.Stats]] = {"off": [], "hit": []}
    for i in range(pairs):
        for name in ("off", "hit") if i % 2 else ("hit", "off"):
            run, req = runs[name], reqs[name]
            if profiler is not None:
                profiler.enable()
            t, c = time.perf_counter_ns(), time.thread_time_ns()
            for _ in range(HANDLE_BATCH):
                response = await daemon.dispatcher.handle(run, req, peer)
                if not response.ok:
                    raise RuntimeError(f"a {name} call failed: {response}")
            wall[name].append((time.perf_counter_ns() - t) / 1e9 / HANDLE_BATCH)
            cpu[name].append((time.thread_time_ns() - c) / 1e9 / HANDLE_BATCH)
            if profiler is not None:
                profiler.disable()
                stats[name].append(pstats.Stats(profiler))
                profiler.clear()

    def pairs_of(d: dict[str, list[float]]) -> list[float]:
        return [h - o for h, o in zip(d["hit"], d["off"], strict=True)]

    return {
        "off": wall["off"],
        "hit": wall["hit"],
        "diff": pairs_of(wall),
        "cpu_off": cpu["off"],
        "cpu_hit": cpu["hit"],
        "cpu_diff": pairs_of(cpu),
        "stats": stats,
        "calls": pairs * HANDLE_BATCH,
    }


def profile_diff(result: dict[str, Any], top: int = 14) -> list[tuple[float, float, str]]:
    """Per call, the functions whose own CPU time grew most from the baseline to the hit
    run: (own time added, cumulative time added, function), seconds."""
    totals: dict[str, dict[str, tuple[float, float]]] = {"off": {}, "hit": {}}
    for name in ("off", "hit"):
        for one in result["stats"][name]:
            raw: dict[Any, Any] = one.stats
            for (filename, line, func), (_cc, _nc, tottime, cumtime, _callers) in raw.items():
                where = "/".join(Path(filename).parts[-2:])
                key = f"{where}:{line}({func})"
                own, cum = totals[name].get(key, (0.0, 0.0))
                totals[name][key] = (own + tottime, cum + cumtime)
    calls = result["calls"]  # per variant
    rows = []
    for key in totals["off"].keys() | totals["hit"].keys():
        off_own, off_cum = totals["off"].get(key, (0.0, 0.0))
        hit_own, hit_cum = totals["hit"].get(key, (0.0, 0.0))
        rows.append(((hit_own - off_own) / calls, (hit_cum - off_cum) / calls, key))
    rows.sort(reverse=True)
    return rows[:top]


def paired(
    fn: Callable[[], Any], base: Callable[[], Any], batch: int = 2000, batches: int = 51
) -> tuple[float, float, float]:
    """Mean seconds per call of ``fn`` and of ``base`` in alternating batches: the median
    of each and the median of the paired differences (drift cancels within a pair)."""
    a, b, diffs = [], [], []
    for _ in range(batches):
        pair = []
        for f in (fn, base):
            t = time.perf_counter_ns()
            for _ in range(batch):
                f()
            pair.append((time.perf_counter_ns() - t) / 1e9 / batch)
        a.append(pair[0])
        b.append(pair[1])
        diffs.append(pair[0] - pair[1])
    return median(a), median(b), median(diffs)


# --- the daemon and its runs -------------------------------------------------------


async def start_runs(daemon: Daemon, base: Path) -> dict[str, Run]:
    runs = {}
    for name in VARIANTS:
        policy = POLICY_HEAD.format(name=name)
        if name != "off":
            policy += REVIEW + (NO_CACHE if name == "miss" else "")
        path = base / "policies" / f"{name}.yaml"
        path.write_text(policy)
        ws = base / f"ws-{name}"
        ws.mkdir()
        runs[name] = await daemon.runs.start(
            RunRequest(
                workspacePath=str(ws),
                policy=str(path),
                actorId="bench",
                tenantId="bench",
                grant=Grant(allowSandbox=True),
            ),
            policy_paths=True,  # the bench is a local caller, like `gatewayd run`
        )
    return runs


async def load(run: Run, *what: str) -> Any:
    done = await trio.run_process(
        [sys.executable, LOAD, str(run.socket_path), run.run_id, "gateway", *what],
        capture_stdout=True,
    )
    return json.loads(done.stdout)


async def latency(run: Run, n: int) -> list[float]:
    return list(await load(run, "latency", str(n)))


async def throughput(run: Run, conns: int, seconds: float) -> float:
    result = await load(run, "load", str(conns), str(seconds))
    return float(result["calls"]) / float(result["seconds"])


# --- in-process parts --------------------------------------------------------------


async def last_call_entry(daemon: Daemon, run: Run) -> dict[str, Any]:
    """The fields of the last write-ahead ``call`` entry of ``run`` in the audit log, as
    dispatch recorded them (without what the chain adds: seq, time, kind, prev, hash)."""
    await daemon.audit.durable(daemon.audit.last_seq)
    lines = daemon.config.resolved_audit_path.read_bytes().splitlines()
    for line in reversed(lines):
        entry = json.loads(line)
        if entry.get("kind") == "call" and entry.get("runId") == run.run_id:
            return {k: v for k, v in entry.items() if k not in CHAIN_FIELDS}
    raise RuntimeError(f"no call entry of run {run.run_id} in the audit log")


CHAIN_FIELDS = frozenset({"seq", "time", "kind", "prev", "hash"})


def seal_entry(fields: dict[str, Any]) -> None:
    body = build_body(1, format_time(time.time_ns()), "call", fields, "0" * 64)
    seal(body)


def expect(outcome: ReviewOutcome | None, source: Source) -> ReviewOutcome:
    """``outcome``, checked to be an allow from ``source`` (else the figures are wrong)."""
    if outcome is None or outcome.source is not source or not outcome.allowed:
        raise RuntimeError(f"expected an allow from {source}, got {outcome}")
    return outcome


async def in_process(
    daemon: Daemon, runs: dict[str, Run], port: int, args: argparse.Namespace
) -> dict[str, Any]:
    """The reviewer's own cost, timed directly with the runs' live rules."""
    reviewer, dispatcher = daemon.reviewer, daemon.dispatcher
    hit_run, miss_run = runs["hit"], runs["miss"]
    section, rules = daemon.rules.current(hit_run.spec.policy_source, hit_run.spec.policy.review)
    miss_section, miss_rules = daemon.rules.current(
        miss_run.spec.policy_source, miss_run.spec.policy.review
    )
    req = Request(v=1, runId=hit_run.run_id, toolCallId="b1", tool="time.now", args={})
    off_req = Request(v=1, runId=runs["off"].run_id, toolCallId="b1", tool="time.now", args={})
    now_args = NowArgs()
    out: dict[str, Any] = {}

    outcome = expect(await reviewer.review("time.now", {}, section, rules), Source.CACHE)

    async def review_hit() -> Any:
        return await reviewer.review("time.now", {}, section, rules)

    async def step7_hit() -> Any:
        return await dispatcher._review(hit_run, req, now_args)

    async def step7_off() -> Any:
        return await dispatcher._review(runs["off"], off_req, now_args)

    await per_call(review_hit, 1000)  # warm-up
    out["review"] = await per_call(review_hit, args.direct_calls)
    out["step7"] = await per_call(step7_hit, args.direct_calls)
    out["step7_off"] = await per_call(step7_off, args.direct_calls)
    out["handle"] = await paired_handle(daemon, runs, args.handle_pairs)

    # The audit entries of the two runs as written: the hit's has the review field.
    with_review = await last_call_entry(daemon, hit_run)
    without = await last_call_entry(daemon, runs["off"])
    out["entry"] = paired(lambda: seal_entry(with_review), lambda: seal_entry(without))
    out["entry_bytes"] = (
        len(build_body(1, format_time(0), "call", with_review, "0" * 64)),
        len(build_body(1, format_time(0), "call", without, "0" * 64)),
    )

    # The parts of a hit, each alone (mean per call over batches).
    def empty_deadline_scope() -> None:
        with trio.fail_after(10):
            pass

    async def limiter_round() -> None:
        async with hit_run.limiter:
            pass

    key = cache_key(rules.digest, "time.now", {})
    assert key is not None
    clock = reviewer.clock
    out["parts"] = [
        (
            "decide_structured (no structured rules)",
            batched(lambda: decide_structured("time.now", {}, rules.structured_compiled)),
        ),
        ("section.reviews(tool)", batched(lambda: section.reviews("time.now"))),
        ("cache_key (msgpack + blake2b)", batched(lambda: cache_key(rules.digest, "time.now", {}))),
        ("DecisionCache.get", batched(lambda: reviewer.cache.get(key, clock()))),
        ("clock() (3 reads per hit)", batched(clock)),
        ("async with run.limiter (dispatch)", await async_batched(limiter_round)),
        ("trio.lowlevel.checkpoint()", await async_batched(trio.lowlevel.checkpoint)),
        ("a trio.fail_after(10) scope, empty", batched(empty_deadline_scope)),
        ("msgspec.to_builtins(args) (dispatch)", batched(lambda: msgspec.to_builtins(now_args))),
        (
            "RuleBook.current (dispatch)",
            batched(
                lambda: daemon.rules.current(hit_run.spec.policy_source, hit_run.spec.policy.review)
            ),
        ),
        ("ReviewOutcome.audit() (dispatch)", batched(outcome.audit)),
    ]

    if args.profile:
        # Timed by the thread's CPU clock: what the event loop spends, not its waits.
        profiler = cProfile.Profile(time.thread_time_ns, 1e-9)
        profiled = await paired_handle(daemon, runs, 20, profiler)
        out["profile"] = profile_diff(profiled)
        out["profile_cpu"] = (median(profiled["cpu_off"]), median(profiled["cpu_hit"]))

    # A miss, and its parts.
    alias = daemon.reviewer.models[ALIAS]

    async def review_miss() -> Any:
        return expect(await reviewer.review("time.now", {}, miss_section, miss_rules), Source.MODEL)

    prompt = build_review_prompt("time.now", {}, miss_rules)

    async def complete() -> Any:
        return await model_client.complete(
            alias,
            prompt.messages(),
            timeout_s=15,
            max_tokens=REVIEW_MAX_TOKENS,
            temperature=0,
            alias_name=ALIAS,
        )

    body = json.dumps(
        {
            "model": alias.model,
            "messages": prompt.messages(),
            "max_tokens": REVIEW_MAX_TOKENS,
            "temperature": 0,
        }
    ).encode()

    async def bare_http() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port)
        conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
        answer = json.loads(conn.getresponse().read())
        conn.close()
        if answer["choices"][0]["message"]["content"] != "ALLOW":
            raise RuntimeError(f"unexpected answer from the fake: {answer}")

    async def hand_off() -> None:
        await trio.to_thread.run_sync(lambda: None)

    n = args.miss_direct_calls
    await per_call(review_miss, 20)  # warm-up
    out["miss_review"] = await per_call(review_miss, n)
    out["miss_complete"] = await per_call(complete, n)
    out["miss_http"] = await per_call(bare_http, n)
    out["hand_off"] = await per_call(hand_off, n)
    out["prompt"] = batched(
        lambda: build_review_prompt("time.now", {}, miss_rules), batch=200, batches=15
    )
    if args.profile:
        out["miss_profile"] = await trio.to_thread.run_sync(profile_litellm, alias, prompt)
    return out


def profile_litellm(alias: ModelAlias, prompt: Any) -> list[tuple[str, float]]:
    """cProfile of 100 ``litellm.completion`` calls as model_client makes them (in this
    worker thread: cProfile sees one thread), own time grouped by package, per call."""
    litellm = model_transport.LITELLM.get()
    request = {
        "model": alias.litellm_model,
        "messages": prompt.messages(),
        "api_key": model_client.KEYLESS_PLACEHOLDER,
        "api_base": alias.api_base,
        "timeout": 15,
        "num_retries": 0,
        "max_retries": 0,
        "max_tokens": REVIEW_MAX_TOKENS,
        "temperature": 0,
    }
    calls = 100
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        litellm.completion(**request)
    profiler.disable()
    groups: dict[str, float] = {}
    stats: dict[Any, Any] = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    for (filename, _line, func), (_cc, _nc, tottime, _ct, _callers) in stats.items():
        if filename == "~":
            waits = ("recv", "connect", "sendall", "select", "poll", "acquire")
            name = "socket and lock waits" if any(w in func for w in waits) else "C builtins"
        elif "site-packages/" in filename:
            name = filename.split("site-packages/", 1)[1].split("/", 1)[0]
        else:
            name = "standard library and other"
        groups[name] = groups.get(name, 0.0) + tottime / calls
    return sorted(groups.items(), key=lambda kv: -kv[1])


# --- the whole measurement ----------------------------------------------------------


async def measure(args: argparse.Namespace, port: int) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="cg-ro-", dir="/tmp"))
    (base / "policies").mkdir()
    models = {
        ALIAS: ModelAlias(
            provider="openai", model="fake-model", api_base=f"http://127.0.0.1:{port}/v1"
        )
    }
    config = GatewaydConfig(
        state_dir=base / "state",
        policy_dirs=(base / "policies",),
        os_sandbox=False,
        models=models,
        audit_fsync=not args.no_fsync,
    )
    rng = random.Random(args.seed)
    lat: dict[str, list[float]] = {v: [] for v in VARIANTS}
    round_p50: dict[str, list[float]] = {v: [] for v in VARIANTS}
    rps: dict[str, list[float]] = {v: [] for v in VARIANTS}
    try:
        async with open_daemon(config, preload=True) as daemon:
            await trio.to_thread.run_sync(model_client.preload)  # as at daemon start
            runs = await start_runs(daemon, base)
            for name in VARIANTS:  # warm-up; the hit run's first call fills the cache
                await latency(runs[name], args.warmup)
            calls = {"off": args.calls, "hit": args.calls, "miss": args.miss_calls}
            for _ in range(args.rounds):
                order = list(VARIANTS)
                rng.shuffle(order)
                for name in order:
                    samples = await latency(runs[name], calls[name])
                    lat[name] += samples
                    round_p50[name].append(median(samples))
            for _ in range(args.load_rounds):
                order = list(VARIANTS)
                rng.shuffle(order)
                for name in order:
                    rps[name].append(await throughput(runs[name], args.conns, args.seconds))
            direct = await in_process(daemon, runs, port, args)
            counts = {name: (run.calls, run.allowed) for name, run in runs.items()}
            fsyncs = daemon.audit.fsync_count
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return {
        "lat": lat,
        "round_p50": round_p50,
        "rps": rps,
        "direct": direct,
        "counts": counts,
        "fsyncs": fsyncs,
    }


LABELS = {
    "off": "no review (baseline)",
    "hit": "review, cache hit",
    "miss": "review, miss (fake model)",
}


def paired_rounds(per_round: dict[str, list[float]], name: str, ratio: bool) -> list[float]:
    """Each round's figure of ``name`` against the baseline's in the same round."""
    pairs = zip(per_round[name], per_round["off"], strict=True)
    return [v / b if ratio else v - b for v, b in pairs]


def report(args: argparse.Namespace, r: dict[str, Any]) -> bool:
    """Print every figure; returns whether the cache-hit target is met."""
    lat, rps, d = r["lat"], r["rps"], r["direct"]
    off = lat["off"]
    print(
        f"\n{'round trip, 1 connection':<30}{'median':>12}{'p90':>12}{'added median':>15}"
        f"{'added p90':>12}{'ratio':>8}"
    )
    for name in VARIANTS:
        v = lat[name]
        added = "" if name == "off" else us(median(v) - median(off))
        added90 = "" if name == "off" else us(p90(v) - p90(off))
        print(
            f"{LABELS[name]:<30}{us(median(v)):>12}{us(p90(v)):>12}{added:>15}{added90:>12}"
            f"{median(v) / median(off):>7.2f}x"
        )
    for name in ("hit", "miss"):
        diffs = paired_rounds(r["round_p50"], name, ratio=False)
        print(
            f"  {name} - baseline, round by round (medians): median {us(median(diffs))}, "
            f"range {min(diffs) * 1e6:+,.0f} to {max(diffs) * 1e6:+,.0f} us"
        )

    print(f"\n{f'calls/s, {args.conns} connections':<30}{'median':>12}{'range':>20}{'ratio':>9}")
    for name in VARIANTS:
        v = rps[name]
        ratios = paired_rounds(rps, name, ratio=True)
        span = f"{min(v):,.0f}-{max(v):,.0f}"
        print(f"{LABELS[name]:<30}{median(v):>12,.0f}{span:>20}{median(ratios):>8.2f}x")
    print("  (ratio: median over rounds of the variant / the baseline in the same round)")

    h = d["handle"]
    print(
        f"\nin-process dispatch, no socket (Dispatcher.handle, {len(h['diff'])} paired batches "
        f"of {HANDLE_BATCH} calls):\n  baseline {us(median(h['off']))}, cache hit {us(median(h['hit']))}"
        f" per call; hit - baseline: median {us(median(h['diff']))}, 10th-90th percentile "
        f"{us(percentile(h['diff'], 10))} to {us(p90(h['diff']))}\n  trio thread's CPU: "
        f"baseline {us(median(h['cpu_off']))}, hit {us(median(h['cpu_hit']))} per call; "
        f"hit - baseline: median {us(median(h['cpu_diff']))}"
    )
    print(f"\n{'in-process, per call':<46}{'median':>12}{'p90':>12}")
    for key, label in (
        ("review", "Reviewer.review, cache hit"),
        ("step7", "dispatch step 7 (Dispatcher._review), hit"),
        ("step7_off", "dispatch step 7, baseline run (no review)"),
    ):
        print(f"  {label:<44}{us(median(d[key])):>12}{us(p90(d[key])):>12}")
    entry_with, entry_without, entry_added = d["entry"]
    with_b, without_b = d["entry_bytes"]
    print(
        f"  audit call entry sealed with the review field {us(entry_with)}, without "
        f"{us(entry_without)}: {us(entry_added)} more ({with_b} vs {without_b} bytes)"
    )
    print("  parts of a hit, each alone (mean per call):")
    for label, seconds in d["parts"]:
        print(f"    {label:<42}{us(seconds):>12}")
    if "profile" in d:
        off_cpu, hit_cpu = d["profile_cpu"]
        print(
            f"\ncProfile by the trio thread's CPU clock, dispatch of a hit minus the baseline, "
            f"per call (inflated by the profiler: {us(off_cpu)} vs {us(hit_cpu)} per call"
            f" under it):\n  {'own +':>10}{'cumulative +':>14}  function"
        )
        for own, cum, where in d["profile"]:
            print(f"  {own * 1e6:>7.1f} us{cum * 1e6:>11.1f} us  {where}")

    print(f"\n{'in-process, miss (fake model, ALLOW at once)':<58}{'median':>12}{'p90':>12}")
    for key, label in (
        ("miss_review", "Reviewer.review, cache off"),
        ("miss_complete", "  model_client.complete (litellm), same prompt"),
        ("miss_http", "  bare HTTP POST of it to the fake (http.client)"),
        ("hand_off", "  one trio.to_thread hand-off (complete() makes 2)"),
    ):
        print(f"  {label:<56}{us(median(d[key])):>12}{us(p90(d[key])):>12}")
    print(f"  {'  build_review_prompt (mean)':<56}{us(d['prompt']):>12}")
    if "miss_profile" in d:
        total = sum(t for _, t in d["miss_profile"])
        print(
            f"\ncProfile of 100 litellm.completion calls, own time per call by package "
            f"({us(total)} in all, inflated by the profiler):"
        )
        for name, seconds in d["miss_profile"][:8]:
            print(f"    {name:<42}{us(seconds):>12}{seconds / total:>7.0%}")

    # The hit path does no I/O and waits for nothing but the scheduler, so what it adds
    # to a call is what it adds to the event loop's CPU; that figure is steady here, while
    # wall-clock differences carry the audit's fdatasync noise (shown above).
    hit_adds = median(d["handle"]["cpu_diff"])
    met = bool(hit_adds <= TARGET_HIT_S)
    print(
        f"\ntarget: a cache hit adds <= 50 us: {'MET' if met else 'NOT MET'}: {us(hit_adds)} "
        f"of the trio thread's CPU per call, in-process dispatch (paired median); wall "
        f"clock {us(median(d['handle']['diff']))} in-process and "
        f"{us(median(paired_rounds(r['round_p50'], 'hit', ratio=False)))} over the socket, "
        "both within their noise"
    )
    calls = ", ".join(f"{k} {c}/{a}" for k, (c, a) in r["counts"].items())
    print(f"calls made/allowed per run: {calls}; {r['fsyncs']} fdatasyncs")
    return met


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=12, help="interleaved latency rounds")
    ap.add_argument("--calls", type=int, default=1000, help="sequential calls per round (off, hit)")
    ap.add_argument("--miss-calls", type=int, default=150, help="sequential calls per round (miss)")
    ap.add_argument("--load-rounds", type=int, default=5, help="interleaved calls/s rounds")
    ap.add_argument("--conns", type=int, default=8, help="connections for calls/s")
    ap.add_argument("--seconds", type=float, default=2.0, help="duration of each calls/s step")
    ap.add_argument("--warmup", type=int, default=300, help="calls per variant before measuring")
    ap.add_argument("--direct-calls", type=int, default=20_000, help="in-process hits timed")
    ap.add_argument("--miss-direct-calls", type=int, default=300, help="in-process misses timed")
    ap.add_argument(
        "--handle-pairs", type=int, default=100, help="paired batches of in-process dispatch"
    )
    ap.add_argument("--seed", type=int, default=4, help="seed of the rounds' order")
    ap.add_argument("--profile", action="store_true", help="cProfile a hit and a miss too")
    ap.add_argument(
        "--no-fsync",
        action="store_true",
        help="diagnostic: audit entries written but not fdatasynced (less noise; not gatewayd)",
    )
    args = ap.parse_args()
    configure_logging(logging.ERROR)  # the daemon's start-up warnings are expected here
    print(
        f"review_overhead: {env_info()}; in-process gatewayd, durable audit "
        f"{'OFF (diagnostic)' if args.no_fsync else 'on'}, time.now; {args.rounds} latency "
        f"and {args.load_rounds} calls/s rounds, interleaved"
    )
    with fake_provider() as port:
        results = trio.run(measure, args, port)
    report(args, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
