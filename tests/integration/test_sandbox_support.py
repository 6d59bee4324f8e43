"""The host probe behind require_os_sandbox: it starts what a run starts, in small, and
says why not when it cannot."""

from __future__ import annotations

import os
import secrets

import pytest

from gatewayd.sandbox.limits import HostUser
from gatewayd.sandbox.netns import NETNS_RUN_DIR
from gatewayd.sandbox.support import PROBE_RUN_ID, probe_os_sandbox

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/usr/bin/bwrap"),
    reason="the probe's positive case needs root and bubblewrap",
)


def probe(bwrap: str = "/usr/bin/bwrap") -> tuple[bool, str, str]:
    prefix = f"cgt{secrets.token_hex(4)}-"
    uid = 1_700_000_000 + secrets.randbelow(50_000) * 1024
    support = probe_os_sandbox(bwrap, HostUser(uid=uid, gid=uid), prefix)
    return support.available, support.reason, prefix


def test_a_healthy_host_is_available_and_the_probe_leaves_no_namespace() -> None:
    available, reason, prefix = probe()
    assert available and reason == ""
    assert not (NETNS_RUN_DIR / f"{prefix}{PROBE_RUN_ID}").exists()


def test_missing_bubblewrap_is_reported_with_the_package_to_install() -> None:
    available, reason, _ = probe("/nonexistent/bwrap")
    assert not available
    assert "bubblewrap is not installed at /nonexistent/bwrap" in reason
    assert "apt-get install bubblewrap" in reason


def test_a_bwrap_that_cannot_build_a_sandbox_is_reported_with_its_error() -> None:
    available, reason, _ = probe("/bin/false")
    assert not available
    assert "bubblewrap cannot build a sandbox as an unprivileged uid" in reason
    assert "unprivileged_userns_clone" in reason
