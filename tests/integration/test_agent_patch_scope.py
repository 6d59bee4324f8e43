"""An agent run's branch holds what the agent meant to change, and nothing its commands
left behind.

The scenario of the report: a scripted model (the loopback fake provider, through
litellm) fixes a function in a small Python repository and runs commands in the real
sandbox that leave bytecode (``python3 -m unittest``), a test cache (what pytest writes:
``.pytest_cache`` with its own ``.gitignore``) and a build folder the repository's
``.gitignore`` ignores (``python3 setup.py build``). The repository ignores ``build/``
only: the bytecode and the test cache stay out by the policy's cache list. The pushed
branch holds the one-line fix; the result says what was left out and why.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import pytest

from gatewayd.agent.loop import run_agent
from gatewayd.daemon import Daemon
from tests.fakeprovider import Call, FakeProvider, Text
from tests.gitserver import GitServer, make_bare_repo, read_tree
from tests.integration.test_agent_run import (  # noqa: F401 - fixtures
    CALC,
    TESTS,
    base,
    daemon,
    provider,
    server,
    task,
    tool_results,
)
from tests.integration.test_run_sandbox import _unavailable

pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))

SETUP = b"from setuptools import setup\n\nsetup(name='calc', version='0.1', py_modules=['calc'])\n"
REPO: Mapping[str, bytes] = {
    "calc.py": CALC,
    "test_calc.py": TESTS,
    "setup.py": SETUP,
    "README.md": b"# calc\n",
    ".gitignore": b"build/\n",  # no word of bytecode or test caches
}
FIXED = b"def add(a, b):\n    return a + b\n"
# What pytest leaves in the directory it ran in (the sandbox's python has no pytest).
PYTEST_CACHE = (
    "mkdir -p .pytest_cache/v/cache && printf '[]' > .pytest_cache/v/cache/nodeids && "
    "printf 'Signature: 8a477f597d28d172789f06886806bc55\\n' > .pytest_cache/CACHEDIR.TAG && "
    "printf '# Created by pytest automatically.\\n*\\n' > .pytest_cache/.gitignore && echo cached"
)
CACHE_REASON = "a cache or tool output ('{}' in the policy's patches.exclude)"


async def test_the_pushed_branch_holds_only_the_fix_and_the_result_says_what_stayed_out(
    daemon: Daemon,  # noqa: F811
    server: GitServer,  # noqa: F811
    provider: FakeProvider,  # noqa: F811
) -> None:
    sha = make_bare_repo(server.root, "calc.git", REPO)
    provider.script(
        Text(
            content="fixing the operator",
            calls=(
                Call(name="edit", arguments={"path": "calc.py", "old": "a - b", "new": "a + b"}),
            ),
        ),
        Text(
            content=None,
            calls=(
                Call(name="exec", arguments={"command": "python3 -m unittest -v 2>&1"}),
                Call(name="exec", arguments={"command": PYTEST_CACHE}),
                Call(name="exec", arguments={"command": "python3 setup.py -q build 2>&1"}),
                Call(name="exec", arguments={"command": "find . -path ./.git -prune -o -print"}),
            ),
        ),
        Text(content="Fix add() to add"),
    )
    result = await run_agent(daemon.runs, daemon.dispatcher, task(server.url_for("calc.git"), sha))

    assert result.ok, result.to_json()
    ran = tool_results(provider)
    assert ran[1]["exitCode"] == 0 and "OK" in ran[1]["stdout"], ran[1]
    assert ran[2]["stdout"].strip() == "cached", ran[2]
    assert ran[3]["exitCode"] == 0, ran[3]
    # The commands did leave all three behind in the workspace.
    tree = ran[4]["stdout"].split()
    assert "./__pycache__/calc.cpython-311.pyc" in tree, tree
    assert "./.pytest_cache/v/cache/nodeids" in tree, tree
    assert "./build/lib/calc.py" in tree, tree

    # The branch: the base tree with the one-line fix, nothing else.
    pushed = read_tree(server.root / "calc.git", f"cogni/{result.run_id}")
    assert {path: data for path, (_mode, data) in pushed.items()} == {**REPO, "calc.py": FIXED}
    assert len(result.patches) == 1
    assert "diff --git a/calc.py b/calc.py" in result.patches[0]
    assert result.patches[0].count("diff --git") == 1

    # The result lists what was left out, each with its reason.
    skipped = dict(line.split(": ", 1) for line in result.skipped)
    assert skipped == {
        "__pycache__/calc.cpython-311.pyc": CACHE_REASON.format("__pycache__"),
        "__pycache__/test_calc.cpython-311.pyc": CACHE_REASON.format("__pycache__"),
        ".pytest_cache/.gitignore": CACHE_REASON.format(".pytest_cache"),
        ".pytest_cache/CACHEDIR.TAG": CACHE_REASON.format(".pytest_cache"),
        ".pytest_cache/v/cache/nodeids": CACHE_REASON.format(".pytest_cache"),
        "build/lib/calc.py": "ignored by .gitignore",
    }
    assert result.to_json()["skipped"] == result.skipped
    [patch_event] = [e for e in result.audit_log if e.get("event") == "agent_patch"]
    assert sorted(patch_event["detail"]["skipped"]) == sorted(result.skipped)
    assert any("6 path(s) left out" in line for line in result.logs), json.dumps(result.logs)
