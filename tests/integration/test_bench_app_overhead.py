"""Smoke test of bench/app_overhead.py: one counted repetition runs end to end (two fake
providers, an in-process gatewayd with the OS sandbox, an app invoked through the
dispatcher twice: every review a miss, then every one a cache hit) and prints every
figure. The bench wraps gatewayd's objects by name (the dispatcher's handle and review
step, the reviewer, model_client.complete, the run manager's start_child and end, the
audit log's durable), so this also catches a rename that would leave a wrapper unused.
Figures only: no time is asserted."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.integration.test_run_sandbox import _unavailable

pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))

ENV = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
# A figure; one made by difference can come out negative on a loaded host.
MS = r"-?[\d,]+\.\d{2} ms"
US = r"-?[\d,]+ us"


def run_bench(*options: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "app_overhead.py"), *options],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    return done.stdout


def test_app_overhead_bench_prints_each_part_of_an_invocation_for_a_miss_and_a_hit() -> None:
    out = run_bench("--reps", "1", "--plain-reads", "2")
    assert "OS sandbox on, durable audit on" in out
    assert "10 tool calls (9 fs, 1 exec), 11 model turns" in out
    for label in (
        "the app call, whole (Dispatcher.handle on the caller)",
        "model: the app's 11 turns",
        "review: 10 reviews",
        "of which the reviewer model's calls",
        "tools: 9 fs calls",
        "tools: 1 exec (sandbox.exec, a bwrap start)",
        "sandbox: child run start (RunManager.start_child)",
        "sandbox: child run end (RunManager.end)",
        "gateway: the 10 calls' dispatch less tools, reviewer",
        "rest of the invocation (by difference)",
    ):
        # one figure for the miss, one for the hit
        assert re.search(rf"{re.escape(label)}\s+{MS}\s+{MS}", out), (label, out)
    # A hit asks no model: the reviewer's model time of the hit column is nothing.
    assert re.search(rf"of which the reviewer model's calls\s+{MS}\s+0\.00 ms", out), out
    for label in (
        "plain run, review off, back to back",
        "plain run, review off, after a model call",
        "app's child run, review miss",
        "app's child run, cache hit",
    ):
        # calls, whole, tool, (step 7, review), gateway, less tool, ratio, CPU, ratio
        row = rf"{re.escape(label)}\s+\d+\s+{US}\s+{US}\s+(-|{US})\s+(-|{US})\s+{US}\s+{US}"
        assert re.search(rf"{row}\s+-?[\d.]+x\s+{US}\s+-?[\d.]+x", out), (label, out)
