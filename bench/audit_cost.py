"""Where a call's time goes: the same in-process daemon with the audit log's fdatasync
on and off (the entries are written either way), one sequential connection for
latency and 8 connections for throughput, alternating to even out machine noise.

    .venv/bin/python bench/audit_cost.py [--rounds 2]

A diagnostic for docs/performance.md, not a product setting: gatewayd itself always
syncs the audit log.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import trio

from gatewayd.daemon import DaemonConfig, open_daemon
from gatewayd.runs import Grant, RunRequest

ROOT = Path(__file__).resolve().parent.parent
LOAD = str(ROOT / "bench" / "load.py")


async def measure(fsync: bool) -> tuple[float, float, int]:
    base = Path(tempfile.mkdtemp(prefix="cg-ac-", dir="/tmp"))
    (base / "ws").mkdir()
    try:
        config = DaemonConfig(state_dir=base / "state", audit_fsync=fsync)
        async with open_daemon(config) as daemon:
            run = await daemon.start_run(
                RunRequest(
                    workspacePath=str(base / "ws"),
                    policy=str(ROOT / "bench" / "policy.yaml"),
                    actorId="bench",
                    tenantId="bench",
                    grant=Grant(allowSandbox=True),
                )
            )
            sock, rid = str(run.socket_path), run.run_id
            lat = await trio.run_process(
                [sys.executable, LOAD, sock, rid, "gateway", "latency", "3000"], capture_stdout=True
            )
            load = await trio.run_process(
                [sys.executable, LOAD, sock, rid, "gateway", "load", "8", "2"], capture_stdout=True
            )
            times = sorted(json.loads(lat.stdout))
            result = json.loads(load.stdout)
            return (
                times[len(times) // 2],
                result["calls"] / result["seconds"],
                daemon.audit.fsync_count,
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    print("audit_cost: in-process gatewayd, time.now; p50 over 3000 sequential calls, calls/s at 8")
    for _ in range(args.rounds):
        for fsync in (False, True):
            p50, rps, syncs = trio.run(measure, fsync)
            print(
                f"  fdatasync {'on ' if fsync else 'off'}  p50 {p50 * 1e6:7.0f} us  "
                f"8 connections {rps:7.0f} calls/s  ({syncs} fdatasyncs)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
