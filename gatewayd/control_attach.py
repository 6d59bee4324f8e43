"""``POST /v1/runs/attach``: a ``gatewayd run`` served by a running daemon, its command's
standard streams the client's own.

`gatewayd run` in its own process loads the daemon (pydantic, trio, the policy and
sandbox layers) before its command starts: hundreds of milliseconds, and it cannot run at
all while ``gatewayd serve`` holds the same state directory. When a daemon serves the
state directory's control socket, the client asks it instead and imports none of that.

The exchange, on one connection of the control socket (root or the daemon's user only,
as every control request):

1. The client sends ``POST /v1/runs/attach`` with ``Connection: Upgrade`` and
   ``Upgrade: gatewayd-attach/1``, its body an :class:`AttachRequest` (the run request,
   the command, the client's environment for the variables the policy lets through).
2. gatewayd checks the body and answers ``101 Switching Protocols``, or refuses with an
   ordinary HTTP answer (400 and why) and closes.
3. The client sends one byte carrying its standard input, output and error as
   ``SCM_RIGHTS``. They are relayed to and from the command through pipes, never handed
   to it (gatewayd/sandbox/passthrough.py: one of them may be the operator's terminal).
4. gatewayd starts the run and its command, and sends lines of JSON: ``{"say": LINE}``
   for the client to print on its stderr, and last ``{"exit": STATUS}``, the status
   `gatewayd run` exits with; then it closes the connection.
5. Meanwhile the client may send ``{"stop": N}`` (it received stop signal N): the
   command is stopped and the run ended, as a signal ends an in-process one-shot run,
   and the status is 128 + N. A client that goes away ends the run the same way.

Policies may be named by a file's path here, as on gatewayd's own command line: the
control socket's peer is the operator.
"""

from __future__ import annotations

import array
import contextlib
import json
import math
import os
import signal
import socket
from typing import TYPE_CHECKING, Annotated, Final

import h11
import pydantic
import structlog
import trio

from gatewayd.exitstatus import EXIT_FAILED, SIGNAL_EXIT_BASE
from gatewayd.runs import RunRequest
from gatewayd.runs.oneshot import attached_run
from gatewayd.sandbox.passthrough import Passthrough

if TYPE_CHECKING:
    from gatewayd.runs.lifecycle import RunManager

log = structlog.get_logger("gatewayd.control")

ATTACH_TARGET: Final = "/v1/runs/attach"
ATTACH_PROTOCOL: Final = "gatewayd-attach/1"
# The client sends its descriptors right after the 101: a client that does not within
# this long is dropped before anything of a run exists.
STREAMS_TIMEOUT_S: Final = 30.0
# stdin, stdout, stderr.
STREAM_COUNT: Final = 3
# The client's messages are one short line each ({"stop": 15}).
MAX_CLIENT_LINE: Final = 256
# An environment is a few kilobytes; the variables only feed the policy's env.allow.
MAX_ENV_VARS: Final = 4096
MAX_ENV_CHARS: Final = 128 * 1024
MAX_STORE_OPTIONS_CHARS: Final = 8192
# The longest argv (as an exec request's).
MAX_ATTACHED_ARGS: Final = 4096
# Signals a client may say it received: the ones that stop `gatewayd run`.
STOP_SIGNALS: Final = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})


def check_command(value: tuple[str, ...]) -> tuple[str, ...]:
    """An argv as a request carries it: C strings, a program named."""
    if any("\0" in arg for arg in value):
        raise ValueError("an argument holds a NUL byte; arguments are C strings")
    if not value[0]:
        raise ValueError("the program (first argument) is empty")
    return value


class AttachRequest(pydantic.BaseModel):
    """The body of ``POST /v1/runs/attach``."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True, strict=True)

    request: RunRequest
    command: tuple[str, ...] = pydantic.Field(min_length=1, max_length=MAX_ATTACHED_ARGS)
    env: dict[
        Annotated[str, pydantic.Field(min_length=1, max_length=MAX_ENV_CHARS)],
        Annotated[str, pydantic.Field(max_length=MAX_ENV_CHARS)],
    ] = pydantic.Field(default_factory=dict, max_length=MAX_ENV_VARS)
    # Said with a kept session's commands (`gatewayd workspace diff --state-dir ...`).
    storeOptions: str = pydantic.Field(default="", max_length=MAX_STORE_OPTIONS_CHARS)

    @pydantic.field_validator("command")
    @classmethod
    def _command(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return check_command(value)

    @pydantic.field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        for name, text in value.items():
            if "=" in name or "\0" in name or "\0" in text:
                raise ValueError(f"not an environment variable: {name[:64]!r}")
        return value

    @pydantic.field_validator("storeOptions")
    @classmethod
    def _one_line(cls, value: str) -> str:
        if not value.isprintable():
            raise ValueError("storeOptions is one line of printable characters")
        return value


def asks_to_attach(request: h11.Request) -> bool:
    """Whether ``request`` asks to switch its connection to the attach exchange."""
    upgrade = [v.strip().lower() for k, v in request.headers if k == b"upgrade"]
    connection = {
        token.strip().lower()
        for k, v in request.headers
        if k == b"connection"
        for token in v.split(b",")
    }
    return upgrade == [ATTACH_PROTOCOL.encode()] and b"upgrade" in connection


async def serve_attached(
    stream: trio.SocketStream, conn: h11.Connection, attach: AttachRequest, runs: RunManager
) -> None:
    """Switch the connection (its request read and checked: ``attach``), take the
    client's standard streams, run the one-shot run, and say how it went. The
    connection is the caller's to close."""
    switch = h11.InformationalResponse(
        status_code=101, headers=[("upgrade", ATTACH_PROTOCOL), ("connection", "upgrade")]
    )
    await stream.send_all(conn.send(switch))
    early, _ = conn.trailing_data
    if early:
        log.info("attach_refused", reason="bytes before the switch")
        return  # the client spoke before it was answered: not this exchange
    fds: list[int] | None = None  # stays None when the client does not send in time
    with trio.move_on_after(STREAMS_TIMEOUT_S):
        fds = await _receive_streams(stream.socket)
    if fds is None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await _send(stream, {"say": _streams_missing()})
            await _send(stream, {"exit": EXIT_FAILED})
        return
    try:
        await _attached(stream, attach, runs, fds)
    finally:
        for fd in fds:
            os.close(fd)


async def _attached(
    stream: trio.SocketStream, attach: AttachRequest, runs: RunManager, fds: list[int]
) -> None:
    lines_in, lines_out = trio.open_memory_channel[dict[str, object]](math.inf)
    stop = trio.CancelScope()
    stopped_by: list[int] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_watch_client, stream, stop, stopped_by)
        async with trio.open_nursery() as sending:
            sending.start_soon(_send_lines, stream, lines_out)
            with lines_in:
                status = await attached_run(
                    runs,
                    attach.request,
                    list(attach.command),
                    Passthrough(stdin=fds[0], stdout=fds[1], stderr=fds[2]),
                    lambda line: lines_in.send_nowait({"say": line}),
                    env_values=attach.env,
                    audit_path=str(runs.config.resolved_audit_path),
                    store_options=attach.storeOptions,
                    stop=stop,
                )
                if status is None:  # stopped: by the client's signal, or the client gone
                    signum = stopped_by[0] if stopped_by else signal.SIGHUP
                    name = signal.Signals(signum).name
                    lines_in.send_nowait(
                        {"say": f"gatewayd: {name}: the run was ended (its command stopped)"}
                    )
                    status = SIGNAL_EXIT_BASE + signum
                lines_in.send_nowait({"exit": status})
            # Every line sent (a client that stopped reading is not waited for long).
            sending.cancel_scope.deadline = trio.current_time() + STREAMS_TIMEOUT_S
        nursery.cancel_scope.cancel()  # the watcher: nothing more to hear


async def _send_lines(
    stream: trio.SocketStream, lines: trio.MemoryReceiveChannel[dict[str, object]]
) -> None:
    async with lines:
        async for message in lines:
            try:
                await _send(stream, message)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                continue  # the client is gone: its run still ends, unheard


async def _watch_client(
    stream: trio.SocketStream, stop: trio.CancelScope, stopped_by: list[int]
) -> None:
    """Read the client's messages; a stop (or the client gone) cancels ``stop``."""
    buffer = bytearray()
    try:
        while True:
            chunk = await stream.receive_some(MAX_CLIENT_LINE)
            if not chunk:
                break
            buffer += chunk
            while b"\n" in buffer:
                line, _, rest = bytes(buffer).partition(b"\n")
                buffer[:] = rest
                signum = _stop_signal(line)
                if signum is not None and not stopped_by:
                    stopped_by.append(signum)
                    stop.cancel()
            if len(buffer) > MAX_CLIENT_LINE:
                break  # not a message of this exchange: treated as the client gone
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    stop.cancel()


def _stop_signal(line: bytes) -> int | None:
    try:
        message = json.loads(line)
    except ValueError:
        return None
    value = message.get("stop") if isinstance(message, dict) else None
    if type(value) is int and value in STOP_SIGNALS:
        return value
    return None


async def _send(stream: trio.SocketStream, message: dict[str, object]) -> None:
    await stream.send_all(json.dumps(message).encode() + b"\n")


async def _receive_streams(sock: trio.socket.SocketType) -> list[int] | None:
    """The client's three descriptors (close-on-exec here), or None when it sent
    something else (any descriptor that came with it is closed)."""
    data, ancillary, flags, _ = await sock.recvmsg(
        1, socket.CMSG_SPACE(STREAM_COUNT * 4), socket.MSG_CMSG_CLOEXEC
    )
    fds = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    if len(data) == 1 and len(fds) == STREAM_COUNT and not flags & socket.MSG_CTRUNC:
        return list(fds)
    for fd in fds:
        os.close(fd)
    return None


def _streams_missing() -> str:
    return (
        "gatewayd: the attached client did not pass its standard input, output and error "
        "(one byte with three descriptors as SCM_RIGHTS, right after the 101 answer)"
    )
