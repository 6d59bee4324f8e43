"""The floor of the call path: the least a trio server in Python must do per call with
a durable, hash-chained audit, to set beside gatewayd's own cost.

    .venv/bin/python bench/call_floor.py SOCKET AUDIT_FILE

It listens on SOCKET and, for every framed request, does what gatewayd's call path
cannot skip and nothing more, on the same loop as gatewayd's server: one task waits for
every connection at once (a private epoll, itself waited for with
``trio.lowlevel.wait_readable``, as gatewayd's ``server.Multiplexer``), reads each
readable one (``os.read``), decodes its requests with msgspec into
:class:`gatewayd.protocol.Request`, seals two entries per call (the call's and its
result's) with the audit's own :class:`gatewayd.audit.chain.Chain` (the same encoder
and hash), and hands them to a flusher thread that writes and fdatasyncs them with
group commit (all lines queued by then in one write and one sync), one wake-up of trio
per flush; a second task waits for each pass's flush and writes its answers (``ok``, a
small value), while the first reads on. No policy, no metrics, no logging, no tools,
no head file, no Merkle tree, no limits, no error handling beyond ending the
connection: bench/gateway_rtt.py measures its CPU per call beside gatewayd's, so the
gap between the two is what gatewayd adds, and the floor itself is what Python, trio
and a thread flusher cost.

Not a server to use: it trusts its client and keeps nothing but the log it appends.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import select
import socket
import struct
import sys
import threading
from typing import Final

import msgspec
import trio

from gatewayd.audit.chain import Chain
from gatewayd.protocol import HEADER, Request, encode_response, ok_response

# As gatewayd's server reads: a frame header and a page of body per read at most.
RECV_CHUNK: Final = 64 * 1024
LISTEN_BACKLOG: Final = 1024
_PEERCRED: Final = struct.Struct("3i")
# What time.now answers, near enough in size: the floor runs no tool.
VALUE_BYTES: Final = b'{"unixNs":1764230400000000000,"iso":"2025-11-27T08:00:00.000000Z"}'
VALUE: Final = msgspec.Raw(VALUE_BYTES)


class Flusher:
    """Group commit: one thread writes and syncs every line queued since its last
    flush, then tells trio once (``run_sync_soon``) for all the waiters of that flush."""

    def __init__(self, fd: int, token: trio.lowlevel.TrioToken) -> None:
        self._fd = fd
        self._token = token
        self._lock = threading.Lock()
        self._pending: list[bytes] = []
        self._queued = 0  # lines handed over (trio's)
        self._doorbell = threading.Lock()
        self._doorbell.acquire()
        self.durable = 0  # lines durable (trio's, set by the flush callback)
        self._flushed = trio.Event()
        self._thread = threading.Thread(target=self._loop, name="floor-flusher", daemon=True)
        self._thread.start()

    def queue(self, *lines: bytes) -> int:
        """Hand sealed lines over; returns the count the caller waits for."""
        with self._lock:
            ring = not self._pending
            self._pending.extend(lines)
        if ring:
            with contextlib.suppress(RuntimeError):  # rung already
                self._doorbell.release()
        self._queued += len(lines)
        return self._queued

    async def wait(self, count: int) -> None:
        while self.durable < count:
            await self._flushed.wait()

    def _loop(self) -> None:
        written = 0
        while True:
            self._doorbell.acquire()
            with self._lock:
                batch, self._pending = self._pending, []
            if not batch:
                continue
            data = b"".join(batch)
            while data:
                data = data[os.write(self._fd, data) :]
            os.fdatasync(self._fd)
            written += len(batch)
            self._token.run_sync_soon(self._on_flushed, written)

    def _on_flushed(self, written: int) -> None:
        self.durable = written
        self._flushed.set()
        self._flushed = trio.Event()


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Conn:
    """One connection: its socket, its unparsed bytes, and its credentials (read once,
    as gatewayd does; they are in every call entry)."""

    __slots__ = ("buf", "peer", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        pid, uid, gid = _PEERCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        )
        self.peer = {"pid": pid, "uid": uid, "gid": gid}


def take(conn: Conn, data: bytes, chain: Chain, flusher: Flusher) -> tuple[bytes, int]:
    """The answers to the whole frames ``data`` completes, and the count of lines to
    wait for (0: none)."""
    buf = conn.buf + data
    answers: list[bytes] = []
    count = 0
    while len(buf) >= HEADER.size:
        (size,) = HEADER.unpack_from(buf)
        if len(buf) < HEADER.size + size:
            break
        body, buf = buf[HEADER.size : HEADER.size + size], buf[HEADER.size + size :]
        req = msgspec.json.decode(body, type=Request)
        _, _, call = chain.append(
            "call",
            {
                "runId": req.runId,
                "toolCallId": req.toolCallId,
                "tool": req.tool,
                "argsDigest": _digest(msgspec.json.encode(req.args)),
                "decision": "allow",
                "peer": conn.peer,
            },
        )
        _, _, result = chain.append(
            "result",
            {
                "runId": req.runId,
                "toolCallId": req.toolCallId,
                "tool": req.tool,
                "durationMs": 0.0,
                "outputDigest": _digest(VALUE_BYTES),
                "outputBytes": len(VALUE_BYTES),
            },
        )
        count = flusher.queue(call, result)
        answers.append(encode_response(ok_response(req.toolCallId, VALUE)))
    conn.buf = buf
    return b"".join(answers), count


async def serve(
    epoll: select.epoll, conns: dict[int, Conn], chain: Chain, flusher: Flusher
) -> None:
    """Read every readable connection, take its calls; a second task answers each pass
    once its lines are durable."""
    passes: collections.deque[tuple[int, list[tuple[int, bytes]]]] = collections.deque()
    taken = trio.Event()

    async def answer() -> None:
        nonlocal taken
        while True:
            while not passes:
                await taken.wait()
                taken = trio.Event()
            count, out = passes.popleft()
            await flusher.wait(count)
            for fd, data in out:
                with contextlib.suppress(OSError):
                    os.write(fd, data)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(answer)
        while True:
            await trio.lowlevel.wait_readable(epoll.fileno())
            out: list[tuple[int, bytes]] = []
            count = 0
            for fd, _ in epoll.poll(0):
                conn = conns.get(fd)
                if conn is None:
                    continue
                try:
                    data = os.read(fd, RECV_CHUNK)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    epoll.unregister(fd)
                    del conns[fd]
                    conn.sock.close()
                    continue
                answers, upto = take(conn, data, chain, flusher)
                if answers:
                    out.append((fd, answers))
                    count = upto
            if out:
                passes.append((count, out))
                taken.set()


async def main(path: str, audit_file: str) -> None:
    fd = os.open(audit_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    flusher = Flusher(fd, trio.lowlevel.current_trio_token())
    chain = Chain()
    epoll = select.epoll()
    conns: dict[int, Conn] = {}
    listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await listener.bind(path)
    listener.listen(LISTEN_BACKLOG)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve, epoll, conns, chain, flusher)
        while True:
            accepted, _ = await listener.accept()
            sock = socket.socket(fileno=accepted.detach())
            sock.setblocking(False)
            conn = Conn(sock)
            conns[sock.fileno()] = conn
            epoll.register(sock.fileno(), select.EPOLLIN)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    trio.run(main, sys.argv[1], sys.argv[2])
