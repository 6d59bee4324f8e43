"""Operators' observability on a real `gatewayd serve`: the Prometheus listener on TCP
(the same text as the control socket's /v1/metrics, with the sandbox_run_ families) and
OpenTelemetry traces exported over OTLP/HTTP to a loopback receiver this test starts; and,
with neither configured, no OpenTelemetry SDK module loaded in the daemon at all (read
from the interpreter's own import log, PYTHONPROFILEIMPORTTIME)."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import subprocess
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cogni_tool.client import Client, ToolError
from tests.livedaemon import BIN, LiveDaemon, start_daemon
from tests.otlp_receiver import ReceivedSpan, Receiver, otlp_receiver

POLICY = """
version: 1
name: observed
tools:
  allow: [time.now, fs.read]
filesystem:
  paths:
    workspace: {root: ., mode: ro, suffixes: [.md]}
limits: {calls_per_second: 1000, burst: 1000}
require_os_sandbox: false
"""
MADE_UP_TOOL = "made.up.tool.q9"
# Where the OpenTelemetry SDK and the OTLP exporter live: none may be imported untraced.
SDK_MODULES = ("opentelemetry.sdk", "opentelemetry.exporter")


@dataclass
class Observed:
    """A traced daemon after one run (stopped, so every span is exported), its log, and
    what its metrics listener and control socket served while it ran."""

    base: Path
    receiver: Receiver
    spans: list[ReceivedSpan]
    run_id: str
    log: str
    listener_address: str
    scrape_listener: str
    scrape_control: str
    listener_errors: dict[str, tuple[int, str]]
    content_type: str
    before: dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def log_events(log: str, event: str) -> list[dict[str, object]]:
    found = []
    for line in log.splitlines():
        if line.startswith("{") and f'"{event}"' in line:
            record = json.loads(line)
            if record.get("event") == event:
                found.append(record)
    return found


def wait_for_event(daemon: LiveDaemon, event: str) -> list[dict[str, object]]:
    """The daemon's log records of ``event``, waiting for the first: the metrics
    listener starts after the control socket answers its health check."""
    deadline = time.monotonic() + 30
    while not (found := log_events(daemon.log_path.read_text(), event)):
        assert daemon.alive(), daemon.log_path.read_text()
        assert time.monotonic() < deadline, f"no {event} in the log in 30 s"
        time.sleep(0.02)
    return found


def http_get(
    address: str, path: str, method: str = "GET", body: bytes | None = None
) -> tuple[int, str, str]:
    host, _, port = address.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request(method, path, body=body)
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    return resp.status, resp.getheader("content-type") or "", text


def control_metrics(daemon: LiveDaemon) -> str:
    from tests.livedaemon import _UnixHTTPConnection

    conn = _UnixHTTPConnection(str(daemon.control_socket))
    conn.request("GET", "/v1/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return text


def workspace(prefix: str) -> Path:
    base = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    (base / "ws").mkdir()
    (base / "ws" / "notes.md").write_text("hello\n")
    (base / "ws" / "key.txt").write_text("not for reading\n")
    (base / "policy.yaml").write_text(textwrap.dedent(POLICY))
    return base


def one_run(daemon: LiveDaemon, base: Path) -> str:
    """A run with two allowed calls and two denied ones, ended by the operator."""
    run = daemon.create_run(base / "ws", base / "policy.yaml")
    with Client(run["socket"], run["runId"]) as client:
        client.call("time.now")
        assert client.call("fs.read", {"path": "/workspace/notes.md"})
        for tool, args in (
            ("fs.read", {"path": "/workspace/key.txt"}),  # suffix: policy_denied
            (MADE_UP_TOOL, {}),  # unknown_tool: neither a label nor an attribute
        ):
            with pytest.raises(ToolError):
                client.call(tool, args)
    status, _ = daemon.control("DELETE", f"/v1/runs/{run['runId']}")
    assert status == 200
    return str(run["runId"])


@pytest.fixture(scope="module")
def observed() -> Iterator[Observed]:
    base = workspace("cg-obs-")
    try:
        with otlp_receiver() as receiver:
            with pytest.MonkeyPatch.context() as env:
                for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
                    env.delenv(name, raising=False)
                env.setenv("GATEWAYD_OTEL_ENDPOINT", receiver.base_url)
                env.setenv("GATEWAYD_METRICS_LISTEN", "127.0.0.1:0")
                env.setenv("PYTHONPROFILEIMPORTTIME", "1")
                daemon = start_daemon(base / "state")
            try:
                [listening] = wait_for_event(daemon, "metrics_listening")
                address = str(listening["address"])
                _, content_type, first = http_get(address, "/metrics")
                run_id = one_run(daemon, base)
                _, _, scrape_listener = http_get(address, "/metrics")
                scrape_control = control_metrics(daemon)
                errors = {
                    "other path": http_get(address, "/v1/metrics")[::2],
                    "POST": http_get(address, "/metrics", "POST", b"x")[::2],
                }
            finally:
                daemon.stop()
            # Stopped: the SDK's batch processor exported everything at the daemon's end.
            spans = receiver.wait_for(5)
            yield Observed(
                base=base,
                receiver=receiver,
                spans=spans,
                run_id=run_id,
                log=daemon.log_path.read_text(),
                listener_address=address,
                scrape_listener=scrape_listener,
                scrape_control=scrape_control,
                listener_errors=errors,
                content_type=content_type,
                before=samples(first),
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_the_listener_serves_the_control_sockets_metrics_with_the_sandbox_run_families(
    observed: Observed,
) -> None:
    assert observed.listener_address.startswith("127.0.0.1:")
    assert not observed.listener_address.endswith(":0")  # the port bound, not the one asked
    assert observed.content_type == "text/plain; version=0.0.4; charset=utf-8"
    listener, control = samples(observed.scrape_listener), samples(observed.scrape_control)
    assert set(listener) == set(control)  # the same series on both
    names = {name for name, _ in listener}
    for family in (
        "sandbox_run_started_total",
        "sandbox_run_active",
        "sandbox_run_completed_total",
        "sandbox_run_refused_total",
        "sandbox_run_duration_seconds_count",
        "gatewayd_calls_total",
    ):
        assert family in names, family

    def moved(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return listener.get(key, 0) - observed.before.get(key, 0)

    assert moved("sandbox_run_started_total") == 1
    assert moved("gatewayd_runs_started_total") == 1
    assert moved("sandbox_run_completed_total", ok="true", error_code="none") == 1
    assert moved("sandbox_run_duration_seconds_count") == 1
    assert moved("gatewayd_calls_total", tool="time.now", decision="allowed") == 1
    assert moved("gatewayd_calls_total", tool="unknown", decision="denied") == 1
    assert listener[("sandbox_run_active", ())] == 0
    assert MADE_UP_TOOL not in observed.scrape_listener


def test_the_listener_answers_nothing_but_get_metrics(observed: Observed) -> None:
    status, text = observed.listener_errors["other path"]
    assert status == 404
    assert "serves GET /metrics only" in text
    status, text = observed.listener_errors["POST"]
    assert status in (405, 413)  # a POST with a body: refused either way, never served
    assert "gatewayd_" not in text


def test_a_run_is_one_span_and_each_call_a_span_inside_it(observed: Observed) -> None:
    runs = [s for s in observed.spans if s.name == "gatewayd.run"]
    calls = [s for s in observed.spans if s.name == "gatewayd.call"]
    assert len(runs) == 1, observed.spans
    assert len(calls) == 4, observed.spans
    [run] = runs
    assert run.attributes["gatewayd.run.id"] == observed.run_id
    assert run.attributes["gatewayd.run.policy"] == "observed"
    assert run.attributes["gatewayd.run.end_reason"] == "ended_by_operator"
    assert run.attributes["gatewayd.error_code"] == "none"
    assert not run.status_error
    assert run.service_name == "gatewayd"
    assert run.scope == "gatewayd"
    for call in calls:
        assert call.trace_id == run.trace_id
        assert call.parent_span_id == run.span_id
        assert call.attributes["gatewayd.run.id"] == observed.run_id
    outcomes = sorted(
        (
            c.attributes["gatewayd.tool"],
            c.attributes["gatewayd.verdict"],
            c.attributes.get("gatewayd.error_code"),
            c.status_error,
        )
        for c in calls
    )
    assert outcomes == [
        ("fs.read", "allowed", None, False),
        ("fs.read", "denied", "policy_denied", True),
        ("time.now", "allowed", None, False),
        ("unknown", "denied", "unknown_tool", True),
    ]
    every_value = json.dumps([s.attributes for s in observed.spans])
    assert MADE_UP_TOOL not in every_value  # a name a run made up never leaves the host
    assert "notes.md" not in every_value  # nor any argument


def test_spans_go_over_otlp_http_protobuf_to_the_traces_path(observed: Observed) -> None:
    assert observed.receiver.requests
    for request in observed.receiver.requests:
        assert request["path"] == "/v1/traces"
        assert request["content-type"] == "application/x-protobuf"


def test_the_traced_daemon_loads_the_sdk(observed: Observed) -> None:
    # The positive control of the next test: the import log does show the SDK.
    imported = [line for line in observed.log.splitlines() if line.startswith("import time:")]
    assert any(line.endswith("opentelemetry.sdk.trace") for line in imported)


def test_untraced_daemon_never_imports_the_sdk_nor_listens(tmp_path: Path) -> None:
    base = workspace("cg-obs0-")
    try:
        with pytest.MonkeyPatch.context() as env:
            for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
                env.delenv(name, raising=False)
            env.delenv("GATEWAYD_OTEL_ENDPOINT", raising=False)
            env.delenv("GATEWAYD_METRICS_LISTEN", raising=False)
            env.setenv("PYTHONPROFILEIMPORTTIME", "1")
            daemon = start_daemon(base / "state")
        try:
            one_run(daemon, base)  # a run and its calls: every path that would trace
        finally:
            daemon.stop()
        log = daemon.log_path.read_text()
        imported = [line.rpartition("|")[2].strip() for line in log.splitlines()]
        assert any(name == "gatewayd.dispatch" for name in imported)  # the log is there
        loaded = [name for name in imported if name.startswith(SDK_MODULES)]
        assert loaded == [], loaded
        assert log_events(log, "metrics_listening") == []
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        (
            "GATEWAYD_METRICS_LISTEN",
            "taken",
            "gatewayd: refused to start: cannot listen on metrics_listen 127.0.0.1:{port}: "
            "Address already in use; choose a free port",
        ),
        (
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "localhost:4318",
            "gatewayd: refused to start: OTEL_EXPORTER_OTLP_ENDPOINT 'localhost:4318' is not "
            "an OTLP/HTTP endpoint: write it as http://HOST:PORT",
        ),
        (
            "GATEWAYD_OTEL_ENDPOINT",
            "grpc://c:4317",
            "gatewayd: bad configuration: GATEWAYD_OTEL_ENDPOINT: otel_endpoint "
            "'grpc://c:4317' is not an OTLP/HTTP endpoint",
        ),
    ],
)
def test_a_start_it_cannot_observe_is_refused_with_the_fix_and_leaves_nothing(
    variable: str, value: str, says: str, tmp_path: Path
) -> None:
    # The listener starts after the control server: a port in use stops the daemon
    # (its control socket removed), it never hangs waiting for a server that never ran.
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        env = {
            key: val
            for key, val in os.environ.items()
            if not key.startswith(("OTEL_", "GATEWAYD_"))
        }
        env[variable] = f"127.0.0.1:{port}" if value == "taken" else value
        state = tmp_path / "state"
        result = subprocess.run(
            [str(BIN / "gatewayd"), "serve", "--state-dir", str(state), "--no-os-sandbox"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        holder.close()
    assert result.returncode == 1, result.stderr
    assert says.format(port=port) in result.stderr
    assert not (state / "control.sock").exists()
