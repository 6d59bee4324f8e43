"""Cold start of the in-sandbox client: wall time of one `cogni-tool exec time.now '{}'`
(a new process, a connection, one durable, audited call) beside a bare interpreter
start, `python3 -I -S -c pass`, with the same interpreter binary, in the same run.

    .venv/bin/python bench/cli_cold.py [--runs 40]

Target: cogni-tool at most 1.5x the bare start plus 5 ms.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import BIN, ROOT, compile_sources, env_info, gatewayd_run


def wall(cmd: list[str], env: dict[str, str], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=40)
    args = ap.parse_args()
    compile_sources()
    python = os.path.realpath(sys.executable)  # the binary behind the venv's python
    print(f"cli_cold: {env_info()}; interpreter {python}; {args.runs} runs each, medians")
    with gatewayd_run(ROOT / "bench" / "policy.yaml") as (sock, run_id):
        env = {
            "PATH": os.environ.get("PATH", ""),
            "COGNI_GATEWAY_SOCK": sock,
            "COGNI_RUN_ID": run_id,
        }
        cases = {
            "python3 -I -S -c pass": [python, "-I", "-S", "-c", "pass"],
            "cogni-tool exec time.now '{}'": [str(BIN / "cogni-tool"), "exec", "time.now", "{}"],
            "python3 -I -S -m cogni_tool exec time.now '{}' (no site)": [
                python,
                "-I",
                "-S",
                "-c",
                f"import sys; sys.path.insert(0, {str(ROOT)!r}); from cogni_tool.cli import main; "
                "sys.argv[1:] = ['exec', 'time.now', '{}']; sys.exit(main())",
            ],
        }
        for cmd in cases.values():  # warm the page cache and .pyc files
            wall(cmd, env, 3)
        results = {
            name: statistics.median(wall(cmd, env, args.runs)) for name, cmd in cases.items()
        }
    base = results["python3 -I -S -c pass"]
    for name, t in results.items():
        print(f"  {name:<58}{t * 1000:8.1f} ms{t / base:8.2f}x")
    cli = results["cogni-tool exec time.now '{}'"]
    limit = 1.5 * base + 0.005
    print(
        f"target cogni-tool <= 1.5x bare + 5 ms = {limit * 1000:.1f} ms: "
        f"{'met' if cli <= limit else 'NOT met'} ({cli * 1000:.1f} ms)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
