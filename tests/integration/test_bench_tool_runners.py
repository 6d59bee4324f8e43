"""Smoke test of bench/tool_runners.py: ``--quick`` runs end to end (the example tools
built, real ``gatewayd run``s with a tool directory, calls from inside the sandbox, fresh
daemons with an empty and a warm module cache, the engine alone) and prints every figure
and both targets. Figures only: no time is asserted."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0 or not os.path.exists("/usr/bin/bwrap"),
        reason="the bench's runs have real sandboxes: root and /usr/bin/bwrap",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("ziglang") is None,
        reason="the ziglang package (the dev extra) builds the example tools",
    ),
]

# A figure, and what it adds over its baseline (negative when it is faster).
MS = r"[\d,]+\.\d{3} ms"
VERSUS = rf"(\(baseline\)|[-+]{MS}, [\d.]+x)"


def test_tool_runners_bench_prints_every_variant_and_the_targets() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "tool_runners.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    out = done.stdout
    assert "OS sandbox on, durable audit on" in out
    rows = {
        "fs.read of a small file (built-in)": 10,
        "text.wordcount (wasm, warm: a fresh instance per call)": 10,
        "files.lines (process: a fresh sandbox per call)": 4,
        "fs.read (built-in)": 2,
        "text.wordcount, cold: an empty module cache (compiled)": 2,
        "text.wordcount, cache hit: the module loaded from disk": 2,
        "text.wordcount, the run's second call (warm)": 4,
        "compile (empty cache)": 3,
        "load from the disk cache (deserialize, link)": 3,
    }
    for label, n in rows.items():
        assert re.search(rf"{re.escape(label)}\s+{n}\s+{MS}\s+{MS}\s+{VERSUS}", out), (label, out)
    assert re.search(r"fs\.read of a small file \(built-in\)\s+10\s+.*\(baseline\)", out), out
    assert re.search(
        rf"warm wasm call over fs\.read at p50: [-+]{MS} \(target <= 2 ms\): (met|MISSED)", out
    ), out
    assert re.search(
        rf"cached module start: the engine's load from the cache {MS} \(target <= 10 ms\): (met|MISSED)",
        out,
    ), out
