"""Shared pieces of the benchmarks: start a real `gatewayd serve`, create a run over
the control socket, and drive framed requests from a separate load process.
"""

from __future__ import annotations

import compileall
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("gatewayd")
        self.unix_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.unix_path)


def control(path: Path, method: str, target: str, body: Any = None) -> tuple[int, Any]:
    conn = UnixHTTPConnection(str(path))
    payload = json.dumps(body).encode() if body is not None else None
    conn.request(method, target, body=payload, headers={"content-type": "application/json"})
    resp = conn.getresponse()
    data = json.loads(resp.read() or b"null")
    conn.close()
    return resp.status, data


def wait_until_serving(
    proc: subprocess.Popen[bytes], control_socket: Path, log_path: Path, timeout: float
) -> None:
    """Return once the ``gatewayd serve`` in ``proc`` answers /v1/health on its control
    socket; RuntimeError with its log when it exits or does not answer in ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:  # the socket file appears just before it listens
        try:
            if control(control_socket, "GET", "/v1/health")[0] == 200:
                return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"gatewayd serve did not start:\n{log_path.read_text()}")
        time.sleep(0.02)


def stop_serving(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """SIGTERM the daemon and wait for its clean stop; kill it if that takes longer than
    ``timeout``, so it never outlives the bench (nor runs over a state it removes)."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_for(path: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.02)


@contextmanager
def gatewayd_run(
    policy: Path, *, serve_args: Sequence[str] = (), launcher: Sequence[str] | None = None
) -> Iterator[tuple[str, str]]:
    """A real `gatewayd serve` with one run; yields (socket path, run id).

    ``serve_args`` are more `gatewayd serve` options (``--config``, ``--no-os-sandbox``);
    ``launcher`` replaces the `gatewayd` console script (a diagnostic wrapper that takes
    the same arguments).
    """
    base = Path(tempfile.mkdtemp(prefix="cogni-bench-"))
    ws = base / "ws"
    ws.mkdir()
    state = base / "state"
    ctl = state / "control.sock"
    program = list(launcher) if launcher is not None else [str(BIN / "gatewayd")]
    # The load comes from this host process, not from inside a sandbox (a sandboxed
    # run's socket refuses peers outside its network namespace): these benches measure
    # the gateway, bench/sandbox_launch.py the sandbox. Also, a daemon with the sandbox
    # removes every namespace of its prefix at start, other daemons' included.
    extra = [] if "--no-os-sandbox" in serve_args else ["--no-os-sandbox"]
    # The control socket names policies: the bench's own is found in its directory.
    extra += ["--policy-dir", str(Path(policy).parent)]
    cmd = [*program, "serve", "--state-dir", str(state), *extra, *serve_args]
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    try:
        wait_for(ctl)
        while True:  # the socket file appears just before it listens
            try:
                if control(ctl, "GET", "/v1/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.02)
        status, data = control(
            ctl,
            "POST",
            "/v1/runs",
            {
                "workspacePath": str(ws),
                "policy": Path(policy).stem,
                "actorId": "bench",
                "tenantId": "bench",
                "grant": {"allowSandbox": True},
            },
        )
        if status != 201:
            raise RuntimeError(f"run creation failed: {status} {data}")
        yield data["run"]["socket"], data["run"]["runId"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        subprocess.run(["rm", "-rf", str(base)], check=False)


ECHO_SERVER = r"""
import os, sys, trio, socket, struct
HEADER = struct.Struct(">I")
async def handle(stream):
    try:
        await echo(stream)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
async def echo(stream):
    buf = bytearray()
    async with stream:
        while True:
            data = await stream.receive_some(65536)
            if not data:
                return
            buf += data
            while len(buf) >= 4:
                (n,) = HEADER.unpack_from(buf)
                if len(buf) < 4 + n:
                    break
                frame = bytes(buf[: 4 + n]); del buf[: 4 + n]
                await stream.send_all(frame)
async def main(path):
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await sock.bind(path); sock.listen(128)
    await trio.serve_listeners(handle, [trio.SocketListener(sock)])
trio.run(main, sys.argv[1])
"""


@contextmanager
def echo_server() -> Iterator[str]:
    """The baseline: a bare trio unix-socket echo server with the same framing."""
    base = Path(tempfile.mkdtemp(prefix="cogni-echo-"))
    path = base / "echo.sock"
    proc = subprocess.Popen([sys.executable, "-c", ECHO_SERVER, str(path)])
    try:
        wait_for(path)
        yield str(path)
    finally:
        proc.kill()
        proc.wait()
        subprocess.run(["rm", "-rf", str(base)], check=False)


LOAD = str(Path(__file__).resolve().parent / "load.py")


def latency(path: str, run_id: str, mode: str, n: int) -> list[float]:
    out = subprocess.run(
        [sys.executable, LOAD, path, run_id, mode, "latency", str(n)],
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    ).stdout
    return list(json.loads(out))


def throughput(path: str, run_id: str, mode: str, conns: int, seconds: float) -> float:
    out = subprocess.run(
        [sys.executable, LOAD, path, run_id, mode, "load", str(conns), str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    ).stdout
    data = json.loads(out)
    return float(data["calls"]) / float(data["seconds"])


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


def compile_sources() -> None:
    """Write the bytecode of gatewayd and cogni_tool now, as an installed package has it
    from its install: with PYTHONDONTWRITEBYTECODE set (or a stale cache after an edit),
    every process timed would compile the modules it imports again, about 12 ms for
    ``gatewayd/cli/run.py`` alone, which no installed gatewayd pays."""
    for package in ("gatewayd", "cogni_tool"):
        compileall.compile_dir(ROOT / package, quiet=1)


def env_info() -> str:
    """The interpreter, with its own file (a virtualenv's base: its build, Debian's or
    one compiled without optimizations, moves every figure timed in Python by 10-25%),
    and the cores."""
    base = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    return f"python {sys.version.split()[0]} ({base}), {os.cpu_count()} cores"
