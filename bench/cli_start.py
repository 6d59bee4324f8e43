"""Start-up of gatewayd's client commands, beside a bare interpreter start of the same
interpreter, in the same run:

    .venv/bin/python bench/cli_start.py [--runs 30] [--warmup 3]

Each row is one fresh process of the `gatewayd` console script (the virtualenv's: `make`
makes it from the system's python3, the interpreter `make install` puts the service on,
so it starts as an operator's does), run ``--runs`` times; every round runs every row once, in a freshly
shuffled order, so drift and load hit all rows alike. Wall time (median, p90) is what a
user waits; CPU time (user + system of the process, from wait4) is what the start costs
when other work shares the machine, the figure to compare under load.

- ``python3 -I -S -c pass`` and ``python3 -c pass`` (the virtualenv's python, which the
  console script runs): the floor, and the floor with the virtualenv's site-packages
  (its .pth files) on;
- ``gatewayd exec RUN -- /bin/date +%s%N`` against a live sandboxed ``gatewayd serve``:
  the row is the whole exec (its answer waits for the command's end in the sandbox), the
  line under it the time from the spawn of ``gatewayd exec`` to the date the sandboxed
  command printed (the sandbox shares the host's clock): the command's start, held to
  the target; and ``exec`` for a run id the daemon does not know (start-up, imports and
  one control request), and to a state directory no daemon serves (start-up and a
  failed connect);
- ``gatewayd rules pending`` against the live daemon;
- ``gatewayd audit show`` and ``audit verify`` of a small log made by the writer;
- ``gatewayd policy check`` of a shipped example policy;
- ``gatewayd run -- /bin/date +%s%N`` with the live daemon serving its state directory:
  the daemon runs it (``POST /v1/runs/attach``); the row is the whole run (start, the
  command in its sandbox, end), and the line under it the time from the spawn of
  ``gatewayd run`` to the date the sandboxed command printed (the sandbox shares the
  host's clock): the run's start, held to the target;
- ``gatewayd run`` refused for its usage (no command: everything before the daemon), and
  the imports ``gatewayd run`` makes before it asks for the sandbox (the daemon, trio,
  the audit log, the policy models) in one ``python3 -c``;
- four floors, each a ``python3 -c`` of what any command doing the same on the design's
  chosen libraries (DESIGN.md) must pay: for ``policy check``, importing pydantic and
  yaml, building one trivial pydantic model and validating a one-key YAML document with
  it; for ``run``'s imports, that and trio, msgspec and structlog (the event loop, the
  wire's codec, the logs); for a control-socket client (``exec``, ``run``'s usage),
  parsing a command line with argparse, encoding a JSON body and connecting to a unix
  socket; for an audit reader (``audit show|verify``), that parser and the log's
  lines decoded (the standard library's json: DESIGN.md's audit records are JSON
  lines, and gatewayd's own codec, msgspec, is its choice) and hashed;
- the attached run's floor, three parts that follow one another (the daemon knows what
  to run only once the client has asked; a command runs only in its run's sandbox): the
  control-socket client's floor, a run's start as bare system calls
  (``bench/run_start_floor.py``: its start half, one durable audit flush included) and a
  command's start in a run's sandbox by gatewayd's launcher and bwrap alone
  (``bench/sandbox_floor.py``), each timed in the same rounds. After the table, each command's figure over its floor
  says how much of it is gatewayd's own, and the verdict names the commands over the
  target whose floor alone is over it.

The live rows need root and /usr/bin/bwrap (the daemon's own prefix and uid range keep
it apart from other daemons); without them they are skipped, with a line saying so.
Target: each client command at most 100 ms wall at the median. Never asserts on time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import trio
from harness import compile_sources, env_info, stop_serving, wait_until_serving
from run_start_floor import RunStartFloor
from sandbox_floor import SandboxStartFloor

from gatewayd.audit import AuditEvent, open_audit_log
from gatewayd.cli.control_client import control_request

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
GATEWAYD = str(BIN / "gatewayd")
TARGET_MS = 100.0
UNKNOWN_RUN = "0123456789abcdef" * 2
ATTACHED = "run -- /bin/date, attached (whole run)"
EXEC_LIVE = "exec RUN -- /bin/date (live run, whole)"
CLIENT_FLOOR_ROW = "floor of a control-socket client"
# The attached run's floor, beside that client's: timed in this process, each round.
RUN_START_FLOOR = "floor of a run's start (bare system calls)"
SANDBOX_FLOOR = "floor of a command's start in its sandbox"
# The command whose output says when it started (nanoseconds of the shared clock).
STAMP = ("/bin/date", "+%s%N")
POLICY = ROOT / "policies" / "examples" / "workspace-rw.yaml"
# How long a `gatewayd serve` may take to answer /v1/health.
SERVE_START_S = 30.0
# What `gatewayd run` imports before it asks the daemon for the sandbox (gatewayd/cli/run.py).
RUN_IMPORTS = (
    "import trio, gatewayd.audit.writer, gatewayd.daemon, gatewayd.errors, gatewayd.logs, "
    "gatewayd.policy, gatewayd.runs.lifecycle; from gatewayd.cli import build_parser; "
    "build_parser('run')"
)
# The floor of `policy check`: a fresh interpreter on the design's libraries for policy
# files (pydantic v2, YAML) validating the smallest document with the smallest model.
POLICY_FLOOR = (
    "import pydantic, yaml\n"
    "class Floor(pydantic.BaseModel):\n"
    "    model_config = pydantic.ConfigDict(extra='forbid', frozen=True)\n"
    "    name: str\n"
    "Floor.model_validate(yaml.safe_load('name: floor\\n'))\n"
)
# The floor of `run`'s imports: that, and the event loop, the wire's codec and the logs
# (trio, msgspec, structlog: DESIGN.md's choices a daemon serving one run cannot skip).
RUN_FLOOR = "import trio, msgspec, structlog\n" + POLICY_FLOOR
# The floor of a control-socket client (`exec`, `rules`, `run` attached): a fresh
# interpreter parsing a command line with argparse, encoding a JSON body and connecting
# to a unix socket (here one that is not there, as `exec` to a state dir no daemon serves)
# through the C module, as gatewayd's clients do (socket.py builds enums they never use).
CLIENT_FLOOR = (
    "import argparse, json, _socket\n"
    "p = argparse.ArgumentParser(prog='floor')\n"
    "p.add_argument('--state-dir')\n"
    "p.add_argument('run')\n"
    "p.add_argument('argv', nargs='*')\n"
    "a = p.parse_args(['--state-dir', '/nonexistent', 'r', '--', '/bin/true'])\n"
    "body = json.dumps({'argv': a.argv}).encode()\n"
    "s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)\n"
    "try:\n"
    "    s.connect(a.state_dir + '/control.sock')\n"
    "except OSError:\n"
    "    pass\n"
)
# The floor of an audit reader: that parser, and the log read line by line, each line
# decoded as JSON by the standard library (the design's audit records are JSON lines;
# msgspec, gatewayd's codec for them, costs its import: about 40 ms of CPU here with
# typing_extensions, inspect and the rest) and each body's sha256 (what any reader of
# the hash-chained log pays). Its one argument, the log, is added where it is measured.
AUDIT_FLOOR = (
    "import argparse, hashlib, json\n"
    "p = argparse.ArgumentParser(prog='floor')\n"
    "p.add_argument('log')\n"
    "a = p.parse_args()\n"
    "decode = json.loads\n"
    "with open(a.log, 'rb') as f:\n"
    "    for line in f:\n"
    "        decode(line)\n"
    "        hashlib.sha256(line[:-76]).hexdigest()\n"
)
# Each command measured against its floor: (command's row, floor's row).
OVER_FLOOR = (
    ("exec RUN (no daemon at the state dir)", "floor of a control-socket client"),
    ("run (usage refused: before the daemon)", "floor of a control-socket client"),
    ("audit show (small log)", "floor of an audit reader (json)"),
    ("audit verify (small log)", "floor of an audit reader (json)"),
    ("policy check", "floor of policy check (pydantic + yaml)"),
    ("run's imports up to the sandbox start", "floor of run's imports (+ trio ...)"),
)
# The environment of every row: this one without gatewayd's variables (a setting there
# would send the commands to the whole configuration, which is not the case measured).
ENV = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAYD_")}


def sandbox_available() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, a uid per run)"
    if not Path("/usr/bin/bwrap").exists():
        return "needs bubblewrap at /usr/bin/bwrap"
    return None


@contextlib.contextmanager
def bench_dir() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="cg-cli-start-", dir="/tmp"))
    base.chmod(0o711)  # a run's uid passes through to its workspace
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def small_audit_log(path: Path) -> None:
    """A log of a few entries, written by gatewayd's own writer."""

    async def write() -> None:
        async with open_audit_log(path, fsync=False) as log:
            log.record("event", event=AuditEvent.RUN_CREATED, runId=UNKNOWN_RUN)
            log.record("event", event=AuditEvent.RUN_ENDED, runId=UNKNOWN_RUN)

    trio.run(write)


@contextlib.contextmanager
def live_daemon(base: Path) -> Iterator[tuple[Path, str]]:
    """A sandboxed `gatewayd serve` with one run of the deny-all policy; (state, run id)."""
    state = base / "state"
    workspace = base / "ws"
    workspace.mkdir()
    uid_base = 1_710_000_000 + secrets.randbelow(50_000) * 1024
    log_path = base / "gatewayd.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                *(GATEWAYD, "serve", "--state-dir", str(state)),
                *("--netns-prefix", f"cgcs{secrets.token_hex(3)}-"),
                *("--sandbox-uids", f"{uid_base}+16"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=ENV,
        )
    try:
        control = state / "control.sock"
        wait_until_serving(proc, control, log_path, SERVE_START_S)
        status, answer = control_request(
            control,
            "POST",
            "/v1/runs",
            {
                "workspacePath": str(workspace),
                "policy": "default",
                "actorId": "bench",
                "tenantId": "bench",
                "grant": {"allowSandbox": True},
            },
        )
        if status != 201:
            raise RuntimeError(f"run creation failed: {status} {answer}")
        yield state, answer["run"]["runId"]
    finally:
        stop_serving(proc)  # never left running over its removed state


@contextlib.contextmanager
def attached_floors(base: Path) -> Iterator[dict[str, Callable[[], float]]]:
    """The attached run's in-process floors (after the client's): name -> one timing."""
    # uids of bench/sandbox_launch.py's region (1.6e9..), away from any daemon's range.
    uid = 1_600_000_000 + secrets.randbelow(50_000) * 1024
    workspace = base / "floor-ws-run"
    for sub in ("src", "docs"):  # bench/sandbox_launch.py's small workspace
        (workspace / sub).mkdir(parents=True)
        for i in range(4):
            (workspace / sub / f"f{i}.txt").write_text("hello\n")
    run_floor = RunStartFloor(
        base=base, workspace=workspace, uid=uid, netns_prefix=f"cgcf{secrets.token_hex(3)}-"
    )
    try:
        with SandboxStartFloor(
            base, uid=uid + 1, netns_prefix=f"cgcs{secrets.token_hex(3)}-"
        ) as sandbox:
            yield {
                RUN_START_FLOOR: lambda: run_floor.round()["start"],
                SANDBOX_FLOOR: sandbox.start,
            }
    finally:
        run_floor.close()


def measure(cmd: list[str], expected: int) -> tuple[float, float, float | None]:
    """(wall s, CPU s, s to the command's start or None) of one run of ``cmd``, which
    must exit ``expected``: the process is waited for with wait4, which reports its own
    CPU time. When ``cmd`` ends in ``/bin/date +%s%N`` (a sandboxed command: the
    sandbox shares the host's clock), the time from the spawn to that date."""
    stamped = cmd[-2:] == list(STAMP)
    spawned_ns = time.time_ns()
    started = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE if stamped else subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=ENV,
    )
    assert proc.stderr is not None
    out = proc.stdout.read() if proc.stdout is not None else b""  # a line: no deadlock
    err = proc.stderr.read()  # to its end: the process has closed it (or exited)
    proc.stderr.close()
    if proc.stdout is not None:
        proc.stdout.close()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != expected:
        raise RuntimeError(f"{cmd} exited {proc.returncode}, not {expected}: {err[-2000:]!r}")
    to_start = (int(out) - spawned_ns) / 1e9 if stamped else None
    return wall, usage.ru_utime + usage.ru_stime, to_start


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=30, help="runs of each row (default 30)")
    ap.add_argument("--warmup", type=int, default=3, help="rounds not counted (default 3)")
    args = ap.parse_args()
    compile_sources()
    # SIGTERM ends the bench as Ctrl-C does, through the finally blocks: the live daemon
    # stopped, the bench's directory removed (the default action would leave both).
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    # The virtualenv's python, which the console script runs: with -S and -I a bare start
    # of the same binary; without, the start with the virtualenv's site-packages (.pth).
    python = sys.executable
    with bench_dir() as base, contextlib.ExitStack() as stack:
        log = base / "audit" / "audit.jsonl"
        small_audit_log(log)
        policy = base / "policy.yaml"
        shutil.copyfile(POLICY, policy)
        nobody = base / "no-daemon"
        rows: dict[str, tuple[list[str], int, bool]] = {
            # name: (argv, expected exit status, a client command held to the target)
            "python3 -I -S -c pass": ([python, "-I", "-S", "-c", "pass"], 0, False),
            "python3 -c pass": ([python, "-c", "pass"], 0, False),
            "exec RUN (no daemon at the state dir)": (
                [GATEWAYD, "exec", "--state-dir", str(nobody), UNKNOWN_RUN, "--", "/bin/true"],
                1,
                True,
            ),
            "audit show (small log)": ([GATEWAYD, "audit", "show", str(log)], 0, True),
            "audit verify (small log)": ([GATEWAYD, "audit", "verify", str(log)], 0, True),
            "policy check": ([GATEWAYD, "policy", "check", str(policy)], 0, True),
            "run (usage refused: before the daemon)": (
                [GATEWAYD, "run", "--state-dir", str(nobody)],
                2,
                True,
            ),
            "run's imports up to the sandbox start": ([python, "-c", RUN_IMPORTS], 0, False),
            "floor of policy check (pydantic + yaml)": ([python, "-c", POLICY_FLOOR], 0, False),
            CLIENT_FLOOR_ROW: ([python, "-c", CLIENT_FLOOR], 0, False),
            "floor of an audit reader (json)": (
                [python, "-c", AUDIT_FLOOR, str(log)],
                0,
                False,
            ),
            "floor of run's imports (+ trio ...)": ([python, "-c", RUN_FLOOR], 0, False),
        }
        skipped = sandbox_available()
        if skipped is None:
            state, run_id = stack.enter_context(live_daemon(base))
            exec_argv = [GATEWAYD, "exec", "--state-dir", str(state)]
            # The command's whole exec (its answer waits for the sandboxed command's
            # end); the line under it, the time to the command's start, is held.
            rows[EXEC_LIVE] = ([*exec_argv, run_id, "--", *STAMP], 0, False)
            rows["exec RUN (unknown to a live daemon)"] = (
                [*exec_argv, UNKNOWN_RUN, "--", "/bin/true"],
                1,
                True,
            )
            # The whole one-shot run, served by the live daemon (POST /v1/runs/attach):
            # start, the command in its sandbox, end. Its start alone is less.
            attached_ws = base / "ws-attached"
            attached_ws.mkdir()
            rows[ATTACHED] = (
                [
                    *(GATEWAYD, "run", "--state-dir", str(state)),
                    *("--workspace", str(attached_ws), "--policy", "default"),
                    *("--on-end", "discard", "--", *STAMP),
                ],
                0,
                False,  # held to the target by its start, below
            )
            rows["rules pending (live daemon)"] = (
                [GATEWAYD, "rules", "pending", "--state-dir", str(state)],
                0,
                True,
            )
            floors = stack.enter_context(attached_floors(base))
            for name in floors:
                rows[name] = ([], 0, False)
        else:
            floors = {}
        walls: dict[str, list[float]] = {name: [] for name in rows}
        cpus: dict[str, list[float]] = {name: [] for name in rows}
        # The stamped rows: each spawn to its sandboxed command's start.
        starts: dict[str, list[float]] = {name: [] for name in rows}
        rng = random.Random(21)
        for round_ in range(args.warmup + args.runs):
            order = list(rows)
            rng.shuffle(order)
            for name in order:
                cmd, expected, _ = rows[name]
                if name in floors:
                    wall, cpu, to_start = floors[name](), 0.0, None
                else:
                    wall, cpu, to_start = measure(cmd, expected)
                if round_ >= args.warmup:
                    walls[name].append(wall)
                    cpus[name].append(cpu)
                    if to_start is not None:
                        starts[name].append(to_start)
    print(
        f"cli_start: {python}, {env_info()}, load {os.getloadavg()[0]:.2f}; "
        f"{args.runs} runs of each row in shuffled rounds (+{args.warmup} warm-up rounds)"
    )
    print(f"  command: {' '.join([sys.executable, *sys.argv])}")
    if skipped is not None:
        print(f"  live rows skipped: {skipped}")
    header = f"  {'gatewayd ...':<44}{'wall med':>10}{'p90':>9}{'cpu med':>10}  (ms)"
    print(header)
    failed = []
    for name, (cmd, _, held) in rows.items():
        wall_med = statistics.median(walls[name]) * 1000
        verdict = ""
        if held:
            verdict = "ok" if wall_med <= TARGET_MS else f"over {TARGET_MS:.0f} ms"
            if wall_med > TARGET_MS:
                failed.append(name)
        cpu_med = "" if name in floors else f"{statistics.median(cpus[name]) * 1000:10.1f}"
        print(
            f"  {name:<44}{wall_med:10.1f}{percentile(walls[name], 90) * 1000:9.1f}"
            f"{cpu_med:>10}  {verdict}"
        )
        if starts[name]:
            start_med = statistics.median(starts[name]) * 1000
            verdict = "ok" if start_med <= TARGET_MS else f"over {TARGET_MS:.0f} ms"
            if start_med > TARGET_MS:
                failed.append(f"{cmd[1]}: up to its command's start")
            print(
                f"  {'  ... up to its command in the sandbox':<44}{start_med:10.1f}"
                f"{percentile(starts[name], 90) * 1000:9.1f}{'':>10}  {verdict}"
            )
    floored = []
    for command, floor in OVER_FLOOR:
        floor_med = statistics.median(walls[floor]) * 1000
        wall = statistics.median(walls[command]) * 1000 - floor_med
        cpu = (statistics.median(cpus[command]) - statistics.median(cpus[floor])) * 1000
        above = floor_med > TARGET_MS
        if above and command in failed:
            floored.append(command)
        print(
            f"  {command} over its floor: {wall:+.1f} ms wall, {cpu:+.1f} ms CPU at the "
            "median (gatewayd's own share)"
            + (f"; the floor alone is ABOVE {TARGET_MS:.0f} ms" if above else "")
        )
    if floors and starts[ATTACHED]:
        parts = [statistics.median(walls[name]) * 1000 for name in (CLIENT_FLOOR_ROW, *floors)]
        floor_ms = sum(parts)
        start_ms = statistics.median(starts[ATTACHED]) * 1000
        above = floor_ms > TARGET_MS
        if above and "run: up to its command's start" in failed:
            floored.append("run, attached: up to its command's start")
        print(
            f"  run, attached, up to its command's start, over its floor: "
            f"{start_ms - floor_ms:+.1f} ms (floor {floor_ms:.1f} ms = client "
            f"{parts[0]:.1f} + run start {parts[1]:.1f} + command start {parts[2]:.1f})"
            + (f"; the floor alone is ABOVE {TARGET_MS:.0f} ms" if above else "")
        )
    print(
        f"verdict: every client command at most {TARGET_MS:.0f} ms wall at the median: "
        + ("yes" if not failed else f"no ({', '.join(failed)})")
    )
    if floored:
        print(f"  of which stopped by a floor above the target: {', '.join(floored)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
