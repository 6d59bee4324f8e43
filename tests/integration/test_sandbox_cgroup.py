"""``gatewayd.sandbox.cgroup`` on this host's real cgroup file system, without bwrap: the
probe finds our own cgroups, a command cgroup gets its limits, a process in it that overruns
memory is OOM-killed and counted, removal kills what is left and leaves nothing behind.
Broken hosts (a hierarchy that is not a cgroup file system) are stood in for by plain
directories, because they cannot be made here otherwise. The launcher's use of all this is
proven in ``test_sandbox_launch.py``."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import trio

from gatewayd.sandbox.cgroup import (
    CgroupError,
    CgroupSupport,
    CgroupVersion,
    CommandCgroup,
    create_command_cgroup,
    probe_cgroups,
)

SUPPORT = probe_cgroups() if os.geteuid() == 0 else CgroupSupport.unavailable("not root")
pytestmark = pytest.mark.skipif(
    not SUPPORT.available, reason=f"needs cgroups this process may create: {SUPPORT.reason}"
)
MIB = 1024**2
BOMB = "chunks = []\nwhile True: chunks.append(b'x' * (10 << 20))"  # touches every page


@pytest.fixture
def cgroup() -> Iterator[CommandCgroup]:
    made = create_command_cgroup(
        SUPPORT, run_id=secrets.token_hex(16), memory_bytes=64 * MIB, max_processes=16
    )
    try:
        yield made
    finally:
        if any(directory.exists() for directory in made.dirs):
            trio.run(made.remove)  # sync teardown: the test's own trio run is over


def joining(cgroup: CommandCgroup) -> Callable[[], None]:
    """A preexec_fn that moves the child into ``cgroup``, as the launcher's does."""

    def join() -> None:
        for procs in cgroup.procs_files:
            fd = os.open(procs, os.O_WRONLY)
            os.write(fd, b"0")
            os.close(fd)

    return join


def leftovers(parent: Path, prefix: str) -> list[str]:
    return [name for name in os.listdir(parent) if name.startswith(prefix)]


# --- probe --------------------------------------------------------------------------------


def test_probe_finds_the_memory_cgroup_this_process_is_in_and_leaves_no_probe_behind() -> None:
    assert SUPPORT.memory_parent is not None
    if SUPPORT.version == CgroupVersion.V1:
        # v1: our own memory cgroup, whose members include this very process.
        members = (SUPPORT.memory_parent / "cgroup.procs").read_text().split()
        assert str(os.getpid()) in members
    assert leftovers(SUPPORT.memory_parent, "cogni-probe-") == []
    if SUPPORT.pids_parent is not None:
        assert leftovers(SUPPORT.pids_parent, "cogni-probe-") == []


def test_probe_without_a_memory_hierarchy_is_unavailable_and_says_so(tmp_path: Path) -> None:
    (tmp_path / "cgroup").write_text("1:cpu:/\n")
    (tmp_path / "mountinfo").write_text("1 0 0:1 / / rw - ext4 /dev/root rw\n")
    support = probe_cgroups(proc_cgroup=tmp_path / "cgroup", mountinfo=tmp_path / "mountinfo")
    assert not support.available
    assert "no mounted cgroup hierarchy has the memory controller" in support.reason
    assert "fall back to rlimits" in support.reason


def test_probe_of_unreadable_proc_files_is_unavailable_naming_the_problem(tmp_path: Path) -> None:
    support = probe_cgroups(proc_cgroup=tmp_path / "missing", mountinfo=tmp_path / "missing")
    assert not support.available
    assert support.reason.startswith("cannot read this process's cgroups:")
    assert "missing" in support.reason


def test_probe_of_a_memory_mount_that_is_no_cgroup_fs_is_unavailable(tmp_path: Path) -> None:
    # A plain directory stands in for a broken hierarchy: mkdir works, no control files.
    fake = tmp_path / "memory"
    fake.mkdir()
    (tmp_path / "cgroup").write_text("4:memory:/\n")
    (tmp_path / "mountinfo").write_text(f"35 31 0:32 / {fake} rw - cgroup cgroup rw,memory\n")
    support = probe_cgroups(proc_cgroup=tmp_path / "cgroup", mountinfo=tmp_path / "mountinfo")
    assert not support.available
    assert "cgroup v1 memory controller unusable: cannot read" in support.reason
    assert "memory.oom_control" in support.reason
    assert os.listdir(fake) == []  # the probe cgroup is removed again


# --- one command's cgroup -------------------------------------------------------------------


def test_a_command_cgroup_has_its_memory_swap_and_pids_limits(cgroup: CommandCgroup) -> None:
    name = cgroup.memory_dir.name
    assert name.startswith("cogni-") and len(name) == len("cogni-") + 32 + 1 + 8
    if cgroup.version == CgroupVersion.V1:
        assert (cgroup.memory_dir / "memory.limit_in_bytes").read_text() == f"{64 * MIB}\n"
        if SUPPORT.swap_limited:
            assert (cgroup.memory_dir / "memory.memsw.limit_in_bytes").read_text() == (
                f"{64 * MIB}\n"
            )
    else:
        assert (cgroup.memory_dir / "memory.max").read_text() == f"{64 * MIB}\n"
    if cgroup.pids_dir is not None:
        assert (cgroup.pids_dir / "pids.max").read_text() == "16\n"
    assert not cgroup.oom_killed()


async def test_a_process_over_the_memory_limit_is_oom_killed_and_counted(
    cgroup: CommandCgroup,
) -> None:
    bomb = subprocess.Popen(
        [sys.executable, "-I", "-c", BOMB],
        stderr=subprocess.DEVNULL,
        preexec_fn=joining(cgroup),  # noqa: PLW1509
    )
    returncode = await trio.to_thread.run_sync(bomb.wait)
    assert returncode == -9  # the kernel's OOM kill, not a MemoryError of its own
    assert cgroup.oom_killed()


async def test_remove_kills_what_is_still_inside_and_removes_every_directory(
    cgroup: CommandCgroup,
) -> None:
    sleeper = subprocess.Popen(["/bin/sleep", "100"], preexec_fn=joining(cgroup))  # noqa: PLW1509
    try:
        members = (cgroup.memory_dir / "cgroup.procs").read_text().split()
        assert members == [str(sleeper.pid)]
        with trio.fail_after(5):
            await cgroup.remove()
    finally:
        sleeper.kill()
    assert sleeper.wait() == -9
    assert [d for d in cgroup.dirs if d.exists()] == []


async def test_remove_of_a_cgroup_already_gone_is_quiet(cgroup: CommandCgroup) -> None:
    await cgroup.remove()
    await cgroup.remove()
    assert not cgroup.memory_dir.exists()


# --- errors ---------------------------------------------------------------------------------


def test_create_under_a_parent_that_is_no_cgroup_names_the_file_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    broken = replace(SUPPORT, memory_parent=tmp_path, pids_parent=None)
    with pytest.raises(CgroupError, match=r"cannot set .*/cogni-[0-9a-f]{32}-[0-9a-f]{8}/memory"):
        create_command_cgroup(
            broken, run_id=secrets.token_hex(16), memory_bytes=MIB, max_processes=8
        )
    assert os.listdir(tmp_path) == []


def test_create_under_a_missing_parent_names_it(tmp_path: Path) -> None:
    broken = replace(SUPPORT, memory_parent=tmp_path / "gone", pids_parent=None)
    with pytest.raises(CgroupError, match=r"cannot create cgroup .*/gone/cogni-.*No such file"):
        create_command_cgroup(
            broken, run_id=secrets.token_hex(16), memory_bytes=MIB, max_processes=8
        )


def test_create_with_unavailable_support_is_a_caller_bug_saying_to_use_rlimits() -> None:
    with pytest.raises(ValueError, match=r"unavailable here \(no memory controller\); use rlimits"):
        create_command_cgroup(
            CgroupSupport.unavailable("no memory controller"),
            run_id=secrets.token_hex(16),
            memory_bytes=MIB,
            max_processes=8,
        )


def test_reading_the_oom_counter_of_a_missing_cgroup_names_the_file(tmp_path: Path) -> None:
    gone = CommandCgroup(version=CgroupVersion.V2, memory_dir=tmp_path / "gone", pids_dir=None)
    with pytest.raises(CgroupError, match=r"cannot read .*/gone/memory.events"):
        gone.oom_killed()


async def test_remove_of_a_directory_that_is_no_cgroup_reports_it(tmp_path: Path) -> None:
    # rmdir of a plain directory with a file in it fails with ENOTEMPTY, never EBUSY.
    (tmp_path / "stray").write_text("")
    odd = CommandCgroup(version=CgroupVersion.V1, memory_dir=tmp_path, pids_dir=None)
    with pytest.raises(CgroupError, match=rf"cannot remove cgroup {tmp_path}: Directory not empty"):
        await odd.remove()
