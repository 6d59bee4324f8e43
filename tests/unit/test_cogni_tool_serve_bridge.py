"""``cogni-tool serve ... -- COMMAND``: the egress bridge beside one command (a process
tool's call granted network), run here on the host with real sockets and processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cogni_tool.serve import parse_serve_args

ROOT = Path(__file__).resolve().parents[2]


def test_a_command_after_the_separator_is_kept_whole() -> None:
    options = parse_serve_args(
        ["--proxy-port", "3128", "--egress-socket", "/run/e.sock", "--", "tool", "--", "-x"]
    )
    assert options.proxy_port == 3128 and options.egress_socket == "/run/e.sock"
    assert options.command == ("tool", "--", "-x")
    assert parse_serve_args(["--proxy-port", "1", "--egress-socket", "/e"]).command == ()


@pytest.mark.parametrize(
    ("words", "says"),
    [
        (["--proxy-port", "1", "--egress-socket", "/e", "--"], "needs a command after it"),
        (["--openai-port", "1", "--", "tool"], "egress bridge alone"),
        (
            ["--openai-port", "2", "--proxy-port", "1", "--egress-socket", "/e", "--", "t"],
            "egress bridge alone",
        ),
        (["--", "tool"], "nothing to serve"),
    ],
)
def test_a_command_runs_beside_the_egress_bridge_alone(words: list[str], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_serve_args(words)


@pytest.fixture
def upstream(tmp_path: Path) -> Iterator[Path]:
    """A unix socket standing in for gatewayd's proxy: answers each connection with what
    it received, upper-cased."""
    path = tmp_path / "egress.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.sendall(conn.recv(1024).upper())

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield path
    finally:
        server.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(port: int, egress: Path, *command: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [
            *(sys.executable, "-m", "cogni_tool", "serve", "--proxy-port", str(port)),
            *("--egress-socket", str(egress), "--", *command),
        ],
        cwd=ROOT,
        input=b"the tool's stdin",
        capture_output=True,
        timeout=30,
        check=False,
    )


def bridges_left(port: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--proxy-port" in cmdline and str(port).encode() in cmdline:
            found.append(int(entry.name))
    return found


TOOL = """
import socket, sys
with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5) as s:
    s.sendall(b"through the bridge")
    answer = s.recv(1024)
print(sys.stdin.read(), answer.decode())
sys.exit(7)
"""


def test_the_command_reaches_the_proxy_keeps_its_stdio_and_status_and_the_bridge_ends(
    upstream: Path,
) -> None:
    port = free_port()
    done = serve(port, upstream, sys.executable, "-c", TOOL, str(port))
    # The tool's own stdout (no "ready"), its stdin, its exit status.
    assert done.stdout == b"the tool's stdin THROUGH THE BRIDGE\n", done.stderr
    assert done.returncode == 7 and done.stderr == b""
    deadline = time.monotonic() + 5
    while bridges_left(port) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert bridges_left(port) == []  # gone with the command


def test_a_command_that_cannot_run_exits_127_and_stops_the_bridge(upstream: Path) -> None:
    port = free_port()
    done = serve(port, upstream, "/nonexistent/tool")
    assert done.returncode == 127 and done.stdout == b""
    assert b"cannot run '/nonexistent/tool'" in done.stderr
    assert bridges_left(port) == []


def test_a_port_taken_is_said_and_nothing_runs(upstream: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = int(taken.getsockname()[1])
        done = serve(port, upstream, sys.executable, "-c", "print('ran')")
    assert done.returncode == 1 and b"cannot listen on 127.0.0.1" in done.stderr
    assert b"ran" not in done.stdout
    assert os.path.exists(upstream)
