"""The optional Prometheus listener: ``GET /metrics`` on a TCP address (config
``metrics_listen``), the same text as the control socket's ``GET /v1/metrics``.

Prometheus cannot scrape a unix socket, and the control socket must stay closed (it
starts runs and runs commands in them), so this listener is a second, separate server
that answers one read-only route and nothing else: no other path, no other method, no
request body. What it serves holds no text a sandbox chose (gatewayd/metrics.py bounds
every label value), so it needs no authentication; it listens on loopback unless the
operator names another address, and then gatewayd says so in its log.

HTTP parsing is h11's (sans-IO), as on the control socket; the text is rendered on the
trio thread, where the metrics are written. A render takes milliseconds of that thread
(about 8 ms with a few dozen tools on a busy host), the thread every tool call is
answered on, so renders are spaced at least :data:`MIN_RENDER_INTERVAL_S` apart: a
client asking as fast as it can (pipelined requests on every connection it may hold)
waits for its turn instead of taking the thread from the calls. Each answer is still
rendered when it is sent, never an older one. prometheus_client's own HTTP server is not
used: it serves from a thread of its own, outside the daemon's nursery and shutdown.

Resource handling: every connection is a task in the server's nursery, closed in
``finally``; at most :data:`MAX_CONNECTIONS` at once (one more is closed at accept), each
dropped when a request and its answer take over :data:`REQUEST_TIMEOUT_S`: a client
that sends slowly, or that asks and never reads the answer (pipelined requests fill the
socket's buffers), would otherwise hold its slot forever.
"""

from __future__ import annotations

import contextlib
import ipaddress
import math
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

import h11
import structlog
import trio

from gatewayd.metrics import CONTENT_TYPE, GatewayMetrics

log = structlog.get_logger("gatewayd.metrics_server")

# The one route: Prometheus's default metrics_path.
METRICS_PATH: Final = "/metrics"
# Prometheus scrapes a target over one connection at a time; a few more cover a second
# scraper and a person's curl. More is a flood, closed at accept before it holds a fd.
MAX_CONNECTIONS: Final = 16
# A scraper sends its whole request at once and reads the answer as it comes; a client
# that has not done both within this long is stuck or hostile, and its connection is
# dropped.
REQUEST_TIMEOUT_S: Final = 10.0
# A scrape's request line and headers are a few hundred bytes.
MAX_REQUEST_HEAD_BYTES: Final = 16 * 1024
RECV_CHUNK: Final = 16 * 1024
# At most ten renders a second, whoever asks: a scraper asks once every few seconds,
# so it never waits; a flood costs the trio thread at most ~10% (8 ms renders).
MIN_RENDER_INTERVAL_S: Final = 0.1
# The listen backlog: scrapes are rare, a short queue is plenty.
LISTEN_BACKLOG: Final = 64
# A scrape's answer is never cached: it is the value now.
_HEADERS_ALWAYS: Final = (("cache-control", "no-store"),)


class MetricsListenError(ValueError):
    """``metrics_listen`` is not an address gatewayd can listen on; the message says
    what is wrong and how it is written."""


@dataclass(frozen=True, slots=True)
class ListenAddress:
    """An IP address and a TCP port (0: any free port, the one bound is logged)."""

    host: str
    port: int

    @property
    def loopback(self) -> bool:
        return ipaddress.ip_address(self.host).is_loopback

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


_FORM: Final = "write it as IP:PORT, e.g. 127.0.0.1:9464 or [::1]:9464"


def parse_listen_address(text: str) -> ListenAddress:
    """``HOST:PORT`` with HOST an IPv4 address or a bracketed IPv6 one. Host names are
    refused: what a name resolves to can change under the daemon, an address cannot.

    Error handling: MetricsListenError naming the problem and the form."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise MetricsListenError(f"metrics_listen {text!r} has no port; {_FORM}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if ":" not in host:
            raise MetricsListenError(f"metrics_listen {text!r}: brackets are for IPv6; {_FORM}")
    elif ":" in host:
        raise MetricsListenError(f"metrics_listen {text!r}: put an IPv6 address in [ ]; {_FORM}")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise MetricsListenError(
            f"metrics_listen {text!r}: {host!r} is not an IP address (host names are not "
            f"taken); {_FORM}"
        ) from None
    if not port_text.isascii() or not port_text.isdigit() or int(port_text) > 65535:
        raise MetricsListenError(
            f"metrics_listen {text!r}: the port must be a number from 0 to 65535; {_FORM}"
        )
    return ListenAddress(str(address), int(port_text))


async def serve_metrics(
    address: ListenAddress,
    metrics: GatewayMetrics,
    *,
    task_status: trio.TaskStatus[ListenAddress] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``metrics`` on ``address`` until cancelled; ``task_status`` gets the
    address bound (its real port when 0 was asked).

    Error handling: MetricsListenError when the address cannot be bound (in use, not
    this host's), raised before anything is served."""
    family = socket.AF_INET6 if ":" in address.host else socket.AF_INET
    sock = trio.socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        await sock.bind((address.host, address.port))
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise MetricsListenError(
            f"cannot listen on metrics_listen {address}: {exc.strerror or exc}; choose a "
            "free port on an address of this host, or unset metrics_listen"
        ) from None
    bound = ListenAddress(address.host, sock.getsockname()[1])
    if not bound.loopback:
        log.warning(
            "metrics_listen_not_loopback",
            address=str(bound),
            hint="anyone who can reach this address reads the metrics; keep it on "
            "loopback or behind a firewall",
        )
    log.info("metrics_listening", address=str(bound), path=METRICS_PATH)
    listener = trio.SocketListener(sock)
    open_connections = [0]
    pacer = _RenderPacer()
    async with listener, trio.open_nursery() as nursery:
        task_status.started(bound)
        while True:
            stream = await listener.accept()
            if open_connections[0] >= MAX_CONNECTIONS:
                log.warning("metrics_connection_refused", reason="too many connections")
                await trio.aclose_forcefully(stream)
                continue
            open_connections[0] += 1
            nursery.start_soon(_connection, stream, metrics, pacer, open_connections)


class _RenderPacer:
    """Spaces the listener's renders :data:`MIN_RENDER_INTERVAL_S` apart (the module's
    docstring says why); the first waiter goes first."""

    def __init__(self) -> None:
        self._lock = trio.Lock()  # fair: waiters are served in the order they came
        self._last = -math.inf

    async def render(self, metrics: GatewayMetrics) -> str:
        async with self._lock:
            await trio.sleep_until(self._last + MIN_RENDER_INTERVAL_S)
            self._last = trio.current_time()
            return metrics.render()


async def _connection(
    stream: trio.SocketStream,
    metrics: GatewayMetrics,
    pacer: _RenderPacer,
    open_connections: list[int],
) -> None:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_HEAD_BYTES)
    try:
        while True:
            with trio.fail_after(REQUEST_TIMEOUT_S):
                request = await _read_request(stream, conn)
                if request is None:
                    return
                status, body, content_type = _refusal(request)
                if status == 200:
                    body = await pacer.render(metrics)
                # An answer to HEAD has its headers only (h11 refuses a body there).
                head = request.method == b"HEAD"
                await _send(stream, conn, status, body, content_type, head=head)
            if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                return
            conn.start_next_cycle()
    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError):
        pass
    except _Refused as refused:
        with _at_most(REQUEST_TIMEOUT_S):
            await _send(stream, conn, refused.status, refused.message, "text/plain")
    except h11.RemoteProtocolError as exc:
        with _at_most(REQUEST_TIMEOUT_S):
            await _send(stream, conn, 400, f"malformed HTTP: {exc}\n", "text/plain")
    except Exception:
        log.exception("metrics_connection_failed")
    finally:
        open_connections[0] -= 1
        await trio.aclose_forcefully(stream)


@contextlib.contextmanager
def _at_most(seconds: float) -> Iterator[None]:
    """An error answer sent on the way out, given up when the client does not take it
    within ``seconds`` or has gone."""
    with (
        trio.move_on_after(seconds),
        contextlib.suppress(trio.BrokenResourceError, h11.LocalProtocolError),
    ):
        yield


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def _read_request(stream: trio.SocketStream, conn: h11.Connection) -> h11.Request | None:
    """The next request (None: the client closed); a body is refused, none is taken."""
    request: h11.Request | None = None
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await stream.receive_some(RECV_CHUNK))
        elif isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.Data):
            raise _Refused(413, "this listener takes no request body\n")
        elif isinstance(event, h11.EndOfMessage):
            return request
        elif isinstance(event, h11.ConnectionClosed):
            return None


def _refusal(request: h11.Request) -> tuple[int, str, str]:
    """The answer to a request this listener refuses; 200 (its body still to render)
    for ``GET /metrics``."""
    path = request.target.decode("ascii", "replace").partition("?")[0]
    if path != METRICS_PATH:
        return 404, f"not found: this listener serves GET {METRICS_PATH} only\n", "text/plain"
    if request.method != b"GET":
        return 405, f"method not allowed: {METRICS_PATH} answers GET\n", "text/plain"
    return 200, "", CONTENT_TYPE


async def _send(
    stream: trio.SocketStream,
    conn: h11.Connection,
    status: int,
    body: str,
    content_type: str,
    *,
    head: bool = False,
) -> None:
    data = body.encode()
    headers = [
        ("content-type", content_type),
        ("content-length", str(len(data))),
        *_HEADERS_ALWAYS,
    ]
    if status != 200:
        headers.append(("connection", "close"))
    out = conn.send(h11.Response(status_code=status, headers=headers))
    if not head:
        out += conn.send(h11.Data(data=data))
    out += conn.send(h11.EndOfMessage())
    await stream.send_all(out)
