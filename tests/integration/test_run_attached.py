"""`gatewayd run` attached to a serving daemon: with `gatewayd serve` on the state
directory, the one-shot run is the daemon's (POST /v1/runs/attach on its control socket,
the client's standard streams passed as SCM_RIGHTS), and the client loads none of it.

Real processes throughout: a sandboxed `gatewayd serve`, `gatewayd run` as a shell starts
it, real pipes for its streams, the daemon's audit log read back.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pytest

from tests.livedaemon import LiveDaemon, start_daemon
from tests.unit.test_cli_imports import HEAVY, MODELS, assert_light, run_cli

if TYPE_CHECKING:
    from gatewayd.runs.lifecycle import RunManager

GATEWAYD = str(Path(sys.executable).parent / "gatewayd")
PY = "/usr/bin/python3"
POLICY = """
version: 1
name: attached
tools:
  allow: [time.now]
filesystem:
  paths:
    workspace: {root: ., mode: rw}
sandbox: {timeout_s: 120, max_output_bytes: 65536}
"""
# How long a run may take to start, or to end once its command ended or was stopped, on
# a loaded 2-core machine.
WAIT_S = 60.0


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "sandboxed runs need root (network namespaces, a uid per run)"
    if not os.path.exists("/usr/bin/bwrap") or not os.path.exists(PY):
        return "needs bubblewrap at /usr/bin/bwrap and the system python3"
    return None


pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))


@pytest.fixture(scope="module")
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-att-", dir="/tmp"))
    path.chmod(0o711)  # the sandbox's uid passes through to its workspace and socket
    (path / "ws").mkdir()
    (path / "policy.yaml").write_text(textwrap.dedent(POLICY))
    try:
        yield path
    finally:
        subprocess.run(["rm", "-rf", str(path)], check=False)


@pytest.fixture(scope="module")
def daemon(base: Path) -> Iterator[LiveDaemon]:
    live = start_daemon(base / "state", sandbox=True)
    try:
        yield live
    finally:
        live.stop()


def run_argv(
    base: Path, *command: str, policy: str | None = None, state: Path | None = None
) -> list[str]:
    return [
        *(GATEWAYD, "run", "--state-dir", str(state or base / "state")),
        *("--workspace", str(base / "ws"), "--policy", policy or str(base / "policy.yaml")),
        "--",
        *command,
    ]


def entries(daemon: LiveDaemon) -> list[dict[str, Any]]:
    lines = daemon.audit_path.read_text().splitlines()
    return [json.loads(line) for line in lines if line]


def run_of(stderr: str) -> str:
    for line in stderr.splitlines():
        if line.startswith("gatewayd: run ") and line.endswith(")") and "started" in line:
            return line.split()[2]
    raise AssertionError(f"no 'run ... started' line in:\n{stderr}")


def events_of(daemon: LiveDaemon, run_id: str) -> list[dict[str, Any]]:
    return [e for e in entries(daemon) if e.get("runId") == run_id and e["kind"] == "event"]


def wait_for_run_end(daemon: LiveDaemon, run_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        ended = [e for e in events_of(daemon, run_id) if e["event"] == "run_ended"]
        if ended:
            return ended[0]
        time.sleep(0.05)
    raise AssertionError(f"run {run_id} did not end within {WAIT_S} s")


def no_process_with(marker: str) -> bool:
    """Whether no `sleep MARKER` runs (the sandboxed command; gatewayd run's own command
    line names the marker too)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if cmdline.split(b"\0")[:2] == [b"sleep", marker.encode()]:
                return False
    return True


def test_the_serving_daemon_runs_it_with_the_clients_streams_and_status(
    base: Path, daemon: LiveDaemon
) -> None:
    proc = subprocess.run(
        run_argv(base, "sh", "-c", "echo out; cat; echo err >&2; exit 3"),
        input=b"a\nb\n",
        capture_output=True,
        timeout=WAIT_S,
    )
    stderr = proc.stderr.decode()
    assert proc.returncode == 3, stderr
    assert proc.stdout == b"out\na\nb\n"  # nothing of gatewayd's on the command's stdout
    assert "err\n" in stderr
    run_id = run_of(stderr)
    assert f"gatewayd: run {run_id} ended: exit 3;" in stderr
    assert f"gatewayd: audit log {daemon.audit_path}" in stderr
    # The daemon's log holds the run: it was the daemon's, not a daemon of the client's.
    events = [e["event"] for e in events_of(daemon, run_id)]
    assert events[0] == "run_created" and events[-1] == "run_ended"
    (ended,) = [e for e in events_of(daemon, run_id) if e["event"] == "exec_ended"]
    detail = ended["detail"]
    assert (detail["stdinBytes"], detail["stdoutBytes"], detail["stderrBytes"]) == (4, 8, 4)
    assert detail["exitCode"] == 3


def test_the_client_loads_none_of_the_daemon(
    base: Path, daemon: LiveDaemon, tmp_path: Path
) -> None:
    # The same wrapper and lists as the client commands' import tests (their positive
    # control shows the listing sees these modules when they load).
    done, modules = run_cli(tmp_path, *run_argv(base, "/bin/true")[1:])
    assert done.returncode == 0, done.stderr
    assert "started" in done.stderr
    assert_light(modules, HEAVY | MODELS)


def start_sleeping(base: Path, marker: str) -> subprocess.Popen[bytes]:
    """`gatewayd run -- sleep MARKER`, returned once the sandboxed sleep runs."""
    proc = subprocess.Popen(
        run_argv(base, "sleep", marker),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + WAIT_S
    while no_process_with(marker):
        assert time.monotonic() < deadline and proc.poll() is None, "the command never started"
        time.sleep(0.02)
    return proc


def test_a_stop_signal_ends_the_run_and_its_command_and_exits_128_plus_n(
    base: Path, daemon: LiveDaemon
) -> None:
    marker = f"{os.getpid() % 1000 + 4000}.5"
    proc = start_sleeping(base, marker)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=WAIT_S)
    stderr = err.decode()
    assert proc.returncode == 128 + signal.SIGINT, stderr
    assert "gatewayd: SIGINT: the run was ended (its command stopped)" in stderr
    assert no_process_with(marker)
    ended = wait_for_run_end(daemon, run_of(stderr))
    assert ended["detail"]["reason"] == "interrupted_by_operator"
    # The command's end is on the record too: no exec_started is left without one.
    events = events_of(daemon, run_of(stderr))
    (started,) = [e for e in events if e["event"] == "exec_started"]
    (stopped,) = [e for e in events if e["event"] == "exec_ended"]
    assert started["seq"] < stopped["seq"] < ended["seq"]
    assert "its caller stopped waiting" in stopped["detail"]["stopped"]


def test_a_client_killed_outright_has_its_run_ended_by_the_daemon(
    base: Path, daemon: LiveDaemon
) -> None:
    marker = f"{os.getpid() % 1000 + 5000}.5"
    proc = start_sleeping(base, marker)
    deadline = time.monotonic() + WAIT_S
    assert proc.stderr is not None
    started = proc.stderr.readline().decode()
    proc.kill()
    proc.wait(timeout=WAIT_S)
    ended = wait_for_run_end(daemon, run_of(started))
    assert ended["detail"]["reason"] == "interrupted_by_operator"
    while not no_process_with(marker):
        assert time.monotonic() < deadline, "the command outlived its run"
        time.sleep(0.02)


def test_input_typed_after_the_run_is_the_shells_not_the_daemons(
    base: Path, daemon: LiveDaemon
) -> None:
    # The command never reads its stdin (a terminal, say): once the run is over, what is
    # written there is for whoever reads it next, not for a reader the daemon left behind.
    read_end, write_end = os.pipe()
    proc = subprocess.run(
        run_argv(base, "true"), stdin=read_end, capture_output=True, timeout=WAIT_S
    )
    assert proc.returncode == 0, proc.stderr.decode()
    os.write(write_end, b"typed later\n")
    time.sleep(0.5)  # a reader left behind in the daemon would have taken it by now
    ready, _, _ = select.select([read_end], [], [], 0)
    assert ready and os.read(read_end, 100) == b"typed later\n"
    os.close(read_end)
    os.close(write_end)


def test_a_relative_policy_path_and_a_spec_are_read_as_the_client_sees_them(
    base: Path, daemon: LiveDaemon
) -> None:
    proc = subprocess.run(
        run_argv(base, "true", policy="policy.yaml"), cwd=base, capture_output=True, timeout=WAIT_S
    )
    assert proc.returncode == 0, proc.stderr.decode()
    assert "(policy attached, workspace mode overlay)" in proc.stderr.decode()
    spec = base / "spec.json"
    spec.write_text(
        json.dumps(
            {
                "workspacePath": str(base / "ws"),
                "policy": str(base / "policy.yaml"),
                "actorId": "tester",
                "tenantId": "t1",
                "grant": {"allowSandbox": True},
                "workspace": {"onEnd": "keep"},
            }
        )
    )
    proc = subprocess.run(
        [
            GATEWAYD,
            "run",
            "--state-dir",
            str(base / "state"),
            "--spec",
            str(spec),
            "--on-end",
            "discard",
            "--",
            "true",
        ],
        capture_output=True,
        timeout=WAIT_S,
    )
    stderr = proc.stderr.decode()
    assert proc.returncode == 0, stderr
    assert ": discarded;" in stderr  # --on-end over the spec's workspace.onEnd


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("no-such-policy", "gatewayd: run refused: "),
        ("/nonexistent/p.yaml", "gatewayd: run refused: "),
    ],
)
def test_a_refused_run_says_why_and_exits_1(
    base: Path, daemon: LiveDaemon, policy: str, expected: str
) -> None:
    proc = subprocess.run(
        run_argv(base, "true", policy=policy), capture_output=True, timeout=WAIT_S
    )
    assert proc.returncode == 1
    assert expected in proc.stderr.decode()
    assert policy in proc.stderr.decode()


def test_a_spec_with_a_key_twice_is_refused_before_the_daemon_is_asked(
    base: Path, daemon: LiveDaemon
) -> None:
    spec = base / "twice.json"
    spec.write_text('{"policy": "a", "policy": "b"}')
    proc = subprocess.run(
        [GATEWAYD, "run", "--state-dir", str(base / "state"), "--spec", str(spec), "--", "true"],
        capture_output=True,
        timeout=WAIT_S,
    )
    assert proc.returncode == 1
    assert (
        f"gatewayd: bad --spec {spec}: the key 'policy' appears twice in one object"
        in proc.stderr.decode()
    )


# --- the exchange itself, spoken by hand ---------------------------------------------


def raw_request(daemon: LiveDaemon, head: str, body: bytes = b"") -> socket.socket:
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(WAIT_S)
    sock.connect(str(daemon.control_socket))
    sock.sendall(head.replace("\n", "\r\n").encode() + body)
    return sock


def attach_head(body: bytes, *, method: str = "POST", upgrade: bool = True) -> str:
    lines = [f"{method} /v1/runs/attach HTTP/1.1", "Host: gatewayd"]
    if upgrade:
        lines += ["Connection: Upgrade", "Upgrade: gatewayd-attach/1"]
    lines += ["Content-Type: application/json", f"Content-Length: {len(body)}", ""]
    return "\n".join(lines) + "\n"


def answer_of(sock: socket.socket) -> tuple[int, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), rest


def attach_body(base: Path, **over: Any) -> bytes:
    body = {
        "request": {
            "workspacePath": str(base / "ws"),
            "policy": str(base / "policy.yaml"),
            "actorId": "tester",
            "tenantId": "t1",
            "grant": {"allowSandbox": True},
        },
        "command": ["true"],
        "env": {},
        **over,
    }
    return json.dumps(body).encode()


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.parametrize(
    ("method", "upgrade", "body", "status", "words"),
    [
        ("GET", True, b"", 405, "takes POST"),
        ("POST", False, None, 400, "Upgrade: gatewayd-attach/1"),
        ("POST", True, b'{"command": []}', 400, "bad attach request"),
        ("POST", True, b'{"command": ["a"], "command": ["b"]}', 400, "not acceptable JSON"),
    ],
    ids=["get", "no-upgrade", "bad-body", "key-twice"],
)
def test_a_request_that_is_not_the_exchange_is_refused_as_http(
    base: Path,
    daemon: LiveDaemon,
    method: str,
    upgrade: bool,
    body: bytes | None,
    status: int,
    words: str,
) -> None:
    payload = attach_body(base) if body is None else body
    with raw_request(daemon, attach_head(payload, method=method, upgrade=upgrade), payload) as s:
        got, rest = answer_of(s)
    assert got == status
    assert words in rest.decode()


@pytest.mark.parametrize("fd_count", [0, 2, 4], ids=["none", "two", "four"])
def test_streams_not_passed_as_three_descriptors_start_no_run(
    base: Path, daemon: LiveDaemon, fd_count: int
) -> None:
    before = open_fds(daemon.proc.pid)
    runs_before = sum(1 for e in entries(daemon) if e.get("event") == "run_created")
    body = attach_body(base)
    with raw_request(daemon, attach_head(body), body) as sock:
        assert answer_of(sock) == (101, b"")
        fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(fd_count)]
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        sock.sendmsg([b"\0"], ancillary)
        for fd in fds:
            os.close(fd)
        lines = sock.makefile("rb").read().splitlines()
    said = [json.loads(line) for line in lines]
    assert said[-1] == {"exit": 1}
    assert "did not pass its standard input, output and error" in said[0]["say"]
    assert sum(1 for e in entries(daemon) if e.get("event") == "run_created") == runs_before
    assert open_fds(daemon.proc.pid) <= before  # what came with the byte was closed


def test_a_client_that_speaks_out_of_turn_is_treated_as_gone(
    base: Path, daemon: LiveDaemon
) -> None:
    # Garbage after the streams (a line too long, a signal not a stop signal): the run
    # is ended as for a client that went away; the daemon carries on.
    marker = f"{os.getpid() % 1000 + 6000}.5"
    body = attach_body(base, command=["sleep", marker])
    with raw_request(daemon, attach_head(body), body) as sock:
        assert answer_of(sock) == (101, b"")
        streams = [os.open(os.devnull, os.O_RDWR) for _ in range(3)]
        sock.sendmsg([b"\0"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", streams))])
        for fd in streams:
            os.close(fd)
        reader = sock.makefile("rb")
        run_id = run_of(json.loads(reader.readline())["say"])
        deadline = time.monotonic() + WAIT_S
        while no_process_with(marker):
            assert time.monotonic() < deadline, "the command never started"
            time.sleep(0.02)
        sock.sendall(b'{"stop": 9}\n')  # SIGKILL is no stop signal: ignored
        time.sleep(0.3)
        assert not no_process_with(marker)
        sock.sendall(b"x" * 1000)  # no line of this exchange
        said = []
        # Closed with our bytes unread, the daemon's end resets after its last line.
        with contextlib.suppress(ConnectionResetError):
            while line := reader.readline():
                said.append(json.loads(line))
    assert said[-1] == {"exit": 128 + signal.SIGHUP}
    assert wait_for_run_end(daemon, run_id)["detail"]["reason"] == "interrupted_by_operator"
    assert no_process_with(marker)
    status, _ = daemon.control("GET", "/v1/health")
    assert status == 200


def test_a_daemon_without_the_os_sandbox_runs_no_attached_command(base: Path) -> None:
    # Its command would run on the host as the daemon: refused, the run ended.
    policy = base / "degraded.yaml"
    policy.write_text(textwrap.dedent(POLICY) + "require_os_sandbox: false\n")
    live = start_daemon(base / "state-nosandbox")
    try:
        proc = subprocess.run(
            run_argv(
                base,
                "touch",
                str(base / "ws" / "made-on-the-host"),
                policy=str(policy),
                state=live.state,
            ),
            capture_output=True,
            timeout=WAIT_S,
        )
        stderr = proc.stderr.decode()
        assert proc.returncode == 1, stderr
        assert "has NO OS sandbox" in stderr
        assert "a serving gatewayd runs an attached command only in a sandbox" in stderr
        assert not (base / "ws" / "made-on-the-host").exists()
        wait_for_run_end(live, run_of(stderr))
    finally:
        live.stop()


def test_a_stop_signal_commits_none_of_the_half_done_work(base: Path, daemon: LiveDaemon) -> None:
    # ^C cuts the work short: as in-process (a daemon's stop), the session's on-end
    # commit is not made and the session is kept for the operator to look at; what the
    # command had written never reaches the directory on its own.
    marker = f"{os.getpid() % 1000 + 7000}.5"
    argv = run_argv(base, "sh", "-c", f"touch half-done && exec sleep {marker}")
    argv[argv.index("--") : argv.index("--")] = ["--on-end", "commit"]
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + WAIT_S
    while no_process_with(marker):
        assert time.monotonic() < deadline and proc.poll() is None, "the command never started"
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=WAIT_S)
    stderr = err.decode()
    assert proc.returncode == 128 + signal.SIGINT, stderr
    fate = [line for line in stderr.splitlines() if line.startswith("gatewayd: workspace (")]
    assert len(fate) == 1 and ": kept until " in fate[0] and "commit skipped" in fate[0], stderr
    assert not (base / "ws" / "half-done").exists()
    subprocess.run(
        [GATEWAYD, "workspace", "discard", "--state-dir", str(base / "state"), run_of(stderr)],
        capture_output=True,
        timeout=WAIT_S,
        check=True,
    )


async def test_a_client_that_never_passes_its_streams_is_told_and_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The 101 answered and then nothing (a client stuck, or not gatewayd run): once the
    # wait is over the daemon says why and closes, with nothing of a run made.
    import h11
    import trio

    from gatewayd import control_attach

    monkeypatch.setattr(control_attach, "STREAMS_TIMEOUT_S", 0.2)
    ours, theirs = trio.socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(attach_head(b"{}").replace("\n", "\r\n").encode() + b"{}")
    assert isinstance(conn.next_event(), h11.Request)
    assert isinstance(conn.next_event(), h11.Data)
    assert isinstance(conn.next_event(), h11.EndOfMessage)
    attach = cast(control_attach.AttachRequest, None)  # never reached: no streams come
    runs = cast("RunManager", None)
    stream = trio.SocketStream(ours)
    with trio.fail_after(WAIT_S):
        await control_attach.serve_attached(stream, conn, attach, runs)
    await stream.aclose()
    said = bytearray()
    while chunk := await theirs.recv(65536):
        said += chunk
    theirs.close()
    lines = said.partition(b"\r\n\r\n")[2].splitlines()
    assert [json.loads(line) for line in lines][-1] == {"exit": 1}


def test_variables_the_daemon_cannot_take_do_not_refuse_the_run(
    base: Path, daemon: LiveDaemon
) -> None:
    # In-process, any environment runs; attached, a variable that is not UTF-8 (a
    # Latin-1 file name) must not turn the run away (the request is JSON).
    from gatewayd import control_attach
    from gatewayd.cli import run as cli_run

    assert cli_run._ATTACH_ENV_CHARS == control_attach.MAX_ENV_CHARS
    env = {
        **{k.encode(): v.encode() for k, v in os.environ.items()},
        b"ODD_BYTES": b"caf\xe9",
    }
    proc = subprocess.run(
        run_argv(base, "sh", "-c", "echo ran"),
        capture_output=True,
        timeout=WAIT_S,
        env=cast(Any, env),
    )
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout == b"ran\n"
    assert "started" in proc.stderr.decode()  # the daemon's run, not an in-process one


def test_the_daemon_stopping_meanwhile_ends_the_run_and_the_client_says_so(
    base: Path,
) -> None:
    # Even with the client's stdout a socket nobody reads (its relay cannot write a
    # whole chunk), the daemon's stop ends the run: nothing waits on that client.
    live = start_daemon(base / "state-stopping", sandbox=True)
    marker = f"{os.getpid() % 1000 + 8000}.5"
    stuck, keep = socket.socketpair()
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    try:
        proc = subprocess.Popen(
            run_argv(
                base,
                *("sh", "-c", f"head -c 1000000 /dev/zero; exec sleep {marker}"),
                state=live.state,
            ),
            stdin=subprocess.DEVNULL,
            stdout=stuck.fileno(),
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + WAIT_S
        assert proc.stderr is not None
        started = proc.stderr.readline().decode()
        run_id = run_of(started)
        time.sleep(1.0)  # the relay now holds a chunk the socket cannot take
        assert proc.poll() is None
        assert live.stop() == 0
        _, err = proc.communicate(timeout=WAIT_S)
        assert proc.returncode == 1, err.decode()
        assert "gatewayd closed the connection before the run's end" in err.decode()
        ended = [e for e in events_of(live, run_id) if e["event"] == "run_ended"]
        assert ended and ended[0]["detail"]["reason"] == "daemon_stopping"
        assert time.monotonic() < deadline
        assert no_process_with(marker)
    finally:
        live.stop()
        stuck.close()
        keep.close()


def test_a_terminal_as_stdin_is_read_by_the_client_never_by_the_daemon(
    base: Path, daemon: LiveDaemon
) -> None:
    # The daemon is in no session of the operator's terminal: job control could not stop
    # it from reading there (a `gatewayd run ... &` would take lines typed for the shell).
    # The client reads its terminal itself and passes the daemon a pipe.
    master, slave = os.openpty()
    proc = subprocess.Popen(
        run_argv(base, "head", "-n", "1"),
        stdin=slave,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    os.close(slave)
    try:
        assert proc.stderr is not None
        run_id = run_of(proc.stderr.readline().decode())  # the run (and its relay) is on
        held = [
            os.readlink(f"/proc/{daemon.proc.pid}/fd/{fd}")
            for fd in os.listdir(f"/proc/{daemon.proc.pid}/fd")
        ]
        assert not [path for path in held if path.startswith("/dev/pts/")], held
        os.write(master, b"typed for the command\n")
        out, err = proc.communicate(timeout=WAIT_S)
        assert proc.returncode == 0, err.decode()
        assert out.replace(b"\r", b"") == b"typed for the command\n"
        wait_for_run_end(daemon, run_id)
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)


def test_a_ctrl_c_before_the_daemon_answers_ends_the_client_without_a_traceback(
    tmp_path: Path,
) -> None:
    # Something listens on the state directory's control socket but has not answered
    # yet (a busy daemon): ^C there ends gatewayd run as 130, saying so.
    state = tmp_path / "state"
    state.mkdir()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(state / "control.sock"))
    listener.listen()
    try:
        proc = subprocess.Popen(
            [
                GATEWAYD,
                "run",
                "--state-dir",
                str(state),
                "--workspace",
                str(tmp_path),
                "--policy",
                "default",
                "--",
                "true",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        held, _ = listener.accept()  # its request arrives; no answer comes
        with held:
            held.recv(65536)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=WAIT_S)
        stderr = err.decode()
        assert proc.returncode == 128 + signal.SIGINT, stderr
        assert "gatewayd run: interrupted before the run started" in stderr
        assert "Traceback" not in stderr
    finally:
        listener.close()
