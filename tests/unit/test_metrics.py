"""The metrics registry and its Prometheus text rendering, checked by prometheus_client's
own parser (the format's reference implementation) and, where installed, promtool."""

from __future__ import annotations

import math
import shutil
import subprocess
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gatewayd.metrics import (
    Counter,
    CounterFunction,
    GatewayMetrics,
    Gauge,
    Histogram,
    Registry,
    render,
)


def parsed(text: str) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    """Family name -> (sample name, labels, value) as prometheus_client reads the text."""
    return {
        family.name: [(s.name, s.labels, s.value) for s in family.samples]
        for family in text_string_to_metric_families(text)
    }


def test_counter_with_labels_renders_help_type_and_one_line_per_label_set() -> None:
    c = Counter("x_calls_total", "Calls.", ["tool", "decision"])
    c.inc(("fs.read", "allowed"))
    c.inc(("fs.read", "allowed"))
    c.inc(("fs.write", "denied"), 3)
    text = render([c])
    assert text.startswith("# HELP x_calls_total Calls.\n# TYPE x_calls_total counter\n")
    assert 'x_calls_total{tool="fs.read",decision="allowed"} 2\n' in text
    families = parsed(text)
    assert ("x_calls_total", {"tool": "fs.write", "decision": "denied"}, 3.0) in families["x_calls"]


def test_label_values_are_escaped_so_the_text_still_parses() -> None:
    c = Counter("x_total", 'Help with a \\ backslash\nand a newline "quoted".', ["v"])
    nasty = 'a"b\\c\nd}{,='
    c.inc((nasty,))
    text = render([c])
    assert text.count("\n") == 3  # HELP, TYPE, the sample: no newline from the values
    [(_, labels, value)] = parsed(text)["x"]
    assert labels == {"v": nasty}
    assert value == 1


def test_histogram_buckets_are_cumulative_with_inf_sum_and_count() -> None:
    h = Histogram("x_duration_seconds", "Durations.", [0.1, 1.0], ["tool"])
    for value in (0.05, 0.1, 0.5, 7.0):  # 0.1 goes into le="0.1": bounds are inclusive
        h.observe(value, ("t",))
    text = render([h])
    assert 'x_duration_seconds_bucket{tool="t",le="0.1"} 2\n' in text
    assert 'x_duration_seconds_bucket{tool="t",le="1"} 3\n' in text
    assert 'x_duration_seconds_bucket{tool="t",le="+Inf"} 4\n' in text
    assert 'x_duration_seconds_count{tool="t"} 4\n' in text
    samples = {(n, labels.get("le")): v for n, labels, v in parsed(text)["x_duration_seconds"]}
    assert samples[("x_duration_seconds_sum", None)] == pytest.approx(7.65)
    assert samples[("x_duration_seconds_bucket", "+Inf")] == 4


def test_histogram_counts_every_observation_from_many_threads() -> None:
    h = Histogram("x_seconds", "d", [0.5], threaded=True)
    per_thread, threads = 20_000, 4

    def work() -> None:
        for i in range(per_thread):
            h.observe(i % 2)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert h.count() == per_thread * threads
    text = render([h])
    assert f'x_seconds_bucket{{le="0.5"}} {per_thread * threads // 2}\n' in text


def test_gauge_and_counter_function_are_read_when_rendered() -> None:
    live = [3]
    g = Gauge("x_active", "Active.", function=lambda: live[0])
    c = CounterFunction("x_entries_total", "Entries.")
    c.function = lambda: 10 + live[0]
    live[0] = 5
    families = parsed(render([g, c]))
    assert families["x_active"] == [("x_active", {}, 5.0)]
    assert families["x_entries"] == [("x_entries_total", {}, 15.0)]


def test_special_values_render_as_prometheus_spells_them() -> None:
    g = Gauge("x_value", "v")
    for value, spelled in ((math.inf, "+Inf"), (-math.inf, "-Inf"), (0.25, "0.25"), (7, "7")):
        g.set(value)
        assert render([g]).endswith(f"x_value {spelled}\n")
    g.set(math.nan)
    assert math.isnan(parsed(render([g]))["x_value"][0][2])


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: Counter("x_calls", "no _total"), "_total"),
        (lambda: Counter("9bad_total", "name"), "not a Prometheus name"),
        (lambda: Counter("x_total", "h", ["le"]), "not allowed"),
        (lambda: Counter("x_total", "h", ["__x"]), "not allowed"),
        (lambda: Counter("x_total", "h", ["a", "a"]), "repeats"),
        (lambda: Histogram("x_seconds", "h", [1.0, 0.5]), "ascending"),
        (lambda: Histogram("x_seconds", "h", []), "ascending"),
    ],
)
def test_bad_definitions_fail_when_made(make: object, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        make()  # type: ignore[operator]


def test_a_wrong_label_set_fails_when_its_series_is_made_never_silently() -> None:
    c = Counter("x_total", "h", ["a", "b"])
    h = Histogram("x_seconds", "h", [1.0], ["a"])
    for bad in (("only-one",), ("a", "b", "c"), ("a", 1)):
        for make in (c.declare, c.inc, c.cell):
            with pytest.raises(ValueError, match="takes labels"):
                make(bad)  # type: ignore[operator]
    with pytest.raises(ValueError, match="takes labels"):
        h.observe(1.0, ("a", "b"))
    assert render([c]).count("\n") == 2  # HELP and TYPE: no series was made


def test_registry_refuses_colliding_names() -> None:
    r = Registry()
    r.add(Histogram("x_seconds", "h", [1.0]))
    with pytest.raises(ValueError, match="collides"):
        r.add(Gauge("x_seconds_count", "h"))


def test_cells_and_series_held_by_a_hot_path_are_the_rendered_ones() -> None:
    m = GatewayMetrics()
    meter = m.tool_meter("fs.read")
    meter.allowed.value += 2
    meter.denied.value += 1
    meter.duration.observe(0.003)
    assert m.tool_meter("fs.read").allowed is meter.allowed  # one series per label set
    families = parsed(m.render())
    calls = {(s[1]["tool"], s[1]["decision"]): s[2] for s in families["gatewayd_calls"]}
    assert calls == {("fs.read", "allowed"): 2, ("fs.read", "denied"): 1}
    assert m.call_duration.count(("fs.read",)) == 1


def test_gateway_metrics_render_parses_and_every_name_has_the_prefix() -> None:
    m = GatewayMetrics()
    m.calls.inc(("fs.read", "allowed"))
    m.call_duration.observe(0.002, ("fs.read",))
    m.audit_fsync.observe(0.0003)
    text = m.render()
    families = parsed(text)
    assert families
    assert all(name.startswith("gatewayd_") for name in families)
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert types["gatewayd_call_duration_seconds"] == "histogram"
    assert types["gatewayd_calls"] == "counter"
    assert types["gatewayd_runs_active"] == "gauge"


def test_promtool_check_metrics_accepts_the_gateway_metrics() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus); the parser tests run")
    m = GatewayMetrics()
    m.calls.inc(("fs.read", "allowed"))
    m.review_cache_hits.inc()
    m.reviews.observe(0.2, ("model",))
    result = subprocess.run(
        [promtool, "check", "metrics"], input=m.render(), capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout + result.stderr == "", result.stdout + result.stderr
