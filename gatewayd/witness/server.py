"""The witness's HTTP service (C2SP tlog-witness) over trio, HTTP parsing by h11.

Routes (the submission and monitoring prefixes are both the root):

- ``POST /add-checkpoint``: :meth:`Witness.add_checkpoint`;
- ``GET /<sha256(origin) hex>/checkpoint``: the latest checkpoint it cosigned for that log.

Keep-alive is supported (the spec asks for it). Each connection is its own task: a
malformed or slow client is answered or dropped without touching the others.

Resource handling: at most ``MAX_CONNECTIONS`` connections are served at once (the
listener stops accepting while that many are open); a request must arrive whole within
``REQUEST_TIMEOUT_S``; each answer is computed in a worker thread (the record's fsync
must not stall the event loop), at most ``MAX_WORKERS`` at once.
"""

from __future__ import annotations

import contextlib
import re
from typing import Final

import h11
import structlog
import trio

from gatewayd.audit.witness_wire import MAX_REQUEST_BYTES
from gatewayd.witness.witness import Answer, Witness

log = structlog.get_logger("gatewayd.witness")

# A log sends a checkpoint a second at most; a few hundred connections is a flood.
MAX_CONNECTIONS: Final = 256
# Checks are a signature and a few dozen hashes; the write is one fsync. More threads
# would only queue on the witness's lock.
MAX_WORKERS: Final = 8
# Slowloris bound: a whole request (headers and body) within this many seconds.
REQUEST_TIMEOUT_S: Final = 10.0
# An idle keep-alive connection is closed after this long.
IDLE_TIMEOUT_S: Final = 60.0
RECV_CHUNK: Final = 16 * 1024
# h11's bound on one event: the request line and headers.
MAX_HEADER_BYTES: Final = 16 * 1024
_CHECKPOINT_PATH: Final = re.compile(r"/([0-9a-f]{64})/checkpoint")


class _TooLarge(Exception):
    pass


class WitnessServer:
    """Serves one :class:`Witness` on a TCP listener."""

    def __init__(self, witness: Witness) -> None:
        self.witness = witness
        self._connections = trio.CapacityLimiter(MAX_CONNECTIONS)
        self._workers = trio.CapacityLimiter(MAX_WORKERS)

    async def serve(self, listeners: list[trio.SocketListener]) -> None:
        """Accept connections on ``listeners`` until cancelled."""
        async with trio.open_nursery() as nursery:
            for listener in listeners:
                nursery.start_soon(self._accept, listener, nursery)

    async def _accept(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        async with listener:
            while True:
                token = object()  # this connection's slot, released when it ends
                await self._connections.acquire_on_behalf_of(token)
                try:
                    stream = await listener.accept()
                except BaseException:
                    self._connections.release_on_behalf_of(token)
                    raise
                nursery.start_soon(self._connection, stream, token)

    async def _connection(self, stream: trio.SocketStream, token: object) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        try:
            while True:
                with trio.move_on_after(IDLE_TIMEOUT_S) as idle:
                    first = await self._receive_into(stream, conn)
                if idle.cancelled_caught or not first:
                    return
                with trio.fail_after(REQUEST_TIMEOUT_S):
                    request, body = await self._read_request(stream, conn)
                if request is None:
                    return
                answer = await self._route(request, body)
                await self._send(stream, conn, answer)
                if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError):
            pass
        except _TooLarge:
            await self._try_send(
                stream, conn, Answer.text(413, f"request body over {MAX_REQUEST_BYTES} bytes")
            )
        except h11.RemoteProtocolError as exc:
            await self._try_send(stream, conn, Answer.text(400, f"malformed HTTP: {exc}"))
        except Exception:
            log.exception("witness_connection_failed")
        finally:
            self._connections.release_on_behalf_of(token)
            await trio.aclose_forcefully(stream)

    async def _receive_into(self, stream: trio.SocketStream, conn: h11.Connection) -> bool:
        """Wait for the next request's first bytes (keep-alive); False at EOF."""
        if conn.trailing_data[0]:
            return True
        data = await stream.receive_some(RECV_CHUNK)
        conn.receive_data(data)
        return bool(data)

    async def _read_request(
        self, stream: trio.SocketStream, conn: h11.Connection
    ) -> tuple[h11.Request | None, bytes]:
        request: h11.Request | None = None
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(RECV_CHUNK))
            elif isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > MAX_REQUEST_BYTES:
                    raise _TooLarge
            elif isinstance(event, h11.EndOfMessage):
                return request, bytes(body)
            elif isinstance(event, h11.ConnectionClosed):
                return None, b""

    async def _route(self, request: h11.Request, body: bytes) -> Answer:
        method = request.method.decode()
        path = request.target.decode(errors="replace").partition("?")[0]
        if path == "/add-checkpoint":
            if method != "POST":
                return Answer.text(405, "add-checkpoint takes POST")
            return await trio.to_thread.run_sync(
                self.witness.add_checkpoint, body, limiter=self._workers
            )
        match = _CHECKPOINT_PATH.fullmatch(path)
        if match is not None:
            if method != "GET":
                return Answer.text(405, "<origin hash>/checkpoint takes GET")
            return await trio.to_thread.run_sync(
                self.witness.checkpoint, match[1], limiter=self._workers
            )
        return Answer.text(
            404, "no such route: POST /add-checkpoint or GET /<sha256 of origin>/checkpoint"
        )

    async def _send(self, stream: trio.SocketStream, conn: h11.Connection, answer: Answer) -> None:
        headers = [("content-type", answer.content_type), ("content-length", str(len(answer.body)))]
        out = conn.send(h11.Response(status_code=answer.status, headers=headers))
        out += conn.send(h11.Data(data=answer.body)) + conn.send(h11.EndOfMessage())
        await stream.send_all(out)

    async def _try_send(
        self, stream: trio.SocketStream, conn: h11.Connection, answer: Answer
    ) -> None:
        if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            with contextlib.suppress(trio.BrokenResourceError, h11.LocalProtocolError):
                await self._send(stream, conn, answer)
