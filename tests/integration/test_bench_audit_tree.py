"""Smoke test of bench/audit_tree.py: small sizes run end to end and print every figure
(the append cost with and without the tree, signing, and both proofs per size).
Figures only: whether the targets are met is not asserted."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def test_audit_tree_bench_prints_every_figure() -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "audit_tree.py"),
            "--entries",
            "500",
            "--rounds",
            "1",
            "--sizes",
            "100,1000",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    for label in (
        "tree off",
        "tree on",
        "the tree adds",
        "TreeStore.append alone",
        "sign (Ed25519 note)",
        "write + history line, fsync",
        "size       100",
        "size      1000",
        "inclusion    wall median",
        "consistency  wall median",
    ):
        assert label in out, out
