"""gatewayd's metric families on prometheus_client's registry, and what they render,
checked by prometheus_client's own parser (the format's reference implementation) and,
where installed, promtool."""

from __future__ import annotations

import shutil
import subprocess
import threading

import pytest
from prometheus_client import Counter, Gauge
from prometheus_client.parser import text_string_to_metric_families

from gatewayd.metrics import (
    CONTENT_TYPE,
    END_REASONS,
    RUN_ERROR_CODES,
    GatewayMetrics,
    ReadCounter,
    run_error_code,
)
from gatewayd.protocol import ErrorCode


def parsed(text: str) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    """Family name -> (sample name, labels, value) as prometheus_client reads the text."""
    return {
        family.name: [(s.name, s.labels, s.value) for s in family.samples]
        for family in text_string_to_metric_families(text)
    }


def sample(m: GatewayMetrics, name: str, **labels: str) -> float:
    """One sample's value, as a scrape would read it."""
    for family in text_string_to_metric_families(m.render()):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return float(s.value)
    raise AssertionError(f"no sample {name}{labels}")


def test_counter_with_labels_renders_help_type_and_one_line_per_label_set() -> None:
    m = GatewayMetrics()
    m.calls.labels("fs.read", "allowed").inc()
    m.calls.labels("fs.read", "allowed").inc()
    m.calls.labels("fs.write", "denied").inc(3)
    text = m.render()
    assert (
        "# HELP gatewayd_calls_total Tool calls answered, by tool and decision (allowed: it "
        "ran; denied: refused before it ran).\n# TYPE gatewayd_calls_total counter\n"
    ) in text
    assert 'gatewayd_calls_total{decision="allowed",tool="fs.read"} 2.0\n' in text
    families = parsed(text)
    assert (
        "gatewayd_calls_total",
        {"tool": "fs.write", "decision": "denied"},
        3.0,
    ) in families["gatewayd_calls"]


def test_label_values_are_escaped_so_the_text_still_parses() -> None:
    m = GatewayMetrics()
    nasty = 'a"b\\c\nd}{,='
    m.runs_ended.labels(nasty).inc()
    text = m.render()
    [line] = [line for line in text.splitlines() if "a\\" in line]
    assert line.startswith("gatewayd_runs_ended_total{")  # no newline from the value
    ended = {s[1]["reason"]: s[2] for s in parsed(text)["gatewayd_runs_ended"]}
    assert ended[nasty] == 1


def test_histogram_buckets_are_cumulative_with_inf_sum_and_count() -> None:
    m = GatewayMetrics()
    for value in (0.00005, 0.0001, 0.0004, 7.0):  # 0.0001 goes into le="0.0001": inclusive
        m.call_duration.labels("t").observe(value)
    text = m.render()
    assert 'gatewayd_call_duration_seconds_bucket{le="0.0001",tool="t"} 2.0\n' in text
    assert 'gatewayd_call_duration_seconds_bucket{le="0.0005",tool="t"} 3.0\n' in text
    assert 'gatewayd_call_duration_seconds_bucket{le="5.0",tool="t"} 3.0\n' in text
    assert 'gatewayd_call_duration_seconds_bucket{le="+Inf",tool="t"} 4.0\n' in text
    assert 'gatewayd_call_duration_seconds_count{tool="t"} 4.0\n' in text
    samples = {
        (n, labels.get("le")): v
        for n, labels, v in parsed(text)["gatewayd_call_duration_seconds"]
        if labels.get("tool") == "t"
    }
    assert samples[("gatewayd_call_duration_seconds_sum", None)] == pytest.approx(7.00055)


def test_histogram_counts_every_observation_from_many_threads() -> None:
    # The flusher thread observes fsyncs while the trio thread renders and counts.
    m = GatewayMetrics()
    per_thread, threads = 20_000, 4

    def work() -> None:
        for i in range(per_thread):
            m.audit_fsync.observe(0.0001 * (i % 2))

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert sample(m, "gatewayd_audit_fsync_duration_seconds_count") == per_thread * threads
    half = per_thread * threads // 2
    assert sample(m, "gatewayd_audit_fsync_duration_seconds_bucket", le="5e-05") == half


def test_gauge_and_counter_function_are_read_when_rendered() -> None:
    m = GatewayMetrics()
    live = [3]
    m.count_runs_with(lambda: live[0])
    m.count_uids_with(lambda: live[0] - 1)
    m.audit_entries.function = lambda: 10 + live[0]
    live[0] = 5
    families = parsed(m.render())
    assert families["gatewayd_sandbox_uids_leased"] == [("gatewayd_sandbox_uids_leased", {}, 4.0)]
    assert families["gatewayd_runs_active"] == [("gatewayd_runs_active", {}, 5.0)]
    assert families["sandbox_run_active"] == [("sandbox_run_active", {}, 5.0)]
    assert families["gatewayd_audit_entries"] == [("gatewayd_audit_entries_total", {}, 15.0)]


def test_read_counter_is_not_read_when_the_registry_checks_names() -> None:
    def boom() -> float:
        raise AssertionError("read outside a scrape")

    counter = ReadCounter("x_entries_total", "Entries.")
    counter.function = boom
    assert [f.name for f in counter.describe()] == ["x_entries"]


def test_bad_definitions_fail_when_made() -> None:
    with pytest.raises(ValueError, match="_total"):
        ReadCounter("x_entries", "no _total")


def test_a_wrong_label_set_fails_when_its_series_is_made_never_silently() -> None:
    m = GatewayMetrics()
    before = m.render()
    for bad in (("only-one",), ("a", "b", "c")):
        with pytest.raises(ValueError, match="label"):
            m.calls.labels(*bad)
    with pytest.raises(ValueError, match="label"):
        m.call_duration.labels("a", "b")
    assert m.render() == before  # no series was made


def test_registry_refuses_colliding_names() -> None:
    m = GatewayMetrics()
    with pytest.raises(ValueError, match="Duplicated"):
        Gauge("gatewayd_call_duration_seconds_count", "h", registry=m.registry)
    with pytest.raises(ValueError, match="Duplicated"):
        Counter("sandbox_run_started_total", "h", registry=m.registry)
    with pytest.raises(ValueError, match="Duplicated"):
        m.registry.register(ReadCounter("gatewayd_audit_entries_total", "again"))


def test_cells_and_series_held_by_a_hot_path_are_the_rendered_ones() -> None:
    m = GatewayMetrics()
    meter = m.tool_meter("fs.read")
    meter.allowed.inc(2)
    meter.denied.inc()
    meter.duration.observe(0.003)
    assert m.tool_meter("fs.read").allowed is meter.allowed  # one series per label set
    families = parsed(m.render())
    calls = {(s[1]["tool"], s[1]["decision"]): s[2] for s in families["gatewayd_calls"]}
    assert calls == {("fs.read", "allowed"): 2, ("fs.read", "denied"): 1}
    assert sample(m, "gatewayd_call_duration_seconds_count", tool="fs.read") == 1


def test_series_known_in_advance_exist_at_zero_from_the_start() -> None:
    families = parsed(GatewayMetrics().render())
    denials = {s[1]["code"] for s in families["gatewayd_denials"]}
    assert denials == {str(code) for code in ErrorCode}
    assert {s[1]["reason"] for s in families["gatewayd_runs_ended"]} == set(END_REASONS)
    refused = {s[1]["error_code"] for s in families["sandbox_run_refused"]}
    assert refused == {str(code) for code in ErrorCode}
    completed = {(s[1]["ok"], s[1]["error_code"]) for s in families["sandbox_run_completed"]}
    assert completed == {
        ("true", "none"),
        ("false", "timeout"),
        ("false", "task_failed"),
        ("false", "internal"),
    }
    assert all(value == 0 for family in families.values() for _, _, value in family)


def test_a_run_moves_both_the_gatewayd_and_the_sandbox_run_families() -> None:
    m = GatewayMetrics()
    m.run_started()
    m.run_refused("authz_denied")
    m.run_ended("max_runtime_exceeded", 12.5)
    m.run_ended("ended_by_operator", 0.5)
    m.run_ended("start_failed", None)  # never served: no duration
    assert sample(m, "gatewayd_runs_started_total") == 1
    assert sample(m, "sandbox_run_started_total") == 1
    assert sample(m, "gatewayd_runs_refused_total", code="authz_denied") == 1
    assert sample(m, "sandbox_run_refused_total", error_code="authz_denied") == 1
    assert sample(m, "gatewayd_runs_ended_total", reason="max_runtime_exceeded") == 1
    assert sample(m, "sandbox_run_completed_total", ok="false", error_code="timeout") == 1
    assert sample(m, "sandbox_run_completed_total", ok="true", error_code="none") == 1
    assert sample(m, "sandbox_run_completed_total", ok="false", error_code="internal") == 1
    assert sample(m, "sandbox_run_duration_seconds_count") == 2
    assert sample(m, "sandbox_run_duration_seconds_sum") == 13.0
    assert sample(m, "sandbox_run_duration_seconds_bucket", le="15.0") == 2


@pytest.mark.parametrize(
    ("reason", "code"),
    [
        ("ended", "none"),
        ("ended_by_operator", "none"),
        ("command_exited", "none"),
        ("max_runtime_exceeded", "timeout"),
        ("services_failed", "internal"),
        ("start_failed", "internal"),
        ("daemon_stopping", "internal"),
        ("tool_called", "none"),
        ("app_finished", "none"),
        ("agent_finished", "none"),
        ("agent_stopped", "task_failed"),
        ("agent_needs_sandbox", "internal"),
        ("mcp_server_stopped", "none"),
        ("mcp_server_timeout", "timeout"),
        ("mcp_server_failed", "internal"),
        ("a-reason-nobody-wrote", "internal"),  # gatewayd's bug: never reported as ok
    ],
)
def test_every_end_reason_has_the_designs_error_code(reason: str, code: str) -> None:
    assert run_error_code(reason) == code
    assert set(END_REASONS) <= set(RUN_ERROR_CODES)


def test_gateway_metrics_render_parses_and_every_name_has_its_prefix() -> None:
    m = GatewayMetrics()
    m.calls.labels("fs.read", "allowed").inc()
    m.call_duration.labels("fs.read").observe(0.002)
    m.audit_fsync.observe(0.0003)
    text = m.render()
    families = parsed(text)
    assert families
    assert all(name.startswith(("gatewayd_", "sandbox_run_")) for name in families)
    assert not any(name.endswith("_created") for name in families)  # no _created series
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert types["gatewayd_call_duration_seconds"] == "histogram"
    assert types["gatewayd_calls"] == "counter"
    assert types["gatewayd_runs_active"] == "gauge"
    assert types["sandbox_run_duration_seconds"] == "histogram"
    assert CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"


def test_promtool_check_metrics_accepts_the_gateway_metrics() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus); the parser tests run")
    m = GatewayMetrics()
    m.calls.labels("fs.read", "allowed").inc()
    m.review_cache_hits.inc()
    m.reviews.labels("model").observe(0.2)
    m.run_ended("ended", 3.0)
    result = subprocess.run(
        [promtool, "check", "metrics"], input=m.render(), capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout + result.stderr == "", result.stdout + result.stderr
