"""A sandboxed command's standard streams relayed to and from host descriptors, as they
come: what makes ``gatewayd run -- CMD`` behave like ``CMD`` in a pipeline (``cat data |
gatewayd run ... -- tool``, or an MCP client on the host driving a stdio server).

The command never gets the host's descriptors themselves: it gets pipes, and gatewayd
copies between them and its own stdin, stdout and stderr. A descriptor handed over as it
is could be the operator's terminal (the sandbox could type into the operator's shell
with TIOCSTI, or read the terminal after gatewayd is gone), a file opened read-write, or
a socket; a pipe is none of these, and every byte crossing it is counted for the audit.

Why the host side is read and written in worker threads: gatewayd's own descriptors are
shared with the shell that started it. Making them non-blocking (as ``trio.lowlevel.
FdStream`` does) would change them for that shell too, and epoll refuses regular files
and ``/dev/null`` (``gatewayd run ... < data``). A blocking read or write in a thread
works on every kind of descriptor. Each thread waits in ``poll`` on its descriptor and on
a wake-up pipe the relay writes to when it is cancelled, so no thread is ever left behind
blocked on a host descriptor: a serving daemon relays an attached ``gatewayd run``'s
streams (gatewayd/runs/oneshot.py), and a read left waiting on the operator's terminal
after the command ended would take the next line typed there, and keep the descriptor
open, for as long as the daemon lives. A pipe (or FIFO) is written ``PIPE_BUF`` bytes at
a time once ``poll`` says it has room, which the kernel takes without blocking; a socket
or a terminal, where ``poll`` promises less, is written without blocking
(:func:`_nonblocking_writes`).

Memory: one chunk per stream in flight, whatever the command writes; the next chunk is
read only once the last is written (backpressure: a slow reader on the host slows the
command, never grows gatewayd). No output cap applies: gatewayd keeps nothing, so
``max_output_bytes`` (what gatewayd *keeps* of a captured command) has nothing to bound;
the command's time is still bounded by its timeout.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import select
import socket
import stat
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Final

import trio

# One pipe's worth per copy: as much as the command can have written before it blocks.
RELAY_CHUNK: Final = 64 * 1024
# ioctl: the device number of the terminal behind a descriptor (linux/asm-generic/ioctls.h).
_TIOCGDEV: Final = 0x80045432


@dataclass(frozen=True, slots=True, kw_only=True)
class Passthrough:
    """Host descriptors a command's standard streams are relayed from and to (usually
    gatewayd's own 0, 1 and 2). gatewayd never closes them nor changes their flags; one
    left non-blocking by whoever started gatewayd is waited on, not taken for its end.

    ``relay=False``: the descriptors are pipe ends gatewayd made for this command alone
    (an MCP server's stdio); the command gets them as its standard streams, with no copy
    between. None of the reasons to relay holds for such a pipe (it is no terminal, no
    file, no socket), and a copy through worker threads would cost every message two
    thread hops. No bytes are counted then (the result's ``streamed`` is None): the
    caller reads and writes every byte itself. The caller keeps its own ends and closes
    them; run_in_sandbox never closes any of these descriptors.
    """

    stdin: int
    stdout: int
    stderr: int
    relay: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamedBytes:
    """How many bytes crossed each stream of a passed-through command: given to the
    command on its stdin, and read from its stdout and stderr."""

    stdin: int
    stdout: int
    stderr: int


class Relay:
    """One direction of one stream: counts what it copies; ``done`` is set when it stops
    (end of input, a closed reader, or cancellation)."""

    def __init__(self) -> None:
        self.count = 0
        self.done = trio.Event()

    async def feed(self, source: int, stream: trio.lowlevel.FdStream) -> None:
        """Copy host descriptor ``source`` into the command's stdin ``stream`` until
        ``source`` ends, then close ``stream``: the command sees end of input.

        Error handling: the command closing its stdin (or ending) stops the copy quietly,
        as a pipeline's writer stops; an unreadable ``source`` ends the command's input
        as end of file would (it is gatewayd's input, not the command's fault).
        """
        async with stream:
            try:
                with _nonblocking_reads(source) as read:
                    async with _woken_when_cancelled() as wake:
                        while chunk := await trio.to_thread.run_sync(
                            _read_some, source, read, wake
                        ):
                            try:
                                await stream.send_all(chunk)
                            except (trio.BrokenResourceError, trio.ClosedResourceError):
                                return
                            self.count += len(chunk)
            finally:
                self.done.set()

    async def drain(self, stream: trio.lowlevel.FdStream, sink: int) -> None:
        """Copy the command's output ``stream`` to host descriptor ``sink`` until the
        command closes it. If ``sink`` stops taking data (its reader is gone: ``gatewayd
        run ... | head -1``), ``stream`` is closed, so the command's next write fails with
        EPIPE (or SIGPIPE) as it would in the same pipeline without gatewayd."""
        piece = select.PIPE_BUF if _is_pipe(sink) else RELAY_CHUNK
        async with stream:
            try:
                with _nonblocking_writes(sink) as write:
                    async with _woken_when_cancelled() as wake:
                        while chunk := await stream.receive_some(RELAY_CHUNK):
                            self.count += len(chunk)
                            try:
                                await trio.to_thread.run_sync(
                                    _write_all, sink, write, chunk, piece, wake
                                )
                            except (OSError, _Woken):  # EPIPE, a sink gone bad; or cancelled
                                return
            finally:
                self.done.set()


class _Woken(Exception):
    """The relay was cancelled while its thread waited on a host descriptor."""


@contextlib.asynccontextmanager
async def _woken_when_cancelled() -> AsyncIterator[int]:
    """A wake-up descriptor for the threads of one relay: readable once the relay's task
    is cancelled (or done), so a thread waiting in ``poll`` returns instead of being
    abandoned. Its threads are waited for (not abandoned): they return at the wake-up."""
    wake_r, wake_w = os.pipe2(os.O_CLOEXEC)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_wake_on_cancel, wake_w)
            yield wake_r
            nursery.cancel_scope.cancel()
    finally:
        os.close(wake_r)
        os.close(wake_w)


async def _wake_on_cancel(wake_w: int) -> None:
    try:
        await trio.sleep_forever()
    finally:
        os.write(wake_w, b"\0")


def _is_pipe(fd: int) -> bool:
    try:
        return stat.S_ISFIFO(os.fstat(fd).st_mode)
    except OSError:
        return False


def _read_some(fd: int, read: Callable[[], bytes], wake: int) -> bytes:
    """A chunk of ``fd`` (with ``read``: :func:`_nonblocking_reads`); empty at its end,
    when it cannot be read (EIO: a terminal hung up; EBADF: no stdin at all), which ends
    the command's input the same way, or when ``wake`` says the relay was cancelled."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    poller.register(wake, select.POLLIN)
    while True:
        if any(ready == wake for ready, _ in poller.poll()):
            return b""
        try:
            return read()
        except BlockingIOError:  # another reader emptied it, or less than a read waits for
            continue
        except OSError:
            return b""


@contextlib.contextmanager
def _nonblocking_reads(fd: int) -> Iterator[Callable[[], bytes]]:
    """How to read ``fd`` without blocking once ``poll`` said it is readable, where a
    blocking read could still wait (a socket's SO_RCVLOWAT; a terminal another process
    reads too: a background job's, whose shell takes the line first), its flags left as
    they are (:func:`_nonblocking_target`)."""
    with _nonblocking_target(fd, os.O_RDONLY) as target:
        if isinstance(target, socket.socket):
            yield lambda: target.recv(RELAY_CHUNK, socket.MSG_DONTWAIT)
        else:
            yield functools.partial(os.read, target, RELAY_CHUNK)


@contextlib.contextmanager
def _nonblocking_writes(fd: int) -> Iterator[Callable[[memoryview], int]]:
    """How to write to ``fd`` without blocking where ``poll`` promises room for some
    bytes but not for a whole chunk (a socket, a terminal: a blocking write there would
    hold the relay, and so the run's end, until its reader reads again), its flags left
    as they are (:func:`_nonblocking_target`)."""
    with _nonblocking_target(fd, os.O_WRONLY) as target:
        if isinstance(target, socket.socket):
            yield lambda view: target.send(view, socket.MSG_DONTWAIT)
        else:
            yield functools.partial(os.write, target)


@contextlib.contextmanager
def _nonblocking_target(fd: int, access: int) -> Iterator[socket.socket | int]:
    """What to read or write (``access``) ``fd`` through without blocking and without
    changing its flags (shared with whoever passed it): a socket object on it (used
    with MSG_DONTWAIT; detached, never closed, at the end); a terminal's non-blocking
    open file of its own, made only when it is the same terminal (a descriptor of
    /dev/tty would reopen as the daemon's own; closed at the end); else ``fd`` itself
    (a pipe, a regular file, /dev/null, a terminal that cannot be reopened: a pipe takes
    ``PIPE_BUF`` once poll says so)."""
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        mode = 0
    if stat.S_ISSOCK(mode):
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            pass
        else:
            try:
                yield sock
            finally:
                sock.detach()
            return
    own = _reopened_terminal(fd, access) if stat.S_ISCHR(mode) else None
    if own is None:
        yield fd
        return
    try:
        yield own
    finally:
        os.close(own)


def _reopened_terminal(fd: int, access: int) -> int | None:
    """A non-blocking descriptor of its own (``access``: O_RDONLY, O_WRONLY) on the
    terminal ``fd`` is, or None (not a terminal, or not one this process can reopen as
    the same device)."""
    try:
        device = _terminal_device(fd)
        own = os.open(f"/proc/self/fd/{fd}", access | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if _terminal_device(own) == device:
            return own
    except OSError:
        pass
    os.close(own)
    return None


def _terminal_device(fd: int) -> bytes:
    """The device of the terminal behind ``fd`` (TIOCGDEV: /dev/tty's own, for one opened
    as /dev/tty). OSError (ENOTTY) when ``fd`` is no terminal."""
    return fcntl.ioctl(fd, _TIOCGDEV, b"\0" * 4)


def _write_all(
    fd: int, write: Callable[[memoryview], int], data: bytes, piece: int, wake: int
) -> None:
    """All of ``data`` to ``fd`` (with ``write``: :func:`_nonblocking_writes`), at most
    ``piece`` bytes per write, each once ``poll`` says ``fd`` has room.

    Error handling: OSError as the system reports it (EPIPE: the reader is gone);
    :class:`_Woken` when ``wake`` says the relay was cancelled."""
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    poller.register(wake, select.POLLIN)
    view = memoryview(data)
    while view:
        if any(ready == wake for ready, _ in poller.poll()):
            raise _Woken
        try:
            view = view[write(view[:piece]) :]
        except BlockingIOError:  # filled meanwhile (or less room than poll said): wait
            continue
