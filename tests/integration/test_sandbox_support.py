"""The host probe behind require_os_sandbox: it starts what a run starts, in small, and
says why not when it cannot."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile

import pytest

from gatewayd.sandbox.limits import HostUser
from gatewayd.sandbox.netns import NETNS_RUN_DIR
from gatewayd.sandbox.support import PROBE_ATTEMPTS, PROBE_RUN_ID, probe_os_sandbox

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


RACE = (
    "bwrap: Can't bind mount /oldroot/ on /newroot/: Unable to apply mount flags: remount "
    '"/newroot/run/netns/gone": No such file or directory'
)


def fake_bwrap(failures: int) -> tuple[str, str]:
    """A stand-in for bwrap that fails ``failures`` times as a mount vanishing under
    `--ro-bind / /` makes it fail, then succeeds; it counts its starts. Made where the
    probe's unprivileged uid may run it and write the count."""
    folder = tempfile.mkdtemp(prefix="cg-fake-bwrap-")
    os.chmod(folder, 0o777)
    script = os.path.join(folder, "bwrap")
    with open(os.path.join(folder, "message"), "w") as message:
        message.write(RACE + "\n")
    with open(script, "w") as out:
        out.write(
            "#!/bin/sh\n"
            f"count={folder}/count\n"
            'n=0; [ -f "$count" ] && read n < "$count"\n'
            'echo $((n + 1)) > "$count"\n'
            f'if [ "$n" -lt {failures} ]; then /bin/cat {folder}/message >&2; exit 1; fi\n'
            "exit 0\n"
        )
    os.chmod(script, 0o755)
    return script, folder


def starts(folder: str) -> int:
    with open(os.path.join(folder, "count")) as count:
        return int(count.read())


def test_a_mount_that_vanishes_during_the_probe_is_tried_again() -> None:
    script, folder = fake_bwrap(failures=PROBE_ATTEMPTS - 1)
    try:
        available, reason, _ = probe(script)
        assert available and reason == ""
        assert starts(folder) == PROBE_ATTEMPTS
    finally:
        shutil.rmtree(folder)


def test_a_probe_that_fails_every_time_is_reported_after_its_tries() -> None:
    script, folder = fake_bwrap(failures=PROBE_ATTEMPTS)
    try:
        available, reason, _ = probe(script)
        assert not available and "Unable to apply mount flags" in reason
        assert starts(folder) == PROBE_ATTEMPTS
        # Another failure is not tried again: it is the host's, every time.
        other, _, _ = probe("/bin/false")
        assert not other
    finally:
        shutil.rmtree(folder)
