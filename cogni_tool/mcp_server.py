"""``cogni-tool mcp``: an MCP server over stdio whose tools are the run's gateway tools.

An MCP client (a coding agent, an IDE assistant, an agent framework) starts
``cogni-tool mcp`` as a subprocess and speaks newline-delimited JSON-RPC 2.0 on its stdin
and stdout. ``tools/list`` is the gateway's ``tools.list`` (without itself): exactly the
tools the run's policy lets it call. Each ``tools/call`` is one gateway call; the
gateway's refusal (``policy_denied``, ``unknown_tool``, ``invalid_args``,
``review_denied``, …) comes back as a tool result with ``isError: true`` and the
gateway's message, never as a protocol error. The messages themselves are
:mod:`cogni_tool.mcp_protocol`'s; this module moves lines and makes calls.
:class:`McpSession` is the streamable HTTP transport's session too
(:mod:`cogni_tool.mcp_http` hands it decoded messages through :meth:`McpSession.receive`),
so both transports answer alike.

Concurrency: the reader (the caller of :meth:`McpSession.receive_line`) never waits for
the gateway, so ``ping`` and ``notifications/cancelled`` are handled while calls run.
Each ``tools/list`` and ``tools/call`` runs in a worker thread (:class:`Workers`: reused,
so a call costs a hand-over, not a thread's start), at most :data:`MAX_CONCURRENT_CALLS`
at the gateway at once, each on a pooled connection (a
:class:`cogni_tool.client.Client` serves one thread at a time).

Cancellation: a cancelled request's answer is dropped, as MCP asks. A call still waiting
for a free connection is never sent; one already at the gateway may still complete
there (and is audited as such): the gateway has no way to take back a call in flight.

Resource handling: at the end of stdin the session stops reading, lets the calls in
flight finish and write their answers (a client that closes its side after the last
request still gets them), then closes its connections. Standard library only.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading

from cogni_tool import __version__
from cogni_tool import mcp_protocol as mcp
from cogni_tool.client import CogniToolError, ToolError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any, BinaryIO, Final, Protocol

    from cogni_tool.mcp_protocol import Json, RequestId

    class GatewayClient(Protocol):
        """What the session needs of a gateway connection (a cogni_tool Client)."""

        def call(self, tool: str, args: dict[str, Any] | None = None) -> Any: ...

        def close(self) -> None: ...


USAGE: Final = """\
usage: cogni-tool mcp [--timeout SECONDS]

Serve the run's gateway tools to an MCP client over stdio (newline-delimited JSON-RPC on
stdin and stdout). An MCP client starts it as a subprocess; see docs/mcp.md.

options:
  --timeout SECONDS   wait at most this long for the gateway's answer to one call
                      (default 3660; 0 waits forever)
"""

# tools/list pages: large enough that a usual run's tools come in one page, small enough
# that a run with hundreds of apps does not answer with one huge line.
TOOLS_PAGE_SIZE: Final = 100

# Calls at the gateway at once. gatewayd allows 64 connections per run and the run's own
# commands and services need some of them.
MAX_CONCURRENT_CALLS: Final = 16

# Requests accepted but not yet answered (running or waiting for a connection). Beyond
# this a client is flooding: the request is refused at once rather than held in a thread.
MAX_PENDING_REQUESTS: Final = 256

# One message line. The gateway reads requests up to 1 MiB; a few MiB leave room for
# JSON escapes and still bound what a runaway client makes this process hold.
MAX_LINE_BYTES: Final = 4 << 20

# What a call may take at the gateway: an app's invocation lasts up to an hour and
# gatewayd's own per-tool limits end calls first; this bounds only a gateway gone silent.
DEFAULT_CALL_TIMEOUT_S: Final = 3660.0
MAX_CALL_TIMEOUT_S: Final = 7 * 24 * 3600.0

# How much of stdin one read takes while skipping an oversized line.
_SKIP_CHUNK: Final = 64 * 1024

# Threads only wait on a socket: a small stack keeps many of them cheap.
THREAD_STACK_BYTES: Final = 512 * 1024

# A worker thread with no request for this long ends: a session that calls in bursts
# keeps its threads between them (starting one costs more than the rest of the hand-over
# of a call to the gateway), an idle one holds none.
WORKER_IDLE_S: Final = 30.0

# Exit statuses, as the rest of cogni-tool's (cogni_tool.client.EXIT_CODES).
EXIT_OK: Final = 0
EXIT_USAGE: Final = 2
EXIT_NO_GATEWAY: Final = 3


class _Call:
    """A request being answered in a worker thread; ``cancelled`` once the client says so."""

    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False


class _Batch:
    """The answers to one JSON-RPC batch, written as one array once all are in.

    ``pending`` starts at one for the batch itself, so the array cannot go out while its
    requests are still being read; :meth:`settle` drops that one.
    """

    def __init__(self, write: Callable[[Any], None]) -> None:
        self._write = write
        self._lock = threading.Lock()
        self._pending = 1
        self._answers: list[Json] = []

    def expect(self) -> None:
        with self._lock:
            self._pending += 1

    def answer(self, response: Json | None) -> None:
        """One request's answer (None: it was cancelled, and has none)."""
        with self._lock:
            if response is not None:
                self._answers.append(response)
            self._pending -= 1
            done = self._pending == 0
        if done:
            self._flush()

    def settle(self) -> None:
        self.answer(None)

    def _flush(self) -> None:
        # A batch of notifications only is answered with nothing (None).
        self._write(self._answers or None)


class Workers:
    """Threads that run jobs, reused: a job goes to an idle worker, or to a new thread
    when none is idle. A worker idle for ``idle_s`` ends.

    Bookkeeping: ``_idle`` is the number of workers waiting for a job less the jobs
    queued for them, so :meth:`submit` starts a thread exactly when no waiting worker is
    left free for its job, and a worker whose wait timed out ends only when another
    waiting worker is free for every queued job. The number of threads is bounded by
    the jobs submitted at once (the session bounds those: :data:`MAX_PENDING_REQUESTS`).
    """

    def __init__(self, idle_s: float = WORKER_IDLE_S) -> None:
        self._idle_s = idle_s
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    @property
    def idle(self) -> int:
        """Workers waiting for a job with none queued for them."""
        with self._lock:
            return self._idle

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` in a worker thread (``job`` must not raise: a worker that fails
        is gone, and its place is taken by a new thread at the next submit)."""
        with self._lock:
            spare = self._idle > 0
            if spare:
                self._idle -= 1
        if spare:
            self._jobs.put(job)
        else:
            threading.Thread(target=self._run, args=(job,), daemon=True).start()

    def _run(self, job: Callable[[], None]) -> None:
        while True:
            job()
            with self._lock:
                self._idle += 1
            while True:
                try:
                    job = self._jobs.get(timeout=self._idle_s)
                    break
                except queue.Empty:
                    with self._lock:
                        if self._idle > 0:  # no queued job counts on this worker
                            self._idle -= 1
                            return


class ClientPool:
    """Gateway connections for one or more sessions: at most ``max_calls`` in use at once,
    each reused once given back. ``connect`` makes a new one when none is idle.

    The stdio server has one session and one pool; the HTTP transport
    (:mod:`cogni_tool.mcp_http`) shares one pool between its sessions, so the number of
    its sessions does not multiply the connections held at the gateway.
    """

    def __init__(
        self, connect: Callable[[], GatewayClient], max_calls: int = MAX_CONCURRENT_CALLS
    ) -> None:
        self._connect = connect
        self.slots = threading.BoundedSemaphore(max_calls)
        self._lock = threading.Lock()
        self._idle: list[GatewayClient] = []

    def take(self) -> GatewayClient:
        """An idle connection, or a new one (the caller holds one of :attr:`slots`)."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self._connect()

    def give_back(self, client: GatewayClient) -> None:
        with self._lock:
            self._idle.append(client)

    def close(self) -> None:
        """Close the idle connections (the calls should be done by now)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for client in idle:
            client.close()


class McpSession:
    """One MCP session: lines in through :meth:`receive_line`, lines out through ``write``;
    or, for a transport that frames messages itself, decoded messages in through
    :meth:`receive` with a reply channel of their own.

    ``connect`` makes a gateway connection (called at most ``max_calls`` times; the
    connections are reused), unless ``pool`` is given: then the session takes its
    connections from that shared pool and leaves closing it to its owner. ``write`` takes
    one encoded line and must be safe to call from several threads (the session
    serialises its own calls to it).

    Error handling: nothing a client sends raises out of :meth:`receive_line`; every
    malformed or refused message is answered as JSON-RPC says. A ``write`` that fails
    (the client went away) is swallowed; the end of stdin ends the session.
    """

    def __init__(
        self,
        connect: Callable[[], GatewayClient],
        write: Callable[[bytes], None],
        *,
        page_size: int = TOOLS_PAGE_SIZE,
        max_calls: int = MAX_CONCURRENT_CALLS,
        max_pending: int = MAX_PENDING_REQUESTS,
        pool: ClientPool | None = None,
    ) -> None:
        self._owns_pool = pool is None
        self._pool = ClientPool(connect, max_calls) if pool is None else pool
        self._write_line = write
        self._page_size = page_size
        self._max_pending = max_pending
        self._write_lock = threading.Lock()
        self._lock = threading.Lock()
        self._in_flight: dict[tuple[str, RequestId], _Call] = {}
        self._workers = Workers()
        # Requests handed to a worker and not yet answered (their answer written):
        # :meth:`wait` waits for none to be left. Under ``_lock``.
        self._unanswered = 0
        self._all_answered = threading.Condition(self._lock)
        self.version: str | None = None
        self.initialized = False

    # -- input --

    def receive_line(self, line: bytes) -> None:
        """Handle one line from the client (without or with its newline)."""
        if not line.strip():
            return  # blank lines carry nothing; tolerated between messages
        try:
            obj = mcp.decode_line(line)
        except mcp.RpcError as exc:
            self._send(exc.to_response())
            return
        self.receive(obj, self._send_or_drop, self._send)

    def receive(
        self, obj: Any, reply: Callable[[Any], None], notify: Callable[[Json], None]
    ) -> None:
        """Handle one decoded message or batch without waiting for the gateway.

        ``reply`` is called exactly once, maybe later from another thread, with the
        answer: a response, the list of a batch's responses, or None when there is none
        (notifications, responses, cancelled requests). ``notify`` takes the
        notifications about its requests (progress), each before the answer.
        """
        if isinstance(obj, list):
            self._receive_batch(obj, reply, notify)
        else:
            self._receive_one(obj, reply, notify)

    @property
    def busy(self) -> bool:
        """Whether any request of this session is still being answered."""
        with self._lock:
            return bool(self._in_flight)

    def oversized_line(self, size: int) -> None:
        """Answer a line that was over :data:`MAX_LINE_BYTES` and skipped unread."""
        self._send(
            mcp.error_response(
                None,
                mcp.INVALID_REQUEST,
                f"invalid request: a message of {size} bytes or more is over this server's "
                f"limit of {MAX_LINE_BYTES} bytes per line; it was skipped unread",
            )
        )

    def _receive_batch(
        self, items: list[Any], reply: Callable[[Any], None], notify: Callable[[Json], None]
    ) -> None:
        version = self.version
        if version not in mcp.BATCH_VERSIONS:
            why = (
                "send initialize first, on its own"
                if version is None
                else f"protocol version {version} has no JSON-RPC batches"
            )
            reply(
                mcp.error_response(
                    None,
                    mcp.INVALID_REQUEST,
                    f"invalid request: a batch (JSON array) is refused: {why}; send each "
                    "message on its own line (over HTTP: in a POST of its own)",
                )
            )
            return
        if not items:
            reply(mcp.error_response(None, mcp.INVALID_REQUEST, "invalid request: an empty batch"))
            return
        batch = _Batch(reply)
        for item in items:
            batch.expect()
            self._receive_one(item, batch.answer, notify, in_batch=True)
        batch.settle()

    def _receive_one(
        self,
        obj: Any,
        reply: Callable[[Json | None], None],
        notify: Callable[[Json], None],
        in_batch: bool = False,
    ) -> None:
        """Handle one message; ``reply`` is called exactly once (None: no answer)."""
        try:
            message = mcp.parse_message(obj)
            if isinstance(message, mcp.Notification):
                self._notified(message)
                reply(None)
            elif message is None:
                reply(None)  # a response: this server sent no request it could answer
            else:
                try:
                    self._request(message, reply, notify, in_batch)
                except mcp.RpcError as exc:
                    exc.request_id = message.id  # every refusal of a request answers it
                    raise
        except mcp.RpcError as exc:
            reply(exc.to_response())

    def _notified(self, message: mcp.Notification) -> None:
        if message.method == "notifications/initialized":
            self.initialized = True
        elif message.method == "notifications/cancelled":
            request_id = message.params.get("requestId")
            if isinstance(request_id, (str, int)):
                with self._lock:
                    call = self._in_flight.get(_key(request_id))
                    if call is not None:
                        call.cancelled = True
        # Any other notification (progress, roots changed, …) needs nothing from a server
        # without those capabilities: JSON-RPC notifications are never answered.

    def _request(
        self,
        request: mcp.Request,
        reply: Callable[[Json | None], None],
        notify: Callable[[Json], None],
        in_batch: bool,
    ) -> None:
        method = request.method
        if method == "initialize":
            if in_batch:
                raise mcp.RpcError(
                    mcp.INVALID_REQUEST,
                    "invalid request: initialize must not be part of a batch",
                    request.id,
                )
            if self.version is not None:
                raise mcp.RpcError(
                    mcp.INVALID_REQUEST,
                    f"invalid request: the session is already initialized (protocol "
                    f"version {self.version}); for another, start a new cogni-tool mcp (over "
                    "HTTP: POST initialize without Mcp-Session-Id)",
                    request.id,
                )
            version, result = mcp.initialize_result(request.params, __version__)
            self.version = version
            reply(mcp.result_response(request.id, result))
        elif method == "ping":
            reply(mcp.result_response(request.id, {}))
        elif method not in mcp.METHODS:
            raise mcp.method_not_found(request)
        elif self.version is None:
            raise mcp.RpcError(
                mcp.INVALID_REQUEST,
                f"invalid request: {method} before initialize; send initialize first",
                request.id,
            )
        elif method == "tools/list":
            cursor = request.params.get("cursor")
            self._start(request, reply, lambda client, call: self._list(client, cursor, request))
        elif method == "tools/call":
            name, arguments = mcp.call_target(request.params)
            token = mcp.progress_token(request.params)
            self._start(
                request,
                reply,
                lambda client, call: self._call(
                    client, call, request, name, arguments, token, notify
                ),
            )

    # -- calls in worker threads --

    def _start(
        self,
        request: mcp.Request,
        reply: Callable[[Json | None], None],
        work: Callable[[GatewayClient, _Call], Json | None],
    ) -> None:
        key = _key(request.id)
        call = _Call()
        with self._lock:
            if key in self._in_flight:
                raise mcp.RpcError(
                    mcp.INVALID_REQUEST,
                    f"invalid request: id {request.id!r} is already in use by a request "
                    "still being answered; use a new id for each request",
                    request.id,
                )
            if len(self._in_flight) >= self._max_pending:
                raise mcp.RpcError(
                    mcp.INTERNAL_ERROR,
                    f"{len(self._in_flight)} requests are already being answered (this "
                    f"server's limit is {self._max_pending}); wait for some answers first",
                    request.id,
                )
            self._in_flight[key] = call
            self._unanswered += 1
        self._workers.submit(lambda: self._work(request, key, call, reply, work))

    def _work(
        self,
        request: mcp.Request,
        key: tuple[str, RequestId],
        call: _Call,
        reply: Callable[[Json | None], None],
        work: Callable[[GatewayClient, _Call], Json | None],
    ) -> None:
        response: Json | None = None
        try:
            with self._pool.slots:
                if not call.cancelled:  # cancelled while waiting: never sent at all
                    client = self._pool.take()
                    try:
                        result = work(client, call)
                    finally:
                        self._pool.give_back(client)
                    if result is not None and not call.cancelled:
                        response = mcp.result_response(request.id, result)
        except mcp.RpcError as exc:
            exc.request_id = request.id
            response = None if call.cancelled else exc.to_response()
        except Exception as exc:  # a bug here must answer, not leave the client waiting
            response = (
                None
                if call.cancelled
                else mcp.error_response(
                    request.id,
                    mcp.INTERNAL_ERROR,
                    f"cogni-tool mcp failed answering {request.method}: "
                    f"{type(exc).__name__}: {exc}",
                )
            )
        finally:
            with self._lock:
                self._in_flight.pop(key, None)
            try:
                reply(response)
            finally:
                with self._lock:
                    self._unanswered -= 1
                    if not self._unanswered:
                        self._all_answered.notify_all()

    def _list(self, client: GatewayClient, cursor: Any, request: mcp.Request) -> Json:
        try:
            manifests = client.call(mcp.GATEWAY_LIST_TOOL, {})
        except ToolError as exc:
            raise mcp.RpcError(
                mcp.INTERNAL_ERROR,
                f"the gateway refused to list this run's tools: {exc.code}: {exc.safe_message}",
            ) from None
        except CogniToolError as exc:
            raise mcp.RpcError(
                mcp.INTERNAL_ERROR, f"the gateway could not list this run's tools: {exc}"
            ) from None
        version = self.version or mcp.LATEST_VERSION
        tools = mcp.tools_for_version(mcp.mcp_tools(manifests), version)
        page, next_cursor = mcp.page(tools, cursor, self._page_size)
        result: Json = {"tools": page}
        if next_cursor is not None:
            result["nextCursor"] = next_cursor
        return result

    def _call(
        self,
        client: GatewayClient,
        call: _Call,
        request: mcp.Request,
        name: str,
        arguments: Json,
        token: RequestId | None,
        notify: Callable[[Json], None],
    ) -> Json | None:
        version = self.version or mcp.LATEST_VERSION
        if token is not None:
            notify(mcp.progress(token, 0, 1, f"{name}: sent to the gateway", version))
        try:
            result = mcp.call_result(client.call(name, arguments), version)
        except ToolError as exc:
            result = mcp.tool_error_result(exc.code, exc.safe_message)
        except CogniToolError as exc:
            # No answer from the gateway (gone, timed out, garbled): still this tool
            # call's failure, for the model to see, not a broken session.
            result = mcp.tool_error_result(exc.code, str(exc))
        if call.cancelled:
            return None
        if token is not None:
            notify(mcp.progress(token, 1, 1, f"{name}: answered", version))
        return result

    # -- output and the end --

    def _send_or_drop(self, response: Json | None) -> None:
        if response is not None:
            self._send(response)

    def _send(self, message: Any) -> None:
        data = mcp.encode_message(message)
        # OSError, ValueError: the client closed our stdout; it wants no more answers.
        with self._write_lock, contextlib.suppress(OSError, ValueError):
            self._write_line(data)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for every request being answered (its answer written); True when none is
        left."""
        with self._lock:
            self._all_answered.wait_for(lambda: not self._unanswered, timeout)
            return not self._unanswered and not self._in_flight

    def close(self) -> None:
        """Close the pooled gateway connections (the calls should be done by now), unless
        the pool is shared: its owner closes it."""
        if self._owns_pool:
            self._pool.close()


def _key(request_id: RequestId) -> tuple[str, RequestId]:
    # "1" and 1 are different ids: the type is part of the key.
    return (type(request_id).__name__, request_id)


def read_lines(stream: BinaryIO, session: McpSession) -> None:
    """Feed ``session`` every line of ``stream`` until its end; an over-long line is
    skipped (never held whole) and answered with an error."""
    while True:
        line = stream.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            size = len(line)
            while True:  # skip to the line's end, a chunk at a time
                chunk = stream.readline(_SKIP_CHUNK)
                size += len(chunk)
                if not chunk or chunk.endswith(b"\n"):
                    break
            session.oversized_line(size)
            continue
        session.receive_line(line)


def parse_timeout(words: list[str]) -> float | None:
    """The call timeout from ``mcp``'s options (ValueError with the reason)."""
    timeout: float | None = DEFAULT_CALL_TIMEOUT_S
    i = 0
    while i < len(words):
        word = words[i]
        name, has_value, value = word.partition("=")
        if name != "--timeout":
            raise ValueError(f"unknown option {word!r}; cogni-tool mcp takes only --timeout")
        if not has_value:
            if i + 1 >= len(words):
                raise ValueError("--timeout needs a number of seconds")
            value = words[i + 1]
            i += 1
        i += 1
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if not 0 <= seconds <= MAX_CALL_TIMEOUT_S:
            raise ValueError(
                f"--timeout takes a number of seconds up to {MAX_CALL_TIMEOUT_S:.0f} "
                f"(0 waits forever), got {value!r}"
            )
        timeout = None if seconds == 0 else seconds
    return timeout


def main(words: list[str]) -> int:
    """Serve MCP on stdin/stdout until stdin ends; the exit status."""
    if any(w in ("-h", "--help") for w in words):
        sys.stdout.write(USAGE)
        return EXIT_OK
    try:
        timeout = parse_timeout(words)
    except ValueError as exc:
        sys.stderr.write(f"cogni-tool: usage: {exc}\n")
        return EXIT_USAGE
    from cogni_tool.client import Client, NotConfigured

    try:
        # Fail at start, on stderr where the MCP client logs it, when this is not a run.
        Client(timeout=timeout).close()
    except NotConfigured as exc:
        sys.stderr.write(f"cogni-tool: {exc.code}: {exc}\n")
        return EXIT_NO_GATEWAY
    threading.stack_size(THREAD_STACK_BYTES)
    out = sys.stdout.buffer

    def write(data: bytes) -> None:
        out.write(data)
        out.flush()

    session = McpSession(lambda: Client(timeout=timeout), write)
    try:
        read_lines(sys.stdin.buffer, session)
        session.wait()
    except KeyboardInterrupt:
        return 130
    finally:
        session.close()
    return EXIT_OK
