"""Metrics on a real daemon: ``GET /v1/metrics`` on the control socket of a real
``gatewayd serve`` parses (prometheus_client's parser; promtool where installed) and
every counter moves by exactly what the calls, runs and reviews made it move."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from cogni_tool.client import Client, ToolError
from gatewayd.config import ModelAlias
from gatewayd.metrics import METRICS
from tests.conftest import Gateway, frame, make_gateway, read_frame, request
from tests.fakeprovider import FakeProvider, Text, provider_with_key
from tests.integration.test_egress import Origins, connect, get, network, raw, running
from tests.integration.test_egress import origins as origins  # noqa: PLC0414 (a fixture)
from tests.livedaemon import LiveDaemon, _UnixHTTPConnection, start_daemon

POLICY = """
version: 1
name: metered
tools:
  allow: [time.now, fs.read]
filesystem:
  paths:
    workspace: {root: ., mode: ro, suffixes: [.md]}
limits: {calls_per_second: 1000, burst: 1000}
require_os_sandbox: false
"""

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(daemon: LiveDaemon) -> tuple[str, str]:
    """(content type, body) of GET /v1/metrics."""
    conn = _UnixHTTPConnection(str(daemon.control_socket))
    conn.request("GET", "/v1/metrics")
    resp = conn.getresponse()
    body = resp.read().decode()
    conn.close()
    assert resp.status == 200, body
    return resp.getheader("content-type") or "", body


def samples(text: str) -> Samples:
    """Every sample by (name, sorted labels), as prometheus_client parses the text."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(snapshot: Samples, name: str, **labels: str) -> float:
    return snapshot.get((name, tuple(sorted(labels.items()))), 0.0)


def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-met-", dir="/tmp"))
    (path / "ws").mkdir()
    (path / "ws" / "notes.md").write_text("hello\n")
    (path / "ws" / "key.txt").write_text("not for reading\n")
    (path / "policy.yaml").write_text(textwrap.dedent(POLICY))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def live(base: Path) -> Iterator[LiveDaemon]:
    daemon = start_daemon(base / "state")
    try:
        yield daemon
    finally:
        daemon.stop()


def test_metrics_parse_and_move_by_exactly_the_calls_and_runs_made(
    live: LiveDaemon, base: Path
) -> None:
    content_type, text = scrape(live)
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    before = samples(text)
    assert value(before, "gatewayd_runs_active") == 0
    assert value(before, "gatewayd_sandbox_uids_leased") == 0

    run = live.create_run(base / "ws", base / "policy.yaml")
    with Client(run["socket"], run["runId"]) as client:
        for _ in range(3):
            client.call("time.now")
        assert client.call("fs.read", {"path": "/workspace/notes.md"})
        for tool, args in (
            ("fs.read", {"path": "/workspace/key.txt"}),  # suffix: policy_denied
            ("fs.write", {"path": "/workspace/a.md", "content": "x"}),  # not allowed
            ("no.such.tool.x7", {}),  # unknown_tool, and not a label
            ("time.now", {"bogus": 1}),  # invalid_args
        ):
            with pytest.raises(ToolError):
                client.call(tool, args)
    during = samples(scrape(live)[1])
    assert value(during, "gatewayd_runs_active") == 1
    status, _ = live.control("DELETE", f"/v1/runs/{run['runId']}")
    assert status == 200
    refused, body = live.control(
        "POST",
        "/v1/runs",
        {
            "workspacePath": str(base / "ws"),
            "policy": str(base / "policy.yaml"),
            "actorId": "tester",
            "tenantId": "t1",
            "grant": {"allowSandbox": False},
        },
    )
    assert refused == 403, body
    _, text = scrape(live)
    after = samples(text)

    assert "no.such.tool.x7" not in text  # a name a run made up never becomes a series
    expected = {
        ("gatewayd_runs_started_total", ()): 1,
        ("gatewayd_runs_ended_total", (("reason", "ended_by_operator"),)): 1,
        ("gatewayd_runs_refused_total", (("code", "authz_denied"),)): 1,
        ("gatewayd_calls_total", (("decision", "allowed"), ("tool", "time.now"))): 3,
        ("gatewayd_calls_total", (("decision", "allowed"), ("tool", "fs.read"))): 1,
        ("gatewayd_calls_total", (("decision", "denied"), ("tool", "fs.read"))): 1,
        ("gatewayd_calls_total", (("decision", "denied"), ("tool", "fs.write"))): 1,
        ("gatewayd_calls_total", (("decision", "denied"), ("tool", "unknown"))): 1,
        ("gatewayd_calls_total", (("decision", "denied"), ("tool", "time.now"))): 1,
        ("gatewayd_denials_total", (("code", "policy_denied"),)): 2,
        ("gatewayd_denials_total", (("code", "unknown_tool"),)): 1,
        ("gatewayd_denials_total", (("code", "invalid_args"),)): 1,
        ("gatewayd_call_duration_seconds_count", (("tool", "time.now"),)): 3,
        ("gatewayd_call_duration_seconds_count", (("tool", "fs.read"),)): 1,
    }
    for (name, labels), delta in expected.items():
        assert moved(before, after, name, **dict(labels)) == delta, (name, labels)
    # Nothing else moved among calls and denials: the only calls are the ones above.
    for key in set(after) | set(before):
        name = key[0]
        if name in ("gatewayd_calls_total", "gatewayd_denials_total") and key not in expected:
            assert after.get(key, 0) == before.get(key, 0), key
    assert value(after, "gatewayd_runs_active") == 0
    assert value(after, "gatewayd_sandbox_uids_leased") == 0  # no OS sandbox: no uid lent
    # 8 calls make 16 entries, plus run_created/run_ended/run_refused events.
    assert moved(before, after, "gatewayd_audit_entries_total") >= 19
    assert moved(before, after, "gatewayd_audit_fsync_duration_seconds_count") >= 1
    assert value(after, "gatewayd_audit_fsync_duration_seconds_sum") > 0

    promtool = shutil.which("promtool")
    if promtool is not None:  # the package's linter too, on what a real daemon serves
        check = subprocess.run(
            [promtool, "check", "metrics"], input=text, capture_output=True, text=True
        )
        assert check.returncode == 0 and not check.stdout + check.stderr, check


def test_metrics_on_an_unknown_method_is_a_404_and_health_still_answers(
    live: LiveDaemon,
) -> None:
    status, body = live.control("POST", "/v1/metrics", {})
    assert status == 404 and "GET /v1/metrics" in body["message"]
    assert live.control("GET", "/v1/health")[0] == 200


# --- the review's metrics, in-process (a fake model provider on loopback) ----------------

KEY_ENV = "COGNI_TEST_METRICS_REVIEW_KEY"
REVIEWED = """
version: 1
name: reviewed
tools:
  allow: ["fs.*"]
filesystem:
  paths:
    workspace: {root: ., mode: rw}
limits: {calls_per_second: 1000, burst: 1000, call_timeout_s: 20}
require_os_sandbox: false
review:
  mode: llm
  model: reviewer
  timeout_s: 5
  tools: ["fs.*"]
  rules:
    allow: [Reading any file in the workspace]
  structured:
    - {effect: allow, tool: fs.stat, skip_model: true}
"""


@pytest.fixture
async def reviewed(short_tmp: Path) -> AsyncIterator[tuple[Gateway, FakeProvider]]:
    with provider_with_key(KEY_ENV, "sk-metrics-review-0123456789") as fake:
        alias = ModelAlias(
            provider="openai", model="fake", api_base=fake.api_base, api_key_env=KEY_ENV
        )
        async with make_gateway(short_tmp, models={"reviewer": alias}) as gateway:
            yield gateway, fake


async def _call(socket_path: Path, body: dict[str, Any]) -> dict[str, Any]:
    stream = await trio.open_unix_socket(str(socket_path))
    async with stream:
        await stream.send_all(frame(body))
        with trio.fail_after(30):
            answer = await read_frame(stream, bytearray())
    assert answer is not None
    return answer


async def test_review_latency_by_source_and_cache_hits_and_misses_move(
    reviewed: tuple[Gateway, FakeProvider], workspace: Path
) -> None:
    gw, fake = reviewed
    fake.script(Text(content="ALLOW"))
    run = await gw.create_run(workspace, REVIEWED)
    before = samples(METRICS.render())
    read = {"path": "/workspace/notes.md"}
    for tcid in ("a", "b"):  # the model, then the cache
        answer = await _call(run.socket_path, request(run, "fs.read", read, tcid))
        assert answer["ok"], answer
    answer = await _call(run.socket_path, request(run, "fs.stat", read, "c"))
    assert answer["ok"], answer
    after = samples(METRICS.render())
    assert len(fake.chat_requests) == 1
    assert moved(before, after, "gatewayd_review_cache_misses_total") == 1
    assert moved(before, after, "gatewayd_review_cache_hits_total") == 1
    for source in ("model", "cache", "structured"):
        assert moved(before, after, "gatewayd_review_duration_seconds_count", source=source) == 1
    assert moved(before, after, "gatewayd_review_duration_seconds_count", source="failed") == 0
    # A model's answer took longer than a cache lookup: the sums say so.
    model_s = moved(before, after, "gatewayd_review_duration_seconds_sum", source="model")
    cache_s = moved(before, after, "gatewayd_review_duration_seconds_sum", source="cache")
    assert model_s > cache_s >= 0


# --- the egress proxy's connections, in-process (real origins on loopback) ---------------


async def test_egress_connections_are_counted_by_verdict(short_tmp: Path, origins: Origins) -> None:
    before = samples(METRICS.render())
    async with running(short_tmp, network(origins)) as h:
        url = f"http://pkgs.example.org:{origins.http_port}/big?n=10"
        allowed, _, _ = await raw(h, get(url))
        denied, _, _ = await raw(h, connect("evil.example.net:443"))
    assert (allowed, denied) == (200, 403)
    after = samples(METRICS.render())
    assert moved(before, after, "gatewayd_egress_connections_total", verdict="allowed") == 1
    assert moved(before, after, "gatewayd_egress_connections_total", verdict="denied") == 1


# --- the sandbox launcher (a real gatewayd serve with the OS sandbox) ---------------------

SANDBOXED = """
version: 1
name: sandboxed
tools:
  allow: [time.now]
limits: {calls_per_second: 1000, burst: 1000}
sandbox: {timeout_s: 30}
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/usr/bin/bwrap"),
    reason="sandboxed runs need root and bubblewrap at /usr/bin/bwrap",
)
def test_each_sandboxed_command_is_one_launch_observation(base: Path) -> None:
    base.chmod(0o711)  # the sandbox's uid passes through to its workspace and socket
    (base / "sandboxed.yaml").write_text(textwrap.dedent(SANDBOXED))
    daemon = start_daemon(base / "state", sandbox=True)
    try:
        run = daemon.create_run(base / "ws", base / "sandboxed.yaml")
        assert run["osSandbox"], run
        before = samples(scrape(daemon)[1])
        for _ in range(2):
            status, body = daemon.control(
                "POST", f"/v1/runs/{run['runId']}/exec", {"command": ["/bin/true"]}
            )
            assert status == 200 and body["result"]["exitCode"] == 0, body
        after = samples(scrape(daemon)[1])
    finally:
        daemon.stop()
    assert moved(before, after, "gatewayd_sandbox_launch_duration_seconds_count") == 2
    assert 0 < moved(before, after, "gatewayd_sandbox_launch_duration_seconds_sum") < 10
