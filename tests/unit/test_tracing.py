"""Where traces go (gatewayd/tracing.py): the setting over the standard variables, what
turns them off, what is refused. That deciding so loads no OpenTelemetry module, in a
fresh interpreter, is tests/integration/test_tracing_imports.py's; the spans themselves,
exported to a loopback receiver by a real daemon, are
tests/integration/test_observability.py's."""

from __future__ import annotations

import pytest

from gatewayd.tracing import (
    ENDPOINT_ENV,
    MAX_ENDPOINT_CHARS,
    SDK_DISABLED_ENV,
    TRACES_ENDPOINT_ENV,
    TracingError,
    open_tracer,
    traces_endpoint,
)
from tests.otlp_receiver import otlp_receiver


@pytest.mark.parametrize(
    ("configured", "environ", "endpoint"),
    [
        (None, {}, None),
        (None, {ENDPOINT_ENV: ""}, None),
        ("http://c:4318", {}, "http://c:4318/v1/traces"),
        ("http://c:4318/", {}, "http://c:4318/v1/traces"),
        ("https://c/otlp", {}, "https://c/otlp/v1/traces"),
        ("http://c:4318/v1/traces", {}, "http://c:4318/v1/traces"),  # not twice
        (None, {ENDPOINT_ENV: "http://base:4318"}, "http://base:4318/v1/traces"),
        (None, {TRACES_ENDPOINT_ENV: "http://full:1/x"}, "http://full:1/x"),  # as given
        # The traces-only URL wins over the base one; the setting wins over both.
        (
            None,
            {ENDPOINT_ENV: "http://base:4318", TRACES_ENDPOINT_ENV: "http://full:1/x"},
            "http://full:1/x",
        ),
        (
            "http://mine:4318",
            {TRACES_ENDPOINT_ENV: "http://full:1/x"},
            "http://mine:4318/v1/traces",
        ),
        # OTEL_SDK_DISABLED turns every source off.
        ("http://mine:4318", {SDK_DISABLED_ENV: "true"}, None),
        (None, {ENDPOINT_ENV: "http://base:4318", SDK_DISABLED_ENV: " TRUE "}, None),
        (
            None,
            {ENDPOINT_ENV: "http://base:4318", SDK_DISABLED_ENV: "false"},
            "http://base:4318/v1/traces",
        ),
    ],
)
def test_the_endpoint_comes_from_the_setting_else_the_standard_variables(
    configured: str | None, environ: dict[str, str], endpoint: str | None
) -> None:
    assert traces_endpoint(configured, environ) == endpoint


@pytest.mark.parametrize(
    ("configured", "environ", "says"),
    [
        ("ftp://c:21", {}, "otel_endpoint 'ftp://c:21' is not an OTLP/HTTP endpoint"),
        ("c:4318", {}, "write it as http://HOST:PORT"),
        ("http://:4318", {}, "is not an OTLP/HTTP endpoint"),
        ("http://c:99999", {}, "otel_endpoint 'http://c:99999' is not a URL"),
        (None, {ENDPOINT_ENV: "localhost:4318"}, f"{ENDPOINT_ENV} 'localhost:4318'"),
        (None, {TRACES_ENDPOINT_ENV: "unix:///x"}, f"{TRACES_ENDPOINT_ENV} 'unix:///x'"),
        ("http://c/" + "a" * MAX_ENDPOINT_CHARS, {}, f"over {MAX_ENDPOINT_CHARS} characters"),
    ],
)
def test_an_endpoint_that_is_no_http_url_is_refused_naming_its_source(
    configured: str | None, environ: dict[str, str], says: str
) -> None:
    with pytest.raises(TracingError) as caught:
        traces_endpoint(configured, environ)
    assert says in str(caught.value)


def test_configured_by_the_standard_variable_exports_to_it() -> None:
    with otlp_receiver() as receiver:
        tracer = open_tracer(None, {ENDPOINT_ENV: receiver.base_url})
        assert tracer is not None
        tracer.run_started("r1", "default")
        span = tracer.call("r1", "time.now")
        span.outcome("denied", "rate_limited")
        span.end()
        tracer.call("r2", "fs.read").end()  # a run without a span: a root span, not lost
        tracer.run_started("r3", "default")  # left open: ended at shutdown
        tracer.run_ended("r1", "max_runtime_exceeded", "timeout")
        tracer.run_ended("never-started", "ended", "none")  # nothing to end: ignored
        tracer.shutdown()
        spans = {(s.name, s.attributes["gatewayd.run.id"]): s for s in receiver.received()}
    assert set(spans) == {
        ("gatewayd.run", "r1"),
        ("gatewayd.call", "r1"),
        ("gatewayd.call", "r2"),
        ("gatewayd.run", "r3"),
    }
    run, call = spans[("gatewayd.run", "r1")], spans[("gatewayd.call", "r1")]
    assert call.parent_span_id == run.span_id
    assert call.status_error and call.status_message == "rate_limited"
    assert run.status_error and run.attributes["gatewayd.error_code"] == "timeout"
    assert spans[("gatewayd.call", "r2")].parent_span_id == ""
    assert spans[("gatewayd.run", "r3")].attributes["gatewayd.run.end_reason"] == "daemon_stopping"
