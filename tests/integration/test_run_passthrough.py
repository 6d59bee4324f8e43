"""`gatewayd run -- CMD` as a stage of a pipeline: CMD's stdin, stdout and stderr are
gatewayd run's own, streamed both ways as they come, with CMD's exit status.

Each test starts `gatewayd run` as a real process (a real daemon, a real bubblewrap
sandbox, a real uid and network namespace) and drives it through real pipes, the way a
shell pipeline or an MCP client on the host does. The properties: every byte arrives,
in order, at once (a line written is answered before the next is written); gatewayd's
own lines never enter the command's stdout; either side going away early ends the run
promptly; the command's timeout still holds whoever stalls; and gatewayd holds nothing
of a stream in memory however long it runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from tests.livedaemon import sandbox_options

PY = "/usr/bin/python3"
GATEWAYD = str(Path(sys.executable).parent / "gatewayd")

POLICY = """
version: 1
name: passthrough
tools:
  allow: [time.now]
filesystem:
  paths:
    workspace: {root: ., mode: rw}
sandbox: {timeout_s: TIMEOUT, max_output_bytes: 65536}
"""
# Long enough for any test's stream on a loaded 2-core machine; the timeout tests set
# their own.
TIMEOUT_S = 120
# How long one line may take to come back through gatewayd and the sandbox.
LINE_WAIT_S = 15.0
# How long gatewayd may take to end once its command has ended or been stopped: the
# run's teardown (uid, network namespace) plus a loaded machine's slack.
END_WAIT_S = 30.0
STREAM_BYTES = 50 * 1024 * 1024
BLOCK = 1024 * 1024
# What gatewayd's resident memory may grow by while STREAM_BYTES pass through it: far
# less than the stream (a relay holds a chunk per stream in flight).
MAX_GROWTH_BYTES = 16 * 1024 * 1024

ECHO_SERVER = r"""
import json, sys
for line in sys.stdin:
    request = json.loads(line)
    if "id" not in request:
        continue  # a notification: never answered
    if request["method"] == "echo":
        answer = {"jsonrpc": "2.0", "id": request["id"], "result": request["params"]}
    else:
        error = {"code": -32601, "message": "Method not found"}
        answer = {"jsonrpc": "2.0", "id": request["id"], "error": error}
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()
print("server: input ended", file=sys.stderr)
"""


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "sandboxed runs need root (network namespaces, a uid per run)"
    if not os.path.exists("/usr/bin/bwrap") or not os.path.exists(PY):
        return "needs bubblewrap at /usr/bin/bwrap and the system python3"
    return None


pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-pt-", dir="/tmp"))
    path.chmod(0o711)  # the sandbox's uid passes through to its workspace and socket
    (path / "ws").mkdir()
    try:
        yield path
    finally:
        subprocess.run(["rm", "-rf", str(path)], check=False)


def run_argv(
    base: Path, *command: str, timeout_s: int = TIMEOUT_S, sandbox: bool = True
) -> list[str]:
    policy = base / "policy.yaml"
    text = POLICY.replace("TIMEOUT", str(timeout_s))
    if not sandbox:
        text += "require_os_sandbox: false\n"
    policy.write_text(textwrap.dedent(text))
    options = sandbox_options() if sandbox else ["--no-os-sandbox"]
    return [
        GATEWAYD,
        "run",
        "--state-dir",
        str(base / "state"),
        *options,
        "--workspace",
        str(base / "ws"),
        "--policy",
        str(policy),
        "--",
        *command,
    ]


def start(argv: list[str], **streams: Any) -> subprocess.Popen[bytes]:
    options: dict[str, Any] = {
        "stdin": subprocess.PIPE,
        "stdout": subprocess.PIPE,
        "stderr": subprocess.PIPE,
        "bufsize": 0,  # the test sees each byte as gatewayd writes it
    }
    return subprocess.Popen(argv, **(options | streams))


def read_line(stream: IO[bytes]) -> bytes:
    """One line of ``stream``, failing (not hanging) if none comes in LINE_WAIT_S."""
    ready, _, _ = select.select([stream], [], [], LINE_WAIT_S)
    assert ready, f"no line within {LINE_WAIT_S} s: the output is not streamed"
    return stream.readline()


def finish(proc: subprocess.Popen[bytes]) -> tuple[bytes, bytes]:
    """The rest of stdout and stderr once ``proc`` ends (within END_WAIT_S)."""
    if proc.stdin is not None and proc.stdin.closed:
        proc.stdin = None  # communicate() would flush it
    return proc.communicate(timeout=END_WAIT_S)


def exec_ended(base: Path) -> dict[str, Any]:
    log = base / "state" / "audit" / "audit.jsonl"
    entries = [json.loads(line) for line in log.read_text().splitlines() if line]
    (ended,) = [e for e in entries if e.get("event") == "exec_ended"]
    started = [e for e in entries if e.get("event") == "exec_started"]
    assert len(started) == 1 and started[0]["seq"] < ended["seq"]
    detail: dict[str, Any] = ended["detail"]
    return detail


def verify_audit(base: Path) -> None:
    log = base / "state" / "audit" / "audit.jsonl"
    check = subprocess.run(
        [GATEWAYD, "audit", "verify", str(log)], capture_output=True, text=True, check=False
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_piped_input_reaches_the_command_and_stdout_holds_only_its_output(base: Path) -> None:
    proc = subprocess.run(
        run_argv(base, "cat"), input=b"a\nb\n", capture_output=True, timeout=END_WAIT_S * 2
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == b"a\nb\n"  # nothing of gatewayd's, before or after
    stderr = proc.stderr.decode()
    assert "gatewayd: run " in stderr and "started" in stderr and "ended: exit 0" in stderr
    detail = exec_ended(base)
    assert (detail["stdinBytes"], detail["stdoutBytes"], detail["stderrBytes"]) == (4, 4, 0)
    assert detail["exitCode"] == 0
    verify_audit(base)


def test_the_commands_stderr_is_gatewayds_stderr_and_stdout_stays_clean(base: Path) -> None:
    proc = subprocess.run(
        run_argv(base, "sh", "-c", "echo out; echo err >&2"),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=END_WAIT_S * 2,
    )
    assert proc.stdout == b"out\n"
    assert b"err\n" in proc.stderr and b"gatewayd: run " in proc.stderr
    assert exec_ended(base)["stderrBytes"] == 4


@pytest.mark.parametrize(
    "command",
    [
        ["cat"],
        # A program that answers each line as it reads it, as a stdio server does.
        [PY, "-u", "-c", "import sys\nfor line in sys.stdin: print('got', line, end='')"],
    ],
    ids=["cat", "python-line-loop"],
)
def test_each_line_is_answered_before_the_next_is_written(base: Path, command: list[str]) -> None:
    proc = start(run_argv(base, *command))
    assert proc.stdin is not None and proc.stdout is not None
    prefix = b"" if command == ["cat"] else b"got "
    for n in range(5):
        line = f"line {n}\n".encode()
        proc.stdin.write(line)
        # Answered while the input is still open: streamed both ways, not at the end.
        assert read_line(proc.stdout) == prefix + line
        assert proc.poll() is None
    proc.stdin.close()  # end of input is the command's end of input ...
    out, _ = finish(proc)
    assert proc.returncode == 0 and out == b""  # ... so it ends, with nothing left over
    detail = exec_ended(base)
    assert detail["stdinBytes"] == 5 * len(b"line 0\n")
    assert detail["stdoutBytes"] == 5 * len(prefix + b"line 0\n")


def test_a_json_rpc_server_in_the_workspace_is_driven_request_by_request(base: Path) -> None:
    # What an MCP client on the host does with a stdio server started through gatewayd.
    (base / "ws" / "server.py").write_text(ECHO_SERVER)
    proc = start(run_argv(base, PY, "-I", "/workspace/server.py"))
    assert proc.stdin is not None and proc.stdout is not None

    def send(message: dict[str, Any]) -> None:
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(message).encode() + b"\n")

    for n in range(1, 4):
        send({"jsonrpc": "2.0", "id": n, "method": "echo", "params": {"n": n, "text": "é"}})
        answer = json.loads(read_line(proc.stdout))
        assert answer == {"jsonrpc": "2.0", "id": n, "result": {"n": n, "text": "é"}}
    send({"jsonrpc": "2.0", "method": "notifications/initialized"})  # no answer due
    send({"jsonrpc": "2.0", "id": 9, "method": "nope", "params": {}})
    answer = json.loads(read_line(proc.stdout))
    assert answer["id"] == 9 and answer["error"]["code"] == -32601
    proc.stdin.close()
    out, err = finish(proc)
    assert proc.returncode == 0 and out == b""
    assert b"server: input ended" in err  # the server saw its input end, and said so
    verify_audit(base)


@pytest.mark.parametrize(
    ("script", "status"),
    [("exit 0", 0), ("exit 7", 7), ("exit 255", 255), ("kill -TERM $$", 128 + 15)],
)
def test_the_commands_exit_status_is_gatewayds(base: Path, script: str, status: int) -> None:
    proc = subprocess.run(
        run_argv(base, "sh", "-c", script),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=END_WAIT_S * 2,
    )
    assert proc.returncode == status, proc.stderr
    assert proc.stdout == b""


def test_fifty_megabytes_pass_intact_without_gatewayd_holding_them(base: Path) -> None:
    proc = start(run_argv(base, "cat"), stderr=subprocess.DEVNULL)
    assert proc.stdin is not None and proc.stdout is not None
    # Warm up first: the memory gatewayd needs anyway (its daemon, the run) is counted
    # before the stream starts.
    proc.stdin.write(b"warm\n")
    assert read_line(proc.stdout) == b"warm\n"
    before = _peak_rss(proc.pid)
    sent = hashlib.sha256()
    seed = os.urandom(BLOCK)

    def write_stream() -> None:
        assert proc.stdin is not None
        for n in range(STREAM_BYTES // BLOCK):
            block = n.to_bytes(8, "big") + seed[8:]  # no two blocks alike
            sent.update(block)
            proc.stdin.write(block)

    writer = threading.Thread(target=write_stream)
    writer.start()
    received = hashlib.sha256()
    count = 0
    while count < STREAM_BYTES:
        chunk = proc.stdout.read(min(BLOCK, STREAM_BYTES - count))
        assert chunk, f"the stream ended after {count} bytes"
        received.update(chunk)
        count += len(chunk)
    writer.join(timeout=END_WAIT_S)
    growth = _peak_rss(proc.pid) - before  # gatewayd is still running: its input is open
    proc.stdin.close()
    out, _ = finish(proc)
    assert proc.returncode == 0 and out == b""
    assert received.hexdigest() == sent.hexdigest()
    assert growth < MAX_GROWTH_BYTES, f"gatewayd grew by {growth} bytes"
    detail = exec_ended(base)
    assert detail["stdinBytes"] == detail["stdoutBytes"] == STREAM_BYTES + len(b"warm\n")


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for pid {pid}")


def _write_for_ever(stream: IO[bytes]) -> threading.Thread:
    """A producer that never stops on its own: it writes until its reader is gone."""

    def produce() -> None:
        try:
            while True:
                stream.write(b"more input\n" * 1000)
        except (BrokenPipeError, ValueError, OSError):
            return

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    return thread


def test_a_command_that_ends_while_input_keeps_coming_ends_the_run(base: Path) -> None:
    proc = start(run_argv(base, "head", "-n", "1"))
    assert proc.stdin is not None
    producer = _write_for_ever(proc.stdin)
    started = time.monotonic()
    proc.wait(timeout=END_WAIT_S)
    assert time.monotonic() - started < END_WAIT_S
    assert proc.returncode == 0
    assert proc.stdout is not None and proc.stdout.read() == b"more input\n"
    producer.join(timeout=5)
    assert not producer.is_alive()  # its reader is gone: gatewayd exited, no one reads


def test_a_command_that_closes_its_output_early_still_ends_when_its_input_does(
    base: Path,
) -> None:
    # stdout closed at once, input still coming: gatewayd keeps feeding the input,
    # and nothing waits on the closed output.
    proc = start(run_argv(base, "sh", "-c", "exec >&-; wc -c >&2"))
    assert proc.stdin is not None
    for _ in range(100):
        proc.stdin.write(b"x" * 1000)
    proc.stdin.close()
    out, err = finish(proc)
    assert proc.returncode == 0 and out == b""
    assert b"\n100000\n" in err, err  # every byte reached the command


def test_an_idle_open_input_does_not_keep_an_ended_command_running(base: Path) -> None:
    # The command never reads; the input stays open and silent: gatewayd must not wait
    # on it once the command is gone.
    proc = start(run_argv(base, "true"))
    proc.wait(timeout=END_WAIT_S)
    assert proc.returncode == 0
    assert proc.stdin is not None
    proc.stdin.close()


def test_a_reader_that_goes_away_stops_the_command_as_in_a_pipeline(base: Path) -> None:
    # `gatewayd run -- yes | head -1`: once the reader is gone the command gets SIGPIPE
    # (128 + 13), as `yes | head -1` does; it does not run on to its timeout.
    proc = start(run_argv(base, "yes"), stdin=subprocess.DEVNULL)
    assert proc.stdout is not None
    assert read_line(proc.stdout) == b"y\n"
    proc.stdout.close()
    proc.wait(timeout=END_WAIT_S)
    assert proc.returncode == 128 + 13
    assert exec_ended(base)["signal"] == 13


def test_the_timeout_stops_a_command_waiting_for_input_that_never_comes(base: Path) -> None:
    proc = start(run_argv(base, "cat", timeout_s=2))
    assert proc.stdin is not None
    proc.stdin.write(b"one line\n")
    proc.wait(timeout=END_WAIT_S)  # its input still open
    assert proc.stdout is not None and proc.stderr is not None
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.stdin.close()
    assert proc.returncode == 124, err
    assert out == b"one line\n"
    assert b"(timeout)" in err
    detail = exec_ended(base)
    assert detail["errorCode"] == "timeout" and detail["stdinBytes"] == len(b"one line\n")


def test_the_timeout_stops_a_command_whose_output_nobody_reads(base: Path) -> None:
    # A stalled reader on the host holds the command back (backpressure), never past
    # its time: gatewayd ends at the timeout although its own output is blocked.
    proc = start(run_argv(base, "yes", timeout_s=2), stdin=subprocess.DEVNULL)
    started = time.monotonic()
    proc.wait(timeout=END_WAIT_S)
    assert time.monotonic() - started < END_WAIT_S
    assert proc.returncode == 124
    assert exec_ended(base)["errorCode"] == "timeout"


@pytest.mark.parametrize("closed", [0, 1, 2], ids=["stdin", "stdout", "stderr"])
def test_a_closed_standard_stream_is_dev_null_never_a_file_gatewayd_opened(
    base: Path, closed: int
) -> None:
    # Started with a standard descriptor closed, gatewayd's own next file (its audit
    # log, a socket) takes that number; relaying it would hand the command gatewayd's
    # files. It gets /dev/null instead: empty input, output dropped. With stderr
    # closed, gatewayd's own lines are dropped too, never moved onto stdout.
    script = f'exec "$@" {closed}>&-'
    proc = subprocess.run(
        ["sh", "-c", script, "sh", *run_argv(base, "sh", "-c", "wc -c; echo done; echo e >&2")],
        stdin=subprocess.DEVNULL,  # closed by the shell for the stdin case
        capture_output=True,
        timeout=END_WAIT_S * 2,
    )
    assert proc.returncode == 0, proc.stderr
    if closed != 1:
        assert proc.stdout == b"0\ndone\n"  # the command's bytes, nothing of gatewayd's
    if closed != 2:
        assert b"gatewayd: run " in proc.stderr and b"e\n" in proc.stderr
    detail = exec_ended(base)
    assert detail["stdinBytes"] == 0
    assert detail["stdoutBytes"] == len(b"0\ndone\n") and detail["stderrBytes"] == 2


def test_without_a_sandbox_the_command_still_gets_gatewayds_input(base: Path) -> None:
    proc = subprocess.run(
        run_argv(base, "cat", sandbox=False),
        input=b"unsandboxed\n",
        capture_output=True,
        timeout=END_WAIT_S * 2,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == b"unsandboxed\n"
    assert b"NO OS sandbox" in proc.stderr
