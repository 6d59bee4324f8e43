"""The scale-out worker's parts that need no Temporal server: the spec's checks, the
outcome made of an agent result (the audit anchor, the bundle's size limit), progress
read from the run's lines, the default number of runs, the spec's JSON through
temporalio's converter, and `gatewayd worker`'s usage errors."""

from __future__ import annotations

import dataclasses
import json
import os
from types import SimpleNamespace

import pytest
import trio
from temporalio.converter import DataConverter

from gatewayd.agent.repo import RepoCredentials
from gatewayd.agent.task import AgentResult
from gatewayd.cli import main
from gatewayd.sandbox.support import SandboxSupport
from gatewayd.sandbox.uids import UidPool, UidRange
from gatewayd.scaleout.activities import (
    MAX_AUDIT_BUNDLE_BYTES,
    MAX_LOG_LINES,
    _task,
    _Tracker,
    outcome_of,
    spec_problems,
)
from gatewayd.scaleout.spec import LIMIT_WALL_TIME_SEC, AgentRunOutcome, AgentRunSpec
from gatewayd.scaleout.worker import RUN_MEMORY_BYTES, _probe, default_max_runs

MODELS = {"coder": object()}


def spec(**changes: object) -> AgentRunSpec:
    base = AgentRunSpec(
        repo="https://git.example/calc.git",
        sha="a" * 40,
        task_input="fix add",
        actor_id="ci",
        tenant_id="t1",
        model="coder",
        grant={"allowSandbox": True},
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_a_good_spec_has_no_problem() -> None:
    assert spec_problems(spec(), MODELS) == []
    assert spec_problems(spec(branch="cogni/fix-1", limits={"maxTurns": 3}), MODELS) == []


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"sha": "main"}, "full lowercase hex commit id"),
        ({"sha": "A" * 40}, "full lowercase hex commit id"),
        ({"repo": "https://user:pw@git.example/x.git"}, "carries credentials"),
        ({"repo": "ssh://git.example/x.git"}, "scheme 'ssh' is not supported"),
        ({"repo": "--upload-pack=evil"}, "starts with '-'"),
        ({"task_input": "  \n"}, "task_input is empty"),
        ({"model": "gpt-9"}, "model alias 'gpt-9' is not configured on this host (coder)"),
        ({"limits": {"maxTurns": 3, "cpu": 2}}, "unknown limits ['cpu']"),
        ({"limits": {"maxTurns": -1}}, "whole numbers, 1 or more"),
        # Each of these passed the grant's check, then failed the run (or, for the
        # huge wall time, every task of the workflow: a stuck workflow).
        ({"limits": {"maxTurns": 0}}, "whole numbers, 1 or more"),
        ({"limits": {"wallTimeSec": 0}}, "whole numbers, 1 or more"),
        ({"limits": {"maxTokens": True}}, "whole numbers, 1 or more"),
        ({"limits": {"wallTimeSec": 10**12}}, "wallTimeSec 1000000000000 is over 604800"),
        ({"backend": "docker"}, "backend 'docker' is not overlay or host"),
        ({"branch": "main"}, "push only to new branches named cogni/<name>"),
        ({"branch": "cogni/../main"}, "no '..'"),
        ({"branch": "cogni/x.lock"}, "not ending in '.' or '.lock'"),
        ({"pull_request": True}, "pull requests are not opened by workers"),
    ],
)
def test_each_problem_of_a_spec_is_named_with_its_fix(
    changes: dict[str, object], says: str
) -> None:
    problems = spec_problems(spec(**changes), MODELS)
    assert len(problems) == 1 and says in problems[0], problems


def test_the_spec_and_outcome_round_trip_through_temporals_converter() -> None:
    converter = DataConverter.default.payload_converter
    original = spec(limits={LIMIT_WALL_TIME_SEC: 60}, branch="cogni/x", push=True)
    [payload] = converter.to_payloads([original])
    assert json.loads(payload.data)["task_input"] == "fix add"
    assert converter.from_payloads([payload], [AgentRunSpec]) == [original]
    outcome = AgentRunOutcome(ok=True, run_id="r", bundle={"patches": ["p"]})
    [payload] = converter.to_payloads([outcome])
    assert converter.from_payloads([payload], [AgentRunOutcome]) == [outcome]


def test_the_spec_holds_no_credential_field() -> None:
    names = {f.name for f in dataclasses.fields(AgentRunSpec)}
    assert not {n for n in names if any(w in n for w in ("token", "key", "secret", "password"))}


def test_the_outcome_anchors_the_run_in_the_hosts_audit_chain() -> None:
    entries = [
        {"seq": 5, "hash": "1" * 64, "runId": "r"},
        {"seq": 9, "hash": "2" * 64, "runId": "r"},
    ]
    result = AgentResult(
        ok=True, run_id="r", patches=["P"], commit_messages=["m\n"], audit_log=entries
    )
    outcome = outcome_of(result, "host-a", 2)
    assert (outcome.audit_head, outcome.audit_seq) == ("2" * 64, 9)
    assert outcome.host == "host-a" and outcome.attempt == 2
    assert outcome.bundle == {"patches": ["P"], "commitMessages": ["m\n"]}
    assert outcome.audit_bundle == {"entries": entries, "count": 2, "truncated": False}


def test_a_large_audit_bundle_is_left_out_but_the_anchor_stays() -> None:
    """Temporal's history limits payloads: past MAX_AUDIT_BUNDLE_BYTES the entries stay
    on the host, and the outcome still says which entry ends the run there."""
    big = [{"seq": i, "hash": f"{i:064x}", "detail": "x" * 1000} for i in range(600)]
    assert len(json.dumps(big)) > MAX_AUDIT_BUNDLE_BYTES
    outcome = outcome_of(AgentResult(ok=False, run_id="r", audit_log=big), "h", 1)
    assert outcome.audit_bundle == {"entries": [], "count": 600, "truncated": True}
    assert outcome.audit_seq == 599 and outcome.audit_head == f"{599:064x}"


def test_the_outcome_keeps_the_last_log_lines() -> None:
    lines = [f"line {i}" for i in range(MAX_LOG_LINES + 50)]
    outcome = outcome_of(AgentResult(ok=True, logs=lines), "h", 1)
    assert outcome.logs == lines[-MAX_LOG_LINES:]


def test_a_run_without_entries_has_no_anchor() -> None:
    outcome = outcome_of(AgentResult(ok=False, error_code="internal"), "h", 1)
    assert (outcome.audit_head, outcome.audit_seq, outcome.run_id) == ("", 0, "")


def test_progress_follows_the_runs_lines() -> None:
    tracker = _Tracker(host="h")
    tracker.say("run 0123abcd started (overlay workspace, policy agent)")
    tracker.say('turn 1: edit {"path": "calc.py"} -> allow')
    tracker.say("turn 2: exec {...} -> allow")
    progress = tracker.progress()
    assert (progress.turn, progress.tool, progress.run_id) == (2, "exec", "0123abcd")
    tracker.say("turn 3: the model finished (40 tokens)")
    assert tracker.progress().turn == 3
    tracker.say("x" * 1000)
    assert len(tracker.progress().line) == 200  # bounded in every heartbeat


@pytest.mark.parametrize(
    ("cpus", "memory", "runs"),
    [
        (8, 64 * RUN_MEMORY_BYTES, 8),  # cores bound it
        (8, 3 * RUN_MEMORY_BYTES, 3),  # memory bounds it
        (2, RUN_MEMORY_BYTES // 2, 1),  # never below one
    ],
)
def test_the_default_number_of_runs_follows_the_hosts_size(
    cpus: int, memory: int, runs: int
) -> None:
    assert default_max_runs(cpus, memory) == runs


def test_the_host_size_is_read_when_not_given() -> None:
    assert default_max_runs() >= 1


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--max-runs", "0"], "--max-runs must be 1 or more"),
        (["--max-runs", "-3"], "--max-runs must be 1 or more"),
        (["--task-queue", " "], "--temporal, --namespace and --task-queue must not be empty"),
        (["--namespace", ""], "--temporal, --namespace and --task-queue must not be empty"),
        (["--probe-interval", "0"], "--probe-interval must be above 0 and at most 86400"),
        (["--probe-interval", "nan"], "--probe-interval must be above 0 and at most 86400"),
        (["--shutdown-grace", "-1"], "--shutdown-grace must be above 0 and at most 86400"),
        (["--shutdown-grace", "inf"], "--shutdown-grace must be above 0 and at most 86400"),
    ],
)
def test_worker_usage_errors_exit_2_with_the_reason(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["worker", "--temporal", "127.0.0.1:7233", *argv]) == 2
    assert says in capsys.readouterr().err


def test_worker_needs_a_temporal_address(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GATEWAYD_TEMPORAL_ADDRESS", raising=False)
    assert main(["worker"]) == 2
    err = capsys.readouterr().err
    assert "no Temporal address: pass --temporal HOST:PORT" in err
    assert "GATEWAYD_TEMPORAL_ADDRESS" in err


def test_the_reprobe_with_every_sandbox_uid_lent_says_so_instead_of_failing() -> None:
    """Every uid lent to runs: the re-probe fails (polling pauses) with the reason,
    rather than raising in the worker's nursery (which stopped gatewayd's side while the
    Temporal thread went on polling)."""
    pool = UidPool(UidRange(base=1_690_000_000, count=1))
    pool.acquire()  # the one uid, lent to a run
    daemon = SimpleNamespace(
        config=SimpleNamespace(os_sandbox=True),
        runs=SimpleNamespace(sandbox_settings=object(), uid_pool=pool),
    )
    support = trio.run(_probe, daemon)
    assert not support.available
    assert support.reason.startswith("the probe found no free sandbox uid: all 1 sandbox uids")


def test_the_reprobe_never_passes_when_the_start_up_probe_failed() -> None:
    daemon = SimpleNamespace(
        config=SimpleNamespace(os_sandbox=True),
        runs=SimpleNamespace(
            sandbox_settings=None, support=SandboxSupport(False, "bubblewrap is not installed")
        ),
    )
    support = trio.run(_probe, daemon)
    assert not support.available
    assert support.reason == (
        "bubblewrap is not installed (found when this worker started; restart it once the "
        "host is fixed)"
    )


def test_the_specs_tool_ids_reach_the_hosts_task_and_none_means_every_tool() -> None:
    narrowed = _task(spec(tool_ids=["fs.read", "sandbox.exec"]), RepoCredentials())
    assert narrowed.tool_ids == ("fs.read", "sandbox.exec")
    assert _task(spec(), RepoCredentials()).tool_ids == ()


def test_a_client_command_whose_reader_is_gone_exits_1_without_a_traceback() -> None:
    import subprocess
    import sys

    script = (
        "from gatewayd.cli.agent_scaleout import _exit_now\n"
        "print('agent-run-' + 'a' * 32)\n"
        "_exit_now(0)\n"
    )
    reader, writer = os.pipe()
    os.close(reader)  # `| head -0`: nobody reads what the command prints
    try:
        proc = subprocess.run(
            [sys.executable, "-c", script],
            stdout=writer,
            stderr=subprocess.PIPE,
            timeout=60,
            # buffered, as a shell gives it: the id is written at the exit's flush
            env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},
        )
    finally:
        os.close(writer)
    assert proc.returncode == 1
    assert b"Traceback" not in proc.stderr, proc.stderr
