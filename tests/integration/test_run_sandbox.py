"""The OS sandbox of a run, probed from inside real sandboxes of real runs.

An in-process gatewayd with the OS sandbox on (real bwrap, real network namespaces, a
real uid per run, the run's workspace lent to it) creates runs; every command runs in the
run's sandbox through ``RunManager.exec`` (the path ``gatewayd run``, ``gatewayd exec``
and the control socket's exec all take). Each property is shown by a probe that tries and
fails inside, or by the host's audit log, never by reading our own configuration back.
"""

from __future__ import annotations

import hashlib
import json
import os
import pty
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from gatewayd.audit import AuditWriteError
from gatewayd.config import GatewaydConfig, SandboxUids
from gatewayd.daemon import Daemon, open_daemon
from gatewayd.errors import AuthzDenied, PolicyViolation
from gatewayd.metrics import METRICS
from gatewayd.runs import Grant, Run, RunLimits, RunRequest
from gatewayd.sandbox.launch import ExecResult
from gatewayd.sandbox.lendable import NotLendable
from gatewayd.sandbox.netns import NETNS_RUN_DIR
from gatewayd.sandbox.session import (
    SandboxUnavailable,
    UnsafeMounts,
    WorkspaceInUse,
)
from gatewayd.sandbox.uids import pids_of_uid
from tests.conftest import frame, raw_exchange, read_frame

PY = "/usr/bin/python3"
OUTSIDE_V4 = "198.51.100.1"  # TEST-NET-2 (RFC 5737): never routed anywhere
SECRET_NAME = "COGNI_TEST_HOST_SECRET"

POLICY = """
version: 1
name: sandboxed
tools:
  allow: [time.now, fs.read, fs.list, fs.write]
filesystem:
  paths:
    workspace: {root: ., mode: rw}
limits: {calls_per_second: 1000, burst: 1000}
sandbox: {timeout_s: 30, cpu_s: 20, max_processes: 48, max_output_bytes: 65536}
"""


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "sandboxed runs need root (network namespaces, a uid per run)"
    if not os.path.exists("/usr/bin/bwrap") or not os.path.exists(PY):
        return "needs bubblewrap at /usr/bin/bwrap and the system python3"
    return None


pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))


class Sandboxed:
    """A daemon with the OS sandbox, and helpers to make runs and run commands in them."""

    def __init__(self, daemon: Daemon, base: Path) -> None:
        self.daemon = daemon
        self.base = base
        self.audit_path = daemon.config.resolved_audit_path

    def workspace(self, name: str = "ws") -> Path:
        ws = self.base / name
        ws.mkdir(exist_ok=True)
        (ws / "notes.md").write_text("hello\n")
        return ws

    async def run(
        self,
        policy: str = POLICY,
        *,
        workspace: Path | None = None,
        memory_mb: int = 2048,
        grant: bool = True,
    ) -> Run:
        path = self.base / f"policy-{secrets.token_hex(4)}.yaml"
        path.write_text(textwrap.dedent(policy))
        request = RunRequest(
            workspacePath=str(workspace or self.workspace()),
            policy=str(path),
            actorId="tester",
            tenantId="t1",
            grant=Grant(allowSandbox=grant),
            limits=RunLimits(maxMemoryMb=memory_mb),
        )
        return await self.daemon.runs.start(request, policy_paths=True)

    async def py(self, run: Run, code: str, *args: str, timeout: float = 30) -> ExecResult:
        return await self.daemon.runs.exec(
            run.run_id, [PY, "-I", "-c", textwrap.dedent(code), *args], timeout_s=timeout
        )

    async def entries(self) -> list[dict[str, Any]]:
        await self.daemon.audit.durable(self.daemon.audit.last_seq)
        return [json.loads(line) for line in self.audit_path.read_text().splitlines() if line]


def sandbox_config(base: Path) -> GatewaydConfig:
    return GatewaydConfig(
        state_dir=base / "state",
        policy_dirs=(base,),
        # These runs' commands write the workspace directory itself (what the tests
        # check on the host); tests/integration/test_run_workspaces.py has the overlay.
        workspace_mode="host",
        netns_prefix=f"cgt{secrets.token_hex(4)}-",
        sandbox_uids=SandboxUids(base=1_700_000_000 + secrets.randbelow(50_000) * 1024, count=64),
    )


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-sb-", dir="/tmp"))
    path.chmod(0o711)  # the sandbox's uid passes through to its workspace and socket
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def sb(base: Path) -> AsyncIterator[Sandboxed]:
    os.environ[SECRET_NAME] = "sk-host-only-" + secrets.token_hex(8)
    try:
        async with open_daemon(sandbox_config(base), preload=True) as daemon:
            assert daemon.runs.support.available, daemon.runs.support.reason
            yield Sandboxed(daemon, base)
    finally:
        del os.environ[SECRET_NAME]


# --- the run's sandbox as gatewayd makes it --------------------------------------------


async def test_a_run_gets_its_own_uid_netns_and_a_workspace_lent_and_given_back(
    sb: Sandboxed,
) -> None:
    ws = sb.workspace()
    owner = os.stat(ws).st_uid
    run = await sb.run(workspace=ws)
    assert run.sandbox is not None
    uid = run.sandbox.user.uid
    assert uid in sb.daemon.config.resolved_sandbox_uids and uid != 0
    assert (NETNS_RUN_DIR / run.sandbox.netns.name).exists()
    assert os.stat(ws / "notes.md").st_uid == uid  # lent for the run
    result = await sb.py(
        run,
        """
        import os
        open("/workspace/made.txt", "w").write("by the sandbox")
        os.mkdir("/workspace/sub")
        print(os.getuid(), os.geteuid())
        """,
    )
    assert result.exitCode == 0, result.stderr
    assert result.stdout.split() == [b"1000", b"1000"]  # the sandbox user inside
    netns = run.sandbox.netns.name
    await sb.daemon.runs.end(run.run_id)
    # Given back: lent and new entries belong to the workspace's owner again.
    for path in (ws, ws / "notes.md", ws / "made.txt", ws / "sub"):
        assert os.stat(path).st_uid == owner, path
    assert not (NETNS_RUN_DIR / netns).exists()
    assert not run.directory.exists()
    assert pids_of_uid(uid) == []
    ended = [e for e in await sb.entries() if e.get("event") == "run_ended"][-1]
    assert ended["detail"]["netnsRemoved"] is True
    assert ended["detail"]["entriesReturned"] >= 4


async def test_two_runs_get_different_uids_and_namespaces(sb: Sandboxed) -> None:
    a = await sb.run(workspace=sb.workspace("a"))
    b = await sb.run(workspace=sb.workspace("b"))
    assert a.sandbox is not None and b.sandbox is not None
    assert a.sandbox.user.uid != b.sandbox.user.uid
    assert a.sandbox.netns_id != b.sandbox.netns_id


def uids_leased() -> float:
    """The daemon's gatewayd_sandbox_uids_leased, as a scrape reads it."""
    lines = METRICS.render().splitlines()
    return float(next(x for x in lines if x.startswith("gatewayd_sandbox_uids_leased ")).split()[1])


async def test_the_uid_leases_metric_counts_each_runs_uid_until_it_ends(sb: Sandboxed) -> None:
    before = uids_leased()
    a = await sb.run(workspace=sb.workspace("a"))
    b = await sb.run(workspace=sb.workspace("b"))
    assert uids_leased() == before + 2
    await sb.daemon.runs.end(a.run_id)
    assert uids_leased() == before + 1
    await sb.daemon.runs.end(b.run_id)
    assert uids_leased() == before


async def test_run_directory_and_socket_are_open_to_the_runs_group_only(sb: Sandboxed) -> None:
    run = await sb.run()
    assert run.sandbox is not None
    gid = run.sandbox.user.gid
    directory, sock = os.stat(run.directory), os.stat(run.socket_path)
    assert (directory.st_uid, directory.st_gid, stat.S_IMODE(directory.st_mode)) == (0, gid, 0o710)
    assert (sock.st_uid, sock.st_gid, stat.S_IMODE(sock.st_mode)) == (0, gid, 0o660)


# --- network ---------------------------------------------------------------------------

NET_PROBE = r"""
import errno, socket, sys
def tcp(host, port):
    s = socket.socket(); s.settimeout(5)
    try:
        s.connect((host, port)); return "connected"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e))
def udp(host, port):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(2)
    try:
        s.sendto(b"ping", (host, port)); s.recvfrom(10); return "answered"
    except OSError as e:
        return errno.errorcode.get(e.errno, type(e).__name__)
print(tcp("127.0.0.1", int(sys.argv[1])), tcp(sys.argv[2], 80),
      udp("127.0.0.1", int(sys.argv[3])), udp(sys.argv[2], 53))
"""


async def test_host_loopback_and_outside_addresses_are_unreachable_tcp_udp_and_curl(
    sb: Sandboxed,
) -> None:
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(4)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    tcp_port, udp_port = tcp.getsockname()[1], udp.getsockname()[1]
    run = await sb.run()
    try:
        result = await sb.py(run, NET_PROBE, str(tcp_port), OUTSIDE_V4, str(udp_port))
        curl = await sb.daemon.runs.exec(
            run.run_id,
            ["curl", "-sS", "--max-time", "5", f"http://127.0.0.1:{tcp_port}/"],
        )
        # The same listeners answer from the host, so the failures inside are the netns.
        with socket.create_connection(("127.0.0.1", tcp_port), timeout=5):
            pass
    finally:
        tcp.close()
        udp.close()
    # Loopback inside is the sandbox's own: nothing listens there. UDP gets no answer.
    assert result.stdout.split() == [
        b"ECONNREFUSED",
        b"ENETUNREACH",
        b"TimeoutError",
        b"ENETUNREACH",
    ], result.stderr
    assert curl.exitCode == 7, curl.stderr  # curl: "Failed to connect to host"


async def test_the_only_interface_inside_is_loopback(sb: Sandboxed) -> None:
    run = await sb.run()
    result = await sb.daemon.runs.exec(run.run_id, ["cat", "/proc/net/dev"])
    interfaces = [line.split(b":")[0].strip() for line in result.stdout.splitlines()[2:]]
    assert interfaces == [b"lo"]


# --- the gateway from inside -----------------------------------------------------------


async def test_cogni_tool_inside_calls_the_gateway_and_every_call_is_audited(
    sb: Sandboxed,
) -> None:
    run = await sb.run()
    result = await sb.daemon.runs.exec(
        run.run_id,
        [
            "sh",
            "-c",
            'cogni-tool exec time.now && cogni-tool exec fs.read \'{"path": "notes.md"}\' '
            '&& cogni-tool exec fs.stat \'{"path": "notes.md"}\'; echo "stat=$?"',
        ],
    )
    assert result.exitCode == 0, result.stderr
    lines = result.stdout.decode().splitlines()
    assert json.loads(lines[0])["timezone"] == "UTC"
    assert json.loads(lines[1])["content"] == "hello\n"
    assert lines[2] == "stat=15", result.stderr  # policy_denied: fs.stat is off the list
    assert b"policy_denied" in result.stderr and b"fs.read" in result.stderr
    calls = [e for e in await sb.entries() if e["kind"] == "call"]
    assert [(c["tool"], c["decision"]) for c in calls] == [
        ("time.now", "allow"),
        ("fs.read", "allow"),
        ("fs.stat", "deny"),
    ]
    assert {c["runId"] for c in calls} == {run.run_id}
    assert all("degraded" not in c for c in calls)
    # The peer recorded is the sandboxed process, as the host sees it: the run's uid.
    assert run.sandbox is not None
    assert {c["peer"]["uid"] for c in calls} == {run.sandbox.user.uid}
    await sb.daemon.runs.end(run.run_id)
    verify = subprocess.run(
        [str(Path(sys.executable).parent / "gatewayd"), "audit", "verify", str(sb.audit_path)],
        capture_output=True,
        text=True,
    )
    assert verify.returncode == 0, verify.stdout


MISMATCH_PROBE = r"""
import json, os, socket, struct, sys
s = socket.socket(socket.AF_UNIX); s.connect(os.environ["COGNI_GATEWAY_SOCK"])
body = json.dumps({"v": 1, "runId": sys.argv[1], "toolCallId": "x", "tool": "time.now",
                   "args": {}}).encode()
s.sendall(struct.pack(">I", len(body)) + body)
n = struct.unpack(">I", s.recv(4))[0]
print(json.loads(s.recv(n))["errorCode"])
"""


async def test_another_runs_id_gets_run_mismatch_and_its_socket_is_not_there(
    sb: Sandboxed,
) -> None:
    a = await sb.run(workspace=sb.workspace("a"))
    b = await sb.run(workspace=sb.workspace("b"))
    mismatch = await sb.py(a, MISMATCH_PROBE, b.run_id)
    assert mismatch.stdout.strip() == b"run_mismatch", mismatch.stderr
    probe = await sb.py(
        a,
        """
        import os, socket, sys
        for path in sys.argv[1:]:
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect(path); print("connected")
            except OSError as e:
                print(type(e).__name__)
        print(sorted(os.listdir("/run/cogni")))
        """,
        str(b.socket_path),
        str(b.directory),
        str(sb.daemon.config.state_dir / "control.sock"),
    )
    lines = probe.stdout.decode().split("\n")
    assert lines[:3] == ["FileNotFoundError"] * 3, probe.stderr
    assert lines[3] == "['gateway.sock']"


async def test_a_connection_from_outside_the_runs_namespace_is_refused_and_audited(
    sb: Sandboxed,
) -> None:
    run = await sb.run()
    request = {"v": 1, "runId": run.run_id, "toolCallId": "c1", "tool": "time.now", "args": {}}
    [answer] = await raw_exchange(run.socket_path, frame(request))
    assert answer["errorCode"] == "authz_denied"
    assert "inside its run's sandbox" in answer["safeMessage"]
    refused = [e for e in await sb.entries() if e.get("event") == "connection_refused"]
    assert refused and refused[-1]["errorCode"] == "authz_denied"
    assert refused[-1]["peer"]["pid"] == os.getpid()
    assert not [e for e in await sb.entries() if e["kind"] == "call"]


CONNECT_PROBE = r"""
import json, socket, struct, sys
s = socket.socket(socket.AF_UNIX); s.settimeout(10); s.connect(sys.argv[1])
body = json.dumps({"v": 1, "runId": sys.argv[2], "toolCallId": "c", "tool": "time.now",
                   "args": {}}).encode()
s.sendall(struct.pack(">I", len(body)) + body)
n = struct.unpack(">I", s.recv(4))[0]
print(json.loads(s.recv(n)).get("errorCode"))
"""


async def test_a_process_of_another_runs_namespace_is_refused_even_with_the_socket(
    sb: Sandboxed,
) -> None:
    # A whole process (not a thread: /proc/PID/ns/net is the main thread's) living in
    # run b's network namespace, as root so it can reach a's socket file on the host.
    a = await sb.run(workspace=sb.workspace("a"))
    b = await sb.run(workspace=sb.workspace("b"))
    assert a.sandbox is not None and b.sandbox is not None

    def connect_from(netns: str) -> str:
        done = subprocess.run(
            ["ip", "netns", "exec", netns, PY, "-c", CONNECT_PROBE, str(a.socket_path), a.run_id],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return done.stdout.strip() or done.stderr

    from_b = await trio.to_thread.run_sync(connect_from, b.sandbox.netns.name)
    from_a = await trio.to_thread.run_sync(connect_from, a.sandbox.netns.name)
    assert from_b == "authz_denied"
    # The control: the same process in a's own namespace is served (ok: no error code).
    assert from_a == "None"


async def test_a_run_without_the_grant_is_refused_with_authz_denied(sb: Sandboxed) -> None:
    with pytest.raises(AuthzDenied, match="allowSandbox"):
        await sb.run(grant=False)
    refused = [e for e in await sb.entries() if e.get("event") == "run_refused"]
    assert refused[-1]["errorCode"] == "authz_denied"


# --- what the sandbox can see and do ---------------------------------------------------

FS_PROBE = r"""
import errno, os, sys
def attempt(what, fn):
    try:
        fn(); return f"{what}:ok"
    except OSError as e:
        return f"{what}:{errno.errorcode.get(e.errno, e.errno)}"
state = sys.argv[1]
out = [
    attempt("root", lambda: os.listdir("/root")),
    attempt("home", lambda: os.listdir("/home")),
    attempt("shadow", lambda: open("/etc/shadow").read()),
    attempt("gshadow", lambda: open("/etc/gshadow").read()),
    attempt("sudoers", lambda: open("/etc/sudoers").read()),
    attempt("sshkeys", lambda: os.listdir("/etc/ssh")),
    attempt("machineid", lambda: open("/etc/machine-id").read()),
    attempt("var", lambda: os.listdir("/var")),
    attempt("state", lambda: os.listdir(state)),
    attempt("write_etc", lambda: open("/etc/x", "w")),
    attempt("write_usr", lambda: open("/usr/x", "w")),
    attempt("write_root", lambda: open("/x", "w")),
    attempt("write_opt", lambda: open("/opt/cogni-tool/x", "w")),
    attempt("write_dev", lambda: open("/dev/x", "w")),
    attempt("sys", lambda: os.listdir("/sys")),
    attempt("write_ws", lambda: open("/workspace/x", "w")),
    attempt("write_tmp", lambda: open("/tmp/x", "w")),
    attempt("write_shm", lambda: open("/dev/shm/x", "w")),
]
print(" ".join(out))
"""


async def test_host_secrets_and_other_trees_are_invisible_and_only_workspace_and_tmp_writable(
    sb: Sandboxed,
) -> None:
    run = await sb.run()
    result = await sb.py(run, FS_PROBE, str(sb.daemon.config.state_dir))
    assert result.stdout.decode().split() == [
        "root:ENOENT",
        "home:ENOENT",
        "shadow:ENOENT",
        "gshadow:ENOENT",
        "sudoers:ENOENT",
        "sshkeys:ENOENT",
        "machineid:ENOENT",
        "var:ENOENT",
        "state:ENOENT",
        "write_etc:EROFS",
        "write_usr:EROFS",
        "write_root:EROFS",
        "write_opt:EROFS",
        "write_dev:EROFS",
        "sys:ENOENT",
        "write_ws:ok",
        "write_tmp:ok",
        "write_shm:ok",  # private tmpfs, like /tmp (POSIX shared memory needs it)
    ], result.stderr


async def test_no_host_variable_or_secret_reaches_the_sandbox(sb: Sandboxed) -> None:
    secret = os.environ[SECRET_NAME]
    run = await sb.run()
    result = await sb.py(
        run,
        """
        import os
        # As exec'd (os.environ may gain LC_CTYPE from Python's own C-locale coercion).
        initial = open("/proc/self/environ", "rb").read().split(b"\\0")
        print(sorted(item.split(b"=")[0].decode() for item in initial if item))
        blob = b""
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                blob += open(f"/proc/{pid}/environ", "rb").read()
            except OSError:
                pass
        import hashlib
        # Every environment value in the sandbox, as digests: the host checks for its
        # secret's digest without handing the secret in.
        values = {item.split(b"=", 1)[-1] for item in blob.split(b"\\0") if item}
        print(" ".join(sorted(hashlib.sha256(v).hexdigest() for v in values)))
        print(open("/proc/1/cmdline", "rb").read().split(b"\\0")[0].decode())
        """,
    )
    names, digests, init = result.stdout.decode().splitlines()
    passed = [name for name in ("LANG", "TERM") if name in os.environ]
    # PWD: bwrap sets it to the working directory (/workspace) after --chdir.
    expected = sorted(["PATH", "HOME", "PWD", "COGNI_GATEWAY_SOCK", "COGNI_RUN_ID", *passed])
    assert json.loads(names.replace("'", '"')) == expected
    assert secret.encode() not in result.stdout
    seen = set(digests.split())
    # The probe read real environments (its own /workspace is one of the values) ...
    assert hashlib.sha256(b"/workspace").hexdigest() in seen
    # ... and the host's secret is in none of them.
    assert hashlib.sha256(secret.encode()).hexdigest() not in seen
    assert init == "/usr/bin/bwrap"  # /proc/1 inside is the sandbox's own init, not the host's


async def test_the_policy_env_allowlist_passes_exactly_the_named_variables(
    sb: Sandboxed,
) -> None:
    os.environ["COGNI_TEST_ALLOWED"] = "visible"
    try:
        run = await sb.run(POLICY + "env: {allow: [COGNI_TEST_ALLOWED]}\n")
        result = await sb.py(run, "import os; print(sorted(os.environ.items()))")
    finally:
        del os.environ["COGNI_TEST_ALLOWED"]
    assert "('COGNI_TEST_ALLOWED', 'visible')" in result.stdout.decode()
    assert SECRET_NAME.encode() not in result.stdout


TTY_PROBE = r"""
import fcntl, os, termios
try:
    fd = os.open("/dev/tty", os.O_RDWR)
    fcntl.ioctl(fd, termios.TIOCSTI, b"x")
    print("typed into the terminal")
except OSError as e:
    print("tty:", e.strerror)
print("isatty:", any(os.isatty(n) for n in (0, 1, 2)))
"""


def test_a_sandbox_started_from_a_terminal_cannot_reach_that_terminal(base: Path) -> None:
    # gatewayd run from an operator's terminal: the sandbox gets a new session and no
    # controlling terminal, so it cannot type into the operator's shell (TIOCSTI).
    argv = one_shot_argv(base, PY, "-c", TTY_PROBE)
    pid, terminal = pty.fork()
    if pid == 0:  # the child: gatewayd with the pty as its controlling terminal
        os.execv(argv[0], argv)
    output = b""
    try:
        while True:
            try:
                chunk = os.read(terminal, 4096)
            except OSError:  # EIO: the terminal's last user is gone
                break
            if not chunk:
                break
            output += chunk
    finally:
        os.close(terminal)
        _, status = os.waitpid(pid, 0)
    text = output.decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 0, text
    assert "tty: No such device or address" in text
    assert "isatty: False" in text
    assert "typed into the terminal" not in text


async def test_abstract_unix_sockets_of_the_host_are_out_of_reach(sb: Sandboxed) -> None:
    # Abstract socket names live in the network namespace: a host service listening on
    # one (X11, D-Bus, containerd do) is invisible from the run's namespace.
    name = f"cogni-test-{secrets.token_hex(4)}"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind("\0" + name)
    listener.listen(1)
    run = await sb.run()
    try:
        result = await sb.py(
            run,
            """
            import socket, sys
            s = socket.socket(socket.AF_UNIX)
            try:
                s.connect("\\0" + sys.argv[1]); print("connected")
            except OSError as e:
                print(type(e).__name__)
            """,
            name,
        )
        with socket.socket(socket.AF_UNIX) as host_side:  # it works from the host
            host_side.connect("\0" + name)
    finally:
        listener.close()
    assert result.stdout.strip() == b"ConnectionRefusedError", result.stderr


async def test_tmp_and_dev_shm_are_capped_by_the_policy(sb: Sandboxed) -> None:
    run = await sb.run(
        POLICY.replace("max_output_bytes: 65536", "max_output_bytes: 65536, tmp_mb: 2")
    )
    result = await sb.py(
        run,
        """
        import errno
        for path in ("/tmp/fill", "/dev/shm/fill"):
            try:
                with open(path, "wb") as f:
                    for _ in range(8):
                        f.write(b"x" * (1 << 20))
                print("filled")
            except OSError as e:
                print(errno.errorcode[e.errno])
        """,
    )
    assert result.stdout.split() == [b"ENOSPC", b"ENOSPC"], result.stderr


KERNEL_PROBE = r"""
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
def call(name, *args):
    rc = getattr(libc, name)(*args)
    return "ok" if rc >= 0 else errno.errorcode.get(ctypes.get_errno(), "?")
out = {
    "ptrace": call("ptrace", 0, 0, 0, 0),
    "mount": call("mount", b"none", b"/tmp", b"tmpfs", 0, None),
    "unshare_user": call("unshare", 0x10000000),
    "unshare_net": call("unshare", 0x40000000),
    "bpf": call("syscall", 321, 0, 0, 0),
    "io_uring_setup": call("syscall", 425, 1, 0),
    "userfaultfd": call("syscall", 323, 0),
    "keyctl": call("syscall", 250, 0, 0, 0, 0),
    "perf_event_open": call("syscall", 298, 0, 0, -1, -1, 0),
}
print(" ".join(f"{k}={v}" for k, v in out.items()))
"""


async def test_kernel_escape_routes_are_refused_inside(sb: Sandboxed) -> None:
    run = await sb.run()
    result = await sb.py(run, KERNEL_PROBE)
    got = dict(item.split("=") for item in result.stdout.decode().split())
    assert got == {
        "ptrace": "EPERM",
        "mount": "EPERM",
        "unshare_user": "EPERM",
        "unshare_net": "EPERM",
        "bpf": "EPERM",
        "io_uring_setup": "ENOSYS",
        "userfaultfd": "EPERM",
        "keyctl": "EPERM",
        "perf_event_open": "EPERM",
    }, result.stderr


# --- limits ----------------------------------------------------------------------------

FORK_BOMB = r"""
import os, time
n = 0
for _ in range(400):
    try:
        pid = os.fork()
    except OSError as e:
        print(n, errno_name := e.strerror, flush=True); break
    if pid == 0:
        time.sleep(30); os._exit(0)
    n += 1
time.sleep(0.5)
"""

MEMORY_BOMB = r"""
chunks = []
while True:
    chunks.append(bytearray(16 * 1024 * 1024))
"""


async def test_fork_and_memory_bombs_are_contained_while_other_runs_are_served(
    sb: Sandboxed,
) -> None:
    bombed = await sb.run(workspace=sb.workspace("bomb"), memory_mb=256)
    other = await sb.run(workspace=sb.workspace("other"))
    answers: list[bytes] = []

    async def keep_calling() -> None:
        for _ in range(5):
            # Served meanwhile, promptly: a bomb in one run must not stall another.
            with trio.fail_after(10):
                result = await sb.daemon.runs.exec(other.run_id, ["cogni-tool", "exec", "time.now"])
            answers.append(result.stdout)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(keep_calling)
        fork = await sb.py(bombed, FORK_BOMB)
        memory = await sb.py(bombed, MEMORY_BOMB)
    count, error = fork.stdout.split(maxsplit=1)
    assert int(count) < 48 and b"Resource temporarily unavailable" in error, fork.stderr
    settings = sb.daemon.runs.sandbox_settings
    if settings is not None and settings.cgroups is not None:  # the kernel's OOM killer
        assert (memory.errorCode, memory.memoryLimit) == ("oom_killed", "cgroup"), memory
    else:  # RLIMIT_AS: the allocation fails inside and Python gives up
        assert (memory.exitCode, memory.memoryLimit) == (1, "rlimit"), memory
        assert b"MemoryError" in memory.stderr
    assert len(answers) == 5 and all(b"UTC" in a for a in answers)


async def test_a_command_over_its_timeout_is_killed_with_its_children(sb: Sandboxed) -> None:
    run = await sb.run()
    assert run.sandbox is not None
    result = await sb.daemon.runs.exec(
        run.run_id,
        ["sh", "-c", "trap '' TERM; (trap '' TERM; sleep 60) & sleep 60"],
        timeout_s=0.5,
    )
    assert result.errorCode == "timeout"
    assert pids_of_uid(run.sandbox.user.uid) == []


async def test_output_over_the_policy_cap_is_truncated_and_flagged(sb: Sandboxed) -> None:
    run = await sb.run(POLICY.replace("max_output_bytes: 65536", "max_output_bytes: 1000"))
    result = await sb.py(run, "print('x' * 100000)")
    assert len(result.stdout) == 1000 and result.stdoutTruncated and result.exitCode == 0


async def test_a_caller_timeout_can_shorten_but_never_lengthen_the_policys(sb: Sandboxed) -> None:
    run = await sb.run(POLICY.replace("timeout_s: 30", "timeout_s: 0.5"))
    result = await sb.daemon.runs.exec(run.run_id, ["sleep", "30"], timeout_s=3600)
    assert result.errorCode == "timeout" and result.durationMs < 10_000


# --- refusals at run start -------------------------------------------------------------


async def test_a_workspace_under_a_private_directory_works_since_its_source_is_pinned(
    sb: Sandboxed,
) -> None:
    # bwrap runs as the run's uid, but it binds the run-private mount point the launcher
    # attached the pinned workspace to: the operator's 0700 parent needs no o+x.
    hidden = sb.base / "private"
    hidden.mkdir(mode=0o700)
    ws = hidden / "ws"
    ws.mkdir()
    (ws / "notes.md").write_text("hello\n")
    run = await sb.run(workspace=ws)
    result = await sb.py(run, "print(open('/workspace/notes.md').read().strip())")
    assert result.stdout.strip() == b"hello", result.stderr
    await sb.daemon.runs.end(run.run_id)
    assert os.stat(ws / "notes.md").st_uid == 0


async def test_a_nested_grant_swapped_between_commands_still_binds_the_pinned_directory(
    sb: Sandboxed,
) -> None:
    # The review's attack: between two commands the sandbox renames a nested read-only
    # grant's parent and puts something else at its path. bwrap must bind the directory
    # pinned at run start, never what the host path has become.
    ws = sb.workspace()
    (ws / "docs" / "ref").mkdir(parents=True)
    (ws / "docs" / "ref" / "spec.md").write_text("the spec\n")
    policy = POLICY.replace(
        "workspace: {root: ., mode: rw}",
        "workspace: {root: ., mode: rw}\n    ref: {root: docs/ref, mode: ro}",
    )
    run = await sb.run(policy, workspace=ws)
    swap = await sb.py(
        run,
        """
        import os
        os.rename("/workspace/docs", "/workspace/docs_old")
        os.makedirs("/workspace/docs/ref")
        open("/workspace/docs/ref/decoy.md", "w").write("decoy")
        print("swapped")
        """,
    )
    assert swap.stdout.strip() == b"swapped", swap.stderr
    look = await sb.py(run, "import os; print(sorted(os.listdir('/workspace/docs/ref')))")
    assert look.stdout.strip() == b"['spec.md']", look.stderr  # the pinned one, read-only
    # A symlink to a host directory in its place: bwrap never resolves the host path, and
    # the sandbox's own broken layout only stops its next command.
    relink = await sb.py(
        run,
        "import os; os.rename('/workspace/docs', '/workspace/docs2'); "
        "os.mkdir('/workspace/docs'); os.symlink('/etc', '/workspace/docs/ref'); print('ok')",
    )
    assert relink.stdout.strip() == b"ok", relink.stderr
    broken = await sb.py(run, "import os; print(sorted(os.listdir('/workspace/docs/ref')))")
    assert broken.exitCode != 0 and b"Can't bind mount" in broken.stderr
    assert b"passwd" not in broken.stdout and b"ssh" not in broken.stdout


async def test_exec_in_an_ended_or_unknown_run_is_refused(sb: Sandboxed) -> None:
    run = await sb.run()
    await sb.daemon.runs.end(run.run_id)
    with pytest.raises(LookupError):
        await sb.daemon.runs.exec(run.run_id, ["true"])


async def test_ending_a_run_stops_its_running_commands(sb: Sandboxed) -> None:
    run = await sb.run()
    assert run.sandbox is not None
    uid = run.sandbox.user.uid
    outcome: list[object] = []

    async def long_command() -> None:
        try:
            await sb.daemon.runs.exec(run.run_id, ["sleep", "60"])
        except Exception as exc:
            outcome.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(long_command)
        with trio.fail_after(10):
            while not pids_of_uid(uid):
                await trio.sleep(0.02)
        with trio.fail_after(10):
            await sb.daemon.runs.end(run.run_id)
    assert outcome and "ended while the command ran" in str(outcome[0])
    assert pids_of_uid(uid) == []


# --- require_os_sandbox (a daemon whose host has no sandbox) ---------------------------


async def test_without_an_os_sandbox_a_requiring_policy_is_refused_and_a_lenient_one_degraded(
    base: Path,
) -> None:
    config = GatewaydConfig(state_dir=base / "state", policy_dirs=(base,), os_sandbox=False)
    ws = base / "ws"
    ws.mkdir()
    async with open_daemon(config, preload=True) as daemon:
        gw = Sandboxed(daemon, base)
        with pytest.raises(PolicyViolation, match="require_os_sandbox: false"):
            await gw.run(workspace=ws)
        run = await gw.run(POLICY + "require_os_sandbox: false\n", workspace=ws)
        assert run.sandbox is None and run.degraded is not None
        request = {"v": 1, "runId": run.run_id, "toolCallId": "c", "tool": "time.now"}
        stream = await trio.open_unix_socket(str(run.socket_path))
        async with stream:
            await stream.send_all(frame({**request, "args": {}}))
            answer = await read_frame(stream, bytearray())
            await stream.send_all(frame({**request, "tool": "fs.stat", "args": {}}))
            denied = await read_frame(stream, bytearray())
        assert answer is not None and answer["ok"] is True
        assert denied is not None and denied["errorCode"] == "policy_denied"
        with pytest.raises(Exception, match="no OS sandbox"):
            await daemon.runs.exec(run.run_id, ["true"])
        entries = await gw.entries()
    refused = next(e for e in entries if e.get("event") == "run_refused")
    assert refused["errorCode"] == "policy_denied"
    assert "--no-os-sandbox" in refused["safeMessage"]
    calls = [e for e in entries if e["kind"] == "call"]
    assert len(calls) == 2
    assert all("no OS sandbox" in c["degraded"] for c in calls)
    support = next(e for e in entries if e.get("event") == "sandbox_support")
    assert support["detail"]["available"] is False


async def test_a_state_dir_the_sandbox_cannot_pass_makes_the_sandbox_unavailable(
    base: Path,
) -> None:
    locked = base / "locked"
    locked.mkdir(mode=0o700)
    config = sandbox_config(locked)
    async with open_daemon(config, preload=True) as daemon:
        assert not daemon.runs.support.available
        assert f"chmod o+x {locked}" in daemon.runs.support.reason


# --- crash cleanup ---------------------------------------------------------------------


async def test_a_crashed_daemon_leaves_nothing_after_the_next_start(base: Path) -> None:
    from tests.livedaemon import start_daemon

    ws = base / "ws"
    ws.mkdir()
    (ws / "notes.md").write_text("hello\n")
    policy = base / "policy.yaml"
    # Mode host: what the crashed run left is looked for in the workspace itself
    # (test_run_workspaces.py crashes an overlay run).
    policy.write_text(textwrap.dedent(POLICY) + "workspace: {mode: host}\n")
    state = base / "state"
    prefix = f"cgt{secrets.token_hex(4)}-"
    uid_base = 1_700_000_000 + secrets.randbelow(50_000) * 1024
    options = ("--netns-prefix", prefix, "--sandbox-uids", f"{uid_base}+8")
    daemon = start_daemon(state, *options, sandbox=True)
    try:
        run = daemon.create_run(ws, policy)
        netns = NETNS_RUN_DIR / f"{prefix}{run['runId']}"
        status, _ = daemon.control(
            "POST", f"/v1/runs/{run['runId']}/exec", {"command": ["sh", "-c", "echo x > made.md"]}
        )
        assert status == 200
        leased_uid = os.stat(ws / "notes.md").st_uid
        assert leased_uid != 0 and netns.exists()
        # A command still running when the daemon dies (the HTTP call never returns).
        long_exec = subprocess.Popen(
            [
                "curl",
                "-s",
                "--unix-socket",
                str(daemon.control_socket),
                "-X",
                "POST",
                "-d",
                json.dumps({"command": ["sleep", "300"]}),
                f"http://gatewayd/v1/runs/{run['runId']}/exec",
            ],
            stdout=subprocess.DEVNULL,
        )
        with trio.fail_after(10):  # the command runs (bwrap's setup is over)
            while not _commands_of_uid(leased_uid) & {"sleep"}:
                await trio.sleep(0.02)
        daemon.proc.kill()  # a crash: no cleanup at all
        daemon.proc.wait()
        long_exec.wait(timeout=10)
    finally:
        daemon.stop()
    # The parent-death signal and bwrap's --die-with-parent take the sandbox down at once.
    with trio.fail_after(5):
        while pids_of_uid(leased_uid):
            await trio.sleep(0.02)
    # What is left: the namespace, the lease (the workspace still the run uid's).
    assert netns.exists()
    assert os.stat(ws / "notes.md").st_uid == leased_uid
    restarted = start_daemon(state, *options, sandbox=True)
    try:
        assert pids_of_uid(leased_uid) == []
        assert not netns.exists()
        assert os.stat(ws / "notes.md").st_uid == 0
        assert os.stat(ws / "made.md").st_uid == 0
        assert os.stat(ws).st_uid == 0
        assert list((state / "runs").iterdir()) == []
        status, health = restarted.control("GET", "/v1/health")
        assert status == 200 and health["runs"] == 0
    finally:
        restarted.stop()
    entries = [
        json.loads(line) for line in (state / "audit" / "audit.jsonl").read_text().splitlines()
    ]
    cleaned = [e for e in entries if e.get("event") == "leftovers_removed"]
    assert cleaned and cleaned[0]["detail"]["runDirs"] == [run["runId"]]
    assert cleaned[0]["detail"]["netns"] == [netns.name]
    support = [e for e in entries if e.get("event") == "sandbox_support"][-1]["detail"]
    if support["cgroups"]:  # the killed command's cgroup was left, empty, and is swept
        assert any(run["runId"] in path for path in support["leftoverCgroups"])


def _commands_of_uid(uid: int) -> set[str]:
    names = set()
    for pid in pids_of_uid(uid):
        try:
            names.add(Path(f"/proc/{pid}/comm").read_text().strip())
        except OSError:
            continue
    return names


async def test_a_sandbox_orphaned_while_it_starts_is_killed_at_the_next_start(
    base: Path,
) -> None:
    # bwrap sets its init's parent-death signal only part-way through its setup: a daemon
    # killed inside that window can leave the sandbox running. The lease names its uid,
    # so the next start kills it before giving the workspace back.
    from tests.livedaemon import start_daemon

    ws = base / "ws"
    ws.mkdir()
    policy = base / "policy.yaml"
    policy.write_text(textwrap.dedent(POLICY))
    state = base / "state"
    options = ("--netns-prefix", f"cgt{secrets.token_hex(4)}-")
    options += ("--sandbox-uids", f"{1_700_000_000 + secrets.randbelow(50_000) * 1024}+8")
    daemon = start_daemon(state, *options, sandbox=True)
    orphan_uid = None
    try:
        run = daemon.create_run(ws, policy)
        orphan_uid = os.stat(ws).st_uid
        # A sandbox the daemon does not supervise, as if bwrap's monitor had died in the
        # window: started in the run's netns as the run's uid, like a real one.
        subprocess.Popen(
            [
                "setpriv",
                f"--reuid={orphan_uid}",
                f"--regid={orphan_uid}",
                "--clear-groups",
                "sleep",
                "300",
            ],
            start_new_session=True,
        )
        with trio.fail_after(10):
            while not _commands_of_uid(orphan_uid) & {"sleep"}:
                await trio.sleep(0.02)
        daemon.proc.kill()
        daemon.proc.wait()
    finally:
        daemon.stop()
    assert orphan_uid is not None and _commands_of_uid(orphan_uid) == {"sleep"}
    restarted = start_daemon(state, *options, sandbox=True)
    try:
        assert pids_of_uid(orphan_uid) == []
        assert os.stat(ws).st_uid == 0
        assert not (NETNS_RUN_DIR / f"{options[1]}{run['runId']}").exists()
    finally:
        restarted.stop()


# --- exec_started is written ahead of the command -----------------------------------------

# A command that leaves a mark in the workspace if it ever runs.
MARK = "open('/workspace/ran', 'w').write('ran')"


async def test_a_command_whose_exec_started_cannot_be_made_durable_never_runs(
    sb: Sandboxed, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = sb.workspace()
    run = await sb.run(workspace=ws)
    assert run.sandbox is not None
    uid = run.sandbox.user.uid
    waited: list[int] = []

    async def failing(seq: int) -> None:
        waited.append(seq)
        await trio.sleep(0.5)  # bwrap builds the whole sandbox meanwhile, then blocks
        raise AuditWriteError("the disk went away")

    monkeypatch.setattr(sb.daemon.audit, "durable", failing)
    with pytest.raises(AuditWriteError) as caught:
        await sb.py(run, MARK)
    monkeypatch.undo()
    assert caught.value.detail == "the disk went away"
    assert waited, "the command did not wait for its exec_started entry"
    assert not (ws / "ran").exists()
    assert pids_of_uid(uid) == []  # the sandbox that waited was killed, nothing left
    done = await sb.py(run, MARK)  # the log is back: the next command runs
    assert done.exitCode == 0, done.stderr
    assert (ws / "ran").exists()


async def test_a_command_cancelled_while_its_entry_is_flushed_never_runs(
    sb: Sandboxed, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = sb.workspace()
    run = await sb.run(workspace=ws)
    assert run.sandbox is not None
    uid = run.sandbox.user.uid
    blocked = trio.Event()

    async def never(seq: int) -> None:
        blocked.set()
        await trio.sleep_forever()

    monkeypatch.setattr(sb.daemon.audit, "durable", never)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sb.py, run, MARK)
        await blocked.wait()
        await trio.sleep(0.5)  # bwrap is waiting on its block descriptor by now
        nursery.cancel_scope.cancel()
    monkeypatch.undo()
    assert not (ws / "ran").exists()
    assert pids_of_uid(uid) == []


async def test_the_command_starts_only_after_its_exec_started_entry_is_on_disk(
    sb: Sandboxed, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = sb.workspace()
    run = await sb.run(workspace=ws)
    real = sb.daemon.audit.durable
    seen: list[bool] = []

    async def slow(seq: int) -> None:
        await trio.sleep(0.5)
        seen.append((ws / "ran").exists())  # not yet, however far bwrap got
        await real(seq)

    monkeypatch.setattr(sb.daemon.audit, "durable", slow)
    done = await sb.py(run, MARK)
    monkeypatch.undo()
    assert done.exitCode == 0, done.stderr
    assert seen[:1] == [False] and (ws / "ran").exists()
    started = [e for e in await sb.entries() if e.get("event") == "exec_started"]
    assert started and started[-1]["runId"] == run.run_id


# --- gatewayd exec and the control socket ----------------------------------------------


async def test_gatewayd_exec_runs_in_the_runs_sandbox_and_passes_status_and_output(
    base: Path,
) -> None:
    from tests.livedaemon import start_daemon

    ws = base / "ws"
    ws.mkdir()
    policy = base / "policy.yaml"
    policy.write_text(textwrap.dedent(POLICY))
    daemon = start_daemon(base / "state", sandbox=True)
    gatewayd = str(Path(sys.executable).parent / "gatewayd")
    state = ["--state-dir", str(base / "state")]
    try:
        run = daemon.create_run(ws, policy)
        ok = subprocess.run(
            [
                gatewayd,
                "exec",
                *state,
                run["runId"],
                "--",
                "sh",
                "-c",
                "id -u; echo err >&2; exit 3",
            ],
            capture_output=True,
        )
        assert (ok.returncode, ok.stdout, ok.stderr) == (3, b"1000\n", b"err\n")
        binary = subprocess.run(
            [
                gatewayd,
                "exec",
                *state,
                run["runId"],
                "--",
                PY,
                "-c",
                "import sys; sys.stdout.buffer.write(bytes(range(256)))",
            ],
            capture_output=True,
        )
        assert binary.stdout == bytes(range(256))
        piped = subprocess.run(
            [gatewayd, "exec", *state, "-i", run["runId"], "--", "wc", "-c"],
            input=b"12345",
            capture_output=True,
        )
        assert piped.stdout.strip() == b"5"
        late = subprocess.run(
            [gatewayd, "exec", *state, "--timeout", "0.3", run["runId"], "--", "sleep", "30"],
            capture_output=True,
            text=True,
        )
        assert late.returncode == 124 and "timeout" in late.stderr
        unknown = subprocess.run(
            [gatewayd, "exec", *state, "0" * 32, "--", "true"], capture_output=True, text=True
        )
        assert unknown.returncode == 1 and "no such run" in unknown.stderr
        empty = subprocess.run(
            [gatewayd, "exec", *state, run["runId"]], capture_output=True, text=True
        )
        assert empty.returncode == 2 and "give the command after --" in empty.stderr
        status, bad = daemon.control("POST", f"/v1/runs/{run['runId']}/exec", {"command": []})
        assert status == 400 and bad["errorCode"] == "bad_request" and "command" in bad["message"]
        status, bad = daemon.control(
            "POST", f"/v1/runs/{run['runId']}/exec", {"command": ["true"], "shell": True}
        )
        assert status == 400 and "shell" in bad["message"]
        status, bad = daemon.control(
            "POST", f"/v1/runs/{run['runId']}/exec", {"command": ["/no/such/program"]}
        )
        assert status == 200 and bad["result"]["exitCode"] != 0
        assert "execvp" in bad["result"]["stderr"] or "No such file" in bad["result"]["stderr"]
    finally:
        daemon.stop()
    entries = [json.loads(line) for line in daemon.audit_path.read_text().splitlines()]
    started = [e for e in entries if e.get("event") == "exec_started"]
    ended = [e for e in entries if e.get("event") == "exec_ended"]
    assert len(started) == len(ended) == 5
    assert started[0]["detail"]["command"][:2] == ["sh", "-c"]
    assert ended[0]["detail"]["exitCode"] == 3


def one_shot_argv(base: Path, *command: str, extra: tuple[str, ...] = ()) -> list[str]:
    """`gatewayd run` in ``base`` (a fresh workspace and POLICY there) with a sandbox of
    its own prefix and uids, running ``command``."""
    from tests.livedaemon import sandbox_options

    ws = base / "ws"
    ws.mkdir(exist_ok=True)
    policy = base / "policy.yaml"
    policy.write_text(textwrap.dedent(POLICY))
    gatewayd = str(Path(sys.executable).parent / "gatewayd")
    return [
        gatewayd,
        "run",
        "--state-dir",
        str(base / "state"),
        *sandbox_options(),
        "--workspace",
        str(ws),
        "--policy",
        str(policy),
        *extra,
        "--",
        *command,
    ]


def test_gatewayd_run_runs_its_command_in_the_sandbox(base: Path) -> None:
    proc = subprocess.run(
        one_shot_argv(base, "sh", "-c", "cogni-tool exec time.now >/dev/null && ls / && exit 4"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 4, proc.stderr
    assert "workspace" in proc.stdout.split() and "root" not in proc.stdout.split()
    assert "1 calls, 1 allowed" in proc.stderr


# --- a root filesystem image instead of the host's system directories -----------------


def make_python_image(root: Path) -> None:
    """A small image that runs python3 and cogni-tool: the interpreter, its standard
    library and the libraries it links, hard-linked from the host where possible, plus
    busybox for a shell and the mount points gatewayd needs (sandbox_image/README.md)."""
    libs = ["libm.so.6", "libz.so.1", "libexpat.so.1", "libc.so.6"]
    for directory in ("usr/bin", "usr/lib/x86_64-linux-gnu", "usr/lib64", "proc", "dev", "tmp"):
        (root / directory).mkdir(parents=True, exist_ok=True)
    for directory in ("workspace", "opt/cogni-tool", "etc", "run/cogni"):
        (root / directory).mkdir(parents=True, exist_ok=True)
    for name in ("etc/passwd", "etc/group", "etc/hosts", "run/cogni/gateway.sock"):
        (root / name).write_text("")
    for link, target in (("bin", "usr/bin"), ("lib64", "usr/lib64"), ("lib", "usr/lib")):
        (root / link).symlink_to(target)
    copies = [
        ("/usr/bin/python3.11", "usr/bin/python3.11"),
        ("/usr/lib64/ld-linux-x86-64.so.2", "usr/lib64/ld-linux-x86-64.so.2"),
        ("/bin/busybox", "usr/bin/busybox"),
        *((f"/usr/lib/x86_64-linux-gnu/{lib}", f"usr/lib/x86_64-linux-gnu/{lib}") for lib in libs),
    ]
    for source, dest in copies:
        real = os.path.realpath(source)
        try:
            os.link(real, root / dest)
        except OSError:  # another file system: copy instead
            shutil.copy2(real, root / dest)
    subprocess.run(
        ["cp", "-al", "/usr/lib/python3.11", str(root / "usr/lib/python3.11")], check=False
    )
    if not (root / "usr/lib/python3.11/os.py").exists():
        shutil.copytree("/usr/lib/python3.11", root / "usr/lib/python3.11", symlinks=True)
    (root / "usr/bin/python3").symlink_to("python3.11")
    for applet in ("sh", "ls", "cat", "id"):
        (root / "usr/bin" / applet).symlink_to("busybox")


@pytest.mark.skipif(not os.path.exists("/bin/busybox"), reason="needs busybox-static (make setup)")
def test_gatewayd_run_with_an_image_sees_the_images_root_and_still_reaches_the_gateway(
    base: Path,
) -> None:
    image = base / "image"
    make_python_image(image)
    gatewayd = str(Path(sys.executable).parent / "gatewayd")
    check = subprocess.run([gatewayd, "image", "check", str(image)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
    probe = "cogni-tool exec time.now && ls /usr/lib && cat /etc/os-release; id -u"
    proc = subprocess.run(
        one_shot_argv(base, "sh", "-c", probe, extra=("--image", str(image))),
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = proc.stdout.split()
    assert '"timezone":' in proc.stdout, proc.stderr
    # The image's /usr/lib holds only what the image has; the host's /etc is not there.
    assert "python3.11" in lines and "git" not in lines and "apt" not in lines
    assert "cat: can't open '/etc/os-release'" in proc.stderr
    assert lines[-1] == "1000"


def test_an_image_that_cannot_be_a_root_refuses_the_run_with_every_problem(base: Path) -> None:
    image = base / "image"
    (image / "usr").mkdir(parents=True)
    proc = subprocess.run(
        one_shot_argv(base, "true", extra=("--image", str(image))),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "bad_request" in proc.stderr and "/usr/bin/python3" in proc.stderr
    assert "/workspace" in proc.stderr  # a missing mount point is named with its fix


def test_gatewayd_run_shows_the_commands_output_as_it_comes(base: Path) -> None:
    proc = subprocess.Popen(
        one_shot_argv(base, "sh", "-c", "echo first; sleep 1; echo second"),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    try:
        first = proc.stdout.readline()
        still_running = proc.poll() is None  # the command is still sleeping
        rest = proc.stdout.read()
    finally:
        proc.wait(timeout=30)
    assert first == b"first\n" and still_running
    assert rest == b"second\n"  # shown once, not again at the end


# --- the lease: what lending the workspace must never do -------------------------------


async def test_a_workspace_that_would_expose_the_state_dir_is_refused_before_anything_is_lent(
    sb: Sandboxed,
) -> None:
    # The base holds the state directory (every run's socket): as a workspace it is
    # refused when the run is created, before a single file is chowned (and the plan's
    # checks would refuse it next: unit/test_sandbox_plan.py).
    canary = sb.base / "canary.md"
    canary.write_text("x")
    with pytest.raises(NotLendable, match=r"holds gatewayd's own state_dir .*/state,") as caught:
        await sb.run(workspace=sb.base)
    assert getattr(caught.value, "code", None) == "bad_request"
    # Read-only, it is never lent, and the plan refuses to show it to the sandbox.
    ro = POLICY.replace(
        "mode: rw}", f"mode: rw}}\n    base: {{root: {sb.base}, mount: /data/base, mode: ro}}"
    )
    with pytest.raises(UnsafeMounts, match=r"exposes .*state") as caught:
        await sb.run(ro)
    assert getattr(caught.value, "code", None) == "bad_request"
    assert os.stat(canary).st_uid == 0 and os.stat(sb.base).st_uid == 0
    assert sb.daemon.runs.uid_pool.in_use == 0
    assert not [
        p for p in NETNS_RUN_DIR.iterdir() if p.name.startswith(sb.daemon.config.netns_prefix)
    ]


async def test_a_hard_link_in_the_workspace_is_not_lent_so_its_other_name_stays_safe(
    sb: Sandboxed,
) -> None:
    outside = sb.base / "outside.txt"  # stands for /etc/passwd: a host file, one inode
    outside.write_text("host data\n")
    ws = sb.workspace()
    os.link(outside, ws / "linked.txt")
    run = await sb.run(workspace=ws)
    assert os.stat(outside).st_uid == 0  # not lent
    result = await sb.py(
        run,
        """
        import errno
        print(open("/workspace/linked.txt").read().strip())
        try:
            open("/workspace/linked.txt", "a").write("pwned")
            print("written")
        except OSError as e:
            print(errno.errorcode[e.errno])
        """,
    )
    assert result.stdout.split(b"\n")[:2] == [b"host data", b"EACCES"], result.stderr
    await sb.daemon.runs.end(run.run_id)
    assert outside.read_text() == "host data\n" and os.stat(outside).st_uid == 0


SUID_PROBE = r"""
import ctypes, errno, os, shutil
libc = ctypes.CDLL(None, use_errno=True)
shutil.copy("/bin/true", "/workspace/plain")
def attempt(what, fn):
    try:
        fn(); return f"{what}:ok"
    except OSError as e:
        return f"{what}:{errno.errorcode[e.errno]}"
def syscall(number, *args):
    if libc.syscall(number, *args) < 0:
        raise OSError(ctypes.get_errno(), "")
out = [
    attempt("chmod", lambda: os.chmod("/workspace/plain", 0o4755)),
    attempt("chmod_sgid", lambda: os.chmod("/workspace/plain", 0o2755)),
    attempt("fchmod", lambda: os.fchmod(os.open("/workspace/plain", os.O_RDONLY), 0o6755)),
    attempt("fchmodat2", lambda: syscall(452, -100, b"/workspace/plain", 0o4755, 0)),
    attempt("open_creat", lambda: os.open("/workspace/a", os.O_CREAT | os.O_WRONLY, 0o4755)),
    attempt("creat", lambda: syscall(85, b"/workspace/b", 0o4755)),
    attempt("mkdir_sgid", lambda: os.mkdir("/workspace/d", 0o2755)),
    attempt("mknod", lambda: os.mknod("/workspace/f", 0o104755)),
    attempt("openat2", lambda: syscall(437, -100, b"/workspace/c", 0, 0)),
    attempt("chmod_plain", lambda: os.chmod("/workspace/plain", 0o755)),
]
print(" ".join(out))
print(oct(os.stat("/workspace/plain").st_mode & 0o7777))
"""


async def test_the_sandbox_cannot_make_a_setuid_or_setgid_file_by_any_call(
    sb: Sandboxed,
) -> None:
    # A setuid file the run's uid owns, in a host directory, would let a host user who
    # runs it become that uid (and outlive the run). Every mode-setting call is refused
    # such a mode; ordinary modes still work.
    ws = sb.workspace()
    run = await sb.run(workspace=ws)
    result = await sb.py(run, SUID_PROBE)
    lines = result.stdout.decode().splitlines()
    assert lines[0].split() == [
        "chmod:EPERM",
        "chmod_sgid:EPERM",
        "fchmod:EPERM",
        "fchmodat2:EPERM",
        "open_creat:EPERM",
        "creat:EPERM",
        "mkdir_sgid:EPERM",
        "mknod:EPERM",
        "openat2:ENOSYS",
        "chmod_plain:ok",
    ], result.stderr
    assert lines[1] == "0o755"
    for path in ws.rglob("*"):  # nothing on the host carries the bits, during the run
        assert not path.lstat().st_mode & (stat.S_ISUID | stat.S_ISGID), path
    await sb.daemon.runs.end(run.run_id)


FIFO_PROBE = """
import errno, os
out = []
for path in ("/workspace/pipe", "/tmp/pipe"):
    try:
        os.mkfifo(path, 0o600)
        out.append("made")
    except OSError as e:
        out.append(errno.errorcode[e.errno])
try:
    os.mknod("/workspace/plain", 0o600)
    out.append("plain")
except OSError as e:
    out.append(errno.errorcode[e.errno])
print(" ".join(out))
"""


async def test_the_sandbox_cannot_make_a_fifo_anywhere(sb: Sandboxed) -> None:
    # A FIFO in the workspace would block whoever opens it on the host (a wasm tool's
    # blocking open); one in /tmp is refused alike, since seccomp sees no path.
    ws = sb.workspace()
    run = await sb.run(workspace=ws)
    result = await sb.py(run, FIFO_PROBE)
    assert result.stdout.decode().split() == ["EPERM", "EPERM", "plain"], result.stderr
    assert not (ws / "pipe").exists()
    assert (ws / "plain").is_file()
    await sb.daemon.runs.end(run.run_id)


async def test_a_process_holding_the_runs_uid_only_as_effective_uid_is_killed_at_run_end(
    sb: Sandboxed,
) -> None:
    # What a host user running a setuid file of the run's uid would be (the seccomp rule
    # above stops the file; this is the second line): real uid nobody, effective uid the
    # run's. The run's end must find and kill it, and the uid must not be handed out.
    run = await sb.run()
    assert run.sandbox is not None
    uid = run.sandbox.user.uid
    survivor = subprocess.Popen(
        [
            "setpriv",
            "--ruid=65534",
            f"--euid={uid}",
            "--rgid=65534",
            "--clear-groups",
            "sleep",
            "300",
        ],
    )
    try:
        with trio.fail_after(10):
            while survivor.pid not in pids_of_uid(uid):
                await trio.sleep(0.01)
        await sb.daemon.runs.end(run.run_id)
        assert survivor.wait(timeout=10) == -9  # SIGKILL
    finally:
        survivor.kill()
        survivor.wait()


async def test_a_workspace_another_live_run_holds_is_refused(sb: Sandboxed) -> None:
    outer = sb.base / "outer"
    outer.mkdir()
    ws = outer / "ws"
    ws.mkdir()
    (ws / "notes.md").write_text("hello\n")
    first = await sb.run(workspace=ws)
    nested = ws / "sub"
    with pytest.raises(WorkspaceInUse, match="live run holds"):
        await sb.run(workspace=ws)
    nested.mkdir()
    with pytest.raises(WorkspaceInUse, match="overlaps"):
        await sb.run(workspace=nested)
    with pytest.raises(WorkspaceInUse, match="overlaps"):
        await sb.run(workspace=outer)  # a parent of the held one
    await sb.daemon.runs.end(first.run_id)
    second = await sb.run(workspace=ws)  # free again
    await sb.daemon.runs.end(second.run_id)
    assert os.stat(ws).st_uid == 0 and os.stat(ws / "notes.md").st_uid == 0


async def test_a_workspace_owned_by_a_sandbox_uid_is_refused_not_lent_again(sb: Sandboxed) -> None:
    ws = sb.workspace()
    stray = sb.daemon.config.resolved_sandbox_uids.base + 5  # a lost lease's owner, say
    os.chown(ws, stray, stray)
    with pytest.raises(SandboxUnavailable, match=f"owned by sandbox uid {stray}"):
        await sb.run(workspace=ws)
    refused = [e for e in await sb.entries() if e.get("event") == "run_refused"][-1]
    assert "one workspace serves one run at a time" in refused["safeMessage"]
    assert os.stat(ws).st_uid == stray  # untouched
    assert sb.daemon.runs.uid_pool.in_use == 0


async def test_a_tree_thousands_of_levels_deep_is_lent_and_given_back(sb: Sandboxed) -> None:
    ws = sb.workspace()
    run = await sb.run(workspace=ws)
    result = await sb.py(
        run,
        """
        import os
        fd = os.open("/workspace", os.O_RDONLY)
        for _ in range(3000):
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = child
        open("leaf", "w", opener=lambda p, f: os.open(p, f, 0o644, dir_fd=fd)).write("x")
        print("made")
        """,
    )
    assert result.stdout.strip() == b"made", result.stderr
    await sb.daemon.runs.end(run.run_id)
    ended = [e for e in await sb.entries() if e.get("event") == "run_ended"][-1]
    assert "cleanupFailed" not in ended["detail"], ended
    assert ended["detail"]["entriesReturned"] >= 3001
    fd = os.open(ws, os.O_RDONLY)
    try:
        for _ in range(3000):
            assert os.stat("d", dir_fd=fd, follow_symlinks=False).st_uid == 0
            child = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = child
        assert os.stat("leaf", dir_fd=fd).st_uid == 0
    finally:
        os.close(fd)
    subprocess.run(["rm", "-rf", str(ws / "d")], check=True)  # deeper than rmtree recurses


async def test_a_read_only_grant_inside_the_workspace_is_not_lent_and_stays_unwritable(
    sb: Sandboxed,
) -> None:
    ws = sb.workspace()
    (ws / "docs" / "ref").mkdir(parents=True)
    (ws / "docs" / "ref" / "spec.md").write_text("the spec\n")
    policy = POLICY.replace(
        "workspace: {root: ., mode: rw}",
        "workspace: {root: ., mode: rw}\n    ref: {root: docs/ref, mode: ro}",
    )
    run = await sb.run(policy, workspace=ws)
    assert os.stat(ws / "docs" / "ref" / "spec.md").st_uid == 0  # kept, not lent
    # The review's attack: rename the parent, so the grant's files have another name
    # that no read-only mount covers, then write through it.
    result = await sb.py(
        run,
        """
        import errno, os
        os.rename("/workspace/docs", "/workspace/docs_old")
        try:
            open("/workspace/docs_old/ref/spec.md", "a").write("REWRITTEN")
            print("written")
        except OSError as e:
            print(errno.errorcode[e.errno])
        """,
    )
    assert result.stdout.strip() == b"EACCES", result.stderr
    assert (ws / "docs_old" / "ref" / "spec.md").read_text() == "the spec\n"


async def test_a_sandboxed_process_cannot_change_review_rules(sb: Sandboxed) -> None:
    # Rules change only on the control socket (root, the state directory): from inside,
    # there is no tool for it and no way to the control socket.
    policy = POLICY + textwrap.dedent(
        """
        review:
          rules:
            deny: [Writing anything at all]
        """
    )
    run = await sb.run(policy)
    result = await sb.py(
        run,
        """
        import os, socket, subprocess, sys
        for tool in ("rules.add_allow", "rules.remove_deny", "review.confirm"):
            done = subprocess.run(["cogni-tool", "exec", tool, '{"rule": "Anything"}'],
                                  capture_output=True, text=True)
            print(tool, done.returncode, "unknown_tool" in done.stderr)
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(sys.argv[1]); print("control: connected")
        except OSError as e:
            print("control:", type(e).__name__)
        """,
        str(sb.daemon.config.state_dir / "control.sock"),
    )
    lines = result.stdout.decode().splitlines()
    assert lines[:3] == [
        "rules.add_allow 14 True",
        "rules.remove_deny 14 True",
        "review.confirm 14 True",
    ], result.stderr
    assert lines[3] == "control: FileNotFoundError"
    section, _ = sb.daemon.rules.current(run.spec.policy_source, run.spec.policy.review)
    assert [rule.text for rule in section.rules.deny] == ["Writing anything at all"]
    assert [rule.text for rule in section.rules.allow] == []
