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

The proxy's HTTP framing (target parsing, header rewriting, error answers) is in
:mod:`gatewayd.egress_framing`; moving an allowed connection's bytes (the tunnel's
pumps, one plain-HTTP exchange, the byte meter) in :mod:`gatewayd.egress_relay`.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final

import h11
import httpcore
import httpx
import structlog
import trio

from gatewayd.audit import AuditEvent, AuditLog, AuditWriteError, Peer
from gatewayd.dialer import Resolver, resolve_checked, resolve_host
from gatewayd.egress_framing import (
    CONNECTED,
    Refused,
    error_response,
    forwarded_request_headers,
    parse_absolute_target,
    parse_connect_target,
)
from gatewayd.egress_relay import RECV_CHUNK, Exchange, Meter, Outcome, pump_down, pump_up
from gatewayd.errors import GatewayError, InvalidArguments, PolicyViolation
from gatewayd.metrics import DENIED, METRICS
from gatewayd.pinned_backend import PinnedBackend
from gatewayd.policy.model import NetworkSection
from gatewayd.policy.network import IpAddress, check_destination, check_method
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
# After an error answer: how long, and how much, to read and discard before closing, so
# the client reads the answer instead of a connection reset (as server.py does).
LINGER_S: Final = 1.0
LINGER_MAX_BYTES: Final = 1 << 20
# The audit entry of a finished connection is waited for at most this long: a stuck
# disk must not hold a connection's task (the entry stays queued and is written later).
AUDIT_WAIT_S: Final = 5.0
# The answer when an entry cannot be made durable (503): nothing goes out unaudited.
_AUDIT_DOWN: Final = "gatewayd's audit log cannot be written, so no connection goes out"


class EgressProxy:
    """The HTTP proxy of one run, enforcing its policy ``network`` section.

    ``resolve`` looks host names up (injectable so tests can name hosts); ``degraded``
    marks every audit entry of a run without the OS sandbox; ``head_timeout_s`` bounds
    the wait for a request head (tests shorten it); ``reply_after_result`` False is the
    operator's opt-out: error answers leave without waiting for their entry.
    ``tags`` go into every audit entry's detail: a process tool call's own proxy names
    the tool and the call (``tool``, ``toolCallId``), so a reviewer tells its connections
    from the run's.
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
        tags: Mapping[str, str] | None = None,
    ) -> None:
        self.run_id = run_id
        self._tags = dict(tags or {})
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
        outcome = Outcome(started=start)
        self.active += 1
        try:
            await self._serve(stream, outcome, peer)
        except Exception:
            log.exception("egress_failed", run_id=self.run_id)
            outcome.fail(ErrorCode.INTERNAL, "gatewayd failed while proxying; see its log")
        finally:
            METRICS.egress_connections.labels(outcome.verdict).inc()
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
        METRICS.egress_connections.labels(DENIED).inc()
        suppressed = throttle.admit(str(code), start)
        lingering = throttle.lingering < MAX_LINGERING_REFUSALS
        throttle.lingering += lingering
        try:
            if suppressed is not None:
                outcome = Outcome(started=start)
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
                detail={**self._tags, "verdict": "denied", "suppressedSinceLast": count},
                degraded=self._degraded,
            )
        except ValueError as exc:
            log.error("egress_audit_failed", run_id=self.run_id, error=str(exc))

    # -- one connection ------------------------------------------------------------

    async def _serve(self, stream: trio.abc.Stream, outcome: Outcome, peer: Peer | None) -> None:
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
        except Refused as refusal:
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
        self, stream: trio.abc.Stream, conn: h11.Connection, outcome: Outcome
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
                        raise Refused(
                            431,
                            ErrorCode.TOO_LARGE,
                            f"request head over {MAX_HEAD_BYTES} bytes",
                        ) from None
                    raise Refused(
                        400 if status < 500 else status,
                        ErrorCode.BAD_REQUEST,
                        f"malformed request: {exc}",
                    ) from None
                if isinstance(event, h11.Request):
                    return event
                if event is not h11.NEED_DATA:  # ConnectionClosed: nothing was asked
                    break
                if fed > MAX_HEAD_BYTES:
                    raise Refused(
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

    def _check(self, request: h11.Request, outcome: Outcome) -> tuple[httpx.URL, str, int]:
        """The destination of ``request`` (URL, host, port) once checked; Refused for
        anything the request's form or the policy does not allow."""
        net = self.network
        try:
            target = request.target.decode("ascii")
        except UnicodeDecodeError:
            raise Refused(
                400, ErrorCode.BAD_REQUEST, "the request target is not ASCII (IDNA-encode it)"
            ) from None
        connect = request.method == b"CONNECT"
        url = parse_connect_target(target) if connect else parse_absolute_target(target)
        outcome.domain = url.raw_host.decode("ascii").rstrip(".") or None
        outcome.port = url.port or (443 if connect else 80)
        try:
            host, port = check_destination(url, net)
        except PolicyViolation as exc:
            raise Refused(403, ErrorCode.POLICY_DENIED, str(exc)) from None
        except InvalidArguments as exc:
            raise Refused(400, ErrorCode.BAD_REQUEST, str(exc)) from None
        if not connect:  # CONNECT is the https scheme's, not a method of network.methods
            try:
                check_method(request.method.decode("ascii", "replace"), net)
            except PolicyViolation as exc:
                raise Refused(
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
                raise Refused(403, ErrorCode.POLICY_DENIED, str(exc)) from None
            except GatewayError as exc:  # ToolFailed: the name does not resolve
                raise Refused(502, ErrorCode.TOOL_FAILED, str(exc)) from None
        raise Refused(
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
        raise Refused(502, ErrorCode.TOOL_FAILED, f"cannot connect to {host}:{port}: {reason}")

    async def _tunnel(
        self,
        client: trio.abc.Stream,
        conn: h11.Connection,
        upstream: httpcore.AsyncNetworkStream,
        outcome: Outcome,
    ) -> None:
        """Answer 200 and relay raw bytes both ways until both sides are done, the
        connection idles or goes over its byte cap."""
        early, _ = conn.trailing_data  # sent before our 200 (e.g. a TLS ClientHello)
        try:
            await client.send_all(CONNECTED)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        meter = Meter(outcome, self.network)
        with meter.scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pump_up, client, upstream, early, meter, nursery)
                nursery.start_soon(pump_down, upstream, client, meter, nursery)
        meter.settle()

    async def _exchange(
        self,
        client: trio.abc.Stream,
        conn: h11.Connection,
        request: h11.Request,
        url: httpx.URL,
        upstream: httpcore.AsyncNetworkStream,
        outcome: Outcome,
        peer: Peer | None,
    ) -> None:
        """Forward one plain-HTTP request (head, then body as it arrives) and stream the
        answer back; both re-framed by h11, so what reaches either side is well formed."""
        up = h11.Connection(h11.CLIENT)
        meter = Meter(outcome, self.network)
        exchange = Exchange(client, conn, upstream, up, meter, outcome)
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
        outcome: Outcome,
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

    async def _record_opening(self, outcome: Outcome, peer: Peer | None) -> None:
        """The write-ahead entry of an allowed connection, durable before it is made.

        Error handling: Refused (503) when the audit log cannot take it: no egress
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
                        **self._tags,
                        "domain": outcome.domain,
                        "port": outcome.port,
                        "method": outcome.method,
                    },
                    degraded=self._degraded,
                )
        except (AuditWriteError, ValueError, trio.TooSlowError) as exc:
            log.error("egress_audit_failed", run_id=self.run_id, error=str(exc))
            raise Refused(503, ErrorCode.INTERNAL, _AUDIT_DOWN) from None

    async def _record(
        self, outcome: Outcome, duration_s: float, peer: Peer | None, *, wait: bool = True
    ) -> bool:
        """Record the connection's ``egress`` entry and, with ``wait``, wait (at most
        AUDIT_WAIT_S) until it is durable. True once it is (or, without ``wait``, once
        it is queued); False, logged, when the log cannot take it or not in time (the
        entry stays queued then)."""
        detail: dict[str, object] = {
            **self._tags,
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
