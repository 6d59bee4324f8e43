"""The seccomp denylist and its compiled program, checked without a sandbox: every entry is
reasoned and resolves here, the argument rules refuse exactly what they say, the program is
well-formed, the docs match the table, and every error says what to do instead."""

from __future__ import annotations

import errno
import os
import platform
import stat
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gatewayd.sandbox.seccomp import (
    BPF_MAXINSNS,
    CLONE_NAMESPACE_FLAGS,
    DENIED_SYSCALLS,
    LIBSECCOMP_PACKAGE,
    PERSONALITY_ALLOWED,
    SOCK_FILTER_SIZE,
    DeniedSyscall,
    SeccompError,
    _Libseccomp,
    build_filter,
    compile_filter,
    render_markdown_table,
    resolve_syscall,
    write_filter,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "sandbox.md"
BY_NAME = {entry.name: entry for entry in DENIED_SYSCALLS}
# What the sandbox's hardening (docs/sandbox.md) requires the filter to refuse at least.
REQUIRED = [
    "ptrace",
    "mount",
    "umount2",
    "unshare",
    "setns",
    "clone",
    "clone3",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "userfaultfd",
    "personality",
]
# Flags glibc passes for fork() and pthread_create(): never refused.
FORK_FLAGS = 0x01200000 | 17  # CLONE_CHILD_SETTID | CLONE_CHILD_CLEARTID | SIGCHLD
THREAD_FLAGS = 0x003D0F00  # VM FS FILES SIGHAND THREAD SYSVSEM SETTLS PARENT_SETTID CHILD_CLEARTID


def test_every_required_system_call_is_in_the_table() -> None:
    assert set(REQUIRED) <= set(BY_NAME)


def test_every_entry_has_a_reason_and_appears_once() -> None:
    assert len(BY_NAME) == len(DENIED_SYSCALLS)
    for entry in DENIED_SYSCALLS:
        assert len(entry.reason) > 10, entry.name
        assert entry.when


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the table is written for x86_64")
def test_every_name_resolves_on_this_architecture() -> None:
    unresolved = [entry.name for entry in DENIED_SYSCALLS if resolve_syscall(entry.name) is None]
    assert unresolved == []
    assert resolve_syscall("ptrace") == 101  # a known x86_64 number: resolution is real
    assert resolve_syscall("no_such_call") is None


def test_only_feature_probes_answer_enosys_and_everything_else_eperm() -> None:
    enosys = {entry.name for entry in DENIED_SYSCALLS if entry.errno == errno.ENOSYS}
    assert enosys == {
        "clone3",
        "io_uring_setup",
        "io_uring_enter",
        "io_uring_register",
        "openat2",
    }
    others = {entry.errno for entry in DENIED_SYSCALLS if entry.name not in enosys}
    assert others == {errno.EPERM}


@pytest.mark.parametrize(
    ("name", "index"),
    [
        ("chmod", 1),
        ("fchmod", 1),
        ("fchmodat", 2),
        ("fchmodat2", 2),
        ("creat", 1),
        ("open", 2),
        ("openat", 3),
        ("mkdir", 1),
        ("mkdirat", 2),
        ("mknod", 1),
        ("mknodat", 2),
    ],
)
def test_every_mode_setting_call_refuses_setuid_and_setgid_bits_only(name: str, index: int) -> None:
    entry = BY_NAME[name]
    assert entry.arg_index == index
    for mode in (0o4755, 0o2755, 0o6755, 0o4000, 0o2000, 0o104755):
        assert entry.refuses(mode), oct(mode)
    for mode in (0o755, 0o644, 0o1777, 0o777, 0o100644, 0):
        assert not entry.refuses(mode), oct(mode)


@pytest.mark.parametrize(("name", "index"), [("mknod", 1), ("mknodat", 2)])
def test_the_calls_that_make_special_files_refuse_a_fifo_but_not_a_plain_file(
    name: str, index: int
) -> None:
    # A FIFO in a host directory blocks an open of it on the host (a wasm tool's).
    entry = BY_NAME[name]
    for mode in (stat.S_IFIFO | 0o600, stat.S_IFIFO, stat.S_IFIFO | 0o4600):
        assert entry.refuses(mode), oct(mode)
    for mode in (stat.S_IFREG | 0o600, 0o600, stat.S_IFSOCK | 0o600, stat.S_IFCHR | 0o600):
        assert not entry.refuses(mode), oct(mode)


def test_clone_is_refused_with_any_namespace_flag_but_not_for_fork_or_threads() -> None:
    clone = BY_NAME["clone"]
    for flag in CLONE_NAMESPACE_FLAGS:
        assert clone.refuses(flag | 17)
        assert clone.refuses(flag | THREAD_FLAGS)
    assert not clone.refuses(FORK_FLAGS)
    assert not clone.refuses(THREAD_FLAGS)
    assert BY_NAME["unshare"].refuses(0)  # unconditional


@given(st.integers(min_value=0, max_value=2**64 - 1))
def test_personality_is_refused_unless_its_32_bit_value_is_per_linux_or_the_query(
    value: int,
) -> None:
    # The kernel reads 32 bits; a sign-extended -1 is still the query.
    assert BY_NAME["personality"].refuses(value) == (value & 0xFFFFFFFF not in PERSONALITY_ALLOWED)


@pytest.mark.parametrize(
    "value", [0, 0xFFFFFFFF, 2**64 - 1, 8, 0x0040000, 0x0400000, 0x0100000, 0xFFFFFFFE, 1]
)
def test_personality_edge_values(value: int) -> None:
    assert BY_NAME["personality"].refuses(value) == (value & 0xFFFFFFFF not in (0, 0xFFFFFFFF))


def test_build_filter_returns_a_well_formed_program() -> None:
    program = build_filter()
    assert program
    assert len(program) % SOCK_FILTER_SIZE == 0
    assert len(program) // SOCK_FILTER_SIZE <= BPF_MAXINSNS
    # Deterministic: the same table compiles to the same bytes.
    assert compile_filter(DENIED_SYSCALLS) == program


def test_a_smaller_table_compiles_to_a_different_program() -> None:
    # The table is what is compiled: dropping one entry changes the bytes.
    assert compile_filter(DENIED_SYSCALLS[1:]) != build_filter()


def test_write_filter_writes_the_whole_program_to_a_memfd_and_a_pipe() -> None:
    fd = os.memfd_create("test-seccomp")
    try:
        write_filter(fd)
        assert os.pread(fd, 1 << 20, 0) == build_filter()
    finally:
        os.close(fd)
    read_end, write_end = os.pipe()
    try:
        write_filter(write_end)
        os.close(write_end)
        write_end = -1
        chunks = []
        while chunk := os.read(read_end, 65536):
            chunks.append(chunk)
        assert b"".join(chunks) == build_filter()
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)


def test_docs_hold_the_table_as_rendered_from_the_module() -> None:
    assert render_markdown_table() in DOCS.read_text()
    for entry in DENIED_SYSCALLS:
        assert f"| `{entry.name}` |" in render_markdown_table()


def test_missing_libseccomp_names_the_package_to_install() -> None:
    with pytest.raises(SeccompError, match=f"install the Debian package {LIBSECCOMP_PACKAGE}"):
        _Libseccomp("libseccomp-not-here.so.2")


def test_unknown_system_call_is_refused_and_named() -> None:
    with pytest.raises(SeccompError, match=r"'no_such_call' is unknown.*arch_specific"):
        compile_filter([DeniedSyscall(name="no_such_call", reason="a test of the error path")])


def test_arch_specific_unknown_name_is_skipped() -> None:
    entries = [DeniedSyscall(name="no_such_call", reason="only on some CPU", arch_specific=True)]
    program = compile_filter(entries)
    assert program == compile_filter([])


def test_a_name_listed_twice_is_refused_before_libseccomp_sees_it() -> None:
    twice = [
        DeniedSyscall(name="bpf", reason="first entry here"),
        DeniedSyscall(name="bpf", reason="second entry here", errno=errno.ENOSYS),
    ]
    with pytest.raises(SeccompError, match="names bpf more than once; give each system call"):
        compile_filter(twice)


@pytest.mark.parametrize("bad_errno", [0, -1, 100_000])
def test_an_entry_whose_errno_would_fake_success_or_is_unknown_is_refused(bad_errno: int) -> None:
    with pytest.raises(SeccompError, match="use a positive errno such as EPERM or ENOSYS"):
        DeniedSyscall(name="bpf", reason="a test of the error path", errno=bad_errno)


def test_an_entry_without_a_reason_is_refused() -> None:
    with pytest.raises(SeccompError, match="needs a name and a reason"):
        DeniedSyscall(name="bpf", reason="  ")
