"""The exec path of a live run, through ``RunManager.exec`` with real bwrap: the
command's cgroup, and its plan.

Each command's child joins its cgroup by the per-thread file (v1 ``tasks``), not by
``cgroup.procs`` (which waits for the kernel's global lock), and its cgroup is removed
after its result is returned: these tests show, from the host, that the results are the
same as with the old join, byte for byte, and that no command cgroup outlives its run,
whether the run ends right after a result, while a command runs, with several commands
at once, or with the daemon's stop. (A daemon killed between a result and the removal
leaves an empty cgroup of a run it left behind: the next start's sweep removes it, as
test_run_sandbox.py's crash test shows.) A run's plan is reused for the next command
when nothing but the command differs: it must equal one built afresh, and it is
validated once, when it is built, not again before each start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import tempfile
import textwrap
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import trio

from gatewayd.config import GatewaydConfig, SandboxUids
from gatewayd.daemon import Daemon, open_daemon
from gatewayd.runs import Grant, Run, RunLimits, RunRequest
from gatewayd.sandbox import plan as plan_module
from gatewayd.sandbox.cgroup import CgroupError, CgroupSupport, CommandCgroup, probe_cgroups
from gatewayd.sandbox.launch import ExecResult
from gatewayd.sandbox.limits import LimitMechanism
from gatewayd.sandbox.plan import PlanError, SandboxPlan
from gatewayd.sandbox.session import CommandNetwork

PY = "/usr/bin/python3"
POLICY = """
version: 1
name: exec-cgroups
tools:
  allow: [time.now]
filesystem:
  paths:
    workspace: {root: ., mode: rw}
limits: {calls_per_second: 1000, burst: 1000}
sandbox: {timeout_s: 30, cpu_s: 20, max_processes: 48, max_output_bytes: 4096}
"""
# Memory small enough that the bomb is stopped within a second.
MEMORY_MB = 128
# Commands run at once in one run (each gets a cgroup of its own).
CONCURRENT = 4
# How long a closed gate (below) stays closed once the run's or daemon's end has begun.
GATE_OPENS_S = 0.3
GATE_HOLDS_AT_MOST_S = 5.0


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "sandboxed runs need root (network namespaces, a uid per run, cgroups)"
    if not os.path.exists("/usr/bin/bwrap") or not os.path.exists(PY):
        return "needs bubblewrap at /usr/bin/bwrap and the system python3"
    return None


_REASON = _unavailable()
CGROUPS = probe_cgroups() if _REASON is None else CgroupSupport.unavailable(_REASON)
pytestmark = pytest.mark.skipif(
    not CGROUPS.available, reason=f"needs command cgroups: {_REASON or CGROUPS.reason}"
)

# What each command does; the result of each must not depend on how its child joined.
CASES: dict[str, tuple[list[str], float | None]] = {
    "exit code and both streams, not UTF-8": (
        [
            PY,
            "-I",
            "-c",
            "import sys; sys.stdout.write('out\\n'); sys.stderr.buffer.write(b'\\xff e')"
            "; sys.exit(3)",
        ],
        None,
    ),
    "output over the cap": ([PY, "-I", "-c", "print('x' * 10000)"], None),
    "memory bomb": (
        [PY, "-I", "-c", "chunks = []\nwhile True: chunks.append(bytearray(16 << 20))"],
        None,
    ),
    "fork bomb": (
        [
            PY,
            "-I",
            "-c",
            textwrap.dedent(
                """\
                import os, time
                for _ in range(400):
                    try:
                        pid = os.fork()
                    except OSError as e:
                        print(e.strerror, flush=True); break
                    if pid == 0:
                        time.sleep(5); os._exit(0)
                """
            ),
        ],
        None,
    ),
    "timeout": (["sleep", "60"], 0.3),
}


def command_cgroups(run_id: str) -> list[Path]:
    """The command cgroups of ``run_id`` that exist right now, under every parent."""
    parents = {CGROUPS.memory_parent, CGROUPS.pids_parent} - {None}
    return [path for parent in parents if parent for path in parent.glob(f"cogni-{run_id}-*")]


def occupied(cgroup: Path) -> bool:
    try:
        return bool((cgroup / "cgroup.procs").read_text().split())
    except OSError:
        return False  # removed meanwhile


def config(base: Path) -> GatewaydConfig:
    return GatewaydConfig(
        state_dir=base / "state",
        policy_dirs=(base,),
        workspace_mode="host",
        netns_prefix=f"cgx{secrets.token_hex(4)}-",
        sandbox_uids=SandboxUids(base=1_700_000_000 + secrets.randbelow(50_000) * 1024, count=16),
    )


async def start_run(daemon: Daemon, base: Path) -> Run:
    workspace = Path(tempfile.mkdtemp(dir=base))
    workspace.chmod(0o755)
    policy = base / f"policy-{secrets.token_hex(4)}.yaml"
    policy.write_text(POLICY)
    request = RunRequest(
        workspacePath=str(workspace),
        policy=str(policy),
        actorId="tester",
        tenantId="t1",
        grant=Grant(allowSandbox=True),
        limits=RunLimits(maxMemoryMb=MEMORY_MB),
    )
    return await daemon.runs.start(request, policy_paths=True)


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-xc-", dir="/tmp"))
    path.chmod(0o711)  # the sandbox's uid passes through to its workspace and socket
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def daemon(base: Path) -> AsyncIterator[Daemon]:
    async with open_daemon(config(base), preload=True) as daemon:
        assert daemon.runs.sandbox_settings is not None
        assert daemon.runs.sandbox_settings.cgroups is not None
        yield daemon


class Gate:
    """Holds command cgroups' removals back while closed, as a cgroup whose exited pid
    namespace the kernel is still tearing down is held: the run's end must wait."""

    def __init__(self) -> None:
        self.event = trio.Event()
        self.event.set()

    def close(self) -> None:
        self.event = trio.Event()

    async def open_soon(self) -> None:
        """Open it a moment after the caller went on (to end the run or the daemon)."""
        await trio.sleep(GATE_OPENS_S)
        self.event.set()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Gate:
    """Every command cgroup's removal waits for the gate as it was when it began."""
    held = Gate()
    remove = CommandCgroup.remove

    async def held_back(self: CommandCgroup) -> None:
        # Bounded: a test that fails before opening the gate must not hang its daemon's
        # stop (or the event loop's end, which waits for the shielded removal).
        with trio.move_on_after(GATE_HOLDS_AT_MOST_S):
            await held.event.wait()
        await remove(self)

    monkeypatch.setattr(CommandCgroup, "remove", held_back)
    return held


def comparable(result: ExecResult) -> ExecResult:
    """Everything of a result but its duration."""
    return dataclasses.replace(result, durationMs=0)


async def test_results_are_byte_identical_to_the_child_joining_by_cgroup_procs(
    daemon: Daemon, base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = await start_run(daemon, base)
    results: dict[str, ExecResult] = {}
    for name, (command, timeout) in CASES.items():
        results[name] = await daemon.runs.exec(run.run_id, command, timeout_s=timeout)
        with monkeypatch.context() as before:
            # The launcher as it was: the whole process moved by cgroup.procs.
            before.setattr(CommandCgroup, "join_files", CommandCgroup.procs_files)
            then = await daemon.runs.exec(run.run_id, command, timeout_s=timeout)
        assert comparable(results[name]) == comparable(then), name
        assert results[name].memoryLimit == LimitMechanism.CGROUP, name
        assert results[name].processLimit == LimitMechanism.CGROUP, name
    # What each case must have been, so the comparison compared something.
    first = results["exit code and both streams, not UTF-8"]
    assert (first.exitCode, first.stdout, first.stderr) == (3, b"out\n", b"\xff e")
    assert results["output over the cap"].stdoutTruncated
    assert results["memory bomb"].errorCode == "oom_killed"
    assert results["fork bomb"].stdout == b"Resource temporarily unavailable\n"
    assert results["fork bomb"].processLimitHit is True
    assert results["timeout"].errorCode == "timeout"
    await daemon.runs.end(run.run_id)
    assert command_cgroups(run.run_id) == []


async def test_no_command_cgroup_outlives_a_run_ended_right_after_its_results(
    daemon: Daemon, base: Path, gate: Gate
) -> None:
    run = await start_run(daemon, base)
    gate.close()
    results: list[ExecResult] = []

    async def one() -> None:
        results.append(await daemon.runs.exec(run.run_id, [PY, "-I", "-c", "print(1)"]))

    async with trio.open_nursery() as nursery:  # each its own cgroup, at once
        for _ in range(CONCURRENT):
            nursery.start_soon(one)
    assert [r.stdout for r in results] == [b"1\n"] * CONCURRENT
    assert command_cgroups(run.run_id)  # the results came before the removals ended
    async with trio.open_nursery() as nursery:
        nursery.start_soon(gate.open_soon)
        await daemon.runs.end(run.run_id)  # at once: the removals are still held back
        assert command_cgroups(run.run_id) == []


async def test_a_command_stopped_by_its_runs_end_leaves_no_cgroup(
    daemon: Daemon, base: Path, gate: Gate
) -> None:
    run = await start_run(daemon, base)
    # One command first: its end must not make the run's end skip waiting for the next.
    assert (await daemon.runs.exec(run.run_id, ["true"])).exitCode == 0
    with trio.fail_after(10):
        while command_cgroups(run.run_id):
            await trio.sleep(0.01)
    gate.close()
    outcome: list[Exception] = []

    async def long_command() -> None:
        try:
            await daemon.runs.exec(run.run_id, ["sleep", "60"])
        except Exception as exc:
            outcome.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(long_command)
        with trio.fail_after(10):  # the long command runs in a cgroup of its own
            while not any(occupied(cgroup) for cgroup in command_cgroups(run.run_id)):
                await trio.sleep(0.01)
        nursery.start_soon(gate.open_soon)
        with trio.fail_after(10):
            await daemon.runs.end(run.run_id)
        assert command_cgroups(run.run_id) == []  # gone by the time the end returns
    assert outcome and "ended while the command ran" in str(outcome[0])


async def test_the_daemons_stop_right_after_a_result_leaves_no_command_cgroup(
    base: Path, gate: Gate
) -> None:
    async with trio.open_nursery() as nursery:
        async with open_daemon(config(base), preload=True) as daemon:
            run = await start_run(daemon, base)
            gate.close()
            result = await daemon.runs.exec(run.run_id, ["true"])
            assert result.exitCode == 0
            assert command_cgroups(run.run_id)  # its removal is held back
            nursery.start_soon(gate.open_soon)
            # Leaving at once: the stop ends the run, which waits for the removal.
        assert command_cgroups(run.run_id) == []


async def test_a_plan_reused_for_the_next_command_equals_one_built_afresh(
    daemon: Daemon, base: Path
) -> None:
    run = await start_run(daemon, base)
    sandbox = run.sandbox
    assert sandbox is not None
    env = {"LANG": "C.UTF-8", "TERM": "xterm", "UNLISTED": "x"}
    sandbox.plan(["true"], env)
    reused = sandbox.plan(["echo", "hi"], dict(env))
    # A copy of the sandbox has no plan yet: it builds one from scratch.
    assert reused == dataclasses.replace(sandbox).plan(["echo", "hi"], env)
    assert reused.command == ("echo", "hi")
    # Anything else that differs makes a new plan, with what differs in it.
    other = sandbox.plan(["true"], {**env, "LANG": "de_DE.UTF-8"})
    assert ("LANG", "de_DE.UTF-8") in other.env
    assert sandbox.plan(["true"], env, cwd="/tmp").cwd == "/tmp"
    assert not sandbox.plan(["true"], env, network=CommandNetwork()).run_network
    assert sandbox.plan(["true"], env).cwd != "/tmp"
    # An empty command is refused as before, reused plan or not.
    with pytest.raises(PlanError, match="the command is empty"):
        sandbox.plan([], env)
    # Through the exec path, one command after another: each runs its own command.
    for word in ("one", "two", "three"):
        result = await daemon.runs.exec(run.run_id, ["echo", word])
        assert (result.exitCode, result.stdout) == (0, f"{word}\n".encode())


async def test_a_runs_plan_is_validated_when_built_and_not_again_before_each_start(
    daemon: Daemon, base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = await start_run(daemon, base)
    validated: list[SandboxPlan] = []
    validate = plan_module.validate

    def counted(plan: SandboxPlan) -> None:
        validated.append(plan)
        validate(plan)

    monkeypatch.setattr(plan_module, "validate", counted)
    first = await daemon.runs.exec(run.run_id, ["echo", "first"])
    assert (first.exitCode, first.stdout) == (0, b"first\n")
    assert [plan.command for plan in validated] == [("echo", "first")]  # built, checked once
    for word in ("two", "three"):
        result = await daemon.runs.exec(run.run_id, ["echo", word])
        assert (result.exitCode, result.stdout) == (0, f"{word}\n".encode())
    assert len(validated) == 1  # the same plan but for its command: not again
    # A plan that differs in more than its command is built and validated afresh.
    other = await daemon.runs.exec(run.run_id, ["pwd"], env_values={"LANG": "de_DE.UTF-8"})
    assert (other.exitCode, len(validated)) == (0, 2)


async def test_a_cgroup_that_cannot_be_removed_is_named_in_the_runs_end_and_not_the_result(
    daemon: Daemon, base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = await start_run(daemon, base)
    remove = CommandCgroup.remove

    async def refuse(self: CommandCgroup) -> None:
        raise CgroupError(f"cgroup {self.memory_dir} still has processes (a stand-in)")

    monkeypatch.setattr(CommandCgroup, "remove", refuse)
    result = await daemon.runs.exec(run.run_id, ["echo", "done"])
    # The command's result stands: its cgroup is not its business.
    assert (result.exitCode, result.stdout) == (0, b"done\n")
    left = command_cgroups(run.run_id)
    try:
        summary = await daemon.runs.end(run.run_id)
        assert summary is not None
        await daemon.audit.durable(daemon.audit.last_seq)
        lines = daemon.config.resolved_audit_path.read_text().splitlines()
        ended = [json.loads(line) for line in lines if '"run_ended"' in line and run.run_id in line]
        assert len(ended) == 1
        named = ended[0]["detail"]["cgroupsLeft"]
        memory_dir = next(path for path in left if path.parent == CGROUPS.memory_parent)
        assert named == [f"cgroup {memory_dir} still has processes (a stand-in)"]
    finally:
        monkeypatch.setattr(CommandCgroup, "remove", remove)
        for path in left:
            with contextlib.suppress(OSError):
                path.rmdir()
    assert command_cgroups(run.run_id) == []
