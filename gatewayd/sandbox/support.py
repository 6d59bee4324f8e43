"""Can this host build gatewayd's OS sandbox? Asked once, at daemon start.

``require_os_sandbox``: where bubblewrap or namespaces are missing,
a run whose policy requires the sandbox is refused, and one whose policy says
``require_os_sandbox: false`` runs degraded (no isolation, every call audited as such).
The probe does what a run does, in small: it starts bwrap as an unprivileged uid with
a new user, pid and mount namespace, so a kernel that forbids unprivileged user
namespaces, a missing bwrap or a daemon that is not root all show up here, with the
reason, instead of as the first run's failure.
"""

from __future__ import annotations

import ctypes
import errno
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from gatewayd.errors import GatewayError
from gatewayd.files import LIBC
from gatewayd.sandbox.launch import (
    LauncherFailed,
    launcher_missing,
    launcher_runnable,
    start_launched,
)
from gatewayd.sandbox.limits import HostUser
from gatewayd.sandbox.netns import NetnsError, create_run_netns, netns_name, remove_run_netns
from gatewayd.sandbox.seccomp import build_filter

USERNS_SYSCTL: Final = Path("/proc/sys/user/max_user_namespaces")
# The probe is one tiny bwrap start; a host that takes longer is broken, not slow.
PROBE_TIMEOUT_S: Final = 10.0
# The probe's namespace: a run id no run gets (runs are random; this one is all zeros).
PROBE_RUN_ID: Final = "0" * 32
# bwrap's `--ro-bind / /` remounts every mount beneath /; one that another process
# unmounts meanwhile (a run's network namespace torn down by this or another gatewayd)
# fails that start with this message. A host that cannot build a sandbox fails every
# time: a few tries tell the two apart.
PROBE_ATTEMPTS: Final = 3
MOUNT_RACE: Final = "Unable to apply mount flags"
PROBE_RETRY_PAUSE_S: Final = 0.05
# The new mount API's system call numbers (x86_64) and flags (<linux/mount.h>, <fcntl.h>).
SYS_OPEN_TREE: Final = 428
SYS_MOVE_MOUNT: Final = 429
AT_FDCWD: Final = -100
OPEN_TREE_CLONE: Final = 1


@dataclass(frozen=True, slots=True)
class SandboxSupport:
    """Whether runs get the OS sandbox; ``reason`` says why not, for the operator."""

    available: bool
    reason: str = ""


# What a sandboxed run needs of gatewayd, with the capability's bit (<linux/capability.h>);
# why each: docs/operations.md, "Capabilities".
REQUIRED_CAPABILITIES: Final = {
    "CAP_CHOWN": 0,
    "CAP_DAC_OVERRIDE": 1,
    "CAP_FOWNER": 3,
    "CAP_KILL": 5,
    "CAP_SETGID": 6,
    "CAP_SETUID": 7,
    "CAP_NET_ADMIN": 12,
    "CAP_SYS_PTRACE": 19,
    "CAP_SYS_ADMIN": 21,
}


def missing_capabilities(status: Path = Path("/proc/self/status")) -> list[str]:
    """The required capabilities this process does not hold in its effective set (root
    or not: a root process may run with a reduced bounding set)."""
    effective = 0
    for line in status.read_text().splitlines():
        if line.startswith("CapEff:"):
            effective = int(line.split()[1], 16)
    return [name for name, bit in REQUIRED_CAPABILITIES.items() if not effective >> bit & 1]


def probe_os_sandbox(bwrap: str, probe_user: HostUser, netns_prefix: str) -> SandboxSupport:
    """Check the pieces a run needs: root (network namespaces, uid switch), user
    namespaces, the seccomp filter (libseccomp), a network namespace (made and removed
    under ``netns_prefix``), and bwrap actually starting a sandbox as ``probe_user``.
    Blocking."""
    missing = missing_capabilities()
    if missing:
        return SandboxSupport(
            False,
            f"gatewayd lacks {', '.join(missing)}: making a run's network namespace, "
            "lending its workspace and starting its sandbox as a per-run uid need them "
            "(run it as root, or give them as ambient capabilities: docs/operations.md)",
        )
    try:
        if int(USERNS_SYSCTL.read_text()) < 1:
            return SandboxSupport(
                False, f"user namespaces are disabled ({USERNS_SYSCTL} is 0); set it above 0"
            )
    except (OSError, ValueError) as exc:
        return SandboxSupport(False, f"cannot read {USERNS_SYSCTL}: {exc}")
    if not os.access(bwrap, os.X_OK):
        return SandboxSupport(
            False, f"bubblewrap is not installed at {bwrap} (Debian: apt-get install bubblewrap)"
        )
    try:
        build_filter()  # every command gets this filter: without libseccomp, none starts
    except GatewayError as exc:
        return SandboxSupport(False, f"the seccomp filter cannot be built: {exc}")
    mount_api = _mount_api_missing()
    if mount_api:
        return SandboxSupport(False, mount_api)
    try:
        create_run_netns(PROBE_RUN_ID, prefix=netns_prefix)
        remove_run_netns(netns_name(PROBE_RUN_ID, prefix=netns_prefix))
    except NetnsError as exc:
        return SandboxSupport(False, f"a run's network namespace cannot be made: {exc}")

    argv = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-ipc", "--ro-bind", "/", "/"]
    argv += ["--proc", "/proc", "--dev", "/dev", "--cap-drop", "ALL", "--", "/bin/true"]
    if not launcher_runnable():
        return SandboxSupport(False, launcher_missing("not an executable file"))
    for attempt in range(1, PROBE_ATTEMPTS + 1):
        try:
            done = _probe_start(argv, probe_user)
        except LauncherFailed as exc:
            return SandboxSupport(False, f"cannot start {bwrap}: could not {exc}")
        except subprocess.TimeoutExpired:
            return SandboxSupport(False, f"{bwrap} did not end within {PROBE_TIMEOUT_S:g} s")
        except (OSError, subprocess.SubprocessError) as exc:
            return SandboxSupport(False, f"cannot start {bwrap}: {launcher_missing(exc)}")
        if done.returncode == 0:
            return SandboxSupport(True)
        detail = done.stderr.decode(errors="replace").strip() or f"exit {done.returncode}"
        if MOUNT_RACE not in detail or attempt == PROBE_ATTEMPTS:
            break
        time.sleep(PROBE_RETRY_PAUSE_S)
    return SandboxSupport(
        False,
        f"bubblewrap cannot build a sandbox as an unprivileged uid: {detail} (are "
        "unprivileged user namespaces allowed? kernel.unprivileged_userns_clone)",
    )


def _probe_start(argv: list[str], probe_user: HostUser) -> subprocess.CompletedProcess[bytes]:
    """``argv`` through the launcher as ``probe_user``, as a run's command starts (in this
    network namespace, no cgroup, no rlimit), to its end."""
    process = start_launched(
        argv,
        netns_fd=-1,
        user=probe_user,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        out, err = process.communicate(timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    return subprocess.CompletedProcess(argv, process.returncode, out, err)


def _mount_api_missing() -> str:
    """Why the new mount API the launcher attaches pinned directories with is unusable
    here ('' when it works): open_tree (Linux 5.2) cloning a mount, and move_mount."""
    tree = LIBC.syscall(SYS_OPEN_TREE, AT_FDCWD, b"/", OPEN_TREE_CLONE | os.O_CLOEXEC)
    if tree < 0:
        err = ctypes.get_errno()
        return f"open_tree cannot clone a mount ({os.strerror(err)}); Linux 5.2 or later is needed"
    os.close(tree)  # a detached copy, never attached: closing it frees it
    # Invalid on purpose: any answer but ENOSYS says the call exists.
    if LIBC.syscall(SYS_MOVE_MOUNT, -1, b"", -1, b"", 0) < 0 and ctypes.get_errno() == errno.ENOSYS:
        return "move_mount is not available; Linux 5.2 or later is needed"
    return ""
