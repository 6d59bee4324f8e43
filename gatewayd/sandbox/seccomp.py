"""The seccomp filter handed to bubblewrap (``bwrap --seccomp FD``): a denylist of system calls.

Two layers, like pynacl: :class:`_Libseccomp` is a thin ctypes binding of the five libseccomp
functions we need (no policy in it), and :func:`build_filter` is the recipe on top: default
ALLOW, each call in :data:`DENIED_SYSCALLS` answered with an errno, exported as the classic-BPF
program bwrap loads (the bytes ``seccomp_export_bpf`` writes: ``struct sock_filter`` records of
8 bytes each). bwrap installs it after ``PR_SET_NO_NEW_PRIVS``, just before exec'ing the
command, so it binds the command and everything it starts.

Threat model of this layer: the process in the sandbox is hostile and holds no capability; the
filter removes the kernel interfaces that are the usual first step of a namespace escape or a
kernel exploit (ptrace, mount, namespaces, keyrings, BPF, perf, io_uring, userfaultfd, module
and kexec loading) so that a bug behind them is out of reach. It is a denylist on purpose (it
refuses at least these): an allowlist breaks arbitrary tools in ways that are hard to
diagnose. The table below is the one source of truth; ``docs/sandbox.md#seccomp`` holds its
rendering (:func:`render_markdown_table`) and a test keeps the two equal.

Architecture: the filter holds the native architecture only (x86_64 here). A system call made
through another ABI of the same CPU (i386 via ``int 0x80``, x32) is not matched by the table;
libseccomp's default action for a foreign architecture kills the calling thread, so such a
call can never slip past the denylist.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from gatewayd.errors import GatewayError
from gatewayd.files import write_all

# The shared object of libseccomp 2.x; Debian's package `libseccomp2` ships it (bubblewrap
# itself does not need it, so a host with bwrap may still lack it).
LIBSECCOMP_SONAME: Final = "libseccomp.so.2"
LIBSECCOMP_PACKAGE: Final = "libseccomp2"

# Actions (seccomp.h). The filter's default: anything not in the table runs.
SCMP_ACT_ALLOW: Final = 0x7FFF0000
_SCMP_ACT_ERRNO_BASE: Final = 0x00050000
# enum scmp_compare (seccomp.h)
SCMP_CMP_MASKED_EQ: Final = 7

# One classic-BPF instruction, struct sock_filter {u16 code; u8 jt; u8 jf; u32 k;}.
SOCK_FILTER_SIZE: Final = 8
# The kernel refuses a program longer than BPF_MAXINSNS instructions.
BPF_MAXINSNS: Final = 4096

# clone(2)'s namespace flags (linux/sched.h). CLONE_NEWTIME (0x80) is absent on purpose:
# clone() reads that bit as part of the exit signal, so only unshare/clone3 can ask for a time
# namespace, and both are refused whole.
CLONE_NEWNS: Final = 0x00020000
CLONE_NEWCGROUP: Final = 0x02000000
CLONE_NEWUTS: Final = 0x04000000
CLONE_NEWIPC: Final = 0x08000000
CLONE_NEWUSER: Final = 0x10000000
CLONE_NEWPID: Final = 0x20000000
CLONE_NEWNET: Final = 0x40000000
CLONE_NAMESPACE_FLAGS: Final[tuple[int, ...]] = (
    CLONE_NEWNS,
    CLONE_NEWCGROUP,
    CLONE_NEWUTS,
    CLONE_NEWIPC,
    CLONE_NEWUSER,
    CLONE_NEWPID,
    CLONE_NEWNET,
)

# personality(2): the kernel reads a 32-bit argument, and 0xffffffff is the query that returns
# the current persona without changing it; PER_LINUX (0) is the default persona. Those two stay
# allowed; every other value is refused: ADDR_NO_RANDOMIZE turns ASLR off for what the process
# execs next, READ_IMPLIES_EXEC makes readable memory executable, MMAP_PAGE_ZERO maps page 0.
# (PER_LINUX32 is refused too: i386 system calls are outside the filter's architecture anyway.)
PER_LINUX: Final = 0x00000000
PERSONALITY_QUERY: Final = 0xFFFFFFFF
PERSONALITY_ALLOWED: Final[tuple[int, ...]] = (PER_LINUX, PERSONALITY_QUERY)
_WORD_BITS: Final = 32

# <linux/stat.h>: the bits that make an executable run as its owner or group.
S_ISUID: Final = 0o4000
S_ISGID: Final = 0o2000
SUID_SGID_BITS: Final[tuple[int, ...]] = (S_ISUID, S_ISGID)
SUID_REASON: Final = "would make a set-user/group-ID file in a host directory (the workspace)"
# Every call that sets a file's mode, with the position of its mode argument (x86_64).
SUID_MODE_ARGS: Final[tuple[tuple[str, int], ...]] = (
    ("chmod", 1),
    ("fchmod", 1),
    ("fchmodat", 2),
    ("fchmodat2", 2),
    ("creat", 1),
    ("open", 2),
    ("openat", 3),
    ("mkdir", 1),
    ("mkdirat", 2),
)
# The calls that make special files: refused for setuid and setgid like the rest, and
# for FIFOs. A FIFO left in a host directory blocks whoever opens it there, on the host,
# until a writer comes: wasmtime opens a wasm tool's files with a blocking open(2) that
# no deadline reaches, and backup or indexing tools block the same way. Sockets and
# devices need no row: opening a socket file fails at once (ENXIO), and making a device
# needs CAP_MKNOD, which the sandbox lacks.
MKNOD_MODE_ARGS: Final[tuple[tuple[str, int], ...]] = (("mknod", 1), ("mknodat", 2))
# <linux/stat.h>: the file-type bits of a mode, and the type of a FIFO.
S_IFMT: Final = 0o170000
S_IFIFO: Final = 0o010000
MKNOD_REASON: Final = (
    f"{SUID_REASON}; or would leave a FIFO in a host directory, where an open on the host "
    "(a wasm tool's, a backup's) blocks until a writer comes"
)


def _any_bit_of(flags: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Argument tests (mask, value) matching a value that holds any of ``flags``."""
    return tuple((flag, flag) for flag in flags)


def _neither_all_zeros_nor_all_ones() -> tuple[tuple[int, int], ...]:
    """Argument tests matching every 32-bit value except 0 and 0xffffffff.

    libseccomp takes one comparison per argument per rule (rules are OR-ed), so "not 0 and not
    0xffffffff" is written as: some bit j is 0 while its cyclic neighbour j+1 is 1. Every
    32-bit word that is not constant has such a 0->1 step; 0 and 0xffffffff have none. The
    masks cover the low 32 bits only, which is all the kernel reads.
    """
    tests = []
    for low in range(_WORD_BITS):
        high = (low + 1) % _WORD_BITS
        tests.append(((1 << low) | (1 << high), 1 << high))
    return tuple(tests)


class SeccompError(GatewayError):
    """The seccomp filter could not be built (libseccomp missing or refusing a rule); a host
    setup fault, never the sandbox's. No sandbox may start without the filter."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DeniedSyscall:
    """One row of the denylist: ``name`` answers ``errno``; ``when`` says in words which
    calls, ``arg_tests`` on argument ``arg_index`` in (mask, value) pairs: refused if
    ``arg & mask == value`` for any pair, or always when there are none. ``arch_specific``
    names exist only on some architectures and are skipped where the kernel has no such
    call."""

    name: str
    reason: str
    errno: int = errno.EPERM
    when: str = "always"
    arg_tests: tuple[tuple[int, int], ...] = ()
    arg_index: int = 0
    arch_specific: bool = False

    def __post_init__(self) -> None:
        if not self.name or not self.reason.strip():
            raise SeccompError(f"denylist entry {self.name!r} needs a name and a reason")
        # errno 0 would make a refused call look successful without running it.
        if self.errno <= 0 or self.errno not in errno.errorcode:
            raise SeccompError(
                f"denylist entry {self.name!r} answers errno {self.errno}; use a positive "
                "errno such as EPERM or ENOSYS"
            )

    def refuses(self, arg: int) -> bool:
        """Whether a call whose argument ``arg_index`` is ``arg`` is refused (the rule, in
        Python)."""
        return not self.arg_tests or any(arg & mask == value for mask, value in self.arg_tests)


DENIED_SYSCALLS: Final[tuple[DeniedSyscall, ...]] = (
    # --- debugging other processes
    DeniedSyscall(
        name="ptrace",
        reason="reads and rewrites other processes' memory and registers; on old kernels "
        "it also bypasses seccomp itself",
    ),
    DeniedSyscall(
        name="process_vm_readv",
        reason="reads another process's memory without attaching: ptrace's power, no ptrace",
    ),
    DeniedSyscall(
        name="process_vm_writev",
        reason="writes another process's memory without attaching: ptrace's power, no ptrace",
    ),
    DeniedSyscall(
        name="pidfd_getfd",
        reason="copies a file descriptor out of another process (ptrace access check only)",
    ),
    # --- the mount table and the root
    DeniedSyscall(name="mount", reason="rearranging mounts is how a sandbox's view is undone"),
    DeniedSyscall(name="umount2", reason="unmounting can uncover what a mount hides"),
    DeniedSyscall(name="pivot_root", reason="changes the root of the mount namespace"),
    DeniedSyscall(
        name="chroot",
        reason="nothing in a run needs a new root; with a capability it is the classic "
        "chroot escape",
    ),
    DeniedSyscall(name="fsopen", reason="new mount API: same power as mount"),
    DeniedSyscall(name="fsconfig", reason="new mount API: same power as mount"),
    DeniedSyscall(name="fsmount", reason="new mount API: same power as mount"),
    DeniedSyscall(name="fspick", reason="new mount API: reconfigures an existing mount"),
    DeniedSyscall(name="move_mount", reason="new mount API: attaches a mount anywhere"),
    DeniedSyscall(name="open_tree", reason="new mount API: clones a mount tree"),
    DeniedSyscall(name="mount_setattr", reason="changes mount flags (e.g. read-only off)"),
    # --- namespaces: a fresh user namespace grants every capability inside it, the usual
    #     first step of a kernel exploit
    DeniedSyscall(name="unshare", reason="creates namespaces (a user namespace grants caps)"),
    DeniedSyscall(name="setns", reason="joins another namespace given a descriptor to it"),
    DeniedSyscall(
        name="clone",
        reason="creates namespaces like unshare; plain fork and threads stay allowed",
        when="flags hold any CLONE_NEW* bit",
        arg_tests=_any_bit_of(CLONE_NAMESPACE_FLAGS),
    ),
    DeniedSyscall(
        name="clone3",
        reason="its flags sit in memory, out of seccomp's reach; ENOSYS makes glibc (2.34+) "
        "fall back to clone, which is filtered by flags; EPERM would fail every thread",
        errno=errno.ENOSYS,
    ),
    # --- kernel keyrings: not namespaced, a long line of kernel bugs
    DeniedSyscall(name="keyctl", reason="kernel keyrings: not namespaced, shared with host"),
    DeniedSyscall(name="add_key", reason="kernel keyrings: not namespaced, shared with host"),
    DeniedSyscall(name="request_key", reason="kernel keyrings; can call out to host helpers"),
    # --- in-kernel programs and profiling
    DeniedSyscall(name="bpf", reason="loads programs into the kernel; verifier bugs are exploits"),
    DeniedSyscall(
        name="perf_event_open",
        reason="kernel profiling: leaks kernel addresses, a long line of kernel bugs",
    ),
    DeniedSyscall(name="lookup_dcookie", reason="kernel profiling (oprofile); not namespaced"),
    # --- the running kernel itself
    DeniedSyscall(name="kexec_load", reason="replaces the running kernel"),
    DeniedSyscall(name="kexec_file_load", reason="replaces the running kernel"),
    DeniedSyscall(name="init_module", reason="loads code into the kernel"),
    DeniedSyscall(name="finit_module", reason="loads code into the kernel"),
    DeniedSyscall(name="delete_module", reason="unloads kernel code"),
    # --- io_uring: ENOSYS, the answer of a kernel built without it, which every io_uring user
    #     (liburing, libuv, tokio, glib) already handles by falling back to epoll/threads
    DeniedSyscall(
        name="io_uring_setup",
        reason="io_uring runs I/O outside seccomp's view; a long line of kernel bugs",
        errno=errno.ENOSYS,
    ),
    DeniedSyscall(
        name="io_uring_enter", reason="io_uring (see io_uring_setup)", errno=errno.ENOSYS
    ),
    DeniedSyscall(
        name="io_uring_register", reason="io_uring (see io_uring_setup)", errno=errno.ENOSYS
    ),
    # --- exploitation helpers
    DeniedSyscall(
        name="userfaultfd",
        reason="pauses the kernel mid-copy on a page fault: the race-window tool of exploits",
    ),
    DeniedSyscall(
        name="personality",
        reason="other personas turn ASLR off or make memory executable",
        when="argument is neither 0 (PER_LINUX) nor 0xffffffff (query)",
        arg_tests=_neither_all_zeros_nor_all_ones(),
    ),
    DeniedSyscall(
        name="modify_ldt",
        reason="16-bit segments (Wine, dosemu); several kernel bugs",
        arch_specific=True,
    ),
    DeniedSyscall(name="uselib", reason="obsolete a.out loader; past exploits", arch_specific=True),
    # --- file handles: bypass the mount view
    DeniedSyscall(
        name="open_by_handle_at",
        reason="opens any inode of a mounted filesystem by handle, past the bind mounts "
        "(the 'shocker' container escape)",
    ),
    DeniedSyscall(name="name_to_handle_at", reason="makes handles for open_by_handle_at"),
    # --- host-wide state that no namespace covers
    DeniedSyscall(name="acct", reason="process accounting is host-wide"),
    DeniedSyscall(name="swapon", reason="swap is host-wide"),
    DeniedSyscall(name="swapoff", reason="swap is host-wide"),
    DeniedSyscall(name="reboot", reason="no run reboots anything"),
    DeniedSyscall(name="settimeofday", reason="the wall clock is host-wide"),
    DeniedSyscall(name="clock_settime", reason="the wall clock is host-wide"),
    DeniedSyscall(name="quotactl", reason="filesystem quotas are host-wide"),
    DeniedSyscall(name="quotactl_fd", reason="filesystem quotas are host-wide"),
    DeniedSyscall(
        name="syslog",
        reason="the kernel log holds kernel addresses (defeats KASLR) and host events",
    ),
    DeniedSyscall(
        name="fanotify_init",
        reason="whole-filesystem event watching; inotify covers what tools need",
    ),
    DeniedSyscall(name="iopl", reason="raw I/O port access", arch_specific=True),
    DeniedSyscall(name="ioperm", reason="raw I/O port access", arch_specific=True),
    # --- set-user-ID and set-group-ID files: no_new_privs makes them harmless inside, but
    #     the workspace is a host directory, and a host user running a setuid file the run's
    #     uid owns becomes that uid (and could outlive the run). As systemd's
    #     RestrictSUIDSGID=: no mode with S_ISUID or S_ISGID, whatever call sets it.
    *(
        DeniedSyscall(
            name=name,
            reason=SUID_REASON,
            when=f"mode (argument {index}) holds S_ISUID or S_ISGID",
            arg_tests=_any_bit_of(SUID_SGID_BITS),
            arg_index=index,
        )
        for name, index in SUID_MODE_ARGS
    ),
    *(
        DeniedSyscall(
            name=name,
            reason=MKNOD_REASON,
            when=f"mode (argument {index}) holds S_ISUID or S_ISGID, or its type is S_IFIFO",
            arg_tests=(*_any_bit_of(SUID_SGID_BITS), (S_IFMT, S_IFIFO)),
            arg_index=index,
        )
        for name, index in MKNOD_MODE_ARGS
    ),
    DeniedSyscall(
        name="openat2",
        reason="its mode sits in memory, out of seccomp's reach (so a setuid file could be "
        "made); ENOSYS makes callers fall back to openat, which is filtered by mode",
        errno=errno.ENOSYS,
    ),
)

# Calls left allowed on purpose, with the reason (rendered into the docs too).
ALLOWED_ON_PURPOSE: Final[tuple[tuple[str, str], ...]] = (
    ("vmsplice", "used by pipe-heavy tools; its past bugs are fixed and it needs no privilege"),
    (
        "adjtimex, clock_adjtime",
        "also read the clock state (ntp_gettime); setting needs "
        "CAP_SYS_TIME, which the sandbox lacks",
    ),
    ("seccomp, landlock_*", "a process may only restrict itself further"),
    ("fork, vfork, clone without CLONE_NEW*", "ordinary process and thread creation"),
)


# --- thin binding ----------------------------------------------------------------------


class _ScmpArgCmp(ctypes.Structure):
    """struct scmp_arg_cmp (seccomp.h)."""

    _fields_ = (
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    )


class _Libseccomp:
    """The libseccomp functions we call, typed; no policy here. Each returns libseccomp's
    result as is (negative errno on failure) except :meth:`init`, which raises."""

    def __init__(self, soname: str = LIBSECCOMP_SONAME) -> None:
        try:
            lib = ctypes.CDLL(soname, use_errno=True)
        except OSError as exc:
            raise SeccompError(
                f"cannot load {soname} ({exc}); install the Debian package "
                f"{LIBSECCOMP_PACKAGE} (apt-get install {LIBSECCOMP_PACKAGE})"
            ) from exc
        self._init = lib.seccomp_init
        self._init.argtypes = (ctypes.c_uint32,)
        self._init.restype = ctypes.c_void_p
        self.release = lib.seccomp_release
        self.release.argtypes = (ctypes.c_void_p,)
        self.release.restype = None
        # The array form: ctypes cannot pass structs through C varargs (seccomp_rule_add).
        self.rule_add_array = lib.seccomp_rule_add_array
        self.rule_add_array.argtypes = (
            ctypes.c_void_p,
            ctypes.c_uint32,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.POINTER(_ScmpArgCmp),
        )
        self.rule_add_array.restype = ctypes.c_int
        self.export_bpf = lib.seccomp_export_bpf
        self.export_bpf.argtypes = (ctypes.c_void_p, ctypes.c_int)
        self.export_bpf.restype = ctypes.c_int
        self.resolve_name = lib.seccomp_syscall_resolve_name
        self.resolve_name.argtypes = (ctypes.c_char_p,)
        self.resolve_name.restype = ctypes.c_int

    def init(self, default_action: int) -> int:
        ctx = self._init(default_action)
        if not ctx:
            raise SeccompError("seccomp_init failed (out of memory?)")
        return int(ctx)


@functools.cache
def _libseccomp() -> _Libseccomp:
    return _Libseccomp()


# --- recipe -----------------------------------------------------------------------------


def scmp_act_errno(code: int) -> int:
    """SCMP_ACT_ERRNO(code): the call returns -1 with ``errno`` set to ``code``."""
    return _SCMP_ACT_ERRNO_BASE | (code & 0xFFFF)


def resolve_syscall(name: str) -> int | None:
    """The native number of system call ``name``, or None where this architecture has none.

    Error handling: raises :class:`SeccompError` if libseccomp cannot be loaded.
    """
    number = int(_libseccomp().resolve_name(name.encode("ascii")))
    # libseccomp answers __NR_SCMP_ERROR (-1) for an unknown name and a negative pseudo
    # number for a call that exists elsewhere but not on this architecture.
    return number if number >= 0 else None


@functools.cache
def build_filter() -> bytes:
    """The compiled classic-BPF program for ``bwrap --seccomp FD``: default ALLOW, each
    :data:`DENIED_SYSCALLS` entry answering its errno. The policy is fixed, so the bytes
    are built once per process.

    Error handling: raises :class:`SeccompError` as :func:`compile_filter` does.
    """
    return compile_filter(DENIED_SYSCALLS)


def compile_filter(entries: Sequence[DeniedSyscall]) -> bytes:
    """The classic-BPF program for a denylist ``entries`` (default ALLOW); use
    :func:`build_filter` for the sandbox's own table.

    Error handling: raises :class:`SeccompError` if libseccomp is missing, a name is unknown
    on this architecture (and not marked ``arch_specific``), libseccomp refuses a rule, or
    the exported program is empty, malformed or longer than the kernel loads.
    """
    names = [entry.name for entry in entries]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        # libseccomp would keep one of two conflicting rules without a word.
        raise SeccompError(
            f"the denylist names {', '.join(twice)} more than once; give each system call "
            "one entry (its arg_tests hold all its cases)"
        )
    lib = _libseccomp()
    ctx = lib.init(SCMP_ACT_ALLOW)
    try:
        for entry in entries:
            number = resolve_syscall(entry.name)
            if number is None:
                if entry.arch_specific:
                    continue
                raise SeccompError(
                    f"system call {entry.name!r} is unknown to libseccomp on this "
                    "architecture; every name in the denylist must resolve here or be "
                    "marked arch_specific"
                )
            tests = entry.arg_tests or (None,)
            for test in tests:
                args = (_ScmpArgCmp * 1)()
                if test is not None:
                    args[0] = _ScmpArgCmp(entry.arg_index, SCMP_CMP_MASKED_EQ, test[0], test[1])
                count = 0 if test is None else 1
                rc = lib.rule_add_array(ctx, scmp_act_errno(entry.errno), number, count, args)
                if rc < 0:
                    raise SeccompError(
                        f"libseccomp refused the rule for {entry.name} "
                        f"({os.strerror(-rc)}); the table must hold only rules "
                        "libseccomp 2.5 accepts"
                    )
        program = _export(lib, ctx)
    finally:
        lib.release(ctx)
    # Verified after, with checks `python -O` cannot strip.
    if not program or len(program) % SOCK_FILTER_SIZE:
        raise SeccompError(
            f"seccomp_export_bpf wrote {len(program)} bytes; a program is a non-empty "
            f"multiple of {SOCK_FILTER_SIZE}"
        )
    if len(program) // SOCK_FILTER_SIZE > BPF_MAXINSNS:
        raise SeccompError(
            f"the filter has {len(program) // SOCK_FILTER_SIZE} instructions; the kernel "
            f"loads at most {BPF_MAXINSNS}"
        )
    return program


def _export(lib: _Libseccomp, ctx: int) -> bytes:
    # A memfd, not a pipe: libseccomp writes the whole program at once, and a pipe's buffer
    # would block it past 64 KiB.
    fd = os.memfd_create("cogni-seccomp", os.MFD_CLOEXEC)
    try:
        rc = lib.export_bpf(ctx, fd)
        if rc < 0:
            raise SeccompError(f"seccomp_export_bpf failed ({os.strerror(-rc)})")
        size = os.lseek(fd, 0, os.SEEK_END)
        return os.pread(fd, size, 0)
    finally:
        os.close(fd)


def write_filter(fd: int) -> None:
    """Write :func:`build_filter`'s program to ``fd`` whole (a memfd or pipe the launcher then
    passes to bwrap with ``pass_fds`` and ``--seccomp FD``; rewind a memfd first).

    Error handling: raises :class:`SeccompError` as :func:`build_filter` does; an
    ``OSError`` from writing (a closed descriptor, a full pipe nobody reads) propagates.
    """
    write_all(fd, build_filter())


def render_markdown_table() -> str:
    """The denylist as the markdown table in ``docs/sandbox.md`` (a test keeps the
    document equal to this)."""
    lines = ["| system call | answer | refused when | why |", "| --- | --- | --- | --- |"]
    for entry in DENIED_SYSCALLS:
        lines.append(
            f"| `{entry.name}` | {errno.errorcode[entry.errno]} | {entry.when} | {entry.reason} |"
        )
    lines += ["", "| left allowed | why |", "| --- | --- |"]
    lines += [f"| {name} | {why} |" for name, why in ALLOWED_ON_PURPOSE]
    return "\n".join(lines) + "\n"
