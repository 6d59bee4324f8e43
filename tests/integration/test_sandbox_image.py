"""A real bwrap sandbox on an image root: the sandbox sees the image, not the host.

The image is tiny: a static busybox (Debian package ``busybox-static``) with a few applet
links, a marker in /usr, and the mount points. It has no python3, so ``check_image``
names exactly that and nothing else. The launcher runs as it does for real runs: the
run's netns, an unprivileged fresh host uid, seccomp, rlimits.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gatewayd.sandbox.image import check_image
from gatewayd.sandbox.launch import ExecResult, run_in_sandbox
from gatewayd.sandbox.limits import HostUser, SandboxLimits
from gatewayd.sandbox.netns import create_run_netns, remove_run_netns
from gatewayd.sandbox.plan import build_plan, probe_host_layout

BUSYBOX = Path("/bin/busybox")
BUSYBOX_STATIC_FILES = Path("/var/lib/dpkg/info/busybox-static.list")  # the package is there
APPLETS = ("sh", "ls", "cat", "touch", "id", "echo", "test")
MARKER = "this-is-the-image"
LIMITS = SandboxLimits(timeout_s=20, max_processes=24, max_output_bytes=4096, kill_grace_s=0.5)


def _unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "the launcher joins a netns and drops to another uid: these tests run as root"
    if not os.path.exists("/usr/bin/bwrap"):
        return "needs bubblewrap at /usr/bin/bwrap"
    if not os.path.exists("/proc/sys/user/max_user_namespaces"):
        return "this kernel has no user namespaces"
    # A static binary runs in an image without a libc; Debian's plain busybox is dynamic.
    if not BUSYBOX.is_file() or not BUSYBOX_STATIC_FILES.is_file():
        return "needs a static busybox at /bin/busybox: apt-get install busybox-static"
    return None


_REASON = _unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


@dataclass(frozen=True, slots=True, kw_only=True)
class Setup:
    base: Path
    image: Path
    run_id: str
    netns: Path
    user: HostUser


def make_busybox_image(root: Path) -> None:
    """The smallest image that starts: busybox in a real /bin, the mount points, a marker."""
    for directory in ("bin", "usr", "proc", "dev", "tmp", "workspace", "opt/cogni-tool"):
        (root / directory).mkdir(parents=True)
    for directory in ("etc", "run/cogni"):
        (root / directory).mkdir(parents=True)
    for name in ("etc/passwd", "etc/group", "etc/hosts", "run/cogni/gateway.sock"):
        (root / name).write_text("")
    (root / "usr" / MARKER).write_text("")
    shutil.copy2(BUSYBOX, root / "bin/busybox")
    for applet in APPLETS:
        (root / "bin" / applet).symlink_to("busybox")
    for directory, _dirs, files in os.walk(root):
        os.chmod(directory, 0o755)
        for name in files:
            os.chmod(os.path.join(directory, name), 0o644)
    (root / "bin/busybox").chmod(0o755)


@pytest.fixture
def setup() -> Iterator[Setup]:
    base = Path(tempfile.mkdtemp(prefix="cg-image-", dir="/tmp"))
    base.chmod(0o755)  # bwrap runs as the sandbox uid: it must reach its bind sources
    handle = create_run_netns(secrets.token_hex(16))
    listener = socket.socket(socket.AF_UNIX)
    try:
        uid = 3_000_000 + secrets.randbelow(1_000_000)  # one process budget per test
        user = HostUser(uid=uid, gid=uid)
        make_busybox_image(base / "image")
        for name in ("ws", "tool"):
            (base / name).mkdir(mode=0o755)
        os.chown(base / "ws", uid, uid)
        run_dir = base / "state" / "runs" / handle.run_id
        run_dir.mkdir(parents=True)
        for path in (base / "state", base / "state" / "runs", run_dir):
            path.chmod(0o755)
        listener.bind(str(run_dir / "gateway.sock"))
        yield Setup(
            base=base, image=base / "image", run_id=handle.run_id, netns=handle.path, user=user
        )
    finally:
        listener.close()
        remove_run_netns(handle.name)
        shutil.rmtree(base, ignore_errors=True)


async def launch(setup: Setup, *command: str) -> ExecResult:
    plan = build_plan(
        run_id=setup.run_id,
        workspace_host=str(setup.base / "ws"),
        policy_paths=[],
        gateway_socket_host=str(setup.base / "state" / "runs" / setup.run_id / "gateway.sock"),
        cogni_tool_host_dir=str(setup.base / "tool"),
        command=command,
        extra_env_names=[],
        env_values={},
        state_dir=str(setup.base / "state"),
        netns_path=str(setup.netns),
        layout=probe_host_layout(),
        image_dir=str(setup.image),
    )
    return await run_in_sandbox(plan, netns=setup.netns, limits=LIMITS, host_user=setup.user)


def test_the_busybox_image_lacks_only_python3(setup: Setup) -> None:
    [problem] = check_image(setup.image).problems
    assert problem.startswith("/usr/bin/python3 does not lead to a file in the image")


async def test_the_sandbox_sees_the_images_usr_and_not_the_hosts(setup: Setup) -> None:
    assert Path("/usr/bin").is_dir()  # the host has a /usr/bin; the image does not
    result = await launch(setup, "/bin/busybox", "ls", "/usr")
    assert (result.exitCode, result.stdout, result.stderr) == (0, f"{MARKER}\n".encode(), b"")


async def test_the_hosts_etc_does_not_enter_an_image_sandbox(setup: Setup) -> None:
    assert Path("/etc/os-release").is_file()  # on the host
    result = await launch(
        setup, "/bin/sh", "-c", "ls /etc; test -e /etc/os-release; echo os-release=$?; id -u"
    )
    # Only the generated files, mounted over the image's empty ones.
    assert result.stdout == b"group\nhosts\npasswd\nos-release=1\n1000\n", result.stderr


async def test_the_workspace_is_writable_and_the_image_is_not(setup: Setup) -> None:
    result = await launch(
        setup,
        "/bin/sh",
        "-c",
        "echo hi > /workspace/made && echo workspace-ok; "
        "touch /usr/made 2>&1; touch /made 2>&1; touch /bin/made 2>&1; true",
    )
    lines = result.stdout.decode().splitlines()
    assert lines[0] == "workspace-ok"
    assert lines[1:] == [
        f"touch: {p}: Read-only file system" for p in ("/usr/made", "/made", "/bin/made")
    ]
    assert (setup.base / "ws" / "made").read_text() == "hi\n"
    assert not (setup.image / "usr" / "made").exists()
    assert sorted(os.listdir(setup.image)) == sorted(
        ["bin", "dev", "etc", "opt", "proc", "run", "tmp", "usr", "workspace"]
    )


async def test_an_image_missing_a_mount_point_does_not_start_and_the_check_names_it(
    setup: Setup,
) -> None:
    (setup.image / "workspace").rmdir()
    result = await launch(setup, "/bin/busybox", "true")
    assert result.exitCode != 0
    assert b"workspace" in result.stderr, result.stderr  # bwrap's own complaint
    assert any(p.startswith("/workspace is missing") for p in check_image(setup.image).problems)


@pytest.mark.parametrize("relative", ["", "run", "etc"])
async def test_an_image_directory_others_cannot_traverse_does_not_start_and_the_check_names_it(
    setup: Setup, relative: str
) -> None:
    # Why the check insists on o+x: bwrap runs as the per-run uid, an "other" to the image.
    (setup.image / relative).chmod(0o750)
    result = await launch(setup, "/bin/busybox", "true")
    assert result.exitCode != 0
    assert b"Permission denied" in result.stderr, result.stderr
    assert any("not traversable by others" in p for p in check_image(setup.image).problems)
