"""run_in_sandbox's gate (bwrap's ``--block-fd``): while an exec waits for its
``exec_started`` entry to be durable, its command must not start, whatever happens to
gatewayd meanwhile, and nothing of a sandbox that never ran is left behind.

bwrap 0.8.0 reads the block descriptor in its namespace child (the sandbox's future init)
before that child sets its own parent-death signal (``--die-with-parent`` takes effect
there only in ``do_init``, after the read), and it takes end of file as the go-ahead. So
when gatewayd dies during the flush, its end of the release pipe is closed by the kernel,
the child reads end of file and starts the command, and bwrap's monitor being killed
(the launcher's parent-death signal) does not stop it: the command runs, unsupervised,
with no durable write-ahead entry. Hence bwrap's end of the pipe is the read end
reopened read-write (``_release_pipe``): only the byte starts the command.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from gatewayd.sandbox import launch
from gatewayd.sandbox.launch import run_in_sandbox
from gatewayd.sandbox.limits import HostUser, SandboxLimits
from gatewayd.sandbox.netns import create_run_netns, remove_run_netns
from gatewayd.sandbox.plan import SandboxPlan
from tests.integration.test_sandbox_launch import make_plan

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/usr/bin/bwrap"),
    reason="runs bwrap through the launcher as root",
)

LIMITS = SandboxLimits(
    timeout_s=20,
    cpu_s=10,
    memory_bytes=256 * 1024**2,
    max_processes=24,
    max_file_bytes=1024**2,
    max_open_files=64,
    max_output_bytes=4096,
    kill_grace_s=0.5,
)
# The command leaves a mark in the workspace if it ever starts.
MARK = ("/usr/bin/python3", "-c", "open('/workspace/ran', 'w').write('ran')")

# A stand-in for gatewayd: run_in_sandbox with a gate that never returns (the flush still
# under way), from the trio thread, as RunManager.exec calls it. Killed by the test.
HARNESS = r"""
import functools, sys
from pathlib import Path
import trio
from gatewayd.sandbox.launch import run_in_sandbox
from gatewayd.sandbox.limits import HostUser, SandboxLimits
from gatewayd.sandbox.plan import build_plan, probe_host_layout

base, run_id, netns, uid = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
plan = build_plan(
    run_id=run_id,
    workspace_host=str(base / "ws"),
    policy_paths=[],
    gateway_socket_host=str(base / "state" / "runs" / run_id / "gateway.sock"),
    cogni_tool_host_dir=str(base / "tool"),
    command=("/usr/bin/python3", "-c", "open('/workspace/ran', 'w').write('ran')"),
    extra_env_names=[],
    env_values={"LANG": "C.UTF-8"},
    state_dir=str(base / "state"),
    netns_path=netns,
    layout=probe_host_layout(),
)

async def gate() -> None:
    print("waiting", flush=True)
    await trio.sleep_forever()

trio.run(functools.partial(
    run_in_sandbox, plan, netns=Path(netns), host_user=HostUser(uid=uid, gid=uid),
    limits=SandboxLimits(timeout_s=20, cpu_s=10, memory_bytes=256 * 1024**2,
        max_processes=24, max_file_bytes=1024**2, max_open_files=64,
        max_output_bytes=4096, kill_grace_s=0.5),
    gate=gate,
))
"""


def _pids_of_uid(uid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
        except OSError:
            continue
        if int(fields["Uid"].split()[0]) == uid and fields["State"].split()[0] not in "ZX":
            found.append(int(entry))
    return found


def _kill_uid(uid: int) -> None:
    for pid in _pids_of_uid(uid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def setup() -> Iterator[dict[str, object]]:
    base = Path(tempfile.mkdtemp(prefix="cg-gate-", dir="/tmp"))
    base.chmod(0o755)
    handle = create_run_netns(secrets.token_hex(16))
    uid = 3_000_000 + secrets.randbelow(1_000_000)
    for name in ("ws", "tool", "state"):
        (base / name).mkdir(mode=0o755)
    os.chown(base / "ws", uid, uid)
    run_dir = base / "state" / "runs" / handle.run_id
    run_dir.mkdir(parents=True)
    for path in (base / "state" / "runs", run_dir):
        path.chmod(0o755)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(run_dir / "gateway.sock"))
    try:
        yield {"base": base, "run_id": handle.run_id, "netns": handle.path, "uid": uid}
    finally:
        _kill_uid(uid)
        listener.close()
        remove_run_netns(handle.name)
        shutil.rmtree(base, ignore_errors=True)


def _plan(setup: dict[str, object]) -> SandboxPlan:
    return make_plan(setup, *MARK)


def test_a_command_waiting_for_its_entry_never_starts_when_gatewayd_dies(
    setup: dict[str, object],
) -> None:
    base = setup["base"]
    assert isinstance(base, Path)
    uid = int(str(setup["uid"]))
    where = (str(base), str(setup["run_id"]), str(setup["netns"]), str(uid))
    harness = subprocess.Popen(
        [sys.executable, "-c", HARNESS, *where],
        stdout=subprocess.PIPE,
        cwd=Path(launch.__file__).parents[2],
    )
    try:
        assert harness.stdout is not None
        assert harness.stdout.readline() == b"waiting\n"  # bwrap started, the gate awaited
        time.sleep(1.0)  # bwrap has built the sandbox and waits on its block descriptor
        assert not (base / "ws" / "ran").exists()
        harness.kill()  # gatewayd dies (OOM killer, SIGKILL, a crash) during the flush
        harness.wait()
        time.sleep(2.0)
        assert not (base / "ws" / "ran").exists(), (
            "the command started after gatewayd died, its exec_started never made durable"
        )
    finally:
        harness.kill()
        harness.wait()


async def test_a_failure_between_the_start_and_the_supervision_leaves_no_sandbox(
    setup: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Anything raised after start_launched returned and before _supervise's try (here
    # os.pidfd_open's EMFILE) leaves bwrap blocked on its block descriptor, unsupervised,
    # and the release pipe's write end open in gatewayd for good.
    uid = int(str(setup["uid"]))

    def no_descriptor_left(pid: int) -> int:
        raise OSError(24, "Too many open files")

    async def gate() -> None:
        raise AssertionError("not reached")

    opened_before = set(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(os, "pidfd_open", no_descriptor_left)
    with pytest.raises(OSError, match="Too many open files"):
        await run_in_sandbox(
            _plan(setup),
            netns=Path(str(setup["netns"])),
            limits=LIMITS,
            host_user=HostUser(uid=uid, gid=uid),
            gate=gate,
        )
    monkeypatch.undo()
    await trio.sleep(0.5)
    left = _pids_of_uid(uid)
    leaked = {
        fd: os.readlink(f"/proc/self/fd/{fd}")
        for fd in set(os.listdir("/proc/self/fd")) - opened_before
        if os.path.exists(f"/proc/self/fd/{fd}")
    }
    assert (left, leaked) == ([], {}), f"outlived the call: processes {left}, descriptors {leaked}"


@pytest.mark.parametrize("stdin", [None, b"input"])
async def test_a_gate_that_fails_leaves_no_descriptor_behind(
    setup: dict[str, object], stdin: bytes | None
) -> None:
    # The command's stdout/stderr read ends (and stdin's write end) are handed to the
    # drains only after the gate: a failed flush or a cancelled exec never closes them.
    uid = int(str(setup["uid"]))

    async def failing() -> None:
        await trio.sleep(0.3)
        raise OSError(5, "the audit log's disk went away")

    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="disk went away"):
        await run_in_sandbox(
            _plan(setup),
            netns=Path(str(setup["netns"])),
            limits=LIMITS,
            host_user=HostUser(uid=uid, gid=uid),
            stdin=stdin,
            gate=failing,
        )
    leaked = {
        fd: os.readlink(f"/proc/self/fd/{fd}")
        for fd in set(os.listdir("/proc/self/fd")) - before
        if os.path.exists(f"/proc/self/fd/{fd}")
    }
    assert (_pids_of_uid(uid), leaked) == ([], {}), f"left: {leaked}"
