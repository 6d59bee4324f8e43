"""Run ONE command in a run's sandbox and return what happened: the host-to-sandbox path.

Order of events for one command:

1. In gatewayd: when the host offers cgroups (``cgroups=probe_cgroups()``), the command's
   own cgroup is made with its memory (swap included) and pids limits; the plan's generated
   files and the seccomp filter go on memfds; the argv is ``render_argv(plan)`` plus
   ``--seccomp FD`` inserted just before the ``--`` that ends bwrap's options
   (``render_argv`` has no seccomp hook); the run's netns file is opened.
2. gatewayd starts ``gatewayd-launcher`` (launcher.c beside this module) with vfork and
   exec, never running Python in a forked child (a full fork of the daemon and its
   interpreter's after-fork work cost 8-13 ms per command). In that process, before it
   execs bwrap (after ``setsid`` from ``start_new_session``): join the command's cgroup
   (write ``0`` to its v1 ``tasks`` or v2 ``cgroup.procs``,
   :attr:`~gatewayd.sandbox.cgroup.CommandCgroup.join_files`: needs root, so before the
   uid changes, and first, so bwrap is counted too), join the run's netns with ``setns``
   (needs CAP_SYS_ADMIN), attach the pinned directories, set the rlimits (no RLIMIT_AS or
   RLIMIT_NPROC where the cgroup limits those), drop to the caller's unprivileged host
   uid/gid with no supplementary group and no capability in any set, then no_new_privs and
   the parent-death signal (after the uid change, which clears it). One process and one
   exec into bwrap: no ``nsenter``/``setpriv`` wrappers, whose own credential changes would
   clear the death signal again. The launcher closes the namespace and pinned directories'
   descriptors before the exec, and says on a close-on-exec pipe which step failed.
3. bwrap (unprivileged: it needs unprivileged user namespaces, which this kernel allows)
   builds the namespaces, drops every capability, loads the filter and execs the command.
4. After the command: its cgroup's OOM-kill counter decides ``oom_killed``; the cgroup is
   removed (also on cancellation and when bwrap could not start).

The launcher is started from the trio thread itself, not through
``trio.lowlevel.open_process`` (which starts it from a worker thread): the parent-death
signal fires when the *thread* that started the child ends, and trio's idle worker
threads end after a few seconds.

Threat model: the command is hostile. It holds no capability, sees only the plan, has no
network, cannot keep running past its time (the whole pid namespace is killed), cannot
block gatewayd with output (both pipes are drained to the end, keeping at most the cap).
"""

from __future__ import annotations

import base64
import contextlib
import enum
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import trio

from gatewayd.errors import GatewayError
from gatewayd.files import write_all
from gatewayd.metrics import METRICS
from gatewayd.sandbox.cgroup import (
    CgroupError,
    CgroupSupport,
    CommandCgroup,
    DeferredRemovals,
    create_command_cgroup,
)
from gatewayd.sandbox.limits import (
    ErrorKind,
    HostUser,
    LimitMechanism,
    SandboxLimits,
    classify_exit,
    rlimits,
)
from gatewayd.sandbox.passthrough import Passthrough, Relay, StreamedBytes
from gatewayd.sandbox.plan import BWRAP, CheckedPlans, SandboxPlan, render_argv
from gatewayd.sandbox.seccomp import write_filter

READ_CHUNK: Final = 64 * 1024  # one pipe's worth per read
# After the command is gone its pipes close at once (every writer was in its pid
# namespace); this bounds the drain in case something still holds one.
DRAIN_AFTER_EXIT_S: Final = 2.0
# The launcher (launcher.c, built beside this module): it sets the command's process up
# and execs bwrap. Its account of a failed step is one short line.
LAUNCHER: Final = str(Path(__file__).with_name("gatewayd-launcher"))
LAUNCHER_REPORT_BYTES: Final = 512
# After SIGKILL, how long to wait for the kernel to finish off the namespace's processes.
TREE_GONE_WAIT_S: Final = 2.0
# How often the grace period checks whether the tree has gone.
EXIT_POLL_S: Final = 0.01
# How often a kill checks whether bwrap has stopped (SIGSTOP takes effect within
# microseconds unless it is inside the kernel; TREE_GONE_WAIT_S bounds the wait).
STOP_POLL_S: Final = 0.0005
# /proc/PID/stat states in which a process runs nothing more: stopped, traced, dead.
_STOPPED_OR_GONE: Final = frozenset({b"T", b"t", b"Z", b"X", None})


# Where a command's output goes as it arrives, besides the capture: (stdout, stderr).
Echo = tuple[Callable[[bytes], None], Callable[[bytes], None]]
# What a command waits for between bwrap's start and its own (run_in_sandbox's ``gate``).
Gate = Callable[[], Awaitable[None]]


class _Release:
    """The write end of the pipe bwrap's ``--block-fd`` waits on: one byte starts the
    command. Closed without the byte only once the sandbox is gone (bwrap takes end of
    file as the go-ahead; it holds a writer of its own, :func:`_release_pipe`, so that a
    gatewayd that dies meanwhile starts nothing)."""

    def __init__(self) -> None:
        self.fd = -1
        self.handed_on = False  # the supervision owns it from then on

    def go(self) -> None:
        # A broken pipe: bwrap already failed and exited; its status says so.
        with contextlib.suppress(BrokenPipeError):
            os.write(self.fd, b"\0")
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def close_unless_handed_on(self) -> None:
        """Closed here only when bwrap never started (or failed to)."""
        if not self.handed_on:
            self.close()


def _release_pipe() -> tuple[int, int]:
    """(bwrap's ``--block-fd``, gatewayd's end). bwrap's end is the pipe's read end
    reopened read-write: bwrap then holds a writer of its own and never reads end of
    file, so only the byte starts the command. With a plain read end, gatewayd's end
    closed by the kernel when gatewayd dies would start it, and bwrap's namespace child,
    blocked there, has no parent-death signal yet (--die-with-parent takes effect only
    after that read)."""
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    try:
        return os.open(f"/proc/self/fd/{read_end}", os.O_RDWR | os.O_CLOEXEC), write_end
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)


class LaunchError(GatewayError):
    """The sandbox could not be started (gatewayd's or the host's fault, never the command's);
    the message names what failed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecResult:
    """What one sandboxed command did.

    ``stdout``/``stderr`` are the first ``max_output_bytes`` bytes, as bytes: the command's
    output need not be text, and the caller decides how to decode it for the wire.
    ``errorCode`` is ``"timeout"``, ``"oom_killed"`` (only with a cgroup memory limit),
    ``"limit_exceeded"`` or None; see :func:`~gatewayd.sandbox.limits.classify_exit`.
    ``memoryLimit`` and ``processLimit`` say how those limits were applied (``"cgroup"``
    or ``"rlimit"``), so the audit can tell a per-command limit from a per-process one.
    ``streamed``: for a command whose streams were passed through (:class:`Passthrough`),
    how many bytes crossed each; its ``stdout``/``stderr`` are then empty (nothing kept).
    """

    exitCode: int | None  # camelCase: the wire's spelling
    signal: int | None
    stdout: bytes
    stderr: bytes
    stdoutTruncated: bool
    stderrTruncated: bool
    durationMs: int
    errorCode: ErrorKind | None
    memoryLimit: LimitMechanism
    processLimit: LimitMechanism
    streamed: StreamedBytes | None = None
    # Whether the command's pids cgroup refused a fork at its limit (None: no pids
    # cgroup, or its counter unread); for the result's hint, not part of any JSON form.
    processLimitHit: bool | None = None

    @property
    def failed(self) -> bool:
        """Did the command fail: a non-zero exit, a signal, or a limit (its time, its
        memory, an rlimit) that ended it? (note 002's ``failed`` beside the exit code)"""
        return self.exitCode != 0 or self.signal is not None or self.errorCode is not None


class ResultForm(enum.Enum):
    """Who an :class:`ExecResult` is written for as JSON: each reader gets its own fields,
    in the order it has always had them (:data:`RESULT_FIELDS`)."""

    # The control socket's answer (gatewayd exec): output exact, as UTF-8 text when it is
    # valid UTF-8, else base64 (``stdoutEncoding`` says which).
    CONTROL = "control"
    # sandbox.exec's value, read by a model: output as text, invalid UTF-8 replaced.
    TOOL = "tool"
    # exec_ended's detail: the audit log never holds a command's output, only its size
    # (its duration is the entry's own durationMs).
    AUDIT = "audit"
    # exec_ended's detail for a passed-through command: how many bytes crossed each of
    # its streams (nothing was kept, so nothing was cut).
    STREAMED_AUDIT = "streamed_audit"
    # services_exited's detail: how the in-sandbox services ended, nothing more.
    EXIT = "exit"


# Each form's keys in their order. The order is part of each answer's bytes: the agent
# loop reads sandbox.exec's value by its first key, and a test pins every form's bytes.
RESULT_FIELDS: Final[Mapping[ResultForm, tuple[str, ...]]] = {
    ResultForm.CONTROL: (
        "exitCode",
        "signal",
        "durationMs",
        "errorCode",
        "memoryLimit",
        "processLimit",
        "stdout",
        "stdoutEncoding",
        "stdoutTruncated",
        "stderr",
        "stderrEncoding",
        "stderrTruncated",
        "failed",
        "hint",
    ),
    ResultForm.TOOL: (
        "exitCode",
        "signal",
        "errorCode",
        "stdout",
        "stderr",
        "stdoutTruncated",
        "stderrTruncated",
        "durationMs",
        "failed",
        "hint",
    ),
    ResultForm.AUDIT: (
        "memoryLimit",
        "processLimit",
        "exitCode",
        "signal",
        "errorCode",
        "stdoutBytes",
        "stderrBytes",
        "stdoutTruncated",
        "stderrTruncated",
    ),
    ResultForm.STREAMED_AUDIT: (
        "memoryLimit",
        "processLimit",
        "exitCode",
        "signal",
        "errorCode",
        "stdinBytes",
        "stdoutBytes",
        "stderrBytes",
    ),
    ResultForm.EXIT: ("exitCode", "signal"),
}


def exec_result_json(
    result: ExecResult, form: ResultForm, *, hint: str | None = None
) -> dict[str, Any]:
    """``result`` as a JSON object for ``form``'s reader: its :data:`RESULT_FIELDS`, in
    that order; the output decoded only as that reader takes it. ``hint``: why the
    sandbox made it fail, for the forms that carry one (:mod:`gatewayd.sandbox.hints`)."""
    facts: dict[str, Any] = {
        "failed": result.failed,
        "hint": hint,
        "exitCode": result.exitCode,
        "signal": result.signal,
        "durationMs": result.durationMs,
        "errorCode": None if result.errorCode is None else str(result.errorCode),
        "memoryLimit": str(result.memoryLimit),
        "processLimit": str(result.processLimit),
        # Counted only when passed through; a captured command's input is its caller's.
        "stdinBytes": None if result.streamed is None else result.streamed.stdin,
    }
    for name, data, truncated in (
        ("stdout", result.stdout, result.stdoutTruncated),
        ("stderr", result.stderr, result.stderrTruncated),
    ):
        facts[f"{name}Bytes"] = len(data)
        if result.streamed is not None:
            facts[f"{name}Bytes"] = getattr(result.streamed, name)
        facts[f"{name}Truncated"] = truncated
        if form is ResultForm.CONTROL:
            try:
                facts[name], facts[f"{name}Encoding"] = data.decode("utf-8"), "utf-8"
            except UnicodeDecodeError:
                facts[name], facts[f"{name}Encoding"] = base64.b64encode(data).decode(), "base64"
        elif form is ResultForm.TOOL:
            facts[name] = data.decode("utf-8", "replace")
    return {key: facts[key] for key in RESULT_FIELDS[form]}


def sandbox_argv(
    plan: SandboxPlan,
    *,
    bwrap: str,
    data_fds: dict[str, int],
    seccomp_fd: int,
    checks: CheckedPlans | None = None,
    block_fd: int | None = None,
) -> list[str]:
    """``render_argv`` with ``--seccomp FD`` added as the last bwrap option (before ``--``),
    and ``--block-fd FD`` before it when given: bwrap then builds the whole sandbox and
    waits for a byte on ``block_fd`` before it starts the command.

    Error handling: raises ``PlanError`` as ``render_argv`` does.
    """
    argv = render_argv(plan, bwrap=bwrap, data_fds=data_fds, checks=checks)
    end_of_options = len(argv) - len(plan.command) - 1
    if argv[end_of_options] != "--":
        raise LaunchError(
            "render_argv no longer ends with '--' followed by the command; the launcher "
            "inserts --seccomp just before that '--'"
        )
    options = ["--seccomp", str(seccomp_fd)]
    if block_fd is not None:
        options = ["--block-fd", str(block_fd), *options]
    return [*argv[:end_of_options], *options, *argv[end_of_options:]]


async def run_in_sandbox(
    plan: SandboxPlan,
    *,
    netns: Path,
    limits: SandboxLimits,
    host_user: HostUser,
    stdin: bytes | None = None,
    bwrap: str = BWRAP,
    cgroups: CgroupSupport | None = None,
    echo: Echo | None = None,
    pins: Sequence[tuple[int, str]] = (),
    passthrough: Passthrough | None = None,
    removals: DeferredRemovals | None = None,
    checks: CheckedPlans | None = None,
    gate: Gate | None = None,
) -> ExecResult:
    """Run ``plan.command`` in the sandbox the plan describes, inside network namespace
    ``netns``, as ``host_user``, within ``limits``; return its :class:`ExecResult`.

    Must be called in the trio thread (the parent-death signal is tied to the forking
    thread). ``stdin`` is written to the command and closed; None gives it /dev/null.
    ``cgroups`` (from :func:`~gatewayd.sandbox.cgroup.probe_cgroups`, once per daemon):
    where available, memory and process count are limited by the command's own cgroup
    and an OOM kill is reported as ``oom_killed``; None or unavailable keeps RLIMIT_AS
    and RLIMIT_NPROC. ``echo`` (stdout sink, stderr sink) is called with every chunk as it
    arrives, all of it, not only the kept part: `gatewayd run` shows a long command's
    progress this way. A sink must not block for long (the command waits meanwhile).
    ``pins`` are (descriptor, mount point): before dropping privileges the child makes
    itself a private mount namespace and attaches each pinned directory there, by its
    descriptor, so bwrap binds exactly the directories opened at run start
    (:attr:`~gatewayd.sandbox.plan.Bind.via`), whatever their paths have become.
    ``passthrough`` (instead of ``stdin`` and ``echo``) relays the command's stdin,
    stdout and stderr from and to host descriptors as they come, through pipes
    (:mod:`~gatewayd.sandbox.passthrough`): nothing is kept, no output cap applies, the
    result counts the bytes (``streamed``). After the command ends, what it wrote is
    still delivered to a slow host reader, until the command's timeout.
    ``removals``: the command's cgroup is handed to it once the command's tree is gone
    and its counters are read, and removed in the background (its owner waits for it
    before the run ends); None removes it before returning.
    ``checks``: how the plan is validated before the start (its owner's
    :class:`~gatewayd.sandbox.plan.CheckedPlans`; None: :func:`~gatewayd.sandbox.plan.validate`).
    ``gate``: awaited once bwrap is started, while it builds the sandbox; the command
    itself starts only after it returns (bwrap's ``--block-fd``). If it raises or is
    cancelled, the sandbox is killed before the command ever ran, and that exception is
    raised. The exec's write-ahead audit entry is made durable this way, in parallel
    with bwrap's own work instead of before it.

    Resource handling: the memfds and the netns descriptor are closed once bwrap runs; on
    timeout the tree gets SIGTERM, then SIGKILL after ``limits.kill_grace_s``; on
    cancellation it is killed at once under a shielded scope, so no process outlives the call.
    The command's cgroup is removed in every case, under a shielded scope (by
    ``removals`` when given).

    Error handling: ``PlanError`` if the plan does not validate, :class:`LaunchError` if the
    command's cgroup cannot be made, read or removed (the message names the file; with
    ``removals`` a failed removal is its to report), the
    netns cannot be opened or bwrap cannot be started. Anything the command does is a
    result, never an exception. ValueError if ``passthrough`` comes with ``stdin`` or
    ``echo`` (a stream has one source and one destination).
    """
    if passthrough is not None and (stdin is not None or echo is not None):
        raise ValueError("a passed-through command takes no stdin bytes and no echo")
    cgroup = _create_cgroup(plan.run_id, limits, cgroups)
    try:
        return await _start_and_supervise(
            plan,
            netns,
            limits,
            host_user,
            stdin,
            bwrap,
            cgroup,
            echo,
            pins,
            passthrough,
            checks,
            gate,
        )
    finally:
        if cgroup is not None and removals is not None:
            removals.remove_later(cgroup)
        elif cgroup is not None:
            with trio.CancelScope(shield=True):
                try:
                    await cgroup.remove()
                except CgroupError as exc:
                    raise LaunchError(f"run {plan.run_id}'s command cgroup: {exc}") from exc


def _create_cgroup(
    run_id: str, limits: SandboxLimits, cgroups: CgroupSupport | None
) -> CommandCgroup | None:
    if cgroups is None or not cgroups.available:
        return None
    try:
        return create_command_cgroup(
            cgroups,
            run_id=run_id,
            memory_bytes=limits.memory_bytes,
            max_processes=limits.max_processes,
        )
    except CgroupError as exc:
        raise LaunchError(f"cannot make run {run_id}'s command cgroup: {exc}") from exc


async def _start_and_supervise(
    plan: SandboxPlan,
    netns: Path,
    limits: SandboxLimits,
    host_user: HostUser,
    stdin: bytes | None,
    bwrap: str,
    cgroup: CommandCgroup | None,
    echo: Echo | None,
    pins: Sequence[tuple[int, str]],
    passthrough: Passthrough | None,
    checks: CheckedPlans | None,
    gate: Gate | None,
) -> ExecResult:
    release = _Release()
    with contextlib.ExitStack() as fds:
        data_fds = {step.dest: memfd(fds, "cogni-data", step.data) for step in plan.data_steps}
        seccomp_fd = memfd(fds, "cogni-seccomp", None)
        block_fd = None
        if gate is not None:
            block_fd, release.fd = _release_pipe()
            fds.callback(os.close, block_fd)  # bwrap's end: closed here once it runs
            fds.callback(release.close_unless_handed_on)
        argv = sandbox_argv(
            plan,
            bwrap=bwrap,
            data_fds=data_fds,
            seccomp_fd=seccomp_fd,
            checks=checks,
            block_fd=block_fd,
        )
        try:
            netns_fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise LaunchError(f"cannot open the run's network namespace {netns}: {exc}") from exc
        fds.callback(os.close, netns_fd)
        if passthrough is not None and not passthrough.relay:
            # The caller's own pipes become the command's streams: nothing to copy, and
            # the caller keeps (and closes) every end.
            out_r = err_r = in_w = -1
            in_r, out_w, err_w = passthrough.stdin, passthrough.stdout, passthrough.stderr
            child_ends = []
        else:
            out_r, out_w = os.pipe2(os.O_CLOEXEC)
            err_r, err_w = os.pipe2(os.O_CLOEXEC)
            piped = stdin is not None or passthrough is not None
            in_r, in_w = os.pipe2(os.O_CLOEXEC) if piped else (subprocess.DEVNULL, -1)
            child_ends = [fd for fd in (out_w, err_w, in_r) if fd >= 0]
        started = time.monotonic()
        try:
            process = start_launched(
                argv,
                netns_fd=netns_fd,
                user=host_user,
                joins=cgroup.join_files if cgroup is not None else (),
                pins=pins,
                limits=rlimits(
                    limits, memory=_memory_mechanism(cgroup), processes=_pids_mechanism(cgroup)
                ),
                pass_fds=(
                    *data_fds.values(),
                    seccomp_fd,
                    *([] if block_fd is None else [block_fd]),
                ),
                stdin=in_r,
                stdout=out_w,
                stderr=err_w,
            )
            release.handed_on = True
        except (LauncherFailed, OSError, subprocess.SubprocessError) as exc:
            for fd in (out_r, err_r, in_w):
                if fd >= 0:
                    os.close(fd)
            if isinstance(exc, LauncherFailed):
                why = f"could not {exc}"
            elif isinstance(exc, FileNotFoundError | PermissionError):
                why = launcher_missing(exc)
            else:  # out of descriptors or processes, say: the launcher is there
                why = f"could not start gatewayd's sandbox launcher: {exc}"
            raise LaunchError(f"cannot start {bwrap} for run {plan.run_id}: {why}") from exc
        finally:
            for fd in child_ends:
                with contextlib.suppress(OSError):
                    os.close(fd)
        # start_launched returns once the launcher has exec'd bwrap (or failed to): its
        # start, its steps (cgroup, netns, pins, uid) and the exec.
        METRICS.sandbox_launch.observe(time.monotonic() - started)
    return await _supervise(
        process,
        started,
        out_r,
        err_r,
        in_w,
        stdin,
        limits,
        cgroup,
        echo,
        passthrough,
        gate,
        release,
    )


def memfd(stack: contextlib.ExitStack, name: str, data: bytes | None) -> int:
    """A memfd holding ``data`` (None: the seccomp filter), rewound for bwrap, closed
    with ``stack``."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)  # pass_fds clears CLOEXEC in the child
    stack.callback(os.close, fd)
    if data is None:
        write_filter(fd)
    else:
        write_all(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)  # bwrap reads from the current offset to the end
    return fd


class LauncherFailed(Exception):
    """The launcher said which of its steps failed (``"STEP: [Errno N] REASON"``); nothing
    was started, and the launcher has been waited for."""


def launcher_argv(
    argv: Sequence[str],
    *,
    report_fd: int,
    netns_fd: int,
    user: HostUser,
    joins: Sequence[bytes] = (),
    pins: Sequence[tuple[int, str]] = (),
    limits: Sequence[tuple[int, int, int]] = (),
) -> list[str]:
    """The launcher's command line that runs ``argv`` (launcher.c's usage)."""
    line = [LAUNCHER, str(report_fd), str(netns_fd), str(user.uid), str(user.gid)]
    line += [str(len(joins)), *(os.fsdecode(join) for join in joins)]
    line.append(str(len(pins)))
    for fd, point in pins:
        line += [str(fd), point]
    line.append(str(len(limits)))
    for which, soft, hard in limits:
        line += [str(which), str(soft), str(hard)]
    return line + list(argv)


def start_launched(
    argv: Sequence[str],
    *,
    netns_fd: int,
    user: HostUser,
    joins: Sequence[bytes] = (),
    pins: Sequence[tuple[int, str]] = (),
    limits: Sequence[tuple[int, int, int]] = (),
    pass_fds: Sequence[int] = (),
    stdin: int | None = None,
    stdout: int | None = None,
    stderr: int | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` (bwrap) through the launcher: joined to the cgroups of ``joins``, in
    the network namespace of ``netns_fd`` (-1: this one), with ``pins`` attached, within
    ``limits`` (``(resource, soft, hard)``), as ``user``, in a new session, with an empty
    environment. Returns once ``argv`` runs. Blocking for the launcher's few system calls:
    call it from the trio thread (the parent-death signal is tied to the starting thread).

    Error handling: :class:`LauncherFailed` when a step failed (the launcher is reaped);
    ``OSError`` or ``SubprocessError`` when the launcher itself cannot be run."""
    report_r, report_w = os.pipe2(os.O_CLOEXEC)
    try:
        given = [report_w, *pass_fds, *(fd for fd, _ in pins)]
        if netns_fd >= 0:
            given.append(netns_fd)
        process = subprocess.Popen(
            launcher_argv(
                argv,
                report_fd=report_w,
                netns_fd=netns_fd,
                user=user,
                joins=joins,
                pins=pins,
                limits=limits,
            ),
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            env={},  # bwrap's own environment: nothing of the daemon's (invariant 4)
            pass_fds=given,
            start_new_session=True,
        )
        os.close(report_w)
        report_w = -1
        # End of file: bwrap runs (the pipe is close-on-exec there); else the step's line.
        report = os.read(report_r, LAUNCHER_REPORT_BYTES)
    finally:
        os.close(report_r)
        if report_w >= 0:
            os.close(report_w)
    if report:
        process.wait()
        raise LauncherFailed(report.decode(errors="replace").strip())
    return process


def launcher_runnable() -> bool:
    """Whether the launcher is there to run (the start-up probe asks)."""
    return os.access(LAUNCHER, os.X_OK)


def launcher_missing(exc: BaseException | str) -> str:
    """What to say when the launcher itself cannot be run."""
    return (
        f"gatewayd's sandbox launcher {LAUNCHER} cannot be run ({exc}); `make setup` builds "
        "it in a checkout, `make install` in an installed gatewayd"
    )


def _memory_mechanism(cgroup: CommandCgroup | None) -> LimitMechanism:
    return LimitMechanism.RLIMIT if cgroup is None else LimitMechanism.CGROUP


def _pids_mechanism(cgroup: CommandCgroup | None) -> LimitMechanism:
    if cgroup is None or cgroup.pids_dir is None:
        return LimitMechanism.RLIMIT
    return LimitMechanism.CGROUP


async def _supervise(
    process: subprocess.Popen[bytes],
    started: float,
    out_r: int,
    err_r: int,
    in_w: int,
    stdin: bytes | None,
    limits: SandboxLimits,
    cgroup: CommandCgroup | None,
    echo: Echo | None,
    passthrough: Passthrough | None,
    gate: Gate | None,
    release: _Release,
) -> ExecResult:
    stdout = _Capture(limits.max_output_bytes, None if echo is None else echo[0])
    stderr = _Capture(limits.max_output_bytes, None if echo is None else echo[1])
    relays = (Relay(), Relay(), Relay())  # stdin, stdout, stderr; used when passed through
    timed_out = False
    try:
        pidfd = os.pidfd_open(process.pid)
    except BaseException:
        _kill_unsupervised(process)
        release.close()
        _close_unless_negative(out_r, err_r, in_w)
        raise
    drained = False  # the drains own (and close) out_r, err_r and in_w from then on
    try:
        if gate is not None:
            # bwrap builds the sandbox meanwhile (its output waits in the pipes); if this
            # raises, the finally below kills it before its command ever ran.
            await gate()
            release.go()
        drained = True
        async with trio.open_nursery() as nursery:
            outputs: tuple[trio.Event, ...]
            if passthrough is None:
                nursery.start_soon(stdout.drain, trio.lowlevel.FdStream(out_r))
                nursery.start_soon(stderr.drain, trio.lowlevel.FdStream(err_r))
                outputs = (stdout.done, stderr.done)
            elif not passthrough.relay:
                outputs = ()  # the caller reads the command's output itself
            else:
                feed, out, err = relays
                nursery.start_soon(feed.feed, passthrough.stdin, trio.lowlevel.FdStream(in_w))
                nursery.start_soon(out.drain, trio.lowlevel.FdStream(out_r), passthrough.stdout)
                nursery.start_soon(err.drain, trio.lowlevel.FdStream(err_r), passthrough.stderr)
                outputs = (out.done, err.done)
            if stdin is not None:
                nursery.start_soon(_feed, trio.lowlevel.FdStream(in_w), stdin)
            with trio.move_on_after(limits.timeout_s) as deadline:
                await trio.lowlevel.wait_readable(pidfd)
            if deadline.cancelled_caught:
                timed_out = True
                with trio.CancelScope(shield=True):
                    await _terminate_tree(process, pidfd, limits.kill_grace_s)
            with trio.move_on_after(_drain_time(deadline, passthrough)):
                for done in outputs:
                    await done.wait()
            nursery.cancel_scope.cancel()
    finally:
        # Cancelled from outside (or a bug): nothing may outlive the call.
        with trio.CancelScope(shield=True):
            if process.poll() is None:
                await _kill_now(process, pidfd)
            process.wait()
            os.close(pidfd)
            # Only now, nothing of the sandbox left: bwrap reads end of file as the
            # go-ahead (it holds a writer of its own too; closing last costs nothing).
            release.close()
            if not drained:
                _close_unless_negative(out_r, err_r, in_w)
    try:
        # Read once the tree is reaped: every kill the kernel made is counted by then.
        oom_killed = cgroup is not None and cgroup.oom_killed()
    except CgroupError as exc:
        raise LaunchError(f"cannot tell whether the command was OOM-killed: {exc}") from exc
    pids_hit = None if cgroup is None else cgroup.pids_limit_hit()
    reading = classify_exit(process.returncode, timed_out=timed_out, oom_killed=oom_killed)
    return ExecResult(
        exitCode=reading.exit_code,
        signal=reading.signal,
        stdout=bytes(stdout.data),
        stderr=bytes(stderr.data),
        stdoutTruncated=stdout.truncated,
        stderrTruncated=stderr.truncated,
        durationMs=round((time.monotonic() - started) * 1000),
        errorCode=reading.error,
        memoryLimit=_memory_mechanism(cgroup),
        processLimit=_pids_mechanism(cgroup),
        streamed=None
        if passthrough is None or not passthrough.relay
        else StreamedBytes(stdin=relays[0].count, stdout=relays[1].count, stderr=relays[2].count),
        processLimitHit=pids_hit,
    )


def _close_unless_negative(*fds: int) -> None:
    for fd in fds:
        if fd >= 0:
            os.close(fd)


def _kill_unsupervised(process: subprocess.Popen[bytes]) -> None:
    """:func:`_kill_now` without a pidfd (it could not be opened), blocking: bwrap stopped,
    its children (the sandbox's init: no parent-death signal before its setup ends)
    killed, then bwrap, and reaped."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, signal.SIGSTOP)
    deadline = time.monotonic() + TREE_GONE_WAIT_S
    while _state(process.pid) not in _STOPPED_OR_GONE and time.monotonic() < deadline:
        time.sleep(STOP_POLL_S)
    for pid in _children(process.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, signal.SIGKILL)
    process.wait()


def _drain_time(deadline: trio.CancelScope, passthrough: Passthrough | None) -> float:
    """How long to wait, once the command is gone, for its output to be read to the end.
    Captured output is read at once (:data:`DRAIN_AFTER_EXIT_S`); passed-through output
    also waits for the host's reader to take it, as long as the command's time lasts."""
    if passthrough is None:
        return DRAIN_AFTER_EXIT_S
    return max(DRAIN_AFTER_EXIT_S, deadline.deadline - trio.current_time())


class _Capture:
    """Keeps the first ``cap`` bytes of a pipe and reads (and drops) the rest to its end,
    so the command never blocks on a full pipe."""

    def __init__(self, cap: int, sink: Callable[[bytes], None] | None = None) -> None:
        self.cap = cap
        self.sink = sink
        self.data = bytearray()
        self.truncated = False
        self.done = trio.Event()

    async def drain(self, stream: trio.lowlevel.FdStream) -> None:
        async with stream:
            try:
                while chunk := await stream.receive_some(READ_CHUNK):
                    if self.sink is not None:
                        self.sink(chunk)
                    room = self.cap - len(self.data)
                    if len(chunk) > room:
                        self.truncated = True
                    self.data += chunk[: max(room, 0)]
            finally:
                self.done.set()


async def _feed(stream: trio.lowlevel.FdStream, data: bytes) -> None:
    async with stream:
        # The command may exit without reading its input; that is its business.
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.send_all(data)


async def _terminate_tree(process: subprocess.Popen[bytes], pidfd: int, grace_s: float) -> None:
    """SIGTERM every process in the sandbox but its init, wait ``grace_s`` for the command to
    end (its init then ends the namespace), then kill the init (:func:`_kill_now`): killing
    a pid namespace's init kills every process in it."""
    namespaces = _namespaces_of(process.pid)
    _term_tree(process.pid)
    with trio.move_on_after(grace_s):
        await trio.lowlevel.wait_readable(pidfd)
    if process.poll() is None:
        await _kill_now(process, pidfd)
    await _until_gone(namespaces)


async def _kill_now(process: subprocess.Popen[bytes], pidfd: int) -> None:
    """SIGKILL the sandbox's init (so every process of the sandbox), let bwrap reap it and
    exit, and return once they are gone.

    bwrap is stopped first and its children listed only once it is: killed between its
    clone() and its child's own PR_SET_PDEATHSIG (``--die-with-parent``), bwrap would
    leave that child running as an orphan, missing from a listing made a moment before.
    A stopped bwrap clones nothing more (a clone under way completes first, so its child
    is listed). Once its init is killed bwrap is let go on rather than killed: it reaps the
    init and exits. Killed with it, bwrap would leave the init's zombie to the host's PID 1,
    and a PID 1 that reaps late (a container's init) keeps that zombie charged against the
    sandbox uid's process limit, so the uid's next sandboxes fail to start."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, signal.SIGSTOP)
    with trio.move_on_after(TREE_GONE_WAIT_S):
        while _state(process.pid) not in _STOPPED_OR_GONE:
            await trio.sleep(STOP_POLL_S)
    inits = list(_children(process.pid))
    namespaces = {ns for ns in map(_pid_namespace, inits) if ns is not None}
    for pid in inits:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    reaped = False
    if inits:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGCONT)
        with trio.move_on_after(TREE_GONE_WAIT_S):
            await trio.lowlevel.wait_readable(pidfd)
            reaped = True
    if not reaped:  # no child yet (nothing to leave behind), or bwrap did not end in time
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
        await trio.lowlevel.wait_readable(pidfd)
    await _until_gone(namespaces)


def _state(pid: int) -> bytes | None:
    """The state letter of ``pid`` in /proc/PID/stat (None: no such process)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _namespaces_of(bwrap_pid: int) -> set[tuple[int, int]]:
    """The pid namespace(s) of the sandbox bwrap ``bwrap_pid`` started."""
    return {ns for ns in map(_pid_namespace, _children(bwrap_pid)) if ns is not None}


async def _until_gone(namespaces: set[tuple[int, int]]) -> None:
    """SIGKILL takes effect asynchronously: return once no process of ``namespaces`` is
    left running (bounded), so a result or a cancellation means the tree is gone."""
    with trio.move_on_after(TREE_GONE_WAIT_S):
        while namespaces and any(_pid_namespace(pid) in namespaces for pid in _running_pids()):
            await trio.sleep(EXIT_POLL_S)


def _term_tree(bwrap_pid: int) -> None:
    """SIGTERM every process in the sandbox's pid namespace except its init (so the
    command sees it and the init reaps it)."""
    inits = list(_children(bwrap_pid))
    namespaces = {_pid_namespace(pid) for pid in inits} - {None}
    for pid in _all_pids():
        if pid not in inits and _pid_namespace(pid) in namespaces:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)


def _running_pids() -> Iterator[int]:
    """Every pid that is not a zombie (a zombie runs nothing; its parent reaps it)."""
    for pid in _all_pids():
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                state = stat.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in (b"Z", b"X"):
            yield pid


def _all_pids() -> Iterator[int]:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            yield int(entry)


def _children(parent: int) -> Iterator[int]:
    """Processes whose parent is ``parent`` (this kernel has no /proc/PID/task/TID/children)."""
    for pid in _all_pids():
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue  # it ended while we looked
        if int(fields[1]) == parent:
            yield pid


def _pid_namespace(pid: int) -> tuple[int, int] | None:
    try:
        info = os.stat(f"/proc/{pid}/ns/pid")
    except OSError:
        return None
    return (info.st_dev, info.st_ino)
