"""What a tool folder's tool call costs through cogni gateway, beside ``fs.read`` measured
in the same run.

    .venv/bin/python bench/tool_runners.py [--rounds 5] [--calls 200] [--process-calls 20]
                                           [--starts 5] [--loads 20] [--warmup 20] [--quick]

Needs root, /usr/bin/bwrap and a system python3 (the in-sandbox client is standard
library only); builds the example tools first (``make tools``). Every gatewayd here is a
real ``gatewayd run`` (a daemon of its own, the OS sandbox on, the durable audit on: its
defaults) whose configuration lists a tool directory holding copies of
``examples/tools/wordcount`` (wasm) and ``examples/tools/py-lines`` (process). The calls
come from inside the run's sandbox (bench/tool_driver.py, copied into the workspace), on
the run's socket, with cogni-tool's framing: what an agent's calls cost.

(a) One run: ``fs.read`` of a small file (the built-in baseline), ``text.wordcount``
    (a warm wasm call: its module compiled and linked by then, a fresh instance per
    call) and ``files.lines`` (a process tool: a fresh sandbox per call), in
    ``--rounds`` interleaved rounds whose order rotates, ``--calls`` calls each
    (``--process-calls`` for the process tool) after ``--warmup``.
(b) ``--starts`` times each, in turn: a fresh ``gatewayd run`` whose first call is
    ``fs.read`` (what any first call of a fresh daemon costs: the baseline), one with an
    empty module cache, whose first ``text.wordcount`` call compiles the module
    (**cold**), and one whose cache (``tool_cache_dir``) already holds it, whose first
    call loads it from disk (**cache hit**); the wasm runs' second calls, warm, beside
    them.
(c) In this process, the engine alone (gatewayd.runners.wasm.WasmEngine): loading the
    module into a fresh engine from a warm disk cache, and compiling it into one with an
    empty cache, ``--loads`` times each.

Printed: p50 and p90 of each and what it adds at p50 over its baseline, then the
targets: a warm wasm call at most 2 ms over ``fs.read`` at p50, and a cached module's
start at most 10 ms. Figures only: nothing is asserted about time.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import BIN, ROOT, env_info, percentile

DRIVER: Final = Path(__file__).resolve().parent / "tool_driver.py"
SYSTEM_PYTHON: Final = "/usr/bin/python3"
BWRAP: Final = "/usr/bin/bwrap"
GATEWAYD: Final = str(BIN / "gatewayd")
EXAMPLES: Final = ROOT / "examples" / "tools"
# The example tools the bench calls: a wasm one and a process one.
TOOLS: Final = ("wordcount", "py-lines")
WASM_TOOL: Final = "wordcount"
# Each gatewayd here removes its prefix's network namespaces when it starts, and takes
# uids from its own range: random ones keep it apart from any other daemon on the host.
UIDS_PER_DAEMON: Final = 64
UID_BASE: Final = 1_760_000_000
# The small file fs.read and files.lines read: a few lines of text.
SMALL_FILE: Final = "".join(f"line {n}: the quick brown fox\n" for n in range(20))

POLICY: Final = """
version: 1
name: tool-runners-bench
description: fs.read and the example tools, the workspace read-write, limits out of the way.
tools:
  allow: [fs.read, text.wordcount, files.lines]
filesystem:
  paths:
    workspace: {root: ., mode: rw}
limits:
  call_timeout_s: 30
  calls_per_second: 1000000
  burst: 1000000
  max_concurrent_calls: 256
sandbox: {timeout_s: 3600, cpu_s: 3600}
"""


def unavailable() -> str | None:
    if os.geteuid() != 0 or not Path(BWRAP).exists():
        return "needs root and /usr/bin/bwrap (every run has a real sandbox)"
    if not Path(SYSTEM_PYTHON).exists():
        return f"needs {SYSTEM_PYTHON} (the in-sandbox client)"
    return None


def build_tools() -> None:
    """``make tools``: the example modules, built only when their sources changed, with
    this interpreter's ziglang (the virtualenv the bench runs from is not re-made)."""
    done = subprocess.run(
        ["make", "-s", "tools", "TOOL_NEEDS=", f"PY={sys.executable}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"make tools failed ({done.returncode}):\n{done.stderr[-3000:]}")


class Bench:
    """The bench's directory: the tool directory (copies of the examples), the policy,
    and one workspace, state directory and configuration per ``gatewayd run``."""

    def __init__(self) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="cg-toolb-", dir="/tmp"))
        self.base.chmod(0o711)  # the runs' uids pass through to their workspaces
        self.tools = self.base / "tools"
        self.tools.mkdir(mode=0o755)
        for name in TOOLS:
            shutil.copytree(EXAMPLES / name, self.tools / name)
        self.policy = self.base / "policy.yaml"
        self.policy.write_text(textwrap.dedent(POLICY))
        self.runs = 0

    def run(self, cache: Path, *driver_args: str) -> dict[str, list[float]]:
        """A fresh ``gatewayd run`` (its own daemon) whose command is the driver; its
        module cache is ``cache``."""
        self.runs += 1
        name = f"r{self.runs}"
        workspace = self.base / f"ws-{name}"
        workspace.mkdir()
        (workspace / "src").mkdir()
        (workspace / "src" / "small.txt").write_text(SMALL_FILE)
        shutil.copy(DRIVER, workspace / "tool_driver.py")
        uids = UID_BASE + secrets.randbelow(40_000) * UIDS_PER_DAEMON
        config = {
            "state_dir": str(self.base / f"state-{name}"),
            "netns_prefix": f"cgt{secrets.token_hex(4)}-",
            "sandbox_uids": {"base": uids, "count": UIDS_PER_DAEMON},
            "tool_dirs": [str(self.tools)],
            "tool_cache_dir": str(cache),
        }
        path = self.base / f"config-{name}.yaml"
        path.write_text(json.dumps(config))  # JSON is YAML
        argv = [
            GATEWAYD,
            "run",
            "--config",
            str(path),
            "--workspace",
            str(workspace),
            "--policy",
            str(self.policy),
            "--",
            SYSTEM_PYTHON,
            "-I",
            "/workspace/tool_driver.py",
            *driver_args,
        ]
        done = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"the in-sandbox driver failed ({done.returncode}):\n{done.stderr}")
        times: dict[str, list[float]] = json.loads(done.stdout.splitlines()[-1])
        return times

    def close(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)


def measure_starts(bench: Bench, starts: int) -> dict[str, list[float]]:
    """(b): first calls of fresh daemons, in turn; the warm cache is filled by a run of
    its own first."""
    warm_cache = bench.base / "cache-warm"
    bench.run(warm_cache, "first", "wasm")
    times: dict[str, list[float]] = {"builtin": [], "cold": [], "hit": [], "second": []}
    for n in range(starts):
        builtin = bench.run(bench.base / f"cache-builtin-{n}", "first", "fs_read")
        cold = bench.run(bench.base / f"cache-cold-{n}", "first", "wasm")
        hit = bench.run(warm_cache, "first", "wasm")
        times["builtin"] += builtin["first"]
        times["cold"] += cold["first"]
        times["hit"] += hit["first"]
        times["second"] += cold["second"] + hit["second"]
    return times


def measure_engine(bench: Bench, loads: int) -> dict[str, list[float]]:
    """(c): the engine alone, in this process: a fresh engine's load of the module from
    a warm disk cache, and its compile into an empty one."""
    from gatewayd.config import GatewaydConfig
    from gatewayd.runners.folders import load_folder, manifest_defaults
    from gatewayd.runners.spec import FolderTool
    from gatewayd.runners.wasm import WasmEngine

    tool = load_folder(
        bench.tools / WASM_TOOL,
        defaults=manifest_defaults(GatewaydConfig(state_dir=bench.base / "engine-state")),
    )
    if not isinstance(tool, FolderTool):
        raise SystemExit(f"the example {WASM_TOOL} does not load: {tool}")
    cache = bench.base / "engine-cache"
    with WasmEngine(cache) as engine:
        engine.load(tool)  # fills the disk cache
    times: dict[str, list[float]] = {"from_cache": [], "compile": []}
    for n in range(loads):
        for what, where in (("from_cache", cache), ("compile", bench.base / f"empty-{n}")):
            with WasmEngine(where) as engine:
                started = time.perf_counter()
                engine.load(tool)
                times[what].append(time.perf_counter() - started)
                if what == "from_cache" and engine.cache_hits != 1:
                    raise SystemExit("the engine compiled a module its disk cache holds")
    return times


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.3f} ms"


def table(title: str, rows: Sequence[tuple[str, list[float]]], baseline: list[float]) -> list[str]:
    """One group: each row's calls, p50, p90, and what it adds at p50 over ``baseline``."""
    base50 = percentile(baseline, 50)
    lines = [title, f"  {'variant':<64}{'n':>6}{'p50':>13}{'p90':>13}{'p50 vs baseline':>26}"]
    for label, values in rows:
        p50 = percentile(values, 50)
        versus = (
            "(baseline)"
            if values is baseline
            else f"{(p50 - base50) * 1e3:+,.3f} ms, {p50 / base50:.2f}x"
        )
        lines.append(
            f"  {label:<64}{len(values):>6}{ms(p50):>13}{ms(percentile(values, 90)):>13}"
            f"{versus:>26}"
        )
    return lines


def verdict(met: bool) -> str:
    return "met" if met else "MISSED"


def report(
    calls: dict[str, list[float]], starts: dict[str, list[float]], engine: dict[str, list[float]]
) -> None:
    lines = table(
        "(a) one call from inside a run's sandbox, over the run's socket",
        [
            ("fs.read of a small file (built-in)", calls["fs_read"]),
            ("text.wordcount (wasm, warm: a fresh instance per call)", calls["wasm"]),
            ("files.lines (process: a fresh sandbox per call)", calls["process"]),
        ],
        calls["fs_read"],
    )
    lines += table(
        "(b) the first call of a fresh gatewayd",
        [
            ("fs.read (built-in)", starts["builtin"]),
            ("text.wordcount, cold: an empty module cache (compiled)", starts["cold"]),
            ("text.wordcount, cache hit: the module loaded from disk", starts["hit"]),
            ("text.wordcount, the run's second call (warm)", starts["second"]),
        ],
        starts["builtin"],
    )
    lines += table(
        "(c) the engine alone: a fresh WasmEngine's load(tool), in this process",
        [
            ("compile (empty cache)", engine["compile"]),
            ("load from the disk cache (deserialize, link)", engine["from_cache"]),
        ],
        engine["compile"],
    )
    warm_extra = percentile(calls["wasm"], 50) - percentile(calls["fs_read"], 50)
    start_extra = percentile(starts["hit"], 50) - percentile(starts["builtin"], 50)
    load = percentile(engine["from_cache"], 50)
    lines += [
        "targets",
        f"  warm wasm call over fs.read at p50: {warm_extra * 1e3:+,.3f} ms (target <= 2 ms): "
        f"{verdict(warm_extra <= 0.002)}",
        f"  cached module start: the engine's load from the cache {ms(load)} (target <= 10 "
        f"ms): {verdict(load <= 0.010)}; a fresh daemon's first call, cache hit over "
        f"fs.read at p50: {start_extra * 1e3:+,.3f} ms: {verdict(start_extra <= 0.010)}",
    ]
    print("\n".join(lines))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--process-calls", type=int, default=20)
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--loads", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument(
        "--quick", action="store_true", help="a smoke test: 2 rounds of 5 calls, 2 starts"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.calls, args.process_calls = 2, 5, 2
        args.starts, args.loads, args.warmup = 2, 3, 2
    reason = unavailable()
    if reason is not None:
        print(f"skipped: {reason}", file=sys.stderr)
        return 1
    build_tools()
    bench = Bench()
    try:
        calls = bench.run(
            bench.base / "cache-calls",
            "warm",
            *(str(n) for n in (args.rounds, args.calls, args.process_calls, args.warmup)),
        )
        starts = measure_starts(bench, args.starts)
        engine = measure_engine(bench, args.loads)
    finally:
        bench.close()
    print(
        f"tool runners through gatewayd ({env_info()}; OS sandbox on, durable audit on): "
        f"{args.rounds} rounds of {args.calls} calls per variant ({args.process_calls} for "
        f"the process tool), {args.starts} fresh daemons each for fs.read, cold and cache hit, "
        f"{args.loads} engine loads each"
    )
    report(calls, starts, engine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
