"""Smoke test of bench/model_overhead.py: with --quick it runs end to end (a fake provider,
litellm in-process, a real `gatewayd serve` and model.chat over a run's socket) and
prints its figures; so do its diagnostics, which wrap gatewayd by name. Figures only:
whether the target is met is not asserted."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.conftest import ROOT

ENV = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
# A stage is a difference of two clocks' medians: on a loaded host it can come out
# slightly negative, and the line is still there.
MS = r"-?[\d,]+\.\d{3} ms"


def run_bench(*options: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "model_overhead.py"), "--quick", *options],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_model_overhead_bench_quick_prints_every_variant_the_added_p50_and_the_verdict() -> None:
    done = run_bench()
    out = done.stdout
    for label in (
        "litellm.acompletion, direct (baseline)",
        "litellm.completion (sync), direct",
        "model.chat via gatewayd (cogni_tool Client)",
        "time.now via gatewayd (same Client, no model)",
        "openai SDK -> cogni-tool serve -> model.chat",
    ):
        # p50, p90 and p99 of every variant
        assert re.search(rf"{re.escape(label)}\s+{MS}\s+{MS}\s+{MS}", out), out
    assert re.search(rf"model\.chat via gatewayd \(cogni_tool Client\).*[+-]{MS}\s+[\d.]+x", out)
    assert re.search(rf"dispatch, steps 3-12 \(the audit's durationMs\)\s+{MS}", out), out
    assert re.search(rf"target: .*: (MET|NOT MET): [+-]{MS}", out), out
    assert "durable audit on" in out
    assert "round 2/2" in done.stderr  # progress goes to stderr


def test_model_overhead_bench_diagnostics_still_find_what_they_wrap_in_gatewayd() -> None:
    out = run_bench("--stages", "--no-fsync").stdout
    assert re.search(rf"litellm returns -> complete\(\) resumes on trio's thread\s+{MS}", out), out
    assert re.search(rf"before complete\(\): admission, durable audit entry\s+{MS}", out), out
    assert "durable audit OFF (diagnostic" in out
