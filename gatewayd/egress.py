"""The per-run HTTP egress proxy: what gatewayd serves on a run's proxy socket.

Inside the sandbox, ``cogni-tool serve`` listens on 127.0.0.1:3128 (``HTTP_PROXY`` and
``HTTPS_PROXY`` point there) and relays every TCP connection it accepts, byte for byte,
to the run's proxy unix socket. Here one such connection is one client: its request head
is read (bounded in size and time) and is either

- ``CONNECT host:port``: answered ``200 Connection established`` and relayed as raw
  bytes both ways. TLS runs end to end between the sandboxed client and the origin; the
  proxy never sees inside it (no interception, so no content inspection), or
- a plain-HTTP absolute-form request (``GET http://host:port/path HTTP/1.1``): rewritten
  to origin form, ``Proxy-*`` and hop-by-hop headers dropped, the body re-framed and
  ``Connection: close`` forced upstream, the answer streamed back. Exactly one request
  per connection: anything the client sends after it is never read, so a pipelined
  second request cannot slip past the checks.

Threat model: the sandboxed client picks the destination, so before a byte goes out the
destination passes the very checks ``http.fetch`` makes, in the same code
(:mod:`gatewayd.policy.network` decides, :mod:`gatewayd.dialer` looks up and connects):
scheme (``https`` for CONNECT, ``http`` for plain requests), method, the host against
``network.allow_domains``, the port against ``network.ports``, one DNS lookup whose every
address passes the SSRF guard (``network.allow_private``), and a connection to those
checked addresses only. Bodies are streamed, never buffered whole; each connection is cut
past ``network.proxy.max_connection_bytes`` and closed after ``idle_timeout_s`` without a
byte. Every connection is audited once (an ``egress`` event); no upstream byte ever
enters the audit log.

What is durable when (invariant RESULT_BEFORE_REPLY): an allowed connection's
``egress_opened`` entry before it is made, so before the ``200`` to a CONNECT or any
forwarded byte; a refusal's or failure's ``egress`` entry before its error answer
(403, 429, 502, 503, 504...), at once with the operator's opt-out
(``audit_reply_after_result: false``). The ``egress`` entry of a connection that was
relayed ends it, after its last byte went out: a stream has no single answer to hold
back, and its destination was on the record before it started.
"""

from __future__ import annotations

import contextlib
import functools
import http
import math
import re
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

import h11
import httpcore
import httpx
import structlog
import trio

from gatewayd.audit import AuditEvent, AuditLog, AuditWriteError, Peer
from gatewayd.dialer import PinnedBackend, Resolver, resolve_checked, resolve_host
from gatewayd.errors import GatewayError, InvalidArguments, PolicyViolation
from gatewayd.metrics import DENIED, METRICS
from gatewayd.policy.model import NetworkSection
from gatewayd.policy.network import REFUSED_HEADERS, IpAddress, check_destination, check_method
from gatewayd.policy.rate import TokenBucket
from gatewayd.protocol import ErrorCode
from gatewayd.server import (
    MAX_LINGERING_REFUSALS,
    RUN_SOCKET_MODE,
    RefusalThrottle,
    accept_retrying,
    open_unix_listener,
    peer_credentials,
)

log = structlog.get_logger("gatewayd.egress")

# Real request heads are a few KiB; 64 KiB is what common servers accept. More is a
# client trying to make gatewayd hold memory (431).
MAX_HEAD_BYTES: Final = 64 * 1024
# A client sends its request head at once; one that dribbles it for longer is holding a
# connection slot for nothing (slowloris), and is closed.
HEAD_TIMEOUT_S: Final = 30.0
# One read moves at most this much: large enough for fast downloads in few reads, small
# enough that one connection never holds more than a little memory.
RECV_CHUNK: Final = 64 * 1024
# After an error answer: how long, and how much, to read and discard before closing, so
# the client reads the answer instead of a connection reset (as server.py does).
LINGER_S: Final = 1.0
LINGER_MAX_BYTES: Final = 1 << 20
# The audit entry of a finished connection is waited for at most this long: a stuck
# disk must not hold a connection's task (the entry stays queued and is written later).
AUDIT_WAIT_S: Final = 5.0
# The answer when an entry cannot be made durable (503): nothing goes out unaudited.
_AUDIT_DOWN: Final = "gatewayd's audit log cannot be written, so no connection goes out"

# Hop-by-hop headers (RFC 9110 7.6.1) are the proxy's own: never forwarded either way.
HOP_BY_HOP_HEADERS: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# What gatewayd sets itself on a forwarded request (as for http.fetch: Host and framing
# are re-derived from what was checked), plus Expect: the proxy answers 100-continue.
_DROPPED_REQUEST_HEADERS: Final = REFUSED_HEADERS | HOP_BY_HOP_HEADERS | {"expect"}
# CONNECT's target: host:port, the host a DNS name (ASCII) or a bracketed IPv6 literal.
_AUTHORITY_RE: Final = re.compile(r"(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9.-]{1,253}):([0-9]{1,5})")
_CONNECTED: Final = b"HTTP/1.1 200 Connection established\r\n\r\n"

Verdict = Literal["allowed", "denied"]


class _Refused(Exception):
    """Answer the client with ``status`` and ``reason``; audited with ``code``."""

    def __init__(
        self,
        status: int,
        code: ErrorCode,
        reason: str,
        *,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(reason)
        self.status = status
        self.code = code
        self.reason = reason
        self.headers = headers


@dataclass(slots=True, kw_only=True)
class _Outcome:
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


def error_response(
    status: int,
    message: str,
    *,
    head_only: bool = False,
    headers: Iterable[tuple[str, str]] = (),
) -> bytes:
    """A complete ``text/plain`` answer that closes the connection (``message`` + newline)."""
    body = f"cogni egress proxy: {message}\n".encode()
    lines = [
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}",
        "Content-Type: text/plain; charset=utf-8",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{name}: {value}" for name, value in headers),
    ]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head if head_only else head + body


def _connection_tokens(headers: Iterable[tuple[str, bytes]]) -> set[str]:
    """Header names a ``Connection`` header marks as hop-by-hop."""
    return {
        token.strip().lower()
        for name, value in headers
        if name == "connection"
        for token in value.decode("latin-1").split(",")
    }


def _named(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[str, bytes, bytes]]:
    """(lowercase name, name as sent, value): compared by the first, forwarded as sent."""
    return [(name.decode("latin-1").lower(), name, value) for name, value in headers]


def forwarded_request_headers(
    headers: Iterable[tuple[bytes, bytes]], netloc: bytes
) -> list[tuple[bytes, bytes]]:
    """The client's request headers as sent upstream: Host from the checked URL, the
    body framing re-derived (chunked wins over Content-Length, as h11 read it), no
    ``Proxy-*``, hop-by-hop or ``Expect`` header, and ``Connection: close``."""
    items = _named(headers)
    drop = _connection_tokens((lower, value) for lower, _, value in items)
    out: list[tuple[bytes, bytes]] = [(b"Host", netloc)]
    for lower, name, value in items:
        if lower in _DROPPED_REQUEST_HEADERS or lower in drop or lower.startswith("proxy-"):
            continue
        out.append((name, value))
    lengths = [value for lower, _, value in items if lower == "content-length"]
    if any(lower == "transfer-encoding" for lower, _, _ in items):  # h11 took it as chunked
        out.append((b"Transfer-Encoding", b"chunked"))
    elif lengths:  # h11 checked that repeats agree
        out.append((b"Content-Length", lengths[0]))
    out.append((b"Connection", b"close"))
    return out


def forwarded_response_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The origin's response headers as sent to the client: hop-by-hop ones dropped (h11
    re-frames the body; a chunked body's Content-Length, which h11 ignored, goes too),
    ``Connection: close`` added."""
    items = _named(headers)
    drop = _connection_tokens((lower, value) for lower, _, value in items) | HOP_BY_HOP_HEADERS
    if any(lower == "transfer-encoding" for lower, _, _ in items):
        drop.add("content-length")
    out = [(name, value) for lower, name, value in items if lower not in drop]
    out.append((b"Connection", b"close"))
    return out


def _parse_connect_target(target: str) -> httpx.URL:
    match = _AUTHORITY_RE.fullmatch(target)
    if match is None:
        raise _Refused(
            400,
            ErrorCode.BAD_REQUEST,
            f"CONNECT needs host:port (e.g. CONNECT pypi.org:443), not {target[:200]!r}",
        )
    try:
        return httpx.URL(f"https://{target}/")
    except httpx.InvalidURL as exc:
        raise _Refused(
            400, ErrorCode.BAD_REQUEST, f"CONNECT target {target[:200]!r}: {exc}"
        ) from None


def _parse_absolute_target(target: str) -> httpx.URL:
    scheme = target.partition("://")[0].lower() if "://" in target else ""
    if scheme == "https":
        raise _Refused(
            400,
            ErrorCode.BAD_REQUEST,
            "an https:// URL goes through a CONNECT tunnel: use HTTPS_PROXY, not a plain "
            "request to the proxy",
        )
    if scheme != "http":
        raise _Refused(
            400,
            ErrorCode.BAD_REQUEST,
            "this is a forward proxy: send an absolute URL (GET http://host/path HTTP/1.1), "
            f"or CONNECT host:port for https; got the target {target[:200]!r}",
        )
    try:
        url = httpx.URL(target)
    except httpx.InvalidURL as exc:
        raise _Refused(400, ErrorCode.BAD_REQUEST, f"not a valid URL: {exc}") from None
    if url.fragment:
        raise _Refused(400, ErrorCode.BAD_REQUEST, "a request URL may not carry a #fragment")
    return url


class _Meter:
    """One connection's byte count against its cap, and its idle deadline."""

    def __init__(self, outcome: _Outcome, net: NetworkSection) -> None:
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


class EgressProxy:
    """The HTTP proxy of one run, enforcing its policy ``network`` section.

    ``resolve`` looks host names up (injectable so tests can name hosts); ``degraded``
    marks every audit entry of a run without the OS sandbox; ``head_timeout_s`` bounds
    the wait for a request head (tests shorten it); ``reply_after_result`` False is the
    operator's opt-out: error answers leave without waiting for their entry.
    """

    def __init__(
        self,
        *,
        run_id: str,
        network: NetworkSection,
        audit: AuditLog,
        resolve: Resolver = resolve_host,
        degraded: str | None = None,
        head_timeout_s: float = HEAD_TIMEOUT_S,
        reply_after_result: bool = True,
    ) -> None:
        self.run_id = run_id
        self.network = network
        self._audit = audit
        self._resolve = resolve
        self._degraded = degraded
        self._head_timeout_s = head_timeout_s
        self._reply_after_result = reply_after_result
        # Connections being handled right now, audit entry included (status, tests).
        self.active = 0

    async def handle(self, stream: trio.abc.Stream, *, peer: Peer | None = None) -> None:
        """Serve one client connection (one request, or one CONNECT tunnel), then close it.

        Resource handling: the client stream and any upstream connection are closed
        before this returns, also when cancelled; the audit entry is recorded then,
        unless an error answer needed it first.

        Error handling: never raises for anything the client or the upstream does; each
        refusal or failure is an HTTP answer (if the client has had none yet) and the
        audit entry's ``errorCode`` and ``safeMessage``. A bug is logged and audited
        as ``internal``.
        """
        start = trio.current_time()
        outcome = _Outcome(started=start)
        self.active += 1
        try:
            await self._serve(stream, outcome, peer)
        except Exception:
            log.exception("egress_failed", run_id=self.run_id)
            outcome.fail(ErrorCode.INTERNAL, "gatewayd failed while proxying; see its log")
        finally:
            METRICS.egress_connections.inc((outcome.verdict,))
            if trio.current_effective_deadline() == -math.inf:  # cancelled from outside
                outcome.fail(None, "closed by gatewayd: the run is ending")
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)
                if not outcome.recorded:
                    await self._record(outcome, trio.current_time() - start, peer)
            self.active -= 1

    async def refuse(
        self,
        stream: trio.abc.Stream,
        *,
        peer: Peer,
        throttle: RefusalThrottle,
        status: int,
        code: ErrorCode,
        message: str,
    ) -> None:
        """Answer a connection refused before it is read (an outsider, one over the
        limit) and close it. As on the run socket (server.py), ``throttle`` audits at most
        one such refusal per code per second (the next entry counts those left out) and
        lets only a few linger for their client to read the answer. An audited refusal
        is answered once its entry is durable; one left out has no entry to wait for."""
        start = trio.current_time()
        METRICS.egress_connections.inc((DENIED,))
        suppressed = throttle.admit(str(code), start)
        lingering = throttle.lingering < MAX_LINGERING_REFUSALS
        throttle.lingering += lingering
        try:
            if suppressed is not None:
                outcome = _Outcome(started=start)
                outcome.fail(code, message)
                if suppressed:
                    outcome.extra["suppressedSinceLast"] = suppressed
                await self._answer_on_record(
                    stream, outcome, peer, status, message, linger=lingering
                )
            else:
                log.info("egress_refused", run_id=self.run_id, code=str(code))
                await _answer(stream, error_response(status, message), linger=lingering)
        finally:
            throttle.lingering -= lingering
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)

    def record_suppressed(self, code: str, count: int) -> None:
        """Count refusals the throttle left out of the audit (at shutdown; never awaits)."""
        try:
            self._audit.record(
                "event",
                event=AuditEvent.EGRESS,
                runId=self.run_id,
                errorCode=code,
                safeMessage=f"{count} more refused proxy connections, not audited one by one",
                detail={"verdict": "denied", "suppressedSinceLast": count},
                degraded=self._degraded,
            )
        except ValueError as exc:
            log.error("egress_audit_failed", run_id=self.run_id, error=str(exc))

    # -- one connection ------------------------------------------------------------

    async def _serve(self, stream: trio.abc.Stream, outcome: _Outcome, peer: Peer | None) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        head_only = False
        try:
            request = await self._read_head(stream, conn, outcome)
            if request is None:
                return
            method = request.method.decode("ascii", "replace")
            head_only = method == "HEAD"
            outcome.method = method
            url, host, port = self._check(request, outcome)
            addresses = await self._resolve_checked(host, port)
            await self._record_opening(outcome, peer)
            outcome.verdict = "allowed"
            upstream = await self._connect(host, port, addresses)
        except _Refused as refusal:
            outcome.fail(refusal.code, refusal.reason, refusal.status)
            await self._answer_on_record(
                stream,
                outcome,
                peer,
                refusal.status,
                refusal.reason,
                head_only=head_only,
                headers=refusal.headers,
            )
            return
        try:
            if request.method == b"CONNECT":
                await self._tunnel(stream, conn, upstream, outcome)
            else:
                await self._exchange(stream, conn, request, url, upstream, outcome, peer)
        finally:
            with trio.CancelScope(shield=True):
                await upstream.aclose()

    async def _read_head(
        self, stream: trio.abc.Stream, conn: h11.Connection, outcome: _Outcome
    ) -> h11.Request | None:
        """The request head, or None when the client closed or took too long (no answer).

        Never feeds h11 more than MAX_HEAD_BYTES + 1 bytes before the head is complete, so
        a head arriving in a few large reads is held to the limit as well.
        """
        fed = 0
        with trio.move_on_after(self._head_timeout_s):
            while True:
                try:
                    event = conn.next_event()
                except h11.RemoteProtocolError as exc:
                    status = exc.error_status_hint
                    if status == 431:
                        raise _Refused(
                            431,
                            ErrorCode.TOO_LARGE,
                            f"request head over {MAX_HEAD_BYTES} bytes",
                        ) from None
                    raise _Refused(
                        400 if status < 500 else status,
                        ErrorCode.BAD_REQUEST,
                        f"malformed request: {exc}",
                    ) from None
                if isinstance(event, h11.Request):
                    return event
                if event is not h11.NEED_DATA:  # ConnectionClosed: nothing was asked
                    break
                if fed > MAX_HEAD_BYTES:
                    raise _Refused(
                        431, ErrorCode.TOO_LARGE, f"request head over {MAX_HEAD_BYTES} bytes"
                    )
                try:
                    data = await stream.receive_some(min(RECV_CHUNK, MAX_HEAD_BYTES + 1 - fed))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
                fed += len(data)
                conn.receive_data(bytes(data))  # no copy: a socket's read is bytes
            outcome.fail(
                ErrorCode.BAD_REQUEST,
                "the client closed the connection before sending a request head",
            )
            return None
        outcome.fail(
            ErrorCode.TIMEOUT,
            f"no complete request head within {self._head_timeout_s:g} s; closed",
        )
        return None

    def _check(self, request: h11.Request, outcome: _Outcome) -> tuple[httpx.URL, str, int]:
        """The destination of ``request`` (URL, host, port) once checked; _Refused for
        anything the request's form or the policy does not allow."""
        net = self.network
        try:
            target = request.target.decode("ascii")
        except UnicodeDecodeError:
            raise _Refused(
                400, ErrorCode.BAD_REQUEST, "the request target is not ASCII (IDNA-encode it)"
            ) from None
        connect = request.method == b"CONNECT"
        url = _parse_connect_target(target) if connect else _parse_absolute_target(target)
        outcome.domain = url.raw_host.decode("ascii").rstrip(".") or None
        outcome.port = url.port or (443 if connect else 80)
        try:
            host, port = check_destination(url, net)
        except PolicyViolation as exc:
            raise _Refused(403, ErrorCode.POLICY_DENIED, str(exc)) from None
        except InvalidArguments as exc:
            raise _Refused(400, ErrorCode.BAD_REQUEST, str(exc)) from None
        if not connect:  # CONNECT is the https scheme's, not a method of network.methods
            try:
                check_method(request.method.decode("ascii", "replace"), net)
            except PolicyViolation as exc:
                raise _Refused(
                    405,
                    ErrorCode.POLICY_DENIED,
                    str(exc),
                    headers=(("Allow", ", ".join(net.methods)),),
                ) from None
        return url, host, port

    async def _resolve_checked(self, host: str, port: int) -> tuple[IpAddress, ...]:
        with trio.move_on_after(self.network.timeout_s):
            try:
                return await resolve_checked(host, port, self.network, self._resolve)
            except PolicyViolation as exc:
                raise _Refused(403, ErrorCode.POLICY_DENIED, str(exc)) from None
            except GatewayError as exc:  # ToolFailed: the name does not resolve
                raise _Refused(502, ErrorCode.TOOL_FAILED, str(exc)) from None
        raise _Refused(
            502,
            ErrorCode.TOOL_FAILED,
            f"resolving {host!r} took over {self.network.timeout_s:g} s (network.timeout_s)",
        )

    async def _connect(
        self, host: str, port: int, addresses: tuple[IpAddress, ...]
    ) -> httpcore.AsyncNetworkStream:
        backend = PinnedBackend(host, addresses)
        try:
            return await backend.connect_tcp(host, port, timeout=self.network.timeout_s)
        except httpcore.ConnectTimeout:
            reason = f"timed out after {self.network.timeout_s:g} s (network.timeout_s)"
        except (httpcore.ConnectError, OSError) as exc:
            reason = str(exc) or type(exc).__name__
        raise _Refused(502, ErrorCode.TOOL_FAILED, f"cannot connect to {host}:{port}: {reason}")

    async def _tunnel(
        self,
        client: trio.abc.Stream,
        conn: h11.Connection,
        upstream: httpcore.AsyncNetworkStream,
        outcome: _Outcome,
    ) -> None:
        """Answer 200 and relay raw bytes both ways until both sides are done, the
        connection idles or goes over its byte cap."""
        early, _ = conn.trailing_data  # sent before our 200 (e.g. a TLS ClientHello)
        try:
            await client.send_all(_CONNECTED)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        meter = _Meter(outcome, self.network)
        with meter.scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_pump_up, client, upstream, early, meter, nursery)
                nursery.start_soon(_pump_down, upstream, client, meter, nursery)
        meter.settle()

    async def _exchange(
        self,
        client: trio.abc.Stream,
        conn: h11.Connection,
        request: h11.Request,
        url: httpx.URL,
        upstream: httpcore.AsyncNetworkStream,
        outcome: _Outcome,
        peer: Peer | None,
    ) -> None:
        """Forward one plain-HTTP request (head, then body as it arrives) and stream the
        answer back; both re-framed by h11, so what reaches either side is well formed."""
        up = h11.Connection(h11.CLIENT)
        meter = _Meter(outcome, self.network)
        exchange = _Exchange(client, conn, upstream, up, meter, outcome)
        head = h11.Request(
            method=request.method,
            target=url.raw_path or b"/",
            headers=forwarded_request_headers(request.headers.raw_items(), url.netloc),
        )
        head_for_client = request.method == b"HEAD"
        with meter.scope:
            if conn.they_are_waiting_for_100_continue:  # before anything else is sent
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await client.send_all(
                        conn.send(
                            h11.InformationalResponse(
                                status_code=100, headers=[], reason=b"Continue"
                            )
                        )
                    )
            async with trio.open_nursery() as nursery:
                if await exchange.send_up(up.send(head)):
                    nursery.start_soon(exchange.upload, nursery.cancel_scope)
                    await exchange.download()
                nursery.cancel_scope.cancel()
        meter.settle()
        if not exchange.answered and outcome.status is not None and outcome.reason is not None:
            await self._answer_on_record(
                client, outcome, peer, outcome.status, outcome.reason, head_only=head_for_client
            )

    async def _answer_on_record(
        self,
        stream: trio.abc.Stream,
        outcome: _Outcome,
        peer: Peer | None,
        status: int,
        reason: str,
        *,
        head_only: bool = False,
        headers: tuple[tuple[str, str], ...] = (),
        linger: bool = True,
    ) -> None:
        """The connection's last word, an error answer, sent once its ``egress`` entry
        (which says so) is durable, or at once with the operator's opt-out; a 503 when
        the log cannot take the entry."""
        outcome.recorded = True
        durable = await self._record(
            outcome,
            trio.current_time() - outcome.started,
            peer,
            wait=self._reply_after_result,
        )
        if durable:
            answer = error_response(status, reason, head_only=head_only, headers=headers)
        else:
            answer = error_response(503, _AUDIT_DOWN, head_only=head_only)
        await _answer(stream, answer, linger=linger)

    async def _record_opening(self, outcome: _Outcome, peer: Peer | None) -> None:
        """The write-ahead entry of an allowed connection, durable before it is made.

        Error handling: _Refused (503) when the audit log cannot take it: no egress
        without its audit entry (fail closed).
        """
        try:
            with trio.fail_after(AUDIT_WAIT_S):
                await self._audit.append(
                    "event",
                    event=AuditEvent.EGRESS_OPENED,
                    runId=self.run_id,
                    peer=peer,
                    detail={
                        "domain": outcome.domain,
                        "port": outcome.port,
                        "method": outcome.method,
                    },
                    degraded=self._degraded,
                )
        except (AuditWriteError, ValueError, trio.TooSlowError) as exc:
            log.error("egress_audit_failed", run_id=self.run_id, error=str(exc))
            raise _Refused(503, ErrorCode.INTERNAL, _AUDIT_DOWN) from None

    async def _record(
        self, outcome: _Outcome, duration_s: float, peer: Peer | None, *, wait: bool = True
    ) -> bool:
        """Record the connection's ``egress`` entry and, with ``wait``, wait (at most
        AUDIT_WAIT_S) until it is durable. True once it is (or, without ``wait``, once
        it is queued); False, logged, when the log cannot take it or not in time (the
        entry stays queued then)."""
        detail: dict[str, object] = {
            "domain": outcome.domain,
            "port": outcome.port,
            "method": outcome.method,
            "verdict": outcome.verdict,
            "bytesUp": outcome.bytes_up,
            "bytesDown": outcome.bytes_down,
        }
        if outcome.reason is not None:
            detail["reason"] = outcome.reason
        detail.update(outcome.extra)
        try:
            seq = self._audit.record(
                "event",
                event=AuditEvent.EGRESS,
                runId=self.run_id,
                durationMs=round(duration_s * 1000, 3),
                errorCode=None if outcome.code is None else str(outcome.code),
                safeMessage=outcome.reason if outcome.code is not None else None,
                peer=peer,
                detail=detail,
                degraded=self._degraded,
            )
            if not wait:
                return True
            with trio.move_on_after(AUDIT_WAIT_S):
                await self._audit.durable(seq)
                return True
            log.error("egress_audit_slow", run_id=self.run_id, seconds=AUDIT_WAIT_S, **detail)
        except AuditWriteError as exc:
            log.error("egress_audit_failed", run_id=self.run_id, error=exc.detail, **detail)
        except ValueError as exc:
            log.error("egress_audit_failed", run_id=self.run_id, error=str(exc), **detail)
        return False


class _Exchange:
    """One plain-HTTP request and its answer, between the client and the origin."""

    def __init__(
        self,
        client: trio.abc.Stream,
        conn: h11.Connection,
        upstream: httpcore.AsyncNetworkStream,
        up: h11.Connection,
        meter: _Meter,
        outcome: _Outcome,
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


async def _pump_up(
    client: trio.abc.Stream,
    upstream: httpcore.AsyncNetworkStream,
    early: bytes,
    meter: _Meter,
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


async def _pump_down(
    upstream: httpcore.AsyncNetworkStream,
    client: trio.abc.Stream,
    meter: _Meter,
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


async def _answer(stream: trio.abc.Stream, data: bytes, *, linger: bool) -> None:
    """Send a final answer; then half-close and read briefly, so closing with the
    client's unread bytes does not reset the connection before it reads the answer."""
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        with trio.move_on_after(LINGER_S):
            await stream.send_all(data)
        if not linger or not isinstance(stream, trio.abc.HalfCloseableStream):
            return
        await stream.send_eof()
        drained = 0
        with trio.move_on_after(LINGER_S):
            while drained < LINGER_MAX_BYTES:
                chunk = await stream.receive_some(RECV_CHUNK)
                if not chunk:
                    break
                drained += len(chunk)


async def serve_egress(
    path: Path,
    proxy: EgressProxy,
    *,
    group: int | None,
    owns_peer: Callable[[int], bool] | None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``proxy`` on a fresh unix socket at ``path`` until cancelled.

    With ``group`` the socket is the run sandbox's (mode 0660, that group); without, the
    owner's only. A peer for which ``owns_peer(pid)`` is False (a process outside the
    run's sandbox) is answered 403 and closed; a connection over
    ``network.proxy.connections_per_second`` (and its burst) 429; beyond
    ``network.proxy.max_connections`` open connections a new one 503. These refusals are
    audited, throttled like refusals on the run socket (server.py's RefusalThrottle).

    Resource handling: the listener and every connection are closed on exit; refusals
    left out of the audit are counted in one last entry. The socket file is the
    caller's to remove.
    """
    if group is None:
        listener = await open_unix_listener(path)
    else:
        listener = await open_unix_listener(path, mode=RUN_SOCKET_MODE, group=group)
    settings = proxy.network.proxy
    limit = settings.max_connections
    bucket = TokenBucket(settings.connections_per_second, settings.connection_burst)
    throttle = RefusalThrottle()
    open_connections = 0

    async def serve_one(stream: trio.SocketStream, peer: Peer) -> None:
        nonlocal open_connections
        try:
            await proxy.handle(stream, peer=peer)
        finally:
            open_connections -= 1

    try:
        async with listener, trio.open_nursery() as connections:
            task_status.started()
            while True:
                stream = await accept_retrying(listener, "egress_accept_failed", proxy.run_id)
                try:
                    peer = peer_credentials(stream.socket)
                except OSError:
                    await trio.aclose_forcefully(stream)
                    continue
                refuse = functools.partial(proxy.refuse, stream, peer=peer, throttle=throttle)
                if owns_peer is not None and not owns_peer(peer.pid):
                    connections.start_soon(
                        functools.partial(
                            refuse,
                            status=403,
                            code=ErrorCode.AUTHZ_DENIED,
                            message="this proxy serves only processes inside its run's "
                            "sandbox (its network namespace)",
                        )
                    )
                elif not bucket.try_take(trio.current_time()):
                    rate = f"{settings.connections_per_second:g}"
                    connections.start_soon(
                        functools.partial(
                            refuse,
                            status=429,
                            code=ErrorCode.RATE_LIMITED,
                            message=f"this run opens proxy connections faster than {rate} a "
                            "second (network.proxy.connections_per_second); retry in a moment",
                        )
                    )
                elif open_connections >= limit:
                    connections.start_soon(
                        functools.partial(
                            refuse,
                            status=503,
                            code=ErrorCode.RATE_LIMITED,
                            message=f"this run already has {limit} proxy connections open "
                            "(network.proxy.max_connections); retry when one closes",
                        )
                    )
                else:  # counted now: a burst of accepts must not overshoot the limit
                    open_connections += 1
                    connections.start_soon(serve_one, stream, peer)
    finally:
        for code, count in throttle.leftover().items():
            proxy.record_suppressed(code, count)
