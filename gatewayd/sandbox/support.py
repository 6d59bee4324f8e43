"""Can this host build gatewayd's OS sandbox? Asked once, at daemon start.

Reference note 003's ``require_os_sandbox``: where bubblewrap or namespaces are missing,
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
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from gatewayd.errors import GatewayError
from gatewayd.sandbox.launch import AT_FDCWD, OPEN_TREE_CLONE, SYS_MOVE_MOUNT, SYS_OPEN_TREE
from gatewayd.sandbox.limits import HostUser
from gatewayd.sandbox.netns import NetnsError, create_run_netns, netns_name, remove_run_netns
from gatewayd.sandbox.seccomp import build_filter

USERNS_SYSCTL: Final = Path("/proc/sys/user/max_user_namespaces")
# The probe is one tiny bwrap start; a host that takes longer is broken, not slow.
PROBE_TIMEOUT_S: Final = 10.0
# The probe's namespace: a run id no run gets (runs are random; this one is all zeros).
PROBE_RUN_ID: Final = "0" * 32


@dataclass(frozen=True, slots=True)
class SandboxSupport:
    """Whether runs get the OS sandbox; ``reason`` says why not, for the operator."""

    available: bool
    reason: str = ""


def probe_os_sandbox(bwrap: str, probe_user: HostUser, netns_prefix: str) -> SandboxSupport:
    """Check the pieces a run needs: root (network namespaces, uid switch), user
    namespaces, the seccomp filter (libseccomp), a network namespace (made and removed
    under ``netns_prefix``), and bwrap actually starting a sandbox as ``probe_user``.
    Blocking."""
    if os.geteuid() != 0:
        return SandboxSupport(
            False,
            "gatewayd is not running as root: creating a run's network namespace and "
            "starting its sandbox as a per-run uid need root (or CAP_SYS_ADMIN + CAP_SETUID)",
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
    missing = _mount_api_missing()
    if missing:
        return SandboxSupport(False, missing)
    try:
        create_run_netns(PROBE_RUN_ID, prefix=netns_prefix)
        remove_run_netns(netns_name(PROBE_RUN_ID, prefix=netns_prefix))
    except NetnsError as exc:
        return SandboxSupport(False, f"a run's network namespace cannot be made: {exc}")

    def drop() -> None:
        os.setgroups([])
        os.setresgid(probe_user.gid, probe_user.gid, probe_user.gid)
        os.setresuid(probe_user.uid, probe_user.uid, probe_user.uid)

    argv = [bwrap, "--unshare-user", "--unshare-pid", "--unshare-ipc", "--ro-bind", "/", "/"]
    argv += ["--proc", "/proc", "--dev", "/dev", "--cap-drop", "ALL", "--", "/bin/true"]
    try:
        done = subprocess.run(
            argv,
            env={},
            capture_output=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
            preexec_fn=drop,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return SandboxSupport(False, f"cannot start {bwrap}: {exc}")
    if done.returncode != 0:
        detail = done.stderr.decode(errors="replace").strip() or f"exit {done.returncode}"
        return SandboxSupport(
            False,
            f"bubblewrap cannot build a sandbox as an unprivileged uid: {detail} (are "
            "unprivileged user namespaces allowed? kernel.unprivileged_userns_clone)",
        )
    return SandboxSupport(True)


def _mount_api_missing() -> str:
    """Why the new mount API the launcher attaches pinned directories with is unusable
    here ('' when it works): open_tree (Linux 5.2) cloning a mount, and move_mount."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    tree = libc.syscall(SYS_OPEN_TREE, AT_FDCWD, b"/", OPEN_TREE_CLONE | os.O_CLOEXEC)
    if tree < 0:
        err = ctypes.get_errno()
        return f"open_tree cannot clone a mount ({os.strerror(err)}); Linux 5.2 or later is needed"
    os.close(tree)  # a detached copy, never attached: closing it frees it
    # Invalid on purpose: any answer but ENOSYS says the call exists.
    if libc.syscall(SYS_MOVE_MOUNT, -1, b"", -1, b"", 0) < 0 and ctypes.get_errno() == errno.ENOSYS:
        return "move_mount is not available; Linux 5.2 or later is needed"
    return ""
