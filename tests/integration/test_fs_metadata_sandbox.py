"""fs.stat and fs.list, called with cogni-tool from inside a real run's sandbox, tell
nothing about an inode outside the workspace that a hard link brings in, nor where a
symlink points.

The host (the test) makes the hard link: the sandbox cannot, its workspace is another
mount there. The whole class of entry kinds is in tests/unit/test_fs_tools.py; this is
the same rule proven end to end: socket, dispatch, policy, audit, runner, and back.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from gatewayd.daemon import open_daemon
from tests.integration.test_run_sandbox import Sandboxed, _unavailable, sandbox_config

pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))

POLICY = """
version: 1
name: metadata
tools:
  allow: [fs.read, fs.list, fs.stat]
filesystem:
  paths:
    workspace: {root: ., mode: rw}
limits: {calls_per_second: 1000, burst: 1000}
sandbox: {timeout_s: 30, cpu_s: 20, max_processes: 48, max_output_bytes: 65536}
"""

# The outside file's facts, each distinctive enough to be recognised in any output.
OUTSIDE_SIZE = 31_337
OUTSIDE_MODE = 0o4751
OUTSIDE_MTIME_NS = 1_000_000_000_123_000_000  # 2001-09-09T01:46:40.123Z
OUTSIDE_NAMES = 4  # names of that inode, the one in the workspace included

# Each call in the sandbox, its exit status and output, as JSON for the host to judge.
PROBE = """
import json, subprocess
calls = {
    "stat_link": ["fs.stat", {"path": "linked.txt"}],
    "stat_symlink": ["fs.stat", {"path": "where"}],
    "list": ["fs.list", {"pattern": "**"}],
    "read_link": ["fs.read", {"path": "linked.txt"}],
}
out = {}
for name, (tool, args) in calls.items():
    done = subprocess.run(["cogni-tool", "exec", tool, json.dumps(args)],
                          capture_output=True, text=True)
    out[name] = {"rc": done.returncode, "out": done.stdout, "err": done.stderr}
print(json.dumps(out))
"""


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="cg-md-", dir="/tmp"))
    path.chmod(0o711)  # the sandbox's uid passes through to its workspace and socket
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def sb(base: Path) -> AsyncIterator[Sandboxed]:
    async with open_daemon(sandbox_config(base), preload=True) as daemon:
        assert daemon.runs.support.available, daemon.runs.support.reason
        yield Sandboxed(daemon, base)


async def test_stat_and_list_from_the_sandbox_tell_nothing_of_a_hard_linked_host_file(
    sb: Sandboxed, base: Path
) -> None:
    # A host file (it stands for /etc/shadow): one inode with names outside the workspace.
    outside = base / "host-secret"
    outside.write_bytes(b"s" * OUTSIDE_SIZE)
    outside.chmod(OUTSIDE_MODE)
    os.utime(outside, ns=(OUTSIDE_MTIME_NS, OUTSIDE_MTIME_NS))
    for index in range(OUTSIDE_NAMES - 2):
        os.link(outside, base / f"host-name-{index}")
    ws = sb.workspace()
    os.link(outside, ws / "linked.txt")
    (ws / "where").symlink_to(outside)  # its length would be the host path's
    assert os.stat(ws / "linked.txt").st_nlink == OUTSIDE_NAMES

    run = await sb.run(POLICY, workspace=ws)
    result = await sb.py(run, PROBE)
    assert result.exitCode == 0, result.stderr
    calls: dict[str, dict[str, Any]] = json.loads(result.stdout)

    for name in ("stat_link", "stat_symlink", "list", "read_link"):
        shown = calls[name]["out"] + calls[name]["err"]
        for fact in ("31337", "4751", "2001-09-09", str(base)):
            assert fact not in shown, f"{name}: {fact!r} from outside the workspace: {shown}"

    assert calls["stat_link"]["rc"] == 0, calls["stat_link"]["err"]
    described = json.loads(calls["stat_link"]["out"])
    assert described.pop("note").startswith("one of several hard links to the same file")
    assert described == {
        "path": "/workspace/linked.txt",
        "type": "file",
        "size": None,
        "mtime": None,
        "mode": None,
        "hardLinked": True,
    }

    assert calls["stat_symlink"]["rc"] == 0, calls["stat_symlink"]["err"]
    symlink = json.loads(calls["stat_symlink"]["out"])
    assert (symlink["type"], symlink["size"]) == ("symlink", None)

    assert calls["list"]["rc"] == 0, calls["list"]["err"]
    entries = json.loads(calls["list"]["out"])["entries"]
    assert entries == [
        {"path": "/workspace/linked.txt", "type": "file", "size": None, "hardLinked": True},
        {"path": "/workspace/notes.md", "type": "file", "size": 6},  # the workspace's own
        {"path": "/workspace/where", "type": "symlink", "size": None},
    ]

    # fs.read refuses it by the same rule (policy_denied: exit 15), without the link count.
    assert calls["read_link"]["rc"] == 15, calls["read_link"]
    refusal = calls["read_link"]["err"]
    assert "policy_denied: '/workspace/linked.txt' is one of several hard links" in refusal
    assert "only files with a single link can be read or written" in refusal
    assert re.search(r"\d", refusal) is None, refusal

    # Every call went through the chokepoint and was audited as the sandbox's.
    audited = [e for e in await sb.entries() if e["kind"] == "call"]
    assert [(c["tool"], c["decision"]) for c in audited] == [
        ("fs.stat", "allow"),
        ("fs.stat", "allow"),
        ("fs.list", "allow"),
        ("fs.read", "allow"),
    ]
    await sb.daemon.runs.end(run.run_id)
    assert outside.read_bytes() == b"s" * OUTSIDE_SIZE
