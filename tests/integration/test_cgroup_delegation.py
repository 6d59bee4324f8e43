"""gatewayd in its own delegated cgroup v2 (systemd 252's Delegate=yes, no
DelegateSubgroup=): enter_delegated_leaf moves the cgroup's processes into the leaf and
hands the controllers down, on the kernel's real cgroup2 file system.

The test cgroup stands for the unit's delegated cgroup, a real process (sleep) for
gatewayd. This host is cgroup v1 for memory and pids (its v2 hierarchy has neither), so
the controllers handed down here are whatever the v2 hierarchy offers the test cgroup;
the memory and pids case is the same write (docs/operations.md, "Hardening")."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gatewayd.sandbox.cgroup import (
    DAEMON_LEAF,
    CgroupError,
    CgroupVersion,
    enter_delegated_leaf,
    parse_mountinfo,
)


def _v2_mount() -> Path | None:
    mounts = parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    for mount in mounts:
        if mount.version == CgroupVersion.V2 and mount.root == "/":
            return Path(mount.mount_point)
    return None


V2 = _v2_mount()
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or V2 is None or not os.access(V2, os.W_OK),
    reason="needs root and a writable cgroup2 mount",
)


@pytest.fixture
def delegated() -> Iterator[Path]:
    """A cgroup standing for gatewayd's delegated one, removed with its children."""
    assert V2 is not None
    own = V2 / f"cogni-test-delegated-{os.getpid()}"
    own.mkdir()
    try:
        yield own
    finally:
        for child in sorted(own.iterdir(), reverse=True):
            if child.is_dir():
                for pid in (child / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        (V2 / "cgroup.procs").write_text(pid)
                child.rmdir()
        for pid in (own / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (V2 / "cgroup.procs").write_text(pid)
        own.rmdir()


def _procs(cgroup: Path) -> set[int]:
    return {int(pid) for pid in (cgroup / "cgroup.procs").read_text().split()}


def test_the_delegated_cgroups_processes_move_into_the_leaf_and_controllers_go_down(
    delegated: Path,
) -> None:
    workers = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        for worker in workers:
            (delegated / "cgroup.procs").write_text(str(worker.pid))
        offered = frozenset((delegated / "cgroup.controllers").read_text().split())
        leaf = enter_delegated_leaf(delegated, offered)
        assert leaf == delegated / DAEMON_LEAF
        assert _procs(delegated) == set()
        assert _procs(leaf) == {worker.pid for worker in workers}
        assert frozenset((delegated / "cgroup.subtree_control").read_text().split()) == offered
        # A command cgroup can now go beside the leaf, and a restarted daemon (put back
        # into the delegated cgroup by systemd) moves again.
        (delegated / "cogni-command").mkdir()
        restarted = subprocess.Popen(["sleep", "60"])
        workers.append(restarted)
        if offered:
            # With controllers enabled, the kernel refuses a process in the delegated
            # cgroup itself (no internal processes): systemd's restart lands in it only
            # with none enabled, so show the move with them off again.
            (delegated / "cgroup.subtree_control").write_text(
                " ".join(f"-{name}" for name in offered)
            )
        (delegated / "cgroup.procs").write_text(str(restarted.pid))
        assert enter_delegated_leaf(delegated, offered) == leaf
        assert restarted.pid in _procs(leaf) and _procs(delegated) == set()
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()


def test_a_cgroup_the_kernel_will_not_let_it_write_is_a_cgroup_error_naming_the_file(
    delegated: Path,
) -> None:
    with pytest.raises(CgroupError) as caught:
        enter_delegated_leaf(delegated / "missing", ())
    assert f"cannot create cgroup {delegated}/missing/{DAEMON_LEAF}" in str(caught.value)
    with pytest.raises(CgroupError) as refused:
        enter_delegated_leaf(delegated, ("no-such-controller",))
    assert f"cannot set {delegated}/cgroup.subtree_control to +no-such-controller" in str(
        refused.value
    )
