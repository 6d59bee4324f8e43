"""`gatewayd serve` socket-activated as gatewayd.socket does it: the test holds the
listening control socket (as systemd does), passes it at descriptor 3 with LISTEN_FDS,
LISTEN_PID and LISTEN_FDNAMES, and checks that a client who connected before the daemon
ran is answered, that a stop leaves the path in place, and that the next daemon serves
the same socket."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.livedaemon import BIN

# The exec step of systemd's socket activation: the socket at descriptor 3, LISTEN_PID
# naming the process that will exec gatewayd (exec keeps the pid).
_ACTIVATE = (
    "import os, sys; os.dup2(int(sys.argv[1]), 3); "
    "os.environ['LISTEN_PID'] = str(os.getpid()); os.execv(sys.argv[2], sys.argv[2:])"
)
HEALTH = b"GET /v1/health HTTP/1.1\r\nHost: gatewayd\r\nConnection: close\r\n\r\n"


@pytest.fixture
def notify_socket(short_tmp: Path) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(short_tmp / "notify"))
    sock.settimeout(60)
    try:
        yield sock
    finally:
        sock.close()


@pytest.fixture
def held(short_tmp: Path) -> Iterator[socket.socket]:
    """The control socket as gatewayd.socket holds it: bound and listening at
    <state>/control.sock before any gatewayd runs."""
    state = short_tmp / "state"
    state.mkdir(mode=0o711)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(state / "control.sock"))
    sock.listen(16)
    try:
        yield sock
    finally:
        sock.close()


def activated(
    held: socket.socket, state: Path, notify: socket.socket | None
) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LISTEN_", "NOTIFY_"))}
    env |= {"LISTEN_FDS": "1", "LISTEN_FDNAMES": "control"}
    if notify is not None:
        env["NOTIFY_SOCKET"] = notify.getsockname()
    return subprocess.Popen(
        [sys.executable, "-c", _ACTIVATE, str(held.fileno()), str(BIN / "gatewayd"), "serve",
         "--state-dir", str(state), "--no-os-sandbox"],
        pass_fds=[held.fileno()],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )  # fmt: skip


def stop(proc: subprocess.Popen[bytes]) -> tuple[bytes, bytes]:
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    return out, err


def answer(client: socket.socket) -> bytes:
    client.sendall(HEALTH)
    chunks = []
    while chunk := client.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def test_a_passed_control_socket_is_served_and_outlives_every_stop(
    short_tmp: Path, held: socket.socket, notify_socket: socket.socket
) -> None:
    state = short_tmp / "state"
    path = state / "control.sock"
    bound = os.lstat(path)
    early = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    early.settimeout(60)
    with early:
        early.connect(str(path))  # before any gatewayd: it waits in the backlog
        first = activated(held, state, notify_socket)
        try:
            assert notify_socket.recv(4096).decode().startswith("READY=1")
            assert answer(early).startswith(b"HTTP/1.1 200")
        finally:
            out, _ = stop(first) if first.poll() is None else first.communicate()
    assert notify_socket.recv(4096).decode().startswith("STOPPING=1")
    assert b'"socket_activated": true' in out
    # The path is systemd's: still there, the same socket, still taking connections.
    after = os.lstat(path)
    assert (after.st_ino, after.st_dev) == (bound.st_ino, bound.st_dev)
    waiting = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    waiting.settimeout(60)
    with waiting:
        waiting.connect(str(path))  # between two daemons: queued, not refused
        second = activated(held, state, notify_socket)
        try:
            assert notify_socket.recv(4096).decode().startswith("READY=1")
            assert answer(waiting).startswith(b"HTTP/1.1 200")
        finally:
            stop(second)
    assert os.lstat(path).st_ino == bound.st_ino


def test_a_passed_socket_bound_elsewhere_refuses_the_start_naming_both(
    short_tmp: Path, held: socket.socket
) -> None:
    other_state = short_tmp / "other"
    proc = activated(held, other_state, None)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, out + err
    message = err.decode()
    assert message.startswith("gatewayd: refused to start: the passed descriptor 3 (control)")
    assert f"is bound at {short_tmp}/state/control.sock" in message
    assert f"gatewayd's control socket is {other_state}/control.sock" in message
    assert not (other_state / "control.sock").exists()
