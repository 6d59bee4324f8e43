"""The review's second round, each guard shown on its own: a pinned source that changed
identity, a pinned source that cannot be attached, a bind source outside the run's mount
points, the uid pool skipping a uid a process holds, and the lease stopping at a mount."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import trio

from gatewayd.policy.paths import PathGrant, PathMode
from gatewayd.sandbox.launch import LaunchError, run_in_sandbox
from gatewayd.sandbox.lease import give_back, lend
from gatewayd.sandbox.lendable import LendableRoots
from gatewayd.sandbox.limits import HostUser
from gatewayd.sandbox.plan import Bind, PlanError, validate
from gatewayd.sandbox.session import UnsafeMounts, _pin_sources
from gatewayd.sandbox.uids import UidPool, UidRange
from tests.integration.test_sandbox_launch import (  # noqa: F401 (fixtures)
    FAST,
    base,
    make_plan,
    netns,
    setup,
    user,
)

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/usr/bin/bwrap"),
    reason="needs root (mounts, other uids) and bubblewrap",
)


@pytest.fixture
def tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-hard-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_a_grant_whose_directory_changed_identity_is_not_pinned(tmp: Path) -> None:
    ref = tmp / "ws" / "ref"
    ref.mkdir(parents=True)
    st = os.stat(ref)
    grant = PathGrant(
        name="ref",
        host_root=ref,
        root_id=(st.st_dev, st.st_ino),
        holds_nested=False,
        visible_root=Path("/workspace/ref"),  # type: ignore[arg-type]
        mode=PathMode.RO,
    )
    run_dir = tmp / "run"
    run_dir.mkdir()
    ref.rename(tmp / "ws" / "ref-old")
    ref.mkdir()  # same path, another directory
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(UnsafeMounts, match="no longer the directory the run was created with"):
        _pin_sources(run_dir, HostUser(uid=4_000_001, gid=4_000_001), [ref], [grant])
    assert set(os.listdir("/proc/self/fd")) <= before  # nothing left open


def test_a_bind_source_outside_the_runs_mount_points_is_refused(
    setup: dict[str, object],  # noqa: F811
) -> None:
    plan = make_plan(setup, "/bin/true")
    workspace = next(step for step in plan.steps if isinstance(step, Bind))
    forged = replace(workspace, via="/etc")
    steps = tuple(forged if step is workspace else step for step in plan.steps)
    with pytest.raises(PlanError, match="a pinned source must be one of this run's mount points"):
        validate(replace(plan, steps=steps))


async def test_a_pinned_source_that_cannot_be_attached_names_the_step(
    setup: dict[str, object],  # noqa: F811
) -> None:
    plan = make_plan(setup, "/bin/true")
    netns_path, host_user = setup["netns"], setup["user"]
    assert isinstance(netns_path, Path) and isinstance(host_user, HostUser)
    closed = os.open("/", os.O_PATH)
    os.close(closed)  # a descriptor number that is not open in the child
    with pytest.raises(
        LaunchError, match=r"could not attach the pinned directories: \[Errno \d+\]"
    ):
        await run_in_sandbox(
            plan, netns=netns_path, limits=FAST, host_user=host_user, pins=[(closed, "/tmp")]
        )


async def test_the_pool_skips_a_uid_a_process_holds_even_as_its_effective_uid() -> None:
    uid_base = 4_100_000 + secrets.randbelow(100_000) * 4
    holder = subprocess.Popen(
        [
            "setpriv",
            "--ruid=65534",
            f"--euid={uid_base}",
            "--rgid=65534",
            "--clear-groups",
            "sleep",
            "30",
        ]
    )
    try:
        with trio.fail_after(5):
            while f"{uid_base}" not in Path(f"/proc/{holder.pid}/status").read_text():
                await trio.sleep(0.01)
        assert UidPool(UidRange(uid_base, 2)).acquire().uid == uid_base + 1
    finally:
        holder.kill()
        holder.wait()


def test_the_lease_never_enters_a_mount_inside_the_tree(tmp: Path) -> None:
    ws = tmp / "ws"
    (ws / "cache").mkdir(parents=True)
    outside = tmp / "outside"
    outside.mkdir()
    (outside / "app.conf").write_text("host setting\n")
    run_dir = tmp / "run"
    run_dir.mkdir()
    subprocess.run(["mount", "--bind", str(outside), str(ws / "cache")], check=True)
    borrower = HostUser(uid=4_000_003, gid=4_000_003)
    try:
        lease = lend([ws], borrower, run_dir, roots=LendableRoots())
        assert os.stat(ws).st_uid == borrower.uid
        assert os.stat(outside / "app.conf").st_uid == 0  # behind the mount: not lent
        give_back(lease)
    finally:
        subprocess.run(["umount", str(ws / "cache")], check=True)
    assert os.stat(ws).st_uid == 0
