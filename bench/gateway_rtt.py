"""Round trip of `time.now` through a real gatewayd (durable audit on) beside a bare
trio unix-socket echo server with the same framing, measured in the same run.

    .venv/bin/python bench/gateway_rtt.py [--calls 5000] [--seconds 3]

Prints p50/p99 latency over one persistent connection, and calls per second with 1,
8 and 64 concurrent connections (each connection one call in flight), with the
ratio to the echo baseline. Targets: p50 <= 2x echo; >= 8,000 calls/s at 8.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (
    ROOT,
    echo_server,
    env_info,
    gatewayd_run,
    latency,
    percentile,
    throughput,
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=5000, help="sequential calls for latency")
    ap.add_argument("--seconds", type=float, default=3.0, help="duration of each load step")
    args = ap.parse_args()
    print(f"gateway_rtt: {env_info()}; durable audit (fdatasync, group commit) on")

    results: dict[str, dict[str, float]] = {}
    with echo_server() as echo_path:
        lat = latency(echo_path, "x", "echo", args.calls)
        results["echo"] = {"p50": percentile(lat, 50), "p99": percentile(lat, 99)}
        for c in (1, 8, 64):
            results["echo"][f"rps{c}"] = throughput(echo_path, "x", "echo", c, args.seconds)
    with gatewayd_run(ROOT / "bench" / "policy.yaml") as (sock, run_id):
        lat = latency(sock, run_id, "gateway", args.calls)
        results["gateway"] = {"p50": percentile(lat, 50), "p99": percentile(lat, 99)}
        for c in (1, 8, 64):
            results["gateway"][f"rps{c}"] = throughput(sock, run_id, "gateway", c, args.seconds)

    e, g = results["echo"], results["gateway"]
    print(f"{'metric':<28}{'gatewayd':>14}{'echo baseline':>16}{'ratio':>10}")
    for key, label, unit, scale in (
        ("p50", "round trip p50", "us", 1e6),
        ("p99", "round trip p99", "us", 1e6),
        ("rps1", "calls/s, 1 connection", "/s", 1),
        ("rps8", "calls/s, 8 connections", "/s", 1),
        ("rps64", "calls/s, 64 connections", "/s", 1),
    ):
        print(
            f"{label:<28}{g[key] * scale:>12.0f}{unit}{e[key] * scale:>14.0f}{unit}"
            f"{g[key] / e[key]:>9.2f}x"
        )
    p50_ok = g["p50"] <= 2 * e["p50"]
    rps_ok = g["rps8"] >= 8000
    print(
        f"target p50 <= 2x echo: {'met' if p50_ok else 'NOT met'}; "
        f">= 8000 calls/s at 8 connections: {'met' if rps_ok else 'NOT met'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
