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
    DeferredRemovals,
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


def joining(cgroup: CommandCgroup, *, whole_process: bool = True) -> Callable[[], None]:
    """A preexec_fn that moves the child into ``cgroup``: by ``cgroup.procs``, or as the
    launcher's does (``join_files``)."""
    files = cgroup.procs_files if whole_process else cgroup.join_files

    def join() -> None:
        for procs in files:
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


# A child that starts threads, says so, then waits: every thread must be in its cgroup.
THREADS = 3
THREADED = (
    "import sys, threading, time\n"
    f"for _ in range({THREADS}): threading.Thread(target=time.sleep, args=(30,), daemon=True)"
    ".start()\n"
    "print('ready', flush=True)\n"
    "sys.stdin.read()\n"
)


def thread_cgroups(pid: int) -> set[str]:
    """Every cgroup line of every thread of ``pid``, as the host sees them."""
    lines: set[str] = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        lines.update(Path(f"/proc/{pid}/task/{tid}/cgroup").read_text().splitlines())
    return lines


async def test_joining_as_the_launcher_moves_the_whole_child_and_its_later_threads(
    cgroup: CommandCgroup,
) -> None:
    # The launcher's child writes its join files (v1: tasks, its one thread): the process,
    # and every thread it starts after, belongs to the command cgroup of each controller.
    child = subprocess.Popen(
        [sys.executable, "-I", "-c", THREADED],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        preexec_fn=joining(cgroup, whole_process=False),  # noqa: PLW1509
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        assert await trio.to_thread.run_sync(child.stdout.readline) == b"ready\n"
        for directory in cgroup.dirs:
            assert (directory / "cgroup.procs").read_text().split() == [str(child.pid)]
        if cgroup.version == CgroupVersion.V1:
            assert len((cgroup.memory_dir / "tasks").read_text().split()) == THREADS + 1
        if cgroup.pids_dir is not None:  # the pids controller counts every thread
            assert (cgroup.pids_dir / "pids.current").read_text() == f"{THREADS + 1}\n"
        # Each thread's memory (and pids) line names the command cgroup, none the parent.
        v2 = cgroup.version == CgroupVersion.V2
        for controller in ("memory", "pids") if cgroup.pids_dir is not None else ("memory",):
            lines = {
                line
                for line in thread_cgroups(child.pid)
                if controller in line.split(":")[1].split(",") or (v2 and line.startswith("0::"))
            }
            assert lines and all(line.endswith(f"/{cgroup.memory_dir.name}") for line in lines)
    finally:
        child.stdin.close()
        child.wait()


async def test_a_memory_bomb_joined_as_the_launcher_is_oom_killed_and_counted(
    cgroup: CommandCgroup,
) -> None:
    # Memory is charged to the cgroup the mm's owner is in: the moved thread's.
    bomb = subprocess.Popen(
        [sys.executable, "-I", "-c", BOMB],
        stderr=subprocess.DEVNULL,
        preexec_fn=joining(cgroup, whole_process=False),  # noqa: PLW1509
    )
    returncode = await trio.to_thread.run_sync(bomb.wait)
    assert returncode == -9
    assert cgroup.oom_killed()


# --- removal after the result ------------------------------------------------------------


async def test_a_deferred_removal_returns_at_once_and_wait_sees_it_done(
    cgroup: CommandCgroup,
) -> None:
    sleeper = subprocess.Popen(
        ["/bin/sleep", "100"],
        preexec_fn=joining(cgroup, whole_process=False),  # noqa: PLW1509
    )
    try:
        removals = DeferredRemovals()
        removals.remove_later(cgroup)
        # Handed over, not done: the caller goes on (its result is on its way) ...
        assert removals.pending == 1 and cgroup.memory_dir.exists()
        with trio.fail_after(5):
            assert await removals.wait() == ()
        # ... and the owner's wait returns once the leftover is killed and every
        # directory is gone.
        assert removals.pending == 0
        assert [d for d in cgroup.dirs if d.exists()] == []
    finally:
        sleeper.kill()
    assert sleeper.wait() == -9


async def test_a_deferred_removal_that_fails_is_returned_by_wait_with_its_reason(
    tmp_path: Path,
) -> None:
    # A plain directory with a file in it stands in for a cgroup the kernel will not
    # remove: the failure must reach the owner, never the event loop.
    (tmp_path / "stray").write_text("")
    odd = CommandCgroup(version=CgroupVersion.V1, memory_dir=tmp_path, pids_dir=None)
    removals = DeferredRemovals()
    removals.remove_later(odd)
    with trio.fail_after(5):
        failed = await removals.wait()
    assert [cgroup for cgroup, _ in failed] == [odd]
    assert f"cannot remove cgroup {tmp_path}: Directory not empty" in failed[0][1]
    assert await removals.wait() == ()  # reported once


async def test_an_idle_owner_waits_for_nothing() -> None:
    with trio.fail_after(1):
        assert await DeferredRemovals().wait() == ()


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
