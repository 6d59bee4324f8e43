"""Operational metrics: gatewayd's families on ``prometheus_client``'s registry, exposed
in the Prometheus text format 0.0.4 by its ``generate_latest``.

The maintained client replaced a registry and renderer of our own once
bench/metrics_cost.py measured both in one run: its labelled child's ``inc`` plus a
histogram's ``observe`` add about 1 µs to a call, well under the 5 µs budget a call's
metrics were given (docs/metrics.md, "Cost"). The families are declared once, in
:class:`GatewayMetrics`; the names follow Prometheus's conventions (``gatewayd_`` prefix,
``_total`` for counters, base units: ``_seconds``), and the ``sandbox_run_`` families
are the ``sandbox.run.*`` metrics the sandboxed-agent design asks for, beside them.

Label values are never free text from a sandbox: tool names outside the daemon's tool
table become ``unknown``, error codes are the closed :class:`~gatewayd.protocol.ErrorCode`
set, end reasons and review sources are gatewayd's own words. So the number of series is
bounded by the code, not by what a run sends.

Threads: every value takes prometheus_client's lock when written, so the audit writer's
flusher thread and the trio thread write safely; rendering runs on the trio thread (the
control socket, the metrics listener).

One process-wide :data:`METRICS`: a Prometheus target is a process, and two places that
record are built below the daemon where it cannot hand them an object without threading
it through layers others own (the audit writer's flusher, opened before the daemon; the
bubblewrap launcher, reached through the run's sandbox session). The dispatcher and the
reviewer take theirs as a constructor argument (default: METRICS), so a test can give
them a registry of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Final

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from gatewayd.protocol import ErrorCode

# No ``_created`` series beside each counter and histogram: they would double the
# series gatewayd has always exported, and rate() does not need them. Process-wide
# (the client has no per-registry switch); gatewayd makes no other Prometheus metric.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

# The media type of the text exposition format served: generate_latest's legacy text,
# 0.0.4, which every Prometheus scrapes (the client's newest default names 1.0.0).
CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

# Latency buckets (seconds). Calls: 100 us (an fs.stat through the whole chokepoint) up
# to the longest call timeout worth telling apart.
CALL_BUCKETS: Final = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
# Reviews: a cache hit or a structured rule is microseconds; a model is 0.1-10 s.
REVIEW_BUCKETS: Final = (
    0.00001,
    0.0001,
    0.001,
    0.01,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
# fdatasync: tens of microseconds on NVMe, milliseconds on disks, seconds when sick.
FSYNC_BUCKETS: Final = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)
# Forking and exec'ing bwrap: a few milliseconds; more means a loaded host.
LAUNCH_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# A run's life: a `gatewayd run` of one command lasts a second, an agent's run minutes,
# a long one up to its maxRuntimeSec (hours at most).
RUN_BUCKETS: Final = (1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 7200.0, 14400.0)

# Label values for a call's decision, as the audit's ``call`` entry has them.
ALLOWED: Final = "allowed"
DENIED: Final = "denied"
# A tool name that is not in the daemon's tool table (or a frame that had none).
UNKNOWN_TOOL: Final = "unknown"
# How a run can end (gatewayd's words; see daemon.py and cli.py).
END_REASONS: Final = (
    "ended",
    "ended_by_operator",
    "interrupted_by_operator",
    "command_exited",
    "max_runtime_exceeded",
    "services_failed",
    "daemon_stopping",
)
# A run's end as the sandboxed-agent design's run result says it: ``ok``, else its
# ``errorCode``. A run ended by its owner, its operator, its command's exit or its
# finished work is ok; one whose time ran out is ``timeout``; an agent run the agent's
# loop stopped before its task was done is ``task_failed`` (its own result has the
# finer code, ``oom_killed`` among them: docs/agent-runs.md); one gatewayd ended (its
# services or its start failed, the daemon stopped under it) is ``internal``.
NO_ERROR: Final = "none"
RUN_ERROR_CODES: Final[Mapping[str, str]] = {
    "ended": NO_ERROR,
    "ended_by_operator": NO_ERROR,
    "interrupted_by_operator": NO_ERROR,
    "command_exited": NO_ERROR,
    "tool_called": NO_ERROR,
    "app_finished": NO_ERROR,
    "agent_finished": NO_ERROR,
    "mcp_server_stopped": NO_ERROR,
    "max_runtime_exceeded": "timeout",
    "mcp_server_timeout": "timeout",
    "agent_stopped": "task_failed",
    "agent_needs_sandbox": "internal",
    "services_failed": "internal",
    "start_failed": "internal",
    "mcp_server_failed": "internal",
    "daemon_stopping": "internal",
}


def run_error_code(reason: str) -> str:
    """The ``error_code`` label of a run that ended for ``reason`` (one of gatewayd's
    own words; an unknown one is gatewayd's bug, counted as ``internal``)."""
    return RUN_ERROR_CODES.get(reason, "internal")


class ReadCounter(Collector):
    """A counter whose value is read when scraped from something that counts already
    (the audit chain's sequence number): nothing on the hot path at all. The client's
    own Counter only counts what it is told, so this is its custom-collector form."""

    def __init__(self, name: str, help_text: str) -> None:
        if not name.endswith("_total"):
            raise ValueError(f"counter {name} must end in _total")
        self.name = name
        self.help = help_text
        self.function: Callable[[], float] = lambda: 0

    def collect(self) -> Iterable[Metric]:
        yield CounterMetricFamily(self.name, self.help, value=self.function())

    def describe(self) -> Iterable[Metric]:
        # Names only (the registry checks collisions with them): nothing is read.
        yield CounterMetricFamily(self.name, self.help, value=0)


class ToolMeter:
    """One tool's call series, held by the dispatcher so a call costs no label lookup."""

    __slots__ = ("allowed", "denied", "duration")

    def __init__(self, allowed: Counter, denied: Counter, duration: Histogram) -> None:
        self.allowed = allowed
        self.denied = denied
        self.duration = duration


class GatewayMetrics:
    """Every metric gatewayd exports, in one registry. docs/metrics.md lists them."""

    def __init__(self) -> None:
        # auto_describe: a family whose names collide with another's fails when added.
        r = self.registry = CollectorRegistry(auto_describe=True)
        codes = [str(code) for code in ErrorCode]
        self.runs_started = Counter(
            "gatewayd_runs_started_total", "Runs started (their socket is served).", registry=r
        )
        self.runs_active = Gauge(
            "gatewayd_runs_active", "Runs in the registry now (serving or ending).", registry=r
        )
        self.sandbox_uids_leased = Gauge(
            "gatewayd_sandbox_uids_leased",
            "Sandbox uids leased to runs now (0 when no run holds one).",
            registry=r,
        )
        self.runs_ended = Counter(
            "gatewayd_runs_ended_total", "Runs ended, by reason.", ["reason"], registry=r
        )
        _declare(self.runs_ended, END_REASONS)
        self.runs_refused = Counter(
            "gatewayd_runs_refused_total",
            "Run requests refused before start, by error code.",
            ["code"],
            registry=r,
        )
        _declare(self.runs_refused, codes)
        self.calls = Counter(
            "gatewayd_calls_total",
            "Tool calls answered, by tool and decision (allowed: it ran; denied: refused "
            "before it ran).",
            ["tool", "decision"],
            registry=r,
        )
        self.denials = Counter(
            "gatewayd_denials_total",
            "Calls refused before they ran (decision denied), by error code.",
            ["code"],
            registry=r,
        )
        _declare(self.denials, codes)
        self.call_failures = Counter(
            "gatewayd_call_failures_total",
            "Allowed calls that ended in an error (tool_failed, timeout, internal), by code.",
            ["code"],
            registry=r,
        )
        _declare(
            self.call_failures,
            [str(c) for c in (ErrorCode.TOOL_FAILED, ErrorCode.TIMEOUT, ErrorCode.INTERNAL)],
        )
        self.call_duration = Histogram(
            "gatewayd_call_duration_seconds",
            "Allowed calls: from the request to the answer (review, audit write-ahead, "
            "the tool, scrubbing), by tool.",
            ["tool"],
            buckets=CALL_BUCKETS,
            registry=r,
        )
        self.reviews = Histogram(
            "gatewayd_review_duration_seconds",
            "Rule reviews, by where the verdict came from (structured, cache, model, failed).",
            ["source"],
            buckets=REVIEW_BUCKETS,
            registry=r,
        )
        self.review_cache_hits = Counter(
            "gatewayd_review_cache_hits_total",
            "Reviews answered from the decision cache.",
            registry=r,
        )
        self.review_cache_misses = Counter(
            "gatewayd_review_cache_misses_total",
            "Cacheable reviews the decision cache could not answer (the model is asked).",
            registry=r,
        )
        self.audit_fsync = Histogram(
            "gatewayd_audit_fsync_duration_seconds",
            "fdatasync of one batch of audit entries (group commit), in the flusher thread.",
            buckets=FSYNC_BUCKETS,
            registry=r,
        )
        self.audit_entries = ReadCounter(
            "gatewayd_audit_entries_total",
            "Audit entries recorded by this gatewayd process (calls, results, events).",
        )
        r.register(self.audit_entries)
        self.sandbox_launch = Histogram(
            "gatewayd_sandbox_launch_duration_seconds",
            "Starting one sandboxed command: fork, the child's setup (network namespace, "
            "uid, pinned mounts) and the exec of bwrap.",
            buckets=LAUNCH_BUCKETS,
            registry=r,
        )
        self.egress_connections = Counter(
            "gatewayd_egress_connections_total",
            "Connections to the runs' egress proxies, by verdict.",
            ["verdict"],
            registry=r,
        )
        _declare(self.egress_connections, (ALLOWED, DENIED))
        # -- sandbox.run.*: the sandboxed-agent design's names for the same runs
        self.sandbox_run_started = Counter(
            "sandbox_run_started_total", "Sandbox runs started (sandbox.run.started).", registry=r
        )
        self.sandbox_run_active = Gauge(
            "sandbox_run_active",
            "Sandbox runs now, serving or ending (sandbox.run.active).",
            registry=r,
        )
        self.sandbox_run_completed = Counter(
            "sandbox_run_completed_total",
            "Sandbox runs ended, by their result's ok and errorCode (sandbox.run.completed).",
            ["ok", "error_code"],
            registry=r,
        )
        for code in sorted(set(RUN_ERROR_CODES.values())):
            self.sandbox_run_completed.labels(_ok_label(code), code)
        self.sandbox_run_refused = Counter(
            "sandbox_run_refused_total",
            "Sandbox run requests refused before start, by error code (sandbox.run.refused; "
            "authz_denied: no allowSandbox grant).",
            ["error_code"],
            registry=r,
        )
        _declare(self.sandbox_run_refused, codes)
        self.sandbox_run_duration = Histogram(
            "sandbox_run_duration_seconds",
            "Sandbox runs from serving to their end (sandbox.run.duration).",
            buckets=RUN_BUCKETS,
            registry=r,
        )

    def count_runs_with(self, active: Callable[[], float]) -> None:
        """Read both families' runs in progress from ``active`` when scraped."""
        self.runs_active.set_function(active)
        self.sandbox_run_active.set_function(active)

    def count_uids_with(self, leased: Callable[[], float]) -> None:
        """Read the sandbox uids leased now from ``leased`` when scraped: what shows a
        uid lease outliving its run (bench/many_runs.py checks it after every run ended)."""
        self.sandbox_uids_leased.set_function(leased)

    def run_started(self) -> None:
        self.runs_started.inc()
        self.sandbox_run_started.inc()

    def run_refused(self, code: str) -> None:
        self.runs_refused.labels(code).inc()
        self.sandbox_run_refused.labels(code).inc()

    def run_ended(self, reason: str, seconds: float | None) -> None:
        """A run ended for ``reason`` after serving ``seconds`` (None: it never served,
        so it has no duration)."""
        self.runs_ended.labels(reason).inc()
        code = run_error_code(reason)
        self.sandbox_run_completed.labels(_ok_label(code), code).inc()
        if seconds is not None:
            self.sandbox_run_duration.observe(seconds)

    def tool_meter(self, tool: str) -> ToolMeter:
        """The series of one tool label (a name from the tool table, or UNKNOWN_TOOL)."""
        return ToolMeter(
            self.calls.labels(tool, ALLOWED),
            self.calls.labels(tool, DENIED),
            self.call_duration.labels(tool),
        )

    def render(self) -> str:
        """Every family in the Prometheus text exposition format 0.0.4."""
        return generate_latest(self.registry).decode()


def _declare(counter: Counter, values: Iterable[str]) -> None:
    """Make a one-label counter's series exist at 0, so rate() works from the first
    scrape."""
    for value in values:
        counter.labels(value)


def _ok_label(code: str) -> str:
    return "true" if code == NO_ERROR else "false"


METRICS: Final = GatewayMetrics()
