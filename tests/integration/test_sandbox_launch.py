"""The launcher run for real: bwrap, the run's netns, seccomp, rlimits, cgroups, an
unprivileged uid.

Every property is proven from inside (the probe tries and fails) or from the host's /proc
and cgroup files, never by reading our own configuration back. Each test gets a fresh run id,
netns and host uid (RLIMIT_NPROC counts per host uid, so tests must not share one), removed
in ``finally``. Tests pass ``cgroups=CGROUPS`` to limit by cgroup; without it the launcher
keeps today's rlimits, so the rlimit tests stay meaningful on a host with cgroups.
"""

from __future__ import annotations

import contextlib
import os
import resource
import secrets
import shutil
import signal
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import trio

from gatewayd.sandbox.cgroup import CgroupSupport, probe_cgroups
from gatewayd.sandbox.launch import ExecResult, LaunchError, run_in_sandbox, sandbox_argv
from gatewayd.sandbox.limits import (
    ErrorKind,
    HostUser,
    LimitMechanism,
    SandboxLimits,
    classify_exit,
    rlimits,
)
from gatewayd.sandbox.netns import create_run_netns, remove_run_netns
from gatewayd.sandbox.plan import SandboxPlan, build_plan, probe_host_layout

SANDBOX_PYTHON = "/usr/bin/python3"
OUTSIDE_V4 = "198.51.100.1"  # TEST-NET-2 (RFC 5737): never routed anywhere
# Small limits so each bomb ends in well under a second.
FAST = SandboxLimits(
    timeout_s=20,
    cpu_s=10,
    memory_bytes=256 * 1024**2,
    max_processes=24,
    max_file_bytes=1024**2,
    max_open_files=64,
    max_output_bytes=4096,
    kill_grace_s=0.5,
)


def _unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "the launcher joins a netns and drops to another uid: these tests run as root"
    if not os.path.exists("/usr/bin/bwrap") or not os.path.exists(SANDBOX_PYTHON):
        return "needs bubblewrap at /usr/bin/bwrap and the system python3"
    if not os.path.exists("/proc/sys/user/max_user_namespaces"):
        return "this kernel has no user namespaces"
    return None


_REASON = _unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
CGROUPS = probe_cgroups() if _REASON is None else CgroupSupport.unavailable(_REASON)
needs_cgroups = pytest.mark.skipif(
    not CGROUPS.available, reason=f"needs cgroups gatewayd may create: {CGROUPS.reason}"
)
MIB = 1024**2


def _fresh_user() -> HostUser:
    # High ids nobody on this host uses, different per test (one process budget each).
    uid = 3_000_000 + secrets.randbelow(1_000_000)
    return HostUser(uid=uid, gid=uid)


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-launch-", dir="/tmp"))
    path.chmod(0o755)  # bwrap runs as the sandbox uid: it must reach its bind sources
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def netns() -> Iterator[tuple[str, Path]]:
    handle = create_run_netns(secrets.token_hex(16))
    try:
        yield handle.run_id, handle.path
    finally:
        remove_run_netns(handle.name)


@pytest.fixture
def user() -> HostUser:
    return _fresh_user()


@pytest.fixture
def setup(base: Path, netns: tuple[str, Path], user: HostUser) -> Iterator[dict[str, object]]:
    run_id, netns_path = netns
    for name in ("ws", "tool", "state"):
        (base / name).mkdir(mode=0o755)
    os.chown(base / "ws", user.uid, user.gid)
    run_dir = base / "state" / "runs" / run_id
    run_dir.mkdir(parents=True)
    for path in (base / "state" / "runs", run_dir):
        path.chmod(0o755)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(run_dir / "gateway.sock"))
    try:
        yield {"base": base, "run_id": run_id, "netns": netns_path, "user": user}
    finally:
        listener.close()


def make_plan(setup: dict[str, object], *command: str) -> SandboxPlan:
    base = setup["base"]
    assert isinstance(base, Path)
    run_id = str(setup["run_id"])
    return build_plan(
        run_id=run_id,
        workspace_host=str(base / "ws"),
        policy_paths=[],
        gateway_socket_host=str(base / "state" / "runs" / run_id / "gateway.sock"),
        cogni_tool_host_dir=str(base / "tool"),
        command=command,
        extra_env_names=[],
        env_values={"LANG": "C.UTF-8"},
        state_dir=str(base / "state"),
        netns_path=str(setup["netns"]),
        layout=probe_host_layout(),
    )


async def launch(
    setup: dict[str, object],
    *command: str,
    limits: SandboxLimits = FAST,
    stdin: bytes | None = None,
    cgroups: CgroupSupport | None = None,
    bwrap: str = "/usr/bin/bwrap",
) -> ExecResult:
    netns, user = setup["netns"], setup["user"]
    assert isinstance(netns, Path) and isinstance(user, HostUser)
    return await run_in_sandbox(
        make_plan(setup, *command),
        netns=netns,
        limits=limits,
        host_user=user,
        stdin=stdin,
        cgroups=cgroups,
        bwrap=bwrap,
    )


async def python(setup: dict[str, object], code: str, **kwargs: object) -> ExecResult:
    return await launch(setup, SANDBOX_PYTHON, "-I", "-c", code, **kwargs)  # type: ignore[arg-type]


def host_pids_with_cmdline(marker: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in cmdline.split(b"\0"):
                pids.append(int(entry))
    return pids


def host_pids_of_uid(uid: int) -> list[int]:
    """Every process whose real uid is ``uid``, zombies included: a zombie nobody reaps
    still counts against the uid's process limit (RLIMIT_NPROC)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                status = Path(f"/proc/{entry}/status").read_text()
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith("Uid:") and int(line.split()[1]) == uid:
                    pids.append(int(entry))
    return pids


# --- the ordinary path ---------------------------------------------------------------


async def test_hello_world_returns_exit_0_its_output_and_no_error(
    setup: dict[str, object],
) -> None:
    result = await launch(setup, "/bin/sh", "-c", "echo hello; echo oops >&2")
    assert result.exitCode == 0
    assert result.signal is None
    assert result.stdout == b"hello\n"
    assert result.stderr == b"oops\n"
    assert (result.stdoutTruncated, result.stderrTruncated) == (False, False)
    assert result.errorCode is None
    assert 0 < result.durationMs < 10_000


async def test_stdin_reaches_the_command_and_exit_codes_pass_through(
    setup: dict[str, object],
) -> None:
    result = await launch(setup, "/bin/sh", "-c", "cat; exit 7", stdin=b"from the host")
    assert (result.exitCode, result.stdout, result.errorCode) == (7, b"from the host", None)


async def test_output_over_the_cap_is_truncated_flagged_and_never_blocks_the_command(
    setup: dict[str, object],
) -> None:
    # 1 MB on each pipe, far over a pipe buffer: the command only finishes if we keep reading.
    result = await launch(
        setup, "/bin/sh", "-c", "head -c 1000000 /dev/zero; head -c 1000000 /dev/zero >&2"
    )
    assert result.exitCode == 0
    assert result.stdout == b"\0" * FAST.max_output_bytes
    assert result.stderr == b"\0" * FAST.max_output_bytes
    assert (result.stdoutTruncated, result.stderrTruncated) == (True, True)


# --- identity and hardening ----------------------------------------------------------


async def test_the_sandbox_runs_as_the_unprivileged_host_uid_given(
    setup: dict[str, object],
) -> None:
    user = setup["user"]
    assert isinstance(user, HostUser)
    result = await launch(setup, "/bin/sh", "-c", "id -u; echo x > /workspace/owned")
    assert result.stdout == b"1000\n"  # the plan's sandbox user, inside
    owner = (Path(str(setup["base"])) / "ws" / "owned").stat()
    assert (owner.st_uid, owner.st_gid) == (user.uid, user.gid)  # not root, on the host


async def test_a_sleeping_sandbox_process_has_the_host_uid_in_proc_status(
    setup: dict[str, object],
) -> None:
    user = setup["user"]
    assert isinstance(user, HostUser)
    marker = f"{secrets.randbelow(10**6) + 10**6}.5"
    seen: list[str] = []

    async def watch() -> None:
        while not (pids := host_pids_with_cmdline(marker)):
            await trio.sleep(0.01)
        status = Path(f"/proc/{pids[0]}/status").read_text()
        seen.extend(line for line in status.splitlines() if line.startswith(("Uid:", "Gid:")))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        result = await launch(setup, "/bin/sh", "-c", f"sleep {marker} & sleep 0.5")
    assert result.exitCode == 0, result.stderr
    assert seen == [
        f"Uid:\t{user.uid}\t{user.uid}\t{user.uid}\t{user.uid}",
        f"Gid:\t{user.gid}\t{user.gid}\t{user.gid}\t{user.gid}",
    ]


async def test_no_new_privs_is_set_and_no_capability_is_held_inside(
    setup: dict[str, object],
) -> None:
    result = await launch(
        setup, "/bin/grep", "-E", "^(NoNewPrivs|CapEff|CapBnd)", "/proc/self/status"
    )
    assert result.stdout.decode().split() == [
        "CapEff:",
        "0000000000000000",
        "CapBnd:",
        "0000000000000000",
        "NoNewPrivs:",
        "1",
    ]


async def test_seccomp_refuses_ptrace_inside(setup: dict[str, object]) -> None:
    # Without a filter ptrace(TRACEME) needs no privilege and succeeds (see
    # test_sandbox_seccomp), so EPERM here is the filter's answer.
    result = await python(
        setup,
        "import ctypes, errno; libc = ctypes.CDLL(None, use_errno=True); "
        "rc = libc.ptrace(0, 0, 0, 0); print(rc, errno.errorcode[ctypes.get_errno()])",
    )
    assert result.stdout == b"-1 EPERM\n", result.stderr


# --- network ---------------------------------------------------------------------------

NET_PROBE = r"""
import errno, socket, sys
def tcp(host, port):
    s = socket.socket(); s.settimeout(5)
    try:
        s.connect((host, port)); return "connected"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e))
def udp(host):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.sendto(b"x", (host, 53)); return "sent"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e))
print(tcp("127.0.0.1", int(sys.argv[1])), tcp(sys.argv[2], 80), udp(sys.argv[2]))
"""


async def test_network_probes_from_inside_fail(setup: dict[str, object]) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        result = await launch(setup, SANDBOX_PYTHON, "-I", "-c", NET_PROBE, str(port), OUTSIDE_V4)
        # The host's listener works from the host, so "refused" inside is the netns.
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        server.close()
    assert result.stdout.split() == [b"ECONNREFUSED", b"ENETUNREACH", b"ENETUNREACH"], result.stderr


# --- limits ---------------------------------------------------------------------------

FORK_BOMB = r"""
import os, time
children = 0
error = "none"
for _ in range(400):  # the hard stop: never more than 400, whatever the limit
    try:
        pid = os.fork()
    except OSError as e:
        error = e.strerror
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    children += 1
print(children, error, flush=True)
time.sleep(0.3)  # hold the processes while the host is checked
"""


async def test_fork_bomb_is_stopped_by_the_process_limit_and_the_host_keeps_working(
    setup: dict[str, object],
) -> None:
    host_ok: list[int] = []

    async def host_work() -> None:
        await trio.sleep(0.2)
        done = await trio.run_process(["/bin/true"])
        host_ok.append(done.returncode)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(host_work)
        result = await python(setup, FORK_BOMB)
    children, error = result.stdout.decode().split(maxsplit=1)
    assert int(children) < FAST.max_processes  # bwrap, init and python count too
    assert error.strip() == "Resource temporarily unavailable"  # EAGAIN from fork
    assert host_ok == [0]
    assert result.exitCode == 0


@pytest.mark.parametrize(
    "cgroups", [None, CgroupSupport.unavailable("turned off")], ids=["no-cgroups", "unavailable"]
)
async def test_memory_bomb_is_contained_by_the_address_space_limit_without_cgroups(
    setup: dict[str, object], cgroups: CgroupSupport | None
) -> None:
    result = await python(setup, "x = bytearray(1 << 30)", cgroups=cgroups)  # 1 GiB vs 256 MiB
    assert result.exitCode not in (0, None)
    assert b"MemoryError" in result.stderr
    assert result.errorCode is None  # an allocation failure is not guessed as a limit code
    assert (result.memoryLimit, result.processLimit) == (LimitMechanism.RLIMIT,) * 2


async def test_cpu_limit_ends_a_spinning_command_with_limit_exceeded(
    setup: dict[str, object],
) -> None:
    result = await python(setup, "while True: pass", limits=replace(FAST, cpu_s=1))
    assert (result.signal, result.errorCode) == (24, ErrorKind.LIMIT_EXCEEDED)  # SIGXCPU
    assert result.exitCode is None


async def test_file_size_limit_ends_a_writer_with_limit_exceeded(
    setup: dict[str, object],
) -> None:
    result = await launch(setup, "/bin/sh", "-c", "head -c 2000000 /dev/zero > /workspace/big")
    assert (result.signal, result.errorCode) == (25, ErrorKind.LIMIT_EXCEEDED)  # SIGXFSZ
    assert (Path(str(setup["base"])) / "ws" / "big").stat().st_size == FAST.max_file_bytes


async def test_timeout_kills_the_command_and_its_grandchildren_even_if_they_ignore_sigterm(
    setup: dict[str, object],
) -> None:
    marker = f"{secrets.randbelow(10**6) + 10**6}.25"
    appeared: list[int] = []

    async def watch() -> None:
        while not (pids := host_pids_with_cmdline(marker)):
            await trio.sleep(0.01)
        appeared.extend(pids)

    limits = replace(FAST, timeout_s=1.0, kill_grace_s=0.3)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        result = await launch(
            setup,
            "/bin/sh",
            "-c",
            f"trap '' TERM; (sleep {marker} &); sleep {marker}",
            limits=limits,
        )
    assert result.errorCode == ErrorKind.TIMEOUT
    assert len(appeared) >= 1  # the grandchild existed on the host ...
    assert host_pids_with_cmdline(marker) == []  # ... and is gone
    assert 1000 <= result.durationMs < 1000 + 300 + 2000


async def test_timeout_sends_sigterm_first_so_the_command_can_clean_up(
    setup: dict[str, object],
) -> None:
    limits = replace(FAST, timeout_s=0.5, kill_grace_s=5)
    result = await launch(
        setup, "/bin/sh", "-c", "trap 'echo got-term; exit 3' TERM; sleep 100 & wait", limits=limits
    )
    assert result.stdout == b"got-term\n"
    assert (result.exitCode, result.errorCode) == (3, ErrorKind.TIMEOUT)
    assert result.durationMs < 4000  # it ended on SIGTERM, well before the grace ran out


async def test_cancelling_the_caller_kills_the_sandbox_at_once(
    setup: dict[str, object],
) -> None:
    marker = f"{secrets.randbelow(10**6) + 10**6}.75"
    appeared: list[int] = []
    async with trio.open_nursery() as nursery:

        async def launch_then_cancel_once_seen() -> None:
            while not (pids := host_pids_with_cmdline(marker)):
                await trio.sleep(0.01)
            appeared.extend(pids)
            nursery.cancel_scope.cancel()

        nursery.start_soon(launch_then_cancel_once_seen)
        await launch(setup, "/bin/sleep", marker)
    assert appeared  # it was running when the caller gave up ...
    assert host_pids_with_cmdline(marker) == []  # ... and nothing outlived the call
    user = setup["user"]
    assert isinstance(user, HostUser)
    assert host_pids_of_uid(user.uid) == []  # not even a zombie left for the host's PID 1


# Cancellations made as soon as bwrap itself shows: enough that one lands between its
# clone() and its child's PR_SET_PDEATHSIG (3 in 25 did before bwrap was stopped first).
EARLY_CANCELS = 25
EARLY_CANCEL_BOUND_S = 60.0


async def test_cancelling_as_soon_as_bwrap_shows_leaves_no_orphan(
    setup: dict[str, object],
) -> None:
    user = setup["user"]
    assert isinstance(user, HostUser)
    survivors: list[int] = []
    zombies: list[int] = []
    for _ in range(EARLY_CANCELS):
        marker = f"{secrets.randbelow(10**6) + 10**6}.25"
        # A bound, so a watcher that never sees bwrap fails the test instead of hanging it
        # (the sleep is long: only the cancellation ends the launch).
        with trio.fail_after(EARLY_CANCEL_BOUND_S):
            async with trio.open_nursery() as nursery:

                async def cancel_once_bwrap_shows(marker: str, scope: trio.CancelScope) -> None:
                    # bwrap's own command line names the marker too: this fires at bwrap.
                    while not host_pids_with_cmdline(marker):
                        await trio.sleep(0.001)
                    scope.cancel()

                nursery.start_soon(cancel_once_bwrap_shows, marker, nursery.cancel_scope)
                await launch(setup, "/bin/sleep", marker)
        left = host_pids_with_cmdline(marker)
        for pid in left:  # never leave one behind, whatever the outcome
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        survivors.extend(left)
        # Nothing of the uid either: a zombie left to a PID 1 that reaps late (a container's
        # init) still counts against the uid's process limit, and enough of them made this
        # loop's later sandboxes fail to start ("Creating new namespace failed").
        zombies.extend(host_pids_of_uid(user.uid))
    assert survivors == []
    assert zombies == []


# --- cgroups: memory and process count per command -----------------------------------------

MEMORY_BOMB = "chunks = []\nwhile True: chunks.append(b'x' * (10 << 20))"  # touches every page


def command_cgroups(run_id: object) -> list[Path]:
    """The command cgroups of this run that exist right now, under every parent."""
    parents = {CGROUPS.memory_parent, CGROUPS.pids_parent} - {None}
    return [path for parent in parents if parent for path in parent.glob(f"cogni-{run_id}-*")]


def _soft_limit(which: int) -> bytes:
    soft = resource.getrlimit(which)[0]
    return b"unlimited" if soft == resource.RLIM_INFINITY else str(soft).encode()


async def host_work() -> int:
    done = await trio.run_process(["/bin/true"])
    return done.returncode


@needs_cgroups
async def test_memory_bomb_under_a_cgroup_limit_ends_oom_killed_and_the_host_keeps_working(
    setup: dict[str, object],
) -> None:
    limits = replace(FAST, memory_bytes=128 * MIB)
    result = await python(setup, MEMORY_BOMB, limits=limits, cgroups=CGROUPS)
    assert result.errorCode == ErrorKind.OOM_KILLED, result.stderr
    assert (result.exitCode, result.signal) == (None, 9)  # the kernel's SIGKILL
    assert b"MemoryError" not in result.stderr  # no RLIMIT_AS: the cgroup stopped it
    assert result.memoryLimit == LimitMechanism.CGROUP
    assert await host_work() == 0
    assert command_cgroups(setup["run_id"]) == []


@needs_cgroups
async def test_a_command_under_its_cgroup_limits_is_unaffected_and_has_no_as_or_nproc_rlimit(
    setup: dict[str, object],
) -> None:
    code = (
        "data = b'x' * (64 << 20)\n"  # half the limit, every page touched
        "for line in open('/proc/self/limits'):\n"
        "    if line.startswith(('Max address space', 'Max processes')): print(line.split()[-3])"
    )
    result = await python(
        setup, code, limits=replace(FAST, memory_bytes=128 * MIB), cgroups=CGROUPS
    )
    assert (result.exitCode, result.errorCode) == (0, None), result.stderr
    # The cgroup replaces RLIMIT_AS (and, with a pids controller, RLIMIT_NPROC): the
    # command keeps what gatewayd itself has, not FAST's values.
    pids_by_cgroup = CGROUPS.pids_parent is not None
    inherited = [_soft_limit(resource.RLIMIT_NPROC), _soft_limit(resource.RLIMIT_AS)]
    assert result.stdout.split() == [
        inherited[0] if pids_by_cgroup else str(FAST.max_processes).encode(),
        inherited[1],
    ]
    assert result.memoryLimit == LimitMechanism.CGROUP
    assert result.processLimit == (
        LimitMechanism.CGROUP if pids_by_cgroup else LimitMechanism.RLIMIT
    )


@needs_cgroups
async def test_every_sandbox_process_is_in_the_command_cgroup_as_the_host_sees_it(
    setup: dict[str, object],
) -> None:
    marker = f"{secrets.randbelow(10**6) + 10**6}.5"
    seen: list[str] = []
    during: list[Path] = []

    async def watch() -> None:
        while not (pids := host_pids_with_cmdline(marker)):
            await trio.sleep(0.01)
        seen.extend(Path(f"/proc/{pids[0]}/cgroup").read_text().splitlines())
        during.extend(command_cgroups(setup["run_id"]))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        result = await launch(
            setup, "/bin/sh", "-c", f"sleep {marker} & sleep 0.5", cgroups=CGROUPS
        )
    assert result.exitCode == 0, result.stderr
    mine = f"/cogni-{setup['run_id']}-"
    memory = [line for line in seen if ":memory:" in line or line.startswith("0::")]
    assert any(mine in line for line in memory), seen
    if CGROUPS.pids_parent is not None:
        assert any(":pids:" in line and mine in line for line in seen), seen
    assert during  # the cgroup existed while the command ran ...
    assert command_cgroups(setup["run_id"]) == []  # ... and is gone after


@needs_cgroups
async def test_fork_bomb_is_stopped_by_the_pids_cgroup_seen_from_the_host(
    setup: dict[str, object],
) -> None:
    if CGROUPS.pids_parent is None:
        pytest.skip(f"this host has no pids controller for gatewayd: {CGROUPS.reason}")
    refused: list[int] = []

    async def watch_pids_events() -> None:
        while True:
            for directory in command_cgroups(setup["run_id"]):
                events = directory / "pids.events"
                try:
                    counters = dict(line.split() for line in events.read_text().splitlines())
                except OSError:
                    continue
                if int(counters["max"]) > 0:
                    refused.append(int(counters["max"]))
                    return
            await trio.sleep(0.01)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_pids_events)
        result = await python(setup, FORK_BOMB, cgroups=CGROUPS)
        nursery.cancel_scope.cancel()
    children, error = result.stdout.decode().split(maxsplit=1)
    assert int(children) < FAST.max_processes
    assert error.strip() == "Resource temporarily unavailable"  # EAGAIN from fork
    assert refused  # the pids cgroup counted the refused forks (RLIMIT_NPROC is not set)
    assert result.processLimit == LimitMechanism.CGROUP
    assert command_cgroups(setup["run_id"]) == []


@needs_cgroups
async def test_the_command_cgroup_is_removed_after_a_timeout(setup: dict[str, object]) -> None:
    during: list[Path] = []

    async def watch() -> None:
        while not (found := command_cgroups(setup["run_id"])):
            await trio.sleep(0.01)
        during.extend(found)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        limits = replace(FAST, timeout_s=0.5, kill_grace_s=0.2)
        result = await launch(setup, "/bin/sleep", "100", limits=limits, cgroups=CGROUPS)
    assert result.errorCode == ErrorKind.TIMEOUT
    assert during
    assert command_cgroups(setup["run_id"]) == []


@needs_cgroups
async def test_the_command_cgroup_is_removed_when_the_caller_cancels(
    setup: dict[str, object],
) -> None:
    marker = f"{secrets.randbelow(10**6) + 10**6}.75"
    during: list[Path] = []
    async with trio.open_nursery() as nursery:

        async def cancel_once_running() -> None:
            while not host_pids_with_cmdline(marker):
                await trio.sleep(0.01)
            during.extend(command_cgroups(setup["run_id"]))
            nursery.cancel_scope.cancel()

        nursery.start_soon(cancel_once_running)
        await launch(setup, "/bin/sleep", marker, cgroups=CGROUPS)
    assert during
    assert host_pids_with_cmdline(marker) == []
    assert command_cgroups(setup["run_id"]) == []


@needs_cgroups
async def test_the_command_cgroup_is_removed_when_bwrap_cannot_start(
    setup: dict[str, object],
) -> None:
    with pytest.raises(LaunchError, match=r"cannot start /nonexistent/bwrap for run [0-9a-f]{32}"):
        await launch(setup, "/bin/true", cgroups=CGROUPS, bwrap="/nonexistent/bwrap")
    assert command_cgroups(setup["run_id"]) == []


@needs_cgroups
async def test_a_cgroup_that_cannot_be_made_is_a_launch_error_naming_the_file(
    setup: dict[str, object], tmp_path: Path
) -> None:
    # A plain directory stands in for a hierarchy whose controller files are missing.
    broken = replace(CGROUPS, memory_parent=tmp_path, pids_parent=None)
    with pytest.raises(
        LaunchError, match=r"cannot make run [0-9a-f]{32}'s command cgroup: cannot set .*memory"
    ):
        await launch(setup, "/bin/true", cgroups=broken)
    assert os.listdir(tmp_path) == []


# --- errors ---------------------------------------------------------------------------


async def test_a_missing_netns_is_a_launch_error_naming_it(
    setup: dict[str, object], user: HostUser
) -> None:
    missing = Path("/run/netns/cogni-" + "0" * 32)
    with pytest.raises(LaunchError, match=r"cannot open the run's network namespace .*cogni-0"):
        await run_in_sandbox(
            make_plan(setup, "/bin/true"), netns=missing, limits=FAST, host_user=user
        )


def test_seccomp_is_added_as_the_last_bwrap_option_not_into_the_command(
    setup: dict[str, object],
) -> None:
    plan = make_plan(setup, "/bin/echo", "--", "--seccomp")
    fds = {step.dest: 9 for step in plan.data_steps}
    argv = sandbox_argv(plan, bwrap="bwrap", data_fds=fds, seccomp_fd=5)
    assert argv[-8:] == [
        "--chdir",
        "/workspace",
        "--seccomp",
        "5",
        "--",
        "/bin/echo",
        "--",
        "--seccomp",
    ]
    assert argv.count("--seccomp") == 2  # ours, and the command's own argument


@pytest.mark.parametrize("uid", [0, -1, 2**32 - 1])
def test_host_user_refuses_root_and_invalid_ids(uid: int) -> None:
    with pytest.raises(ValueError, match="unprivileged id from 1 to"):
        HostUser(uid=uid, gid=1000)


def test_limits_refuse_values_bwrap_cannot_start_with() -> None:
    with pytest.raises(ValueError, match=r"max_processes=2 .* at least 4"):
        SandboxLimits(max_processes=2)
    with pytest.raises(ValueError, match=r"timeout_s=0 .* more than 0"):
        SandboxLimits(timeout_s=0)


@pytest.mark.parametrize(
    ("returncode", "timed_out", "oom_killed", "expected"),
    [
        (0, False, False, (0, None, None)),
        (1, False, False, (1, None, None)),
        (128, False, False, (128, None, None)),
        (137, False, False, (None, 9, None)),
        (128 + 24, False, False, (None, 24, ErrorKind.LIMIT_EXCEEDED)),
        (128 + 25, False, False, (None, 25, ErrorKind.LIMIT_EXCEEDED)),
        (-9, True, False, (None, 9, ErrorKind.TIMEOUT)),
        (3, True, False, (3, None, ErrorKind.TIMEOUT)),
        (255, False, False, (255, None, None)),
        (137, False, True, (None, 9, ErrorKind.OOM_KILLED)),
        # A child was OOM-killed and the command carried on: still reported.
        (0, False, True, (0, None, ErrorKind.OOM_KILLED)),
        # Precedence: timeout, then oom_killed, then limit_exceeded.
        (-9, True, True, (None, 9, ErrorKind.TIMEOUT)),
        (128 + 24, False, True, (None, 24, ErrorKind.OOM_KILLED)),
    ],
)
def test_classify_exit_reads_bwraps_status(
    returncode: int,
    timed_out: bool,
    oom_killed: bool,
    expected: tuple[int | None, int | None, ErrorKind | None],
) -> None:
    reading = classify_exit(returncode, timed_out=timed_out, oom_killed=oom_killed)
    assert (reading.exit_code, reading.signal, reading.error) == expected


def test_a_limit_the_cgroup_enforces_gets_no_rlimit() -> None:
    def resources(**mechanisms: LimitMechanism) -> set[int]:
        return {entry[0] for entry in rlimits(FAST, **mechanisms)}

    everything = resources()
    assert {resource.RLIMIT_AS, resource.RLIMIT_NPROC} <= everything
    cgroup = LimitMechanism.CGROUP
    assert everything - resources(memory=cgroup) == {resource.RLIMIT_AS}
    assert everything - resources(processes=cgroup) == {resource.RLIMIT_NPROC}
