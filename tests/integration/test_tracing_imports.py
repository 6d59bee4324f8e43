"""Deciding where traces go loads no OpenTelemetry module when tracing is off: in a fresh
interpreter (the test process has the SDK loaded by other tests), as a daemon starts."""

from __future__ import annotations

import subprocess
import sys


def test_not_configured_loads_no_opentelemetry_module() -> None:
    # A fresh interpreter: this one has the SDK loaded by other tests.
    code = (
        "import sys\n"
        "from gatewayd.tracing import open_tracer\n"
        "import gatewayd.dispatch, gatewayd.daemon\n"
        "assert open_tracer(None, {}) is None\n"
        "assert open_tracer('http://c:4318', {'OTEL_SDK_DISABLED': 'true'}) is None\n"
        "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', "
        "'opentelemetry.exporter'))))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
