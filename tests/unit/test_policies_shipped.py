"""Every policy file shipped in policies/ validates; default denies all; demo is exact.

The files are globbed, so a policy added to policies/ or policies/examples/ is tested
here without touching this file.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gatewayd.hostpaths.binding import bind_paths
from gatewayd.policy import (
    PathAccess,
    PathMode,
    Policy,
    RunRules,
    decide,
    load_policy_text,
    summarize,
    tool_allowed,
)
from gatewayd.policy.decide import Allow, Deny
from gatewayd.policyfile import load_policy
from gatewayd.protocol import ErrorCode

POLICIES = Path(__file__).resolve().parents[2] / "policies"
SHIPPED = sorted([*POLICIES.glob("*.yaml"), *POLICIES.glob("examples/*.yaml")])

# Every tool family the gateway has or plans, with a few names each: anything a policy
# does not list must be refused.
TOOL_UNIVERSE = (
    "time.now",
    "time.sleep",
    "fs.read",
    "fs.write",
    "fs.edit",
    "fs.list",
    "fs.stat",
    "fs.delete",
    "fs.move",
    "fs.mkdir",
    "http.fetch",
    "model.chat",
    "model.complete",
    "git.status",
    "git.commit",
    "mcp.call",
    "wasm.run",
    "shell.exec",
)


def ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(POLICIES)) for p in paths]


def rules_for(policy: Policy, workspace: Path) -> RunRules:
    return RunRules(
        tool_patterns=policy.tools.allow,
        run_tool_ids=None,
        grants=bind_paths(policy, workspace),
    )


def make_relative_roots(policy: Policy, workspace: Path) -> None:
    for rule in policy.filesystem.paths.values():
        if not rule.is_absolute:
            (workspace / rule.root).mkdir(parents=True, exist_ok=True)


def test_the_shipped_policies_are_found() -> None:
    names = ids(SHIPPED)
    assert "default.yaml" in names
    assert {
        "examples/demo.yaml",
        "examples/read-only-docs.yaml",
        "examples/workspace-rw.yaml",
    } <= set(names)


@pytest.mark.parametrize("path", SHIPPED, ids=ids(SHIPPED))
def test_every_shipped_policy_validates_and_summarizes(path: Path) -> None:
    policy = load_policy(path)
    assert policy.name == path.stem
    assert policy.description
    assert f"policy {policy.name} " in summarize(policy, str(path))


@pytest.mark.parametrize("path", SHIPPED, ids=ids(SHIPPED))
def test_every_shipped_policys_workspace_paths_bind(path: Path, tmp_path: Path) -> None:
    policy = load_policy(path)
    make_relative_roots(policy, tmp_path)
    relative = {n for n, r in policy.filesystem.paths.items() if not r.is_absolute}
    if any(r.is_absolute and not Path(r.root).is_dir() for r in policy.filesystem.paths.values()):
        pytest.skip("an absolute root of this example does not exist on this host")
    grants = bind_paths(policy, tmp_path)
    assert {g.name for g in grants} >= relative
    for grant in grants:
        if grant.name in relative:
            assert grant.host_root.is_relative_to(tmp_path.resolve())


def test_default_policy_denies_every_tool_and_every_path(tmp_path: Path) -> None:
    policy = load_policy(POLICIES / "default.yaml")
    assert policy.tools.allow == ()
    assert policy.filesystem.paths == {}
    rules = rules_for(policy, tmp_path)
    assert rules.grants == ()
    for tool in TOOL_UNIVERSE:
        decision = decide(tool, (), rules)
        assert decision == Deny(
            code=ErrorCode.POLICY_DENIED,
            message=f"tool '{tool}' is not allowed for this run. This run's policy allows no "
            "tools.",
        )
    everyone = RunRules(tool_patterns=("fs.*",), run_tool_ids=None, grants=rules.grants)
    for path in ("notes.md", "/workspace", "/workspace/a.txt", "/", "/etc/passwd"):
        decision = decide("fs.read", (PathAccess(path=path, access="read"),), everyone)
        assert isinstance(decision, Deny)
        assert decision.message.endswith("Readable paths: none")


def test_default_policy_file_says_it_denies_all() -> None:
    text = (POLICIES / "default.yaml").read_text()
    assert "deny all" in text.lower()


DEMO_TOOLS = ("time.now", "fs.read", "fs.write", "fs.edit", "fs.list", "fs.stat")


def test_demo_allows_exactly_its_six_tools(tmp_path: Path) -> None:
    policy = load_policy(POLICIES / "examples" / "demo.yaml")
    assert sorted(policy.tools.allow) == sorted(DEMO_TOOLS)
    rules = rules_for(policy, tmp_path)
    for tool in TOOL_UNIVERSE:
        assert tool_allowed(tool, rules) is (tool in DEMO_TOOLS), tool


def test_demo_grants_only_the_workspace_read_write_for_four_suffixes(tmp_path: Path) -> None:
    policy = load_policy(POLICIES / "examples" / "demo.yaml")
    (grant,) = rules_for(policy, tmp_path).grants
    assert grant.host_root == tmp_path.resolve()
    assert str(grant.visible_root) == "/workspace"
    assert grant.mode is PathMode.RW
    assert grant.suffixes == (".txt", ".md", ".json", ".py")
    assert grant.max_file_bytes == 1_000_000


@pytest.mark.parametrize(
    ("path", "access", "size", "allowed"),
    [
        ("notes.md", "write", 10, True),
        ("a/b.py", "write", 1_000_000, True),
        ("data.json", "read", None, True),
        ("t.txt", "read", None, True),
        ("big.md", "write", 1_000_001, False),
        ("image.png", "read", None, False),
        ("/etc/passwd", "read", None, False),
        ("../outside.md", "write", 1, False),
        ("/data/docs/x.md", "read", None, False),
    ],
)
def test_demo_paths(
    tmp_path: Path, path: str, access: str, size: int | None, allowed: bool
) -> None:
    policy = load_policy(POLICIES / "examples" / "demo.yaml")
    request = PathAccess(path=path, access=access, size=size)  # type: ignore[arg-type]
    decision = decide("fs.write", (request,), rules_for(policy, tmp_path))
    assert isinstance(decision, Allow) is allowed, decision


def test_workspace_rw_keeps_its_reference_directory_read_only(tmp_path: Path) -> None:
    policy = load_policy(POLICIES / "examples" / "workspace-rw.yaml")
    make_relative_roots(policy, tmp_path)
    rules = rules_for(policy, tmp_path)
    write = PathAccess(path="reference/spec.md", access="write", size=1)
    read = PathAccess(path="reference/spec.md", access="read")
    assert isinstance(decide("fs.edit", (read,), rules), Allow)
    denied = decide("fs.write", (write,), rules)
    assert denied == Deny(
        code=ErrorCode.POLICY_DENIED,
        message="Cannot write to 'reference/spec.md': path is read-only.\n"
        "Writable paths: /workspace (except /workspace/reference)",
    )


def test_read_only_docs_refuses_every_write(tmp_path: Path) -> None:
    policy = load_policy(POLICIES / "examples" / "read-only-docs.yaml")
    rules = rules_for(policy, tmp_path)
    assert not tool_allowed("fs.write", rules)
    write = PathAccess(path="notes.md", access="write", size=1)
    decision = decide("fs.read", (write,), rules)
    assert isinstance(decision, Deny)
    assert decision.message.endswith("Writable paths: none")


DOC = Path(__file__).resolve().parents[2] / "docs" / "policy.md"


def test_every_yaml_example_in_the_policy_reference_validates() -> None:
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) >= 4
    for block in blocks:
        text = block if block.startswith("version:") else f"version: 1\nname: doc\n{block}"
        load_policy_text(text, f"{DOC.name} example")
