"""The end-to-end gate of reference note 004: a host-owned agent run
against a real bare repository served over authenticated smart HTTP on loopback, a
scripted model on the loopback fake provider (through litellm), real sandboxes.

clone at a commit -> the model edits a file -> runs the repository's own tests inside the
sandbox -> the host commits and pushes ``cogni/<run-id>``. Then: the branch holds the
expected diff, the default branch is untouched, the audit log holds every step and
verifies, and the git token never appeared in the sandbox's environment or files.
Plus a run that hits each limit (turns, tokens, wall time) and ends with the right error
code and a usable partial result.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from gatewayd.agent.conversation import MAX_CALLS_PER_TURN
from gatewayd.agent.loop import run_agent
from gatewayd.agent.repo import RepoCredentials
from gatewayd.agent.task import AgentLimits, AgentResult, AgentTask, PullRequestSpec
from gatewayd.audit.verify import verify_file
from gatewayd.config import GatewaydConfig, ModelAlias
from gatewayd.daemon import Daemon, open_daemon
from tests.fakeprovider import Call, FakeProvider, Malformed, Text
from tests.gitserver import DEFAULT_TOKEN, GitServer, git, make_bare_repo, read_tree, ref_sha
from tests.integration.test_agent_repo import FakeForge
from tests.integration.test_model_client import DEEP
from tests.integration.test_run_sandbox import _unavailable, sandbox_config

pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))

TOKEN_ENV = "COGNI_TEST_GIT_TOKEN"
MODEL_KEY_ENV = "COGNI_TEST_AGENT_MODEL_KEY"
MODEL_KEY = "sk-agent-model-" + secrets.token_hex(12)
ALIAS = "agent-model"

CALC = b"def add(a, b):\n    return a - b\n"
TESTS = (
    b"import unittest\n\nfrom calc import add\n\n\n"
    b"class T(unittest.TestCase):\n"
    b"    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n\n\n"
    b"if __name__ == '__main__':\n    unittest.main()\n"
)
REPO_FILES: Mapping[str, bytes] = {
    "calc.py": CALC,
    "test_calc.py": TESTS,
    "README.md": b"# calc\n",
    # What the tests leave behind (__pycache__) stays out of the commit, as in a clone.
    ".gitignore": b"__pycache__/\n",
}
# The probe looks for the token (given reversed on stdin: neither the command in the
# audit log nor its output holds it) in every file outside /usr, /proc and /sys and in
# every visible process's environment; it writes a canary first, to prove it looks.
PROBE = (
    'read r; k=$(printf %s "$r" | rev); printf %s "$k" > /tmp/canary; '
    'grep -rlsF "$k" / --exclude-dir=usr --exclude-dir=proc --exclude-dir=sys; '
    'echo "env:$(cat /proc/*/environ 2>/dev/null | grep -caF "$k")"'
)


def agent_base() -> Iterator[Path]:
    """A short directory under /tmp the sandbox's uid may pass through."""
    path = Path(tempfile.mkdtemp(prefix="cg-ag-", dir="/tmp"))
    path.chmod(0o711)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


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


def agent_config(base: Path, provider: FakeProvider, **changes: Any) -> GatewaydConfig:
    config = sandbox_config(base)
    policies = Path(__file__).resolve().parents[2] / "policies"
    alias = ModelAlias(
        provider="openai",
        model="fake-model",
        api_base=provider.api_base,
        api_key_env=MODEL_KEY_ENV,
    )
    return GatewaydConfig(
        state_dir=config.state_dir,
        policy_dirs=(policies,),
        netns_prefix=config.netns_prefix,
        sandbox_uids=config.sandbox_uids,
        models={ALIAS: alias},
        secret_env=(TOKEN_ENV,),
        **changes,
    )


@pytest.fixture
async def daemon(base: Path, provider: FakeProvider) -> AsyncIterator[Daemon]:
    os.environ[TOKEN_ENV] = DEFAULT_TOKEN
    os.environ[MODEL_KEY_ENV] = MODEL_KEY
    try:
        async with open_daemon(agent_config(base, provider), preload=True) as d:
            yield d
    finally:
        os.environ.pop(TOKEN_ENV, None)
        os.environ.pop(MODEL_KEY_ENV, None)


def task(url: str, sha: str, **changes: Any) -> AgentTask:
    fields: dict[str, Any] = {
        "repo_url": url,
        "sha": sha,
        "task": "make add() add; the tests must pass",
        "model": ALIAS,
        "policy": "agent",
        "credentials": RepoCredentials(token=DEFAULT_TOKEN),
        "limits": AgentLimits(max_turns=10, max_tokens=10_000, max_wall_s=120),
    }
    fields.update(changes)
    return AgentTask(**fields)


def fixing_script(probe_stdin: bool = True) -> list[Text]:
    """The scripted model: look, read, fix, run the tests, probe, finish."""
    return [
        Text(content=None, calls=(Call(name="list", arguments={"path": "."}),)),
        Text(content=None, calls=(Call(name="read", arguments={"path": "calc.py"}),)),
        Text(
            content="fixing the operator",
            calls=(
                Call(
                    name="edit",
                    arguments={"path": "calc.py", "old": "a - b", "new": "a + b"},
                ),
            ),
        ),
        Text(
            content=None,
            calls=(
                Call(name="exec", arguments={"command": "python3 -m unittest -v 2>&1"}),
                Call(
                    name="exec",
                    arguments={"command": PROBE, "stdin": DEFAULT_TOKEN[::-1] + "\n"},
                ),
                Call(name="exec", arguments={"command": PROBE, "stdin": MODEL_KEY[::-1] + "\n"}),
            ),
        ),
        Text(content="Fix add() to add\n\nIt subtracted; test_calc passes now."),
    ]


def tool_results(provider: FakeProvider) -> list[dict[str, Any]]:
    """What the model was told for each tool call, in order (from the last request)."""
    last = provider.chat_requests[-1].body["messages"]
    return [json.loads(m["content"]) for m in last if m["role"] == "tool"]


def by_event(entries: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in entries if e.get("event") == name]


# --- the gate -------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["overlay", "host"])
async def test_clone_edit_test_push_end_to_end(
    backend: str, daemon: Daemon, server: GitServer, provider: FakeProvider
) -> None:
    sha = make_bare_repo(server.root, "calc.git", REPO_FILES)
    bare = server.root / "calc.git"
    provider.script(*fixing_script())
    progress: list[str] = []

    result = await run_agent(
        daemon.runs,
        daemon.dispatcher,
        task(server.url_for("calc.git"), sha, backend=backend),
        progress.append,
    )

    assert result.ok, result.to_json()
    assert result.error_code is None
    # The repository's own tests ran inside the sandbox, and passed after the fix.
    results = tool_results(provider)
    assert "calc.py" in json.dumps(results[0])
    assert "return a - b" in results[1]["content"]
    assert results[3]["exitCode"] == 0 and "OK" in results[3]["stdout"], results[3]
    # The probes: only their own canary, and no process environment holds the git token
    # or the model key.
    assert results[4]["stdout"].split() == ["/tmp/canary", "env:0"], results[4]
    assert results[5]["stdout"].split() == ["/tmp/canary", "env:0"], results[5]
    # The branch holds exactly the fix; main is untouched.
    branch = f"cogni/{result.run_id}"
    assert result.branch == branch
    assert ref_sha(bare, f"refs/heads/{branch}") == result.head_sha
    assert ref_sha(bare, "refs/heads/main") == sha
    pushed = read_tree(bare, branch)
    assert pushed["calc.py"][1] == b"def add(a, b):\n    return a + b\n"
    assert {k: v[1] for k, v in pushed.items() if k != "calc.py"} == {
        k: v for k, v in REPO_FILES.items() if k != "calc.py"
    }
    log = git("--git-dir", str(bare), "log", "--format=%s%n%b%x00", f"{sha}..{branch}").decode()
    assert log.split("\0")[0].startswith("Fix add() to add\n")
    diff = git("--git-dir", str(bare), "diff", sha, branch).decode()
    assert "-    return a - b\n+    return a + b" in diff
    # The bundle: one patch, one message; the patch applies to the base with git am.
    assert len(result.patches) == 1 and result.commit_messages[0].startswith("Fix add()")
    assert "Subject: [PATCH] Fix add() to add" in result.patches[0]
    # Progress said turn, tool and verdict.
    assert any('exec "python3 -m unittest -v 2>&1" -> allowed (exit 0)' in p for p in progress)
    # The audit log holds every step, and verifies.
    entries = result.audit_log
    assert [e["event"] for e in entries if e.get("event", "").startswith("agent_")] == [
        "agent_run_started",
        *["agent_turn"] * 5,
        "agent_patch",
        "agent_push",
        "agent_run_ended",
    ]
    calls = [e for e in entries if e["kind"] == "call"]
    assert [c["tool"] for c in calls] == [
        "fs.list",
        "fs.read",
        "fs.edit",
        "sandbox.exec",
        "sandbox.exec",
        "sandbox.exec",
    ]
    assert all(c["decision"] == "allow" and c["peer"]["pid"] == os.getpid() for c in calls)
    assert len([e for e in entries if e["kind"] == "result"]) == 6
    await daemon.audit.durable(daemon.audit.last_seq)
    report = verify_file(daemon.config.resolved_audit_path)
    assert report.ok, report
    # The token and the key: nowhere in the audit log, the result or the logs, and the
    # key went to the provider (the host used it).
    everything = daemon.config.resolved_audit_path.read_text() + json.dumps(result.to_json())
    assert DEFAULT_TOKEN not in everything and MODEL_KEY not in everything
    assert provider.chat_requests[0].authorization == f"Bearer {MODEL_KEY}"
    # Every request to the git server carried the token (the host's), and the work
    # directory is gone.
    assert server.requests and all(r.auth_ok for r in server.requests)
    assert list(daemon.config.resolved_agent_dir.iterdir()) == []


async def test_what_the_sandbox_writes_into_git_never_runs_on_the_host(
    daemon: Daemon, server: GitServer, provider: FakeProvider, base: Path
) -> None:
    """The model (through exec, inside the sandbox) plants hooks, config tricks and
    attribute filters in the checkout; the host's patch and push run none of them."""
    sha = make_bare_repo(server.root, "calc.git", REPO_FILES)
    marker = base / "ran"
    marker.mkdir()
    marker.chmod(0o777)  # a hook running as anyone could leave its mark
    hook = f"#!/bin/sh\ntouch {marker}/$(basename $0)-$$\n"
    plant = (
        "set -e; mkdir -p .git/hooks; for h in pre-commit post-commit commit-msg applypatch-msg pre-applypatch "
        "post-applypatch pre-push post-checkout reference-transaction post-rewrite; do "
        f"printf '%s' '{hook}' > .git/hooks/$h; chmod +x .git/hooks/$h; done; "
        "mkdir -p /workspace/evil; cp .git/hooks/pre-commit evil/fsmonitor; "
        "git config core.hooksPath /workspace/.git/hooks; "
        "git config core.fsmonitor /workspace/evil/fsmonitor; "
        "git config filter.evil.clean /workspace/evil/fsmonitor; "
        "git config filter.evil.smudge /workspace/evil/fsmonitor; "
        "git config filter.evil.required true; "
        "git config diff.evil.textconv /workspace/evil/fsmonitor; "
        "printf '* filter=evil diff=evil\\n' > .gitattributes; echo planted"
    )
    provider.script(
        Text(content=None, calls=(Call(name="exec", arguments={"command": plant}),)),
        Text(
            content=None,
            calls=(
                Call(name="edit", arguments={"path": "calc.py", "old": "a - b", "new": "a + b"}),
            ),
        ),
        Text(content="Fix add()"),
    )
    result = await run_agent(daemon.runs, daemon.dispatcher, task(server.url_for("calc.git"), sha))
    assert tool_results(provider)[0]["stdout"].strip() == "planted", json.dumps(
        tool_results(provider)[0]
    )
    assert result.ok, result.to_json()
    assert list(marker.iterdir()) == [], "a hook or filter written in the sandbox ran on the host"
    pushed = read_tree(server.root / "calc.git", f"cogni/{result.run_id}")
    # The attributes file is content like any other; nothing under .git travels.
    assert pushed[".gitattributes"][1] == b"* filter=evil diff=evil\n"
    assert pushed["calc.py"][1] == b"def add(a, b):\n    return a + b\n"
    assert not any(".git/" in path for path in pushed)
    assert "evil/fsmonitor" in pushed  # a plain file of the change, never run
    # git's own metadata is left out before the patch, and said so once.
    assert not any(s.startswith(".git") for s in result.skipped), result.skipped
    assert any("under .git or apps/ left out" in line for line in result.logs), result.logs


async def test_a_refused_call_is_told_to_the_model_and_audited(
    daemon: Daemon, server: GitServer, provider: FakeProvider
) -> None:
    sha = make_bare_repo(server.root, "calc.git", REPO_FILES)
    provider.script(
        Text(
            content=None,
            calls=(
                Call(name="read", arguments={"path": "/etc/passwd"}),
                Call(name="shell", arguments={"command": "id"}),
                Call(name="read", arguments="{not json"),
                # The socket's JSON discipline holds for the model's arguments too.
                Call(name="read", arguments='{"path": "calc.py", "path": "/etc/passwd"}'),
                Call(name="list", arguments='{"path": ' + "[" * 100_000 + "]" * 100_000 + "}"),
            ),
        ),
        Text(content="nothing to do"),
    )
    result = await run_agent(
        daemon.runs, daemon.dispatcher, task(server.url_for("calc.git"), sha, push=False)
    )
    told = tool_results(provider)
    assert told[0]["error"] == "policy_denied" and "/workspace" in told[0]["message"]
    assert told[1] == {
        "error": "bad_request",
        "message": "there is no tool 'shell'; the tools are read, write, edit, list, exec",
    }
    assert told[2]["error"] == "bad_request" and "JSON object" in told[2]["message"]
    assert told[3]["error"] == "bad_request"
    assert "the key 'path' appears twice in one object" in told[3]["message"]
    assert told[4]["error"] == "bad_request" and "at most 64 are accepted" in told[4]["message"]
    assert len(told) == 5
    # No change and --no-push: the run is ok with an empty bundle.
    assert result.ok and result.patches == [] and result.branch is None
    refused = by_event(result.audit_log, "agent_call_refused")
    assert [e["detail"]["tool"] for e in refused] == ["shell", "read", "read", "list"]
    denied = [e for e in result.audit_log if e["kind"] == "call" and e["decision"] == "deny"]
    assert denied and denied[0]["errorCode"] == "policy_denied"


async def test_tool_calls_past_the_per_answer_cap_are_refused(
    daemon: Daemon, server: GitServer, provider: FakeProvider
) -> None:
    sha = make_bare_repo(server.root, "calc.git", REPO_FILES)
    many = tuple(Call(name="list", arguments={"path": "."}) for _ in range(MAX_CALLS_PER_TURN + 2))
    provider.script(Text(content=None, calls=many), Text(content="done"))
    result = await run_agent(
        daemon.runs, daemon.dispatcher, task(server.url_for("calc.git"), sha, push=False)
    )
    told = tool_results(provider)
    assert len(told) == MAX_CALLS_PER_TURN + 2
    assert all("error" not in t for t in told[:MAX_CALLS_PER_TURN])
    assert told[-1]["message"].startswith(f"at most {MAX_CALLS_PER_TURN} tool calls")
    assert len(by_event(result.audit_log, "agent_call_refused")) == 2


async def test_the_overlay_workspace_holds_at_most_max_workspace_bytes(
    daemon: Daemon, server: GitServer, provider: FakeProvider
) -> None:
    sha = make_bare_repo(server.root, "calc.git", REPO_FILES)
    fill = "dd if=/dev/zero of=big bs=1M count=64 2>&1; rm -f big; echo after > small.txt"
    provider.script(
        Text(content=None, calls=(Call(name="exec", arguments={"command": fill}),)),
        Text(content="tried"),
    )
    result = await run_agent(
        daemon.runs,
        daemon.dispatcher,
        task(server.url_for("calc.git"), sha, push=False, max_workspace_bytes=16 << 20),
    )
    told = tool_results(provider)[0]
    assert "No space left on device" in told["stdout"], told
    # The run went on: what fits is written and makes the patch.
    assert result.ok and "+++ b/small.txt" in result.patches[0]


async def test_control_characters_from_the_model_never_reach_the_terminal(
    daemon: Daemon, server: GitServer, provider: FakeProvider
) -> None:
    sha = make_bare_repo(server.root, "calc.git", REPO_FILES)
    provider.script(
        Text(content=None, calls=(Call(name="\x1b]52;c;aGk=\x07list", arguments={}),)),
        Text(content="done"),
    )
    lines: list[str] = []
    result = await run_agent(
        daemon.runs,
        daemon.dispatcher,
        task(server.url_for("calc.git"), sha, push=False),
        lines.append,
    )
    assert not any("\x1b" in line or "\x07" in line for line in lines + result.logs)
    assert any("\\x1b]52;c;aGk=\\x07list" in line for line in lines)


async def test_an_answer_without_usage_is_charged_what_it_could_have_cost(
    daemon: Daemon, server: GitServer, provider: FakeProvider
) -> None:
    sha = make_bare_repo(server.root, "calc.git", REPO_FILES)
    look = Call(name="list", arguments={"path": "."})
    provider.script(*[Text(content=None, calls=(look,), usage=False)] * 3)
    result = await run_agent(
        daemon.runs,
        daemon.dispatcher,
        task(
            server.url_for("calc.git"),
            sha,
            push=False,
            limits=AgentLimits(max_turns=10, max_tokens=9000, max_wall_s=120),
        ),
    )
    # Turn 1 may cost 8192 (the most asked per turn), turn 2 the 808 left: spent.
    assert result.error_code == "task_failed" and "token limit (9000)" in result.message
    assert result.tokens == 9000 and result.turns == 2


# --- limits: each ends with its error code and a usable partial result ---------------


def _edit_then_loop(n: int, command: str = "true") -> list[Text]:
    edit = Call(name="edit", arguments={"path": "calc.py", "old": "a - b", "new": "a + b"})
    loop = Call(name="exec", arguments={"command": command})
    return [Text(content=None, calls=(edit,)), *[Text(content=None, calls=(loop,))] * n]


async def _partial(
    daemon: Daemon, server: GitServer, provider: FakeProvider, script: list[Text], **kw: Any
) -> tuple[AgentResult, str]:
    sha = make_bare_repo(server.root, "calc.git", REPO_FILES)
    provider.script(*script)
    result = await run_agent(
        daemon.runs, daemon.dispatcher, task(server.url_for("calc.git"), sha, **kw)
    )
    assert not result.ok
    # The partial result: the change made so far, as a patch that applies; nothing pushed.
    assert len(result.patches) == 1 and "+    return a + b" in result.patches[0]
    assert result.commit_messages[0].startswith(f"cogni agent run {result.run_id} (stopped:")
    assert result.branch is None
    refs = git("--git-dir", str(server.root / "calc.git"), "for-each-ref").decode()
    assert "cogni/" not in refs
    ended = by_event(result.audit_log, "agent_run_ended")
    assert ended and ended[0]["detail"]["errorCode"] == result.error_code
    # Usable: `git am` applies it on the commit the run started from.
    clone = server.root.parent / f"partial-{result.run_id}"
    git("clone", "--quiet", str(server.root / "calc.git"), str(clone))
    git("-C", str(clone), "checkout", "--quiet", "--detach", sha)
    git("-C", str(clone), "am", "--quiet", stdin=result.patches[0].encode())
    assert (clone / "calc.py").read_text() == "def add(a, b):\n    return a + b\n"
    return result, sha


async def test_the_turn_limit_ends_the_run_as_task_failed(
    daemon: Daemon, server: GitServer, provider: FakeProvider
) -> None:
    result, _ = await _partial(
        daemon,
        server,
        provider,
        _edit_then_loop(5),
        limits=AgentLimits(max_turns=3, max_tokens=10_000, max_wall_s=120),
    )
    assert result.error_code == "task_failed" and "turn limit (3)" in result.message
    assert result.turns == 3


async def test_the_token_limit_ends_the_run_as_task_failed(
    daemon: Daemon, server: GitServer, provider: FakeProvider
) -> None:
    # Each fake answer counts 11 + 7 tokens: 2 turns spend 36 >= 30.
    result, _ = await _partial(
        daemon,
        server,
        provider,
        _edit_then_loop(5),
        limits=AgentLimits(max_turns=10, max_tokens=30, max_wall_s=120),
    )
    assert result.error_code == "task_failed" and "token limit (30)" in result.message
    assert result.tokens == 36 and result.turns == 2
    # The model was asked for no more than what was left of the budget.
    assert provider.chat_requests[1].body["max_tokens"] == 12


async def test_the_wall_time_limit_ends_the_run_as_timeout(
    daemon: Daemon, server: GitServer, provider: FakeProvider
) -> None:
    result, _ = await _partial(
        daemon,
        server,
        provider,
        _edit_then_loop(1, command="sleep 60"),
        limits=AgentLimits(max_turns=10, max_tokens=10_000, max_wall_s=4),
    )
    assert result.error_code == "timeout" and "wall time limit (4 s)" in result.message
    # The command in flight was stopped, and its call still has its result entry.
    results = [e for e in result.audit_log if e["kind"] == "result"]
    assert results[-1]["tool"] == "sandbox.exec" and results[-1]["errorCode"] == "internal"


async def test_a_command_killed_for_memory_makes_a_failed_run_oom_killed(
    daemon: Daemon, server: GitServer, provider: FakeProvider
) -> None:
    hog = "python3 -c 'b = bytearray(1 << 30); print(len(b))'"
    result, _ = await _partial(
        daemon,
        server,
        provider,
        _edit_then_loop(2, command=hog),
        limits=AgentLimits(max_turns=3, max_tokens=10_000, max_wall_s=120),
        max_memory_mb=128,
    )
    told = tool_results(provider)
    assert told[1]["errorCode"] == "oom_killed", told[1]
    assert result.error_code == "oom_killed" and "out of memory" in result.message


async def test_what_a_crashed_agent_run_left_is_unmounted_and_removed_at_start(
    base: Path, provider: FakeProvider
) -> None:
    import fcntl

    from gatewayd.agent.workdir import WORK_MARKER
    from gatewayd.workspace import OverlayWorkspace

    config = agent_config(base, provider)
    work = config.resolved_agent_dir / "0123456789abcdef"
    (work / "base").mkdir(parents=True)
    (work / WORK_MARKER).touch()
    # Not gatewayd's (no marker), and a live run's (its marker locked): both are kept.
    foreign = config.resolved_agent_dir / "fedcba9876543210"
    foreign.mkdir()
    live = config.resolved_agent_dir / "00000000000000aa"
    live.mkdir()
    (live / WORK_MARKER).touch()
    held = os.open(live / WORK_MARKER, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    (work / "base" / "f.txt").write_text("x\n")
    os.chown(work / "base" / "f.txt", 1_999_999_999, 1_999_999_999)  # a run uid's
    session = OverlayWorkspace.create(work / "base", work / "session")
    (Path(session.root) / "new.txt").write_text("y\n")
    assert os.path.ismount(session.root)
    # gatewayd dies here: no close, no discard. The next daemon on this state directory:
    try:
        async with open_daemon(config, preload=True) as d:
            assert not os.path.ismount(session.root)
            assert sorted(config.resolved_agent_dir.iterdir()) == [live, foreign]
            await d.audit.durable(d.audit.last_seq)
            lines = config.resolved_audit_path.read_text().splitlines()
    finally:
        os.close(held)
    [event] = [json.loads(x) for x in lines if '"leftovers_removed"' in x]
    assert event["detail"]["agentDirs"] == ["0123456789abcdef"]


async def test_a_failure_inside_gatewayd_ends_the_run_and_says_internal(
    daemon: Daemon, server: GitServer, provider: FakeProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection: a bug while making the patch (nothing real fails there on demand).
    The run still ends, its files go, and the result says internal, not a traceback."""
    from gatewayd.agent import loop

    def broken(*_args: Any, **_kwargs: Any) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(loop, "patch_from_tree", broken)
    sha = make_bare_repo(server.root, "calc.git", REPO_FILES)
    provider.script(*fixing_script())
    result = await run_agent(daemon.runs, daemon.dispatcher, task(server.url_for("calc.git"), sha))
    assert not result.ok and result.error_code == "internal"
    assert result.message == (
        "gatewayd failed during the run (RuntimeError); gatewayd's log has the details"
    )
    assert daemon.registry.all() == []  # the run ended
    assert list(daemon.config.resolved_agent_dir.iterdir()) == []
    assert ref_sha(server.root / "calc.git", f"refs/heads/cogni/{result.run_id}") is None


async def test_the_policys_rule_review_judges_the_models_commands(
    daemon: Daemon, server: GitServer, provider: FakeProvider, base: Path
) -> None:
    """The same review a cogni-tool call gets: a separate model call, which denies."""
    shipped = Path(__file__).resolve().parents[2] / "policies" / "agent.yaml"
    policy = base / "reviewed-agent.yaml"
    policy.write_text(
        shipped.read_text().replace("name: agent", "name: reviewed-agent")
        + f"review:\n  mode: llm\n  model: {ALIAS}\n  tools: [sandbox.exec]\n"
        "  rules:\n    deny: [Deleting files]\n"
    )
    sha = make_bare_repo(server.root, "calc.git", REPO_FILES)
    provider.script(
        Text(content=None, calls=(Call(name="exec", arguments={"command": "rm -rf ./*"}),)),
        Text(content="DENY: it deletes the repository's files"),  # the reviewer's answer
        Text(content="I will not delete anything"),
    )
    result = await run_agent(
        daemon.runs,
        daemon.dispatcher,
        task(server.url_for("calc.git"), sha, push=False, policy=str(policy)),
    )
    told = tool_results(provider)[0]
    assert told["error"] == "review_denied", told
    assert "it deletes the repository's files" in told["message"]
    # The reviewer saw the command; nothing was deleted (no change, so no patch).
    review_request = provider.chat_requests[1].body["messages"]
    assert "rm -rf ./*" in json.dumps(review_request)
    assert result.ok and result.patches == []
    [call] = [e for e in result.audit_log if e["kind"] == "call"]
    assert call["decision"] == "deny" and call["errorCode"] == "review_denied"
    assert call["review"]["verdict"] == "deny"


async def test_changes_that_all_stay_out_of_the_patch_fail_a_push_run(
    daemon: Daemon, server: GitServer, provider: FakeProvider
) -> None:
    sha = make_bare_repo(server.root, "calc.git", REPO_FILES)
    only_ignored = "mkdir -p __pycache__ && echo x > __pycache__/calc.pyc"
    provider.script(
        Text(content=None, calls=(Call(name="exec", arguments={"command": only_ignored}),)),
        Text(content="done"),
    )
    result = await run_agent(daemon.runs, daemon.dispatcher, task(server.url_for("calc.git"), sha))
    assert not result.ok and result.error_code == "task_failed"
    assert result.message.startswith("every change was left out of the patch")
    assert result.skipped == ["__pycache__/calc.pyc: ignored by .gitignore"]
    assert result.branch is None


@pytest.mark.parametrize("mode", [0o777, 0o770])
async def test_an_agent_dir_others_may_write_is_refused_and_left_as_it_is(
    base: Path, provider: FakeProvider, server: GitServer, mode: int
) -> None:
    shared = base / "shared"
    shared.mkdir()
    shared.chmod(mode)
    async with open_daemon(agent_config(base, provider, agent_dir=shared), preload=True) as d:
        result = await run_agent(d.runs, d.dispatcher, task(server.url_for("calc.git"), "a" * 40))
        await d.audit.durable(d.audit.last_seq)
        lines = d.config.resolved_audit_path.read_text().splitlines()
    assert result.error_code == "internal"
    assert "must be a directory of gatewayd's own user that no one else may write" in (
        result.message
    )
    assert stat.S_IMODE(shared.stat().st_mode) == mode  # not chmodded behind the operator
    assert list(shared.iterdir()) == [] and server.requests == []
    assert any('"agent_run_refused"' in line for line in lines)


async def test_without_the_os_sandbox_no_agent_run_starts(
    base: Path, provider: FakeProvider, server: GitServer
) -> None:
    sha = make_bare_repo(server.root, "calc.git", REPO_FILES)
    shipped = Path(__file__).resolve().parents[2] / "policies" / "agent.yaml"
    lax = base / "lax-agent.yaml"
    lax.write_text(
        shipped.read_text().replace("name: agent", "name: lax-agent")
        + "require_os_sandbox: false\n"
    )
    os.environ[TOKEN_ENV] = DEFAULT_TOKEN
    try:
        async with open_daemon(agent_config(base, provider, os_sandbox=False), preload=True) as d:
            # The shipped policy requires the sandbox: the run is refused at its start.
            strict = await run_agent(d.runs, d.dispatcher, task(server.url_for("calc.git"), sha))
            # A policy that would let the run go on without one: still no agent run.
            degraded = await run_agent(
                d.runs, d.dispatcher, task(server.url_for("calc.git"), sha, policy=str(lax))
            )
            await d.audit.durable(d.audit.last_seq)
            entries = [json.loads(x) for x in d.config.resolved_audit_path.read_text().splitlines()]
    finally:
        os.environ.pop(TOKEN_ENV, None)
    assert strict.error_code == "internal" and strict.run_id is None
    assert strict.message.startswith("the run could not start: policy 'agent' requires the OS")
    assert degraded.error_code == "internal" and degraded.run_id is not None
    assert degraded.message.startswith("agent runs execute commands only in an OS sandbox")
    refused = by_event(entries, "agent_run_refused")
    assert [e.get("runId") for e in refused] == [degraded.run_id]
    assert by_event(entries, "run_refused")[0]["errorCode"] == "policy_denied"
    assert provider.requests == []  # no model was asked anything


# --- what a provider or a forge sends that gatewayd cannot read ---------------------------

EDIT = Call(name="edit", arguments={"path": "calc.py", "old": "a - b", "new": "a + b"})


@pytest.mark.filterwarnings("ignore::UserWarning")  # pydantic's, on litellm's models
@pytest.mark.parametrize(
    ("reply", "says"),
    [
        pytest.param(
            Malformed(status=400, body=DEEP),
            "the model call failed (bad_request): model alias 'agent-model' (openai/fake-model "
            "at http://127.0.0.1:",
            id="deep-error",
        ),
        pytest.param(
            Malformed(body=DEEP),
            "the model call failed (malformed): model alias 'agent-model'",
            id="deep-answer",
        ),
        pytest.param(
            Text(content=None, calls=(Call(name="exec\udc80", arguments={"command": "ls"}),)),
            "the model call failed (malformed): model alias 'agent-model'",
            id="lone-surrogate-tool-name",
        ),
    ],
)
async def test_a_model_reply_gatewayd_cannot_read_ends_the_run_internal_and_audited(
    daemon: Daemon, server: GitServer, provider: FakeProvider, reply: Any, says: str
) -> None:
    """As for any failed model call: the run ends internal saying why, keeps its partial
    patch, pushes nothing, and its end is audited."""
    sha = make_bare_repo(server.root, "calc.git", REPO_FILES)
    provider.script(Text(content=None, calls=(EDIT,)), reply)

    result = await run_agent(daemon.runs, daemon.dispatcher, task(server.url_for("calc.git"), sha))

    assert (result.ok, result.error_code) == (False, "internal")
    assert result.message.startswith(says), result.message
    assert MODEL_KEY not in result.message
    assert result.turns == 2 and result.branch is None
    assert len(result.patches) == 1 and "+    return a + b" in result.patches[0]
    [ended] = by_event(result.audit_log, "agent_run_ended")
    assert ended["detail"]["errorCode"] == "internal"
    assert ended["detail"]["message"] == result.message


def forge_answering(status: int, answer: bytes) -> Iterator[FakeForge]:
    forge = FakeForge(status, answer)
    try:
        yield forge
    finally:
        forge.close()


@pytest.mark.parametrize(
    ("status", "answer", "says"),
    [
        pytest.param(
            201,
            DEEP,
            "is not a pull request: it is not JSON gatewayd accepts (the document nests",
            id="deep-201",
        ),
        pytest.param(422, DEEP, "failed: the forge answered 422: [[[[", id="deep-422"),
        pytest.param(
            201,
            b'{"html_url": "javascript:alert(1)"}',
            "its html_url is not an http(s) URL",
            id="url-not-http",
        ),
        pytest.param(
            201, b'{"html_url": "https://forge.invalid/1"', "it is not JSON", id="cut-short"
        ),
    ],
)
async def test_a_pull_request_the_forge_answers_badly_fails_the_run_after_its_push_audited(
    daemon: Daemon,
    server: GitServer,
    provider: FakeProvider,
    status: int,
    answer: bytes,
    says: str,
) -> None:
    """The branch is pushed, the pull request step fails: the result says both, the
    audit has the failed agent_pull_request, and the run still ends as audited."""
    sha = make_bare_repo(server.root, "calc.git", REPO_FILES)
    provider.script(Text(content=None, calls=(EDIT,)), Text(content="Fix add()"))
    with contextlib.contextmanager(forge_answering)(status, answer) as forge:
        pr = PullRequestSpec(
            api_base=forge.url, repository="o/calc", target_branch="main", token_env=TOKEN_ENV
        )
        result = await run_agent(
            daemon.runs, daemon.dispatcher, task(server.url_for("calc.git"), sha, pull_request=pr)
        )
        assert len(forge.seen) == 1

    assert (result.ok, result.error_code) == (False, "internal")
    assert result.message.startswith("the branch was pushed, but the pull request failed: ")
    assert says in result.message, result.message
    assert DEFAULT_TOKEN not in result.message
    assert result.branch == f"cogni/{result.run_id}" and result.pull_request_url is None
    assert ref_sha(server.root / "calc.git", f"refs/heads/{result.branch}") == result.head_sha
    events = [e["event"] for e in result.audit_log if e.get("event", "").startswith("agent_")]
    assert events[-4:] == ["agent_patch", "agent_push", "agent_pull_request", "agent_run_ended"]
    [failed] = by_event(result.audit_log, "agent_pull_request")
    assert failed["errorCode"] == "internal" and failed["safeMessage"] == result.message
    assert failed["detail"] == {"branch": result.branch, "repository": "o/calc"}


async def test_a_pull_request_step_gatewayd_fails_in_is_still_reported_and_audited(
    daemon: Daemon,
    server: GitServer,
    provider: FakeProvider,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Fault injection (nothing real fails there on demand): an exception the step does
    not expect still ends it with the failed agent_pull_request event."""
    from gatewayd.agent import loop

    def broken(*_args: Any, **_kwargs: Any) -> str:
        raise RuntimeError("injected")

    monkeypatch.setattr(loop, "open_pull_request", broken)
    sha = make_bare_repo(server.root, "calc.git", REPO_FILES)
    provider.script(Text(content=None, calls=(EDIT,)), Text(content="Fix add()"))
    pr = PullRequestSpec(
        api_base="http://127.0.0.1:9",
        repository="o/calc",
        target_branch="main",
        token_env=TOKEN_ENV,
    )

    result = await run_agent(
        daemon.runs, daemon.dispatcher, task(server.url_for("calc.git"), sha, pull_request=pr)
    )

    assert (result.ok, result.error_code) == (False, "internal")
    assert result.message == (
        "the branch was pushed, but the pull request failed: gatewayd failed opening it "
        "(RuntimeError); its log has the details"
    )
    [failed] = by_event(result.audit_log, "agent_pull_request")
    assert failed["errorCode"] == "internal" and failed["safeMessage"] == result.message


# --- apps in the checkout -----------------------------------------------------------

APPS_POLICY = """\
version: 1
name: agent-apps
description: The agent policy, plus the checkout's apps.
tools:
  allow: ["fs.read", "fs.write", "fs.edit", "fs.list", "sandbox.exec", "app_*"]
filesystem:
  paths:
    checkout: {root: ., mode: rw}
model_access:
  models: [agent-model]
review: {mode: "off", model: reviewer}
limits: {call_timeout_s: 120}
"""


async def test_an_agent_run_prompts_an_app_of_its_checkout_and_the_patch_leaves_its_data_out(
    base: Path, server: GitServer, provider: FakeProvider
) -> None:
    note_taker = Path(__file__).resolve().parents[2] / "apps" / "examples" / "note-taker"
    files = dict(REPO_FILES)
    files["apps/note-taker/APP.md"] = (note_taker / "APP.md").read_bytes()
    sha = make_bare_repo(server.root, "calc.git", files)
    (base / "policies").mkdir()
    (base / "policies" / "agent-apps.yaml").write_text(APPS_POLICY)
    with FakeProvider() as reviewer:
        reviewer.respond = lambda body: Text(content="ALLOW")
        config = agent_config(base, provider)
        reviewer_alias = ModelAlias(
            provider="openai", model="r", api_base=reviewer.api_base, api_key_env=MODEL_KEY_ENV
        )
        config = config.model_copy(
            update={
                "policy_dirs": (*config.policy_dirs, base / "policies"),
                "models": {**config.models, "reviewer": reviewer_alias},
            }
        )
        os.environ[TOKEN_ENV] = DEFAULT_TOKEN
        os.environ[MODEL_KEY_ENV] = MODEL_KEY
        try:
            async with open_daemon(config, preload=True) as daemon:
                provider.script(
                    # The agent prompts the app; the app (same provider) writes a note.
                    Text(
                        content=None,
                        calls=(Call(name="app_note_taker", arguments={"prompt": "note: hi"}),),
                    ),
                    Text(
                        content=None,
                        calls=(
                            Call(
                                name="write",
                                arguments={"path": "data/n.md", "content": "- hi\n"},
                            ),
                        ),
                    ),
                    Text(content="Noted in data/n.md."),
                    Text(
                        content=None,
                        calls=(
                            Call(
                                name="edit",
                                arguments={"path": "calc.py", "old": "a - b", "new": "a + b"},
                            ),
                        ),
                    ),
                    Text(content="Fix add()\n\nIt subtracted."),
                )
                result = await run_agent(
                    daemon.runs,
                    daemon.dispatcher,
                    task(server.url_for("calc.git"), sha, policy="agent-apps", push=False),
                )
        finally:
            os.environ.pop(TOKEN_ENV, None)
            os.environ.pop(MODEL_KEY_ENV, None)
    assert result.ok, result.to_json()
    offered = [t["function"]["name"] for t in provider.chat_requests[0].body["tools"]]
    assert offered == ["read", "write", "edit", "list", "exec", "app_note_taker"]
    told = tool_results(provider)
    app_answer = json.loads(told[0]) if isinstance(told[0], str) else told[0]
    assert app_answer["ok"] is True and app_answer["changed"] == ["/app/data/n.md"], told
    assert any("apps offered: app_note_taker" in line for line in result.logs)
    # The patch holds the agent's fix and nothing of the app's data.
    (patch,) = result.patches
    assert "calc.py" in patch and "apps/" not in patch
    invoked = by_event(result.audit_log, "app_invoked")
    assert len(invoked) == 1 and invoked[0]["detail"]["app"] == "note-taker"
