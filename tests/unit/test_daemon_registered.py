"""A daemon's start says, in its log, which dead daemons' entries it removed from the
host's registry (the operator's only sign that a daemon had died without its stop).

The registry here is a directory of the test's own: the host's is shared with every
other test's daemons, any of whose starts may sweep a dead entry first."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from gatewayd import daemon as daemon_module
from gatewayd.sandbox.daemons import DaemonShare, register_daemon


def share(base: Path, name: str, pid: int) -> DaemonShare:
    return DaemonShare(
        state_dir=base / name / "state",
        agent_dir=base / name / "agent",
        netns_prefix=None,
        uids=None,
        pid=pid,
    )


def dead_entries(registry: Path, *dead: DaemonShare) -> None:
    """Entries whose daemons died: each written and flocked while the others lived, then
    every descriptor closed without the entry's removal (what the kernel does at a
    SIGKILL)."""
    registrations = [register_daemon(d, directory=registry) for d in dead]
    for registration in registrations:
        os.close(registration._fd)
        registration._fd = -1  # released by the "death": nothing left to release


async def test_a_start_that_removed_dead_entries_logs_each_dead_daemon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = tmp_path / "daemons"
    dead_entries(registry, share(tmp_path, "a", 4_000_001), share(tmp_path, "b", 4_000_002))
    monkeypatch.setattr(
        daemon_module, "register_daemon", lambda s: register_daemon(s, directory=registry)
    )
    with capture_logs() as logs:
        async with daemon_module._registered(share(tmp_path, "live", os.getpid())) as reg:
            assert sorted(d.pid for d in reg.stale) == [4_000_001, 4_000_002]
            assert len(list(registry.glob("*.json"))) == 1  # this daemon's own entry
    [note] = [e for e in logs if e["event"] == "dead_daemons_unregistered"]
    assert note["log_level"] == "warning"
    assert sorted(d["pid"] for d in note["daemons"]) == [4_000_001, 4_000_002]
    assert list(registry.glob("*.json")) == []  # and its own is gone at its end


async def test_a_start_with_no_dead_entry_says_nothing_of_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = tmp_path / "daemons"
    monkeypatch.setattr(
        daemon_module, "register_daemon", lambda s: register_daemon(s, directory=registry)
    )
    with capture_logs() as logs:
        async with daemon_module._registered(share(tmp_path, "live", os.getpid())) as reg:
            assert reg.stale == []
    assert [e for e in logs if e["event"] == "dead_daemons_unregistered"] == []
