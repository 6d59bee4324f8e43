"""The relay between a passed-through command's pipes and host descriptors, on real
pipes: every byte in order and counted, end of input passed on, a reader that goes away
stops the copy (the writer then gets EPIPE), and nothing unbounded is held."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import os
import resource
import select
import socket
import struct
import termios
import threading
import time
import tty
from collections.abc import Callable, Iterator
from typing import Any, cast

import pytest
import trio

from gatewayd.sandbox.launch import run_in_sandbox
from gatewayd.sandbox.limits import HostUser, SandboxLimits
from gatewayd.sandbox.passthrough import RELAY_CHUNK, Passthrough, Relay

# Polls 10 ms apart in which nothing moved: the relay and the command are held.
STILL_POLLS = 20
# A relay's thread is in its next read or write well within this once the relay has
# taken its input (a cancellation before would test nothing).
SETTLE_S = 0.05


def _read_all(fd: int) -> bytes:
    data = bytearray()
    while chunk := os.read(fd, 1 << 16):
        data += chunk
    return bytes(data)


async def test_feed_copies_every_byte_then_ends_the_commands_input() -> None:
    host_r, host_w = os.pipe()  # stands for gatewayd's stdin
    cmd_r, cmd_w = os.pipe()  # the command's stdin pipe
    data = os.urandom(5 * RELAY_CHUNK + 17)  # several chunks and a ragged end
    relay = Relay()
    received: list[bytes] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay.feed, host_r, trio.lowlevel.FdStream(cmd_w))
        nursery.start_soon(trio.to_thread.run_sync, lambda: received.append(_read_all(cmd_r)))
        await trio.to_thread.run_sync(os.write, host_w, data)
        os.close(host_w)  # end of gatewayd's input ...
    # ... is end of the command's input: the reader above saw EOF, or it would hang.
    assert received == [data] and relay.count == len(data) and relay.done.is_set()
    os.close(host_r)
    os.close(cmd_r)


async def test_feed_stops_quietly_when_the_command_closes_its_input() -> None:
    host_r, host_w = os.pipe()
    cmd_r, cmd_w = os.pipe()
    os.close(cmd_r)  # the command closed its stdin (or ended)
    os.write(host_w, b"more input\n")
    relay = Relay()
    with trio.fail_after(5):
        await relay.feed(host_r, trio.lowlevel.FdStream(cmd_w))
    assert relay.done.is_set() and relay.count == 0  # nothing reached the command
    os.close(host_r)
    os.close(host_w)


async def test_feed_treats_an_unreadable_input_as_its_end() -> None:
    # gatewayd's stdin gone bad (a hung-up terminal reads EIO; here: not a descriptor):
    # the command sees end of input rather than gatewayd failing.
    cmd_r, cmd_w = os.pipe()
    # At the open-files limit: never a descriptor (a closed one's number is taken again
    # by the next pipe, the relay's own wake-up pipe included).
    bad = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    relay = Relay()
    with trio.fail_after(5):
        await relay.feed(bad, trio.lowlevel.FdStream(cmd_w))
    assert os.read(cmd_r, 10) == b""
    os.close(cmd_r)


async def test_drain_copies_the_commands_output_as_it_comes() -> None:
    cmd_r, cmd_w = os.pipe()  # the command's stdout pipe
    host_r, host_w = os.pipe()  # stands for gatewayd's stdout
    relay = Relay()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay.drain, trio.lowlevel.FdStream(cmd_r), host_w)
        for line in (b"one\n", b"two\n"):
            os.write(cmd_w, line)
            # Each line arrives while the writer is still open: streamed, not at the end.
            with trio.fail_after(5):
                await trio.lowlevel.wait_readable(host_r)
            assert os.read(host_r, 100) == line
        os.close(cmd_w)
    assert relay.count == 8 and relay.done.is_set()
    os.close(host_r)
    os.close(host_w)


async def test_a_reader_that_goes_away_stops_the_drain_and_the_command_gets_epipe() -> None:
    # `gatewayd run -- yes | head -1`: once head is gone, yes must stop as it would
    # without gatewayd, not run on until its timeout while gatewayd discards its output.
    cmd_r, cmd_w = os.pipe()
    host_r, host_w = os.pipe()
    os.close(host_r)  # the host's reader is gone
    os.write(cmd_w, b"y\n")
    relay = Relay()
    with trio.fail_after(5):
        await relay.drain(trio.lowlevel.FdStream(cmd_r), host_w)
    with pytest.raises(OSError) as caught:
        os.write(cmd_w, b"y\n")
    assert caught.value.errno == errno.EPIPE
    os.close(cmd_w)
    os.close(host_w)


async def test_a_reader_that_stops_reading_holds_back_the_command_not_gatewayd() -> None:
    # Backpressure: with nobody reading the host side, the relay holds at most a chunk
    # in flight and the command's pipe fills, so the command blocks; gatewayd's memory
    # does not grow with what the command would write.
    cmd_r, cmd_w = os.pipe()
    host_r, host_w = os.pipe()
    os.set_blocking(cmd_w, False)
    relay = Relay()
    written = 0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay.drain, trio.lowlevel.FdStream(cmd_r), host_w)
        # Written until neither the command nor the relay has moved for STILL_POLLS
        # polls in a row (a relay that held more would go on taking the command's
        # output), or for at most a second.
        with trio.move_on_after(1):
            still = 0
            while still < STILL_POLLS:
                before = (written, relay.count)
                try:
                    written += os.write(cmd_w, b"x" * RELAY_CHUNK)
                except BlockingIOError:
                    await trio.sleep(0.01)
                still = still + 1 if (written, relay.count) == before else 0
        # Two pipes and the chunk in hand, nothing more: the command could not go on.
        assert written <= 4 * RELAY_CHUNK + relay.count
        assert relay.count <= 3 * RELAY_CHUNK
        nursery.cancel_scope.cancel()
    for fd in (cmd_w, host_r, host_w):
        os.close(fd)


async def test_passthrough_takes_neither_stdin_bytes_nor_an_echo() -> None:
    # One source and one destination per stream: refused before anything starts.
    streams = Passthrough(stdin=0, stdout=1, stderr=2)
    common: dict[str, Any] = {
        "netns": "/nonexistent",
        "limits": SandboxLimits(),
        "host_user": HostUser(uid=65534, gid=65534),
        "passthrough": streams,
    }
    plan = cast(Any, None)  # never reached
    with pytest.raises(ValueError, match="no stdin bytes and no echo"):
        await run_in_sandbox(plan, stdin=b"x", **common)
    with pytest.raises(ValueError, match="no stdin bytes and no echo"):
        await run_in_sandbox(plan, echo=(print, print), **common)


async def test_host_descriptors_left_non_blocking_are_waited_on_not_taken_for_their_end() -> None:
    # Whoever started gatewayd may hand it non-blocking pipes: "nothing yet" (EAGAIN)
    # on stdin is not end of input, and a full stdout is waited on, not a broken one.
    host_in_r, host_in_w = os.pipe()
    host_out_r, host_out_w = os.pipe()
    cmd_in_r, cmd_in_w = os.pipe()
    cmd_out_r, cmd_out_w = os.pipe()
    for fd in (host_in_r, host_out_w):
        os.set_blocking(fd, False)
    feed, drain = Relay(), Relay()
    big = os.urandom(2 * RELAY_CHUNK)  # more than the host's stdout pipe holds
    got = bytearray()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(feed.feed, host_in_r, trio.lowlevel.FdStream(cmd_in_w))
        nursery.start_soon(drain.drain, trio.lowlevel.FdStream(cmd_out_r), host_out_w)
        await trio.sleep(0.2)  # stdin empty for a while: the feed must keep waiting
        assert not feed.done.is_set()
        os.write(host_in_w, b"late\n")
        os.close(host_in_w)
        assert await trio.to_thread.run_sync(_read_all, cmd_in_r) == b"late\n"
        await trio.to_thread.run_sync(os.write, cmd_out_w, big)  # fills, then waits
        os.close(cmd_out_w)
        await trio.sleep(0.2)
        assert not drain.done.is_set()  # still waiting on the full stdout, not given up
        got += await trio.to_thread.run_sync(_read_all_nonblocking_writer, host_out_r, drain)
    assert bytes(got) == big and drain.count == len(big)
    for fd in (host_in_r, host_out_r, host_out_w, cmd_in_r):
        os.close(fd)


def _read_all_nonblocking_writer(fd: int, relay: Relay) -> bytes:
    """What ``relay`` copies to ``fd`` until it is done (its writer is never closed)."""
    data = bytearray()
    while not (relay.done.is_set() and not select.select([fd], [], [], 0)[0]):
        if select.select([fd], [], [], 0.05)[0]:
            data += os.read(fd, 1 << 16)
    return bytes(data)


@pytest.mark.parametrize("stream", [None, io.StringIO()], ids=["closed", "no-descriptor"])
def test_a_standard_stream_without_a_descriptor_of_ours_is_relayed_as_dev_null(
    stream: io.StringIO | None,
) -> None:
    from gatewayd.cli.run import _own_descriptor

    opened: list[int] = []
    fd = _own_descriptor(stream, os.O_RDONLY, opened)
    try:
        assert os.path.samestat(os.fstat(fd), os.stat(os.devnull))
        assert opened == [fd]  # the caller closes it
    finally:
        for each in opened:
            os.close(each)


async def test_a_cancelled_feed_leaves_no_thread_reading_the_hosts_input() -> None:
    # The command ended without reading its input (stdin an operator's terminal, in a
    # serving daemon relaying an attached `gatewayd run`): what is typed afterwards is
    # the shell's, never taken by a reader the relay left behind.
    host_r, host_w = os.pipe()
    cmd_r, cmd_w = os.pipe()
    relay = Relay()
    with trio.move_on_after(0.2):
        await relay.feed(host_r, trio.lowlevel.FdStream(cmd_w))
    assert relay.done.is_set()
    os.write(host_w, b"typed later\n")
    await trio.sleep(0.2)  # a reader left behind would have taken it by now
    os.set_blocking(host_r, False)
    assert os.read(host_r, 100) == b"typed later\n"
    for fd in (host_r, host_w, cmd_r):
        os.close(fd)


async def test_a_cancelled_drain_writes_nothing_more_to_a_full_host_output() -> None:
    # The host's reader stopped reading (a pager): a cancelled relay stops at once and
    # leaves no thread behind that would go on writing once the reader reads again.
    cmd_r, cmd_w = os.pipe()
    host_r, host_w = os.pipe()
    os.set_blocking(host_w, False)
    with contextlib.suppress(BlockingIOError):
        while True:
            os.write(host_w, b"x" * 4096)  # the host's pipe full
    os.set_blocking(host_w, True)
    os.write(cmd_w, b"y" * 1000)
    relay = Relay()
    with trio.fail_after(5):
        with trio.move_on_after(0.3):
            await relay.drain(trio.lowlevel.FdStream(cmd_r), host_w)
    assert relay.done.is_set()
    os.set_blocking(host_r, False)
    seen = bytearray()
    for _ in range(2):
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(host_r, 1 << 16):  # the reader reads again
                seen += chunk
        await trio.sleep(0.2)  # a writer left behind would write its chunk now
    assert b"y" not in seen
    for fd in (cmd_w, host_r, host_w):
        os.close(fd)


def _stuck_socket_sink() -> tuple[int, socket.socket]:
    """A socket whose reader never reads, with a small send buffer: ``poll`` says it
    has room while a relay chunk does not fit."""
    ours, peer = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    return ours.detach(), peer


def _stuck_tty_sink() -> tuple[int, int]:
    """A terminal whose screen reads nothing (a pty's master never read; an operator's
    ^S does the same to a real one)."""
    master, slave = os.openpty()
    return slave, master


def _pending(fd: int) -> int:
    """The bytes waiting to be read in the pipe ``fd``."""
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]


async def settled_once(reached: Callable[[], bool]) -> None:
    """Until ``reached()`` (the relay has taken or passed what it was given), then
    SETTLE_S more, for its thread to be in the read or write that follows."""
    with trio.fail_after(5):
        while not reached():
            await trio.sleep(0.005)
    await trio.sleep(SETTLE_S)


@contextlib.contextmanager
def rescued_if_held(relay: Relay, unblock: Callable[[], object]) -> Iterator[threading.Event]:
    """So a relay held on a host descriptor fails its test instead of hanging it: after
    10 s, ``unblock`` is called until the relay is done, and the event says it had to."""
    rescued = threading.Event()

    def rescue() -> None:
        while not relay.done.is_set():
            rescued.set()
            with contextlib.suppress(OSError):
                unblock()
            time.sleep(0.05)

    timer = threading.Timer(10.0, rescue)
    timer.start()
    try:
        yield rescued
    finally:
        timer.cancel()


@pytest.mark.parametrize("kind", ["socket", "tty"])
async def test_a_cancelled_drain_returns_while_a_socket_or_terminal_takes_nothing(
    kind: str,
) -> None:
    # A serving daemon relays an attached client's stdout, which may be a socket or the
    # operator's terminal: poll says either has room while a whole chunk does not fit, and
    # a blocking write of it would hold the relay (the run's end, the daemon's stop) until
    # that reader reads again.
    if kind == "socket":
        sink, keep = _stuck_socket_sink()
        unblock: Callable[[], object] = lambda: keep.recv(1 << 20)  # noqa: E731
    else:
        sink, master = _stuck_tty_sink()
        unblock = lambda: os.read(master, 1 << 20)  # noqa: E731
    cmd_r, cmd_w = os.pipe()
    os.set_blocking(cmd_w, False)
    with contextlib.suppress(BlockingIOError):
        os.write(cmd_w, b"z" * RELAY_CHUNK)  # a whole chunk waiting for the relay
    relay = Relay()
    with rescued_if_held(relay, unblock) as rescued:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(relay.drain, trio.lowlevel.FdStream(cmd_r), sink)
            await settled_once(lambda: _pending(cmd_r) == 0)  # the relay holds the chunk
            nursery.cancel_scope.cancel()
    assert relay.done.is_set() and not rescued.is_set()
    for fd in (cmd_w, sink):
        os.close(fd)
    if kind == "socket":
        keep.close()
    else:
        os.close(master)


async def test_a_cancelled_feed_returns_while_its_socket_holds_less_than_a_read_waits_for() -> None:
    # An attached client's stdin may be a socket it set SO_RCVLOWAT on: poll says it is
    # readable with a few bytes in, while a blocking read waits for more. The relay must
    # still stop when the command ends, or the run's end (and the daemon's stop) waits on
    # that client.
    ours, peer = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1 << 16)
    peer.sendall(b"a few bytes")
    cmd_r, cmd_w = os.pipe()
    relay = Relay()
    with rescued_if_held(relay, lambda: peer.sendall(b"z" * (1 << 16))) as rescued:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(relay.feed, ours.fileno(), trio.lowlevel.FdStream(cmd_w))
            # What had come was passed on; the relay waits for more.
            await settled_once(lambda: _pending(cmd_r) == len(b"a few bytes"))
            nursery.cancel_scope.cancel()
    assert relay.done.is_set() and not rescued.is_set()
    assert os.read(cmd_r, 100) == b"a few bytes"  # what had come was passed on
    os.close(cmd_r)
    ours.close()
    peer.close()


@pytest.mark.parametrize("kind", ["socket", "tty"])
async def test_a_socket_or_terminal_is_relayed_whole_both_ways_its_flags_untouched(
    kind: str,
) -> None:
    # Written and read without blocking (their own flags or MSG_DONTWAIT), yet every byte
    # passes, and the descriptor shared with the client's shell stays blocking.
    data = os.urandom(3 * RELAY_CHUNK + 5)
    if kind == "socket":
        a, b = socket.socketpair()
        ours, theirs = a.detach(), b.detach()
    else:
        theirs, ours = os.openpty()
        tty.setraw(ours)  # bytes as they are: no echo, no newline translation
    out_r, out_w = os.pipe()
    in_r, in_w = os.pipe()
    os.write(in_w, data[:1000])
    os.close(in_w)
    got: list[bytes] = []

    def read_back(fd: int, size: int) -> None:
        seen = bytearray()
        while len(seen) < size and (chunk := os.read(fd, 1 << 16)):
            seen += chunk
        got.append(bytes(seen))

    drain, feed = Relay(), Relay()
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain.drain, trio.lowlevel.FdStream(in_r), ours)
            await trio.to_thread.run_sync(read_back, theirs, 1000)
            nursery.start_soon(feed.feed, ours, trio.lowlevel.FdStream(out_w))
            nursery.start_soon(trio.to_thread.run_sync, os.write, theirs, data)
            await trio.to_thread.run_sync(read_back, out_r, len(data))
            nursery.cancel_scope.cancel()
    assert got == [data[:1000], data]
    assert os.get_blocking(ours)
    for fd in (ours, theirs, out_r):
        os.close(fd)
