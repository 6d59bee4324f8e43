"""What the metrics and the tracing add to one call on the trio thread.

    .venv/bin/python bench/metrics_cost.py [--calls N]

Part 1, the metrics (ns of the thread's CPU time per call, a Python call's own cost
taken off), both registries in the same run: the hand-written registry gatewayd had
(its hot path reproduced below: a dict lookup and an add per counter, a bisect per
histogram) and prometheus_client's, alone and as the dispatcher now uses it (an allowed
call: calls counter and duration histogram; a denied call: calls and denials
counters). The decision rule: prometheus_client's registry and exposition unless a
call's hooks cost more than BUDGET_NS (5 µs).

Part 2, tracing (µs per call through the whole chokepoint, in memory: the dispatcher's
handle() with an in-memory audit log and a tool that returns at once), rounds
interleaved so the machine's drift falls on all three alike: the baseline (the steps
alone, without handle()'s tracing test), tracing off (what every call now pays), and
tracing on (the OpenTelemetry SDK exporting over OTLP/HTTP to a stand-in collector on
loopback, in a process of its own as a real collector is).

Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import statistics
import subprocess
import sys
import time
import timeit
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gatewayd.dispatch import Dispatcher
from gatewayd.metrics import CALL_BUCKETS, GatewayMetrics
from gatewayd.policy import TokenBucket
from gatewayd.protocol import ErrorCode
from gatewayd.tools import builtin_tools
from gatewayd.tracing import open_tracer

N = 1_000_000
# The rule: the maintained client unless a call's metrics cost more than this.
BUDGET_NS = 5_000
ROUNDS = 5


def per_call_ns(stmt: Any, number: int = N, repeat: int = 7) -> float:
    # The thread's CPU time, not the wall clock: what a call costs the trio thread,
    # without the time a busy machine takes the CPU away (the fastest of the repeats).
    times = timeit.repeat(stmt, number=number, repeat=repeat, timer=time.thread_time)
    return min(times) / number * 1e9


class _Cell:
    """The retired registry's counter series (gatewayd/metrics.py before prometheus_client)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: float = 0


class _HistogramSeries:
    """The retired registry's histogram series, trio thread only (no lock)."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self._bounds, value)] += 1
        self.sum += value


def metrics_rows() -> list[tuple[str, float]]:
    dispatcher = Dispatcher.__new__(Dispatcher)  # no audit log: only the metric hooks run
    Dispatcher.__init__(dispatcher, None, builtin_tools(), metrics=GatewayMetrics())  # type: ignore[arg-type]
    baseline: dict[tuple[str, str], int] = {("fs.read", "allowed"): 0}
    key = ("fs.read", "allowed")
    meters = {"fs.read": (_Cell(), _Cell(), _HistogramSeries(CALL_BUCKETS))}
    denials = {code: _Cell() for code in ErrorCode}

    def budget() -> None:
        baseline[key] += 1

    def ours_allowed() -> None:
        allowed, _, duration = meters["fs.read"]
        allowed.value += 1
        duration.observe(0.0004)

    def ours_denied() -> None:
        meters["fs.read"][1].value += 1
        denials[ErrorCode.POLICY_DENIED].value += 1

    registry = GatewayMetrics()
    held = registry.tool_meter("fs.read")
    held_denials = registry.denials.labels(str(ErrorCode.POLICY_DENIED))

    def alone_allowed() -> None:
        held.allowed.inc()
        held.duration.observe(0.0004)

    def alone_denied() -> None:
        held.denied.inc()
        held_denials.inc()

    def client_allowed() -> None:
        dispatcher._count_allowed("fs.read", 0.0004, None)

    def client_denied() -> None:
        dispatcher._count_denied("fs.read", ErrorCode.POLICY_DENIED)

    def empty() -> None:
        pass

    call = per_call_ns(empty)
    return [
        ("python call (taken off the rows below)", call),
        ("budget: dict lookup + int add", per_call_ns(budget) - call),
        ("hand-written, series held: allowed call", per_call_ns(ours_allowed) - call),
        ("hand-written, series held: denied call", per_call_ns(ours_denied) - call),
        ("prometheus_client, series held: allowed call", per_call_ns(alone_allowed) - call),
        ("prometheus_client, series held: denied call", per_call_ns(alone_denied) - call),
        ("dispatcher's hooks (client): allowed call", per_call_ns(client_allowed) - call),
        ("dispatcher's hooks (client): denied call", per_call_ns(client_denied) - call),
    ]


def tracing_rows(calls: int) -> list[tuple[str, list[float]]]:
    """µs per call through Dispatcher.handle, per round, for each variant."""
    from tests.unit.test_dispatch import PEER, FakeAuditLog, Seen, call, fake_tools, make_run

    results: dict[str, list[float]] = {"baseline": [], "tracing off": [], "tracing on": []}
    with collector() as (base_url, received):
        tracer = open_tracer(base_url, {})
        assert tracer is not None

        async def measure(variant: str) -> float:
            log = FakeAuditLog()
            seen = Seen(durable_seq=lambda: log.durable_seq)
            dispatcher = Dispatcher(log, fake_tools(seen), metrics=GatewayMetrics())  # type: ignore[arg-type]
            dispatcher.tracer = tracer if variant == "tracing on" else None
            run = make_run(Path("/nonexistent-bench"))
            run.bucket = TokenBucket(rate=1e9, burst=10**9)  # the bench is not rate-limited
            if variant == "tracing on":
                tracer.run_started(run.run_id, "bench")
            req = call("test.echo", {"text": "hello"})
            started = time.perf_counter()
            if variant == "baseline":
                for _ in range(calls):
                    await dispatcher._handle(run, req, PEER, None)
            else:
                for _ in range(calls):
                    await dispatcher.handle(run, req, PEER)
            elapsed = time.perf_counter() - started
            if variant == "tracing on":
                tracer.run_ended(run.run_id, "ended", "none")
            return elapsed / calls * 1e6

        for _ in range(ROUNDS):
            for variant, figures in results.items():
                figures.append(trio.run(measure, variant))
        tracer.shutdown()
        print(f"(export requests answered by the loopback collector: {received()})")
    return list(results.items())


# A stand-in collector in a process of its own (as a real one is): it reads each export
# and answers it with an empty ExportTraceServiceResponse, counting the requests.
_COLLECTOR = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
count = 0
class H(BaseHTTPRequestHandler):
    def do_POST(self):
        global count
        self.rfile.read(int(self.headers["content-length"]))
        count += 1
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()
    def do_GET(self):
        body = str(count).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
server = HTTPServer(("127.0.0.1", 0), H)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


@contextlib.contextmanager
def collector() -> Iterator[tuple[str, Callable[[], int]]]:
    proc = subprocess.Popen([sys.executable, "-c", _COLLECTOR], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        base_url = f"http://127.0.0.1:{int(proc.stdout.readline())}"

        def received() -> int:
            with urllib.request.urlopen(base_url, timeout=10) as answer:
                return int(answer.read())

        yield base_url, received
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=5000, help="calls per tracing round")
    args = parser.parse_args()

    rows = metrics_rows()
    print("Part 1: metrics, ns of the thread's CPU time per call")
    print(f"{'what':46} ns/call")
    for what, ns in rows:
        print(f"{what:46} {ns:7.0f}")
    # What a call pays: the dispatcher's hooks, the dearer of its two rows.
    worst = max(ns for what, ns in rows if what.startswith("dispatcher's hooks"))
    verdict = "prometheus_client" if worst <= BUDGET_NS else "the hand-written registry"
    print(f"decision: {verdict} (its dearest call {worst:.0f} ns; budget {BUDGET_NS} ns)")

    loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry.sdk"))
    print(f"\nOpenTelemetry SDK modules loaded before tracing is switched on: {len(loaded)}")
    print(f"Part 2: tracing, µs per call through Dispatcher.handle ({args.calls} calls x {ROUNDS})")
    print(f"{'variant':15} {'median':>8} {'min':>8} {'max':>8}")
    for variant, figures in tracing_rows(args.calls):
        print(
            f"{variant:15} {statistics.median(figures):8.2f} {min(figures):8.2f} "
            f"{max(figures):8.2f}"
        )


if __name__ == "__main__":
    main()
