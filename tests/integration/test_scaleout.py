"""Scale-out for real: a Temporal dev server on loopback (tests/temporal_server.py), two
`gatewayd worker` processes standing for two hosts (their own state directories,
network namespace prefixes and sandbox uid ranges), a bare repository served over
authenticated smart HTTP, the fake model provider, real sandboxes.

Runs submitted together spread over both workers and all succeed; a worker killed
mid-run (kill -9) has its run retried on the other worker, finishing once with one
pushed branch; a cancelled run ends with its partial result and its sandbox gone; a run
without the grant is refused by the first activity.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client, WorkflowHandle

from gatewayd.audit.verify import verify_file
from gatewayd.sandbox.plan import BWRAP
from gatewayd.scaleout.spec import (
    ERROR_AUTHZ_DENIED,
    ERROR_CANCELLED,
    LIMIT_WALL_TIME_SEC,
    PROGRESS_QUERY,
    WORKFLOW_NAME,
    AgentRunOutcome,
    AgentRunSpec,
)
from tests.fakeprovider import Call, FakeProvider, Reply, Text
from tests.gitserver import DEFAULT_TOKEN, GitServer, git, make_bare_repo
from tests.integration.test_agent_run import REPO_FILES, agent_base
from tests.integration.test_run_sandbox import _unavailable
from tests.temporal_server import TemporalServer, free_port, running_temporal_server

pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))

QUEUE = "test-agent-runs"
ALIAS = "coder"
# A task holding "SLOW:<seconds>" makes the model's exec call sleep that long: a run still
# running when the test kills its worker or cancels it. Each test's seconds differ in
# their fraction, so the sleep of one run is told from another's in the process list.
SLOW_RE = re.compile(r"SLOW:([0-9.]+)")
SLOW_SECONDS = 20
# The model's key, as the workers' hosts hold it (the fake provider accepts any).
MODEL_KEY_ENV = "COGNI_TEST_SCALEOUT_MODEL_KEY"
MODEL_KEY = "sk-scaleout-" + secrets.token_hex(12)
WORKER_START_TIMEOUT_S = 60.0
RUN_TIMEOUT_S = 150.0
# The workers' shutdown grace (--shutdown-grace): short, so a SIGTERM'd worker ends its
# slow run at once, and teardown is quick.
SHUTDOWN_GRACE_S = 2
# The re-probing worker's probe interval (--probe-interval): its pauses show up fast.
PROBE_INTERVAL_S = 0.5


def model_reply(body: Mapping[str, Any]) -> Reply:
    """The model, stateless: edit, then run the tests, then finish (its answer follows
    from how many tool results the conversation holds)."""
    messages = body.get("messages", [])
    done = sum(1 for m in messages if m.get("role") == "tool")
    prompt = " ".join(str(m.get("content")) for m in messages if m.get("role") == "user")
    if done == 0:
        return Text(
            content=None,
            calls=(
                Call(name="edit", arguments={"path": "calc.py", "old": "a - b", "new": "a + b"}),
            ),
        )
    if done == 1:
        command = "python3 test_calc.py"
        if (slow := SLOW_RE.search(prompt)) is not None:
            command = f"sleep {slow.group(1)}; {command}"
        return Text(content=None, calls=(Call(name="exec", arguments={"command": command}),))
    return Text(content="Fix add()\n\nThe tests pass.")


@dataclass
class WorkerProcess:
    """A `gatewayd worker` process standing for one host; ``start`` (again) launches it
    with the same state directory, namespace prefix and uids, as a restarted host."""

    name: str
    argv: list[str]
    env: dict[str, str]
    state: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def start(self, ready: str = "polling") -> None:
        offset = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=out, stderr=out
            )
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        while ready not in self.output()[offset:]:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"{self.name} did not start:\n{self.output()[-3000:]}")
            time.sleep(0.2)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_worker(
    base: Path,
    name: str,
    server: TemporalServer,
    provider: FakeProvider,
    *extra: str,
    queue: str = QUEUE,
    ready: str = "polling",
    extra_env: Mapping[str, str] | None = None,
) -> WorkerProcess:
    models = {
        ALIAS: {
            "provider": "openai",
            "model": "fake",
            "api_base": provider.api_base,
            "api_key_env": MODEL_KEY_ENV,
        }
    }
    config = base / f"{name}.yaml"
    config.write_text("{}\n")
    state = base / f"{name}-state"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("GATEWAYD_")},
        "GATEWAYD_MODELS": json.dumps(models),
        "GATEWAYD_CONFIG": str(config),
        "COGNI_GIT_TOKEN": DEFAULT_TOKEN,
        MODEL_KEY_ENV: MODEL_KEY,
    }
    uid_base = 1_650_000_000 + secrets.randbelow(40_000) * 1024
    argv = [
        sys.executable,
        "-m",
        "gatewayd.cli",
        "worker",
        *("--temporal", server.address, "--namespace", server.namespace),
        *("--task-queue", queue, "--host-name", name, "--max-runs", "2"),
        *("--state-dir", str(state), "--netns-prefix", f"cgw{secrets.token_hex(3)}-"),
        *("--sandbox-uids", f"{uid_base}+32"),
        *("--shutdown-grace", str(SHUTDOWN_GRACE_S)),
        *extra,
    ]
    env.update(extra_env or {})
    worker = WorkerProcess(name, argv, env, state, base / f"{name}.log")
    worker.start(ready)
    return worker


@pytest.fixture(scope="module")
def base() -> Iterator[Path]:
    yield from agent_base()


@pytest.fixture(scope="module")
def temporal(base: Path) -> Iterator[TemporalServer]:
    with running_temporal_server(base / "temporal") as server:
        yield server


@pytest.fixture(scope="module")
def provider() -> Iterator[FakeProvider]:
    with FakeProvider() as fake:
        fake.respond = model_reply
        yield fake


@pytest.fixture(scope="module")
def gitserver(base: Path) -> Iterator[GitServer]:
    with GitServer(base / "served", token=DEFAULT_TOKEN) as served:
        yield served


@pytest.fixture(scope="module")
def workers(
    base: Path, temporal: TemporalServer, provider: FakeProvider
) -> Iterator[dict[str, WorkerProcess]]:
    started: dict[str, WorkerProcess] = {}
    try:
        for name in ("worker-a", "worker-b"):
            started[name] = start_worker(base, name, temporal, provider)
        yield started
    finally:
        for worker in started.values():
            worker.stop()


@pytest.fixture(scope="module")
def repo(gitserver: GitServer) -> tuple[str, str]:
    sha = make_bare_repo(gitserver.root, "calc.git", REPO_FILES)
    return gitserver.url_for("calc.git"), sha


def spec(repo: tuple[str, str], task: str = "make add() add", **changes: Any) -> AgentRunSpec:
    url, sha = repo
    the_spec = AgentRunSpec(
        repo=url,
        sha=sha,
        task_input=task,
        actor_id="ci",
        tenant_id="t1",
        model=ALIAS,
        grant={"allowSandbox": True},
        limits={LIMIT_WALL_TIME_SEC: 120},
    )
    for key, value in changes.items():
        setattr(the_spec, key, value)
    return the_spec


async def submit(
    server: TemporalServer, specs: list[AgentRunSpec], *, histories: list[str] | None = None
) -> list[AgentRunOutcome]:
    """Start every run, wait for every outcome; ``histories`` gets each workflow's whole
    history as JSON."""
    client = await Client.connect(server.address, namespace=server.namespace)
    handles = [
        await client.start_workflow(
            WORKFLOW_NAME,
            s,
            id=f"run-{uuid.uuid4().hex}",
            task_queue=QUEUE,
            result_type=AgentRunOutcome,
        )
        for s in specs
    ]
    outcomes = await asyncio.wait_for(
        asyncio.gather(*(h.result() for h in handles)), timeout=RUN_TIMEOUT_S
    )
    if histories is not None:
        for handle in handles:
            histories.append((await handle.fetch_history()).to_json())
    return list(outcomes)


def slow_task() -> tuple[str, str]:
    """A task whose run sleeps SLOW_SECONDS in its exec, and that sleep's command line."""
    seconds = f"{SLOW_SECONDS}.{secrets.randbelow(10**6):06d}"
    return f"make add() add SLOW:{seconds}", f"sleep {seconds}"


def sleeping(command: str) -> bool:
    return subprocess.run(["pgrep", "-f", command], capture_output=True).returncode == 0


def branches(gitserver: GitServer) -> list[str]:
    out = git(
        "--git-dir", str(gitserver.root / "calc.git"), "for-each-ref", "--format=%(refname)"
    ).decode()
    return [line for line in out.splitlines() if line.startswith("refs/heads/cogni/")]


def test_runs_submitted_together_spread_over_both_workers_and_all_succeed(
    temporal: TemporalServer, workers: dict[str, WorkerProcess], repo: tuple[str, str]
) -> None:
    histories: list[str] = []
    outcomes = asyncio.run(submit(temporal, [spec(repo) for _ in range(4)], histories=histories))
    assert all(o.ok for o in outcomes), [(o.error_code, o.message) for o in outcomes]
    assert {o.host for o in outcomes} == {"worker-a", "worker-b"}
    assert len({o.run_id for o in outcomes}) == 4
    for outcome in outcomes:
        assert "+    return a + b" in outcome.patches[0]
        # The reviewer's anchor: the run's last entry on the host that ran it.
        entries = outcome.audit_bundle["entries"]
        assert entries and entries[-1]["hash"] == outcome.audit_head
        assert entries[-1]["seq"] == outcome.audit_seq
        assert all(e.get("runId") == outcome.run_id for e in entries)
        log = workers[outcome.host].state / "audit" / "audit.jsonl"
        assert outcome.audit_head in log.read_text()
    for worker in workers.values():
        assert verify_file(worker.state / "audit" / "audit.jsonl").ok
    # Credentials stay on the hosts: the whole history holds neither the git token nor
    # the model key (the runs used both: a clone over authenticated HTTP, model calls).
    assert len(histories) == 4 and all("execute_run" in h for h in histories)
    for history in histories:
        assert DEFAULT_TOKEN not in history and MODEL_KEY not in history


def test_a_run_without_the_grant_is_refused_by_the_first_activity(
    temporal: TemporalServer, workers: dict[str, WorkerProcess], repo: tuple[str, str]
) -> None:
    [outcome] = asyncio.run(submit(temporal, [spec(repo, grant={})]))
    assert not outcome.ok and outcome.error_code == ERROR_AUTHZ_DENIED
    assert "allowSandbox" in outcome.message and outcome.run_id == ""
    audited = "".join((w.state / "audit" / "audit.jsonl").read_text() for w in workers.values())
    assert '"errorCode":"authz_denied"' in audited


async def _wait_running(handle: WorkflowHandle[Any, Any], turn: int = 1) -> dict[str, Any]:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        progress: dict[str, Any] = await handle.query(PROGRESS_QUERY)
        if progress["state"] == "running" and progress["turn"] >= turn:
            return progress
        await asyncio.sleep(0.3)
    raise AssertionError("the run never reached its turn")


def test_a_worker_killed_mid_run_has_its_run_retried_on_the_other_once(
    temporal: TemporalServer,
    workers: dict[str, WorkerProcess],
    repo: tuple[str, str],
    gitserver: GitServer,
) -> None:
    before = set(branches(gitserver))
    task, command = slow_task()

    async def go() -> tuple[AgentRunOutcome, str]:
        client = await Client.connect(temporal.address, namespace=temporal.namespace)
        handle = await client.start_workflow(
            WORKFLOW_NAME,
            spec(repo, task, push=True),
            id=f"kill-{uuid.uuid4().hex}",
            task_queue=QUEUE,
            result_type=AgentRunOutcome,
        )
        # Turn 1's edit reported (a call's line comes when it ends): the slow exec next.
        progress = await _wait_running(handle, turn=1)
        await asyncio.sleep(3)
        victim = workers[progress["host"]]
        victim.kill()
        outcome = await asyncio.wait_for(handle.result(), timeout=RUN_TIMEOUT_S)
        return outcome, victim.name

    outcome, victim = asyncio.run(go())
    assert outcome.ok and outcome.pushed, (outcome.error_code, outcome.message)
    assert outcome.host != victim and outcome.attempt == 2
    new = set(branches(gitserver)) - before
    assert new == {f"refs/heads/{outcome.branch}"}
    # The killed host comes back: its start removes what the dead run left (network
    # namespace, run directory, workspace) and the audit chain goes on across the crash.
    killed = workers[victim]
    killed.start()
    audit = killed.state / "audit" / "audit.jsonl"
    assert '"event":"leftovers_removed"' in audit.read_text()
    assert verify_file(audit).ok
    assert not sleeping(command)  # the dead run's sandbox is gone too


def test_a_cancelled_run_ends_with_its_partial_result_and_its_sandbox_gone(
    temporal: TemporalServer,
    workers: dict[str, WorkerProcess],
    repo: tuple[str, str],
    gitserver: GitServer,
) -> None:
    before = set(branches(gitserver))
    task, command = slow_task()

    async def go() -> AgentRunOutcome:
        client = await Client.connect(temporal.address, namespace=temporal.namespace)
        handle = await client.start_workflow(
            WORKFLOW_NAME,
            spec(repo, task, push=True),
            id=f"cancel-{uuid.uuid4().hex}",
            task_queue=QUEUE,
            result_type=AgentRunOutcome,
        )
        progress = await _wait_running(handle, turn=1)  # edited; the slow exec next
        assert progress["tool"] == "edit" and progress["runId"]
        await asyncio.sleep(3)
        # The activity heartbeats with the run's progress (host, turn, tool).
        described = await handle.describe()
        [pending] = described.raw_description.pending_activities
        beat = json.loads(pending.heartbeat_details.payloads[0].data)
        assert beat["host"] == progress["host"] and beat["turn"] >= 1
        assert beat["run_id"] == progress["runId"] and beat["state"] == "running"
        cancelled = time.monotonic()
        await handle.cancel()
        outcome = await asyncio.wait_for(handle.result(), timeout=RUN_TIMEOUT_S)
        # Ended, not waited out: the command's sleep had most of its time left.
        assert time.monotonic() - cancelled < SLOW_SECONDS - 3
        return outcome

    outcome = asyncio.run(go())
    assert not outcome.ok and outcome.error_code == ERROR_CANCELLED
    assert not outcome.pushed and set(branches(gitserver)) == before
    # The partial result: the edit made before the cancellation.
    assert "+    return a + b" in outcome.patches[0]
    # The sandbox is gone: no command of it left, the run ended in the audit log.
    assert not sleeping(command)
    entries = outcome.audit_bundle["entries"]
    assert any(e.get("event") == "run_ended" for e in entries)
    assert entries[-1]["event"] == "agent_run_ended"
    assert entries[-1]["detail"]["errorCode"] == ERROR_CANCELLED
    host_log = (workers[outcome.host].state / "audit" / "audit.jsonl").read_text()
    assert outcome.audit_head in host_log


def test_a_worker_whose_sandbox_probe_fails_does_not_poll(
    base: Path, temporal: TemporalServer, provider: FakeProvider
) -> None:
    """No OS sandbox on this "host": the worker says why and takes no work (no poller on
    its queue); SIGTERM stops it cleanly."""
    queue = "probe-fails"
    worker = start_worker(
        base,
        "worker-nosandbox",
        temporal,
        provider,
        "--no-os-sandbox",
        queue=queue,
        ready="not polling",
    )
    try:
        assert "the sandbox probe fails: the OS sandbox is turned off" in worker.output()
        time.sleep(2)
        assert asyncio.run(pollers(temporal, queue)) == 0
    finally:
        assert worker.stop() == 0
    assert "stopped" in worker.output()


async def pollers(server: TemporalServer, queue: str) -> int:
    """How many workers poll ``queue`` (workflow and activity tasks)."""
    client = await Client.connect(server.address, namespace=server.namespace)
    total = 0
    for kind in (TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW, TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY):
        answer = await client.workflow_service.describe_task_queue(
            DescribeTaskQueueRequest(
                namespace=server.namespace, task_queue=TaskQueue(name=queue), task_queue_type=kind
            )
        )
        total += len(answer.pollers)
    return total


def test_a_worker_that_cannot_reach_temporal_says_where_it_tried(base: Path) -> None:
    config = base / "empty.yaml"
    config.write_text("{}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAYD_")}
    closed = free_port()
    down = subprocess.run(
        [
            sys.executable,
            "-m",
            "gatewayd.cli",
            "worker",
            "--temporal",
            f"127.0.0.1:{closed}",
            "--state-dir",
            str(base / "down-state"),
            "--netns-prefix",
            f"cgw{secrets.token_hex(3)}-",
            "--no-os-sandbox",
            "--sandbox-uids",
            f"{1640000000 + secrets.randbelow(9000) * 1024}+16",
        ],
        env={**env, "GATEWAYD_CONFIG": str(config)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert down.returncode == 1
    assert f"cannot reach Temporal at 127.0.0.1:{closed} (namespace default)" in down.stderr
    assert "check --temporal and --namespace" in down.stderr


def test_a_worker_stopped_mid_run_ends_the_run_and_it_is_retried_on_the_other_once(
    temporal: TemporalServer,
    workers: dict[str, WorkerProcess],
    repo: tuple[str, str],
    gitserver: GitServer,
    provider: FakeProvider,
) -> None:
    """SIGTERM on the worker running a run: past its shutdown grace the run is ended
    there (sandbox killed, audited), the worker exits 0, and the run is retried on the
    other worker as a fresh run, pushed once (not reported cancelled: never retried)."""
    before = set(branches(gitserver))
    seconds = f"{SLOW_SECONDS}.{secrets.randbelow(10**6):06d}"
    marker, command = f"SLOWONCE:{seconds}", f"sleep {seconds}"
    slowed: set[str] = set()

    def slow_the_first_conversation(body: Mapping[str, Any]) -> Reply:
        """The stopped worker's run sleeps in its exec; the retry's runs at once."""
        messages = body.get("messages", [])
        done = sum(1 for m in messages if m.get("role") == "tool")
        prompt = " ".join(str(m.get("content")) for m in messages if m.get("role") == "user")
        if done == 1 and marker in prompt and marker not in slowed:
            slowed.add(marker)
            exec_call = Call(name="exec", arguments={"command": f"{command}; true"})
            return Text(content=None, calls=(exec_call,))
        return model_reply(body)

    async def go() -> tuple[AgentRunOutcome, str, str, float]:
        client = await Client.connect(temporal.address, namespace=temporal.namespace)
        handle = await client.start_workflow(
            WORKFLOW_NAME,
            spec(repo, f"make add() add {marker}", push=True),
            id=f"term-{uuid.uuid4().hex}",
            task_queue=QUEUE,
            result_type=AgentRunOutcome,
        )
        progress = await _wait_running(handle, turn=1)
        await asyncio.sleep(3)  # the slow exec runs
        assert sleeping(command)
        victim = workers[progress["host"]]
        assert victim.proc is not None
        signalled = time.monotonic()
        victim.proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(victim.proc.wait, 60)
        stopped_after = time.monotonic() - signalled
        outcome = await asyncio.wait_for(handle.result(), timeout=RUN_TIMEOUT_S)
        return outcome, victim.name, progress["runId"], stopped_after

    provider.respond = slow_the_first_conversation
    victim = ""
    try:
        outcome, victim, first_run, stopped_after = asyncio.run(go())
        stopped = workers[victim]
        assert stopped.proc is not None and stopped.proc.returncode == 0, stopped.output()[-3000:]
        # Ended after the grace, not waited out: the exec had most of its sleep left.
        assert stopped_after < SLOW_SECONDS - 3
        assert not sleeping(command)
        assert outcome.ok and outcome.pushed, (outcome.error_code, outcome.message)
        assert outcome.host != victim and outcome.attempt == 2
        assert outcome.run_id and outcome.run_id != first_run
        assert set(branches(gitserver)) - before == {f"refs/heads/{outcome.branch}"}
        said = stopped.output()
        assert f"stopping: no more polling; running runs get {SHUTDOWN_GRACE_S} s" in said
        assert said.rstrip().endswith("stopped")
        # The stopped host's log says its run ended, and why; its chain verifies.
        audit = stopped.state / "audit" / "audit.jsonl"
        ended = [
            json.loads(line)
            for line in audit.read_text().splitlines()
            if '"agent_run_ended"' in line and first_run in line
        ]
        assert [e["detail"]["errorCode"] for e in ended] == [ERROR_CANCELLED]
        assert "the worker is stopping" in json.dumps(ended)
        assert verify_file(audit).ok
    finally:
        provider.respond = model_reply
        if victim:
            workers[victim].start()  # the module's later tests have both hosts again


def test_a_worker_polls_again_once_its_sandbox_probe_passes_again(
    base: Path, temporal: TemporalServer, provider: FakeProvider, repo: tuple[str, str]
) -> None:
    """The host's bubblewrap goes away: the re-probe stops the polling (a run submitted
    meanwhile waits, untouched); it comes back: the worker polls again and runs it."""
    queue = "reprobe"
    bin_dir = base / "reprobe-bin"
    bin_dir.mkdir(exist_ok=True)
    bwrap = bin_dir / "bwrap"
    bwrap.unlink(missing_ok=True)
    bwrap.symlink_to(os.path.realpath(BWRAP))
    worker = start_worker(
        base,
        "worker-reprobe",
        temporal,
        provider,
        *("--probe-interval", str(PROBE_INTERVAL_S)),
        queue=queue,
        extra_env={"GATEWAYD_BWRAP": str(bwrap)},
    )
    try:
        polling = f"polling {queue} on"
        assert worker.output().count(polling) == 1
        bwrap.unlink()
        paused = f"not polling {queue}: the sandbox probe fails: bubblewrap is not installed"
        wait_for_line(worker, paused)

        async def go() -> tuple[AgentRunOutcome, list[str]]:
            client = await Client.connect(temporal.address, namespace=temporal.namespace)
            handle = await client.start_workflow(
                WORKFLOW_NAME,
                spec(repo, grant={}),
                id=f"reprobe-{uuid.uuid4().hex}",
                task_queue=queue,
                result_type=AgentRunOutcome,
            )
            await asyncio.sleep(4 * PROBE_INTERVAL_S)
            # Nobody took its first task: the worker does not poll.
            events = [e.WhichOneof("attributes") async for e in handle.fetch_history_events()]
            bwrap.symlink_to(os.path.realpath(BWRAP))
            outcome = await asyncio.wait_for(handle.result(), timeout=RUN_TIMEOUT_S)
            return outcome, events

        outcome, events = asyncio.run(go())
        assert "workflow_task_scheduled_event_attributes" in events
        assert "workflow_task_started_event_attributes" not in events
        assert outcome.error_code == ERROR_AUTHZ_DENIED and outcome.host == ""
        assert worker.output().count(polling) == 2
    finally:
        bwrap.unlink(missing_ok=True)
        assert worker.stop() == 0


def test_a_worker_whose_sandbox_was_missing_at_start_never_polls(
    base: Path, temporal: TemporalServer, provider: FakeProvider
) -> None:
    """Its gatewayd set up no sandbox at start (runs would run without one): a later
    passing probe does not make it poll; it says to restart it."""
    queue = "reprobe-late"
    bwrap = base / "reprobe-late-bin" / "bwrap"
    bwrap.parent.mkdir(exist_ok=True)
    bwrap.unlink(missing_ok=True)
    worker = start_worker(
        base,
        "worker-reprobe-late",
        temporal,
        provider,
        *("--probe-interval", str(PROBE_INTERVAL_S)),
        queue=queue,
        ready="not polling",
        extra_env={"GATEWAYD_BWRAP": str(bwrap)},
    )
    try:
        bwrap.symlink_to(os.path.realpath(BWRAP))
        wait_for_line(worker, "found when this worker started; restart it once the host is fixed")
        time.sleep(4 * PROBE_INTERVAL_S)
        assert f"polling {queue} on" not in worker.output()
        assert asyncio.run(pollers(temporal, queue)) == 0
    finally:
        bwrap.unlink(missing_ok=True)
        assert worker.stop() == 0


def wait_for_line(worker: WorkerProcess, line: str) -> None:
    deadline = time.monotonic() + WORKER_START_TIMEOUT_S
    while line not in worker.output():
        assert time.monotonic() < deadline, f"no {line!r} in:\n{worker.output()[-3000:]}"
        time.sleep(0.2)
