"""bench/anchors.py: the anchors that run here are timed side by side and printed with
their commands; one that is not installed is skipped with a line saying how to install
it (the npm anchors are looked for in a prefix of the test's own, so here they are
never found). Figures only: no time is asserted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.integration.test_run_sandbox import _unavailable

pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))

BENCH = ROOT / "bench" / "anchors.py"
ENV = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
ROW = r"\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+  "


def run_bench(*options: str) -> str:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--iterations", "2", "--warmup", "0", *options],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    return done.stdout


def test_missing_npm_anchors_are_skipped_saying_how_to_install_them(tmp_path: Path) -> None:
    out = run_bench("--prefix", str(tmp_path), "--no-gatewayd")
    assert re.search(rf"^plain{ROW}/bin/true$", out, re.MULTILINE), out
    assert re.search(rf"^bwrap{ROW}/usr/bin/bwrap --ro-bind / / .*--unshare-all", out, re.M), out
    for name, package in (("codex", "@openai/codex"), ("srt", "@anthropic-ai/sandbox-runtime")):
        line = f"skipped {name}: not installed: npm install --prefix {tmp_path} {package}"
        assert line in out, out
        assert not re.search(rf"^{name}\s", out, re.MULTILINE), out
    assert "gatewayd" not in out.split("skipped", 1)[0]


def test_gatewayd_is_timed_beside_the_anchors(tmp_path: Path) -> None:
    out = run_bench("--prefix", str(tmp_path))
    assert re.search(rf"^gatewayd{ROW}POST /v1/runs/RUN/exec /bin/true", out, re.MULTILINE), out
    assert re.search(rf"^gw-cli{ROW}gatewayd exec --state-dir STATE RUN -- /bin/true$", out, re.M)
    assert re.search(rf"^bwrap{ROW}", out, re.MULTILINE), out
