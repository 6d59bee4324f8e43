"""The seccomp filter loaded by a real bwrap (``--seccomp FD``), probed from inside.

Each probe runs twice: in a sandbox with the filter and in the same sandbox without it. The
sandbox runs as uid 0 of its own user namespace (``--unshare-all``, so also no network) and
keeps that namespace's capabilities, so without the filter the kernel *allows* nearly every
probed call; the filtered answer differing from the unfiltered one is what proves the filter
did the refusing. (The launcher's real plan also drops capabilities and disables nested user
namespaces; the filter must hold even where those layers would not.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from typing import Any

import pytest

from gatewayd.sandbox.seccomp import resolve_syscall, write_filter

BWRAP = shutil.which("bwrap")
SANDBOX_PYTHON = "/usr/bin/python3"
pytestmark = pytest.mark.skipif(
    BWRAP is None or not os.path.exists(SANDBOX_PYTHON),
    reason="needs bubblewrap and the system python3",
)
PROBED = [
    "ptrace",
    "mount",
    "unshare",
    "clone",
    "clone3",
    "setns",
    "bpf",
    "io_uring_setup",
    "keyctl",
    "userfaultfd",
    "perf_event_open",
    "personality",
]

PROBE = r"""
import ctypes, errno, json, mmap, os, subprocess, sys, threading

NR = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
U, I = ctypes.c_ulong, ctypes.c_int
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWUTS, SIGCHLD = 0x20000, 0x10000000, 0x04000000, 17
ADDR_NO_RANDOMIZE = 0x0040000


def call(name, *args):
    ret = libc.syscall(ctypes.c_long(NR[name]), *args)
    return "ok" if ret >= 0 else errno.errorcode[ctypes.get_errno()]


def in_child(fn):
    # fn may change the process for good (traced, new namespace, new persona): fork first.
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(w, fn().encode())
        finally:
            os._exit(0)
    os.close(w)
    answer = os.read(r, 100).decode()
    os.close(r)
    _, status = os.waitpid(pid, 0)
    return answer or f"died:{os.waitstatus_to_exitcode(status)}"


def raw_clone(flags):
    def go():
        ret = libc.syscall(ctypes.c_long(NR["clone"]), U(flags), U(0), U(0), U(0), U(0))
        if ret == 0:
            os._exit(0)
        if ret < 0:
            return errno.errorcode[ctypes.get_errno()]
        os.waitpid(ret, 0)
        return "ok"
    return in_child(go)


def setns_own_uts():
    return call("setns", I(os.open("/proc/self/ns/uts", os.O_RDONLY)), I(CLONE_NEWUTS))


def bpf_null_attr():
    # This host's kernel refuses unprivileged bpf with EPERM itself; with a NULL attribute
    # it answers EFAULT before any permission check, so EPERM can only be the filter's.
    return call("bpf", I(0), None, ctypes.c_uint(128))


def io_uring():
    params = (ctypes.c_uint8 * 120)()
    return call("io_uring_setup", ctypes.c_uint(1), params)


def perf_self():
    attr = (ctypes.c_uint8 * 128)()
    ctypes.c_uint32.from_buffer(attr, 0).value = 1  # PERF_TYPE_SOFTWARE
    ctypes.c_uint32.from_buffer(attr, 4).value = 128  # size
    # disabled | exclude_kernel | exclude_hv: allowed to anyone at perf_event_paranoid 2
    ctypes.c_uint64.from_buffer(attr, 40).value = 1 | 1 << 5 | 1 << 6
    return call("perf_event_open", attr, I(0), I(-1), I(-1), U(0))


def i386_ptrace():
    # ptrace(PTRACE_TRACEME) through the i386 ABI: mov eax,26; xor ebx,ebx; int 0x80; ret
    code = bytes.fromhex("b81a000000" "31db" "cd80" "c3")
    page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(code)
    fn = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
    ret = fn()
    return "ok" if ret >= 0 else errno.errorcode[-ret]


def ordinary_work():
    import decimal, sqlite3, hashlib  # noqa: F401  (extension modules load)
    echoed = subprocess.run(["/bin/echo", "hi"], capture_output=True, text=True).stdout
    with open("/tmp/scratch", "w") as f:
        f.write("data")
    seen = []
    threads = [threading.Thread(target=seen.append, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {
        "subprocess": echoed,
        "tmp_file": open("/tmp/scratch").read(),
        "threads": sorted(seen),
        "fork": in_child(lambda: "ok"),
        "plain_clone": raw_clone(SIGCHLD),
        "personality_query": call("personality", U(0xFFFFFFFF)),
        "personality_linux": in_child(lambda: call("personality", U(0))),
    }


print(json.dumps({
    "ptrace_traceme": in_child(lambda: call("ptrace", U(0), U(0), U(0), U(0))),
    "mount_tmpfs": in_child(lambda: call("mount", b"none", b"/tmp", b"tmpfs", U(0), None)),
    "unshare_newuser": in_child(lambda: call("unshare", U(CLONE_NEWUSER))),
    "clone_newns": raw_clone(CLONE_NEWNS | SIGCHLD),
    "clone3": call("clone3", None, U(0)),
    "setns": in_child(setns_own_uts),
    "bpf": bpf_null_attr(),
    "io_uring_setup": io_uring(),
    "keyctl": call("keyctl", I(0), I(-3), I(0)),  # KEYCTL_GET_KEYRING_ID, session keyring
    "userfaultfd": call("userfaultfd", I(1 | os.O_CLOEXEC)),  # UFFD_USER_MODE_ONLY
    "perf_event_open": perf_self(),
    "personality_no_aslr": in_child(lambda: call("personality", U(ADDR_NO_RANDOMIZE))),
    "i386_ptrace": in_child(i386_ptrace),
    "work": ordinary_work(),
}))
"""


def run_probe(*, with_filter: bool) -> dict[str, Any]:
    numbers = {name: resolve_syscall(name) for name in PROBED}
    argv = [
        str(BWRAP),
        "--unshare-all",  # user, pid, ipc, uts, cgroup and net: nothing reaches out
        "--die-with-parent",
        "--uid",
        "0",
        "--gid",
        "0",
        "--ro-bind",
        "/usr",
        "/usr",
        *("--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64"),
        *("--symlink", "usr/bin", "/bin", "--proc", "/proc", "--dev", "/dev"),
        *("--tmpfs", "/tmp", "--clearenv"),
    ]
    fd = os.memfd_create("seccomp-filter")
    try:
        if with_filter:
            write_filter(fd)
            os.lseek(fd, 0, os.SEEK_SET)
            argv += ["--seccomp", str(fd)]
        argv += [SANDBOX_PYTHON, "-I", "-c", PROBE, json.dumps(numbers)]
        done = subprocess.run(
            argv, pass_fds=(fd,), capture_output=True, text=True, timeout=60, check=False
        )
    finally:
        os.close(fd)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@pytest.fixture(scope="module")
def filtered() -> dict[str, Any]:
    return run_probe(with_filter=True)


@pytest.fixture(scope="module")
def unfiltered() -> dict[str, Any]:
    return run_probe(with_filter=False)


@pytest.mark.parametrize(
    ("probe", "refused_with"),
    [
        ("ptrace_traceme", "EPERM"),
        ("mount_tmpfs", "EPERM"),
        ("unshare_newuser", "EPERM"),
        ("clone_newns", "EPERM"),
        ("setns", "EPERM"),
        ("bpf", "EPERM"),
        ("keyctl", "EPERM"),
        ("userfaultfd", "EPERM"),
        ("perf_event_open", "EPERM"),
        ("personality_no_aslr", "EPERM"),
        ("io_uring_setup", "ENOSYS"),
        ("clone3", "ENOSYS"),
    ],
)
def test_denied_call_is_refused_by_the_filter_where_the_kernel_would_answer_otherwise(
    probe: str, refused_with: str, filtered: dict[str, Any], unfiltered: dict[str, Any]
) -> None:
    assert filtered[probe] == refused_with
    assert unfiltered[probe] != refused_with, f"{probe}: the kernel alone answers the same"


def test_the_unfiltered_sandbox_really_allows_the_dangerous_calls(
    unfiltered: dict[str, Any],
) -> None:
    # So the comparison above is against success, not against some other refusal.
    allowed = ["ptrace_traceme", "mount_tmpfs", "unshare_newuser", "clone_newns", "setns"]
    allowed += ["keyctl", "userfaultfd", "perf_event_open", "io_uring_setup"]
    assert {name: unfiltered[name] for name in allowed} == dict.fromkeys(allowed, "ok")


def test_a_32_bit_system_call_cannot_bypass_the_filter(
    filtered: dict[str, Any], unfiltered: dict[str, Any]
) -> None:
    # i386 ptrace via int 0x80: a foreign architecture to the filter kills the thread.
    assert filtered["i386_ptrace"] == "died:-31"  # SIGSYS
    assert unfiltered["i386_ptrace"] != filtered["i386_ptrace"]


def test_ordinary_work_runs_under_the_filter(
    filtered: dict[str, Any], unfiltered: dict[str, Any]
) -> None:
    expected = {
        "subprocess": "hi\n",
        "tmp_file": "data",
        "threads": [0, 1, 2, 3],  # pthread_create falls back from clone3 (ENOSYS) to clone
        "fork": "ok",
        "plain_clone": "ok",
        "personality_query": "ok",
        "personality_linux": "ok",
    }
    assert filtered["work"] == expected
    assert unfiltered["work"] == expected
