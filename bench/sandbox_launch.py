"""Starting a command in a run's sandbox, and making and ending a run, with their
baselines measured in the same process run.

    .venv/bin/python bench/sandbox_launch.py [--iterations 200] [--warmup 10] [--cli-iterations 30]

Needs root, /usr/bin/bwrap and /bin/true. One in-process gatewayd with the OS sandbox on
(its own network-namespace prefix and sandbox uid range, so it never touches another
daemon's) runs every variant once per round, in a freshly shuffled order each round, so
drift and after-effects (a cgroup or pid namespace still being torn down) hit all alike:

- ``/bin/true`` through ``RunManager.exec`` in an existing run: the path
  ``gatewayd exec`` and the control socket take after HTTP parsing; then the same
  without the audit entry (``RunSandbox.exec``), without plan building too
  (``run_in_sandbox`` with a plan built once, the daemon's cgroups) and without the
  command cgroup (``cgroups=None``: the rlimit fallback), to show what each layer costs;
  and ``run_in_sandbox`` with its child joining by ``cgroup.procs`` as it did before it
  joined by v1's ``tasks`` (an A/B of that change in the same rounds); and
  ``RunManager.exec`` as it was before a reused plan went unvalidated at its start,
  the workspace session's check-only sync stayed in the trio thread and the command's
  cgroup removal waited for the answer's own work (another A/B);
- raw bwrap: the launcher's exact argv (``sandbox_argv`` of the run's plan), the same
  seccomp filter and data on memfds made once (rewound before each start), the same
  setup by gatewayd's launcher program (setns into the run's netns, the same rlimits,
  setgroups/setresgid/setresuid to the run's uid, every capability set cleared,
  no_new_privs, parent-death signal), a new session, the empty environment and both
  output pipes read to the end, from a worker thread. Not in it: audit entries, plan
  building and validation, making the memfds, the command's cgroup, trio's supervision
  (pidfd, pipe drains, timeout scope); and the same with that setup in a Python
  ``preexec_fn`` instead (how gatewayd started commands before its launcher program:
  a full fork of the process and Python in the child);
- the same raw bwrap joining a fresh command cgroup (made with gatewayd's own
  ``create_command_cgroup``), removed afterwards by polling
  ``rmdir`` every 0.2 ms: what a cgroup costs when nothing waits longer than it must;
  once joined as the launcher joins (``CommandCgroup.join_files``), once by
  ``cgroup.procs`` (the kernel's whole-process move);
- plain ``/bin/true`` via ``subprocess.run`` (no preexec_fn, so Python can vfork);
- ``RunManager.start`` + ``RunManager.end`` of a fresh run (uid, network namespace,
  lease of a small workspace, run directory, socket, two durable audit entries), and
  its parts measured alone in the same rounds; with ``--run-start``, also its floor
  (``bench/run_start_floor.py``: the same kernel work with bare system calls).

Then, separately, the full CLI path: ``gatewayd exec RUN -- /bin/true`` against a live
``gatewayd serve``, with fewer iterations; Python start-up dominates it.

Targets: exec at most 1.3x raw bwrap with the same limits; run create + teardown under
50 ms.
Prints medians and p90 in ms, never asserts on time.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import logging
import os
import random
import resource
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final, get_args
from unittest import mock

import prctl
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (
    BIN,
    compile_sources,
    control,
    env_info,
    percentile,
    stop_serving,
    wait_until_serving,
)
from run_start_floor import RunStartFloor

from gatewayd.audit import AuditEvent
from gatewayd.config import GatewaydConfig, SandboxUids
from gatewayd.daemon import Daemon, open_daemon
from gatewayd.files import LIBC
from gatewayd.logs import configure_logging
from gatewayd.policy import Policy
from gatewayd.policy.workspace_section import WorkspaceModeName
from gatewayd.policyfile import RACY_WINDOW_NS, load_policy
from gatewayd.runs import Grant, RunRequest
from gatewayd.sandbox import cgroup as cgroup_module
from gatewayd.sandbox import session as session_module
from gatewayd.sandbox.cgroup import CgroupSupport, CommandCgroup, create_command_cgroup
from gatewayd.sandbox.launch import (
    ExecResult,
    LaunchError,
    memfd,
    run_in_sandbox,
    sandbox_argv,
    start_launched,
)
from gatewayd.sandbox.lease import give_back, lend
from gatewayd.sandbox.lendable import LendableRoots
from gatewayd.sandbox.limits import HostUser, LimitMechanism, SandboxLimits, rlimits
from gatewayd.sandbox.netns import (
    NETNS_PREFIX,
    NETNS_RUN_DIR,
    NetnsHandle,
    create_run_netns,
    netns_name,
    remove_run_netns,
    remove_stale_netns,
)
from gatewayd.sandbox.plan import BWRAP, CheckedPlans, SandboxPlan, validate
from gatewayd.sandbox.seccomp import CLONE_NEWNET
from gatewayd.sandbox.session import RunSandbox
from gatewayd.sandbox.uids import UidPool, UidRange, pids_of_uid, uids_with_processes
from gatewayd.workspace import WorkspaceSession

TRUE: Final = "/bin/true"
# Sandbox uids of this benchmark: a random 64-uid slice of 1.6e9..1.65e9, away from the
# tests' slices (1.7e9..) and the default range (1.8e9), so no live daemon shares one.
UID_REGION_BASE: Final = 1_600_000_000
UID_REGION_SLICES: Final = 50_000
UID_COUNT: Final = 64
# "A small workspace": this many files in two directories, so the lease walks a tree.
WORKSPACE_FILES: Final = 8
EXEC_TARGET_RATIO: Final = 1.3  # the target: exec at most 1.3x raw bwrap, same limits
CREATE_TARGET_MS: Final = 50.0  # the target: run create + teardown under 50 ms
# A fixed seed: the shuffled orders are the same from run to run.
ORDER_SEED: Final = 3
# The raw cgroup variant retries rmdir this often: far below the launcher's 10 ms poll,
# so it shows how long a cgroup really stays busy after its command ended.
RMDIR_POLL_S: Final = 0.0002
# The raw cgroup variant's child reports how long joining its cgroups took (seconds).
# litellm must never fetch its cost map at import (DESIGN.md), in any process we start.
SUBPROCESS_ENV: Final = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
# Waiting for a live `gatewayd serve` to answer /v1/health.
SERVE_START_S: Final = 30.0

# The shipped default max_processes (256) on purpose: each bwrap start keeps one process
# of the run's uid counted for about a second after it exits (its pid namespace is torn
# down late), so with the rlimit fallback (the cgroups=None variant) a low RLIMIT_NPROC
# would make back-to-back starts fail with EAGAIN.
POLICY: Final = """\
version: 1
name: bench-sandbox
description: the run of bench/sandbox_launch.py; a writable workspace, so it is lent.
tools:
  allow: [time.now]
filesystem:
  paths:
    workspace: {root: ., mode: rw}
limits: {calls_per_second: 1000000, burst: 1000000}
sandbox: {timeout_s: 30, max_output_bytes: 65536}
"""

Durations = dict[str, float]
Variant = Callable[[], Awaitable[Durations]]


def bench_ids() -> tuple[str, UidRange]:
    """A fresh namespace prefix and uid range, so this run shares nothing with others."""
    prefix = f"cgtb{secrets.token_hex(4)}-"
    base = UID_REGION_BASE + secrets.randbelow(UID_REGION_SLICES) * 1024
    return prefix, UidRange(base, UID_COUNT)


def make_workspace(path: Path) -> Path:
    for sub in ("src", "docs"):
        (path / sub).mkdir(parents=True)
        for i in range(WORKSPACE_FILES // 2):
            (path / sub / f"f{i}.txt").write_text("hello\n")
    return path


@contextlib.contextmanager
def bench_dir(prefix: str) -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    base.chmod(0o711)  # the sandbox uid passes through to its workspace and socket
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


class StartFailed(Exception):
    """/bin/true did not run to a clean exit; the round's time for it is not recorded."""


# A start that fails is counted and reported, never timed (it would time the failure).
# On a shared host another daemon's start-up sweep of empty command cgroups can remove a
# cgroup between its mkdir and the child's join: the child's preexec then fails.
START_FAILURES: Final = (StartFailed, LaunchError, subprocess.SubprocessError)


def check(result: ExecResult) -> None:
    if result.exitCode != 0 or result.errorCode is not None:
        raise StartFailed(f"/bin/true in the sandbox failed: {result}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RawBwrap:
    """The launcher's bwrap command without gatewayd around it (see the module doc)."""

    argv: list[str]
    fds: tuple[int, ...]  # data memfds and the seccomp memfd, as the argv names them
    netns_fd: int
    user: HostUser
    rlimit_table: tuple[tuple[int, int, int], ...]

    def start(self, joins: tuple[bytes, ...] = ()) -> float:
        """Run it once through gatewayd's launcher program (joining the cgroups of
        ``joins`` first); returns the wall time in seconds. Blocking: call it from a thread."""
        started = time.perf_counter()
        self._rewind()
        process = start_launched(
            self.argv,
            netns_fd=self.netns_fd,
            user=self.user,
            joins=joins,
            limits=self.rlimit_table,
            pass_fds=self.fds,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        _, err = process.communicate()
        elapsed = time.perf_counter() - started
        if process.returncode != 0:
            raise StartFailed(f"raw bwrap failed ({process.returncode}): {err!r}")
        return elapsed

    def start_preexec(self) -> float:
        """Run it once with the same setup in a Python ``preexec_fn`` (no cgroup): how
        gatewayd started its commands before its launcher program. Blocking."""
        started = time.perf_counter()
        self._rewind()
        proc = subprocess.run(
            self.argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            env={},
            pass_fds=self.fds,
            start_new_session=True,
            # Forked from a worker thread that waits for it; the child only makes syscalls.
            preexec_fn=self._child_setup,
        )
        elapsed = time.perf_counter() - started
        if proc.returncode != 0:
            raise StartFailed(f"raw bwrap failed ({proc.returncode}): {proc.stderr!r}")
        return elapsed

    def _rewind(self) -> None:
        for fd in self.fds:
            os.lseek(fd, 0, os.SEEK_SET)  # bwrap reads each from the current offset

    def _child_setup(self) -> None:
        if LIBC.setns(self.netns_fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns into the run's network namespace failed")
        for which, soft, hard in self.rlimit_table:
            resource.setrlimit(which, (soft, hard))
        os.setgroups([])
        os.setresgid(self.user.gid, self.user.gid, self.user.gid)
        os.setresuid(self.user.uid, self.user.uid, self.user.uid)
        prctl.set_no_new_privs(1)
        prctl.set_pdeathsig(signal.SIGKILL)


def memfds(stack: contextlib.ExitStack, plan: SandboxPlan) -> tuple[dict[str, int], int]:
    """The plan's data and the seccomp filter on memfds, as the launcher makes them."""

    data = {step.dest: memfd(stack, "cogni-data", step.data) for step in plan.data_steps}
    return data, memfd(stack, "cogni-seccomp", None)


def rmdir_when_empty(directory: Path) -> int:
    """rmdir, retrying every ``RMDIR_POLL_S`` while the kernel says busy; returns the
    number of busy answers."""
    busy = 0
    while True:
        try:
            directory.rmdir()
            return busy
        except FileNotFoundError:
            # Another daemon's start-up sweep removes empty command cgroups under the same
            # parent; the launcher tolerates that too.
            return busy
        except OSError as exc:
            if exc.errno != errno.EBUSY:
                raise
        busy += 1
        time.sleep(RMDIR_POLL_S)


def raw_in_cgroup(
    raw: RawBwrap,
    cgroups: CgroupSupport,
    run_id: str,
    limits: SandboxLimits,
    *,
    whole_process: bool,
) -> Durations:
    """Raw bwrap in a fresh command cgroup, timed in three parts. Blocking.
    ``whole_process``: the child joins by ``cgroup.procs`` (the kernel moves a whole
    thread group, under its global lock); else by the files the launcher writes
    (``CommandCgroup.join_files``: v1 ``tasks``, the child's only thread)."""
    key = "raw_cg" if whole_process else "raw_cg_tasks"
    started = time.perf_counter()
    cgroup = create_command_cgroup(
        cgroups, run_id=run_id, memory_bytes=limits.memory_bytes, max_processes=limits.max_processes
    )
    made = time.perf_counter()
    try:
        raw.start(cgroup.procs_files if whole_process else cgroup.join_files)
    finally:
        ran = time.perf_counter()
        busy = sum(rmdir_when_empty(directory) for directory in cgroup.dirs)
    removed = time.perf_counter()
    if not whole_process:
        return {key: removed - started}
    return {
        key: removed - started,
        "cg_make": made - started,
        "cg_remove": removed - ran,
        "cg_busy": float(busy > 0),
    }


@contextlib.contextmanager
def joining_whole_process() -> Iterator[None]:
    """The launcher as it was before it joined by ``tasks``: its child writes
    ``cgroup.procs`` instead (an A/B in one process; the class attribute is swapped only
    around one awaited start, in the one trio thread)."""
    saved = CommandCgroup.join_files
    CommandCgroup.join_files = CommandCgroup.procs_files  # type: ignore[method-assign]
    try:
        yield
    finally:
        CommandCgroup.join_files = saved  # type: ignore[method-assign]


@contextlib.contextmanager
def exec_as_before(sandbox: RunSandbox, session: WorkspaceSession | None) -> Iterator[None]:
    """RunManager.exec as it was: every plan validated again just before its start (a
    reused one too), the workspace session's sync (the base class's check, for an
    overlay session) run in a worker thread after the command, and the command's cgroup
    removal begun at once, beside the answer's durable entry. Swapped around one
    awaited exec, in the one trio thread (an A/B in one process)."""
    after = sandbox.after_command
    lock = trio.Lock()

    async def sync_in_thread() -> None:
        if session is not None:
            async with lock:
                await trio.to_thread.run_sync(session.sync)

    def validate_always(_: CheckedPlans, plan: SandboxPlan) -> None:
        validate(plan)

    with (
        mock.patch.object(CheckedPlans, "validate", validate_always),
        mock.patch.object(cgroup_module, "REMOVE_AFTER_S", 0),
    ):
        if after is not None:
            sandbox.after_command = sync_in_thread
        try:
            yield
        finally:
            sandbox.after_command = after


def launcher_rlimits(sandbox: RunSandbox) -> tuple[tuple[int, int, int], ...]:
    """The launcher's rlimit table for this host: no RLIMIT_AS/RLIMIT_NPROC where the
    command's cgroup limits memory/processes instead (as ``run_in_sandbox`` decides)."""
    cgroups = sandbox.settings.cgroups
    memory = LimitMechanism.RLIMIT if cgroups is None else LimitMechanism.CGROUP
    pids = (
        LimitMechanism.CGROUP
        if cgroups is not None and cgroups.pids_parent is not None
        else LimitMechanism.RLIMIT
    )
    return rlimits(sandbox.limits.for_command(None), memory=memory, processes=pids)


def plain_true() -> float:
    started = time.perf_counter()
    subprocess.run([TRUE], stdin=subprocess.DEVNULL, capture_output=True, check=True)
    return time.perf_counter() - started


class InProcess:
    """Every in-process variant: each does one round's worth and returns named times."""

    def __init__(
        self, daemon: Daemon, base: Path, policy: Path, sandbox: RunSandbox, raw: RawBwrap
    ) -> None:
        self.daemon = daemon
        self.policy = policy
        self.sandbox = sandbox
        self.raw = raw
        self.limits = sandbox.limits.for_command(None)
        self.plan = sandbox.plan([TRUE], dict(os.environ))
        # As a run's sandbox checks its plans: validated at the first start only.
        self.checks = CheckedPlans()
        self.create_ws = make_workspace(base / "ws-create")
        self.lease_ws = make_workspace(base / "ws-lease")
        self.lease_record = base / "lease-record"
        self.lease_record.mkdir()

    def request(self) -> RunRequest:
        return RunRequest(
            workspacePath=str(self.create_ws),
            policy=str(self.policy),
            actorId="bench",
            tenantId="bench",
            grant=Grant(allowSandbox=True),
        )

    def variants(self) -> dict[str, Variant]:
        found: dict[str, Variant] = {
            "exec": self.exec_daemon,
            "exec_before": self.exec_daemon_before,
            "session": self.exec_session,
            "launcher": self.exec_launcher_no_cgroup,
            "raw": self.exec_raw,
            "raw_preexec": self.exec_raw_preexec,
            "plain": self.exec_plain,
            "parts_exec": self.parts_exec,
            "create": self.create_teardown,
            "netns": self.part_netns,
            "lease": self.part_lease,
            "uids": self.part_uids,
            "registry": self.part_registry,
            "audit": self.part_audit,
        }
        if self.sandbox.settings.cgroups is not None:
            found["launcher_cg"] = self.exec_launcher
            found["launcher_procs"] = self.exec_launcher_whole_process
            found["raw_cg"] = self.exec_raw_cgroup
            found["raw_cg_tasks"] = self.exec_raw_cgroup_tasks
        return found

    async def timed_exec(self, key: str, command: Awaitable[ExecResult]) -> Durations:
        started = time.perf_counter()
        result = await command
        elapsed = time.perf_counter() - started
        check(result)
        return {key: elapsed}

    async def exec_daemon(self) -> Durations:
        cpu = time.process_time()
        got = await self.timed_exec("exec", self.daemon.runs.exec(self.sandbox.run_id, [TRUE]))
        return {**got, "exec_cpu": time.process_time() - cpu}

    async def exec_daemon_before(self) -> Durations:
        run = self.daemon.registry.get(self.sandbox.run_id)
        session = None if run is None or run.workspace is None else run.workspace.session
        with exec_as_before(self.sandbox, session):
            cpu = time.process_time()
            ran = self.daemon.runs.exec(self.sandbox.run_id, [TRUE])
            got = await self.timed_exec("exec_before", ran)
            return {**got, "exec_before_cpu": time.process_time() - cpu}

    async def exec_session(self) -> Durations:
        return await self.timed_exec("session", self.sandbox.exec([TRUE]))

    def launch(self, cgroups: CgroupSupport | None) -> Awaitable[ExecResult]:
        return run_in_sandbox(
            self.plan,
            netns=self.sandbox.netns.path,
            limits=self.limits,
            host_user=self.sandbox.user,
            bwrap=self.sandbox.settings.bwrap,
            cgroups=cgroups,
            pins=self.sandbox.pins,
            checks=self.checks,
        )

    async def exec_launcher(self) -> Durations:
        return await self.timed_exec("launcher_cg", self.launch(self.sandbox.settings.cgroups))

    async def exec_launcher_whole_process(self) -> Durations:
        with joining_whole_process():
            launched = self.launch(self.sandbox.settings.cgroups)
            return await self.timed_exec("launcher_procs", launched)

    async def exec_launcher_no_cgroup(self) -> Durations:
        return await self.timed_exec("launcher", self.launch(None))

    async def exec_raw(self) -> Durations:
        return {"raw": await trio.to_thread.run_sync(self.raw.start)}

    async def exec_raw_preexec(self) -> Durations:
        return {"raw_preexec": await trio.to_thread.run_sync(self.raw.start_preexec)}

    async def exec_raw_cgroup(self) -> Durations:
        return await self.raw_cgroup(whole_process=True)

    async def exec_raw_cgroup_tasks(self) -> Durations:
        return await self.raw_cgroup(whole_process=False)

    async def raw_cgroup(self, *, whole_process: bool) -> Durations:
        cgroups = self.sandbox.settings.cgroups
        if cgroups is None:  # only offered with cgroups
            raise RuntimeError("no command cgroups on this host")
        run_id, limits = self.sandbox.run_id, self.limits
        return await trio.to_thread.run_sync(
            lambda: raw_in_cgroup(self.raw, cgroups, run_id, limits, whole_process=whole_process)
        )

    async def exec_plain(self) -> Durations:
        return {"plain": await trio.to_thread.run_sync(plain_true)}

    async def parts_exec(self) -> Durations:
        reused = time.perf_counter()
        self.sandbox.plan([TRUE], dict(os.environ))  # the run's last plan, reused
        started = time.perf_counter()
        replace(self.sandbox).plan([TRUE], dict(os.environ))  # a copy has none: built
        planned = time.perf_counter()
        with contextlib.ExitStack() as stack:
            memfds(stack, self.plan)
        made = time.perf_counter()
        # The durable entry an exec waits for (the writer takes registered names only).
        await self.daemon.audit.append("event", event=AuditEvent.EXEC_STARTED)
        appended = time.perf_counter()
        return {
            "plan": planned - started,
            "plan_reused": started - reused,
            "memfds": made - planned,
            "audit1": appended - made,
        }

    async def create_teardown(self) -> Durations:
        started = time.perf_counter()
        run = await self.daemon.runs.start(self.request(), policy_paths=True)
        created = time.perf_counter()
        await self.daemon.runs.end(run.run_id)
        ended = time.perf_counter()
        return {
            "create": ended - started,
            "start": created - started,
            "end": ended - created,
        }

    async def part_netns(self) -> Durations:
        # Through a worker thread, as RunSandbox.open and close call them.
        run_id = secrets.token_hex(16)
        prefix = self.daemon.config.resolved_netns_prefix
        started = time.perf_counter()
        handle = await trio.to_thread.run_sync(lambda: create_run_netns(run_id, prefix=prefix))
        created = time.perf_counter()
        await trio.to_thread.run_sync(remove_run_netns, handle.name)
        removed = time.perf_counter()
        return {"netns_create": created - started, "netns_remove": removed - created}

    async def part_lease(self) -> Durations:
        user = self.daemon.runs.uid_pool.acquire()
        try:
            started = time.perf_counter()
            lease = await trio.to_thread.run_sync(
                lambda: lend([self.lease_ws], user, self.lease_record, roots=LendableRoots())
            )
            lent = time.perf_counter()
            await trio.to_thread.run_sync(give_back, lease)
            returned = time.perf_counter()
        finally:
            self.daemon.runs.uid_pool.release(user)
        return {"lend": lent - started, "give_back": returned - lent}

    async def part_uids(self) -> Durations:
        # The pool keeps records; teardown scans /proc for the uid's pids.
        started = time.perf_counter()
        user = self.daemon.runs.uid_pool.acquire()
        self.daemon.runs.uid_pool.release(user)
        pids_of_uid(user.uid)
        return {"uids": time.perf_counter() - started}

    async def part_registry(self) -> Durations:
        # Request to run object: policy file loaded and bound, run directory made/removed.
        started = time.perf_counter()
        run = self.daemon.registry.create(self.request(), policy_paths=True)
        self.daemon.registry.remove(run)
        return {"registry": time.perf_counter() - started}

    async def part_audit(self) -> Durations:
        # A run's two durable entries (run_created, run_ended).
        started = time.perf_counter()
        await self.daemon.audit.append("event", event=AuditEvent.RUN_CREATED)
        await self.daemon.audit.append("event", event=AuditEvent.RUN_ENDED)
        return {"audit2": time.perf_counter() - started}


@dataclass(frozen=True, slots=True, kw_only=True)
class Samples:
    times: dict[str, list[float]]  # seconds, by measurement
    failures: dict[str, list[str]]  # the failed starts' messages, by variant


async def rounds(variants: dict[str, Variant], warmup: int, iterations: int) -> Samples:
    """Each variant once per round, in a new shuffled order each round."""
    rng = random.Random(ORDER_SEED)
    samples = Samples(times={}, failures={})
    for i in range(warmup + iterations):
        order = list(variants)
        rng.shuffle(order)
        for name in order:
            try:
                got = await variants[name]()
            except START_FAILURES as exc:
                samples.failures.setdefault(name, []).append(f"{type(exc).__name__}: {exc}")
                continue
            if i >= warmup:
                for key, value in got.items():
                    samples.times.setdefault(key, []).append(value)
    return samples


async def in_process(warmup: int, iterations: int) -> tuple[Samples, str]:
    """Returns the samples and what the daemon said about cgroups."""
    prefix, uids = bench_ids()
    with bench_dir("cg-bsl-") as base:
        policy = base / "policy.yaml"
        policy.write_text(POLICY)
        config = GatewaydConfig(
            state_dir=base / "state",
            policy_dirs=(base,),
            netns_prefix=prefix,
            sandbox_uids=SandboxUids(base=uids.base, count=uids.count),
        )
        try:
            async with open_daemon(config, preload=True) as daemon:
                if not daemon.runs.support.available or daemon.runs.sandbox_settings is None:
                    raise RuntimeError(f"no OS sandbox here: {daemon.runs.support.reason}")
                cgroups = daemon.runs.sandbox_settings.cgroups
                cgroup_note = (
                    f"cgroup v{cgroups.version} command cgroups"
                    if cgroups is not None and cgroups.version is not None
                    else "no command cgroups (rlimits)"
                )
                run = await daemon.runs.start(
                    RunRequest(
                        workspacePath=str(make_workspace(base / "ws-exec")),
                        policy=str(policy),
                        actorId="bench",
                        tenantId="bench",
                        grant=Grant(allowSandbox=True),
                    ),
                    policy_paths=True,  # the bench is a local caller, like `gatewayd run`
                )
                sandbox = run.sandbox
                if sandbox is None:
                    raise RuntimeError(f"the run has no sandbox: {run.degraded}")
                # Raw bwrap binds the host paths itself, as bwrap used alone does; gatewayd
                # first attaches the directories it pinned at run start (its own cost).
                # The run's workspace is its session's view in the state directory, which
                # only a pinned descriptor reaches: raw bwrap binds the workspace itself.
                plan = replace(sandbox, pinned={}, workspace=base / "ws-exec").plan(
                    [TRUE], dict(os.environ)
                )
                with contextlib.ExitStack() as stack:
                    data_fds, seccomp_fd = memfds(stack, plan)
                    netns_fd = os.open(sandbox.netns.path, os.O_RDONLY | os.O_CLOEXEC)
                    stack.callback(os.close, netns_fd)
                    raw = RawBwrap(
                        argv=sandbox_argv(
                            plan,
                            bwrap=sandbox.settings.bwrap,
                            data_fds=data_fds,
                            seccomp_fd=seccomp_fd,
                        ),
                        fds=(*data_fds.values(), seccomp_fd),
                        netns_fd=netns_fd,
                        user=sandbox.user,
                        rlimit_table=launcher_rlimits(sandbox),
                    )
                    bench = InProcess(daemon, base, policy, sandbox, raw)
                    samples = await rounds(bench.variants(), warmup, iterations)
                    return samples, cgroup_note
        finally:
            # Only if interrupted mid-round could a namespace of ours be left.
            remove_stale_netns(prefix)


@contextlib.contextmanager
def live_daemon() -> Iterator[tuple[Path, str]]:
    """A real `gatewayd serve` with the OS sandbox and one run; yields (state dir, run id)."""
    prefix, uids = bench_ids()
    with bench_dir("cg-bsl-cli-") as base:
        state = base / "state"
        policy = base / "policy.yaml"
        policy.write_text(POLICY)
        ws = make_workspace(base / "ws")
        log_path = base / "gatewayd.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [
                    str(BIN / "gatewayd"),
                    "serve",
                    "--state-dir",
                    str(state),
                    "--netns-prefix",
                    prefix,
                    "--sandbox-uids",
                    f"{uids.base}+{uids.count}",
                    # The control socket names policies; this one is found here.
                    "--policy-dir",
                    str(base),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=SUBPROCESS_ENV,
            )
        try:
            wait_until_serving(proc, state / "control.sock", log_path, SERVE_START_S)
            status, data = control(
                state / "control.sock",
                "POST",
                "/v1/runs",
                {
                    "workspacePath": str(ws),
                    "policy": policy.stem,
                    "actorId": "bench",
                    "tenantId": "bench",
                    "grant": {"allowSandbox": True},
                },
            )
            if status != 201:
                raise RuntimeError(f"run creation failed: {status} {data}")
            yield state, data["run"]["runId"]
        finally:
            stop_serving(proc)


def cli_path(warmup: int, iterations: int) -> dict[str, list[float]]:
    python = os.path.realpath(sys.executable)  # the binary behind the venv's python
    with live_daemon() as (state, run_id):
        gatewayd = [str(BIN / "gatewayd"), "exec", "--state-dir", str(state)]
        cases: dict[str, tuple[list[str], int]] = {
            "cli_exec": ([*gatewayd, run_id, "--", TRUE], 0),
            # Refused at the lookup: start-up, imports and one control request, no sandbox.
            "cli_unknown": ([*gatewayd, "0" * 32, "--", TRUE], 1),
            "python": ([python, "-I", "-S", "-c", "pass"], 0),
        }
        rng = random.Random(ORDER_SEED)
        samples: dict[str, list[float]] = {name: [] for name in cases}
        for i in range(warmup + iterations):
            order = list(cases)
            rng.shuffle(order)
            for name in order:
                cmd, expected = cases[name]
                started = time.perf_counter()
                proc = subprocess.run(cmd, capture_output=True, env=SUBPROCESS_ENV)
                elapsed = time.perf_counter() - started
                if proc.returncode != expected:
                    raise RuntimeError(f"{cmd} exited {proc.returncode}: {proc.stderr!r}")
                if i >= warmup:
                    samples[name].append(elapsed)
        return samples


def ms(values: list[float], p: float) -> float:
    return percentile(values, p) * 1000


def row(label: str, values: list[float] | None, baseline: list[float] | None = None) -> str:
    if values is None:
        return f"  {label:<60}{'n/a (no cgroups here)':>20}"
    line = f"  {label:<60}{ms(values, 50):9.2f}{ms(values, 90):9.2f}"
    if baseline is not None:
        line += f"{statistics.median(values) / statistics.median(baseline):9.2f}x"
    return line


def report(samples: Samples, cli: dict[str, list[float]] | None) -> None:
    s = samples.times
    raw = s["raw"]
    print(f"{'/bin/true started through':<62}{'median':>9}{'p90':>9}{'vs raw':>10}  (ms)")
    print(row("gatewayd: RunManager.exec (the exec path)", s["exec"], raw))
    print(
        row(
            "  as before (plan checks, sync, cgroup removal)",
            s["exec_before"],
            raw,
        )
    )
    print(row("  without its audit entry: RunSandbox.exec", s["session"], raw))
    print(row("  without plan building too: run_in_sandbox", s.get("launcher_cg"), raw))
    print(
        row("  the same, its child joining by cgroup.procs (before)", s.get("launcher_procs"), raw)
    )
    print(row("  without the command cgroup too: cgroups=None", s["launcher"], raw))
    print(row("raw bwrap: same argv, memfds, setup, rlimits, no cgroup", raw, raw))
    print(row("  the same, its setup in a Python preexec_fn (before)", s["raw_preexec"], raw))
    print(
        row(
            "raw bwrap in a fresh command cgroup, joined as the launcher",
            s.get("raw_cg_tasks"),
            raw,
        )
    )
    print(row("raw bwrap in a fresh command cgroup, joined by cgroup.procs", s.get("raw_cg"), raw))
    print(row("plain /bin/true (subprocess.run)", s["plain"], raw))
    print("  parts, timed alone in the same rounds:")
    print(row("  plan build + validate (RunSandbox.plan, a new plan)", s["plan"]))
    print(row("  plan reused (same inputs, as a run's next exec)", s["plan_reused"]))
    print(row("  memfds: plan data + seccomp filter", s["memfds"]))
    print(row("  one durable audit append (exec_started)", s["audit1"]))
    print(row("  command cgroup: mkdir + limits", s.get("cg_make")))
    print(row("  command cgroup: until rmdir succeeds after the command", s.get("cg_remove")))
    if "cg_busy" in s:
        busy = statistics.mean(s["cg_busy"])
        print(f"    (rmdir answered EBUSY at first in {busy:.0%} of rounds; a run's exec")
        print("     removes its cgroup after the result is returned)")

    print(f"{'run create + teardown':<62}{'median':>9}{'p90':>9}  (ms)")
    print(row("RunManager.start + RunManager.end, a fresh run", s["create"]))
    print(row("  start", s["start"]))
    print(row("  end", s["end"]))
    print("  parts, timed alone in the same rounds:")
    parts = {
        "netns_create": "network namespace create (namespace thread, lo up, verify)",
        "netns_remove": "network namespace remove",
        "lend": "lease: lend the workspace (walk, chown, fsynced record)",
        "give_back": "lease: give the workspace back (walk, chown)",
        "uids": "uid pool acquire/release + pids_of_uid (one /proc scan)",
        "registry": "registry create/remove (policy load, run directory)",
        "audit2": "two durable audit appends (run_created, run_ended)",
    }
    for key, label in parts.items():
        print(row(f"  {label}", s[key]))
    rest = statistics.median(s["create"]) - sum(statistics.median(s[key]) for key in parts)
    label = "  rest: total minus parts (listener, socket, hand-offs)"
    print(f"  {label:<60}{rest * 1000:9.2f}")

    ratio = statistics.median(s["exec"]) / statistics.median(raw)
    ratio90 = percentile(s["exec"], 90) / percentile(raw, 90)
    create_ms = ms(s["create"], 50)
    print(
        f"target exec <= {EXEC_TARGET_RATIO}x raw bwrap: "
        f"{'MET' if ratio <= EXEC_TARGET_RATIO else 'NOT MET'} "
        f"({ratio:.2f}x at the median, {ratio90:.2f}x at p90)"
    )
    for key, label in (("raw_cg_tasks", "joined as the launcher"), ("raw_cg", "by cgroup.procs")):
        if s.get(key):
            # The same comparison with equal limits: raw bwrap in a command cgroup of its
            # own, made, joined and removed around each start.
            same = statistics.median(s["exec"]) / statistics.median(s[key])
            print(
                f"  the same against raw bwrap in a fresh command cgroup ({label}): "
                f"{'MET' if same <= EXEC_TARGET_RATIO else 'NOT MET'} ({same:.2f}x at the median)"
            )
    saved = statistics.median(s["exec_before"]) - statistics.median(s["exec"])
    print(
        f"  a reused plan not validated again, the check-only sync in the trio thread and "
        f"the cgroup removed after the answer save {saved * 1000:.2f} ms at the median; "
        f"the process's CPU per exec "
        f"{ms(s['exec_cpu'], 50):.2f} ms now, {ms(s['exec_before_cpu'], 50):.2f} ms before"
    )
    if s.get("launcher_procs") and s.get("launcher_cg"):
        saved = statistics.median(s["launcher_procs"]) - statistics.median(s["launcher_cg"])
        print(
            f"  joining by tasks instead of cgroup.procs saves {saved * 1000:.2f} ms at the median"
        )
    print(
        f"target run create + teardown < {CREATE_TARGET_MS:.0f} ms: "
        f"{'MET' if create_ms < CREATE_TARGET_MS else 'NOT MET'} "
        f"({create_ms:.1f} ms median, {ms(s['create'], 90):.1f} ms p90)"
    )
    for name, messages in samples.failures.items():
        print(f"failed starts of {name!r}: {len(messages)} (not timed); first: {messages[0]}")
    if cli is None:
        return
    print(f"{'full CLI path, separately (a live gatewayd serve)':<62}{'median':>9}{'p90':>9}  (ms)")
    print(row("gatewayd exec RUN -- /bin/true", cli["cli_exec"]))
    print(row("gatewayd exec <unknown run> (refused before any sandbox)", cli["cli_unknown"]))
    print(row("python3 -I -S -c pass", cli["python"]))
    share = statistics.median(cli["cli_unknown"]) / statistics.median(cli["cli_exec"])
    print(
        f"  the CLI is a new Python process: start-up, imports and one control request "
        f"(the unknown-run row) are {share:.0%} of it"
    )


# --- run start: RunManager.start + end, now and with its parts as they were ------------

# Run create + teardown at most this at the median (the target for run start).
RUN_START_TARGET_MS: Final = 15.0


def create_netns_before(run_id: str, *, prefix: str = NETNS_PREFIX) -> NetnsHandle:
    """A run's namespace as gatewayd made it before: pyroute2's ``netns.create`` (a
    forked child unshares and bind-mounts) and ``IPRoute(netns=...)`` (a second fork
    opens the socket inside), lo up, its interfaces and addresses read and checked."""
    from pyroute2 import IPRoute
    from pyroute2 import netns as pyroute2_netns

    name = netns_name(run_id, prefix=prefix)
    path = NETNS_RUN_DIR / name
    pyroute2_netns.create(str(path))
    with IPRoute(netns=str(path), flags=0, groups=0) as ipr:
        (index,) = ipr.link_lookup(ifname="lo")
        ipr.link("set", index=index, state="up")
        links = [str(link.get_attr("IFLA_IFNAME")) for link in ipr.get_links()]
        tuple(ipr.get_addr())
    if links != ["lo"]:
        raise RuntimeError(f"namespace {name} holds {links}")
    return NetnsHandle(run_id=run_id, name=name, path=path)


def pids_of_uid_before(uid: int) -> list[int]:
    """The /proc scan as it was: each status file read line by line."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        ids: set[int] = set()
        zombie = False
        try:
            with open(f"/proc/{entry}/status", "rb") as status:
                for line in status:
                    if line.startswith(b"State:"):
                        zombie = line.split()[1] == b"Z"
                    elif line.startswith((b"Uid:", b"Gid:")):
                        ids.update(int(field) for field in line.split()[1:5])
                        if line.startswith(b"Gid:"):
                            break
        except (OSError, ValueError):
            continue
        if not zombie and uid in ids:
            pids.append(int(entry))
    return pids


class UncachedPolicies:
    """A policy cache that keeps nothing: every run parses its file, as before."""

    def load(self, path: Path) -> Policy:
        return load_policy(path)


@contextlib.contextmanager
def run_start_as_before(daemon: Daemon) -> Iterator[None]:
    """RunManager.start + end with the parts as they were: the namespace by pyroute2's
    forks, a /proc scan at every uid acquire, the policy file parsed for every run, the
    end's /proc scan read line by line. Swapped around one awaited start + end, in the
    one trio thread (an A/B in one process)."""
    pool = daemon.runs.uid_pool

    def acquire_scanning() -> HostUser:
        uids_with_processes()  # what every acquire did first
        return UidPool.acquire(pool)

    with contextlib.ExitStack() as stack:
        for target, name, value in (
            (session_module, "create_run_netns", create_netns_before),
            (session_module, "pids_of_uid", pids_of_uid_before),
            (daemon.registry.policies, "cache", UncachedPolicies()),
            (pool, "acquire", acquire_scanning),
        ):
            stack.enter_context(mock.patch.object(target, name, value))
        yield


class SyncCounter:
    """How many fsync and fdatasync calls this process made (each a wait for the disk):
    os.fsync and os.fdatasync wrapped while the run-start rounds run."""

    def __init__(self) -> None:
        self.fsync = 0
        self.fdatasync = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        fsync, fdatasync = os.fsync, os.fdatasync

        def counted_fsync(fd: int) -> None:
            self.fsync += 1
            fsync(fd)

        def counted_fdatasync(fd: int) -> None:
            self.fdatasync += 1
            fdatasync(fd)

        with (
            mock.patch.object(os, "fsync", counted_fsync),
            mock.patch.object(os, "fdatasync", counted_fdatasync),
        ):
            yield


class RunStart:
    """The run-start variants: each does one round's worth and returns named times."""

    def __init__(self, daemon: Daemon, base: Path, policy: Path, syncs: SyncCounter) -> None:
        self.daemon = daemon
        self.policy = policy
        self.workspace = make_workspace(base / "ws-start")
        self.forks = 0
        self.syncs = syncs
        os.register_at_fork(before=self._forked)
        # The floor (bench/run_start_floor.py): the same kernel work on the same file
        # system, its own workspace like this one, a uid of the daemon's pool held for
        # the whole run, namespaces under the daemon's prefix (swept with its own).
        self.floor = RunStartFloor(
            base=base,
            workspace=make_workspace(base / "ws-floor"),
            uid=daemon.runs.uid_pool.acquire().uid,
            netns_prefix=daemon.config.resolved_netns_prefix,
        )

    def _forked(self) -> None:
        self.forks += 1

    def variants(self) -> dict[str, Variant]:
        return {
            "now": self.start_end,
            "before": self.start_end_before,
            "netns": self.part_netns,
            "netns_before": self.part_netns_before,
            "uids": self.part_uids,
            "policy": self.part_policy,
            "audit": self.part_audit,
            "floor": self.part_floor,
        }

    def request(self) -> RunRequest:
        return RunRequest(
            workspacePath=str(self.workspace),
            policy=str(self.policy),
            actorId="bench",
            tenantId="bench",
            grant=Grant(allowSandbox=True),
        )

    async def timed_start_end(self, key: str) -> Durations:
        forks = self.forks
        # Counted in this process: the daemon's audit flusher and worker threads too
        # (nothing else runs during one start + end in these rounds).
        fsyncs, fdatasyncs = self.syncs.fsync, self.syncs.fdatasync
        started = time.perf_counter()
        cpu = time.process_time()
        run = await self.daemon.runs.start(self.request(), policy_paths=True)
        created = time.perf_counter()
        await self.daemon.runs.end(run.run_id)
        ended = time.perf_counter()
        return {
            key: ended - started,
            f"{key}_start": created - started,
            f"{key}_end": ended - created,
            f"{key}_cpu": time.process_time() - cpu,
            f"{key}_forks": float(self.forks - forks),
            f"{key}_fsyncs": float(self.syncs.fsync - fsyncs),
            f"{key}_fdatasyncs": float(self.syncs.fdatasync - fdatasyncs),
        }

    async def start_end(self) -> Durations:
        return await self.timed_start_end("now")

    async def start_end_before(self) -> Durations:
        with run_start_as_before(self.daemon):
            return await self.timed_start_end("before")

    async def netns(self, key: str, create: Callable[..., NetnsHandle]) -> Durations:
        run_id = secrets.token_hex(16)
        prefix = self.daemon.config.resolved_netns_prefix
        started = time.perf_counter()
        handle = await trio.to_thread.run_sync(lambda: create(run_id, prefix=prefix))
        created = time.perf_counter()
        await trio.to_thread.run_sync(remove_run_netns, handle.name)
        return {key: created - started, f"{key}_remove": time.perf_counter() - created}

    async def part_netns(self) -> Durations:
        return await self.netns("netns", create_run_netns)

    async def part_netns_before(self) -> Durations:
        return await self.netns("netns_before", create_netns_before)

    async def part_uids(self) -> Durations:
        pool = self.daemon.runs.uid_pool
        started = time.perf_counter()
        pool.release(pool.acquire())
        taken = time.perf_counter()
        uids_with_processes()
        scanned = time.perf_counter()
        pids_of_uid(0)
        ended = time.perf_counter()
        pids_of_uid_before(0)
        return {
            "uids": taken - started,
            "uids_scan_before": scanned - taken,  # the scan every acquire made
            "kill_scan": ended - scanned,  # the end's scan: every process of the uid
            "kill_scan_before": time.perf_counter() - ended,
            "processes": float(sum(entry.isdigit() for entry in os.listdir("/proc"))),
        }

    async def part_policy(self) -> Durations:
        started = time.perf_counter()
        self.daemon.registry.policies.cache.load(self.policy)
        cached = time.perf_counter()
        load_policy(self.policy)
        return {"policy": cached - started, "policy_before": time.perf_counter() - cached}

    async def part_floor(self) -> Durations:
        # Timed in its worker thread, from its first system call to its last.
        fsyncs, fdatasyncs = self.syncs.fsync, self.syncs.fdatasync
        got = await trio.to_thread.run_sync(self.floor.round)
        return {
            **{f"floor_{key}": value for key, value in got.items()},
            "floor_fsyncs": float(self.syncs.fsync - fsyncs),
            "floor_fdatasyncs": float(self.syncs.fdatasync - fdatasyncs),
        }

    async def part_audit(self) -> Durations:
        # A run's two durable entries (run_created, run_ended).
        started = time.perf_counter()
        await self.daemon.audit.append("event", event=AuditEvent.RUN_CREATED)
        await self.daemon.audit.append("event", event=AuditEvent.RUN_ENDED)
        return {"audit2": time.perf_counter() - started}


async def run_start(warmup: int, iterations: int, workspace_mode: WorkspaceModeName) -> Samples:
    """RunManager.start + end of a fresh run each round, now and with the parts as they
    were (:func:`run_start_as_before`), the parts alone and the floor
    (bench/run_start_floor.py), in shuffled rounds; the
    run's workspace session in ``workspace_mode`` (the daemon's setting)."""
    prefix, uids = bench_ids()
    with bench_dir("cg-bsl-start-") as base:
        policy = base / "policy.yaml"
        policy.write_text(POLICY)
        config = GatewaydConfig(
            state_dir=base / "state",
            policy_dirs=(base,),
            netns_prefix=prefix,
            sandbox_uids=SandboxUids(base=uids.base, count=uids.count),
            workspace_mode=workspace_mode,
        )
        try:
            async with open_daemon(config, preload=True) as daemon:
                if daemon.runs.sandbox_settings is None:
                    raise RuntimeError(f"no OS sandbox here: {daemon.runs.support.reason}")
                # A policy file written this instant is parsed at every use until it is
                # older than the cache's racy window (gatewayd/policyfile.py): as a
                # daemon's policy files are, it is older when the rounds start.
                await trio.sleep(RACY_WINDOW_NS / 1e9)
                syncs = SyncCounter()
                starts = RunStart(daemon, base, policy, syncs)
                try:
                    with syncs.counting():
                        return await rounds(starts.variants(), warmup, iterations)
                finally:
                    starts.floor.close()
        finally:
            remove_stale_netns(prefix)


def report_run_start(samples: Samples) -> None:
    s = samples.times
    print(f"{'run create + teardown (RunManager.start + end)':<62}{'median':>9}{'p90':>9}  (ms)")
    print(row("now", s["now"]))
    print(row("  start", s["now_start"]))
    print(row("  end", s["now_end"]))
    print(row("  the process's CPU time (all threads)", s["now_cpu"]))
    print(row("as before (pyroute2's forks, /proc scans, policy parsed per run)", s["before"]))
    print(row("  start", s["before_start"]))
    print(row("  end", s["before_end"]))
    print(row("  the process's CPU time (all threads)", s["before_cpu"]))
    print("  parts, timed alone in the same rounds (now / as before):")
    pairs = {
        "network namespace create (lo up, verified)": ("netns", "netns_before"),
        "network namespace remove": ("netns_remove", "netns_before_remove"),
        "uid pool acquire + release / the /proc scan each acquire made": (
            "uids",
            "uids_scan_before",
        ),
        "the end's /proc scan for the uid's processes": ("kill_scan", "kill_scan_before"),
        "policy: cached load / parsed from the file": ("policy", "policy_before"),
    }
    for label, (now, before) in pairs.items():
        print(f"  {label:<60}{ms(s[now], 50):9.2f}{ms(s[before], 50):9.2f}")
    print(row("  two durable audit appends (run_created, run_ended)", s["audit2"]))
    forks_now = statistics.mean(s["now_forks"])
    forks_before = statistics.mean(s["before_forks"])
    print(
        f"  forks of the daemon per run start + end: {forks_now:.1f} now, "
        f"{forks_before:.1f} before; {statistics.median(s['processes']):.0f} processes on the "
        "host (each scan reads each one's status)"
    )
    print(
        f"  fsync + fdatasync calls per run start + end (the process, all threads): "
        f"{statistics.mean(s['now_fsyncs']):.1f} + {statistics.mean(s['now_fdatasyncs']):.1f}"
        " (the records crash recovery reads, and the audit log's flushes)"
    )
    report_floor(s)
    median = ms(s["now"], 50)
    print(
        f"target run create + teardown <= {RUN_START_TARGET_MS:.0f} ms at the median: "
        f"{'MET' if median <= RUN_START_TARGET_MS else 'NOT MET'} ({median:.1f} ms; "
        f"{ms(s['before'], 50):.1f} ms as before, in the same rounds)"
    )
    for name, messages in samples.failures.items():
        print(f"failed rounds of {name!r}: {len(messages)} (not timed); first: {messages[0]}")


# The floor's steps as bench/run_start_floor.py times them, in its order.
FLOOR_STEPS: Final = (
    ("store_open", "session directory, lock, meta.json"),
    ("lend", "base lease recorded, chowned to the uid"),
    ("overlay", "overlay directories and mount"),
    ("run_dir", "run directory opened to the uid, mount points"),
    ("apps", "apps folder made, its record"),
    ("netns", "network namespace (its own thread, meanwhile)"),
    ("netns_wait", "  waited for it"),
    ("run_lease", "the run's lease record"),
    ("audit", "two audit flushes"),
    ("socket", "the run's socket"),
    ("proc_scan", "the end's /proc scan"),
    ("apps_remove", "apps folder removed"),
    ("netns_remove", "namespace removed"),
    ("seal", "view unmounted, delta read, seal.json"),
    ("give_back", "base given back"),
    ("keep", "meta.json kept"),
    ("run_dir_delete", "run directory deleted (another thread, meanwhile)"),
    ("run_dir_wait", "  waited for it"),
)


def report_floor(s: dict[str, list[float]]) -> None:
    """The floor beside gatewayd's start + end (see bench/run_start_floor.py)."""
    floor, now = ms(s["floor_total"], 50), ms(s["now"], 50)
    print(row("the floor: the same kernel work, bare (bench/run_start_floor.py)", s["floor_total"]))
    print(row("  start", s["floor_start"]))
    print(row("  end", s["floor_end"]))
    print(row("  the process's CPU time (all threads)", s["floor_cpu"]))
    for key, label in FLOOR_STEPS:
        print(row(f"  {label}", s[f"floor_{key}"]))
    print(
        f"  fsync + fdatasync calls per floor round: {statistics.mean(s['floor_fsyncs']):.1f}"
        f" + {statistics.mean(s['floor_fdatasyncs']):.1f}"
    )
    print(
        f"  gatewayd / floor at the median: {now / floor:.2f}x ({now - floor:+.1f} ms); "
        f"CPU {ms(s['now_cpu'], 50) / ms(s['floor_cpu'], 50):.2f}x; the floor alone is "
        f"{'ABOVE' if floor > RUN_START_TARGET_MS else 'below'} the "
        f"{RUN_START_TARGET_MS:.0f} ms target ({floor:.1f} ms)"
    )


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--iterations", type=int, default=200, help="measured rounds, in-process")
    ap.add_argument("--warmup", type=int, default=10, help="unmeasured rounds first")
    ap.add_argument(
        "--cli-iterations", type=int, default=30, help="rounds of the CLI path (0: skip it)"
    )
    ap.add_argument(
        "--run-start",
        action="store_true",
        help="only run create + teardown, now and as before, and its parts",
    )
    ap.add_argument(
        "--workspace-mode",
        choices=get_args(WorkspaceModeName),
        default="overlay",
        help="the run-start rounds' workspace session (the daemon's default: overlay)",
    )
    args = ap.parse_args()
    compile_sources()
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    configure_logging(logging.WARNING)  # run_started/run_ended per round would drown it
    if os.geteuid() != 0 or not os.path.exists(BWRAP) or not os.path.exists(TRUE):
        print("sandbox_launch: needs root, /usr/bin/bwrap and /bin/true", file=sys.stderr)
        return 2
    version = subprocess.run([BWRAP, "--version"], capture_output=True, text=True).stdout.strip()
    print(
        f"sandbox_launch: {env_info()}; {version}; kernel {os.uname().release}; "
        f"{args.iterations} rounds after {args.warmup} warm-up, shuffled order; "
        "durable audit on"
    )
    if args.run_start:
        print(f"  run-start rounds; the run's workspace session: {args.workspace_mode}")
        samples = trio.run(run_start, args.warmup, args.iterations, args.workspace_mode)
        report_run_start(samples)
        return 0
    samples, cgroup_note = trio.run(in_process, args.warmup, args.iterations)
    print(f"  the daemon uses {cgroup_note}")
    cli = None
    if args.cli_iterations > 0:
        cli = cli_path(min(args.warmup, 3), args.cli_iterations)
    report(samples, cli)
    return 0


if __name__ == "__main__":
    sys.exit(main())
