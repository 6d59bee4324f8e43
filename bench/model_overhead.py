"""What `model.chat` through the gateway adds to a model call, beside the same call to
the same fake provider through litellm directly, measured in the same run.

    .venv/bin/python bench/model_overhead.py [--rounds 6] [--calls 200] [--warmup 50]
                                             [--quick] [--stages] [--no-fsync]

One process drives every variant, one call at a time, against ``tests/fakeprovider.py``
(a real OpenAI-compatible HTTP server on loopback that answers ``ALLOW`` at once with
usage 11 + 7 tokens; in its own process, as in ``bench/review_overhead.py``, so serving
it takes no GIL from the callers):

- **baseline**: ``litellm.acompletion`` in this process, with the request gatewayd
  builds (same ``openai/<model>`` string, ``api_base``, key, timeout, no retries,
  ``max_tokens``), and litellm configured as gatewayd configures it
  (``model_client.preload``: callbacks cleared, message logging off). That is what an
  agent without a sandbox would do: call litellm from its own asyncio code.
- **model.chat via gatewayd**: a real ``gatewayd serve --no-os-sandbox`` (the client is
  on the host, not in a sandbox) with its configuration file naming an alias for the
  fake and a run whose policy grants it (budgets out of the way), called with the
  ``cogni_tool`` Client library over the run's unix socket. The daemon runs with its
  defaults: the durable audit is on (the ``audit_fsync`` setting; ``gatewayd serve``
  has no option to turn it off).
- references, for where the time goes: ``litellm.completion`` (the sync call gatewayd
  makes in a trio worker thread), the same in an ``asyncio.to_thread`` worker,
  ``time.now`` through the same gateway run (the gateway's fixed cost without a model),
  and a bare ``http.client`` POST of the same body to the fake (the wire without
  litellm).

Every variant runs ``--calls`` sequential calls per round after ``--warmup`` calls, in
``--rounds`` rounds whose order rotates, so drift hits every variant alike. Printed:
p50, p90 and p99 of each, what each adds at p50 over the baseline (over all samples, and
round by round), the ratio, and whether the target holds. Then a model.chat call split
per call by clocks of the same call: the round trip, gatewayd's dispatch time (the
audit's ``durationMs`` of each result entry; the audit log is put in the bench's own
directory with ``--audit``) and, with ``--stages``, its parts inside gatewayd.

- **openai SDK -> cogni-tool serve -> model.chat**: what an unmodified agent in a sandbox
  does: the official ``openai`` SDK against the run's OpenAI-compatible endpoint
  (``cogni-tool serve``, here on the host's loopback with the run's socket; in a run it
  is on the sandbox's own loopback), which makes the same model.chat call.

Adding a variant is one :meth:`Bench.add` call: a label and a callable that makes one
call and returns the answer's text (or an awaitable of it, awaited in the bench's
asyncio loop).

Diagnostics (not gatewayd's configuration; gatewayd is then started through a wrapper,
``DIAG_LAUNCHER``, that leaves its code as it is): ``--stages`` stamps each model.chat
call inside gatewayd (``complete``, ``litellm.completion`` and litellm's own success
logging); ``--no-fsync`` turns the audit's fdatasync off, to show what the durable
write-ahead entry costs. Target: at most 2 ms added at p50, judged with the
defaults and no diagnostic. Figures, never assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import inspect
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any, Final

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import ROOT, env_info, gatewayd_run, percentile
from review_overhead import fake_provider

from cogni_tool.client import Client
from gatewayd import model_client

TARGET_ADDED_S: Final = 2e-3
ALIAS: Final = "bench-chat"
MODEL: Final = "fake-model"
# The key travels as gatewayd sends it: from a variable of its environment (inherited
# from this process), to the provider in the Authorization header.
KEY_ENV: Final = "COGNI_BENCH_MODEL_KEY"
KEY: Final = "sk-bench-not-a-real-key"
MESSAGES: Final = [{"role": "user", "content": "Answer with one word: may I?"}]
MAX_TOKENS: Final = 16
ANSWER: Final = "ALLOW"  # what the fake says (bench/review_overhead.py's fake_provider)
# What gatewayd hands litellm: min(model.chat's 120 s, the alias's default 60 s).
TIMEOUT_S: Final = 60.0

POLICY: Final = """\
version: 1
name: bench-model
description: model.chat (and time.now) with every limit out of the way, for bench/model_overhead.py.
tools:
  allow: [model.chat, time.now]
limits:
  call_timeout_s: 60
  calls_per_second: 1000000
  burst: 1000000
  max_concurrent_calls: 256
require_os_sandbox: false
model_access:
  models: [{alias}]
  max_requests: 1000000000
  max_tokens: 1000000000000
"""
CONFIG: Final = """\
models:
  {alias}:
    provider: openai
    model: {model}
    api_base: {api_base}
    api_key_env: {key_env}
"""
# Diagnostic only (--stages): `gatewayd serve` started through this wrapper, argv as the
# console script's. (--no-fsync needs no wrapper: gatewayd reads GATEWAYD_AUDIT_FSYNC.)
# --stages records, per model.chat call, when `complete` starts and ends (trio's thread) and when
# litellm.completion starts and ends (the worker thread), and how long litellm's own
# success logging runs (its logging thread), and writes them to $COGNI_BENCH_STAGES when
# the daemon exits. Only the tool's names are wrapped; gatewayd's code is unchanged.
DIAG_LAUNCHER: Final = r"""
import json, os, sys, time
import gatewayd.cli as cli
stages = os.environ.get("COGNI_BENCH_STAGES")
times = {k + end: [] for k in ("complete", "litellm", "logging") for end in ("", "_end")}
def stamped(fn, name):
    def call(*args, **kwargs):
        times[name].append(time.perf_counter())
        try:
            return fn(*args, **kwargs)
        finally:
            times[name + "_end"].append(time.perf_counter())
    return call
def stamped_async(fn, name):
    async def call(*args, **kwargs):
        times[name].append(time.perf_counter())
        try:
            return await fn(*args, **kwargs)
        finally:
            times[name + "_end"].append(time.perf_counter())
    return call
if stages:
    import gatewayd.tools.model as chat_tool
    from gatewayd import model_client, model_transport
    model_client.preload()
    litellm = model_transport.LITELLM.get()
    from litellm.litellm_core_utils.litellm_logging import Logging
    chat_tool.complete = stamped_async(chat_tool.complete, "complete")
    litellm.completion = stamped(litellm.completion, "litellm")
    Logging.success_handler = stamped(Logging.success_handler, "logging")
code = cli.main(sys.argv[1:])
if stages:
    with open(stages, "w") as out:
        json.dump(times, out)
sys.exit(code)
"""

GATEWAY_PATH: Final = (
    "the gateway's path (gatewayd serve defaults, --no-os-sandbox): Client.call in this\n"
    "  process -> one frame (4-byte length + JSON) on the run's unix socket -> gatewayd's\n"
    "  trio loop: peer credentials at accept, frame decode (msgspec), rate bucket, run id,\n"
    "  grant, allowlist, argument schema (msgspec), policy, then the write-ahead audit\n"
    "  entry (sealed, hash-chained) written and fdatasynced before the call runs\n"
    "  (audit_fsync=True, the default; serve has no flag to turn it off) -> model.chat:\n"
    "  model_access grant and budget -> model_client.complete: litellm.completion (sync)\n"
    "  in a trio worker thread -> output cap, result audit entry (queued; fdatasynced by\n"
    "  the flusher within 2 ms, not awaited) -> response frame -> Client decodes it."
)


# --- variants ------------------------------------------------------------------------

SYNC_LABEL: Final = "litellm.completion (sync), direct"
NOW_LABEL: Final = "time.now via gatewayd (same Client, no model)"
SDK_LABEL: Final = "openai SDK -> cogni-tool serve -> model.chat"
THREAD_LABEL: Final = "litellm.completion in a thread (asyncio.to_thread)"

Call = Callable[[], Any]  # one call; returns the answer's text, or an awaitable of it


@dataclass
class Variant:
    label: str
    call: Call
    role: str  # "baseline", "gateway" or "reference"
    expect: str | None  # the answer every call must return (None: not checked)
    samples: list[float] = field(default_factory=list)
    round_p50: list[float] = field(default_factory=list)

    @property
    def p50(self) -> float:
        return percentile(self.samples, 50)


class Bench:
    """The variants, timed in one asyncio loop so async callables run where they would
    in an agent: the loop lives for the whole bench (litellm caches its async clients
    per loop), and a sync callable is simply called from it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.variants: list[Variant] = []

    def add(
        self, label: str, call: Call, *, role: str = "reference", expect: str | None = ANSWER
    ) -> Variant:
        """The hook: one more variant, timed in the same rounds as the others."""
        variant = Variant(label, call, role, expect)
        self.variants.append(variant)
        return variant

    def role(self, role: str) -> Variant:
        return next(v for v in self.variants if v.role == role)

    def batch(self, variant: Variant, n: int) -> list[float]:
        """Seconds per call of ``n`` sequential calls of ``variant``."""
        return self.loop.run_until_complete(self._timed(variant, n))

    async def _timed(self, variant: Variant, n: int) -> list[float]:
        out = []
        clock = time.perf_counter
        for _ in range(n):
            started = clock()
            answer = variant.call()
            if inspect.isawaitable(answer):
                answer = await answer
            out.append(clock() - started)
            if variant.expect is not None and answer != variant.expect:
                raise RuntimeError(f"{variant.label}: unexpected answer {answer!r}")
        # Tasks litellm left on the loop run now, not in the next variant's timing.
        await asyncio.sleep(0.005)
        return out

    def run(self, rounds: int, calls: int, warmup: int) -> None:
        for variant in self.variants:
            progress(f"warm-up: {warmup} calls of {variant.label}")
            self.batch(variant, warmup)
        k = len(self.variants)
        for r in range(rounds):
            # Rotate the order each round: over k rounds every variant runs at every
            # position of the round once.
            for variant in self.variants[r % k :] + self.variants[: r % k]:
                samples = self.batch(variant, calls)
                variant.samples += samples
                variant.round_p50.append(percentile(samples, 50))
                progress(
                    f"round {r + 1}/{rounds}: {variant.label:<44} p50 {ms(percentile(samples, 50))}"
                )

    def close(self) -> None:
        self.loop.close()


def litellm_request(api_base: str) -> dict[str, Any]:
    """The request gatewayd's model_client.complete hands litellm for model.chat with
    ``max_tokens`` and no temperature (gatewayd/model_client.py)."""
    return {
        "model": f"openai/{MODEL}",
        "messages": [dict(m) for m in MESSAGES],
        "api_key": KEY,
        "timeout": TIMEOUT_S,
        "num_retries": 0,
        "max_retries": 0,
        "api_base": api_base,
        "max_tokens": MAX_TOKENS,
    }


def add_direct(bench: Bench, api_base: str) -> None:
    model_client.preload()  # import and configure litellm as gatewayd does
    import litellm

    request = litellm_request(api_base)

    async def acompletion() -> Any:
        response = await litellm.acompletion(**request)
        return response.choices[0].message.content

    def completion() -> Any:
        return litellm.completion(**request)

    async def in_thread() -> Any:
        return (await asyncio.to_thread(completion)).choices[0].message.content

    bench.add("litellm.acompletion, direct (baseline)", acompletion, role="baseline")
    bench.add(SYNC_LABEL, lambda: completion().choices[0].message.content)
    bench.add(THREAD_LABEL, in_thread)


def add_gateway(bench: Bench, client: Client) -> None:
    def chat() -> Any:
        args = {"model": ALIAS, "messages": MESSAGES, "max_tokens": MAX_TOKENS}
        return client.call("model.chat", args)["content"]

    bench.add("model.chat via gatewayd (cogni_tool Client)", chat, role="gateway")
    bench.add(NOW_LABEL, lambda: client.call("time.now"), expect=None)


def add_bare_http(bench: Bench, port: int) -> None:
    body = json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS}).encode()
    headers = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}

    def post() -> Any:
        conn = http.client.HTTPConnection("127.0.0.1", port)
        conn.request("POST", "/v1/chat/completions", body, headers)
        answer = json.loads(conn.getresponse().read())
        conn.close()
        return answer["choices"][0]["message"]["content"]

    bench.add("bare HTTP POST to the fake (http.client)", post)


def hand_off_s(n: int) -> float:
    """p50 of one trio.to_thread.run_sync hand-off (model.chat makes one per call)."""

    async def main() -> list[float]:
        out = []
        for _ in range(n):
            started = time.perf_counter()
            await trio.to_thread.run_sync(lambda: None)
            out.append(time.perf_counter() - started)
        return out

    return percentile(trio.run(main), 50)


# --- the run -------------------------------------------------------------------------


def progress(line: str) -> None:
    print(f"model_overhead: {line}", file=sys.stderr, flush=True)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.3f} ms"


@contextmanager
def gateway(port: int, base: Path, args: argparse.Namespace) -> Iterator[tuple[Client, str, str]]:
    """`gatewayd serve` with the fake as an alias, its audit log at ``base/audit.jsonl``
    and a run granting the alias; a Client on the run's socket, the socket, the run id."""
    policy = base / "policy.yaml"
    policy.write_text(POLICY.format(alias=ALIAS))
    config = base / "gatewayd.yaml"
    api_base = f"http://127.0.0.1:{port}/v1"
    config.write_text(CONFIG.format(alias=ALIAS, model=MODEL, api_base=api_base, key_env=KEY_ENV))
    serve_args = ("--config", str(config), "--no-os-sandbox", "--audit", str(base / "audit.jsonl"))
    launcher = None
    os.environ.pop("GATEWAYD_AUDIT_FSYNC", None)
    os.environ.pop("COGNI_BENCH_STAGES", None)
    if args.no_fsync:  # the documented setting (tests and benchmarks only)
        os.environ["GATEWAYD_AUDIT_FSYNC"] = "false"
    if args.stages:
        launcher = [sys.executable, "-c", DIAG_LAUNCHER]
        os.environ["COGNI_BENCH_STAGES"] = str(base / "stages.json")
    with (
        gatewayd_run(policy, serve_args=serve_args, launcher=launcher) as (sock, run_id),
        Client(sock, run_id) as client,
    ):
        yield client, sock, run_id


@contextmanager
def endpoint(sock: str, run_id: str) -> Iterator[int]:
    """``cogni-tool serve`` on the host (in a run it is inside the sandbox, reached on the
    run's own loopback: the same hop) forwarding to the run's socket; yields its port."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    env = {**os.environ, "COGNI_GATEWAY_SOCK": sock, "COGNI_RUN_ID": run_id}
    command = [sys.executable, "-I", "-m", "cogni_tool", "serve", "--openai-port", str(port)]
    proc = subprocess.Popen(
        [*command, "--models", ALIAS], env=env, stdout=subprocess.PIPE, cwd=ROOT
    )
    try:
        assert proc.stdout is not None
        if proc.stdout.readline() != b"ready\n":
            raise RuntimeError("cogni-tool serve did not start")
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def add_sdk(bench: Bench, port: int) -> None:
    import openai

    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="dummy", max_retries=0)

    def chat() -> Any:
        answer = sdk.chat.completions.create(
            model=ALIAS,
            messages=MESSAGES,  # type: ignore[arg-type]  # the SDK's TypedDicts, same shape
            max_tokens=MAX_TOKENS,
        )
        return answer.choices[0].message.content

    bench.add(SDK_LABEL, chat)


@dataclass
class Inside:
    """What gatewayd's side of each measured call took, seconds, in call order."""

    chat: list[float]  # model.chat: dispatch, steps 3-12 (the audit's durationMs)
    now: list[float]  # time.now: the same
    # --stages: perf_counter stamps per model.chat call, "complete", "complete_end",
    # "litellm", "litellm_end", "logging", "logging_end" (see DIAG_LAUNCHER)
    stamps: dict[str, list[float]] | None


def read_inside(base: Path, n: int) -> Inside:
    """The last ``n`` calls of each tool (the measured ones; warm-up calls come first)."""
    durations: dict[str, list[float]] = {"model.chat": [], "time.now": []}
    with (base / "audit.jsonl").open() as log:
        for line in log:
            entry = json.loads(line)
            # This process's Client calls only (cogni-tool serve's ids have its own pid).
            mine = str(entry.get("toolCallId", "")).startswith(f"{os.getpid()}-")
            if entry.get("kind") == "result" and entry.get("tool") in durations and mine:
                if "errorCode" in entry:
                    raise RuntimeError(f"a measured call failed: {entry}")
                durations[entry["tool"]].append(entry["durationMs"] / 1e3)
    stages = base / "stages.json"
    stamps = json.loads(stages.read_text()) if stages.exists() else None
    return Inside(
        chat=durations["model.chat"][-n:],
        now=durations["time.now"][-n:],
        stamps={k: v[-n:] for k, v in stamps.items()} if stamps else None,
    )


def p50_of_diffs(a: list[float], b: list[float]) -> float:
    return percentile([x - y for x, y in zip(a, b, strict=True)], 50)


def report(bench: Bench, inside: Inside, hand_off: float, args: argparse.Namespace) -> bool:
    """Print every figure; returns whether the target is met."""
    base, gw = bench.role("baseline"), bench.role("gateway")
    refs = {v.label: v for v in bench.variants}
    sync, now, thread = refs[SYNC_LABEL], refs[NOW_LABEL], refs[THREAD_LABEL]
    print(
        f"\n{'sequential calls, one at a time':<48}{'p50':>11}{'p90':>11}{'p99':>11}"
        f"{'added p50':>12}{'ratio':>8}"
    )
    for v in bench.variants:
        over = "" if v is base else f"{(v.p50 - base.p50) * 1e3:+,.3f} ms"
        print(
            f"{v.label:<48}{ms(v.p50):>11}{ms(percentile(v.samples, 90)):>11}"
            f"{ms(percentile(v.samples, 99)):>11}{over:>12}{v.p50 / base.p50:>7.2f}x"
        )
    print(
        f"  ({len(base.samples)} calls each: {args.rounds} rounds of {args.calls}, after "
        f"{args.warmup} warm-up; added = p50 minus the baseline's p50)"
    )
    print("added at p50, round by round (the variant's p50 minus the baseline's, same round):")
    for v in bench.variants:
        if v is base:
            continue
        diffs = [a - b for a, b in zip(v.round_p50, base.round_p50, strict=True)]
        print(
            f"  {v.label:<46} median {percentile(diffs, 50) * 1e3:+,.3f} ms, range "
            f"{min(diffs) * 1e3:+,.3f} to {max(diffs) * 1e3:+,.3f} ms"
        )

    print(f"\n{GATEWAY_PATH}")
    print(
        "\nwhere a model.chat call's time goes, per call (p50 of each part; a part is the\n"
        "difference of two clocks of the same call, so the parts of one call add up):"
    )
    rows = [
        ("model.chat round trip (Client.call, this process)", gw.p50),
        (
            "  outside dispatch: Client, socket, frames, decode",
            p50_of_diffs(gw.samples, inside.chat),
        ),
        ("  dispatch, steps 3-12 (the audit's durationMs)", percentile(inside.chat, 50)),
    ]
    if inside.stamps is not None:
        t = inside.stamps
        in_complete = [e - b for b, e in zip(t["complete"], t["complete_end"], strict=True)]
        rows += [
            (
                "    before complete(): admission, durable audit entry",
                p50_of_diffs(inside.chat, in_complete),
            ),
            (
                "    complete() -> litellm starts in a worker thread",
                p50_of_diffs(t["litellm"], t["complete"]),
            ),
            (
                "    litellm.completion in gatewayd's worker thread",
                p50_of_diffs(t["litellm_end"], t["litellm"]),
            ),
            (
                "    litellm returns -> complete() resumes on trio's thread",
                p50_of_diffs(t["complete_end"], t["litellm_end"]),
            ),
        ]
        if t["logging"]:  # gatewayd skips litellm's success logging where litellm lets it
            rows += [
                (
                    "    (litellm's success_handler, its logging thread: starts after",
                    p50_of_diffs(t["logging"], t["litellm_end"]),
                ),
                (
                    "     litellm returns, and runs for)",
                    p50_of_diffs(t["logging_end"], t["logging"]),
                ),
            ]
        else:
            print("  (litellm's success logging: not run; gatewayd's calls skip it)")
    rows += [
        ("litellm.completion direct, in this process", sync.p50),
        ("litellm.completion in an asyncio.to_thread worker, in this process", thread.p50),
        ("litellm.acompletion direct, in this process (baseline)", base.p50),
        ("time.now round trip (Client.call, same run)", now.p50),
        ("  outside dispatch", p50_of_diffs(now.samples, inside.now)),
        ("  dispatch, steps 3-12 (durable audit entry included)", percentile(inside.now, 50)),
        ("one trio.to_thread hand-off there and back, in this process", hand_off),
    ]
    for label, seconds in rows:
        print(f"  {label:<64}{ms(seconds):>12}")
    if inside.stamps is None:
        print("  (--stages splits dispatch further, through a timing wrapper around gatewayd)")

    added = gw.p50 - base.p50
    like = gw.p50 - sync.p50
    met = added <= TARGET_ADDED_S
    fsync = "OFF (diagnostic, not gatewayd's configuration)" if args.no_fsync else "on"
    print(
        f"\ntarget: model.chat through the gateway adds <= 2 ms at p50 over litellm.acompletion: "
        f"{'MET' if met else 'NOT MET'}: {added * 1e3:+,.3f} ms ({ms(gw.p50)} vs "
        f"{ms(base.p50)} direct, {gw.p50 / base.p50:.2f}x); durable audit {fsync}"
    )
    print(
        f"like for like, over litellm.completion (the sync call gatewayd itself makes): "
        f"{like * 1e3:+,.3f} ms ({'within' if like <= TARGET_ADDED_S else 'over'} 2 ms)"
    )
    return met


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6, help="interleaved rounds")
    ap.add_argument("--calls", type=int, default=200, help="sequential calls per variant per round")
    ap.add_argument("--warmup", type=int, default=50, help="calls per variant before measuring")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 10 calls (smoke test)")
    ap.add_argument(
        "--no-fsync",
        action="store_true",
        help="diagnostic: gatewayd's audit entries written but not fdatasynced (not gatewayd's "
        "configuration; the target is judged without this)",
    )
    ap.add_argument(
        "--stages",
        action="store_true",
        help="diagnostic: time complete() and litellm.completion inside gatewayd (a wrapper)",
    )
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.calls, args.warmup = 2, 10, 3
    os.environ[KEY_ENV] = KEY  # gatewayd inherits it; the direct calls pass it themselves
    diagnostics = [d for d, on in (("--no-fsync", args.no_fsync), ("--stages", args.stages)) if on]
    print(
        f"model_overhead: {env_info()}, litellm {version('litellm')}; gatewayd serve, "
        f"durable audit {'OFF (diagnostic)' if args.no_fsync else 'on (default)'}"
        f"{', diagnostics ' + ' '.join(diagnostics) if diagnostics else ''}; "
        f"{args.rounds} rounds of {args.calls} calls per variant, interleaved"
    )
    bench = Bench()
    base = Path(tempfile.mkdtemp(prefix="cg-mo-", dir="/tmp"))
    try:
        with fake_provider() as port:
            progress(f"fake provider on 127.0.0.1:{port}; importing litellm")
            add_direct(bench, f"http://127.0.0.1:{port}/v1")
            progress("starting gatewayd serve")
            with gateway(port, base, args) as (client, sock, run_id), endpoint(sock, run_id) as api:
                add_gateway(bench, client)
                add_bare_http(bench, port)
                add_sdk(bench, api)
                bench.run(args.rounds, args.calls, args.warmup)
        inside = read_inside(base, args.rounds * args.calls)
        hand_off = hand_off_s(max(200, args.calls))
    finally:
        bench.close()
        shutil.rmtree(base, ignore_errors=True)
    report(bench, inside, hand_off, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
