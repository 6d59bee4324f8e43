"""The Prometheus listener (gatewayd/metrics_server.py) against floods and stalled
clients on a real loopback TCP socket: each test waits out a deadline or a flood's
seconds, so they run here, out of the fast lane (tests/unit/test_metrics_server.py holds
the rest)."""

from __future__ import annotations

import itertools
import socket

import pytest
import trio

from gatewayd import metrics_server
from gatewayd.metrics import GatewayMetrics
from gatewayd.metrics_server import MAX_CONNECTIONS, ListenAddress, serve_metrics
from tests.unit.test_metrics_server import request, status_of


async def test_a_flood_of_idle_connections_is_capped_and_scrapes_resume(
    nursery: trio.Nursery,
) -> None:
    metrics = GatewayMetrics()
    address = await nursery.start(serve_metrics, ListenAddress("127.0.0.1", 0), metrics)
    idle = [await trio.open_tcp_stream(address.host, address.port) for _ in range(MAX_CONNECTIONS)]
    await trio.sleep(0.2)  # every one accepted and waiting for its request
    extra = await trio.open_tcp_stream(address.host, address.port)
    with trio.fail_after(5):
        assert await extra.receive_some(10) == b""  # closed at accept, nothing read
    await extra.aclose()
    for stream in idle:
        await stream.aclose()
    await trio.sleep(0.2)
    answer = await request(
        address, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    assert status_of(answer) == 200


async def test_a_client_that_asks_and_never_reads_is_dropped_and_frees_its_slot(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pipelined scrapes whose answers are never read fill the socket's buffers, and the
    # server's send then waits on the client: without a deadline over the answer too,
    # MAX_CONNECTIONS such clients would shut every scraper out for good.
    monkeypatch.setattr(metrics_server, "REQUEST_TIMEOUT_S", 0.5)
    monkeypatch.setattr(metrics_server, "MAX_CONNECTIONS", 1)
    metrics = GatewayMetrics()
    for n in range(200):  # a few hundred kilobytes per answer
        metrics.tool_meter(f"tool{n}")
    address = await nursery.start(serve_metrics, ListenAddress("127.0.0.1", 0), metrics)
    stalled = await trio.open_tcp_stream(address.host, address.port)
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await stalled.send_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 100)
    await trio.sleep(1.5)  # the deadline, with room for the renders before it
    answer = await request(
        address, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    assert status_of(answer) == 200
    await stalled.aclose()


async def test_a_flood_of_scrapes_cannot_take_the_trio_thread_from_the_calls(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every render runs on the thread that answers tool calls: however many requests
    # arrive, renders stay MIN_RENDER_INTERVAL_S apart, and a scraper still gets a fresh
    # answer within the flood.
    monkeypatch.setattr(metrics_server, "MIN_RENDER_INTERVAL_S", 0.2)
    metrics = GatewayMetrics()
    renders: list[float] = []
    real_render = metrics.render

    def counted() -> str:
        renders.append(trio.current_time())
        return real_render()

    monkeypatch.setattr(metrics, "render", counted)
    address = await nursery.start(serve_metrics, ListenAddress("127.0.0.1", 0), metrics)

    async def flood() -> None:
        stream = await trio.open_tcp_stream(address.host, address.port)
        async with stream:
            await stream.send_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 500)
            while await stream.receive_some(65536):
                pass

    answered_after = None
    with trio.move_on_after(2.0):
        async with trio.open_nursery() as flooders:
            for _ in range(4):
                flooders.start_soon(flood)
            await trio.sleep(0.5)
            metrics.run_started()
            asked = trio.current_time()
            answer = await request(
                address, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            )
            answered_after = trio.current_time() - asked
            assert status_of(answer) == 200
            assert b"sandbox_run_started_total 1.0" in answer
            await trio.sleep_forever()
    # Its turn came after the flooders' (one render each before it, at most).
    assert answered_after is not None and answered_after < 4 * 0.2 + 0.5
    assert 3 <= len(renders) <= 11, len(renders)  # 2 s at one per 0.2 s, not hundreds
    assert all(b - a >= 0.2 - 1e-3 for a, b in itertools.pairwise(renders))


async def test_a_client_that_never_finishes_its_request_is_dropped(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(metrics_server, "REQUEST_TIMEOUT_S", 0.3)
    address = await nursery.start(serve_metrics, ListenAddress("127.0.0.1", 0), GatewayMetrics())
    slow = await trio.open_tcp_stream(address.host, address.port)
    async with slow:
        await slow.send_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # no blank line
        with trio.fail_after(5):
            assert await slow.receive_some(10) == b""  # closed, nothing answered
