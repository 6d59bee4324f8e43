"""Operational metrics: a small registry and the Prometheus text format (0.0.4).

No dependency: a counter is a dict from a tuple of label values to a number, so counting
a call costs one dict update on the trio thread (bench/metrics_cost.py measures it). The
families are declared once, in :class:`GatewayMetrics`; the names follow Prometheus's
conventions (``gatewayd_`` prefix, ``_total`` for counters, base units: ``_seconds``).

Label values are never free text from a sandbox: tool names outside the daemon's tool
table become ``unknown``, error codes are the closed :class:`~gatewayd.protocol.ErrorCode`
set, end reasons and review sources are gatewayd's own words. So the number of series is
bounded by the code, not by what a run sends.

Threads: counters, gauges and most histograms are written on the trio thread only (one
writer, no lock); the audit fsync histogram is observed by the flusher thread and takes
a lock per observation (``threaded=True``). Rendering runs on the trio thread.

One process-wide :data:`METRICS`: a Prometheus target is a process, and two places that
record are built below the daemon where it cannot hand them an object without threading
it through layers others own (the audit writer's flusher, opened before the daemon; the
bubblewrap launcher, reached through the run's sandbox session). The dispatcher and the
reviewer take theirs as a constructor argument (default: METRICS), so a test can give
them a registry of its own.
"""

from __future__ import annotations

import bisect
import math
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Final, TypeVar

from gatewayd.protocol import ErrorCode

# The media type of the text exposition format this module writes.
CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

_NAME: Final = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL: Final = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")

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

Labels = tuple[str, ...]


def _check_names(name: str, labelnames: Sequence[str]) -> None:
    if not _NAME.fullmatch(name):
        raise ValueError(f"metric name {name!r} is not a Prometheus name")
    for label in labelnames:
        if not _LABEL.fullmatch(label) or label.startswith("__") or label == "le":
            raise ValueError(f"label name {label!r} of {name} is not allowed")
    if len(set(labelnames)) != len(labelnames):
        raise ValueError(f"{name} repeats a label name")


class _Family:
    kind: str = "untyped"

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        _check_names(name, labelnames)
        self.name = name
        self.help = help_text
        self.labelnames = tuple(labelnames)

    def _check_labels(self, labels: Labels) -> None:
        if len(labels) != len(self.labelnames) or not all(isinstance(v, str) for v in labels):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {labels!r}")

    def samples(self) -> Iterator[tuple[str, Labels, tuple[str, ...], float]]:
        """(sample name, label names, label values, value) for rendering."""
        raise NotImplementedError


class Cell:
    """One series' number. Hot paths hold the cell and add to ``value`` directly."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: float = 0


class Counter(_Family):
    """A monotonically increasing number per label set. Label sets are checked when a
    cell is made and when rendered, never per increment."""

    kind = "counter"

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        if not name.endswith("_total"):
            raise ValueError(f"counter {name} must end in _total")
        super().__init__(name, help_text, labelnames)
        self._cells: dict[Labels, Cell] = {}
        if not labelnames:
            self._cells[()] = Cell()

    def cell(self, labels: Labels = ()) -> Cell:
        """The series for ``labels``, made at 0 if new (so a rate over it starts at the
        first scrape). A hot path keeps the cell and does ``cell.value += 1``."""
        found = self._cells.get(labels)
        if found is None:
            self._check_labels(labels)
            found = self._cells[labels] = Cell()
        return found

    def inc(self, labels: Labels = (), amount: float = 1) -> None:
        found = self._cells.get(labels)
        if found is None:
            found = self.cell(labels)
        found.value += amount

    def declare(self, *label_sets: Labels) -> None:
        """Make these series exist at 0."""
        for labels in label_sets:
            self.cell(labels)

    def value(self, labels: Labels = ()) -> float:
        found = self._cells.get(labels)
        return 0 if found is None else found.value

    def samples(self) -> Iterator[tuple[str, Labels, tuple[str, ...], float]]:
        for labels, found in sorted(self._cells.items()):
            yield self.name, self.labelnames, labels, found.value


class Gauge(_Family):
    """A number that goes up and down; or, with ``function``, read when scraped (costs
    nothing between scrapes)."""

    kind = "gauge"

    def __init__(
        self,
        name: str,
        help_text: str,
        *,
        function: Callable[[], float] | None = None,
    ) -> None:
        super().__init__(name, help_text)
        self._value: float = 0
        self.function = function

    def set(self, value: float) -> None:
        self._value = value

    def value(self) -> float:
        return self.function() if self.function is not None else self._value

    def samples(self) -> Iterator[tuple[str, Labels, tuple[str, ...], float]]:
        yield self.name, (), (), self.value()


class CounterFunction(_Family):
    """A counter whose value is read when scraped from something that counts already
    (the audit chain's sequence number): nothing on the hot path at all."""

    kind = "counter"

    def __init__(self, name: str, help_text: str) -> None:
        if not name.endswith("_total"):
            raise ValueError(f"counter {name} must end in _total")
        super().__init__(name, help_text)
        self.function: Callable[[], float] = lambda: 0

    def samples(self) -> Iterator[tuple[str, Labels, tuple[str, ...], float]]:
        yield self.name, (), (), self.function()


class HistogramSeries:
    """One label set's buckets (not cumulative; the last is +Inf), sum and count. A hot
    path keeps the series and calls ``observe``."""

    __slots__ = ("_bounds", "_lock", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...], lock: threading.Lock | None) -> None:
        self._bounds = bounds
        self._lock = lock
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(self._bounds, value)  # le is inclusive
        lock = self._lock
        if lock is None:
            self.counts[index] += 1
            self.sum += value
        else:
            with lock:
                self.counts[index] += 1
                self.sum += value

    def snapshot(self) -> tuple[list[int], float]:
        if self._lock is None:
            return list(self.counts), self.sum
        with self._lock:
            return list(self.counts), self.sum


class Histogram(_Family):
    """Observations counted into fixed buckets (upper bounds, ascending), with their sum
    and count, per label set. ``threaded``: observed from more than one thread (a lock
    per observation, ~50 ns); otherwise the trio thread alone writes it, lock-free."""

    kind = "histogram"

    def __init__(
        self,
        name: str,
        help_text: str,
        buckets: Sequence[float],
        labelnames: Sequence[str] = (),
        *,
        threaded: bool = False,
    ) -> None:
        super().__init__(name, help_text, labelnames)
        bounds = [float(b) for b in buckets if b != math.inf]
        if not bounds or bounds != sorted(set(bounds)) or any(math.isnan(b) for b in bounds):
            raise ValueError(f"{name}: buckets must be distinct, ascending numbers")
        self.bounds = tuple(bounds)
        self._lock = threading.Lock() if threaded else None
        self._series: dict[Labels, HistogramSeries] = {}
        if not labelnames:
            self._series[()] = HistogramSeries(self.bounds, self._lock)

    def series(self, labels: Labels = ()) -> HistogramSeries:
        """The series for ``labels``, made empty if new."""
        found = self._series.get(labels)
        if found is None:
            self._check_labels(labels)
            found = self._series[labels] = HistogramSeries(self.bounds, self._lock)
        return found

    def observe(self, value: float, labels: Labels = ()) -> None:
        found = self._series.get(labels)
        if found is None:
            found = self.series(labels)
        found.observe(value)

    def declare(self, *label_sets: Labels) -> None:
        for labels in label_sets:
            self.series(labels)

    def count(self, labels: Labels = ()) -> int:
        found = self._series.get(labels)
        return 0 if found is None else sum(found.snapshot()[0])

    def samples(self) -> Iterator[tuple[str, Labels, tuple[str, ...], float]]:
        names = (*self.labelnames, "le")
        for labels, found in sorted(self._series.items(), key=lambda item: item[0]):
            counts, total = found.snapshot()
            cumulative = 0
            for bound, n in zip((*self.bounds, math.inf), counts, strict=True):
                cumulative += n
                yield f"{self.name}_bucket", names, (*labels, _number(bound)), cumulative
            yield f"{self.name}_sum", self.labelnames, labels, total
            yield f"{self.name}_count", self.labelnames, labels, cumulative


_F = TypeVar("_F", bound=_Family)


class Registry:
    """Metric families in the order they were added, rendered together."""

    def __init__(self) -> None:
        self._families: dict[str, _Family] = {}

    def add(self, family: _F) -> _F:
        taken = _sample_names(family)
        for existing in self._families.values():
            if taken & _sample_names(existing):
                raise ValueError(f"metric {family.name} collides with {existing.name}")
        self._families[family.name] = family
        return family

    def __iter__(self) -> Iterator[_Family]:
        return iter(self._families.values())

    def render(self) -> str:
        """Every family in the Prometheus text exposition format 0.0.4."""
        return render(self)


def _sample_names(family: _Family) -> set[str]:
    if isinstance(family, Histogram):
        return {family.name, *(f"{family.name}_{s}" for s in ("bucket", "sum", "count"))}
    return {family.name}


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def render(families: Iterable[_Family]) -> str:
    """The text exposition format 0.0.4: ``# HELP``, ``# TYPE``, then one line per
    sample; a newline ends the text."""
    lines: list[str] = []
    for family in families:
        lines.append(f"# HELP {family.name} {_escape_help(family.help)}")
        lines.append(f"# TYPE {family.name} {family.kind}")
        for sample, names, values, value in family.samples():
            if names:
                pairs = ",".join(
                    f'{n}="{_escape_label(v)}"' for n, v in zip(names, values, strict=True)
                )
                lines.append(f"{sample}{{{pairs}}} {_number(value)}")
            else:
                lines.append(f"{sample} {_number(value)}")
    return "\n".join(lines) + "\n"


# Label values for a call's decision, as the audit's ``call`` entry has them.
ALLOWED: Final = "allowed"
DENIED: Final = "denied"
# A tool name that is not in the daemon's tool table (or a frame that had none).
UNKNOWN_TOOL: Final = "unknown"
# How a run can end (gatewayd's words; see daemon.py and cli.py).
END_REASONS: Final = (
    "ended",
    "ended_by_operator",
    "command_exited",
    "max_runtime_exceeded",
    "services_failed",
    "daemon_stopping",
)


class ToolMeter:
    """One tool's call series, held by the dispatcher so a call costs no label lookup."""

    __slots__ = ("allowed", "denied", "duration")

    def __init__(self, allowed: Cell, denied: Cell, duration: HistogramSeries) -> None:
        self.allowed = allowed
        self.denied = denied
        self.duration = duration


class GatewayMetrics:
    """Every metric gatewayd exports, in one registry. docs/metrics.md lists them."""

    def __init__(self) -> None:
        r = self.registry = Registry()
        codes = [(str(code),) for code in ErrorCode]
        self.runs_started = r.add(
            Counter("gatewayd_runs_started_total", "Runs started (their socket is served).")
        )
        self.runs_active = r.add(
            Gauge("gatewayd_runs_active", "Runs in the registry now (serving or ending).")
        )
        self.runs_ended = r.add(
            Counter("gatewayd_runs_ended_total", "Runs ended, by reason.", ["reason"])
        )
        self.runs_ended.declare(*[(reason,) for reason in END_REASONS])
        self.runs_refused = r.add(
            Counter(
                "gatewayd_runs_refused_total",
                "Run requests refused before start, by error code.",
                ["code"],
            )
        )
        self.runs_refused.declare(*codes)
        self.calls = r.add(
            Counter(
                "gatewayd_calls_total",
                "Tool calls answered, by tool and decision (allowed: it ran; denied: refused "
                "before it ran).",
                ["tool", "decision"],
            )
        )
        self.denials = r.add(
            Counter(
                "gatewayd_denials_total",
                "Calls refused before they ran (decision denied), by error code.",
                ["code"],
            )
        )
        self.denials.declare(*codes)
        self.call_failures = r.add(
            Counter(
                "gatewayd_call_failures_total",
                "Allowed calls that ended in an error (tool_failed, timeout, internal), by code.",
                ["code"],
            )
        )
        self.call_failures.declare(
            *[(str(c),) for c in (ErrorCode.TOOL_FAILED, ErrorCode.TIMEOUT, ErrorCode.INTERNAL)]
        )
        self.call_duration = r.add(
            Histogram(
                "gatewayd_call_duration_seconds",
                "Allowed calls: from the request to the answer (review, audit write-ahead, "
                "the tool, scrubbing), by tool.",
                CALL_BUCKETS,
                ["tool"],
            )
        )
        self.reviews = r.add(
            Histogram(
                "gatewayd_review_duration_seconds",
                "Rule reviews, by where the verdict came from (structured, cache, model, failed).",
                REVIEW_BUCKETS,
                ["source"],
            )
        )
        self.review_cache_hits = r.add(
            Counter(
                "gatewayd_review_cache_hits_total",
                "Reviews answered from the decision cache.",
            )
        )
        self.review_cache_misses = r.add(
            Counter(
                "gatewayd_review_cache_misses_total",
                "Cacheable reviews the decision cache could not answer (the model is asked).",
            )
        )
        self.audit_fsync = r.add(
            Histogram(
                "gatewayd_audit_fsync_duration_seconds",
                "fdatasync of one batch of audit entries (group commit), in the flusher thread.",
                FSYNC_BUCKETS,
                threaded=True,
            )
        )
        self.audit_entries = r.add(
            CounterFunction(
                "gatewayd_audit_entries_total",
                "Audit entries recorded by this gatewayd process (calls, results, events).",
            )
        )
        self.sandbox_launch = r.add(
            Histogram(
                "gatewayd_sandbox_launch_duration_seconds",
                "Starting one sandboxed command: fork, the child's setup (network namespace, "
                "uid, pinned mounts) and the exec of bwrap.",
                LAUNCH_BUCKETS,
            )
        )
        self.egress_connections = r.add(
            Counter(
                "gatewayd_egress_connections_total",
                "Connections to the runs' egress proxies, by verdict.",
                ["verdict"],
            )
        )
        self.egress_connections.declare((ALLOWED,), (DENIED,))

    def tool_meter(self, tool: str) -> ToolMeter:
        """The series of one tool label (a name from the tool table, or UNKNOWN_TOOL)."""
        return ToolMeter(
            self.calls.cell((tool, ALLOWED)),
            self.calls.cell((tool, DENIED)),
            self.call_duration.series((tool,)),
        )

    def render(self) -> str:
        return self.registry.render()


METRICS: Final = GatewayMetrics()
