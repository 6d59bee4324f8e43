"""What an MCP ``tools/call`` costs through cogni gateway, beside baselines measured in
the same run.

    .venv/bin/python bench/mcp_overhead.py [--rounds 5] [--calls 200] [--exec-calls 20]
                                           [--warmup 20] [--quick] [--rows all|c]

Needs root, /usr/bin/bwrap, a system python3 of the dev virtualenv's minor version (the
SDK's and the servers' compiled packages load in the sandbox) and ``mcp-server-time``
(the dev extra). Every gatewayd here is a real ``gatewayd run`` (a daemon of its own, the
OS sandbox on, the durable audit on: its defaults).

(a) One gateway call, ``time.now``, made from inside a run's sandbox: through
    ``cogni-tool exec time.now '{}'`` (a process per call: what a shell script does; the
    baseline) and as an MCP ``tools/call`` through ``cogni-tool mcp``, driven by our
    standard-library client (bench/mcp_driver.py: the server side's cost alone) and by
    the official SDK client (``mcp`` on PyPI, imported from the dev virtualenv's
    site-packages, a read-only policy path). Then the same tools/call from a client on
    the host that starts ``gatewayd run ... -- cogni-tool mcp`` as its stdio server
    (gatewayd run relays the stream): what a host MCP client pays.
(b) ``mcp-server-time``'s ``get_current_time``: the official SDK client calling it as a
    subprocess on the host, directly (the baseline), and the same server started
    through ``gatewayd run`` in a sandbox (stdio relayed; the calls do not pass the
    gateway's chokepoint), with both clients.
(c) ``mcp-server-time`` behind gatewayd: declared in gatewayd's configuration
    (``mcp_servers``, a shared stdio server in a sandbox of its own), pinned with
    ``gatewayd mcp pin``, and its tool called as the gateway tool
    ``mcp.time.get_current_time`` through the chokepoint (policy, audit, pin check):
    from inside a run's sandbox through ``cogni-tool mcp`` (both clients), and by a
    client on the host through ``gatewayd run ... -- cogni-tool mcp``. Each group has
    its own direct baseline, measured beside it: the in-sandbox driver starts the same
    server directly (``/opt/mcp-venv``, its own subprocess, the same sandbox and system
    python3 as the declared server's) and interleaves those calls with its calls through
    gatewayd; the host rows are interleaved with (b)'s direct calls on the host. Against
    a baseline from another phase of the bench, the in-sandbox SDK row was +1.19 ms in
    one run and +2.38 ms in the next on the same tree (docs/performance.md). The host rows run
    once with the durable audit on (the default: two fdatasyncs per call, its call entry
    before the server sees it and its result entry before the answer) and once with
    ``audit_fsync: false``, which shows what the gateway adds beside the disk. The
    target: at most 2 ms over the direct SDK call at p50.

How the sandbox runs a PyPI server: the sandbox sees the system image, never /root (where
pyenv's interpreter behind the dev virtualenv lives), so the bench makes a virtualenv
from the system python3 whose packages are the dev virtualenv's (a .pth file), bound
read-only at /opt/mcp-venv, as tests/integration/test_mcp_pypi_servers_run.py does.

Each variant makes ``--calls`` sequential calls per round (``--exec-calls`` for
cogni-tool exec, a process each) after ``--warmup``, in ``--rounds`` rounds whose order
rotates. Printed: p50 and p90 of each and what it adds at p50 over its group's baseline.
``--rows c`` measures (c) alone (its baselines, the direct calls, included): fewer
processes, and a shorter run, for work on the gateway's own share of the call. Figures
only: nothing is asserted about time.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import secrets
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from collections.abc import Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Final, TextIO

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import BIN, env_info, percentile
from mcp_driver import Call, LineClient, line_call, run_rounds, sdk_call, sdk_session

DRIVER: Final = Path(__file__).resolve().parent / "mcp_driver.py"
SYSTEM_PYTHON: Final = "/usr/bin/python3"
BWRAP: Final = "/usr/bin/bwrap"
GATEWAYD: Final = str(BIN / "gatewayd")
TIME_SERVER: Final = "mcp-server-time"
# Where the sandbox sees the servers' virtualenv: not under /tmp, which is its own tmpfs.
VENV_VISIBLE: Final = "/opt/mcp-venv"
SITE_PACKAGES: Final = sysconfig.get_path("purelib")
# Where the sandbox sees the dev virtualenv's packages: a checkout may lie under /tmp,
# which the sandbox keeps for its own tmpfs, so they are mounted elsewhere.
SITE_VISIBLE: Final = "/opt/mcp-site"
# The same zone for every time server, so each does the same work.
TIME_ARGS: Final = ("--local-timezone", "UTC")
TIME_CALL: Final = ("get_current_time", {"timezone": "UTC"})
# Each gatewayd here removes its prefix's network namespaces when it starts, and takes
# uids from its own range: random ones keep it apart from any other daemon on the host.
UIDS_PER_DAEMON: Final = 64
UID_BASE: Final = 1_750_000_000

POLICY: Final = """
version: 1
name: mcp-bench
description: time.now, the PyPI servers' virtualenv read-only, limits out of the way.
tools:
  allow: [time.now, mcp.time.*]
filesystem:
  paths:
    workspace: {root: ., mode: rw}
    server_venv: {root: VENV, mount: VENV_VISIBLE, mode: ro}
    server_packages: {root: SITE_PACKAGES, mount: SITE_VISIBLE, mode: ro}
limits:
  call_timeout_s: 10
  calls_per_second: 1000000
  burst: 1000000
  max_concurrent_calls: 256
sandbox: {timeout_s: 3600, cpu_s: 3600}
"""


def unavailable() -> str | None:
    if os.geteuid() != 0 or not Path(BWRAP).exists():
        return "needs root and /usr/bin/bwrap (every variant runs in a real sandbox)"
    probe = subprocess.run(
        [SYSTEM_PYTHON, "-c", "import sys; print(sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=False,
    )
    if probe.stdout.strip() != str(sys.version_info[:2]):
        return (
            f"{SYSTEM_PYTHON} is Python {probe.stdout.strip() or '?'}, this one "
            f"{sys.version_info[:2]}: the SDK's compiled packages would not load in the sandbox"
        )
    if not (BIN / TIME_SERVER).exists():
        return f"{TIME_SERVER} is not installed: pip install -e '.[dev]'"
    return None


class Bench:
    """The bench's directory: the servers' virtualenv, the policy, and one workspace,
    state directory and stderr log per ``gatewayd run``."""

    def __init__(self) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="cg-mcpb-", dir="/tmp"))
        self.base.chmod(0o711)  # the runs' uids pass through to their workspaces
        self.venv = self.base / "venv"
        self._make_venv()
        self.policy = self.base / "policy.yaml"
        text = textwrap.dedent(POLICY)
        for name, value in (
            ("VENV_VISIBLE", VENV_VISIBLE),
            ("VENV", str(self.venv)),
            ("SITE_VISIBLE", SITE_VISIBLE),
            ("SITE_PACKAGES", SITE_PACKAGES),
        ):
            text = text.replace(name, value)
        self.policy.write_text(text)
        self.logs: list[TextIO] = []

    def _make_venv(self) -> None:
        subprocess.run([SYSTEM_PYTHON, "-m", "venv", "--without-pip", str(self.venv)], check=True)
        version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
        pth = self.venv / "lib" / version / "site-packages" / "dev-packages.pth"
        pth.write_text(SITE_VISIBLE + "\n")
        scripts = importlib.metadata.entry_points(group="console_scripts")
        (entry,) = [e for e in scripts if e.name == TIME_SERVER]
        script = self.venv / "bin" / TIME_SERVER
        script.write_text(
            f"#!{VENV_VISIBLE}/bin/python\nimport sys\n"
            f"from {entry.module} import {entry.attr}\nsys.exit({entry.attr}())\n"
        )
        script.chmod(0o755)

    def log(self, name: str) -> TextIO:
        """A file for ``name``'s stderr (gatewayd's lines and the server's)."""
        stream = (self.base / f"{name}.stderr").open("w+")
        self.logs.append(stream)
        return stream

    def run_argv(self, name: str, *command: str) -> list[str]:
        """``gatewayd run`` of ``command`` in a workspace of its own."""
        workspace = self.base / f"ws-{name}"
        workspace.mkdir()
        uids = UID_BASE + secrets.randbelow(40_000) * UIDS_PER_DAEMON
        return [
            GATEWAYD,
            "run",
            "--state-dir",
            str(self.base / f"state-{name}"),
            "--netns-prefix",
            f"cgb{secrets.token_hex(4)}-",
            "--sandbox-uids",
            f"{uids}+{UIDS_PER_DAEMON}",
            "--workspace",
            str(workspace),
            "--policy",
            str(self.policy),
            "--",
            *command,
        ]

    def tail(self) -> str:
        """The end of every stderr log, for a failure's report."""
        parts = []
        for stream in self.logs:
            stream.flush()
            stream.seek(0)
            parts.append(f"--- {stream.name}\n{stream.read()[-2000:]}")
        return "\n".join(parts)

    def close(self) -> None:
        for stream in self.logs:
            stream.close()
        shutil.rmtree(self.base, ignore_errors=True)


def measure_inside(bench: Bench, args: argparse.Namespace) -> dict[str, list[float]]:
    """(a) in one run's sandbox, and (c) from there: bench/mcp_driver.py copied into the
    workspace of a run whose gatewayd declares mcp-server-time, pinned; the driver also
    calls mcp-server-time directly (its own subprocess, in the same sandbox), the
    baseline of (c)'s in-sandbox rows."""
    config = behind_config(bench, "inside", fsync=True)
    workspace = bench.base / "ws-inside"
    workspace.mkdir()
    shutil.copy(DRIVER, workspace / "mcp_driver.py")
    counts = (args.rounds, args.calls, args.exec_calls, args.warmup)
    argv = [
        GATEWAYD,
        "run",
        "--config",
        str(config),
        "--workspace",
        str(workspace),
        "--policy",
        str(bench.policy),
        "--",
        SYSTEM_PYTHON,
        "-I",
        "/workspace/mcp_driver.py",
        "inside",
        *(str(n) for n in counts),
        SITE_VISIBLE,
        BEHIND_TOOL,
        args.rows,
        # The direct baseline beside (c)'s in-sandbox rows: the same server, from the
        # read-only virtualenv, a subprocess of the driver.
        f"{VENV_VISIBLE}/bin/{TIME_SERVER}",
        *TIME_ARGS,
    ]
    done = subprocess.run(
        argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"the in-sandbox driver failed ({done.returncode}):\n{done.stderr}")
    times: dict[str, list[float]] = json.loads(done.stdout.splitlines()[-1])
    return times


async def measure_host(bench: Bench, args: argparse.Namespace) -> dict[str, list[float]]:
    """(a) from the host through gatewayd run, and (b): every session opened first,
    then the calls interleaved."""
    tool, arguments = TIME_CALL
    direct = [str(BIN / TIME_SERVER), *TIME_ARGS]
    sandboxed = [f"{VENV_VISIBLE}/bin/{TIME_SERVER}", *TIME_ARGS]
    async with AsyncExitStack() as stack:

        def line_client(name: str, argv: Sequence[str]) -> LineClient:
            client = LineClient(argv, stderr=bench.log(name))
            stack.callback(client.close)
            client.initialize()
            return client

        async def sdk(name: str, argv: Sequence[str]) -> object:
            context = sdk_session(argv[0], argv[1:], errlog=bench.log(name))
            return await stack.enter_async_context(context)

        variants: dict[str, Call] = {}
        if args.rows == "all":
            cogni_raw = line_client("a-raw", bench.run_argv("a-raw", "cogni-tool", "mcp"))
            cogni_sdk = await sdk("a-sdk", bench.run_argv("a-sdk", "cogni-tool", "mcp"))
            variants["host_run_cogni_raw"] = line_call(cogni_raw, "time.now", {})
            variants["host_run_cogni_sdk"] = sdk_call(cogni_sdk, "time.now", {})
        time_sdk = await sdk("b-direct-sdk", direct)
        time_raw = line_client("b-direct-raw", direct)
        variants["time_direct_sdk"] = sdk_call(time_sdk, tool, arguments)
        variants["time_direct_raw"] = line_call(time_raw, tool, arguments)
        if args.rows == "all":
            relayed_sdk = await sdk("b-run-sdk", bench.run_argv("b-run-sdk", *sandboxed))
            relayed_raw = line_client("b-run-raw", bench.run_argv("b-run-raw", *sandboxed))
            variants["time_run_sdk"] = sdk_call(relayed_sdk, tool, arguments)
            variants["time_run_raw"] = line_call(relayed_raw, tool, arguments)
        behind_sdk = await sdk("c-sdk", behind_argv(bench, "c-sdk", fsync=True))
        behind_raw = line_client("c-raw", behind_argv(bench, "c-raw", fsync=True))
        nosync_sdk = await sdk("c-sdk-nosync", behind_argv(bench, "c-sdk-nosync", fsync=False))
        nosync_raw = line_client("c-raw-nosync", behind_argv(bench, "c-raw-nosync", fsync=False))
        variants |= {
            "behind_sdk": sdk_call(behind_sdk, BEHIND_TOOL, arguments),
            "behind_raw": line_call(behind_raw, BEHIND_TOOL, arguments),
            "behind_sdk_nosync": sdk_call(nosync_sdk, BEHIND_TOOL, arguments),
            "behind_raw_nosync": line_call(nosync_raw, BEHIND_TOOL, arguments),
        }
        calls = dict.fromkeys(variants, args.calls)
        return await run_rounds(variants, rounds=args.rounds, calls=calls, warmup=args.warmup)


BEHIND_POLICY: Final = """
version: 1
name: mcp-bench-behind
description: mcp-server-time's tools, declared and pinned, limits out of the way.
tools:
  allow: [mcp.time.*]
filesystem:
  paths:
    workspace: {root: ., mode: rw}
limits:
  call_timeout_s: 10
  calls_per_second: 1000000
  burst: 1000000
  max_concurrent_calls: 256
sandbox: {timeout_s: 3600, cpu_s: 3600}
"""
BEHIND_TOOL: Final = "mcp.time.get_current_time"


def behind_config(bench: Bench, name: str, *, fsync: bool) -> Path:
    """(c): a gatewayd configuration declaring mcp-server-time (the system python3 with
    the dev virtualenv's packages, bound read-only), its tools pinned."""
    uids = UID_BASE + secrets.randbelow(40_000) * UIDS_PER_DAEMON
    config = {
        "state_dir": str(bench.base / f"state-{name}"),
        "netns_prefix": f"cgb{secrets.token_hex(4)}-",
        "sandbox_uids": {"base": uids, "count": UIDS_PER_DAEMON},
        "audit_fsync": fsync,
        "mcp_servers": {
            "time": {
                "command": [SYSTEM_PYTHON, "-m", "mcp_server_time", *TIME_ARGS],
                "read_only_paths": [SITE_PACKAGES],
                "env": {"PYTHONPATH": SITE_PACKAGES},
                "share": "shared",
            }
        },
    }
    path = bench.base / f"config-{name}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    pinned = subprocess.run(
        [GATEWAYD, "mcp", "pin", "time", "--config", str(path), "--by", "bench"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=False,
    )
    if pinned.returncode != 0 or BEHIND_TOOL not in pinned.stdout:
        raise RuntimeError(f"gatewayd mcp pin time failed ({pinned.returncode}):\n{pinned.stderr}")
    return path


def behind_argv(bench: Bench, name: str, *, fsync: bool) -> list[str]:
    """(c) from the host: the ``gatewayd run ... -- cogni-tool mcp`` a host client
    starts, its gatewayd declaring mcp-server-time with its tools pinned."""
    path = behind_config(bench, name, fsync=fsync)
    policy = bench.base / "policy-behind.yaml"
    policy.write_text(textwrap.dedent(BEHIND_POLICY))
    workspace = bench.base / f"ws-{name}"
    workspace.mkdir()
    return [
        GATEWAYD,
        "run",
        "--config",
        str(path),
        "--workspace",
        str(workspace),
        "--policy",
        str(policy),
        "--",
        "cogni-tool",
        "mcp",
    ]


def load_average() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min), {five:.2f} (5 min)"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.3f} ms"


HEADER: Final = f"  {'variant':<74}{'calls':>6}{'p50':>13}{'p90':>13}{'p50 vs baseline':>26}"


def rows_against(rows: Sequence[tuple[str, list[float]]], baseline: list[float]) -> list[str]:
    """Each row's calls, p50, p90, and what it adds at p50 over ``baseline`` (one of
    the rows)."""
    base50 = percentile(baseline, 50)
    lines = []
    for label, values in rows:
        p50 = percentile(values, 50)
        if values is baseline:
            versus = "(baseline)"
        else:
            versus = f"{(p50 - base50) * 1e3:+,.3f} ms, {p50 / base50:.2f}x"
        lines.append(
            f"  {label:<74}{len(values):>6}{ms(p50):>13}{ms(percentile(values, 90)):>13}"
            f"{versus:>26}"
        )
    return lines


def table(title: str, rows: Sequence[tuple[str, list[float]]], baseline: list[float]) -> list[str]:
    """One group: each row's calls, p50, p90, and what it adds at p50 over ``baseline``."""
    return [title, HEADER, *rows_against(rows, baseline)]


def report(inside: dict[str, list[float]], host: dict[str, list[float]], rows: str) -> None:
    lines: list[str] = []
    if rows == "all":
        lines += report_a_b(inside, host)
    lines += report_c(inside, host)
    print("\n".join(lines))


def report_c(inside: dict[str, list[float]], host: dict[str, list[float]]) -> list[str]:
    """(c): one table, two groups, each against the direct call measured beside it (in
    the same phase, interleaved): the in-sandbox rows against the driver's own direct
    calls in that sandbox, the host rows against the host's."""
    return [
        "(c) mcp-server-time behind gatewayd: mcp.time.get_current_time through the chokepoint",
        HEADER,
        "  in one run's sandbox, the driver's calls interleaved (baseline: its direct SDK call)",
        *rows_against(
            [
                (
                    "official SDK client -> mcp-server-time in the sandbox (direct)",
                    inside["direct_sdk"],
                ),
                (
                    "std-lib client -> mcp-server-time in the sandbox (direct)",
                    inside["direct_raw"],
                ),
                (
                    "in the sandbox: std-lib client -> cogni-tool mcp -> gatewayd -> server",
                    inside["behind_raw"],
                ),
                (
                    "in the sandbox: SDK client -> cogni-tool mcp -> gatewayd -> server",
                    inside["behind_sdk"],
                ),
            ],
            inside["direct_sdk"],
        ),
        "  on the host, the clients' calls interleaved (baseline: the host's direct SDK call)",
        *rows_against(
            [
                (
                    "official SDK client -> mcp-server-time on the host (direct)",
                    host["time_direct_sdk"],
                ),
                (
                    "std-lib client -> mcp-server-time on the host (direct)",
                    host["time_direct_raw"],
                ),
                (
                    "SDK client -> gatewayd run -> cogni-tool mcp -> gatewayd -> server",
                    host["behind_sdk"],
                ),
                ("std-lib client -> the same", host["behind_raw"]),
                ("SDK client -> the same, audit_fsync: false", host["behind_sdk_nosync"]),
                ("std-lib client -> the same, audit_fsync: false", host["behind_raw_nosync"]),
            ],
            host["time_direct_sdk"],
        ),
    ]


def report_a_b(inside: dict[str, list[float]], host: dict[str, list[float]]) -> list[str]:
    """The tables of (a) and (b)."""
    lines = table(
        "(a) time.now, one gateway call, from inside a run's sandbox",
        [
            ("cogni-tool exec time.now '{}' (a process per call)", inside["exec"]),
            ("MCP tools/call: std-lib client -> cogni-tool mcp", inside["mcp_raw"]),
            ("MCP tools/call: official SDK client -> cogni-tool mcp", inside["mcp_sdk"]),
            (
                "MCP tools/call: host std-lib client -> gatewayd run -> cogni-tool mcp",
                host["host_run_cogni_raw"],
            ),
            (
                "MCP tools/call: host SDK client -> gatewayd run -> cogni-tool mcp",
                host["host_run_cogni_sdk"],
            ),
        ],
        inside["exec"],
    )
    lines += table(
        "(b) mcp-server-time get_current_time {timezone: UTC}",
        [
            (
                "official SDK client -> mcp-server-time on the host (direct)",
                host["time_direct_sdk"],
            ),
            ("std-lib client -> mcp-server-time on the host (direct)", host["time_direct_raw"]),
            (
                "SDK client -> gatewayd run -> mcp-server-time in a sandbox (relayed)",
                host["time_run_sdk"],
            ),
            (
                "std-lib client -> gatewayd run -> mcp-server-time in a sandbox (relayed)",
                host["time_run_raw"],
            ),
        ],
        host["time_direct_sdk"],
    )
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--calls", type=int, default=200, help="MCP calls per variant per round")
    ap.add_argument("--exec-calls", type=int, default=20, help="cogni-tool exec per round")
    ap.add_argument("--warmup", type=int, default=20, help="calls per variant before timing")
    ap.add_argument("--quick", action="store_true", help="2 rounds of 5 calls (smoke test)")
    ap.add_argument(
        "--rows",
        choices=("all", "c"),
        default="all",
        help="every variant, or (c) alone with its direct baselines",
    )
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.calls, args.exec_calls, args.warmup = 2, 5, 2, 2
    reason = unavailable()
    if reason is not None:
        print(f"mcp_overhead: {reason}", file=sys.stderr)
        return 2
    print(
        f"mcp_overhead: {env_info()}, mcp {importlib.metadata.version('mcp')}, "
        f"{TIME_SERVER} {importlib.metadata.version(TIME_SERVER)}; gatewayd run (OS sandbox "
        f"on, durable audit on); {args.rounds} rounds of {args.calls} calls per variant "
        f"({args.exec_calls} for cogni-tool exec) after {args.warmup}, interleaved; "
        f"rows {args.rows}; "
        f"{load_average()}"
    )
    bench = Bench()
    try:
        inside = measure_inside(bench, args)
        host = asyncio.run(measure_host(bench, args))
    except Exception:
        print(bench.tail(), file=sys.stderr)
        raise
    finally:
        bench.close()
    report(inside, host, args.rows)
    # Other work on the host moves every figure (a busy 2-core machine doubles them): the
    # load at both ends says whether this run was quiet.
    print(f"at the end: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
