"""The supervisor of the declared MCP servers: :class:`McpServers` starts an instance of
a server when a call first needs it, keeps it while it serves, and stops it when it
fails, hangs, or its run or the daemon ends.

A command server's instance is a run of its own (:mod:`gatewayd.mcp.child` says what it
may see), and the server's program runs in that run's sandbox as a long-lived command whose
standard streams are pipes gatewayd made for it and holds the other ends of
(:class:`~gatewayd.sandbox.passthrough.Passthrough` with ``relay=False``: no copy
between, so a message costs no thread hop): its stdin and stdout carry the MCP session
(:mod:`gatewayd.mcp.client`), the last :data:`STDERR_TAIL_BYTES` of its stderr are kept
for diagnostics.

A url server's instance is a connection from gatewayd's host over streamable HTTP
(:func:`gatewayd.mcp.client.open_remote_session`), one for the daemon, with the same
lifetimes (a closed connection is a failure; the next call connects again).

Lifetimes:

* **start**: lazily, on the first :meth:`McpServers.list_tools` or
  :meth:`McpServers.call_tool` that needs it; callers arriving meanwhile wait for the
  same start. A start past the declaration's ``start_timeout_s`` fails.
* **failure**: a server that exits, floods its stdout or stops speaking the protocol
  fails the call in flight (``tool_failed``, saying which) and its instance is stopped;
  the next call starts a fresh one. Starts that keep failing back off
  (:data:`RESTART_BACKOFF_S` doubling to :data:`MAX_RESTART_BACKOFF_S`): a call meanwhile
  is refused at once, saying when the next start is allowed.
* **hang**: a call past its timeout is ``timeout``; a ``notifications/cancelled`` is
  sent, and the instance is stopped (a server that hung once cannot be trusted with the
  next call).
* **end**: a per_run instance with its calling run (:meth:`McpServers.end_run`, the run
  manager's ``run_ending`` hook), every instance with the daemon (:meth:`McpServers.aclose`).
  Stopping an instance ends its run: every process of its uid is killed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import structlog
import trio

from gatewayd.configsources import redact_url
from gatewayd.errors import GatewayError, ToolFailed, ToolTimedOut
from gatewayd.mcp.child import (
    ServerUnavailable,
    read_only_grants,
    server_policy,
    server_spec,
    server_view,
    shared_workspace,
    workspace_grants,
)
from gatewayd.mcp.declaration import McpServerDeclaration, Share
from gatewayd.mcp.remote import RemoteResult, RemoteTool
from gatewayd.runs.lifecycle import RunManager
from gatewayd.runs.model import ChildSpec, Run, RunState
from gatewayd.sandbox.passthrough import Passthrough
from gatewayd.sandbox.session import SandboxView
from gatewayd.secrets import Scrubber, SecretError, read_secret

if TYPE_CHECKING:
    from gatewayd.mcp.client import McpSession

log = structlog.get_logger("gatewayd.mcp")

# The tail of a server's stderr kept per instance (what it said last, for diagnostics),
# and how much of it the log takes when the instance ends. Never more: a server that
# writes its stderr without end costs gatewayd a read, not memory.
STDERR_TAIL_BYTES: Final = 16 << 10
STDERR_LOG_BYTES: Final = 2 << 10
STDERR_CHUNK: Final = 64 << 10
# How much of that tail a failed start's message quotes (its last words, the diagnosis).
STDERR_HINT_CHARS: Final = 256
# Starts that keep failing: the second failure in a row waits this long before the next
# start, doubling up to the maximum, so a server that crashes at once does not spin
# (each start is a sandbox, a uid and a namespace).
RESTART_BACKOFF_S: Final = 1.0
MAX_RESTART_BACKOFF_S: Final = 60.0
# Stopping an instance: its run's end kills every process of its uid; this bounds the
# wait for the instance's task to see it (the kill itself has its own bound).
STOP_WAIT_S: Final = 30.0
# A server that failed before its handshake: how long its stderr may take to be read to
# its end (it has exited; what it wrote is in the pipe already).
STDERR_SETTLE_S: Final = 1.0
# The server's program outlives its run's maximum runtime by this much in its limits
# (the run's end stops it first anyway).
SERVER_GRACE_S: Final = 60.0


@dataclass(eq=False, kw_only=True)
class _Instance:
    """One running (or starting) instance of one server, for one caller or shared."""

    server: str
    caller: str | None
    ready: trio.Event = field(default_factory=trio.Event)
    stop: trio.Event = field(default_factory=trio.Event)
    finished: trio.Event = field(default_factory=trio.Event)
    session: McpSession | None = None
    run: Run | None = None
    start_error: str | None = None
    # Why it ended (a run_ended reason), once it has.
    end_reason: str = "mcp_server_stopped"
    stderr: bytearray = field(default_factory=bytearray)
    stderr_total: int = 0
    stderr_closed: trio.Event = field(default_factory=trio.Event)

    def keep_stderr(self, data: bytes) -> None:
        self.stderr_total += len(data)
        self.stderr += data
        del self.stderr[:-STDERR_TAIL_BYTES]


@dataclass(eq=False, kw_only=True)
class _Restarts:
    """Failed starts in a row of one server for one caller, and when the next may be."""

    failures: int = 0
    not_before: float = -math.inf
    last_error: str = ""


class McpServers:
    """The declared MCP servers' instances, started on demand in ``nursery``.

    ``runs`` starts and ends each instance's run; ``scrubber`` (the daemon's, holding
    every server's ``secret_env``) cleans every result; ``environ``: where secrets are
    looked up (None: gatewayd's environment, then systemd credentials).
    """

    def __init__(
        self,
        declarations: Mapping[str, McpServerDeclaration],
        *,
        runs: RunManager,
        nursery: trio.Nursery,
        scrubber: Scrubber,
        shared_dir: Path,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self._declarations = dict(declarations)
        self._runs = runs
        self._nursery = nursery
        self._scrubber = scrubber
        self._shared_dir = shared_dir
        self._environ = environ
        self._instances: dict[tuple[str, str | None], _Instance] = {}
        self._restarts: dict[tuple[str, str | None], _Restarts] = {}
        self._closed = False

    def declared(self) -> Mapping[str, McpServerDeclaration]:
        """Every declared server by name."""
        return self._declarations

    async def list_tools(self, server: str, *, caller: Run | None) -> tuple[RemoteTool, ...]:
        """The server's live tools (starting it if needed). The list is cached per
        instance and read again after the server's notifications/tools/list_changed.
        A per_run server listed with no ``caller`` (the operator pinning its tools)
        runs as a shared one would: with an empty workspace of its own.

        Error handling: ToolFailed (the server cannot start, failed, or is backing off;
        the message says which); ToolTimedOut when it does not answer in its
        call_timeout_s; KeyError for a server not declared."""
        declaration = self._declarations[server]
        instance = await self._instance(server, caller)
        session = _session(instance)
        cached = session.cached_tools()
        if cached is not None:  # every call's pin check: no request, nothing to guard
            return cached
        tools: tuple[RemoteTool, ...] = await self._guarded(
            instance, session.tools(), declaration.call_timeout_s, what="tools/list"
        )
        return tools

    async def call_tool(
        self,
        server: str,
        tool: str,
        arguments: Mapping[str, Any],
        *,
        caller: Run,
        timeout_s: float,
    ) -> RemoteResult:
        """One tools/call (starting the server lazily), within ``timeout_s`` and the
        declaration's call_timeout_s, whichever is shorter; the result scrubbed of every
        secret gatewayd holds.

        Error handling: ToolTimedOut (``timeout``) for a server that does not answer in
        time (the instance is stopped; the next call starts a fresh one); ToolFailed
        (``tool_failed``) for a server that cannot start, exited, flooded its output,
        answered with a protocol error, or is backing off after repeated failures;
        KeyError for a server not declared. Never hangs."""
        declaration = self._declarations[server]
        limit = min(timeout_s, declaration.call_timeout_s)
        instance = await self._instance(server, caller)
        session = _session(instance)
        # _guarded's deadline is the call's only one (the session's call makes none).
        result: RemoteResult = await self._guarded(
            instance, session.call(tool, arguments), limit, what=f"tools/call {tool}"
        )
        return RemoteResult(
            content=self._scrubber.value(result.content),
            structured=self._scrubber.value(result.structured),
            is_error=result.is_error,
        )

    def stderr_tail(self, server: str, *, caller: Run | None) -> bytes:
        """The last bytes the server's live instance wrote on its stderr (b"": none)."""
        instance = self._instances.get(self._key(server, caller))
        return bytes(instance.stderr) if instance is not None else b""

    def instance_run(self, server: str, *, caller: Run | None) -> Run | None:
        """The run of the server's live instance for ``caller`` (None: none running)."""
        instance = self._instances.get(self._key(server, caller))
        return instance.run if instance is not None else None

    async def end_run(self, run_id: str) -> None:
        """Stop ``run_id``'s per_run instances and wait until they are gone."""
        await self._stop_all([i for k, i in self._instances.items() if k[1] == run_id])
        for key in [k for k in self._restarts if k[1] == run_id]:
            del self._restarts[key]  # the run is gone: so is its servers' record

    async def aclose(self) -> None:
        """Stop every instance (the daemon stops); no new one starts."""
        self._closed = True
        await self._stop_all(list(self._instances.values()))

    # -- instances ----------------------------------------------------------------------

    def _key(self, server: str, caller: Run | None) -> tuple[str, str | None]:
        declaration = self._declarations[server]
        # A remote server is one connection for the daemon, whatever its share says.
        per_run = (
            declaration.share is Share.PER_RUN and caller is not None and declaration.url is None
        )
        return (server, caller.run_id if per_run and caller is not None else None)

    async def _instance(self, server: str, caller: Run | None) -> _Instance:
        """The live instance for this server and caller, started if there is none."""
        declaration = self._declarations[server]
        if self._closed:
            raise ToolFailed(f"MCP server {server!r}: gatewayd is stopping")
        if caller is not None and caller.state not in (RunState.CREATED, RunState.SERVING):
            # Its instances are stopped (or being stopped) with it: none starts again.
            raise ToolFailed(f"MCP server {server!r}: run {caller.run_id} is ending")
        key = self._key(server, caller)
        instance = self._instances.get(key)
        if instance is not None and instance.stop.is_set():
            # Being stopped (a timeout, a failure): the next instance is a fresh one.
            with trio.move_on_after(STOP_WAIT_S):
                await instance.finished.wait()
            instance = self._instances.get(key)
        if instance is None or instance.finished.is_set():
            restarts = self._restarts.setdefault(key, _Restarts())
            wait = restarts.not_before - trio.current_time()
            if wait > 0:
                raise ToolFailed(
                    f"MCP server {server!r} failed {restarts.failures} times in a row, last: "
                    f"{restarts.last_error}; the next start is allowed in {wait:.1f} s"
                )
            instance = _Instance(server=server, caller=key[1])
            self._instances[key] = instance
            self._nursery.start_soon(self._serve, instance, declaration, caller if key[1] else None)
        if not instance.ready.is_set():  # started: no schedule point (a call makes its own)
            await instance.ready.wait()
        if instance.session is None:
            raise ToolFailed(instance.start_error or f"MCP server {server!r} did not start")
        return instance

    async def _guarded(self, instance: _Instance, pending: Any, limit: float, what: str) -> Any:
        """Await one request of ``instance``'s session, mapping its failures to the
        caller's error codes and stopping the instance on any of them."""
        from gatewayd.mcp.client import CallTimedOut, ServerError, SessionFailed

        key = (instance.server, instance.caller)
        try:
            # Cancelling the request sends the server a notifications/cancelled for it.
            with trio.move_on_after(limit):
                result = await pending
                self._restarts.pop(key, None)  # it served: its failures are behind it
                return result
            raise CallTimedOut("no answer")
        except CallTimedOut:
            instance.end_reason = "mcp_server_timeout"
            await self._stop(instance)
            raise ToolTimedOut(
                f"MCP server {instance.server!r} did not answer {what} within {limit:g} s; "
                "it was stopped (the next call starts it again)"
            ) from None
        except SessionFailed as exc:
            if not instance.stop.is_set():  # not one gatewayd stopped (a timeout)
                instance.end_reason = "mcp_server_failed"
                self._failed(key, str(exc))
            await self._stop(instance)
            raise ToolFailed(f"{exc} (during {what}; the next call starts it again)") from None
        except ServerError as exc:
            raise ToolFailed(
                f"MCP server {instance.server!r} answered {what} with an error: {exc}"
            ) from None

    def _failed(self, key: tuple[str, str | None], why: str) -> None:
        restarts = self._restarts.setdefault(key, _Restarts())
        restarts.failures += 1
        restarts.last_error = why
        if restarts.failures >= 2:
            delay = min(RESTART_BACKOFF_S * 2 ** (restarts.failures - 2), MAX_RESTART_BACKOFF_S)
            restarts.not_before = trio.current_time() + delay

    async def _stop(self, instance: _Instance) -> None:
        instance.stop.set()
        with trio.CancelScope(shield=True), trio.move_on_after(STOP_WAIT_S):
            await instance.finished.wait()

    async def _stop_all(self, instances: list[_Instance]) -> None:
        async with trio.open_nursery() as nursery:
            for instance in instances:
                nursery.start_soon(self._stop, instance)

    async def _serve(
        self, instance: _Instance, declaration: McpServerDeclaration, caller: Run | None
    ) -> None:
        """One instance from its start to its end. Never raises: what went wrong is the
        instance's ``start_error`` or its session's failure, and is logged."""
        key = (instance.server, instance.caller)
        try:
            if declaration.url is not None:
                await self._run_remote(instance, declaration, declaration.url)
            else:
                await self._run_instance(instance, declaration, caller)
        except Exception as exc:
            if not instance.ready.is_set():
                instance.start_error = _start_error(instance.server, exc)
                if not instance.stop.is_set():  # a stopped start is no failure of its own
                    self._failed(key, instance.start_error)
            log.warning(
                "mcp_server_failed",
                server=instance.server,
                caller=instance.caller,
                error=str(_first_cause(exc)),
            )
        finally:
            instance.ready.set()
            instance.finished.set()
            if self._instances.get(key) is instance:
                del self._instances[key]
            log.info(
                "mcp_server_ended",
                server=instance.server,
                caller=instance.caller,
                reason=instance.end_reason,
                stderr_bytes=instance.stderr_total,
                stderr_tail=_scrubbed_tail(instance, self._scrubber, STDERR_LOG_BYTES),
            )

    async def _run_instance(
        self, instance: _Instance, declaration: McpServerDeclaration, caller: Run | None
    ) -> None:
        # The SDK takes ~0.5 s to import: only a daemon that starts a server pays it.
        from gatewayd.mcp.client import ServerError, SessionFailed, open_session

        name = instance.server
        env = {**declaration.env, **self._secrets(name, declaration)}
        spec, view = await trio.to_thread.run_sync(self._spec, name, declaration, caller)
        run = await self._runs.start_child(spec, view=view)
        instance.run = run
        pipes: list[int] = []
        try:
            in_r, in_w = _pipe(pipes)
            out_r, out_w = _pipe(pipes)
            err_r, err_w = _pipe(pipes)
            sandbox = run.sandbox
            if sandbox is None:  # start_child makes a sandbox or refuses the run
                raise ServerUnavailable(f"MCP server {name!r} got no sandbox")
            limits = sandbox.limits.for_services(
                run.spec.request.limits.maxRuntimeSec + SERVER_GRACE_S
            )
            command = list(declaration.command or ())
            exited = trio.Event()
            async with trio.open_nursery() as nursery:

                async def execute() -> None:
                    try:
                        result = await sandbox.exec(
                            command,
                            env_values=env,
                            limits=limits,
                            passthrough=Passthrough(
                                stdin=in_r, stdout=out_w, stderr=err_w, relay=False
                            ),
                        )
                        why = (
                            f"exit code {result.exitCode}"
                            if result.exitCode is not None
                            else (f"signal {result.signal}")
                        )
                        log.info("mcp_server_exited", server=name, how=why)
                    except Exception as exc:
                        log.warning("mcp_server_exec_failed", server=name, error=str(exc))
                    finally:
                        exited.set()
                        # Our end of its stdout: the reader sees the end at once.
                        os.close(_take(pipes, out_w))
                        os.close(_take(pipes, err_w))

                nursery.start_soon(execute)
                nursery.start_soon(
                    _keep_stderr, trio.lowlevel.FdStream(_take(pipes, err_r)), instance
                )
                to_server = trio.lowlevel.FdStream(_take(pipes, in_w))
                from_server = trio.lowlevel.FdStream(_take(pipes, out_r))
                async with (
                    to_server,
                    from_server,
                    open_session(to_server, from_server, name=name) as session,
                ):
                    failure: str | None = None
                    with trio.move_on_after(declaration.start_timeout_s) as started:
                        try:
                            await _unless_stopped(instance, session.initialize())
                        except (SessionFailed, ServerError) as exc:
                            failure = str(exc)
                    if instance.stop.is_set():
                        raise ServerUnavailable(
                            f"MCP server {name!r} was stopped before its MCP handshake "
                            f"completed ({instance.end_reason})"
                        )
                    if failure is not None:
                        # Its last words are the diagnosis: let its stderr be read to the end.
                        with trio.move_on_after(STDERR_SETTLE_S):
                            await exited.wait()
                            await instance.stderr_closed.wait()
                        raise ServerUnavailable(
                            f"{failure}, before the MCP handshake completed"
                            + _tail_hint(instance, self._scrubber)
                        )
                    if started.cancelled_caught:
                        raise ServerUnavailable(
                            f"MCP server {name!r} did not complete the MCP handshake within "
                            f"{declaration.start_timeout_s:g} s (start_timeout_s)"
                            + _tail_hint(instance, self._scrubber)
                        )
                    instance.session = session
                    instance.ready.set()
                    log.info(
                        "mcp_server_started",
                        server=name,
                        caller=instance.caller,
                        run_id=run.run_id,
                        protocol=session.protocol_version,
                    )
                    async with trio.open_nursery() as waiting:
                        for event in (instance.stop, session.failed, exited):
                            waiting.start_soon(_set_when, event, waiting.cancel_scope)
                    if not instance.stop.is_set():
                        why = session.failure or f"MCP server {name!r} exited" + _tail_hint(
                            instance, self._scrubber
                        )
                        instance.end_reason = "mcp_server_failed"
                        session.fail(why)
                    else:  # calls still waiting on it answer at once
                        session.fail(f"MCP server {name!r} was stopped ({instance.end_reason})")
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self._runs.end(run.run_id, reason=instance.end_reason)
                # The ends still ours (its stdin's read end among them): the command is gone.
                for fd in list(pipes):
                    os.close(_take(pipes, fd))

    async def _run_remote(
        self, instance: _Instance, declaration: McpServerDeclaration, url: str
    ) -> None:
        """A remote server's session, from gatewayd's host (no process, no sandbox: the
        server runs elsewhere), until it is stopped or fails."""
        from gatewayd.mcp.client import ServerError, SessionFailed, open_remote_session

        name = instance.server
        async with open_remote_session(url, name=name) as session:
            failure: str | None = None
            with trio.move_on_after(declaration.start_timeout_s) as started:
                try:
                    await _unless_stopped(instance, session.initialize())
                except (SessionFailed, ServerError) as exc:
                    failure = str(exc)
            if instance.stop.is_set():
                raise ServerUnavailable(f"MCP server {name!r} was stopped before it connected")
            if failure is not None or started.cancelled_caught:
                raise ServerUnavailable(
                    f"MCP server {name!r} ({redact_url(url)}) did not complete the MCP "
                    "handshake"
                    + (
                        f": {failure}"
                        if failure
                        else f" within {declaration.start_timeout_s:g} s (start_timeout_s)"
                    )
                )
            instance.session = session
            instance.ready.set()
            log.info("mcp_server_connected", server=name, protocol=session.protocol_version)
            async with trio.open_nursery() as waiting:
                for event in (instance.stop, session.failed):
                    waiting.start_soon(_set_when, event, waiting.cancel_scope)
            if not instance.stop.is_set():
                instance.end_reason = "mcp_server_failed"
            session.fail(session.failure or f"MCP server {name!r} was stopped")

    def _spec(
        self, name: str, declaration: McpServerDeclaration, caller: Run | None
    ) -> tuple[ChildSpec, SandboxView]:
        """The instance's run spec and sandbox view. Blocking (stats paths)."""
        if caller is not None:
            workspace = caller.spec.workspace
            grants = (
                *workspace_grants(name, declaration, caller),
                *read_only_grants(name, declaration),
            )
        else:
            workspace = shared_workspace(self._shared_dir / name)
            grants = read_only_grants(name, declaration)
        policy = server_policy(name, declaration, caller)
        spec = server_spec(
            name, declaration, caller, policy=policy, grants=grants, workspace=workspace
        )
        return spec, server_view(workspace, grants)

    def _secrets(self, name: str, declaration: McpServerDeclaration) -> dict[str, str]:
        found = {}
        for secret in declaration.secret_env:
            try:
                found[secret] = read_secret(
                    secret, self._environ, holds=f"MCP server {name!r}'s secret"
                ).value
            except SecretError as exc:
                raise ServerUnavailable(f"MCP server {name!r} cannot start: {exc}") from None
        return found


def _session(instance: _Instance) -> McpSession:
    if instance.session is None:  # _instance returns only started ones
        raise ToolFailed(f"MCP server {instance.server!r} is not running")
    return instance.session


def _start_error(server: str, exc: BaseException) -> str:
    exc = _first_cause(exc)
    if isinstance(exc, ServerUnavailable | GatewayError):
        return str(exc)
    return f"MCP server {server!r} could not start: {exc}"


def _first_cause(exc: BaseException) -> BaseException:
    """The exception a nursery's group wraps (the first: the others are its echoes)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _tail_hint(instance: _Instance, scrubber: Scrubber) -> str:
    tail = _scrubbed_tail(instance, scrubber, STDERR_HINT_CHARS).strip()
    return f"; its stderr ends: {tail}" if tail else ""


def _scrubbed_tail(instance: _Instance, scrubber: Scrubber, chars: int) -> str:
    """The last ``chars`` of the instance's stderr, scrubbed before it is cut: a cut
    inside a secret would leave a part of it no scrubber recognises."""
    return scrubber.text(bytes(instance.stderr).decode("utf-8", "replace"))[-chars:]


def _pipe(pipes: list[int]) -> tuple[int, int]:
    read, write = os.pipe()
    pipes += [read, write]
    return read, write


def _take(pipes: list[int], fd: int) -> int:
    """``fd``, no longer to be closed by the instance's cleanup (its new owner will)."""
    pipes.remove(fd)
    return fd


async def _unless_stopped(instance: _Instance, pending: Awaitable[None]) -> None:
    """Await ``pending`` unless ``instance`` is stopped first (its run or the daemon
    ending): a start waits up to start_timeout_s, which a stop must not wait out."""
    failed: list[Exception] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_set_when, instance.stop, nursery.cancel_scope)
        try:
            await pending
        except Exception as exc:  # raised as itself, not in the nursery's group
            failed.append(exc)
        nursery.cancel_scope.cancel()
    if failed:
        raise failed[0]


async def _set_when(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


async def _keep_stderr(stream: trio.lowlevel.FdStream, instance: _Instance) -> None:
    async with stream:
        try:
            while chunk := await stream.receive_some(STDERR_CHUNK):
                instance.keep_stderr(chunk)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            instance.stderr_closed.set()
