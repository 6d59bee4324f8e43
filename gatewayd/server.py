"""trio listeners for run sockets: a thin adapter that moves bytes to and from the
sans-IO protocol and hands requests to the dispatcher.

A call that needs no wait on its way (no I/O: ``tools.list``, ``time.now``, a refusal;
:meth:`Dispatcher.handle_now`) is taken through the chokepoint without a task of its
own, and the answers of the calls taken together leave together once their shared
audit flush is durable; any other call gets a task of its own, so it never holds up
the calls behind it. A connection with nothing of its client's pending, of a run with
more than one connection open, waits in its run's :class:`Multiplexer`, which takes the
calls of every such connection that is readable in one pass and answers them after one
flush wait; whatever it does not take goes back to the connection's own task. The
socket is read directly (non-blocking reads and ``trio.lowlevel.wait_readable``):
trio's stream classes cost more per read than the rest of the loop.

Resource handling: every connection is owned by its run's nursery and every call that
waits by its connection's nursery; a handler catches its own errors and closes its
stream in ``finally``, so one bad client or one bad run never takes the daemon down.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import select
import socket
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Final

import structlog
import trio

from gatewayd.audit import AuditEvent, AuditWriteError, Peer
from gatewayd.dispatch import Answered, Dispatcher
from gatewayd.protocol import (
    NEED_DATA,
    ErrorCode,
    Event,
    FrameDecoder,
    FrameError,
    RequestReceived,
    Response,
    encode_response,
    error_response,
)
from gatewayd.runs import Run, RunState

if TYPE_CHECKING:
    from gatewayd.sandbox.session import RunSandbox

log = structlog.get_logger("gatewayd.server")

# A connection with no frame in progress may stay open this long: agents keep one
# connection for a whole run but may think for minutes between calls.
IDLE_TIMEOUT_S: Final = 300.0
# Once a frame's first byte arrives, the rest must follow within this: a client
# that dribbles bytes (slowloris) loses its connection, not the daemon's memory.
FRAME_TIMEOUT_S: Final = 10.0
# A client that does not read its responses is dropped after this.
SEND_TIMEOUT_S: Final = 30.0
# How often a run's connections are looked at for a wait for their client that ran past
# its time (IDLE_TIMEOUT_S, FRAME_TIMEOUT_S): so each of those is kept to within this
# much. A sweep instead of a deadline on each wait: moving a cancel scope's deadline
# twice per call (before the wait, and back after it) cost more than the rest of the
# server's work on the call.
IDLE_SWEEP_S: Final = 1.0
# Requests one connection may have in flight before we stop reading from it.
MAX_INFLIGHT_PER_CONNECTION: Final = 32
# One read takes at most this much: a full frame header plus a page of body, so a
# fast client is served in few reads without one read holding megabytes.
RECV_CHUNK: Final = 64 * 1024
# Connections one run may hold open at once. An agent needs a handful (one per
# process that calls cogni-tool); each idle one costs a file descriptor and, while
# a frame is half-sent, up to a frame of memory.
MAX_CONNECTIONS_PER_RUN: Final = 64
# After a fatal frame error: how long, and how much, to read and discard before
# closing, so the client reads our error frame instead of a connection reset.
LINGER_S: Final = 1.0
LINGER_MAX_BYTES: Final = 4 << 20
# Pause after a failed accept (e.g. EMFILE) so a full fd table does not spin the loop.
ACCEPT_RETRY_S: Final = 0.05
# Connections the kernel queues before gatewayd accepts them (capped by the kernel's
# net.core.somaxconn, 4096 here). The control socket sees bursts: hundreds of runs
# created at once made a non-blocking client's connect fail with EAGAIN at 128.
LISTEN_BACKLOG: Final = 1024
# Refused connections of one run: one audit entry per error code per second at most (the
# next counts those left out), and this many may linger for their client to read the
# error, so a connect loop can neither fill the audit disk nor the descriptor table.
REFUSAL_AUDIT_INTERVAL_S: Final = 1.0
MAX_LINGERING_REFUSALS: Final = 8
# A sandboxed run's socket: root-owned, the run's group (its uid's) may connect.
RUN_SOCKET_MODE: Final = 0o660

_PEERCRED: Final = struct.Struct("3i")


def peer_credentials(sock: trio.socket.SocketType) -> Peer:
    """The pid, uid and gid of the process that connected (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return Peer(pid=pid, uid=uid, gid=gid)


async def open_unix_listener(
    path: Path, *, mode: int = 0o600, group: int | None = None
) -> trio.SocketListener:
    """Listen on a fresh unix socket at ``path`` (which must not exist).

    The socket is bound under a temporary name, given its group and mode, set listening,
    and only then linked into place: a client that sees ``path`` can connect at once,
    and never finds it with the wrong permissions. A link, not a rename: a rename would
    replace whatever appeared at ``path`` (another daemon's socket, a log file).

    Error handling: FileExistsError when ``path`` exists; nothing there is touched.
    """
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    await trio.lowlevel.checkpoint()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # Bound here, as the chown, chmod and link below are made, not in a worker thread
        # as trio's bind is (the hand-off there and back was about 0.5 ms of every run's
        # start, for one short system call in gatewayd's own directory).
        sock.bind(os.fspath(staging))
        if group is not None:
            os.chown(staging, -1, group)
        os.chmod(staging, mode)
        sock.listen(LISTEN_BACKLOG)
        os.link(staging, path)
        os.unlink(staging)
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
    except BaseException:
        sock.close()
        staging.unlink(missing_ok=True)
        raise
    return listener


class Connection:
    """One client connection to a run's socket."""

    def __init__(
        self,
        stream: trio.SocketStream,
        run: Run,
        dispatcher: Dispatcher,
        *,
        max_frame_bytes: int,
        multiplexer: Multiplexer | None = None,
    ) -> None:
        self.stream = stream
        self.run = run
        self.dispatcher = dispatcher
        self.decoder = FrameDecoder(max_frame_bytes)
        self._multiplexer = multiplexer
        self.peer = peer_credentials(stream.socket)
        # Held only by a send that has to wait for the client to read; see _send. A
        # semaphore, not a lock: the multiplexer's task takes it when it starts the
        # outbox and the outbox's task gives it back (see _to_outbox).
        self._send_lock = trio.Semaphore(1, max_value=1)
        # Calls in flight, and the event the reader waits on when they reach the cap (a
        # counter, not a trio.Semaphore: the common case then costs no schedule point).
        self._inflight = 0
        self._slot_freed: trio.Event | None = None
        # The toolCallIds of those calls: one id is in flight once per connection.
        self._inflight_ids: set[str] = set()
        # Calls answered on this task without a wait (Dispatcher.handle_now), counted in
        # flight until their answers leave: after the frames of one read, one wait for
        # the audit flush they share, then their answers.
        self._ready: list[Answered] = []
        # Did the last read leave the socket empty (it took less than it asked for)?
        # Then the next receive waits for the socket first instead of reading it: a
        # client that waits for its answers has sent nothing since, and a read that
        # finds nothing is a system call (and a hand-off of the interpreter) for naught.
        self._drained = False
        # While a receive waits for the client: when (trio's clock) that wait has run
        # past its time; infinity otherwise. The run's sweeper (_sweep_idle) cancels
        # the connection's cancel scope once it is past.
        self.waiting_until = math.inf
        self._idle: trio.CancelScope | None = None
        # While parked in the run's multiplexer (see _park): set when it hands the
        # connection back to this task, with what the task must do first: the event the
        # multiplexer decoded but does not take, or the error the multiplexer met.
        self._handed_back: trio.Event | None = None
        self._pushed_back: RequestReceived | FrameError | None = None
        self._multiplexer_error: Exception | None = None
        # The nursery of the connection's calls (while it serves), where the outbox's
        # task runs.
        self._calls: trio.Nursery | None = None
        # Answers of the multiplexer's waiting to be sent, in order, by one task of the
        # connection's (None: no such task; see _to_outbox), each with the calls it
        # settles once sent.
        self._outbox: collections.deque[tuple[bytes, list[Answered]]] | None = None
        self.parked_fd = -1  # the descriptor the multiplexer waits for (-1: none)
        # Answers the multiplexer took for this connection and has not sent yet, and
        # the handed-back task's wait for them: so every answer taken before a
        # hand-back leaves before anything the task sends or does next (an EOF's close).
        self.held = 0
        self._none_held: trio.Event | None = None
        self._park_next = True  # False: the last park was handed back; read here first

    def expire(self) -> None:
        """The sweeper found this connection's wait for its client past its time."""
        if self._idle is not None:
            self._idle.cancel()

    async def serve(self) -> None:
        """Read frames until EOF, a fatal frame error or a timeout; answer each."""
        try:
            # except*: the read loop's errors leave the calls' nursery as a group (a
            # client dropped at the send timeout is found closed by the next read).
            try:
                async with trio.open_nursery() as calls:
                    self._calls = calls
                    try:
                        await self._read_loop(calls)
                    finally:
                        self._calls = None
                        # Answers left unsent by a cancelled or failed loop still count.
                        self.dispatcher.drop(self._ready)
                        self._ready = []
            except* (trio.BrokenResourceError, trio.ClosedResourceError) as gone:
                # The client went away (or was dropped): its calls were audited as they
                # ran. Said at info level, with why, for the operator.
                log.info(
                    "connection_dropped",
                    run_id=self.run.run_id,
                    peer_pid=self.peer.pid,
                    reason=str(gone.exceptions[0]),
                )
        except Exception:
            log.exception("connection_failed", run_id=self.run.run_id, peer_pid=self.peer.pid)
        finally:
            await trio.aclose_forcefully(self.stream)

    async def _read_loop(self, calls: trio.Nursery) -> None:
        # One cancel scope for the connection, cancelled by the run's sweeper when a
        # receive has waited for the client past its time (see _receive: the time is
        # set only while it waits). Anything else the loop waits for (a free call slot,
        # the answers' flush, an error frame's send) runs with no time limit here: that
        # is not the client idling, and the send has its own timeout.
        partial_since: float | None = None
        with trio.CancelScope() as idle:
            self._idle = idle
            while True:
                event: Event
                if self._pushed_back is not None:
                    event, self._pushed_back = self._pushed_back, None
                else:
                    event = self.decoder.next_event()
                if event is NEED_DATA:
                    if self._ready:  # every frame read so far is taken: answer them
                        await self._release_ready()
                    if not self._park_next:
                        self._park_next = True
                    elif (
                        self._multiplexer is not None
                        and self._multiplexer.shared
                        and self.dispatcher.answers_at_once(self.run)
                        and partial_since is None
                        and not self.decoder.buffered
                        and not self._inflight
                    ):
                        # Nothing of the client's is pending here, and another
                        # connection of the run is open: wait for it in the run's
                        # multiplexer, which serves the calls that need no wait without
                        # this task; anything else comes back to this loop. (A lone
                        # connection reads its own socket: one task fewer per call.)
                        await self._park()
                        continue
                    if partial_since is not None:
                        deadline = partial_since + FRAME_TIMEOUT_S
                    elif self.decoder.buffered:
                        partial_since = trio.current_time()
                        deadline = partial_since + FRAME_TIMEOUT_S
                    else:
                        deadline = trio.current_time() + IDLE_TIMEOUT_S
                    data = await self._receive(idle, deadline)
                    if not data:
                        return  # EOF or reset: the nursery still waits for calls in flight
                    self.decoder.receive_data(data)
                    continue
                partial_since = None
                if isinstance(event, FrameError):
                    await self._release_ready()
                    response = await self.dispatcher.refuse_frame(self.run, event, self.peer)
                    await self._send(response)
                    if event.fatal or response.errorCode is ErrorCode.RATE_LIMITED:
                        await self._linger()
                        return
                    # A chunk full of bad frames must not hold the event loop.
                    await trio.lowlevel.checkpoint()
                    continue
                call_id = event.request.toolCallId
                if call_id in self._inflight_ids:
                    # Two answers with one id could not be told apart: the second call
                    # is refused (and audited); the first goes on.
                    # The first call's answer leaves first: the client reads the two
                    # in the order it sent them.
                    await self._release_ready()
                    duplicate = FrameError(
                        code=ErrorCode.BAD_REQUEST,
                        message=f"toolCallId {call_id!r} is already in flight on this "
                        "connection; give each call its own id",
                        tool_call_id=call_id,
                        fatal=False,
                    )
                    await self._send(
                        await self.dispatcher.refuse_frame(self.run, duplicate, self.peer)
                    )
                    await trio.lowlevel.checkpoint()
                    continue
                if self._inflight >= MAX_INFLIGHT_PER_CONNECTION:
                    await self._release_ready()
                    while self._inflight >= MAX_INFLIGHT_PER_CONNECTION:
                        self._slot_freed = trio.Event()
                        await self._slot_freed.wait()
                self._inflight += 1
                self._inflight_ids.add(call_id)
                # A call that needs no wait is taken through every step here, saving a
                # task per call; any other runs in a task of its own, so a slow call
                # never holds up the calls behind it.
                answered = self.dispatcher.handle_now(self.run, event.request, self.peer)
                if answered is None:
                    calls.start_soon(self._call, event)
                else:
                    self._ready.append(answered)
        log.info(
            "connection_timeout",
            run_id=self.run.run_id,
            partial_frame=partial_since is not None,
        )

    async def refuse_over_limit(self, throttle: RefusalThrottle) -> None:
        """Answer a connection over the run's limit with one error frame, then close it."""
        await self.refuse(
            throttle,
            ErrorCode.RATE_LIMITED,
            f"this run already has {MAX_CONNECTIONS_PER_RUN} open connections to gatewayd; "
            "reuse a connection (cogni-tool's Client keeps one) or close idle ones",
        )

    async def refuse_outsider(self, throttle: RefusalThrottle) -> None:
        """Answer a peer outside the run's sandbox and close."""
        await self.refuse(
            throttle,
            ErrorCode.AUTHZ_DENIED,
            "this socket serves only processes inside its run's sandbox (its network "
            "namespace); start the command with `gatewayd exec RUN -- CMD` instead",
        )

    async def refuse(self, throttle: RefusalThrottle, code: ErrorCode, message: str) -> None:
        """Audit a refused connection, answer it with one error frame, then close it.

        An audited refusal is answered once its ``connection_refused`` entry is durable
        (invariant RESULT_BEFORE_REPLY; at once with the operator's opt-out), or, when
        the log cannot take it, with ``internal``.

        A flood of refused connections (a sandbox connecting in a loop) must neither fill
        the audit log nor hold the daemon's descriptors: ``throttle`` audits at most one
        refusal per code per second per run (the next entry counts the ones left out:
        those are answered at once, with no entry of their own to wait for), and lets
        only a few refused connections linger for their client to read the error; the
        rest are answered and closed at once.
        """
        now = trio.current_time()
        suppressed = throttle.admit(str(code), now)
        answer = error_response(None, code, message)
        lingering = throttle.lingering < MAX_LINGERING_REFUSALS
        throttle.lingering += lingering
        try:
            if suppressed is not None:
                answer = await self._audit_refusal(answer, code, message, suppressed)
            with contextlib.suppress(
                trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError
            ):
                with trio.fail_after(LINGER_S):
                    await self._send(answer)
                if lingering:
                    await self._linger()
        finally:
            throttle.lingering -= lingering
            await trio.aclose_forcefully(self.stream)

    async def _audit_refusal(
        self, answer: Response, code: ErrorCode, message: str, suppressed: int
    ) -> Response:
        """Record a refused connection's entry; ``answer`` once it is durable, or an
        ``internal`` answer when the log cannot take it."""
        log.warning(
            "connection_refused",
            run_id=self.run.run_id,
            peer_pid=self.peer.pid,
            code=str(code),
            suppressed=suppressed,
        )
        audit = self.dispatcher.audit
        seq = audit.record(
            "event",
            event=AuditEvent.CONNECTION_REFUSED,
            runId=self.run.run_id,
            errorCode=str(code),
            safeMessage=message,
            peer=self.peer,
            detail={"suppressedSinceLast": suppressed} if suppressed else None,
        )
        if not self.dispatcher.reply_after_result:
            return answer
        try:
            await audit.durable(seq)
        except AuditWriteError as exc:
            log.error("audit_unavailable", run_id=self.run.run_id, error=exc.detail)
            return error_response(None, ErrorCode.INTERNAL, str(exc))
        return answer

    async def _linger(self) -> None:
        """Half-close and drain briefly: closing with unread input would reset the
        connection, and the client could lose the error frame we just sent."""
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            await self.stream.send_eof()
            drained = 0
            with trio.move_on_after(LINGER_S):
                while drained < LINGER_MAX_BYTES:
                    data = await self.stream.receive_some(RECV_CHUNK)
                    if not data:
                        break
                    drained += len(data)

    async def _park(self) -> None:
        """Wait in the run's multiplexer until it hands this connection back: the client
        sent what the multiplexer does not take (see :meth:`take_readable`), went away,
        or stayed silent past IDLE_TIMEOUT_S (the sweeper cancels the wait). Raises
        what the multiplexer met while taking this connection's calls."""
        assert self._multiplexer is not None
        handed_back = self._handed_back = trio.Event()
        self._multiplexer.park(self)
        self.waiting_until = trio.current_time() + IDLE_TIMEOUT_S
        try:
            await handed_back.wait()
            while self.held:
                self._none_held = trio.Event()
                await self._none_held.wait()
        finally:
            self.waiting_until = math.inf
            self._multiplexer.unpark(self)
            self._handed_back = None
            self._park_next = False
        error, self._multiplexer_error = self._multiplexer_error, None
        if error is not None:
            raise error

    def hand_back(self) -> None:
        """The multiplexer is done with this connection: its task goes on, and reads
        the socket itself once before it parks again."""
        if self._multiplexer is not None:
            self._multiplexer.unpark(self)
        if self._handed_back is not None:
            self._handed_back.set()

    def take_readable(self, fd: int) -> bool:
        """The multiplexer found the socket readable: read it and take each whole frame
        through :meth:`Dispatcher.handle_now` as the read loop would. Returns whether
        the connection stays parked with answers to release (``_ready``); hands it back
        (returns False) at anything else: a frame error, a call that needs its own task
        or a free slot, a duplicate id, a partial frame, EOF or a failed read. ``fd``:
        the socket's descriptor, as parked (a parked connection's stream is open: only
        a task of its own closes it, and the multiplexer hands it back first)."""
        if fd != self.parked_fd:  # not parked on this descriptor: never read another's
            self.hand_back()
            return False
        try:
            data = os.read(fd, RECV_CHUNK)
        except BlockingIOError:
            return False
        except OSError:
            self.hand_back()  # the task's own read meets it again, as EOF or an error
            return False
        if not data:
            self.hand_back()
            return False
        self._drained = len(data) < RECV_CHUNK
        self.decoder.receive_data(data)
        while True:
            event = self.decoder.next_event()
            if event is NEED_DATA:
                break
            if (
                isinstance(event, FrameError)
                or event.request.toolCallId in self._inflight_ids
                or self._inflight >= MAX_INFLIGHT_PER_CONNECTION
            ):
                self._pushed_back = event
                self.hand_back()
                return False
            answered = self.dispatcher.handle_now(self.run, event.request, self.peer)
            if answered is None:
                self._pushed_back = event
                self.hand_back()
                return False
            self._inflight += 1
            self._inflight_ids.add(event.request.toolCallId)
            self._ready.append(answered)
        if self.decoder.buffered:  # a partial frame: the task keeps its time
            self.hand_back()
            return False
        if not self._ready:
            return False
        # Waiting for the answers' flush is not the client idling: its idle time starts
        # once they left (answer_parked).
        self.waiting_until = math.inf
        return True

    def answer_parked(self, responses: list[Response], taken: list[Answered]) -> None:
        """Send the answers the multiplexer released for this connection. A frame the
        socket does not take at once, and every answer after it, goes to the
        connection's outbox, sent in order by one task of the connection's (under the
        send lock, within SEND_TIMEOUT_S), and the connection is handed back: its task
        reads no more of the client's calls until the outbox is empty, as when it sends
        its own answers. Every frame is encoded before the first is written (an
        encoding that fails writes nothing and settles nothing: the caller fails the
        connection)."""
        frames = [encode_response(response) for response in responses]
        try:
            for at, data in enumerate(frames):
                free = self._outbox is None and self._send_lock.value
                sent = self._send_nowait(data) if free else 0
                if sent < len(data):
                    if self._to_outbox(b"".join((data[sent:], *frames[at + 1 :])), taken):
                        self.hand_back()
                        return  # the outbox's task settles them
                    break
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client went away; its calls were audited as they ran
        self.settle_held(taken)

    def settle_held(self, taken: list[Answered]) -> None:
        """The multiplexer is done with answers it took here: sent, handed to a send,
        or failed. They leave the calls in flight; the task, if handed back, goes on
        once none is held (see :meth:`_park`)."""
        self._answered(taken)
        self.held -= len(taken)
        if not self.held and self._none_held is not None:
            self._none_held.set()
            self._none_held = None
        if self.parked_fd != -1 and not self._inflight:
            self.waiting_until = trio.current_time() + IDLE_TIMEOUT_S

    def _to_outbox(self, rest: bytes, taken: list[Answered]) -> bool:
        """Queue ``rest`` (a frame's remainder, or whole frames) to be sent after what
        the outbox holds, by its one task, which then settles ``taken``. The send lock
        is taken now when free, so no other frame lands in the middle of a frame begun
        here. False: the connection is ending (its nursery takes no task) and nothing
        was queued."""
        if self._outbox is not None:
            self._outbox.append((rest, taken))
            return True
        calls = self._calls
        if calls is None:
            return False
        holding = bool(self._send_lock.value)
        if holding:
            self._send_lock.acquire_nowait()
        outbox = self._outbox = collections.deque([(rest, taken)])

        async def drain() -> None:
            try:
                if not holding:
                    await self._send_lock.acquire()
                try:
                    while outbox:
                        data, settled = outbox[0]
                        # A client gone away: its calls were audited as they ran.
                        with contextlib.suppress(
                            trio.BrokenResourceError, trio.ClosedResourceError
                        ):
                            await self._send_rest(data)
                        outbox.popleft()
                        self.settle_held(settled)
                finally:
                    self._send_lock.release()
            finally:
                self._outbox = None
                for _, settled in outbox:  # cancelled: never to be sent
                    self.settle_held(settled)
                outbox.clear()

        try:
            calls.start_soon(drain)
        except RuntimeError:  # its nursery closes: the connection is ending
            self._outbox = None
            if holding:
                self._send_lock.release()
            return False
        return True

    async def _receive(self, idle: trio.CancelScope, deadline: float) -> bytes:
        """The next bytes from the client; b"" at EOF or when it reset the connection.

        The socket is read directly, as trio's stream would, minus its layers: a read
        that has data yields to the other tasks once (so a flooding client cannot hold
        the event loop) without losing the data to a cancellation; one that has none
        waits until the socket is readable, for at most until ``deadline`` (the run's
        sweeper cancels ``idle`` once the wait is past it, within IDLE_SWEEP_S). After
        a read that emptied the socket it waits first, without reading. A ``deadline``
        already past cancels ``idle`` before any read.

        Error handling: ClosedResourceError once the connection was closed here (a send
        that timed out), BrokenResourceError for another failed read.
        """
        sock = self.stream.socket
        if deadline <= trio.current_time():  # a partial frame's time ran out
            idle.cancel()
        await trio.lowlevel.checkpoint_if_cancelled()
        waited = False
        try:
            if self._drained and sock.fileno() != -1:
                self.waiting_until = deadline
                await trio.lowlevel.wait_readable(sock)
                waited = True
            while True:
                fd = sock.fileno()
                if fd == -1:  # closed by a send that timed out: never read a reused number
                    raise trio.ClosedResourceError("the connection was closed")
                try:
                    data = os.read(fd, RECV_CHUNK)
                except BlockingIOError:
                    self.waiting_until = deadline
                    await trio.lowlevel.wait_readable(sock)
                    waited = True
                    continue
                except ConnectionResetError:
                    return b""
                except OSError as exc:
                    raise trio.BrokenResourceError(f"reading a request failed: {exc}") from exc
                self._drained = len(data) < RECV_CHUNK
                if not waited:
                    await trio.lowlevel.cancel_shielded_checkpoint()
                return data
        finally:
            self.waiting_until = math.inf

    async def _release_ready(self) -> None:
        """Send the answers of the calls taken here without a wait, once their entries
        are durable (one wait for all of them)."""
        ready, self._ready = self._ready, []
        if not ready:
            return
        try:
            responses = await self.dispatcher.release(ready)
            # try/except, not contextlib.suppress: this is on every call's path, and a
            # try costs nothing when nothing is raised.
            try:
                for response in responses:
                    await self._send(response)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the client went away; its calls were audited as they ran
        finally:
            self._answered(ready)

    def _answered(self, answered: list[Answered]) -> None:
        """Calls answered at once (sent, or never to be) leave the calls in flight."""
        self._inflight -= len(answered)
        for one in answered:
            self._inflight_ids.discard(one.call_id)
        self._free_slot()

    async def _call(self, event: RequestReceived) -> None:
        try:
            response = await self.dispatcher.handle(
                self.run, event.request, self.peer, caller_gone=self._client_gone
            )
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await self._send(response)
        finally:
            self._inflight -= 1
            self._inflight_ids.discard(event.request.toolCallId)
            self._free_slot()

    def _free_slot(self) -> None:
        if self._slot_freed is not None:
            self._slot_freed.set()
            self._slot_freed = None

    def _client_gone(self) -> bool:
        """Has the client closed its end of the connection (or has it been closed here)?
        Asked while a call waits for approval. A client's half-close (shutdown of its
        writing side) is not leaving: it may still read the answer; a full close is, and
        the kernel reports it as POLLHUP on a unix stream socket."""
        fd = self.stream.socket.fileno()
        if fd == -1:
            return True
        poller = select.poll()
        poller.register(fd, 0)  # POLLHUP, POLLERR and POLLNVAL are always reported
        return bool(poller.poll(0))

    async def _send(self, response: Response) -> None:
        """Send one framed response; drop the client if it does not read for SEND_TIMEOUT_S.

        A response usually fits the socket buffer, so when no other send is waiting it
        is written at once without waiting (and so without a timeout to arm). Whatever
        does not fit is sent under the lock, with the timeout, before any other frame.
        """
        data = encode_response(response)
        if self._send_lock.value:  # free: no other send waits
            sent = self._send_nowait(data)
            if sent == len(data):
                return
            # Part of a frame is out: hold the lock (no await since the write, so it is
            # free) until the rest follows, so no other frame lands in the middle.
            self._send_lock.acquire_nowait()
            try:
                await self._send_rest(data[sent:])
            finally:
                self._send_lock.release()
            return
        async with self._send_lock:
            await self._send_rest(data)

    def _send_nowait(self, data: bytes) -> int:
        """Write what the socket takes now, without waiting; returns the bytes written."""
        fd = self.stream.socket.fileno()
        if fd == -1:  # closed by a send that timed out: never write to a reused number
            raise trio.ClosedResourceError("the connection was closed")
        try:
            return os.write(fd, data)
        except BlockingIOError:
            return 0
        except OSError as exc:  # EPIPE, ECONNRESET: the client went away
            raise trio.BrokenResourceError(f"sending a response failed: {exc}") from exc

    async def _send_rest(self, data: bytes) -> None:
        with trio.move_on_after(SEND_TIMEOUT_S) as scope:
            await self.stream.send_all(data)
        if scope.cancelled_caught:
            log.info("client_not_reading", run_id=self.run.run_id, peer_pid=self.peer.pid)
            await trio.aclose_forcefully(self.stream)


class Multiplexer:
    """Two tasks per run that serve the calls of all of its parked connections: one
    waits for every parked connection at once (a private epoll, itself waited for with
    ``trio.lowlevel.wait_readable``), reads those that are readable and takes the calls
    that need no wait through the dispatcher; the other waits for the audit flush each
    such batch needs and sends its answers, while the first goes on reading. Under load
    that is one wake-up and one flush wait for the calls of many connections, where a
    task per connection costs two of each per call.

    A connection is parked only while nothing of its client's is pending and another
    connection of the run is open (:meth:`Connection._park`); anything else (a frame
    error, a call that needs a task of its own, a partial frame, EOF) is handed back to
    the connection's own task, and an answer the socket does not take at once is
    finished by a task of the connection's.

    Resource handling: the epoll is made at the first park and closed while unused
    (:meth:`close_if_unused`) or at the context manager's exit; connections unpark
    themselves as their tasks leave the wait, cancelled or handed back. Answers
    never sent (the run ended first) are tallied, as a connection's own are. A batch
    whose release fails (a bug) fails the connections it answers, not the run."""

    def __init__(self, dispatcher: Dispatcher, serving: set[Connection]) -> None:
        self._dispatcher = dispatcher
        self._serving = serving  # the run's connections being served
        # Made at the first park and closed once no connection is parked and the run
        # has one connection or none (a descriptor per run only while it is of use: a
        # daemon's descriptors bound how many runs it holds), and the take loop's
        # wake-up while there is none.
        self._epoll: select.epoll | None = None
        self._epoll_made = trio.Event()
        self._parked: dict[int, Connection] = {}
        # Batches taken and not yet answered, oldest first (their entries are in seq
        # order, so each flush wait releases them in order), and the releaser's wake-up
        # while it waits for one.
        self._batches: collections.deque[list[tuple[Connection, list[Answered]]]] = (
            collections.deque()
        )
        self._batch_taken: trio.Event | None = None

    @property
    def shared(self) -> bool:
        """Does the run have more than one connection? Only then is waiting here cheaper
        than a connection's own wait: with one, the multiplexer's pass is a task step
        more per call."""
        return len(self._serving) > 1

    def park(self, conn: Connection) -> None:
        fd = conn.stream.socket.fileno()
        if fd == -1:
            conn.hand_back()
            return
        if self._epoll is None:
            self._epoll = select.epoll()
            self._epoll_made.set()
        self._epoll.register(fd, select.EPOLLIN)
        self._parked[fd] = conn
        conn.parked_fd = fd

    def unpark(self, conn: Connection) -> None:
        fd, conn.parked_fd = conn.parked_fd, -1
        if fd != -1 and self._parked.get(fd) is conn:
            del self._parked[fd]
            if self._epoll is not None:
                with contextlib.suppress(OSError):  # closed by now: epoll forgot it
                    self._epoll.unregister(fd)
        self.close_if_unused()

    def close_if_unused(self) -> None:
        """Close the epoll when no connection is parked and the run has at most one
        (called as connections unpark and leave)."""
        epoll = self._epoll
        if epoll is None or self._parked or self.shared:
            return
        self._epoll = None
        self._epoll_made = trio.Event()
        trio.lowlevel.notify_closing(epoll.fileno())  # the take loop's wait ends
        epoll.close()

    def __enter__(self) -> Multiplexer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._epoll is not None:
            self._epoll.close()
            self._epoll = None

    async def run(self) -> None:
        """Serve the parked connections until cancelled (the run's serving ends)."""
        async with trio.open_nursery() as tasks:
            tasks.start_soon(self._release_loop)
            await self._take_loop()

    async def _take_loop(self) -> None:
        audit = self._dispatcher.audit
        while True:
            epoll = self._epoll
            if epoll is None:
                await self._epoll_made.wait()
                continue
            try:
                await trio.lowlevel.wait_readable(epoll.fileno())
            except trio.ClosedResourceError:
                continue  # closed while unused (close_if_unused)
            if epoll is not self._epoll:
                continue  # closed after it became readable: nothing parked there
            batch: list[tuple[Connection, list[Answered]]] = []
            for fd, _ in epoll.poll(0):
                conn = self._parked.get(fd)
                if conn is None:  # not parked (any more): never wake for it again
                    with contextlib.suppress(OSError, ValueError):  # ValueError: closed
                        epoll.unregister(fd)
                    continue
                try:
                    if conn.take_readable(fd):
                        # The multiplexer's now: the releaser answers and tallies them.
                        batch.append((conn, conn._ready))
                        conn.held += len(conn._ready)
                        conn._ready = []
                except Exception as exc:  # the connection's task logs it and closes
                    conn._multiplexer_error = exc
                    conn.hand_back()
            if batch:
                # Flushed now, while the releaser may still wait for an earlier batch.
                audit.flush_soon(max(a.seq for _, ready in batch for a in ready))
                self._batches.append(batch)
                if self._batch_taken is not None:
                    self._batch_taken.set()

    async def _release_loop(self) -> None:
        try:
            while True:
                while not self._batches:
                    self._batch_taken = trio.Event()
                    await self._batch_taken.wait()
                    self._batch_taken = None
                batch = self._batches.popleft()
                settled = 0  # connections whose answers answer_parked took
                try:
                    responses = await self._dispatcher.release(
                        [a for _, ready in batch for a in ready]
                    )
                    at = 0
                    for conn, ready in batch:
                        conn.answer_parked(responses[at : at + len(ready)], ready)
                        settled += 1
                        at += len(ready)
                except Exception as exc:
                    log.exception("multiplexer_release_failed", run_id=batch[0][0].run.run_id)
                    for conn, ready in batch[settled:]:  # their tasks log it and close
                        conn._multiplexer_error = exc
                        conn.hand_back()
                        conn.settle_held(ready)
        finally:
            for batch in self._batches:  # never to be sent: still counted
                self._dispatcher.drop([a for _, ready in batch for a in ready])
            self._batches.clear()


class RefusalThrottle:
    """Per run: when a refused connection is audited, and how many may linger."""

    def leftover(self) -> dict[str, int]:
        """Refusals left out of the audit and not yet counted in an entry."""
        return {code: count for code, count in self._suppressed.items() if count}

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self.lingering = 0

    def admit(self, code: str, now: float) -> int | None:
        """None: leave this refusal out of the audit (it is counted); else audit it, with
        how many were left out since the last audited one."""
        last = self._last.get(code)
        if last is not None and now - last < REFUSAL_AUDIT_INTERVAL_S:
            self._suppressed[code] = self._suppressed.get(code, 0) + 1
            return None
        self._last[code] = now
        return self._suppressed.pop(code, 0)


async def serve_run(
    run: Run,
    dispatcher: Dispatcher,
    *,
    max_frame_bytes: int,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Listen on the run's socket until ``run.cancel_scope`` is cancelled.

    Resource handling: the listener and every connection are closed on exit; the
    socket file is removed with the run's directory by the registry.
    """
    sandbox = run.sandbox
    if sandbox is None:
        listener = await open_unix_listener(run.socket_path)
    else:  # the sandbox runs as the run's uid: its group may connect, nobody else
        listener = await open_unix_listener(
            run.socket_path, mode=RUN_SOCKET_MODE, group=sandbox.user.gid
        )
    throttle = RefusalThrottle()
    try:
        with run.cancel_scope:
            await _accept_loop(
                run, dispatcher, listener, sandbox, throttle, max_frame_bytes, task_status
            )
    finally:
        # Refusals left out of the audit since the last entry are counted, not lost.
        for code, count in throttle.leftover().items():
            dispatcher.audit.record(
                "event",
                event=AuditEvent.CONNECTION_REFUSED,
                runId=run.run_id,
                errorCode=code,
                safeMessage=f"{count} more refused connections, not audited one by one",
                detail={"suppressedSinceLast": count},
            )


async def accept_retrying(
    listener: trio.SocketListener, event: str, run_id: str
) -> trio.SocketStream:
    """The next connection; an accept that fails (e.g. EMFILE) is logged as ``event`` and
    retried shortly, so the connections already open keep being served."""
    while True:
        try:
            return await listener.accept()
        except OSError as exc:
            log.warning(event, run_id=run_id, error=str(exc))
            await trio.sleep(ACCEPT_RETRY_S)


async def _accept_loop(
    run: Run,
    dispatcher: Dispatcher,
    listener: trio.SocketListener,
    sandbox: RunSandbox | None,
    throttle: RefusalThrottle,
    max_frame_bytes: int,
    task_status: trio.TaskStatus[None],
) -> None:
    serving: set[Connection] = set()

    async def serve_one(conn: Connection) -> None:
        serving.add(conn)
        try:
            await conn.serve()
        finally:
            serving.discard(conn)
            multiplexer.close_if_unused()

    with Multiplexer(dispatcher, serving) as multiplexer:
        async with listener, trio.open_nursery() as connections:
            connections.start_soon(_sweep_idle, serving)
            connections.start_soon(multiplexer.run)
            run.move_to(RunState.SERVING)
            task_status.started()
            while True:
                stream = await accept_retrying(listener, "accept_failed", run.run_id)
                try:
                    conn = Connection(
                        stream,
                        run,
                        dispatcher,
                        max_frame_bytes=max_frame_bytes,
                        multiplexer=multiplexer,
                    )
                except OSError:
                    await trio.aclose_forcefully(stream)
                    continue
                if sandbox is not None and not sandbox.owns_peer(conn.peer.pid):
                    connections.start_soon(conn.refuse_outsider, throttle)
                    continue
                if len(serving) >= MAX_CONNECTIONS_PER_RUN:
                    connections.start_soon(conn.refuse_over_limit, throttle)
                    continue
                connections.start_soon(serve_one, conn)


async def _sweep_idle(serving: set[Connection]) -> None:
    """Every IDLE_SWEEP_S: end the connections whose wait for their client ran past its
    time (the idle or partial-frame timeout)."""
    while True:
        await trio.sleep(IDLE_SWEEP_S)
        now = trio.current_time()
        for conn in serving:
            if conn.waiting_until <= now:
                conn.expire()
