"""What one sandboxed command may use, and how its end is read: pure values and decisions.

The launcher (``launch.py``) applies :class:`SandboxLimits` as rlimits in the child before it
execs bwrap, or, where the host offers cgroups (``cgroup.py``), memory and process count as
the command's cgroup limits instead of RLIMIT_AS and RLIMIT_NPROC; it enforces the wall clock
itself. :func:`classify_exit` turns what it saw into the result's exit code, signal and error
code. Nothing here touches a process.

RLIMIT_NPROC counts every process of a *real uid* on the whole host (per user namespace
since Linux 5.14, checked up the chain to the host's), not per sandbox. Runs that share a
host uid share one process budget, so each concurrent run should get its own
:class:`HostUser` (a uid nobody else uses) from the caller. A pids cgroup, where there is
one, counts per command instead and replaces it.
"""

from __future__ import annotations

import enum
import resource
import signal
from dataclasses import dataclass
from typing import Final

# Defaults: enough for a build or a test suite, small enough that a runaway run cannot
# starve the host. The policy may lower them; the caller passes the values.
DEFAULT_TIMEOUT_S: Final = 600.0  # wall clock of one command
DEFAULT_CPU_S: Final = 300  # CPU seconds (RLIMIT_CPU), all of the command's own time
# Memory of the whole command (cgroup, swap included), else address space per process
# (RLIMIT_AS).
DEFAULT_MEMORY_BYTES: Final = 4 * 1024**3
# Tasks of the command (pids cgroup), else of the host uid (RLIMIT_NPROC); threads count.
DEFAULT_MAX_PROCESSES: Final = 256
DEFAULT_MAX_FILE_BYTES: Final = 1024**3  # largest file it may write (RLIMIT_FSIZE)
DEFAULT_MAX_OPEN_FILES: Final = 1024  # descriptors per process (RLIMIT_NOFILE)
DEFAULT_MAX_OUTPUT_BYTES: Final = 1024**2  # kept of stdout and of stderr, each
# SIGTERM first so the command can flush and clean up; then SIGKILL. Short, because a
# run that is already over its time has no claim to more.
DEFAULT_KILL_GRACE_S: Final = 5.0
# Slack between the soft CPU limit (SIGXCPU, which we report as limit_exceeded) and the
# hard one (SIGKILL by the kernel) for a command that catches SIGXCPU.
CPU_HARD_SLACK_S: Final = 1
# bwrap itself needs a few descriptors (its setup fds, the seccomp and data memfds) and a
# few MiB of address space before the command runs; below these it fails to start at all.
MIN_OPEN_FILES: Final = 16
MIN_MEMORY_BYTES: Final = 64 * 1024**2
# bwrap's monitor, the namespace's init and the command are three processes already.
MIN_PROCESSES: Final = 4
# Linux uids and gids are 32-bit; (uid_t)-1 means "unchanged" to set*id, so it is excluded.
MAX_ID: Final = 2**32 - 2
# bwrap reports a command killed by signal N as exit status 128 + N (the shell convention).
SIGNAL_EXIT_BASE: Final = 128
_MAX_SIGNAL: Final = 64  # SIGRTMAX on Linux


class ErrorKind(enum.StrEnum):
    """Why a command ended abnormally, as it appears in the result's ``errorCode``."""

    TIMEOUT = "timeout"  # the wall clock ran out; the tree was terminated
    OOM_KILLED = "oom_killed"  # the kernel OOM-killed a process at the cgroup memory limit
    LIMIT_EXCEEDED = "limit_exceeded"  # the kernel ended it for a CPU or file-size rlimit


class LimitMechanism(enum.StrEnum):
    """How a limit was applied to a command, as the result reports it for the audit."""

    CGROUP = "cgroup"  # the command's own cgroup: counts every process of it together
    RLIMIT = "rlimit"  # RLIMIT_AS per process, RLIMIT_NPROC per host uid


@dataclass(frozen=True, slots=True, kw_only=True)
class HostUser:
    """The unprivileged host uid/gid the sandbox runs as (never 0: bwrap started as root
    maps the sandbox user to host root). Give each concurrent run its own uid, since
    RLIMIT_NPROC is counted per host uid."""

    uid: int
    gid: int

    def __post_init__(self) -> None:
        for name, value in (("uid", self.uid), ("gid", self.gid)):
            if not isinstance(value, int) or not 1 <= value <= MAX_ID:
                raise ValueError(
                    f"host {name} {value!r} is not allowed: use an unprivileged id from 1 to "
                    f"{MAX_ID} (0 is root on the host), e.g. 65534 or one uid per run"
                )


@dataclass(frozen=True, slots=True, kw_only=True)
class SandboxLimits:
    """The limits of one sandboxed command. ``memory_bytes`` and ``max_processes`` are the
    command cgroup's limits where the host offers cgroups, else RLIMIT_AS (per process) and
    RLIMIT_NPROC (per host uid)."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    cpu_s: int = DEFAULT_CPU_S
    memory_bytes: int = DEFAULT_MEMORY_BYTES
    max_processes: int = DEFAULT_MAX_PROCESSES
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    max_open_files: int = DEFAULT_MAX_OPEN_FILES
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES
    kill_grace_s: float = DEFAULT_KILL_GRACE_S

    def __post_init__(self) -> None:
        floors: tuple[tuple[str, float, float], ...] = (
            ("timeout_s", self.timeout_s, 0),
            ("cpu_s", self.cpu_s, 1),
            ("memory_bytes", self.memory_bytes, MIN_MEMORY_BYTES),
            ("max_processes", self.max_processes, MIN_PROCESSES),
            ("max_file_bytes", self.max_file_bytes, 0),
            ("max_open_files", self.max_open_files, MIN_OPEN_FILES),
            ("max_output_bytes", self.max_output_bytes, 0),
            ("kill_grace_s", self.kill_grace_s, 0),
        )
        for name, value, floor in floors:
            if isinstance(value, bool) or not isinstance(value, int | float) or value < floor:
                raise ValueError(
                    f"limit {name}={value!r} is not allowed: it must be a number of at least "
                    f"{floor} (bwrap and the sandbox's init need that much to start)"
                )
        if self.timeout_s <= 0:
            raise ValueError(f"limit timeout_s={self.timeout_s!r} must be more than 0 seconds")


def rlimits(
    limits: SandboxLimits,
    *,
    memory: LimitMechanism = LimitMechanism.RLIMIT,
    processes: LimitMechanism = LimitMechanism.RLIMIT,
) -> tuple[tuple[int, int, int], ...]:
    """``(resource, soft, hard)`` for ``setrlimit`` in the child, in the order applied.

    A limit the command's cgroup enforces (``memory`` or ``processes`` is ``CGROUP``) gets
    no rlimit: RLIMIT_AS would fail allocations before the cgroup's OOM killer could say
    what happened, and RLIMIT_NPROC would share one budget among every run of a host uid.
    """
    table = [
        (resource.RLIMIT_NPROC, limits.max_processes, limits.max_processes),
        (resource.RLIMIT_CPU, limits.cpu_s, limits.cpu_s + CPU_HARD_SLACK_S),
        (resource.RLIMIT_FSIZE, limits.max_file_bytes, limits.max_file_bytes),
        (resource.RLIMIT_NOFILE, limits.max_open_files, limits.max_open_files),
        (resource.RLIMIT_AS, limits.memory_bytes, limits.memory_bytes),
        # No core files: they would land in the workspace and may hold secrets in memory.
        (resource.RLIMIT_CORE, 0, 0),
    ]
    dropped = set()
    if processes == LimitMechanism.CGROUP:
        dropped.add(resource.RLIMIT_NPROC)
    if memory == LimitMechanism.CGROUP:
        dropped.add(resource.RLIMIT_AS)
    return tuple(entry for entry in table if entry[0] not in dropped)


@dataclass(frozen=True, slots=True, kw_only=True)
class ExitReading:
    """How a command ended, as read from bwrap's wait status."""

    exit_code: int | None
    signal: int | None
    error: ErrorKind | None


# Signals the kernel sends for an exceeded rlimit: only these say "a limit ended it".
_LIMIT_SIGNALS: Final = frozenset({signal.SIGXCPU, signal.SIGXFSZ})


def classify_exit(returncode: int, *, timed_out: bool, oom_killed: bool = False) -> ExitReading:
    """Read bwrap's ``returncode`` (Popen convention: negative is "killed by signal").

    bwrap exits with the command's status, or 128+N when the command was killed by signal
    N; both cases (and bwrap itself killed) give ``signal=N`` with no exit code. A command
    that *exits* with 129..192 on its own reads the same way: bwrap does not tell them apart.
    ``limit_exceeded`` only for SIGXCPU / SIGXFSZ, which the kernel sends for RLIMIT_CPU and
    RLIMIT_FSIZE alone; a failed allocation (RLIMIT_AS) or fork (RLIMIT_NPROC) is an error
    the program itself handles, so it shows as its own exit code, never a guessed code.

    ``oom_killed`` is the command cgroup's word that the kernel OOM-killed a process in it.
    Precedence: ``timeout`` (our clock ended it, whatever else happened on the way), then
    ``oom_killed``, then ``limit_exceeded``.
    """
    if returncode < 0:
        exit_code, sig = None, -returncode
    elif SIGNAL_EXIT_BASE < returncode <= SIGNAL_EXIT_BASE + _MAX_SIGNAL:
        exit_code, sig = None, returncode - SIGNAL_EXIT_BASE
    else:
        exit_code, sig = returncode, None
    error: ErrorKind | None = None
    if timed_out:
        error = ErrorKind.TIMEOUT
    elif oom_killed:
        error = ErrorKind.OOM_KILLED
    elif sig in _LIMIT_SIGNALS:
        error = ErrorKind.LIMIT_EXCEEDED
    return ExitReading(exit_code=exit_code, signal=sig, error=error)
