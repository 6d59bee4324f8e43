"""The clients of agent runs on Temporal, against a real Temporal server (the dev server
of tests/temporal_server.py, on loopback): `gatewayd agent submit|status|result|cancel`
as real processes, and the control socket's /v1/agent-runs routes of a real `gatewayd
serve`. The workflow behind them here is tests/scaleout_standin.py's stand-in (same type
name, spec and outcome; no sandbox), so each client path is checked in a second; the
real workflow and its worker are test_scaleout.py's, and this module's last test, which
reads a real run's whole history for the credentials the worker held.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from temporalio.client import Client, WorkflowExecutionStatus

from gatewayd.scaleout.submission import WORKFLOW_ID_RE
from tests.fakeprovider import FakeProvider
from tests.gitserver import GitServer, make_bare_repo
from tests.integration.test_agent_run import REPO_FILES, agent_base
from tests.integration.test_run_sandbox import _unavailable
from tests.integration.test_scaleout import WORKER_START_TIMEOUT_S, model_reply
from tests.livedaemon import LiveDaemon, start_daemon
from tests.scaleout_standin import HOST, SomeOtherWorkflow, standin_worker
from tests.temporal_server import TemporalServer, free_port, running_temporal_server

BIN = Path(sys.executable).parent
QUEUE = "clients-standin"
SHA = "a" * 40
# A CLI command: a Python start (~1 s on a loaded machine) and a few Temporal calls.
CLI_TIMEOUT_S = 120


# An empty configuration file, so no /etc/gatewayd/gatewayd.yaml of the machine counts.
_EMPTY_CONFIG: list[Path] = []


@pytest.fixture(scope="module", autouse=True)
def empty_config(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    path = tmp_path_factory.mktemp("config") / "gatewayd.yaml"
    path.write_text("{}\n")
    _EMPTY_CONFIG.append(path)
    yield
    _EMPTY_CONFIG.remove(path)


@pytest.fixture(scope="module")
def temporal(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TemporalServer]:
    with running_temporal_server(tmp_path_factory.mktemp("temporal")) as server:
        yield server


@pytest.fixture(scope="module")
def standin(temporal: TemporalServer) -> Iterator[TemporalServer]:
    with standin_worker(temporal.address, temporal.namespace, QUEUE):
        yield temporal


def gatewayd(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`gatewayd ARGV` as a process, with no GATEWAYD_ setting of the test's own."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAYD_")}
    return subprocess.run(
        [str(BIN / "gatewayd"), *argv],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        env={**clean, "GATEWAYD_CONFIG": str(_EMPTY_CONFIG[0]), **(env or {})},
        check=False,
    )


def on(server: TemporalServer, *, queue: bool = False) -> list[str]:
    where = ["--temporal", server.address, "--namespace", server.namespace]
    return [*where, "--task-queue", QUEUE] if queue else where


def submit(server: TemporalServer, task: str, *extra: str) -> str:
    done = gatewayd(
        "agent", "submit", *on(server, queue=True), "--repo", "https://example.org/r.git", "--sha", SHA,
        "--model", "fake", "--task", task, *extra,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    workflow_id = done.stdout.strip()
    assert WORKFLOW_ID_RE.fullmatch(workflow_id), done.stdout
    assert f"gatewayd agent status {workflow_id}" in done.stderr
    return workflow_id


def cli_json(server: TemporalServer, *argv: str) -> tuple[int, dict[str, Any], str]:
    done = gatewayd("agent", *argv[:1], *on(server), *argv[1:])
    answer = json.loads(done.stdout) if done.stdout.strip() else {}
    return done.returncode, answer, done.stderr


def sdk(server: TemporalServer, work: Any) -> Any:
    """``work(client)`` on a client of its own (the test's view of Temporal, beside the
    one under test)."""

    async def go() -> Any:
        return await work(await Client.connect(server.address, namespace=server.namespace))

    return asyncio.run(go())


# --- gatewayd agent submit|status|result|cancel ----------------------------------------


def test_submit_prints_the_workflow_id_and_the_worker_gets_the_spec_without_credentials(
    standin: TemporalServer,
) -> None:
    workflow_id = submit(
        standin, "echo", "--max-wall-s", "12.5", "--no-push", "--branch", "feature/x",
        "--max-patch-bytes", "4096", "--actor", "alice", "--tenant", "t9",
    )  # fmt: skip
    code, result, err = cli_json(standin, "result", workflow_id, "--wait", "--timeout", "60")
    assert code == 0, err
    assert result["ok"] is True and result["status"] == "completed"
    assert result["workflowId"] == workflow_id
    # Where a reviewer verifies it: the host and its chain's head, in camelCase.
    assert (result["host"], result["auditHead"], result["auditSeq"]) == (HOST, "ab" * 32, 7)
    spec = json.loads(result["logs"][0])
    assert spec["run_id"] is None  # the worker makes the run id
    assert spec["grant"] == {"allowSandbox": True}  # the host's operator submits
    assert spec["limits"] == {
        "maxTurns": 40,
        "maxTokens": 400_000,
        "wallTimeSec": 13,  # never rounded down below what was asked
        "maxMemoryMb": 2048,
        "maxPatchBytes": 4096,
        "maxWorkspaceBytes": 1 << 30,
    }
    assert (spec["push"], spec["branch"], spec["actor_id"], spec["tenant_id"]) == (
        False,
        "feature/x",
        "alice",
        "t9",
    )
    assert not [key for key in spec if re.search("token|secret|key|password", key)]


def test_a_held_run_shows_progress_refuses_an_early_result_and_cancels_to_a_partial_result(
    standin: TemporalServer,
) -> None:
    workflow_id = submit(standin, "hold")
    code, status, err = cli_json(standin, "status", workflow_id)
    assert code == 0, err
    assert status["status"] == "running" and status["closeTime"] is None
    assert status["progress"] == {"state": "running", "turn": 0, "tool": None, "host": HOST}

    code, _, err = cli_json(standin, "result", workflow_id)
    assert code == 1
    assert "has not finished (status running)" in err and "--wait" in err
    code, _, err = cli_json(standin, "result", workflow_id, "--wait", "--timeout", "0.5")
    assert code == 1
    assert "had not ended after --timeout 0.5 s" in err

    code, cancelled, err = cli_json(standin, "cancel", workflow_id)
    assert code == 0, err
    assert cancelled == {"ok": True, "workflowId": workflow_id, "cancelRequested": True}
    code, result, err = cli_json(standin, "result", workflow_id, "--wait", "--timeout", "60")
    assert code == 1  # the run did not succeed: the exit status says so
    assert (result["ok"], result["errorCode"], result["status"]) == (
        False,
        "cancelled",
        "completed",
    )

    code, _, err = cli_json(standin, "cancel", workflow_id)
    assert code == 1
    assert "has already ended (status completed); nothing to cancel" in err


def test_a_run_no_worker_has_taken_shows_its_status_and_why_progress_is_missing(
    standin: TemporalServer,
) -> None:
    # A queue no worker polls: nobody answers the progress query.
    lonely = f"nobody-{secrets.token_hex(4)}"
    done = gatewayd(
        "agent", "submit", *on(standin), "--task-queue", lonely, "--repo",
        "https://example.org/r.git", "--sha", SHA, "--model", "fake", "--task", "echo",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    workflow_id = done.stdout.strip()
    code, status, err = cli_json(standin, "status", workflow_id)
    assert code == 0, err
    assert (status["status"], status["taskQueue"], status["progress"]) == ("running", lonely, None)
    assert "no worker answered the progress query within 5 s" in status["progressError"]

    async def stop(client: Client) -> None:
        await client.get_workflow_handle(workflow_id).terminate("test over")

    sdk(standin, stop)
    code, result, _ = cli_json(standin, "result", workflow_id)
    assert code == 1
    assert (result["status"], result["errorCode"]) == ("terminated", "terminated")


def test_a_failed_workflow_is_a_failed_result_with_its_message(standin: TemporalServer) -> None:
    workflow_id = submit(standin, "fail")
    code, result, _ = cli_json(standin, "result", workflow_id, "--wait", "--timeout", "60")
    assert code == 1
    assert result["ok"] is False and result["status"] == "failed"
    assert result["errorCode"] == "task_failed"
    assert "the stand-in failed" in result["message"]


def test_an_unknown_id_is_not_found_and_a_malformed_one_a_usage_error(
    standin: TemporalServer,
) -> None:
    unknown = "agent-run-" + secrets.token_hex(16)
    for command in ("status", "result", "cancel"):
        code, _, err = cli_json(standin, command, unknown)
        assert code == 1
        assert f"no agent run {unknown} in namespace {standin.namespace}" in err
    for bad in ("agent-run-../../x", "AGENT-RUN-" + "A" * 32, "some-workflow", "-x"):
        done = gatewayd("agent", "status", *on(standin), "--", bad)
        assert done.returncode == 2, (bad, done.stderr)
        assert "is not an agent run's workflow id" in done.stderr
        assert "agent-run- and 32 lowercase hex digits" in done.stderr


def test_another_workflow_under_an_agent_run_id_is_not_found_and_never_cancelled(
    standin: TemporalServer,
) -> None:
    # Another team's workflow, given an id of our shape: the clients answer for agent
    # runs only, so the control socket cannot read or cancel anything else.
    other = "agent-run-" + secrets.token_hex(16)

    async def start(client: Client) -> None:
        await client.start_workflow(SomeOtherWorkflow.run, id=other, task_queue=QUEUE)

    sdk(standin, start)
    for command in ("status", "result", "cancel"):
        code, _, err = cli_json(standin, command, other)
        assert code == 1 and f"no agent run {other}" in err

    async def state(client: Client) -> WorkflowExecutionStatus | None:
        handle = client.get_workflow_handle(other)
        described = await handle.describe()
        await handle.terminate("test over")
        return described.status

    assert sdk(standin, state) == WorkflowExecutionStatus.RUNNING


def test_an_unreachable_temporal_is_reported_with_the_address_and_what_to_check(
    tmp_path: Path,
) -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    done = gatewayd("agent", "status", "--temporal", address, "agent-run-" + "0" * 32)
    assert done.returncode == 1
    assert f"cannot connect to Temporal at {address}" in done.stderr
    assert "check temporal_address (or --temporal)" in done.stderr


def test_without_an_address_submit_is_a_usage_error_naming_both_ways_to_give_one() -> None:
    done = gatewayd(
        "agent", "submit", "--repo", "https://e.org/r", "--sha", SHA, "--model", "m",
        "--task", "t",
    )  # fmt: skip
    assert done.returncode == 2
    assert "no Temporal address: give --temporal HOST:PORT" in done.stderr
    assert "temporal_address" in done.stderr and "GATEWAYD_TEMPORAL_ADDRESS" in done.stderr


def test_the_address_and_queue_come_from_the_configuration_when_not_given(
    standin: TemporalServer,
) -> None:
    env = {
        "GATEWAYD_TEMPORAL_ADDRESS": standin.address,
        "GATEWAYD_TEMPORAL_NAMESPACE": standin.namespace,
        "GATEWAYD_TEMPORAL_TASK_QUEUE": QUEUE,
    }
    done = gatewayd(
        "agent", "submit", "--repo", "https://e.org/r", "--sha", SHA, "--model", "m",
        "--task", "echo", env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"task queue {QUEUE}" in done.stderr
    done = gatewayd("agent", "result", done.stdout.strip(), "--wait", env=env)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--repo", "https://x-access-token:ghp_abc@github.com/o/r.git"], "user or password"),
        (["--repo", "https://ghp_abc@github.com/o/r.git"], "user or password"),
        (["--repo", "https://github.com/o/r.git?access_token=ghp_abc"], "query or fragment"),
        (["--repo", "ssh://git@github.com/o/r.git"], "scheme 'ssh' is not supported"),
        (["--repo", "--upload-pack=touch /tmp/x"], "may not start with '-'"),
        (["--branch", "main"], "never pushes to the default branch"),
        (["--branch", "cogni/../main"], "is not a branch name"),
        (["--model", "../m"], "is not a model alias"),
        (["--policy", "/etc/passwd"], "not a path"),
        (["--max-memory-mb", "8"], "limits.maxMemoryMb"),
        (["--max-turns", "0"], "limits.maxTurns"),
    ],
)
def test_submit_refuses_what_the_history_must_not_keep_before_reaching_temporal(
    options: list[str], message: str
) -> None:
    # Nothing listens at the address: a refusal is decided before any connection.
    settings = {"--repo": "https://e.org/r", "--model": "m"}
    settings.update(zip(options[::2], options[1::2], strict=True))
    done = gatewayd(
        "agent", "submit", "--temporal", f"127.0.0.1:{free_port()}", "--sha", SHA,
        "--task", "t", *[f"{name}={value}" for name, value in settings.items()],
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert "cannot connect" not in done.stderr


# --- the control socket's /v1/agent-runs --------------------------------------------------


def serving(state: Path, env: dict[str, str]) -> Iterator[LiveDaemon]:
    """A `gatewayd serve` on ``state`` with the GATEWAYD_TEMPORAL_* settings of ``env``;
    it must stop cleanly (a Temporal SDK thread must not abort its exit)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAYD_")}
    with mock.patch.dict(os.environ, {**clean, **env}, clear=True):
        daemon = start_daemon(state)
    try:
        yield daemon
    finally:
        status = daemon.stop()
        assert status == 0, daemon.log_path.read_text()[-3000:]


@pytest.fixture(scope="module")
def daemon(
    standin: TemporalServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveDaemon]:
    env = {
        "GATEWAYD_TEMPORAL_ADDRESS": standin.address,
        "GATEWAYD_TEMPORAL_NAMESPACE": standin.namespace,
        "GATEWAYD_TEMPORAL_TASK_QUEUE": QUEUE,
    }
    yield from serving(tmp_path_factory.mktemp("gw") / "state", env)


def body(task: str, **extra: Any) -> dict[str, Any]:
    return {
        "grant": {"allowSandbox": True},
        "repo": "https://example.org/r.git",
        "sha": SHA,
        "taskInput": task,
        "model": "fake",
        **extra,
    }


def test_the_control_socket_submits_reads_and_cancels_agent_runs(daemon: LiveDaemon) -> None:
    status, answer = daemon.control("POST", "/v1/agent-runs", body("echo", push=False))
    assert status == 201, answer
    workflow_id = answer["workflowId"]
    assert WORKFLOW_ID_RE.fullmatch(workflow_id)
    assert answer["result"] == f"/v1/agent-runs/{workflow_id}/result"
    for _ in range(100):  # the stand-in completes at once; the status says when
        status, answer = daemon.control("GET", f"/v1/agent-runs/{workflow_id}")
        if answer.get("status") == "completed":
            break
    assert status == 200 and answer["status"] == "completed"
    status, answer = daemon.control("GET", f"/v1/agent-runs/{workflow_id}/result")
    assert status == 200 and answer["ok"] is True and answer["host"] == HOST
    spec = json.loads(answer["logs"][0])
    assert (spec["grant"], spec["push"], spec["run_id"]) == ({"allowSandbox": True}, False, None)

    status, answer = daemon.control("POST", "/v1/agent-runs", body("hold"))
    held = answer["workflowId"]
    status, answer = daemon.control("GET", f"/v1/agent-runs/{held}/result")
    assert status == 409 and answer["errorCode"] == "bad_request"
    assert "has not finished" in answer["message"]
    status, answer = daemon.control("DELETE", f"/v1/agent-runs/{held}")
    assert status == 202 and answer["cancelRequested"] is True
    for _ in range(100):
        status, answer = daemon.control("GET", f"/v1/agent-runs/{held}/result")
        if status == 200:
            break
    assert (answer["ok"], answer["errorCode"]) == (False, "cancelled")
    status, answer = daemon.control("DELETE", f"/v1/agent-runs/{held}")
    assert status == 409 and "already ended" in answer["message"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"gitToken": "ghp_x"}, "gitToken: a submission carries no credential"),
        ({"OPENAI_API_KEY": "sk-x"}, "OPENAI_API_KEY: a submission carries no credential"),
        ({"credentials": {"token": "x"}}, "credentials: a submission carries no credential"),
        ({"runId": "0" * 32}, "runId: run ids are made by the worker"),
        ({"repo": "https://u:p@github.com/o/r"}, "carries a user or password"),
        ({"repo": "https://github.com/o/r?private_token=x"}, "has a query or fragment"),
        ({"taskInput": "x" * (256 * 1024 + 1)}, "over 262144 bytes"),
        ({"taskInput": "  \n"}, "the task is empty"),
        ({"sha": "main"}, "sha"),
        ({"branch": "refs/heads/main"}, "never pushes to the default branch or a full ref"),
        ({"limits": {"maxTurns": 5, "maxFun": 1}}, "limits.maxFun"),
        ({"limits": {"wallTimeSec": "60"}}, "limits.wallTimeSec"),
        ({"grant": None}, "grant"),
        ({"push": "yes"}, "push"),
    ],
)
def test_the_control_socket_refuses_a_submission_with_credentials_or_nonsense(
    daemon: LiveDaemon, change: dict[str, Any], message: str
) -> None:
    status, answer = daemon.control("POST", "/v1/agent-runs", body("echo", **change))
    assert status == 400, answer
    assert answer["errorCode"] == "bad_request"
    assert message in answer["message"]
    assert answer["message"].startswith("bad agent run submission: ")


def test_the_control_socket_needs_the_grant_stated(daemon: LiveDaemon) -> None:
    payload = body("echo")
    del payload["grant"]
    status, answer = daemon.control("POST", "/v1/agent-runs", payload)
    assert status == 400 and "grant: Field required" in answer["message"]


def test_the_control_socket_answers_for_agent_runs_only(
    daemon: LiveDaemon, standin: TemporalServer
) -> None:
    status, answer = daemon.control("GET", "/v1/agent-runs/agent-run-" + "0" * 32)
    assert status == 404 and "no agent run agent-run-000" in answer["message"]
    status, answer = daemon.control("GET", "/v1/agent-runs/some-workflow")
    assert status == 400 and "is not an agent run's workflow id" in answer["message"]
    status, answer = daemon.control("GET", "/v1/agent-runs/agent-run-%2e%2e/result")
    assert status == 400
    status, answer = daemon.control("PUT", "/v1/agent-runs")
    assert status == 404 and "no route PUT /v1/agent-runs; agent runs:" in answer["message"]
    status, answer = daemon.control("DELETE", f"/v1/agent-runs/agent-run-{'0' * 32}/result")
    assert status == 404 and "no route" in answer["message"]

    other = "agent-run-" + secrets.token_hex(16)

    async def start(client: Client) -> None:
        await client.start_workflow(SomeOtherWorkflow.run, id=other, task_queue=QUEUE)

    async def stop(client: Client) -> WorkflowExecutionStatus | None:
        handle = client.get_workflow_handle(other)
        described = await handle.describe()
        await handle.terminate("test over")
        return described.status

    sdk(standin, start)
    status, answer = daemon.control("DELETE", f"/v1/agent-runs/{other}")
    assert status == 404 and f"no agent run {other}" in answer["message"]
    assert sdk(standin, stop) == WorkflowExecutionStatus.RUNNING


def test_without_temporal_the_routes_say_what_to_configure(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    for daemon in serving(tmp_path_factory.mktemp("gw") / "state", {}):
        status, answer = daemon.control("POST", "/v1/agent-runs", body("echo"))
        assert status == 404
        assert "set temporal_address (GATEWAYD_TEMPORAL_ADDRESS)" in answer["message"]
        assert "gatewayd agent submit --temporal ADDRESS" in answer["message"]


def test_an_unreachable_temporal_is_a_502_and_the_daemon_serves_on(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    address = f"127.0.0.1:{free_port()}"
    env = {"GATEWAYD_TEMPORAL_ADDRESS": address}
    for daemon in serving(tmp_path_factory.mktemp("gw") / "state", env):
        for _ in range(2):  # the second request tries to connect again
            status, answer = daemon.control("POST", "/v1/agent-runs", body("echo"))
            assert status == 502 and answer["errorCode"] == "tool_failed"
            assert f"cannot connect to Temporal at {address}" in answer["message"]
        assert daemon.control("GET", "/v1/health")[0] == 200


# --- a real run on a real worker: no credential in the whole history ----------------------

REAL_QUEUE = "clients-real"
REAL_ALIAS = "coder"
MODEL_KEY_ENV = "CLIENTS_TEST_MODEL_KEY"
REAL_RUN_TIMEOUT_S = 150


@pytest.fixture(scope="module")
def real_worker(
    temporal: TemporalServer,
) -> Iterator[tuple[TemporalServer, GitServer, FakeProvider, str, str, str]]:
    """`gatewayd worker` as a real process on this host, holding a git token (which the
    git server requires) and a model key (which the fake provider records): both values
    random, so finding either anywhere is finding this test's credential."""
    if _unavailable() is not None:
        pytest.skip(str(_unavailable()))
    token = "git-" + secrets.token_hex(20)
    key = "sk-model-" + secrets.token_hex(20)
    for base in agent_base():
        with GitServer(base / "served", token=token) as served, FakeProvider() as provider:
            provider.respond = model_reply
            sha = make_bare_repo(served.root, "calc.git", REPO_FILES)
            models = {
                REAL_ALIAS: {
                    "provider": "openai",
                    "model": "fake",
                    "api_base": provider.api_base,
                    "api_key_env": MODEL_KEY_ENV,
                }
            }
            config = base / "worker.yaml"
            config.write_text("{}\n")
            log = base / "worker.log"
            env = {
                **{k: v for k, v in os.environ.items() if not k.startswith("GATEWAYD_")},
                "GATEWAYD_MODELS": json.dumps(models),
                "GATEWAYD_CONFIG": str(config),
                "COGNI_GIT_TOKEN": token,
                MODEL_KEY_ENV: key,
            }
            uid_base = 1_650_000_000 + secrets.randbelow(40_000) * 1024
            argv = [
                str(BIN / "gatewayd"), "worker",
                "--temporal", temporal.address, "--namespace", temporal.namespace,
                "--task-queue", REAL_QUEUE, "--host-name", "host-real",
                "--state-dir", str(base / "state"),
                "--netns-prefix", f"cgc{secrets.token_hex(3)}-",
                "--sandbox-uids", f"{uid_base}+16",
            ]  # fmt: skip
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    argv,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            try:
                deadline = time.monotonic() + WORKER_START_TIMEOUT_S
                while "polling" not in log.read_text(errors="replace"):
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise AssertionError(f"worker did not start:\n{log.read_text()[-3000:]}")
                    time.sleep(0.2)
                yield temporal, served, provider, served.url_for("calc.git"), sha, f"{token}\0{key}"
            finally:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def spellings(secret: str) -> list[bytes]:
    """``secret`` as it could sit in a history: raw, in JSON, and base64-encoded at each
    of the three alignments it could start at inside a longer encoded payload."""
    raw = secret.encode()
    found = [raw, json.dumps(secret).encode()]
    for offset in range(3):
        encoded = base64.b64encode(b"\0" * offset + raw)
        # Only the characters that depend on the secret alone, not on its neighbours.
        start = (offset * 4 + 2) // 3 + (1 if offset else 0)
        found.append(encoded[start : start + 16])
    return found


def test_a_real_runs_whole_history_holds_neither_the_git_token_nor_the_model_key(
    real_worker: tuple[TemporalServer, GitServer, FakeProvider, str, str, str],
) -> None:
    server, served, provider, url, sha, held = real_worker
    token, key = held.split("\0")
    task = "make add() add, task marker " + secrets.token_hex(8)
    done = gatewayd(
        "agent", "submit", "--temporal", server.address, "--namespace", server.namespace,
        "--task-queue", REAL_QUEUE, "--repo", url, "--sha", sha, "--model", REAL_ALIAS,
        "--task", task, "--max-wall-s", "120",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    workflow_id = done.stdout.strip()
    done = gatewayd(
        "agent", "result", "--temporal", server.address, "--namespace", server.namespace,
        workflow_id, "--wait", "--timeout", str(REAL_RUN_TIMEOUT_S),
    )  # fmt: skip
    result = json.loads(done.stdout)
    assert done.returncode == 0 and result["ok"] is True, (result, done.stderr)
    assert result["pushed"] is True and result["host"] == "host-real"

    # The worker held both and used both: the git server saw the token, the model its key.
    assert any(request.auth_ok for request in served.requests)
    assert {r.authorization for r in provider.chat_requests} == {f"Bearer {key}"}

    async def everything(client: Client) -> tuple[bytes, str, bytes]:
        handle = client.get_workflow_handle(workflow_id)
        history = await handle.fetch_history()
        described = await handle.describe()
        events = b"".join(event.SerializeToString() for event in history.events)
        return events, history.to_json(), described.raw_description.SerializeToString()

    events, as_json, described = sdk(server, everything)
    # The search sees the payloads: the task the client sent is found, raw in the events
    # and base64-encoded (payload data) in the JSON form.
    assert task.encode() in events
    assert any(spelling.decode() in as_json for spelling in spellings(task)[2:])
    for secret in (token, key):
        for spelling in spellings(secret):
            assert spelling not in events, f"a credential ({spelling!r}) is in the history"
            assert spelling.decode() not in as_json
            assert spelling not in described
    # Nor did the result or the CLI's output carry them.
    for secret in (token, key):
        assert secret not in done.stdout + done.stderr
