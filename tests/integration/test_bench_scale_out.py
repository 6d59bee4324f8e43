"""Smoke test of bench/scale_out.py: the smallest run of it goes end to end (a Temporal
dev server, the fake provider, one worker then two, `gatewayd agent run` beside them)
and prints every figure. Figures only: no time is asserted."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.integration.test_run_sandbox import _unavailable

pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))

MS = r"[\d,]+ ms"
RATE = r"\d+ runs in [\d,]+\.\d s = [\d,]+\.\d runs/min \([\d,]+\.\d\d s a run\)"


def test_the_bench_prints_latency_and_throughput_for_each_path() -> None:
    argv = [
        sys.executable, str(ROOT / "bench" / "scale_out.py"),
        "--runs", "1", "--latency-runs", "1", "--max-runs", "1", "--no-warm-up",
    ]  # fmt: skip
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    out = done.stdout
    assert re.search(rf"submit -> worker \(Temporal\): {MS} \(1 run\)", out), out
    assert re.search(rf"gatewayd agent run \(process start\): {MS} \(1 run\)", out), out
    assert re.search(rf"one worker: {RATE}", out), out
    assert re.search(rf"two workers: {RATE}", out), out
    assert re.search(rf"gatewayd agent run, one host: {RATE}", out), out
    assert "runs on worker-a" in out
