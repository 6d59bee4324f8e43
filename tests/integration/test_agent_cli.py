"""``gatewayd agent run`` as the operator runs it: a separate process, its own daemon,
progress on stderr, the result JSON on stdout, a pull request on a local fake forge.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakeprovider import Call, FakeProvider, Text
from tests.gitserver import DEFAULT_TOKEN, GitServer, make_bare_repo, ref_sha
from tests.integration.test_agent_repo import FakeForge
from tests.integration.test_agent_run import REPO_FILES, agent_base
from tests.integration.test_run_sandbox import _unavailable

pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))

PR_URL = "https://forge.invalid/o/calc/pull/3"


@pytest.fixture
def base() -> Iterator[Path]:
    yield from agent_base()


@pytest.fixture
def provider() -> Iterator[FakeProvider]:
    with FakeProvider() as fake:
        yield fake


@pytest.fixture
def server(base: Path) -> Iterator[GitServer]:
    with GitServer(base / "served", token=DEFAULT_TOKEN) as served:
        yield served


@pytest.fixture
def forge() -> Iterator[FakeForge]:
    fake = FakeForge(201, json.dumps({"html_url": PR_URL}).encode())
    yield fake
    fake.close()


def agent_cli(
    base: Path, provider: FakeProvider, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    models = {"coder": {"provider": "openai", "model": "fake", "api_base": provider.api_base}}
    uid_base = 1_600_000_000 + secrets.randbelow(50_000) * 1024
    config = base / "gatewayd.yaml"
    config.write_text("{}\n")  # no host configuration file leaks in
    environ = {
        **{k: v for k, v in os.environ.items() if not k.startswith("GATEWAYD_")},
        "GATEWAYD_MODELS": json.dumps(models),
        "GATEWAYD_CONFIG": str(config),
        **(env or {}),
    }
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "gatewayd.cli",
            "agent",
            "run",
            "--state-dir",
            str(base / "state"),
            "--netns-prefix",
            f"cga{secrets.token_hex(3)}-",
            "--sandbox-uids",
            f"{uid_base}+16",
            *args,
        ],
        env=environ,
        capture_output=True,
        text=True,
        timeout=180,
    )


def fix_add_with_a_pull_request(
    base: Path, provider: FakeProvider, server: GitServer, sha: str, forge: FakeForge
) -> subprocess.CompletedProcess[str]:
    """`gatewayd agent run` on calc.git at ``sha``, pushing and opening a pull request."""
    return agent_cli(
        base,
        provider,
        *("--repo", server.url_for("calc.git"), "--sha", sha, "--task", "fix add"),
        *("--model", "coder", "--pull-request", "--forge-api", forge.url),
        *("--forge-repo", "o/calc"),
        env={"COGNI_GIT_TOKEN": DEFAULT_TOKEN},
    )


def test_agent_run_pushes_a_branch_and_opens_a_pull_request(
    base: Path,
    provider: FakeProvider,
    server: GitServer,
    forge: FakeForge,
) -> None:
    sha = make_bare_repo(server.root, "calc.git", REPO_FILES)
    provider.script(
        Text(
            content=None,
            calls=(
                Call(name="edit", arguments={"path": "calc.py", "old": "a - b", "new": "a + b"}),
            ),
        ),
        Text(
            content=None, calls=(Call(name="exec", arguments={"command": "python3 test_calc.py"}),)
        ),
        Text(content="Fix add()\n\nThe tests pass."),
    )
    done = fix_add_with_a_pull_request(base, provider, server, sha, forge)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    assert result["ok"] and result["errorCode"] is None
    assert result["pullRequest"] == PR_URL
    branch = result["branch"]
    assert branch == f"cogni/{result['runId']}"
    assert ref_sha(server.root / "calc.git", f"refs/heads/{branch}") == result["headSha"]
    assert ref_sha(server.root / "calc.git", "refs/heads/main") == sha
    # The pull request: from the run's branch into main, titled by the commit message.
    [(path, headers, body)] = forge.seen
    assert path == "/repos/o/calc/pulls"
    assert headers["Authorization"] == f"Bearer {DEFAULT_TOKEN}"
    assert json.loads(body) == {
        "title": "Fix add()",
        "body": "Fix add()\n\nThe tests pass.\n",
        "head": branch,
        "base": "main",
    }
    # Progress lines on stderr: the turn, the tool, the verdict.
    assert 'gatewayd agent: turn 2: exec "python3 test_calc.py" -> allowed (exit 0)' in done.stderr
    assert f"gatewayd agent: pull request {PR_URL}" in done.stderr
    events = [e.get("event") for e in result["auditLog"]]
    assert "agent_pull_request" in events and events[-1] == "agent_run_ended"
    assert DEFAULT_TOKEN not in done.stdout + done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sha", "HEAD"], "--sha must be a full lowercase hex commit id, not 'HEAD'"),
        (
            ["--sha", "a" * 40, "--pull-request"],
            "--pull-request needs --forge-api and --forge-repo",
        ),
        (["--sha", "a" * 40, "--max-turns", "0"], "agent limits must be positive"),
        (["--sha", "a" * 40, "--max-patch-bytes", "0"], "--max-patch-bytes must be positive"),
    ],
)
def test_usage_errors_exit_2_with_the_reason(
    base: Path, provider: FakeProvider, args: list[str], message: str
) -> None:
    done = agent_cli(
        base, provider, "--repo", "/nowhere.git", "--task", "t", "--model", "coder", *args
    )
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert done.stdout == ""


def test_an_unknown_model_alias_fails_with_the_aliases_named(
    base: Path, provider: FakeProvider, server: GitServer
) -> None:
    sha = make_bare_repo(server.root, "calc.git", REPO_FILES)
    done = agent_cli(
        base,
        provider,
        "--repo",
        server.url_for("calc.git"),
        "--sha",
        sha,
        "--task",
        "t",
        "--model",
        "nope",
    )
    assert done.returncode == 1
    result = json.loads(done.stdout)
    assert result["errorCode"] == "internal"
    assert result["message"] == (
        "model alias 'nope' is not in gatewayd's configuration (aliases: coder)"
    )
    assert provider.requests == [] and server.requests == []


def test_a_refused_token_fails_the_clone_with_an_audited_refusal(
    base: Path, provider: FakeProvider, server: GitServer
) -> None:
    sha = make_bare_repo(server.root, "calc.git", REPO_FILES)
    done = agent_cli(
        base,
        provider,
        "--repo",
        server.url_for("calc.git"),
        "--sha",
        sha,
        "--task",
        "t",
        "--model",
        "coder",
        env={"COGNI_GIT_TOKEN": "wrong-token-" + secrets.token_hex(4)},
    )
    assert done.returncode == 1, done.stderr
    result = json.loads(done.stdout)
    assert result["errorCode"] == "internal" and result["runId"] is None
    assert result["message"].startswith("the repository could not be cloned:")
    assert "gatewayd agent: the repository could not be cloned" in done.stderr
    audit = (base / "state" / "audit" / "audit.jsonl").read_text()
    refused = [json.loads(line) for line in audit.splitlines() if "agent_run_refused" in line]
    assert refused and refused[0]["detail"]["sha"] == sha
    assert provider.requests == []


def test_a_pull_request_the_forge_answers_badly_exits_1_after_the_push_audited(
    base: Path, provider: FakeProvider, server: GitServer, forge: FakeForge
) -> None:
    """A forge answering its 201 with JSON nested past any parser's limit: the operator
    sees the branch pushed and the pull request failed, with exit status 1."""
    forge.answer = b"[" * 200_000
    sha = make_bare_repo(server.root, "calc.git", REPO_FILES)
    provider.script(
        Text(
            content=None,
            calls=(
                Call(name="edit", arguments={"path": "calc.py", "old": "a - b", "new": "a + b"}),
            ),
        ),
        Text(content="Fix add()"),
    )
    done = fix_add_with_a_pull_request(base, provider, server, sha, forge)
    assert done.returncode == 1, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    assert (result["ok"], result["errorCode"]) == (False, "internal")
    assert result["message"].startswith(
        "the branch was pushed, but the pull request failed: the forge's answer to opening a "
        "pull request on o/calc at "
    )
    assert "is not a pull request: it is not JSON gatewayd accepts" in result["message"]
    assert ref_sha(server.root / "calc.git", f"refs/heads/{result['branch']}") == result["headSha"]
    assert "gatewayd agent: the branch was pushed, but the pull request failed" in done.stderr
    [failed] = [e for e in result["auditLog"] if e.get("event") == "agent_pull_request"]
    assert failed["errorCode"] == "internal" and failed["safeMessage"] == result["message"]
    assert result["auditLog"][-1]["event"] == "agent_run_ended"
    assert DEFAULT_TOKEN not in done.stdout + done.stderr
