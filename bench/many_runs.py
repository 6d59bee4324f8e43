"""Many runs on one host: a real `gatewayd serve` with the OS sandbox, RUNS runs created
at once, each making CALLS calls and EXECS execs, then ended; then a check that nothing
the runs had outlived them.

    .venv/bin/python bench/many_runs.py [--runs 200] [--calls 50] [--execs 5]
                                        [--call-workers 8] [--exec-parallel 8]

Needs root, /usr/bin/bwrap and /bin/true. The daemon is a subprocess with its own
network-namespace prefix, sandbox uid range (1,024 uids: the shipped 1,024 would do for
200 runs, a test daemon's 64 would not) and state directory, so it touches no other
daemon's. The phases, in order:

1. start the daemon; one warm-up run (a call, an exec, its end) so that what the first
   run loads once (lazy imports, caches, trio's worker threads) is not counted per run;
   then the daemon's memory, threads and descriptors "at 0 runs";
2. RUNS ``POST /v1/runs`` at once, one thread each, all released together: the start
   latency of each (the control socket's answer, sandbox included);
3. with every run idle: the daemon's memory again; (RSS_RUNS - RSS_0) / RUNS is the
   memory per idle run (the target: at most 2 MiB; the sandboxes' processes are not the
   daemon's and are shown apart);
4. CALLS ``time.now`` calls per run over its run socket, from CALL_WORKERS worker
   processes, each serving whole runs one after the other (a run's socket serves only
   processes in its network namespace: a worker joins it with setns(2) before it
   connects, so it must hold one namespace until its run's calls are answered);
5. EXECS ``/bin/true`` per run through the control socket's exec, EXEC_PARALLEL at once;
6. RUNS ``DELETE /v1/runs/{id}`` at once;
7. the leak check: the daemon's descriptors and threads back to their figure at 0 runs
   (waited for: trio keeps an idle worker thread about 10 s), no network namespace of
   the prefix, no mount of it or of the bench's directory, no command cgroup of the
   runs, ``gatewayd_sandbox_uids_leased`` 0, no child process of the daemon, no process
   holding a uid of the range.

A sampler thread reads the daemon's /proc files every SAMPLE_S throughout: the peak is
the largest figure it saw. Memory is read from /proc/PID/smaps_rollup: RSS, PSS and USS
(private clean + private dirty). Exit status 1 on a leak or on any failed call, exec,
start or end, with a line saying which; the figures are printed, never asserted on.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any, Final

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import (
    BIN,
    UnixHTTPConnection,
    env_info,
    percentile,
    stop_serving,
    wait_until_serving,
)

TRUE: Final = "/bin/true"
BWRAP: Final = "/usr/bin/bwrap"
NETNS_DIR: Final = Path("/run/netns")
CGROUP_ROOT: Final = Path("/sys/fs/cgroup")
# The bench's sandbox uids: a random 1,024-uid slice of 1.65e9..1.69e9, away from the
# tests' slices (1.7e9..), bench/sandbox_launch.py's (1.6e9..) and the default range
# (1.8e9), so no live daemon shares one. 1,024 leaves room for the warm-up run and for
# uids a run's processes still hold for a moment after it ended.
UID_REGION_BASE: Final = 1_650_000_000
UID_REGION_SLICES: Final = 40_000
UID_COUNT: Final = 1024
# At most this many runs: the rest of the uid slice is the margin above.
MAX_RUNS: Final = 1000
# Waiting for `gatewayd serve` to answer /v1/health.
SERVE_START_S: Final = 60.0
# Each control or run-socket request gives up after this long (every socket of the bench
# and its workers): 200 sandboxes starting at once on 2 busy cores take seconds; a stuck
# daemon must still end the bench.
REQUEST_TIMEOUT_S: Final = 300.0
# The sampler's period: often enough to catch the peak of a phase lasting seconds.
SAMPLE_S: Final = 0.1
# How long the leak check waits for threads and descriptors to come back: trio's thread
# cache lets an idle worker thread go after 10 s.
SETTLE_S: Final = 30.0
SETTLE_POLL_S: Final = 0.25
# The failures shown of each kind; the count says how many more.
SHOWN_FAILURES: Final = 5
# Idle runs are measured after this pause, so answers still being written are done.
IDLE_PAUSE_S: Final = 1.0
# litellm must never fetch its cost map at import (DESIGN.md), in any process we start;
# the caller's GATEWAYD_* settings stay out (one could move the daemon's sockets away
# from where the bench looks for them).
SUBPROCESS_ENV: Final = {
    **{name: value for name, value in os.environ.items() if not name.startswith("GATEWAYD_")},
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
}
CLONE_NEWNET: Final = 0x40000000  # <linux/sched.h>
HEADER: Final = struct.Struct(">I")
MIB: Final = 1024 * 1024
CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK")
# The phases whose daemon CPU is reported, as Figures.cpu names them.
PHASES: Final = ("start", "calls", "execs", "end")
# The audit tree's per-level files (gatewayd/audit/treestore.py): not counted as the
# daemon's descriptors (see Sample).
AUDIT_TREE_LEVEL: Final = re.compile(r"\.tree/level-\d+$")
# The target of the issue: the daemon's memory per idle run.
IDLE_TARGET_MIB: Final = 2.0

POLICY_NAME: Final = "bench"  # the file bench.yaml in the directory given as --policy-dir
# Every run gets a small writable workspace of its own (one file), lent to its uid as a
# real run's is; time.now is the call (no side effect: one flush per call).
POLICY: Final = """\
version: 1
name: bench-many-runs
description: the runs of bench/many_runs.py; a writable workspace of one file each.
tools:
  allow: [time.now]
filesystem:
  paths:
    workspace: {root: ., mode: rw}
limits: {calls_per_second: 1000000, burst: 1000000}
sandbox: {timeout_s: 60, max_output_bytes: 65536}
"""


# ------------------------------------------------------------------ the daemon's figures


@dataclass(frozen=True, slots=True)
class Sample:
    """The daemon's resources at one moment (bytes, counts) and its children's PSS.
    ``fds`` leaves out the audit tree's level files: one more opens each time the log's
    entry count passes a power of two (gatewayd/audit/treestore.py), which is the log
    growing, not a run leaking."""

    rss: int
    pss: int
    uss: int
    threads: int
    fds: int
    children: int
    children_pss: int


def smaps_rollup(pid: int) -> dict[str, int]:
    """The fields of /proc/PID/smaps_rollup, in bytes."""
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                fields[name] = int(parts[0]) * 1024
    return fields


def children_of(pid: int) -> list[int]:
    """The daemon's child processes (of every thread), from /proc/PID/task/*/children."""
    kids: list[int] = []
    with contextlib.suppress(FileNotFoundError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                kids += [
                    int(k) for k in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
                ]
    return kids


def descendants_of(pid: int) -> list[int]:
    out: list[int] = []
    todo = children_of(pid)
    while todo:
        kid = todo.pop()
        out.append(kid)
        todo += children_of(kid)
    return out


def daemon_cpu(pid: int) -> float:
    """The process's CPU time so far (user + system, seconds), from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    # utime and stime are fields 14 and 15 of proc(5); fields[0] here is field 3.
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def fd_targets(pid: int) -> list[str]:
    """What each of the daemon's descriptors names (a path, socket:[inode], pipe:...)."""
    out: list[str] = []
    with contextlib.suppress(FileNotFoundError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return out


def kinds(targets: list[str]) -> dict[str, int]:
    """Descriptors by kind: ``socket``, ``pipe``, ``anon_inode:[eventpoll]``, a path."""
    count: dict[str, int] = {}
    for target in targets:
        kind = target.split(":[")[0] if ":[" in target else target
        count[kind] = count.get(kind, 0) + 1
    return count


def sample(pid: int) -> Sample:
    mem = smaps_rollup(pid)
    kids = descendants_of(pid)
    kids_pss = 0
    for kid in kids:
        with contextlib.suppress(OSError):  # gone between the listing and the read
            kids_pss += smaps_rollup(kid).get("Pss", 0)
    return Sample(
        rss=mem["Rss"],
        pss=mem["Pss"],
        uss=mem.get("Private_Clean", 0) + mem.get("Private_Dirty", 0),
        threads=len(os.listdir(f"/proc/{pid}/task")),
        fds=sum(1 for target in fd_targets(pid) if not AUDIT_TREE_LEVEL.search(target)),
        children=len(kids),
        children_pss=kids_pss,
    )


class Sampler:
    """Samples the daemon every SAMPLE_S in a thread; keeps the largest of each figure."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            with contextlib.suppress(OSError):
                now = sample(self.pid)
                for name in Sample.__slots__:
                    self.peak[name] = max(self.peak.get(name, 0), getattr(now, name))


# ------------------------------------------------------------------- calls, in workers


def worker_main() -> int:
    """A call worker (``--worker``): for each job line on stdin (JSON: netns, socket,
    runId, calls) join the run's network namespace, connect, make the calls one after
    the other and print one JSON line: the latencies, or the error of the first failure.
    Single-threaded on purpose: setns(2) moves only the calling thread, and the daemon
    looks at the process's main thread's namespace (/proc/PID/ns/net). Says it is ready
    (a first line ``{"ready": true}``) before it reads any job."""
    libc = ctypes.CDLL(None, use_errno=True)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        out: dict[str, Any] = {"runId": job["runId"], "latencies": []}
        try:
            fd = os.open(job["netns"], os.O_RDONLY | os.O_CLOEXEC)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns {job['netns']}: {os.strerror(err)}")
            finally:
                os.close(fd)
            out["latencies"] = calls_on(job["socket"], job["runId"], int(job["calls"]))
        except (OSError, ValueError, RuntimeError) as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        print(json.dumps(out), flush=True)
    return 0


def calls_on(path: str, run_id: str, n: int) -> list[float]:
    latencies: list[float] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(REQUEST_TIMEOUT_S)
        s.connect(path)
        buf = bytearray()
        for i in range(n):
            body = json.dumps(
                {"v": 1, "runId": run_id, "toolCallId": f"m{i}", "tool": "time.now", "args": {}},
                separators=(",", ":"),
            ).encode()
            started = time.perf_counter()
            s.sendall(HEADER.pack(len(body)) + body)
            while len(buf) < 4 or len(buf) < 4 + HEADER.unpack_from(buf)[0]:
                chunk = s.recv(65536)
                if not chunk:
                    raise RuntimeError(f"the run's socket closed after {i} calls")
                buf += chunk
            (size,) = HEADER.unpack_from(buf)
            answer = json.loads(bytes(buf[4 : 4 + size]))
            del buf[: 4 + size]
            latencies.append(time.perf_counter() - started)
            if not answer.get("ok"):
                raise RuntimeError(f"call {i} failed: {answer}")
    return latencies


def start_workers(count: int) -> list[subprocess.Popen[str]]:
    """The call workers, each ready (its first line read) before this returns: Python's
    start is not a call's cost."""
    workers = [
        subprocess.Popen(
            [sys.executable, __file__, "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=SUBPROCESS_ENV,
        )
        for _ in range(count)
    ]
    for worker in workers:
        assert worker.stdout is not None
        if json.loads(worker.stdout.readline() or "{}").get("ready") is not True:
            raise RuntimeError(f"a call worker did not start (exit status {worker.wait()})")
    return workers


def run_calls(
    workers: list[subprocess.Popen[str]], jobs: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], float]:
    """Hands the jobs out round-robin and waits for every answer; (answers, wall s)."""
    shares: list[list[str]] = [[] for _ in workers]
    for i, job in enumerate(jobs):
        shares[i % len(workers)].append(json.dumps(job) + "\n")
    answers: list[dict[str, Any]] = []
    lock = threading.Lock()

    def drive(worker: subprocess.Popen[str], lines: list[str]) -> None:
        assert worker.stdin is not None
        assert worker.stdout is not None
        worker.stdin.write("".join(lines))
        worker.stdin.close()
        got = [json.loads(line) for line in worker.stdout]
        with lock:
            answers.extend(got)

    started = time.perf_counter()
    threads = [
        threading.Thread(target=drive, args=pair) for pair in zip(workers, shares, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    for worker in workers:
        worker.wait(timeout=REQUEST_TIMEOUT_S)
    return answers, elapsed


# ------------------------------------------------------------------ the control socket


class ControlConnection(UnixHTTPConnection):
    """HTTP on the control socket: the connect blocks until the daemon accepts, then
    each read waits at most REQUEST_TIMEOUT_S. Not a timeout on the connect: a socket
    with one is non-blocking inside, and a unix socket's connect then fails at once
    (EAGAIN) while the listen backlog is full, as it was at 128 when 200 clients
    connected together."""

    def connect(self) -> None:
        super().connect()
        self.sock.settimeout(REQUEST_TIMEOUT_S)


def control(path: Path, method: str, target: str, body: Any = None) -> tuple[int, Any]:
    """One JSON request to the control socket (bench/harness.py's, with ControlConnection)."""
    conn = ControlConnection(str(path))
    try:
        payload = json.dumps(body).encode() if body is not None else None
        conn.request(method, target, body=payload, headers={"content-type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def timed(request: Callable[[], tuple[int, Any]]) -> tuple[float, int, Any]:
    started = time.perf_counter()
    try:
        status, data = request()
    except OSError as exc:
        return time.perf_counter() - started, 0, {"message": f"{type(exc).__name__}: {exc}"}
    return time.perf_counter() - started, status, data


def all_at_once(
    count: int, request: Callable[[int], tuple[int, Any]]
) -> list[tuple[float, int, Any]]:
    """``request(i)`` for each i in one thread each, every thread released together."""
    barrier = threading.Barrier(count)

    def one(i: int) -> tuple[float, int, Any]:
        barrier.wait()
        return timed(lambda: request(i))

    with ThreadPoolExecutor(max_workers=count) as pool:
        return list(pool.map(one, range(count)))


# ------------------------------------------------------------------------ leak checks


def netns_left(prefix: str) -> list[str]:
    with contextlib.suppress(FileNotFoundError):
        return sorted(name for name in os.listdir(NETNS_DIR) if name.startswith(prefix))
    return []


def mounts_left(pid: int | None, needles: Sequence[str]) -> list[str]:
    """Mount points naming any of ``needles``, in this process's and the daemon's view."""
    found: set[str] = set()
    for source in ("/proc/self/mountinfo", *(() if pid is None else (f"/proc/{pid}/mountinfo",))):
        with contextlib.suppress(OSError):
            for line in Path(source).read_text().splitlines():
                point = line.split()[4]
                if any(needle in point for needle in needles):
                    found.add(point)
    return sorted(found)


def cgroups_left(run_ids: Sequence[str]) -> list[str]:
    """Command cgroups (``cogni-<run id>-<suffix>``, gatewayd/sandbox/cgroup.py) of any of
    ``run_ids`` anywhere under /sys/fs/cgroup (every hierarchy: v1 and v2)."""
    pattern = re.compile(r"cogni-(" + "|".join(map(re.escape, run_ids)) + r")(-|$)")
    found: list[str] = []
    for top, dirs, _ in os.walk(CGROUP_ROOT):
        found += [os.path.join(top, d) for d in dirs if pattern.match(d)]
    return sorted(found)


def processes_of_uids(base: int, count: int) -> list[int]:
    """Processes holding any uid or gid of base..base+count-1 (real, effective, saved, fs)."""
    pids: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{entry}/status").read_text().splitlines():
                if line.startswith(("Uid:", "Gid:")) and any(
                    base <= int(x) < base + count for x in line.split()[1:]
                ):
                    pids.append(int(entry))
                    break
    return pids


def more_fds(before: dict[str, int], pid: int) -> dict[str, int]:
    """The kinds of descriptor the daemon holds more of than ``before``."""
    now = kinds(fd_targets(pid))
    return {k: n - before.get(k, 0) for k, n in now.items() if n > before.get(k, 0)}


def metric(ctl: Path, name: str) -> float | None:
    """One unlabelled sample of the daemon's /v1/metrics; None when it has no such one."""
    conn_status, text = control_text(ctl, "/v1/metrics")
    if conn_status != 200:
        return None
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == name:
            return float(parts[1])
    return None


def control_text(ctl: Path, target: str) -> tuple[int, str]:
    """A GET whose answer is text, not JSON."""
    conn = ControlConnection(str(ctl))
    try:
        conn.request("GET", target)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


# ------------------------------------------------------------------------ the bench


@dataclass(frozen=True, slots=True)
class Site:
    """Where the bench's daemon lives: its directory, namespace prefix and uid range."""

    base: Path
    prefix: str
    uid_base: int

    @property
    def control(self) -> Path:
        return self.base / "state" / "control.sock"

    def netns(self, run_id: str) -> str:
        return str(NETNS_DIR / f"{self.prefix}{run_id}")


def make_site(runs: int) -> Site:
    """A fresh directory with the policy and one workspace per run (and the warm-up's)."""
    base = Path(tempfile.mkdtemp(prefix="cg-many-", dir="/tmp"))
    base.chmod(0o711)  # each run's uid passes through to its workspace
    (base / f"{POLICY_NAME}.yaml").write_text(POLICY)
    for i in range(runs + 1):
        ws = base / "ws" / str(i)
        ws.mkdir(parents=True)
        (ws / "notes.txt").write_text("hello\n")
    uid_base = UID_REGION_BASE + secrets.randbelow(UID_REGION_SLICES) * UID_COUNT
    return Site(base=base, prefix=f"cgmr{secrets.token_hex(4)}-", uid_base=uid_base)


def run_request(site: Site, i: int) -> dict[str, Any]:
    """The body of ``POST /v1/runs`` for a run in the ``i``th workspace of ``site``."""
    return {
        "workspacePath": str(site.base / "ws" / str(i)),
        "policy": POLICY_NAME,
        "actorId": "bench",
        "tenantId": "bench",
        "grant": {"allowSandbox": True},
    }


@contextlib.contextmanager
def daemon(site: Site) -> Iterator[subprocess.Popen[bytes]]:
    """A `gatewayd serve` of ``site``, answering /v1/health; stopped by SIGTERM after."""
    log_path = site.base / "gatewayd.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                str(BIN / "gatewayd"),
                "serve",
                "--state-dir",
                str(site.base / "state"),
                "--netns-prefix",
                site.prefix,
                "--sandbox-uids",
                f"{site.uid_base}+{UID_COUNT}",
                "--policy-dir",
                str(site.base),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=SUBPROCESS_ENV,
        )
    try:
        wait_until_serving(proc, site.control, log_path, SERVE_START_S)
        yield proc
    finally:
        stop_serving(proc, SERVE_START_S)


def exit_on_sigterm() -> None:
    """SIGTERM (a CI job's end, `kill`) raises SystemExit as Ctrl-C raises
    KeyboardInterrupt: the finally blocks stop the daemon and remove its namespaces and
    the bench's directory, which the default action (die at once) would leave."""

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


class Problems(list[str]):
    """Every failed start, call, exec or end and every leak, printed as it is found."""

    def add(self, line: str) -> None:
        self.append(line)
        print(f"FAIL: {line}", flush=True)


@dataclass
class Figures:
    """What the phases measured (seconds, counts)."""

    started: int = 0
    start_latency: list[float] = field(default_factory=list)
    end_latency: list[float] = field(default_factory=list)
    call_latency: list[float] = field(default_factory=list)
    calls_wall: float = 0.0
    call_workers: int = 0
    exec_latency: list[float] = field(default_factory=list)
    execs_wall: float = 0.0
    # The daemon's own CPU (user + system, every thread of it, not its children's) in
    # each phase: what the load of other processes does not inflate as it does the times.
    cpu: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))


class Bench:
    """The phases against one daemon (see the module doc)."""

    def __init__(self, site: Site, args: argparse.Namespace, problems: Problems) -> None:
        self.site = site
        self.args = args
        self.problems = problems
        self.figures = Figures()
        self.run_ids: list[str] = []  # every run made, the warm-up's too
        self.first_cycle_runs = 0  # the idle runs the memory per run is taken over

    def create(self, i: int) -> tuple[int, Any]:
        return control(self.site.control, "POST", "/v1/runs", run_request(self.site, i))

    def exec_true(self, run_id: str) -> tuple[int, Any]:
        return control(self.site.control, "POST", f"/v1/runs/{run_id}/exec", {"command": [TRUE]})

    def end(self, run_id: str) -> tuple[int, Any]:
        return control(self.site.control, "DELETE", f"/v1/runs/{run_id}")

    def job(self, run: dict[str, Any], calls: int) -> dict[str, Any]:
        run_id = run["runId"]
        return {
            "netns": self.site.netns(run_id),
            "socket": run["socket"],
            "runId": run_id,
            "calls": calls,
        }

    @contextlib.contextmanager
    def cpu_of(self, phase: str, pid: int) -> Iterator[None]:
        """Adds the daemon's CPU time during the block to ``phase``'s."""
        before = daemon_cpu(pid)
        yield
        self.figures.cpu[phase] += daemon_cpu(pid) - before

    def warm_up(self) -> bool:
        """One run with one call and one exec, ended; False (said why) if it failed."""
        status, data = self.create(self.args.runs)  # the last workspace is the warm-up's
        if status != 201:
            self.problems.add(f"the warm-up run was refused: {status} {data}")
            return False
        run = data["run"]
        self.run_ids.append(run["runId"])
        answers, _ = run_calls(start_workers(1), [self.job(run, 1)])
        if any("error" in answer for answer in answers):
            self.problems.add(f"the warm-up run's call failed: {answers}")
        status, data = self.exec_true(run["runId"])
        if status != HTTPStatus.OK or data["result"].get("exitCode") != 0:
            self.problems.add(f"the warm-up run's exec failed: {status} {data}")
        status, data = self.end(run["runId"])
        if status != HTTPStatus.OK:
            self.problems.add(f"the warm-up run did not end: {status} {data}")
        return True

    def start_all(self) -> list[dict[str, Any]]:
        """Every run at once; the runs that started."""
        answers = all_at_once(self.args.runs, self.create)
        runs = [data["run"] for _, status, data in answers if status == HTTPStatus.CREATED]
        self.run_ids += [run["runId"] for run in runs]
        refused = [data for _, status, data in answers if status != HTTPStatus.CREATED]
        if refused:
            reasons = sorted({str(data.get("message", data))[:200] for data in refused})
            self.problems.add(f"{len(refused)} of {self.args.runs} run starts refused: {reasons}")
        self.figures.started += len(runs)
        self.figures.start_latency += [
            t for t, status, _ in answers if status == HTTPStatus.CREATED
        ]
        return runs

    def calls(self, runs: list[dict[str, Any]]) -> None:
        workers = start_workers(min(self.args.call_workers, max(1, len(runs))))
        answers, wall = run_calls(workers, [self.job(run, self.args.calls) for run in runs])
        failed = [answer for answer in answers if "error" in answer]
        for answer in failed[:SHOWN_FAILURES]:
            self.problems.add(f"calls of run {answer['runId']}: {answer['error']}")
        if len(failed) > SHOWN_FAILURES:
            self.problems.add(f"... calls failed in {len(failed)} runs in all")
        self.figures.call_latency += [t for answer in answers for t in answer["latencies"]]
        self.figures.calls_wall += wall
        self.figures.call_workers = len(workers)

    def execs(self, runs: list[dict[str, Any]]) -> None:
        def execs_of(run_id: str) -> list[tuple[float, int, Any]]:
            return [timed(lambda: self.exec_true(run_id)) for _ in range(self.args.execs)]

        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=self.args.exec_parallel) as pool:
            answers = [
                a for per_run in pool.map(execs_of, [r["runId"] for r in runs]) for a in per_run
            ]
        self.figures.execs_wall += time.perf_counter() - started
        failed: list[Any] = []
        for elapsed, status, data in answers:
            if status == HTTPStatus.OK and data.get("result", {}).get("exitCode") == 0:
                self.figures.exec_latency.append(elapsed)
            else:
                failed.append(data)
        if failed:
            reasons = sorted({json.dumps(data)[:200] for data in failed})
            self.problems.add(f"{len(failed)} execs failed: {reasons[:SHOWN_FAILURES]}")

    def end_all(self, runs: list[dict[str, Any]]) -> None:
        answers = all_at_once(len(runs), lambda i: self.end(runs[i]["runId"]))
        failed = [(status, data) for _, status, data in answers if status != HTTPStatus.OK]
        if failed:
            self.problems.add(f"{len(failed)} run ends failed: {failed[:SHOWN_FAILURES]}")
        self.figures.end_latency += [t for t, status, _ in answers if status == HTTPStatus.OK]

    def leaks(self, pid: int, zero: Sample, zero_fds: dict[str, int], after: Sample) -> Checks:
        """Each check's label and what it found left (empty: nothing leaked)."""
        site = self.site
        more = after.fds > zero.fds
        leased = metric(site.control, "gatewayd_sandbox_uids_leased")
        _, health = control(site.control, "GET", "/v1/health")
        return [
            (
                f"daemon descriptors back to {zero.fds}",
                [after.fds, more_fds(zero_fds, pid)] if more else [],
            ),
            (
                f"daemon threads back to {zero.threads}",
                [after.threads] if after.threads > zero.threads else [],
            ),
            ("no child process of the daemon", descendants_of(pid)),
            (f"no network namespace {site.prefix}*", netns_left(site.prefix)),
            (
                "no mount of the prefix or the bench's directory",
                mounts_left(pid, [site.prefix, str(site.base)]),
            ),
            ("no command cgroup of the runs", cgroups_left(self.run_ids)),
            (
                f"no process of the uids {site.uid_base}+{UID_COUNT}",
                processes_of_uids(site.uid_base, UID_COUNT),
            ),
            (
                "uid leases 0 (gatewayd_sandbox_uids_leased)",
                ["not exported by this gatewayd"]
                if leased is None
                else ([] if leased == 0 else [leased]),
            ),
            ("no run in the registry", [] if health.get("runs") == 0 else [health]),
        ]


Checks = list[tuple[str, list[Any]]]


def settled(pid: int, zero: Sample) -> Sample:
    """The daemon's figures once its threads and descriptors are back to ``zero``'s and
    it has no child, or after SETTLE_S."""
    deadline = time.monotonic() + SETTLE_S
    now = sample(pid)
    while (now.fds > zero.fds or now.threads > zero.threads or now.children) and (
        time.monotonic() < deadline
    ):
        time.sleep(SETTLE_POLL_S)
        now = sample(pid)
    return now


def mib(value: float) -> str:
    return f"{value / MIB:8.2f}"


def pct_ms(values: list[float]) -> str:
    if not values:
        return "n/a"
    return "  ".join(f"p{p} {percentile(values, p) * 1000:8.2f}" for p in (50, 90, 99)) + " ms"


def sample_row(label: str, s: Sample) -> str:
    return (
        f"  {label:<30}{mib(s.rss)}{mib(s.pss)}{mib(s.uss)}{s.threads:9d}{s.fds:7d}"
        f"{s.children:7d}{mib(s.children_pss)}"
    )


def report(bench: Bench, samples: dict[str, Sample]) -> None:
    f, args = bench.figures, bench.args
    made = len(f.call_latency)
    rate = made / f.calls_wall if f.calls_wall else 0.0
    print()
    print(f"  {f.started} runs started, {args.runs} at once ({args.cycles} cycle(s))")
    print(f"  start latency         {pct_ms(f.start_latency)}")
    print(f"  end latency           {pct_ms(f.end_latency)}")
    print(
        f"  calls                 {made} answered in {f.calls_wall:.2f} s: {rate:,.0f} calls/s "
        f"({f.call_workers} workers, one run at a time each)"
    )
    print(f"  call latency          {pct_ms(f.call_latency)}")
    print(
        f"  execs                 {len(f.exec_latency)} in {f.execs_wall:.2f} s "
        f"({args.exec_parallel} at once)"
    )
    print(f"  exec latency          {pct_ms(f.exec_latency)}")
    counts = {
        "start": f.started,
        "calls": made,
        "execs": len(f.exec_latency),
        "end": len(f.end_latency),
    }
    each = {name: f.cpu[name] / n if n else 0.0 for name, n in counts.items()}
    print(
        f"  daemon CPU each       start {each['start'] * 1000:.2f} ms, call "
        f"{each['calls'] * 1e6:.0f} us, exec {each['execs'] * 1000:.2f} ms, end "
        f"{each['end'] * 1000:.2f} ms (the daemon's user + system time)"
    )
    print()
    print(
        f"  {'the daemon':<30}{'RSS':>8}{'PSS':>8}{'USS':>8}{'threads':>9}{'fds':>7}"
        f"{'kids':>7}{'kidsPSS':>8}  (MiB)"
    )
    # The moments in order: the peak before what is left after the end.
    for label in sorted(
        samples, key=lambda label: label != ZERO and label != IDLE and label != PEAK
    ):
        print(sample_row(label, samples[label]))
    zero, idle = samples[ZERO], samples[IDLE]
    if bench.first_cycle_runs:
        n = bench.first_cycle_runs
        per = {
            "RSS": (idle.rss - zero.rss) / n,
            "PSS": (idle.pss - zero.pss) / n,
            "USS": (idle.uss - zero.uss) / n,
        }
        kids = (idle.children_pss - zero.children_pss) / n
        print(
            "  per idle run (delta / runs): "
            + ", ".join(f"{name} {value / MIB:.3f} MiB" for name, value in per.items())
            + f"; its processes outside the daemon {kids / MIB:.3f} MiB PSS"
        )
        verdict = "met" if per["RSS"] <= IDLE_TARGET_MIB * MIB else "NOT met"
        print(f"  target: at most {IDLE_TARGET_MIB} MiB RSS per idle run: {verdict}")


ZERO: Final = "at 0 runs (after a warm-up)"
IDLE: Final = "with every run idle"
PEAK: Final = "peak (sampled)"
AFTER: Final = "after every run ended"


def progress(line: str) -> None:
    print(f"  .. {line}", flush=True)


def measure(site: Site, args: argparse.Namespace, problems: Problems) -> None:
    bench = Bench(site, args, problems)
    with daemon(site) as proc, Sampler(proc.pid) as sampler:
        pid = proc.pid
        if not bench.warm_up():
            return
        time.sleep(IDLE_PAUSE_S)
        zero = sample(pid)
        zero_fds = kinds(fd_targets(pid))
        samples: dict[str, Sample] = {ZERO: zero}
        for cycle in range(1, args.cycles + 1):
            progress(f"cycle {cycle}: {args.runs} runs starting at once")
            with bench.cpu_of("start", pid):
                runs = bench.start_all()
            time.sleep(IDLE_PAUSE_S)
            if cycle == 1:
                samples[IDLE] = sample(pid)
                bench.first_cycle_runs = len(runs)
            progress(f"{len(runs)} runs started; {args.calls} calls each")
            with bench.cpu_of("calls", pid):
                bench.calls(runs)
            progress(f"{args.execs} execs each")
            with bench.cpu_of("execs", pid):
                bench.execs(runs)
            progress("ending every run at once")
            with bench.cpu_of("end", pid):
                bench.end_all(runs)
            progress(f"waiting up to {SETTLE_S:.0f} s for the daemon's threads and descriptors")
            after = settled(pid, zero)
            samples[AFTER if cycle == 1 else f"after cycle {cycle}"] = after
        samples[PEAK] = Sample(**{name: sampler.peak.get(name, 0) for name in Sample.__slots__})
        report(bench, samples)
        print("\n  leak check")
        for label, found in bench.leaks(pid, zero, zero_fds, after):
            shown = f": {found[:SHOWN_FAILURES]}" if found else ""
            print(f"    {'LEAK' if found else 'ok  '} {label}{shown}")
            if found:
                problems.append(f"leak: {label}{shown}")


def bench_main(args: argparse.Namespace) -> int:
    site = make_site(args.runs)
    problems = Problems()
    print(
        f"many runs on one host: {args.runs} runs x ({args.calls} calls + {args.execs} execs "
        f"of {TRUE}); {env_info()}, load average {os.getloadavg()[0]:.1f}"
    )
    print(f"  prefix {site.prefix}, uids {site.uid_base}+{UID_COUNT}, directory {site.base}")
    try:
        measure(site, args, problems)
    finally:
        # The daemon has stopped: a namespace still there outlived it too, and must not
        # stay on the host either way.
        for name in netns_left(site.prefix):
            problems.add(f"the network namespace {name} outlived the daemon")
            subprocess.run(["ip", "netns", "delete", name], check=False)
        shutil.rmtree(site.base, ignore_errors=True)
    if problems:
        print(f"\nFAILED: {len(problems)} problem(s); the first: {problems[0]}")
        return 1
    print("\nno failed call, no leak")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=200, help="runs created at once (200)")
    parser.add_argument("--calls", type=int, default=50, help="time.now calls per run (50)")
    parser.add_argument("--execs", type=int, default=5, help=f"{TRUE} execs per run (5)")
    parser.add_argument(
        "--call-workers", type=int, default=8, help="processes making the calls (8)"
    )
    parser.add_argument("--exec-parallel", type=int, default=8, help="execs at once (8)")
    parser.add_argument(
        "--cycles",
        type=int,
        default=1,
        help="start, use and end the runs this many times in one daemon (1): memory still "
        "growing after the first cycle is a leak, memory kept at the first's peak is not",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main()
    if not 1 <= args.runs <= MAX_RUNS:
        parser.error(f"--runs must be 1..{MAX_RUNS} (the bench's uid range holds {UID_COUNT})")
    if min(args.calls, args.execs) < 0 or min(args.call_workers, args.exec_parallel) < 1:
        parser.error("--calls and --execs must be >= 0, the workers and parallelism >= 1")
    if args.cycles < 1:
        parser.error("--cycles must be >= 1")
    if os.geteuid() != 0 or not os.path.exists(BWRAP) or not os.path.exists(TRUE):
        print(f"needs root, {BWRAP} and {TRUE}", file=sys.stderr)
        return 2
    exit_on_sigterm()
    return bench_main(args)


if __name__ == "__main__":
    sys.exit(main())
