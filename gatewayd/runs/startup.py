"""Before the first run: the open-file limit, what a crashed daemon left behind, and what
this host's OS sandbox can do (:func:`prepare_host`, audited as ``leftovers_removed``
and ``sandbox_support``).
"""

from __future__ import annotations

import contextlib
import resource
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import trio

from gatewayd.audit import AuditEvent, AuditLog
from gatewayd.config import GatewaydConfig
from gatewayd.sandbox.cgroup import probe_cgroups, remove_empty_leftovers
from gatewayd.sandbox.plan import probe_host_layout
from gatewayd.sandbox.session import SandboxSettings, clean_leftovers, install_cogni_tool
from gatewayd.sandbox.support import SandboxSupport, probe_os_sandbox
from gatewayd.sandbox.uids import UidPool

log = structlog.get_logger("gatewayd.runs.startup")

# A blocking sweep of leftovers of gatewayd's own besides the runs' (an agent run's work
# directories): returns what it removed, and reports its own failure in that list.
Sweep = Callable[[], list[str]]


@dataclass(frozen=True, slots=True)
class HostSandbox:
    """What this host gives runs: whether the OS sandbox works (``support.reason`` says
    why not), and what every run's sandbox is made with (None without the sandbox)."""

    support: SandboxSupport
    settings: SandboxSettings | None = None


def raise_open_file_limit() -> int:
    """Lift the soft descriptor limit to the hard one (systemd's default soft limit is 1024):
    every connection, run socket, pinned directory and sandbox pipe is a descriptor, and
    running out would refuse every run at once. Returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return soft


async def prepare_host(
    config: GatewaydConfig,
    *,
    runs_dir: Path,
    uid_pool: UidPool,
    audit: AuditLog,
    sweeps: Mapping[str, Sweep] | None = None,
) -> HostSandbox:
    """At start: remove what a crashed daemon left, probe the OS sandbox, install the
    client copy. Audited; a host without the sandbox is logged loudly, not fatal
    (runs whose policy requires it are refused, with the reason).

    ``sweeps``: further leftovers to remove, by the key the ``leftovers_removed`` entry
    names them under (``agentDirs``: an agent run's work directories).
    """
    leftovers = await trio.to_thread.run_sync(
        _clean_leftovers_quietly,
        runs_dir,
        config.resolved_netns_prefix if config.os_sandbox else None,
    )
    for key, sweep in (sweeps or {}).items():
        removed = await trio.to_thread.run_sync(sweep)
        if removed:
            leftovers[key] = removed
    if any(leftovers.values()):
        log.warning("leftovers_removed", **leftovers)
        await audit.append("event", event=AuditEvent.LEFTOVERS_REMOVED, detail=leftovers)
    if not config.os_sandbox:
        support = SandboxSupport(
            False,
            "the OS sandbox is turned off in gatewayd's configuration (os_sandbox: false, "
            "from --no-os-sandbox, GATEWAYD_OS_SANDBOX or the configuration file)",
        )
    else:
        probe_user = uid_pool.acquire()
        try:
            support = await trio.to_thread.run_sync(
                probe_os_sandbox, config.bwrap, probe_user, config.resolved_netns_prefix
            )
        finally:
            # Its bwrap has exited; what it started may still be dying: looked at again
            # before the uid is lent.
            uid_pool.release(probe_user, processes_gone=False)
        if support.available:
            support = _state_dir_reachable(config.state_dir)
    detail: dict[str, Any] = {"available": support.available, "reason": support.reason}
    settings: SandboxSettings | None = None
    if support.available:
        cgroups = await trio.to_thread.run_sync(probe_cgroups)
        if not cgroups.available:
            log.warning("cgroups_unavailable", reason=cgroups.reason, fallback="rlimits")
        else:
            swept = await trio.to_thread.run_sync(
                remove_empty_leftovers, cgroups, leftovers.get("runDirs", [])
            )
            if swept:
                log.warning("leftover_cgroups_removed", cgroups=swept)
                detail["leftoverCgroups"] = swept
        detail["cgroups"] = cgroups.available
        detail["cgroupsReason"] = cgroups.reason or None
        settings = SandboxSettings(
            bwrap=config.bwrap,
            netns_prefix=config.resolved_netns_prefix,
            state_dir=config.state_dir,
            cogni_tool_dir=install_cogni_tool(config.state_dir),
            layout=probe_host_layout(),
            cgroups=cgroups if cgroups.available else None,
        )
    else:
        log.warning("os_sandbox_unavailable", reason=support.reason)
    await audit.append("event", event=AuditEvent.SANDBOX_SUPPORT, detail=detail)
    return HostSandbox(support, settings)


def _clean_leftovers_quietly(runs_dir: Path, prefix: str | None) -> dict[str, list[str]]:
    try:
        return clean_leftovers(runs_dir, prefix)
    except Exception as exc:  # e.g. not root: namespaces cannot be listed/removed
        log.warning("leftover_cleanup_failed", error=str(exc))
        return {"cleanupFailed": [str(exc)]}


def _state_dir_reachable(state_dir: Path) -> SandboxSupport:
    """bwrap runs as the run's uid and must reach the run's socket and the client copy
    in the state directory: every directory above it must let others pass (o+x)."""
    for directory in (state_dir, *state_dir.parents):
        if not directory.stat().st_mode & stat.S_IXOTH:
            return SandboxSupport(
                False,
                f"the state directory {state_dir} lies under {directory}, which other users "
                "cannot pass through (o+x), so a sandbox (running as an unprivileged uid) "
                f"cannot reach its socket; chmod o+x {directory} or choose another "
                "--state-dir",
            )
    return SandboxSupport(True)
