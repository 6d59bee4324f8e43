"""What a client may submit as an agent run on Temporal (gatewayd/scaleout/submission.py):
everything submitted is kept in the workflow's history, so credentials in any field or
URL form are refused here, with a message that says where credentials live instead."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace
from typing import Any

import pydantic
import pytest
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from gatewayd.config import GatewaydConfig
from gatewayd.scaleout.client import outcome_json, result
from gatewayd.scaleout.spec import LIMIT_NAMES, WORKFLOW_NAME, AgentRunOutcome
from gatewayd.scaleout.submission import (
    MAX_TASK_BYTES,
    WORKFLOW_ID_RE,
    AgentRunsError,
    AgentSubmission,
    ErrorKind,
    SubmissionLimits,
    TemporalTarget,
    check_workflow_id,
    new_workflow_id,
    wall_time_limit,
)

SHA = "0123456789abcdef" * 2 + "01234567"


def submission(**changes: Any) -> dict[str, Any]:
    return {
        "grant": {"allowSandbox": True},
        "repo": "https://git.example.org/team/repo.git",
        "sha": SHA,
        "taskInput": "make add() add",
        "model": "coder",
        **changes,
    }


def refusal(**changes: Any) -> str:
    with pytest.raises(pydantic.ValidationError) as caught:
        AgentSubmission.model_validate(submission(**changes))
    return str(caught.value)


def test_a_submission_becomes_the_workflows_spec_with_no_run_id_and_the_stated_grant() -> None:
    spec = AgentSubmission.model_validate(
        submission(limits={"wallTimeSec": 60}, push=False, toolIds=["sandbox.exec"])
    ).spec()
    assert spec.run_id is None
    assert spec.grant == {"allowSandbox": True}
    assert spec.limits == {
        "maxTurns": 40,
        "maxTokens": 400_000,
        "wallTimeSec": 60,
        "maxMemoryMb": 2048,
    }
    assert (spec.push, spec.tool_ids, spec.backend, spec.policy) == (
        False,
        ["sandbox.exec"],
        "overlay",
        "agent",
    )
    denied = AgentSubmission.model_validate(submission(grant={"allowSandbox": False})).spec()
    assert denied.grant == {"allowSandbox": False}  # refused by the first activity


def test_the_limits_are_the_spec_limits_the_worker_knows() -> None:
    assert set(SubmissionLimits.model_fields) == LIMIT_NAMES


@pytest.mark.parametrize(
    "field",
    [
        "gitToken", "git_token", "GIT_TOKEN", "token", "apiKey", "api_key", "OPENAI_API_KEY",
        "modelKey_api_key", "password", "secret", "clientSecret", "credentials",
        "authorization", "Authorization", "privateKey",
    ],
)  # fmt: skip
def test_a_field_naming_a_credential_is_refused_by_name_saying_where_they_live(
    field: str,
) -> None:
    message = refusal(**{field: "x"})
    assert f"{field}: a submission carries no credential" in message
    assert "worker hosts' own" in message and "history" in message


def test_a_run_id_is_never_taken_from_a_submission() -> None:
    assert "runId: run ids are made by the worker" in refusal(runId="0" * 32)


@pytest.mark.parametrize(
    ("repo", "expected"),
    [
        ("https://x-access-token:ghp_abc@github.com/o/r.git", "user or password"),
        ("https://ghp_abc@github.com/o/r.git", "user or password"),
        ("https://:ghp_abc@github.com/o/r.git", "user or password"),
        ("http://user@127.0.0.1:8080/r.git", "user or password"),
        ("https://github.com/o/r.git?access_token=ghp_abc", "query or fragment"),
        ("https://github.com/o/r.git#ghp_abc", "query or fragment"),
        ("ssh://git@github.com/o/r.git", "scheme 'ssh' is not supported"),
        ("git@github.com:o/r.git", "is not supported"),
        ("ext::sh -c touch% /tmp/x", "is not supported"),
        ("--upload-pack=touch /tmp/x", "may not start with '-'"),
        ("https://github.com/o/r\n.git", "control character"),
        ("", "at least 1 character"),
    ],
)
def test_a_repository_url_that_could_carry_a_credential_or_an_option_is_refused(
    repo: str, expected: str
) -> None:
    assert expected in refusal(repo=repo)


@pytest.mark.parametrize(
    "repo",
    ["https://github.com/o/r.git", "http://127.0.0.1:9/r.git", "file:///srv/r.git", "/srv/r"],
)
def test_plain_repository_urls_and_worker_paths_are_taken(repo: str) -> None:
    assert AgentSubmission.model_validate(submission(repo=repo)).repo == repo


@pytest.mark.parametrize(
    ("branch", "expected"),
    [
        ("main", "never pushes to the default branch"),
        ("master", "never pushes to the default branch"),
        ("HEAD", "never pushes to the default branch"),
        ("refs/heads/feature", "or a full ref"),
        ("cogni/../main", "is not a branch name"),
        ("-delete", "is not a branch name"),
        ("a//b", "is not a branch name"),
        ("x@{1}", "is not a branch name"),
        ("feature.lock", "is not a branch name"),
        ("feature/", "is not a branch name"),
        ("new branch", "is not a branch name"),
    ],
)
def test_a_branch_is_a_plain_new_branch_never_the_default_one(branch: str, expected: str) -> None:
    assert expected in refusal(branch=branch)


def test_a_plain_branch_is_taken() -> None:
    assert AgentSubmission.model_validate(submission(branch="cogni/fix-1.2")).branch == (
        "cogni/fix-1.2"
    )


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"taskInput": "x" * (MAX_TASK_BYTES + 1)}, f"over {MAX_TASK_BYTES} bytes"),
        ({"taskInput": "é" * (MAX_TASK_BYTES // 2 + 1)}, f"over {MAX_TASK_BYTES} bytes"),
        ({"taskInput": " \n\t"}, "the task is empty"),
        ({"sha": SHA[:12]}, "sha"),
        ({"sha": SHA.upper()}, "sha"),
        ({"model": "../coder"}, "is not a model alias"),
        ({"policy": "/etc/gatewayd/policies/agent.yaml"}, "not a path"),
        ({"policy": "../agent"}, "not a path"),
        ({"actorId": "ops\x1b[31m"}, "control character"),
        ({"toolIds": ["sandbox.exec", "fs.read\r\nX: y"]}, "a tool id holds a control character"),
        ({"pullRequest": True}, "pull requests are not opened by the workers yet"),
        ({"limits": {"maxTurns": 0}}, "limits.maxTurns"),
        ({"limits": {"maxMemoryMb": 63}}, "limits.maxMemoryMb"),
        ({"limits": {"maxPatchBytes": 2 << 20}}, "limits.maxPatchBytes"),
        ({"limits": {"wallTimeSec": 8 * 24 * 3600}}, "limits.wallTimeSec"),
        ({"limits": {"turns": 3}}, "limits.turns"),
        ({"limits": {"maxTurns": True}}, "limits.maxTurns"),
        ({"grant": {"allowSandbox": "true"}}, "grant.allowSandbox"),
        ({"grant": {"allowSandbox": True, "admin": True}}, "grant.admin"),
        ({"backend": "agentfs"}, "backend"),
        ({"toolIds": ["x"] * 257}, "toolIds"),
        ({"unknown": 1}, "unknown"),
    ],
)
def test_a_submission_out_of_bounds_names_the_field(changes: dict[str, Any], expected: str) -> None:
    assert expected in refusal(**changes)


def test_the_grant_must_be_stated() -> None:
    body = submission()
    del body["grant"]
    with pytest.raises(pydantic.ValidationError, match="grant"):
        AgentSubmission.model_validate(body)


def test_workflow_ids_are_random_of_one_shape_and_others_refused_with_the_shape() -> None:
    made = {new_workflow_id() for _ in range(100)}
    assert len(made) == 100 and all(WORKFLOW_ID_RE.fullmatch(i) for i in made)
    for bad in ("agent-run-" + "0" * 31, "agent-run-" + "G" * 32, "x" * 5000, "agent-run-../x"):
        with pytest.raises(AgentRunsError) as caught:
            check_workflow_id(bad)
        assert caught.value.kind is ErrorKind.BAD_REQUEST
        assert "agent-run- and 32 lowercase hex digits" in caught.value.message
        assert len(caught.value.message) < 300  # a long id is not echoed whole


@pytest.mark.parametrize(("given", "limit"), [(0.1, 1), (1.0, 1), (12.5, 13), (1800.0, 1800)])
def test_the_wall_time_is_never_rounded_down(given: float, limit: int) -> None:
    assert wall_time_limit(given) == limit


def test_an_outcome_is_shown_with_the_run_results_camel_case_names() -> None:
    outcome = AgentRunOutcome(ok=True, error_code=None, run_id="r", audit_head="h", audit_seq=3)
    shown = outcome_json(outcome)
    assert shown["errorCode"] is None and shown["auditHead"] == "h" and shown["auditSeq"] == 3
    assert set(shown) == {
        "".join(w if i == 0 else w.title() for i, w in enumerate(f.name.split("_")))
        for f in dataclasses.fields(AgentRunOutcome)
    }


@pytest.mark.parametrize(
    "address", ["127.0.0.1:7233", "temporal.internal:7233", "[::1]:7233", "t-1.example.org:443"]
)
def test_the_temporal_address_is_host_and_port(address: str) -> None:
    assert GatewaydConfig(temporal_address=address).temporal_address == address


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("temporal_address", "http://temporal:7233"),
        ("temporal_address", "temporal"),
        ("temporal_address", "temporal:port"),
        ("temporal_address", "user@temporal:7233"),
        ("temporal_namespace", "-agents"),
        ("temporal_namespace", "a b"),
        ("temporal_task_queue", ""),
        ("temporal_task_queue", "q\n"),
    ],
)
def test_a_temporal_setting_out_of_shape_is_refused_by_name(setting: str, value: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=setting):
        GatewaydConfig(**{setting: value})


class _FailedRunHandle:
    """A workflow handle whose run failed, and whose second look-up finds Temporal gone."""

    def __init__(self) -> None:
        self.looked_up = 0

    async def describe(self, **_: Any) -> Any:
        self.looked_up += 1
        if self.looked_up > 1:
            raise RPCError("connection refused", RPCStatusCode.UNAVAILABLE, b"")
        return SimpleNamespace(status=WorkflowExecutionStatus.FAILED, workflow_type=WORKFLOW_NAME)

    async def result(self, **_: Any) -> Any:
        raise WorkflowFailureError(cause=ApplicationError("the run failed"))


def test_temporal_failing_while_a_failed_runs_result_is_read_is_reported_not_raised() -> None:
    handle = _FailedRunHandle()
    client = SimpleNamespace(get_workflow_handle=lambda *_, **__: handle)
    target = TemporalTarget(address="127.0.0.1:7233", namespace="default", task_queue="q")
    workflow_id = new_workflow_id()
    with pytest.raises(AgentRunsError) as caught:
        asyncio.run(result(client, target, workflow_id))  # type: ignore[arg-type]
    assert caught.value.kind is ErrorKind.UNREACHABLE
    assert f"look up agent run {workflow_id}: Temporal at 127.0.0.1:7233" in caught.value.message
    assert "connection refused" in caught.value.message
