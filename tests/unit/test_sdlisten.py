"""Socket activation (gatewayd/sdlisten.py) against real descriptors passed the way
systemd passes them: a child process started with the socket at descriptor 3 and
LISTEN_FDS / LISTEN_PID / LISTEN_FDNAMES set for it (its own pid, or another)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gatewayd.sdlisten import PassedSocketError, listen_fds

# Run as the child: puts each given descriptor at 3, 4, ... (as systemd does), sets
# LISTEN_PID to its own pid unless told another, then takes the control socket.
_SYSTEMD_LIKE = """
import json, os, sys
fds = [int(fd) for fd in sys.argv[1].split(",") if fd]
staged = [os.dup(fd) for fd in fds]  # out of the way of 3, 4, ... first
for offset, fd in enumerate(staged):
    os.dup2(fd, 3 + offset)
pid = sys.argv[2]
os.environ["LISTEN_PID"] = str(os.getpid()) if pid == "self" else pid
from pathlib import Path
from gatewayd.sdlisten import PassedSocketError, listen_fds, passed_control_socket
try:
    passed = listen_fds()
    sock = passed_control_socket(passed, Path(sys.argv[3]))
except PassedSocketError as exc:
    print(json.dumps({"error": str(exc)}))
    sys.exit(0)
left = sorted(k for k in os.environ if k.startswith("LISTEN_"))
if sock is None:
    print(json.dumps({"passed": [], "left": left}))
    sys.exit(0)
conn, _ = sock.accept()  # the test connected before this process started
conn.sendall(b"served")
print(json.dumps({"passed": [[p.fd, p.name] for p in passed], "left": left,
                  "cloexec": [bool(__import__("fcntl").fcntl(p.fd, 1) & 1) for p in passed],
                  "bound": sock.getsockname()}))
"""


def systemd_like(
    *socks: socket.socket | int,
    path: Path,
    count: str | None = None,
    names: str | None = None,
    pid: str = "self",
) -> dict[str, object]:
    """Start the child with ``socks`` passed at 3, 4, ...; its JSON answer."""
    fds = [s if isinstance(s, int) else s.fileno() for s in socks]
    env = {k: v for k, v in os.environ.items() if not k.startswith("LISTEN_")}
    env["LISTEN_FDS"] = count if count is not None else str(len(fds))
    if names is not None:
        env["LISTEN_FDNAMES"] = names
    done = subprocess.run(
        [sys.executable, "-c", _SYSTEMD_LIKE, ",".join(map(str, fds)), pid, str(path)],
        pass_fds=fds,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    *logged, last = done.stdout.splitlines()
    answer: dict[str, object] = json.loads(last)
    if logged:  # gatewayd's log lines (structlog's console output here)
        answer["logged"] = logged
    return answer


@pytest.fixture
def control(short_tmp: Path) -> Iterator[tuple[socket.socket, Path]]:
    """A listening unix stream socket at short_tmp/control.sock, as gatewayd.socket's."""
    path = short_tmp / "control.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(8)
    try:
        yield sock, path
    finally:
        sock.close()


@pytest.mark.fresh_interpreter
def test_the_passed_control_socket_is_served_and_the_variables_are_gone(
    control: tuple[socket.socket, Path],
) -> None:
    sock, path = control
    # A client that connects before gatewayd runs waits in the backlog: not ENOENT.
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.connect(str(path))
        answer = systemd_like(sock, path=path, names="control")
        assert client.recv(16) == b"served"
    assert answer == {
        "passed": [[3, "control"]],
        "left": [],  # no child of gatewayd's takes them for its own
        "cloexec": [True],
        "bound": str(path),
    }


@pytest.mark.fresh_interpreter
def test_an_unnamed_single_socket_is_taken_as_the_control_socket(
    control: tuple[socket.socket, Path],
) -> None:
    sock, path = control
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.connect(str(path))
        answer = systemd_like(sock, path=path)
        assert client.recv(16) == b"served"
    assert answer["passed"] == [[3, "unknown"]]


@pytest.mark.fresh_interpreter
def test_variables_for_another_process_are_ignored_and_removed(
    control: tuple[socket.socket, Path],
) -> None:
    sock, path = control
    # Inherited from a parent that was socket-activated: not this process's.
    answer = systemd_like(sock, path=path, names="control", pid="1")
    logged = answer.pop("logged")
    assert answer == {"passed": [], "left": []}
    assert "listen_fds_not_ours" in str(logged) and "listen_pid=1" in str(logged)


def test_without_listen_fds_nothing_is_passed() -> None:
    env: dict[str, str] = {"LISTEN_PID": "1", "LISTEN_FDNAMES": "control"}
    assert listen_fds(env) == ()
    assert env == {}  # removed all the same


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"LISTEN_FDS": "1"}, "$LISTEN_PID is None, not a process id"),
        ({"LISTEN_FDS": "1", "LISTEN_PID": "x1"}, "$LISTEN_PID is 'x1', not a process id"),
        ({"LISTEN_FDS": "0", "LISTEN_PID": "SELF"}, "$LISTEN_FDS is '0': expected a count"),
        ({"LISTEN_FDS": "-1", "LISTEN_PID": "SELF"}, "$LISTEN_FDS is '-1'"),
        ({"LISTEN_FDS": "65", "LISTEN_PID": "SELF"}, "from 1 to 64"),
        ({"LISTEN_FDS": "two", "LISTEN_PID": "SELF"}, "$LISTEN_FDS is 'two'"),
        # Digits to str.isdigit() that int() refuses: a clear refusal, not a traceback.
        ({"LISTEN_FDS": "\u00b9", "LISTEN_PID": "SELF"}, "$LISTEN_FDS is '\u00b9'"),
        ({"LISTEN_FDS": "1", "LISTEN_PID": "\u00b2"}, "$LISTEN_PID is '\u00b2', not a process"),
    ],
)
def test_malformed_variables_are_refused_saying_which(env: dict[str, str], message: str) -> None:
    env = {k: str(os.getpid()) if v == "SELF" else v for k, v in env.items()}
    with pytest.raises(PassedSocketError) as caught:
        listen_fds(env)
    assert message in str(caught.value)
    assert env == {}


@pytest.mark.fresh_interpreter
def test_a_counted_descriptor_that_is_not_open_is_refused(
    control: tuple[socket.socket, Path],
) -> None:
    sock, path = control
    answer = systemd_like(sock, path=path, count="2", names="control:extra")
    assert answer == {
        "error": "$LISTEN_FDS counts descriptor 4 (extra) but it is not open (Bad file "
        "descriptor): the environment does not describe this process"
    }


def _error(answer: dict[str, object]) -> str:
    assert set(answer) == {"error"}, answer
    return str(answer["error"])


@pytest.mark.fresh_interpreter
def test_a_descriptor_that_is_not_a_socket_is_refused(short_tmp: Path) -> None:
    with (short_tmp / "file").open("w") as file:
        error = _error(systemd_like(file.fileno(), path=short_tmp / "c.sock", names="control"))
    assert error.startswith("the passed descriptor 3 (control) is not a socket")
    assert "ListenStream=" in error


@pytest.mark.fresh_interpreter
def test_a_tcp_socket_is_refused() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen(1)
        error = _error(systemd_like(tcp, path=Path("/x/c.sock"), names="control"))
    assert "is a AF_INET socket, not AF_UNIX" in error


@pytest.mark.fresh_interpreter
def test_a_datagram_socket_is_refused(short_tmp: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as dgram:
        dgram.bind(str(short_tmp / "d.sock"))
        error = _error(systemd_like(dgram, path=short_tmp / "d.sock", names="control"))
    assert "is a SOCK_DGRAM socket, not SOCK_STREAM" in error


@pytest.mark.fresh_interpreter
def test_a_connected_socket_is_refused(short_tmp: Path) -> None:
    one, other = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with one, other:
        error = _error(systemd_like(one, path=short_tmp / "c.sock", names="control"))
    assert "is not listening" in error


@pytest.mark.fresh_interpreter
def test_a_socket_bound_elsewhere_is_refused_naming_both_paths(
    control: tuple[socket.socket, Path], short_tmp: Path
) -> None:
    sock, path = control
    error = _error(systemd_like(sock, path=short_tmp / "configured.sock", names="control"))
    assert (
        f"is bound at {path}, but gatewayd's control socket is {short_tmp}/configured.sock" in error
    )
    assert "ListenStream=" in error and "control_socket" in error


@pytest.mark.fresh_interpreter
def test_an_abstract_socket_is_refused(short_tmp: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as abstract:
        abstract.bind(f"\0cogni-sdlisten-{os.getpid()}")
        abstract.listen(1)
        error = _error(systemd_like(abstract, path=short_tmp / "c.sock", names="control"))
    assert "not a path" in error


@pytest.mark.fresh_interpreter
def test_several_descriptors_without_one_named_control_are_refused(
    control: tuple[socket.socket, Path],
) -> None:
    sock, path = control
    error = _error(systemd_like(sock, sock, path=path, names="web:admin"))
    assert "passed 2 descriptors named web, admin" in error
    assert "FileDescriptorName=control" in error


@pytest.mark.fresh_interpreter
def test_the_one_named_control_is_chosen_among_several(
    control: tuple[socket.socket, Path], short_tmp: Path
) -> None:
    sock, path = control
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other:
        other.bind(str(short_tmp / "other.sock"))
        other.listen(1)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(path))
            answer = systemd_like(other, sock, path=path, names="metrics:control")
            assert client.recv(16) == b"served"
    assert answer["passed"] == [[3, "metrics"], [4, "control"]]
