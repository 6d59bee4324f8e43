"""OpenTelemetry traces of runs and calls, when the operator asks for them: a span per
run (from its start to its end) and, inside it, a span per tool call, exported over
OTLP/HTTP to a collector.

Configured by ``otel_endpoint`` (gatewayd's configuration: the collector's base URL,
``/v1/traces`` is added) or, when that is unset, the standard variables the
OpenTelemetry SDKs read: ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (the full URL) or
``OTEL_EXPORTER_OTLP_ENDPOINT`` (a base URL). ``OTEL_SDK_DISABLED=true`` turns them off.

Not configured, which is the default, costs nothing: this module imports no
OpenTelemetry package, :func:`open_tracer` returns None, and the dispatcher and the run
manager hold None and test it once per call and per run. The SDK is imported only by
:mod:`gatewayd.tracing_otel` (which holds the span and attribute names, and imports
nothing of this module), and only when an endpoint is configured (a test proves both).
The maintained SDK does the spans, the batching and the export; nothing of the wire
format is written here.

Span attributes are gatewayd's own words and bounded values, as the metrics' labels:
the run id gatewayd made, a tool name from its tool table (else ``unknown``), the
decision, the closed set of error codes. Nothing a sandbox wrote (arguments, output)
is put in a span: traces leave the host, and the audit log is where calls are kept.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, Protocol
from urllib.parse import urlsplit

# The standard variables (OpenTelemetry's SDK configuration specification).
TRACES_ENDPOINT_ENV: Final = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
ENDPOINT_ENV: Final = "OTEL_EXPORTER_OTLP_ENDPOINT"
SDK_DISABLED_ENV: Final = "OTEL_SDK_DISABLED"
# Appended to a base endpoint (OTLP/HTTP's path for traces).
TRACES_PATH: Final = "v1/traces"
# A collector URL is a short thing; anything near this is a mistake.
MAX_ENDPOINT_CHARS: Final = 2048


class TracingError(ValueError):
    """The configured endpoint is not one gatewayd can export to; the message says
    which setting and what is wrong with it."""


class CallSpan(Protocol):
    """One call's span, open while the call is handled."""

    def outcome(self, verdict: str, error_code: str | None) -> None:
        """The call's verdict (``allowed``: it ran; ``denied``) and error code, if any."""

    def end(self) -> None: ...


class Tracer(Protocol):
    """What the dispatcher and the run manager call when tracing is on."""

    def run_started(self, run_id: str, policy: str) -> None: ...

    def run_ended(self, run_id: str, reason: str, error_code: str) -> None: ...

    def call(self, run_id: str, tool: str) -> CallSpan:
        """A span for one call of the run ``run_id`` to ``tool`` (a bounded label),
        inside the run's span."""

    def shutdown(self) -> None:
        """Export what is queued and stop (blocks: call it in a worker thread)."""


def check_endpoint(url: str, setting: str) -> str:
    """``url`` if it is an http(s) URL with a host, else TracingError naming
    ``setting``."""
    if len(url) > MAX_ENDPOINT_CHARS:
        raise TracingError(f"{setting} is over {MAX_ENDPOINT_CHARS} characters")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (parsing the port is the check)
    except ValueError as exc:
        raise TracingError(f"{setting} {url!r} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TracingError(
            f"{setting} {url!r} is not an OTLP/HTTP endpoint: write it as "
            "http://HOST:PORT (a collector's OTLP/HTTP port is 4318), or https://..."
        )
    return url


def traces_endpoint(configured: str | None, environ: Mapping[str, str]) -> str | None:
    """The URL spans are sent to, or None: tracing is off.

    ``configured`` (the ``otel_endpoint`` setting, a base URL) wins over the standard
    variables; of these, the traces-only full URL wins over the base one, as in every
    OpenTelemetry SDK. ``OTEL_SDK_DISABLED=true`` turns all of them off.

    Error handling: TracingError for a value that is not an http(s) URL."""
    if environ.get(SDK_DISABLED_ENV, "").strip().lower() == "true":
        return None
    if configured:
        return _with_traces_path(check_endpoint(configured, "otel_endpoint"))
    full = environ.get(TRACES_ENDPOINT_ENV, "").strip()
    if full:
        return check_endpoint(full, TRACES_ENDPOINT_ENV)
    base = environ.get(ENDPOINT_ENV, "").strip()
    if base:
        return _with_traces_path(check_endpoint(base, ENDPOINT_ENV))
    return None


def _with_traces_path(base: str) -> str:
    return base if base.endswith("/" + TRACES_PATH) else base.rstrip("/") + "/" + TRACES_PATH


def open_tracer(configured: str | None, environ: Mapping[str, str]) -> Tracer | None:
    """A tracer exporting to the configured endpoint, or None when none is configured
    (and then no OpenTelemetry module is imported).

    Error handling: TracingError for an endpoint that is not an http(s) URL."""
    endpoint = traces_endpoint(configured, environ)
    if endpoint is None:
        return None
    from gatewayd.tracing_otel import OtelTracer

    return OtelTracer(endpoint)
