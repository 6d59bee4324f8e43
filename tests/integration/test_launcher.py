"""gatewayd-launcher (gatewayd/sandbox/launcher.c), run for real as root: what the program
it execs is left with (uid, groups, capabilities, no_new_privs, the parent-death signal,
rlimits, network namespace, cgroup, descriptors), and each failing step named, with
nothing started. bwrap is not involved here: the launched program is the system python,
which reports on itself; test_sandbox_launch.py runs the launcher with bwrap."""

from __future__ import annotations

import json
import os
import resource
import secrets
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from gatewayd.sandbox import launch
from gatewayd.sandbox.cgroup import create_command_cgroup, probe_cgroups
from gatewayd.sandbox.launch import (
    LAUNCHER,
    LauncherFailed,
    launcher_argv,
    start_launched,
)
from gatewayd.sandbox.limits import HostUser
from gatewayd.sandbox.netns import create_run_netns, remove_run_netns
from gatewayd.sandbox.support import probe_os_sandbox

PY = "/usr/bin/python3"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="the launcher joins a netns and drops to another uid: needs root"
)

# What the launched program says of itself: one JSON line on stdout.
REPORT = r"""
import ctypes, json, os, resource
libc = ctypes.CDLL(None, use_errno=True)
sig = ctypes.c_int(0)
libc.prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
held = {}
for fd in range(3, 1024):
    try:
        os.fstat(fd)
    except OSError:
        continue
    try:
        held[fd] = os.readlink(f"/proc/self/fd/{fd}")
    except OSError as exc:
        held[fd] = str(exc)
print(json.dumps({
    "ids": [os.getuid(), os.geteuid(), os.getgid(), os.getegid()],
    "groups": os.getgroups(),
    "caps": {k: status[k].strip() for k in ("CapInh", "CapPrm", "CapEff", "CapAmb")},
    "no_new_privs": status["NoNewPrivs"].strip(),
    "pdeathsig": sig.value,
    "nofile": resource.getrlimit(resource.RLIMIT_NOFILE),
    "core": resource.getrlimit(resource.RLIMIT_CORE),
    "netns": os.readlink("/proc/self/ns/net"),
    "cgroup": open("/proc/self/cgroup").read(),
    "sid_is_pid": os.getsid(0) == os.getpid(),
    "environ": open("/proc/self/environ", "rb").read().decode(),
    "held": held,
}))
"""


def fresh_user() -> HostUser:
    uid = 3_000_000 + secrets.randbelow(1_000_000)
    return HostUser(uid=uid, gid=uid)


@pytest.fixture
def netns_fd() -> Iterator[tuple[int, str]]:
    handle = create_run_netns(secrets.token_hex(16))
    fd = os.open(handle.path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        yield fd, f"net:[{os.fstat(fd).st_ino}]"
    finally:
        os.close(fd)
        remove_run_netns(handle.name)


def run_report(
    *,
    netns: int = -1,
    user: HostUser | None = None,
    pins: list[tuple[int, str]] | None = None,
    limits: tuple[tuple[int, int, int], ...] = (),
    joins: tuple[bytes, ...] = (),
    pass_fds: tuple[int, ...] = (),
) -> dict[str, object]:
    process = start_launched(
        [PY, "-I", "-c", REPORT],
        netns_fd=netns,
        user=user or fresh_user(),
        joins=joins,
        pins=pins or [],
        limits=limits,
        pass_fds=pass_fds,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    report: dict[str, object] = json.loads(out)
    return report


def test_the_program_runs_as_the_user_with_nothing_of_root_left(
    netns_fd: tuple[int, str],
) -> None:
    fd, namespace = netns_fd
    user = fresh_user()
    limits = ((resource.RLIMIT_NOFILE, 64, 64), (resource.RLIMIT_CORE, 0, 0))
    report = run_report(netns=fd, user=user, limits=limits)
    assert report["ids"] == [user.uid, user.uid, user.gid, user.gid]
    assert report["groups"] == []
    zero = "0000000000000000"
    assert report["caps"] == {"CapInh": zero, "CapPrm": zero, "CapEff": zero, "CapAmb": zero}
    assert report["no_new_privs"] == "1"
    assert report["pdeathsig"] == 9  # SIGKILL, kept across the exec
    assert report["nofile"] == [64, 64] and report["core"] == [0, 0]
    assert report["netns"] == namespace != os.readlink("/proc/self/ns/net")
    assert report["sid_is_pid"] is True  # a session of its own
    assert report["environ"] == ""  # as exec'd (python adds LC_CTYPE to os.environ)


def test_without_a_namespace_descriptor_the_program_stays_in_this_one() -> None:
    assert run_report()["netns"] == os.readlink("/proc/self/ns/net")


def test_the_program_holds_none_of_the_descriptors_the_launcher_was_given(
    netns_fd: tuple[int, str],
) -> None:
    fd, _ = netns_fd
    with tempfile.TemporaryDirectory(prefix="cg-launcher-") as scratch:
        pinned = Path(scratch) / "pinned"
        point = Path(scratch) / "point"
        pinned.mkdir()
        point.mkdir()
        (pinned / "mark").write_text("pinned\n")
        pin = os.open(pinned, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        kept = os.memfd_create("cg-kept", os.MFD_CLOEXEC)  # as bwrap's data descriptors
        try:
            report = run_report(netns=fd, pins=[(pin, str(point))], pass_fds=(kept,))
        finally:
            os.close(pin)
            os.close(kept)
        # Only what was passed on for the program: the namespace, the pinned directory
        # and the report pipe are closed before the exec.
        assert report["held"] == {str(kept): "/memfd:cg-kept (deleted)"}
        # The pinned copy was attached in a mount namespace of the program's own.
        assert not (point / "mark").exists()


def test_a_pinned_directory_is_attached_at_its_mount_point() -> None:
    with tempfile.TemporaryDirectory(prefix="cg-launcher-") as scratch:
        pinned = Path(scratch) / "pinned"
        point = Path(scratch) / "point"
        pinned.mkdir()
        point.mkdir()
        (pinned / "mark").write_text("pinned\n")
        os.chmod(scratch, 0o755)
        pin = os.open(pinned, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            process = start_launched(
                ["/bin/cat", str(point / "mark")],
                netns_fd=-1,
                user=fresh_user(),
                pins=[(pin, str(point))],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            out, err = process.communicate(timeout=30)
        finally:
            os.close(pin)
    assert (process.returncode, out) == (0, b"pinned\n"), err


def test_the_program_starts_inside_the_command_cgroup() -> None:
    support = probe_cgroups()
    if not support.available:
        pytest.skip(f"needs cgroups gatewayd may create: {support.reason}")
    run_id = secrets.token_hex(16)
    cgroup = create_command_cgroup(
        support, run_id=run_id, memory_bytes=256 * 1024**2, max_processes=16
    )
    try:
        report = run_report(joins=cgroup.join_files)
    finally:
        trio.run(cgroup.remove)
    assert f"cogni-{run_id}-" in str(report["cgroup"])


@pytest.mark.parametrize(
    ("kwargs", "step"),
    [
        ({"joins": (b"/nonexistent/cg/tasks",)}, "join the command's cgroup: [Errno 2]"),
        ({"netns_fd": "devnull"}, "join the run's network namespace: [Errno 22]"),
        ({"pins": "pipe"}, "attach the pinned directories: [Errno "),
        ({"pins": "no point"}, "attach the pinned directories: [Errno 2]"),
        ({"limits": ((resource.RLIMIT_NOFILE, 64, 32),)}, "set the rlimits: [Errno 22]"),
        ({"argv": ["/nonexistent/bwrap"]}, "execute it: [Errno 2] No such file or directory"),
    ],
    ids=["cgroup", "netns", "pin-pipe", "pin-point", "rlimit", "exec"],
)
def test_a_failing_step_is_named_and_nothing_is_started(
    kwargs: dict[str, object], step: str, tmp_path: Path
) -> None:
    marker = tmp_path / "started"
    argv: list[str] = [PY, "-I", "-c", f"open({str(marker)!r}, 'w')"]
    options: dict[str, object] = {"netns_fd": -1}
    opened: list[int] = []
    for key, value in kwargs.items():
        if value == "devnull":
            fd = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
            opened.append(fd)
            options[key] = fd
        elif value == "pipe":  # not a directory: no mount to copy
            fd, other = os.pipe2(os.O_CLOEXEC)
            opened += [fd, other]
            options[key] = [(fd, str(tmp_path))]
        elif value == "no point":
            fd = os.open(tmp_path, os.O_PATH | os.O_CLOEXEC)
            opened.append(fd)
            options[key] = [(fd, str(tmp_path / "missing"))]
        elif key == "argv":
            argv = value  # type: ignore[assignment]
        else:
            options[key] = value
    try:
        with pytest.raises(LauncherFailed) as caught:
            start_launched(argv, user=fresh_user(), **options)  # type: ignore[arg-type]
    finally:
        for fd in opened:
            os.close(fd)
    assert str(caught.value).startswith(step), caught.value
    assert not marker.exists()


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["x"],
        ["3"],  # the report descriptor only
        ["3", "-1", "0", "1000", "0", "0", "0", "/bin/true"],  # uid 0
        ["3", "-1", "1000", "0", "0", "0", "0", "/bin/true"],  # gid 0
        ["3", "-2", "1000", "1000", "0", "0", "0", "/bin/true"],
        ["3", "-1", "1000", "1000", "99", "0", "0", "/bin/true"],  # too many joins
        ["3", "-1", "1000", "1000", "1", "/x/tasks"],  # counts past the end
        ["3", "-1", "1000", "1000", "0", "1", "4", "relative", "0", "/bin/true"],
        ["3", "-1", "1000", "1000", "0", "0", "1", "7", "-1", "5", "/bin/true"],
        ["3", "-1", "1000", "1000", "0", "0", "1", "7", "1x", "5", "/bin/true"],
        ["3", "-1", "1000", "1000", "0", "0", "1", "99", "1", "1", "/bin/true"],
        ["3", "-1", "1000", "1000", "0", "0", "0"],  # no program
        ["3", "-1", "1000", "1000", "0", "0", "0", "true"],  # not an absolute path
        ["3", "-1", " 1000", "1000", "0", "0", "0", "/bin/true"],
        ["3", "-1", "1000", "1000", "0", "0", "0x0", "/bin/true"],
        ["3", "-1", "99999999999999999999", "1000", "0", "0", "0", "/bin/true"],
    ],
)
def test_arguments_it_cannot_read_stop_it_before_any_step(args: list[str]) -> None:
    read_end, write_end = os.pipe()
    try:
        line = [LAUNCHER, str(write_end), *args[1:]] if args[:1] == ["3"] else [LAUNCHER, *args]
        done = subprocess.run(line, pass_fds=(write_end,), capture_output=True, timeout=10)
        os.close(write_end)
        write_end = -1
        said = os.read(read_end, 512) + done.stderr
    finally:
        os.close(read_end)
        if write_end >= 0:
            os.close(write_end)
    assert done.returncode == 127
    assert said.startswith(b"read its arguments: [Errno 22] Invalid argument"), said
    assert done.stdout == b""


def test_the_command_line_it_gets_is_the_documented_one() -> None:
    line = launcher_argv(
        ["/usr/bin/bwrap", "--", "/bin/true"],
        report_fd=9,
        netns_fd=7,
        user=HostUser(uid=1234, gid=5678),
        joins=(b"/cg/memory/x/tasks", b"/cg/pids/x/tasks"),
        pins=[(11, "/run/x/mnt/0")],
        limits=((7, 64, 64),),
    )
    assert line == [
        LAUNCHER,
        *("9", "7", "1234", "5678"),
        *("2", "/cg/memory/x/tasks", "/cg/pids/x/tasks"),
        *("1", "11", "/run/x/mnt/0"),
        *("1", "7", "64", "64"),
        *("/usr/bin/bwrap", "--", "/bin/true"),
    ]


def test_a_missing_launcher_says_how_to_build_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "LAUNCHER", "/nonexistent/gatewayd-launcher")
    support = probe_os_sandbox("/usr/bin/bwrap", fresh_user(), f"cgl{secrets.token_hex(3)}-")
    assert not support.available
    assert "/nonexistent/gatewayd-launcher cannot be run" in support.reason
    assert "`make setup` builds it" in support.reason
    with pytest.raises(FileNotFoundError):
        start_launched(["/bin/true"], netns_fd=-1, user=fresh_user())
