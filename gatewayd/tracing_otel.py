"""The OpenTelemetry SDK behind the :class:`gatewayd.tracing.Tracer` protocol: imported only when an
endpoint is configured (:func:`gatewayd.tracing.open_tracer`).

The tracer provider is gatewayd's own, never the process-wide global one, so no
library gatewayd loads (litellm, the MCP SDK) reports into it or is changed by it. Spans
are exported by the SDK's batch processor, in a thread of its own: the trio thread only
queues a finished span (a bounded queue: a collector that is down loses spans, never
memory or a call's time). Its schedule, batch and queue sizes and the exporter's
timeout and headers follow the standard ``OTEL_BSP_*`` and ``OTEL_EXPORTER_OTLP_*``
variables.

Threads: run spans are opened and ended, and call spans made, on the trio thread only;
:meth:`OtelTracer.shutdown` runs in a worker thread at the daemon's end.
"""

from __future__ import annotations

from typing import Final

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, Status, StatusCode

from gatewayd.metrics import NO_ERROR

# The instrumentation scope's name, as collectors show it.
SCOPE: Final = "gatewayd"
# Span names: low cardinality, as OpenTelemetry asks (what varies is in attributes).
RUN_SPAN: Final = "gatewayd.run"
CALL_SPAN: Final = "gatewayd.call"
# Attribute names.
RUN_ID: Final = "gatewayd.run.id"
RUN_POLICY: Final = "gatewayd.run.policy"
RUN_END_REASON: Final = "gatewayd.run.end_reason"
TOOL: Final = "gatewayd.tool"
VERDICT: Final = "gatewayd.verdict"
ERROR_CODE: Final = "gatewayd.error_code"


class _OtelCallSpan:
    __slots__ = ("_span",)

    def __init__(self, span: Span) -> None:
        self._span = span

    def outcome(self, verdict: str, error_code: str | None) -> None:
        self._span.set_attribute(VERDICT, verdict)
        if error_code is not None:
            self._span.set_attribute(ERROR_CODE, error_code)
            self._span.set_status(Status(StatusCode.ERROR, error_code))

    def end(self) -> None:
        self._span.end()


class OtelTracer:
    """Runs' and calls' spans, exported to ``endpoint`` (an OTLP/HTTP traces URL)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, when set, are merged over this.
        self._provider = TracerProvider(resource=Resource.create({SERVICE_NAME: "gatewayd"}))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self._tracer = self._provider.get_tracer(SCOPE)
        # Each serving run's span, by run id: its calls' spans are made inside it.
        self._runs: dict[str, Span] = {}

    def run_started(self, run_id: str, policy: str) -> None:
        self._runs[run_id] = self._tracer.start_span(
            RUN_SPAN, attributes={RUN_ID: run_id, RUN_POLICY: policy}
        )

    def run_ended(self, run_id: str, reason: str, error_code: str) -> None:
        span = self._runs.pop(run_id, None)
        if span is None:
            return
        span.set_attribute(RUN_END_REASON, reason)
        span.set_attribute(ERROR_CODE, error_code)
        if error_code != NO_ERROR:
            span.set_status(Status(StatusCode.ERROR, error_code))
        span.end()

    def call(self, run_id: str, tool: str) -> _OtelCallSpan:
        run = self._runs.get(run_id)
        context = None if run is None else trace.set_span_in_context(run)
        return _OtelCallSpan(
            self._tracer.start_span(
                CALL_SPAN, context=context, attributes={RUN_ID: run_id, TOOL: tool}
            )
        )

    def shutdown(self) -> None:
        # Runs still open (a daemon stopping ends them first; this is the backstop).
        for run_id in list(self._runs):
            self.run_ended(run_id, "daemon_stopping", "internal")
        self._provider.shutdown()
