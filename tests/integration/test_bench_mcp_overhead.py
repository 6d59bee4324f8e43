"""Smoke test of bench/mcp_overhead.py: ``--quick`` runs end to end (an in-sandbox driver
in one run, host clients through more ``gatewayd run``s, mcp-server-time directly and
declared behind gatewayd, pinned with ``gatewayd mcp pin``) and prints every figure.
Figures only: no time is asserted."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.integration.test_mcp_pypi_servers_run import _skip_reason

# What the bench needs is what the PyPI servers' tests need: root, bwrap, a system
# python3 of this minor version, mcp-server-time installed.
pytestmark = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))

# A figure, and what it adds over its baseline (negative when it is faster).
MS = r"[\d,]+\.\d{3} ms"
VERSUS = rf"(\(baseline\)|[-+]{MS}, [\d.]+x)"


def test_mcp_overhead_bench_prints_every_variant() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "mcp_overhead.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    out = done.stdout
    assert "OS sandbox on, durable audit on" in out
    assert "2 rounds of 5 calls per variant (2 for cogni-tool exec)" in out
    rows = {
        "cogni-tool exec time.now '{}' (a process per call)": 4,
        "MCP tools/call: std-lib client -> cogni-tool mcp": 10,
        "MCP tools/call: official SDK client -> cogni-tool mcp": 10,
        "MCP tools/call: host std-lib client -> gatewayd run -> cogni-tool mcp": 10,
        "MCP tools/call: host SDK client -> gatewayd run -> cogni-tool mcp": 10,
        "official SDK client -> mcp-server-time on the host (direct)": 10,
        "std-lib client -> mcp-server-time on the host (direct)": 10,
        "SDK client -> gatewayd run -> mcp-server-time in a sandbox (relayed)": 10,
        "std-lib client -> gatewayd run -> mcp-server-time in a sandbox (relayed)": 10,
    }
    for label, calls in rows.items():
        row = rf"{re.escape(label)}\s+{calls}\s+{MS}\s+{MS}\s+{VERSUS}"
        assert re.search(row, out), (label, out)
    # Each group's first row is its baseline.
    assert re.search(r"\(a process per call\)\s+4\s+.*\(baseline\)", out), out
    assert re.search(r"mcp-server-time on the host \(direct\)\s+10\s+.*\(baseline\)", out), out
    # (c): the declared server's tool through the chokepoint, beside the direct call.
    (c_section,) = re.findall(r"^\(c\).*(?:\n  .*)*", out, flags=re.MULTILINE)
    behind = {
        "in the sandbox: std-lib client -> cogni-tool mcp -> gatewayd -> server": 10,
        "in the sandbox: SDK client -> cogni-tool mcp -> gatewayd -> server": 10,
        "SDK client -> gatewayd run -> cogni-tool mcp -> gatewayd -> server": 10,
        "std-lib client -> the same": 10,
        "SDK client -> the same, audit_fsync: false": 10,
        "std-lib client -> the same, audit_fsync: false": 10,
    }
    for label, calls in behind.items():
        row = rf"{re.escape(label)}\s+{calls}\s+{MS}\s+{MS}\s+{VERSUS}"
        assert re.search(row, c_section), (label, c_section)
    assert re.search(r"on the host \(direct\)\s+10\s+.*\(baseline\)", c_section), c_section
    # The in-sandbox rows against the direct calls the driver made beside them.
    for label in (
        "official SDK client -> mcp-server-time in the sandbox (direct)",
        "std-lib client -> mcp-server-time in the sandbox (direct)",
    ):
        row = rf"{re.escape(label)}\s+10\s+{MS}\s+{MS}\s+{VERSUS}"
        assert re.search(row, c_section), (label, c_section)
    assert re.search(r"in the sandbox \(direct\)\s+10\s+.*\(baseline\)", c_section), c_section


def test_rows_c_measures_the_declared_server_rows_alone() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "mcp_overhead.py"), "--quick", "--rows", "c"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    out = done.stdout
    assert "rows c;" in out
    assert not re.search(r"^\((a|b)\)", out, flags=re.MULTILINE), out
    assert "(a process per call)" not in out and "(relayed)" not in out, out
    (c_section,) = re.findall(r"^\(c\).*(?:\n  .*)*", out, flags=re.MULTILINE)
    for label in (
        "official SDK client -> mcp-server-time on the host (direct)",
        "official SDK client -> mcp-server-time in the sandbox (direct)",
        "in the sandbox: SDK client -> cogni-tool mcp -> gatewayd -> server",
        "std-lib client -> the same, audit_fsync: false",
    ):
        row = rf"{re.escape(label)}\s+10\s+{MS}\s+{MS}\s+{VERSUS}"
        assert re.search(row, c_section), (label, c_section)
