"""What the audit log costs a call, and what answering only after the result entry is
durable costs (invariant RESULT_BEFORE_REPLY), side by side in one run.

    .venv/bin/python bench/audit_cost.py [--rounds 3] [--calls 2000] [--seconds 2]

One in-process daemon per variant and tool, driven over the run's unix socket by
bench/load.py in a separate process: latency over ``--calls`` sequential calls on one
connection (p50, p99), then calls per second with 1 and 8 connections (one call in
flight on each) for ``--seconds`` each. Variants, in a fresh order every round:

  reply after result   the product's default: every answer waits for its result entry
  opt-out              audit_reply_after_result: false (answers leave at once; result
                       entries ride the next flush, within RESULT_SYNC_DELAY_S)
  fdatasync off        diagnostic only (audit_fsync: false): entries are written by the
                       flusher thread but never synced

Tools: ``time.now`` (declared side-effect free: by default its call and result entries
share one flush) and ``fs.write`` (a side effect: its call entry is flushed before it
runs, and by default its result entry again before the answer). The figures at the end
are medians of all samples (latency) and of the rounds (calls/s), with the fdatasyncs
each call cost.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import trio

from gatewayd.config import GatewaydConfig
from gatewayd.daemon import open_daemon
from gatewayd.logs import configure_logging
from gatewayd.runs import Grant, RunRequest

ROOT = Path(__file__).resolve().parent.parent
LOAD = str(ROOT / "bench" / "load.py")
TOOLS = ("time.now", "fs.write")
CONNECTIONS = (1, 8)
# The run's limits stay out of the way: the bench measures the audit, not the policy.
POLICY = """\
version: 1
name: audit-cost
description: time.now and fs.write with limits out of the way, for bench/audit_cost.py.
tools:
  allow: [time.now, fs.write]
filesystem:
  paths:
    workspace: {root: ., mode: rw, suffixes: [.txt]}
require_os_sandbox: false
limits:
  call_timeout_s: 10
  calls_per_second: 1000000
  burst: 1000000
  max_concurrent_calls: 256
"""


@dataclass(frozen=True)
class Variant:
    label: str
    fsync: bool
    reply_after_result: bool


VARIANTS = (
    Variant("reply after result (default)", fsync=True, reply_after_result=True),
    Variant("opt-out: reply before result", fsync=True, reply_after_result=False),
    Variant("fdatasync off (diagnostic)", fsync=False, reply_after_result=True),
)


@dataclass
class Figures:
    latencies: list[float]
    rps: dict[int, float]
    calls: int
    fsyncs: int


async def measure(variant: Variant, tool: str, calls: int, seconds: float) -> Figures:
    base = Path(tempfile.mkdtemp(prefix="cg-ac-", dir="/tmp"))
    (base / "ws").mkdir()
    (base / "policies").mkdir()
    (base / "policies" / "audit-cost.yaml").write_text(POLICY)
    try:
        config = GatewaydConfig(
            state_dir=base / "state",
            policy_dirs=(base / "policies",),
            audit_fsync=variant.fsync,
            audit_reply_after_result=variant.reply_after_result,
            os_sandbox=False,
        )
        async with open_daemon(config, preload=True) as daemon:
            run = await daemon.runs.start(
                RunRequest(
                    workspacePath=str(base / "ws"),
                    policy="audit-cost",
                    actorId="bench",
                    tenantId="bench",
                    grant=Grant(allowSandbox=True),
                )
            )
            sock, rid = str(run.socket_path), run.run_id
            fsyncs_before = daemon.audit.fsync_count
            lat = await trio.run_process(
                [sys.executable, LOAD, sock, rid, "gateway", "latency", str(calls), tool],
                capture_stdout=True,
            )
            latencies = list(json.loads(lat.stdout))
            done, rps = len(latencies), {}
            for conns in CONNECTIONS:
                what = ["load", str(conns), str(seconds), tool]
                load = await trio.run_process(
                    [sys.executable, LOAD, sock, rid, "gateway", *what], capture_stdout=True
                )
                result = json.loads(load.stdout)
                done += result["calls"]
                rps[conns] = result["calls"] / result["seconds"]
            return Figures(latencies, rps, done, daemon.audit.fsync_count - fsyncs_before)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=2000, help="sequential calls for latency")
    ap.add_argument("--seconds", type=float, default=2.0, help="duration of each load step")
    args = ap.parse_args()
    configure_logging(logging.ERROR)  # a daemon per measurement: its start-up lines would drown it
    print(
        f"audit_cost: in-process gatewayd; p50/p99 over {args.calls} sequential calls, "
        f"calls/s at {' and '.join(map(str, CONNECTIONS))} connections; {args.rounds} rounds"
    )
    runs: dict[tuple[str, str], list[Figures]] = {}
    for round_no in range(1, args.rounds + 1):
        order = [(v, t) for v in VARIANTS for t in TOOLS]
        random.shuffle(order)
        for variant, tool in order:
            got = trio.run(measure, variant, tool, args.calls, args.seconds)
            runs.setdefault((variant.label, tool), []).append(got)
            print(
                f"  round {round_no}  {tool:<8}  {variant.label:<30}  "
                f"p50 {percentile(got.latencies, 50) * 1e6:6.0f} us  "
                f"p99 {percentile(got.latencies, 99) * 1e6:6.0f} us  "
                + "  ".join(f"{c} conn {got.rps[c]:6.0f}/s" for c in CONNECTIONS)
                + f"  {got.fsyncs / got.calls:.2f} fdatasyncs/call",
                flush=True,
            )
    print()
    header = f"{'tool':<9}{'variant':<31}{'p50':>9}{'p99':>9}"
    header += "".join(f"{f'{c} conn/s':>10}" for c in CONNECTIONS) + f"{'syncs/call':>12}"
    print(header)
    for tool in TOOLS:
        for variant in VARIANTS:
            figures = runs[(variant.label, tool)]
            pooled = [x for f in figures for x in f.latencies]
            line = (
                f"{tool:<9}{variant.label:<31}"
                f"{percentile(pooled, 50) * 1e6:>7.0f}us{percentile(pooled, 99) * 1e6:>7.0f}us"
            )
            for c in CONNECTIONS:
                line += f"{statistics.median(f.rps[c] for f in figures):>10.0f}"
            syncs = sum(f.fsyncs for f in figures) / sum(f.calls for f in figures)
            print(line + f"{syncs:>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
