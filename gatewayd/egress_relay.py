"""Moving one egress connection's bytes, once the proxy allowed it (gatewayd/egress.py).

A CONNECT tunnel is two pumps of raw bytes, one each way, each passing a half-close on;
a plain-HTTP request is one exchange, re-framed by h11 on both sides, the body streamed
as it arrives. Every byte forwarded passes the connection's :class:`Meter` (its cap of
``network.proxy.max_connection_bytes`` and its idle deadline), and what happened is
tallied in its :class:`Outcome`, which the proxy audits.
"""

from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass, field
from typing import Final, Literal

import h11
import httpcore
import trio

from gatewayd.egress_framing import forwarded_response_headers
from gatewayd.policy.model import NetworkSection
from gatewayd.protocol import ErrorCode

# One read moves at most this much: large enough for fast downloads in few reads, small
# enough that one connection never holds more than a little memory.
RECV_CHUNK: Final = 64 * 1024

Verdict = Literal["allowed", "denied"]


@dataclass(slots=True, kw_only=True)
class Outcome:
    """What one connection's audit entry says; filled in as the connection goes."""

    domain: str | None = None
    port: int | None = None
    method: str | None = None
    verdict: Verdict = "denied"
    bytes_up: int = 0
    bytes_down: int = 0
    code: ErrorCode | None = None
    reason: str | None = None
    # The HTTP status to answer with, if the client has not been answered yet.
    status: int | None = None
    extra: dict[str, object] = field(default_factory=dict)
    # When the connection was accepted (trio's clock), and whether its ``egress`` entry
    # is recorded already (before an error answer): it is recorded once.
    started: float = 0.0
    recorded: bool = False

    def fail(self, code: ErrorCode | None, reason: str, status: int | None = None) -> None:
        """Record why the connection failed; the first failure is the one that counts."""
        if self.reason is None:
            self.code, self.reason, self.status = code, reason, status


class Meter:
    """One connection's byte count against its cap, and its idle deadline."""

    def __init__(self, outcome: Outcome, net: NetworkSection) -> None:
        self._outcome = outcome
        self._cap = net.proxy.max_connection_bytes
        self._idle_s = net.proxy.idle_timeout_s
        self.scope = trio.CancelScope()
        self.touch()

    def touch(self) -> None:
        """Bytes moved: the connection is not idle."""
        self.scope.deadline = trio.current_time() + self._idle_s

    def admit(self, n: int, *, up: bool) -> bool:
        """Count ``n`` bytes about to be forwarded; False (and the connection cut) when
        they would take it over ``max_connection_bytes``."""
        outcome = self._outcome
        if outcome.bytes_up + outcome.bytes_down + n > self._cap:
            outcome.fail(
                ErrorCode.TOO_LARGE,
                f"the connection would move more than {self._cap} bytes (both ways, "
                "network.proxy.max_connection_bytes); it was cut",
                413 if up else 502,
            )
            self.scope.cancel()
            return False
        if up:
            outcome.bytes_up += n
        else:
            outcome.bytes_down += n
        self.touch()
        return True

    def settle(self) -> None:
        """After the scope: an expired deadline (not a cut) means the connection idled."""
        if self.scope.cancelled_caught and self._outcome.reason is None:
            self._outcome.fail(
                ErrorCode.TIMEOUT,
                f"no byte either way for {self._idle_s:g} s (network.proxy.idle_timeout_s); closed",
                504,
            )


class Exchange:
    """One plain-HTTP request and its answer, between the client and the origin."""

    def __init__(
        self,
        client: trio.abc.Stream,
        conn: h11.Connection,
        upstream: httpcore.AsyncNetworkStream,
        up: h11.Connection,
        meter: Meter,
        outcome: Outcome,
    ) -> None:
        self.client = client
        self.conn = conn  # h11, the client's side
        self.upstream = upstream
        self.up = up  # h11, the origin's side
        self.meter = meter
        self.outcome = outcome
        self.answered = False  # a byte of the answer went to the client

    async def send_up(self, data: bytes) -> bool:
        if not data:
            return True
        if not self.meter.admit(len(data), up=True):
            return False
        try:
            await self.upstream.write(data)
        except httpcore.NetworkError as exc:
            self.outcome.fail(
                ErrorCode.TOOL_FAILED, f"the origin stopped taking the request: {exc}", 502
            )
            return False
        self.meter.touch()
        return True

    async def send_down(self, data: bytes) -> bool:
        if not data:
            return True
        if not self.meter.admit(len(data), up=False):
            return False
        self.answered = True
        try:
            await self.client.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.outcome.fail(None, "the client went away before the whole answer")
            return False
        self.meter.touch()
        return True

    async def upload(self, done: trio.CancelScope) -> None:
        """The request body, from the client to the origin, as it arrives."""
        conn = self.conn
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await self.client.receive_some(RECV_CHUNK)
                    self.meter.touch()
                    conn.receive_data(bytes(data))
                elif isinstance(event, h11.Data):
                    if not await self.send_up(self.up.send(event)):
                        break
                elif isinstance(event, h11.EndOfMessage):
                    await self.send_up(self.up.send(h11.EndOfMessage()))
                    return  # the answer may still be coming: keep the exchange
                else:
                    break
        except h11.RemoteProtocolError as exc:
            self.outcome.fail(ErrorCode.BAD_REQUEST, f"malformed request body: {exc}", 400)
        except h11.LocalProtocolError as exc:  # a body h11 will not forward as is
            self.outcome.fail(ErrorCode.BAD_REQUEST, f"the request cannot be forwarded: {exc}", 400)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.outcome.fail(None, "the client went away before the whole request")
        done.cancel()

    async def download(self) -> None:
        """The origin's answer, to the client, as it arrives."""
        up, conn = self.up, self.conn
        try:
            while True:
                event = up.next_event()
                if event is h11.NEED_DATA:
                    data = await self.upstream.read(RECV_CHUNK)
                    self.meter.touch()
                    up.receive_data(data)
                elif isinstance(event, h11.InformationalResponse):
                    continue  # 100-continue is ours to send; 103 hints are dropped
                elif isinstance(event, h11.Response):
                    answer = h11.Response(
                        status_code=event.status_code,
                        headers=forwarded_response_headers(event.headers.raw_items()),
                        reason=event.reason,
                    )
                    if not await self.send_down(conn.send(answer)):
                        return
                elif isinstance(event, h11.Data):
                    if not await self.send_down(conn.send(event)):
                        return
                elif isinstance(event, h11.EndOfMessage):
                    await self.send_down(conn.send(h11.EndOfMessage()))
                    return
                else:
                    return
        except h11.RemoteProtocolError as exc:
            where = "its body" if self.answered else "its answer"
            self.outcome.fail(ErrorCode.TOOL_FAILED, f"the origin broke off {where}: {exc}", 502)
        except httpcore.NetworkError as exc:
            self.outcome.fail(ErrorCode.TOOL_FAILED, f"the origin's connection failed: {exc}", 502)
        except h11.LocalProtocolError as exc:  # an answer h11 will not forward as is
            self.outcome.fail(
                ErrorCode.TOOL_FAILED, f"the origin's answer cannot be forwarded: {exc}", 502
            )


async def pump_up(
    client: trio.abc.Stream,
    upstream: httpcore.AsyncNetworkStream,
    early: bytes,
    meter: Meter,
    nursery: trio.Nursery,
) -> None:
    """Client to origin until the client's EOF (passed on as a half-close)."""
    try:
        data: bytes | bytearray = early
        while True:
            if data:
                if not meter.admit(len(data), up=True):
                    return
                await upstream.write(bytes(data))
                meter.touch()
            data = await client.receive_some(RECV_CHUNK)
            if not data:
                with contextlib.suppress(OSError):
                    upstream.get_extra_info("socket").shutdown(socket.SHUT_WR)
                return
            meter.touch()
    except (trio.BrokenResourceError, trio.ClosedResourceError, httpcore.NetworkError):
        nursery.cancel_scope.cancel()  # one side is gone: the tunnel is over


async def pump_down(
    upstream: httpcore.AsyncNetworkStream,
    client: trio.abc.Stream,
    meter: Meter,
    nursery: trio.Nursery,
) -> None:
    """Origin to client until the origin's EOF (passed on as a half-close)."""
    try:
        while True:
            data = await upstream.read(RECV_CHUNK)
            if not data:
                if isinstance(client, trio.abc.HalfCloseableStream):
                    await client.send_eof()
                return
            meter.touch()
            if not meter.admit(len(data), up=False):
                return
            await client.send_all(data)
            meter.touch()
    except (trio.BrokenResourceError, trio.ClosedResourceError, httpcore.NetworkError):
        nursery.cancel_scope.cancel()
