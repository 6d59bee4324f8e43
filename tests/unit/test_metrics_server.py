"""The Prometheus listener (gatewayd/metrics_server.py) on a real loopback TCP socket:
the address setting, the one route, what it refuses, a taken port (the floods and stalled
clients, which wait out their deadlines: tests/integration/test_metrics_server_limits.py)."""

from __future__ import annotations

import socket

import pytest
import structlog
import trio
from prometheus_client.parser import text_string_to_metric_families

from gatewayd.metrics import CONTENT_TYPE, GatewayMetrics
from gatewayd.metrics_server import (
    ListenAddress,
    MetricsListenError,
    parse_listen_address,
    serve_metrics,
)


@pytest.mark.parametrize(
    ("text", "host", "port"),
    [
        ("127.0.0.1:9464", "127.0.0.1", 9464),
        ("[::1]:9464", "::1", 9464),
        ("0.0.0.0:0", "0.0.0.0", 0),
        ("10.1.2.3:65535", "10.1.2.3", 65535),
        ("[0:0::1]:1", "::1", 1),  # written the short way
    ],
)
def test_an_ip_and_port_is_taken(text: str, host: str, port: int) -> None:
    assert parse_listen_address(text) == ListenAddress(host, port)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("127.0.0.1", "has no port"),
        (":9464", "has no port"),
        ("localhost:9464", "not an IP address (host names are not taken)"),
        ("metrics.example:9464", "not an IP address"),
        ("::1:9464", "put an IPv6 address in [ ]"),
        ("[127.0.0.1]:9464", "brackets are for IPv6"),
        ("127.0.0.1:65536", "from 0 to 65535"),
        ("127.0.0.1:-1", "from 0 to 65535"),
        ("127.0.0.1:\uff19\uff14\uff16\uff14", "from 0 to 65535"),  # fullwidth: isdigit() says yes
        ("127.0.0.1:", "from 0 to 65535"),
        ("127.0.0.1:80 ", "from 0 to 65535"),
    ],
)
def test_a_bad_address_is_refused_with_the_form_to_write(text: str, says: str) -> None:
    with pytest.raises(MetricsListenError) as caught:
        parse_listen_address(text)
    assert says in str(caught.value)
    assert "e.g. 127.0.0.1:9464" in str(caught.value)


def test_loopback_is_told_apart() -> None:
    assert ListenAddress("127.0.0.1", 1).loopback
    assert ListenAddress("::1", 1).loopback
    assert not ListenAddress("0.0.0.0", 1).loopback
    assert str(ListenAddress("::1", 9)) == "[::1]:9"


async def request(address: ListenAddress, raw: bytes) -> bytes:
    stream = await trio.open_tcp_stream(address.host, address.port)
    async with stream:
        await stream.send_all(raw)
        out = b""
        with trio.fail_after(10):
            while chunk := await stream.receive_some(65536):
                out += chunk
    return out


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


async def test_get_metrics_serves_the_registry_and_nothing_else_is_served(
    nursery: trio.Nursery,
) -> None:
    metrics = GatewayMetrics()
    metrics.run_started()
    address = await nursery.start(serve_metrics, ListenAddress("127.0.0.1", 0), metrics)
    assert address.port != 0
    answer = await request(
        address, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    head, _, body = answer.partition(b"\r\n\r\n")
    assert status_of(answer) == 200
    assert f"content-type: {CONTENT_TYPE}".encode() in head.lower()
    assert b"cache-control: no-store" in head.lower()
    assert body.decode() == metrics.render()
    names = {f.name for f in text_string_to_metric_families(body.decode())}
    assert "sandbox_run_started" in names
    # A query string does not change the route (a scraper may add one).
    answer = await request(
        address, b"GET /metrics?x=1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    assert status_of(answer) == 200

    for raw, status, says in (
        (b"GET /v1/metrics HTTP/1.1\r\nHost: x\r\n\r\n", 404, b"serves GET /metrics only"),
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", 404, b"serves GET /metrics only"),
        (b"GET /metrics/../v1/runs HTTP/1.1\r\nHost: x\r\n\r\n", 404, b"only"),
        (b"DELETE /metrics HTTP/1.1\r\nHost: x\r\n\r\n", 405, b"answers GET"),
        (b"HEAD /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 405, b""),
        (
            b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc",
            413,
            b"no request body",
        ),
        (b"NOT HTTP AT ALL\r\n\r\n", 400, b"malformed HTTP"),
    ):
        answer = await request(address, raw)
        assert status_of(answer) == status, (raw, answer)
        assert says in answer
        assert b"gatewayd_" not in answer


async def test_keep_alive_serves_several_scrapes_on_one_connection(nursery: trio.Nursery) -> None:
    metrics = GatewayMetrics()
    address = await nursery.start(serve_metrics, ListenAddress("127.0.0.1", 0), metrics)
    stream = await trio.open_tcp_stream(address.host, address.port)
    async with stream:
        one = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
        await stream.send_all(one + one)
        out = b""
        with trio.fail_after(10):
            while out.count(b"HTTP/1.1 200") < 2:
                out += await stream.receive_some(65536)


async def test_a_taken_port_is_refused_with_the_fix(nursery: trio.Nursery) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        port = holder.getsockname()[1]
        with pytest.raises(MetricsListenError) as caught:
            await nursery.start(serve_metrics, ListenAddress("127.0.0.1", port), GatewayMetrics())
        message = str(caught.value)
        assert f"cannot listen on metrics_listen 127.0.0.1:{port}" in message
        assert "in use" in message
        assert "choose a free port" in message
    finally:
        holder.close()


async def test_an_address_not_of_this_host_is_refused(nursery: trio.Nursery) -> None:
    with pytest.raises(MetricsListenError, match=r"cannot listen on metrics_listen 192\.0\.2\.1:9"):
        await nursery.start(serve_metrics, ListenAddress("192.0.2.1", 9), GatewayMetrics())


async def test_an_address_beyond_loopback_is_served_and_warned_about(
    nursery: trio.Nursery,
) -> None:
    with structlog.testing.capture_logs() as logs:
        address = await nursery.start(serve_metrics, ListenAddress("0.0.0.0", 0), GatewayMetrics())
    [warning] = [e for e in logs if e["event"] == "metrics_listen_not_loopback"]
    assert warning["log_level"] == "warning"
    assert warning["address"] == f"0.0.0.0:{address.port}"
    assert "firewall" in warning["hint"]
    answer = await request(
        ListenAddress("127.0.0.1", address.port),
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    )
    assert status_of(answer) == 200


async def test_loopback_is_not_warned_about(nursery: trio.Nursery) -> None:
    with structlog.testing.capture_logs() as logs:
        await nursery.start(serve_metrics, ListenAddress("::1", 0), GatewayMetrics())
    assert [e["event"] for e in logs] == ["metrics_listening"]
