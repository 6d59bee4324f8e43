"""The install_app tool over a real run's socket through the real dispatcher: what the
caller may read is installed into its workspace and audited; every hostile source is
refused (symlinks out of the grant or into the apps folder by the policy step's path and
the no-follow open, the apps folder itself, a bad id, an existing app without replace)
with its code and a message naming the caller's paths only. From inside a real sandbox:
the probe plants a symlink and asks, and loosening an app's rules is refused there; and
`gatewayd apps rules` against a real daemon's control socket."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from gatewayd.apps.admintools import admin_tools
from gatewayd.apps.discovery import DiscoveredApp, find_app
from gatewayd.apps.ruledesk import PendingAppRule
from gatewayd.audit import verify_file
from gatewayd.config import GatewaydConfig
from gatewayd.daemon import Daemon, open_daemon
from gatewayd.policy.rule_action import RuleAction
from gatewayd.runs import Run
from gatewayd.tools import builtin_tools
from gatewayd.tools.registry import ToolRegistry
from tests.conftest import Gateway, make_gateway
from tests.integration.test_app_rules import APP, call, plant, rules_of
from tests.integration.test_apps_folder_sandbox import TOOLS_PROBE, Sandboxed, sandboxed
from tests.integration.test_run_sandbox import sandbox_config

GATEWAYD = str(Path(sys.executable).parent / "gatewayd")
POLICY = """
version: 1
name: installer
tools:
  allow: [install_app, app_rules, "fs.*"]
filesystem:
  paths:
    workspace: {root: ., mode: rw}
limits: {calls_per_second: 1000, burst: 1000, call_timeout_s: 30}
require_os_sandbox: false
"""


def source_app(folder: Path, app_id: str = "helper") -> Path:
    folder.mkdir(parents=True)
    (folder / "APP.md").write_text(APP.replace("name: notes", f"name: {app_id}"))
    (folder / "scripts").mkdir()
    (folder / "scripts" / "run.sh").write_text("#!/bin/sh\necho hi\n")
    return folder


class Installer:
    """A run allowed install_app, its tools set on the dispatcher, rediscoveries counted."""

    def __init__(self, gw: Gateway, run: Run) -> None:
        self.gw = gw
        self.run = run
        self.rediscovered = 0

    async def rediscover(self) -> None:
        self.rediscovered += 1

    async def install(self, args: dict[str, Any], tcid: str = "c1") -> dict[str, Any]:
        return await call(self.run, "install_app", args, tcid)


@pytest.fixture
async def gw(short_tmp: Path) -> AsyncIterator[Gateway]:
    async with make_gateway(short_tmp) as gateway:
        yield gateway


@pytest.fixture
async def installer(gw: Gateway, workspace: Path) -> Installer:
    plant(workspace)  # an installed app, "notes"
    run = await gw.create_run(workspace, POLICY)
    made = Installer(gw, run)
    tools = admin_tools(
        workspace=workspace,
        actor="tester",
        desk=gw.daemon.app_rule_desk,
        audit=gw.daemon.audit,
        rediscover=made.rediscover,
        state_dir=gw.daemon.config.state_dir,
    )
    gw.daemon.dispatcher.set_run_tools(run.run_id, ToolRegistry(tools))
    return made


# --- installing -----------------------------------------------------------------------------


async def test_install_app_installs_what_the_caller_may_read_audited_and_rediscovered(
    installer: Installer, workspace: Path
) -> None:
    source_app(workspace / "incoming" / "helper-src")
    answer = await installer.install({"source": "incoming/helper-src"})
    assert answer["ok"], answer
    assert answer["value"] == {
        "installed": "helper",
        "tool": "app_helper",
        "replaced": False,
        "keptData": False,
        "files": 2,
        "bytes": answer["value"]["bytes"],
    }
    found = find_app(workspace, "helper")
    assert isinstance(found, DiscoveredApp)
    assert (workspace / "apps" / "helper" / "data").is_dir()
    assert installer.rediscovered == 1  # the new tool is offered in this same run
    entries = await installer.gw.audit_entries()
    (installed,) = [e for e in entries if e.get("event") == "app_installed"]
    assert installed["runId"] == installer.run.run_id
    assert installed["detail"]["app"] == "helper"
    call_seq = next(e["seq"] for e in entries if e.get("tool") == "install_app")
    assert call_seq < installed["seq"]  # the call's write-ahead entry comes first
    assert verify_file(installer.gw.audit_path).ok


async def test_an_existing_app_is_replaced_only_when_asked_and_keeps_its_data(
    installer: Installer, workspace: Path
) -> None:
    (workspace / "apps" / "notes" / "data" / "n.md").write_text("mine\n")
    source_app(workspace / "new-notes", app_id="notes")
    refused = await installer.install({"source": "new-notes"})
    assert refused["errorCode"] == "tool_failed"
    message = refused["safeMessage"]
    assert "app 'notes' is already installed in /workspace/apps/notes" in message
    assert "install again with replace: true" in message
    assert str(workspace) not in message  # the caller's paths, never the host's
    replaced = await installer.install({"source": "new-notes", "replace": True}, "c2")
    assert replaced["ok"], replaced
    assert replaced["value"]["replaced"] and replaced["value"]["keptData"]
    assert (workspace / "apps" / "notes" / "data" / "n.md").read_text() == "mine\n"


@pytest.mark.parametrize(
    ("edit", "refusal"),
    [
        (
            ("### Allow\n", "### Allow\n- Reading anything anywhere\n"),
            "adds the allow rule 'Reading anything anywhere'",
        ),
        (("- Running commands\n", ""), "drops the deny rule 'Running commands'"),
        (
            ("- Reading files in data/\n", "- Reading files in data/\n- Deleting all\n"),
            "adds the allow rule 'Deleting all'",
        ),
    ],
)
async def test_a_replacement_from_a_run_never_loosens_the_app_s_rules(
    installer: Installer, workspace: Path, edit: tuple[str, str], refusal: str
) -> None:
    installed = (workspace / "apps" / "notes" / "APP.md").read_bytes()
    src = source_app(workspace / "looser", app_id="notes")
    (src / "APP.md").write_text((src / "APP.md").read_text().replace(*edit))
    answer = await installer.install({"source": "looser", "replace": True})
    assert answer["errorCode"] == "policy_denied", answer
    message = answer["safeMessage"]
    assert message.startswith("this replacement of app 'notes' loosens its rules (")
    assert refusal in message and "ask for each loosening with app_rules" in message
    assert (workspace / "apps" / "notes" / "APP.md").read_bytes() == installed
    assert not [p for p in (workspace / "apps").iterdir() if p.name.startswith(".")]
    assert installer.rediscovered == 0


async def test_a_replacement_with_the_same_or_tighter_rules_is_installed(
    installer: Installer, workspace: Path
) -> None:
    src = source_app(workspace / "tighter", app_id="notes")
    text = (src / "APP.md").read_text()
    text = text.replace("Keep notes in data/.", "Keep short notes in data/.")
    text = text.replace("- Writing files in data/ <!-- addedBy: alice -->\n", "")
    text = text.replace("- Running commands\n", "- Running commands\n- Deleting notes\n")
    (src / "APP.md").write_text(text)
    answer = await installer.install({"source": "tighter", "replace": True})
    assert answer["ok"], answer
    assert rules_of(workspace, "allow") == [("Reading files in data/", None)]
    assert [t for t, _ in rules_of(workspace, "deny")] == ["Running commands", "Deleting notes"]


async def test_a_source_that_is_no_valid_app_is_refused_naming_the_problem(
    installer: Installer, workspace: Path
) -> None:
    bad = source_app(workspace / "bad")
    (bad / "APP.md").write_text(APP.replace("name: notes", "name: Bad_Id"))
    answer = await installer.install({"source": "bad"})
    assert answer["errorCode"] == "tool_failed"
    assert "/workspace/bad/APP.md" in answer["safeMessage"]
    assert "is not an app id" in answer["safeMessage"]
    reserved = source_app(workspace / "reserved", app_id="rules")
    answer = await installer.install({"source": str(reserved.relative_to(workspace))}, "c2")
    assert answer["errorCode"] == "tool_failed" and "reserved" in answer["safeMessage"]
    assert sorted(p.name for p in (workspace / "apps").iterdir()) == ["notes"]


async def test_a_source_holding_a_symlink_is_refused_by_the_installer(
    installer: Installer, workspace: Path
) -> None:
    src = source_app(workspace / "linky")
    (src / "scripts" / "passwd").symlink_to("/etc/passwd")
    answer = await installer.install({"source": "linky"})
    assert answer["errorCode"] == "tool_failed"
    assert "/workspace/linky/scripts/passwd is a symlink" in answer["safeMessage"]
    assert not (workspace / "apps" / "helper").exists()


@pytest.mark.parametrize(
    ("plant_source", "source", "expected"),
    [
        # A symlink out of the grant, at the source and as a parent: never followed.
        ("link-out", "evil", "'/workspace/evil' is a symlink"),
        ("link-out", "evil/.", "'/workspace/evil' is a symlink"),
        ("parent-out", "up/helper-src", "goes through the symlink '/workspace/up'"),
        # One that stays inside is not followed either (the walk follows none).
        ("link-in", "inner", "'/workspace/inner' is a symlink"),
        # Into the apps folder: by the policy step's path, and by a symlink.
        ("none", "apps/notes", "lies in the apps folder"),
        ("none", "/workspace/apps/notes", "lies in the apps folder"),
        ("none", "APPS/notes", "lies in the apps folder"),
        ("link-apps", "sneaky", "'/workspace/sneaky' is a symlink"),
        # Outside every grant.
        ("none", "/etc", "outside"),
        ("none", "../../etc", "outside"),
    ],
)
async def test_a_hostile_source_is_refused_before_anything_is_copied(
    installer: Installer,
    workspace: Path,
    short_tmp: Path,
    plant_source: str,
    source: str,
    expected: str,
) -> None:
    outside = source_app(short_tmp / "outside" / "helper-src")
    source_app(workspace / "inside-src")
    if plant_source == "link-out":
        (workspace / "evil").symlink_to(outside)
    elif plant_source == "parent-out":
        (workspace / "up").symlink_to(outside.parent)
    elif plant_source == "link-in":
        (workspace / "inner").symlink_to("inside-src")
    elif plant_source == "link-apps":
        (workspace / "sneaky").symlink_to("apps/notes")
    answer = await installer.install({"source": source})
    assert answer["errorCode"] == "policy_denied", answer
    assert expected in answer["safeMessage"], answer["safeMessage"]
    assert str(short_tmp) not in answer["safeMessage"]
    assert sorted(p.name for p in (workspace / "apps").iterdir()) == ["notes"]
    assert not [e for e in await installer.gw.audit_entries() if e.get("event") == "app_installed"]


async def test_a_symlink_in_another_grant_is_refused_saying_why_install_follows_none(
    gw: Gateway, workspace: Path, short_tmp: Path
) -> None:
    plant(workspace)
    (workspace / "incoming").mkdir()
    (workspace / "incoming" / "inner").symlink_to(source_app(short_tmp / "out" / "src"))
    policy = POLICY.replace(
        "workspace: {root: ., mode: rw}",
        "workspace: {root: ., mode: rw}\n    incoming: {root: incoming, mode: ro}",
    )
    run = await gw.create_run(workspace, policy)
    tools = admin_tools(
        workspace=workspace,
        actor="tester",
        desk=gw.daemon.app_rule_desk,
        audit=gw.daemon.audit,
        rediscover=_nothing,
        state_dir=gw.daemon.config.state_dir,
    )
    gw.daemon.dispatcher.set_run_tools(run.run_id, ToolRegistry(tools))
    answer = await call(run, "install_app", {"source": "incoming/inner"})
    assert answer["errorCode"] == "policy_denied"
    assert answer["safeMessage"] == (
        "'/workspace/incoming/inner' is a symlink; install_app follows no symlink to its "
        "source, so the folder the policy checked is the folder copied: use the real path"
    )


async def test_the_workspace_itself_is_no_source_it_holds_the_apps(
    installer: Installer, workspace: Path
) -> None:
    (workspace / "APP.md").write_text(APP.replace("name: notes", "name: whole"))
    answer = await installer.install({"source": "."})
    assert answer["errorCode"] == "tool_failed"
    assert "holds /workspace/apps/" in answer["safeMessage"]
    assert str(workspace) not in answer["safeMessage"]
    assert not (workspace / "apps" / "whole").exists()


async def test_install_app_is_granted_by_name_only(gw: Gateway, workspace: Path) -> None:
    plant(workspace)
    source_app(workspace / "src")
    run = await gw.create_run(workspace, POLICY.replace("install_app, app_rules", '"install_*"'))
    tools = admin_tools(
        workspace=workspace,
        actor="tester",
        desk=gw.daemon.app_rule_desk,
        audit=gw.daemon.audit,
        rediscover=_nothing,
        state_dir=gw.daemon.config.state_dir,
    )
    gw.daemon.dispatcher.set_run_tools(run.run_id, ToolRegistry(tools))
    answer = await call(run, "install_app", {"source": "src"})
    assert answer["errorCode"] == "policy_denied"
    assert not (workspace / "apps" / "helper").exists()


async def _nothing() -> None:
    pass


# --- from inside a real sandbox ---------------------------------------------------------

SANDBOX_POLICY = """
version: 1
name: installer-sandboxed
tools:
  allow: [install_app, app_rules]
filesystem:
  paths:
    workspace: {root: ., mode: rw}
limits: {calls_per_second: 1000, burst: 1000}
sandbox: {timeout_s: 30, cpu_s: 20, max_processes: 48, max_output_bytes: 262144}
"""

PLANT_AND_ASK = """
import json, os, subprocess, sys
os.symlink("/etc", "/workspace/evil")                 # out of the grant
os.symlink("apps/notes", "/workspace/sneaky")          # into the apps folder
os.makedirs("/workspace/src/scripts")
with open("/workspace/src/APP.md", "w") as f:
    f.write(sys.argv[2])
calls = json.loads(sys.argv[1])
""" + TOOLS_PROBE.split("calls = json.loads(sys.argv[1])\n", 1)[1]


@pytest.fixture
async def sb(short_tmp: Path) -> AsyncIterator[Sandboxed]:
    base = short_tmp
    base.chmod(0o711)  # the sandbox's uid passes through to its workspace and socket
    async with open_daemon(sandbox_config(base), preload=True) as daemon:
        assert daemon.runs.support.available, daemon.runs.support.reason
        yield Sandboxed(daemon, base)


@sandboxed
async def test_from_inside_a_planted_symlink_installs_nothing_and_loosening_waits(
    sb: Sandboxed,
) -> None:
    ws = sb.workspace()
    plant(ws)
    run = await sb.run(SANDBOX_POLICY, workspace=ws)
    tools = admin_tools(
        workspace=ws,
        actor="tester",
        desk=sb.daemon.app_rule_desk,
        audit=sb.daemon.audit,
        rediscover=_nothing,
        state_dir=sb.daemon.config.state_dir,
    )
    sb.daemon.dispatcher.set_run_tools(run.run_id, ToolRegistry(tools))
    calls = [
        ["install_app", {"source": "evil"}],
        ["install_app", {"source": "sneaky"}],
        ["install_app", {"source": "apps/notes"}],
        ["app_rules", {"app_id": "notes", "action": "add_allow", "rule": "Anything at all"}],
        ["app_rules", {"app_id": "notes", "action": "add_deny", "rule": "Deleting files"}],
        ["install_app", {"source": "src"}],
    ]
    manifest = APP.replace("name: notes", "name: helper")
    result = await sb.py(run, PLANT_AND_ASK, json.dumps(calls), manifest)
    assert result.exitCode == 0, result.stderr
    evil, sneaky, apps, loosen, tighten, good = json.loads(result.stdout)
    for answer in (evil, sneaky, apps):
        assert answer["rc"] == 15 and answer["err"].startswith("cogni-tool: policy_denied: ")
    assert "symlink" in evil["err"] and "symlink" in sneaky["err"]
    assert "apps folder" in apps["err"]
    assert loosen["rc"] == 23, loosen  # confirmation_required
    assert loosen["err"].startswith("cogni-tool: confirmation_required: ")
    (cid,) = sb.daemon.app_rule_desk.pending()
    assert f"gatewayd apps rules confirm {cid}" in loosen["err"]
    assert ("Anything at all", "tester") not in rules_of(ws, "allow")
    assert tighten["rc"] == 0 and ("Deleting files", "tester") in rules_of(ws, "deny")
    assert good["rc"] == 0, good
    assert json.loads(good["out"])["installed"] == "helper"
    assert isinstance(find_app(ws, "helper"), DiscoveredApp)
    assert sorted(p.name for p in (ws / "apps").iterdir()) == ["helper", "notes"]


# --- `gatewayd apps rules` against a real daemon's control socket -------------------------


@pytest.fixture
async def served(short_tmp: Path) -> AsyncIterator[tuple[Daemon, Path]]:
    policies = short_tmp / "policies"
    policies.mkdir()
    config = GatewaydConfig(
        state_dir=short_tmp / "state", policy_dirs=(policies,), os_sandbox=False
    )
    socket_path = short_tmp / "control.sock"
    async with open_daemon(
        config, preload=True, control_socket=socket_path, tools=builtin_tools()
    ) as daemon:
        yield daemon, socket_path


async def cli(socket_path: Path, *words: str) -> subprocess.CompletedProcess[bytes]:
    command = [GATEWAYD, "apps", "rules", words[0], "--control-socket", str(socket_path)]
    env = {**os.environ, "USER": "ops"}
    return await trio.run_process(
        [*command, *words[1:]], capture_stdout=True, capture_stderr=True, check=False, env=env
    )


def out(done: subprocess.CompletedProcess[bytes]) -> str:
    return done.stdout.decode()


def err(done: subprocess.CompletedProcess[bytes]) -> str:
    return done.stderr.decode()


async def test_the_operator_lists_confirms_and_cancels_what_runs_asked_for(
    served: tuple[Daemon, Path], workspace: Path
) -> None:
    daemon, socket_path = served
    plant(workspace)
    desk = daemon.app_rule_desk
    first = await desk.change(workspace, "notes", RuleAction.ADD_ALLOW, "Listing", "eve", "a" * 32)
    second = await desk.change(
        workspace, "notes", RuleAction.REMOVE_DENY, "Running commands", "eve", "a" * 32
    )
    assert isinstance(first, PendingAppRule) and isinstance(second, PendingAppRule)

    listed = await cli(socket_path, "pending")
    assert listed.returncode == 0, err(listed)
    lines = out(listed).splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(f"{first.confirmation_id}  add_allow  'Listing'  app notes in ")
    assert f"(asked by run {'a' * 32}, addedBy eve)" in lines[0]

    confirmed = await cli(socket_path, "confirm", first.confirmation_id)
    assert confirmed.returncode == 0, err(confirmed)
    assert out(confirmed).startswith("APPLIED add_allow 'Listing' to app notes in ")
    assert ("Listing", "eve") in rules_of(workspace, "allow")

    cancelled = await cli(socket_path, "cancel", second.confirmation_id)
    assert cancelled.returncode == 0 and out(cancelled).startswith("CANCELLED remove_deny")
    assert ("Running commands", None) in rules_of(workspace, "deny")

    empty = await cli(socket_path, "pending")
    assert out(empty) == "no app rule changes wait for confirmation\n"

    again = await cli(socket_path, "confirm", first.confirmation_id)
    assert again.returncode == 1
    assert err(again).startswith("gatewayd apps rules: bad_request: no pending app rule change")

    await daemon.audit.durable(daemon.audit.last_seq)
    entries = [
        json.loads(line) for line in daemon.config.resolved_audit_path.read_text().splitlines()
    ]
    changed = [e for e in entries if e.get("event") == "app_rule_changed"]
    assert [e["detail"]["confirmedBy"] for e in changed] == ["ops"]  # --by defaults to $USER


async def test_the_operator_s_own_change_applies_at_once_both_ways(
    served: tuple[Daemon, Path], workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, socket_path = served
    plant(workspace)
    monkeypatch.chdir(workspace.parent)  # a relative --workspace is made absolute
    relative = workspace.name
    loosened = await cli(
        socket_path, "change", "notes", "remove_deny", "Running commands", "--workspace", relative
    )
    assert loosened.returncode == 0, err(loosened)
    assert out(loosened).startswith("APPLIED remove_deny 'Running commands' to app notes")
    assert rules_of(workspace, "deny") == []
    tightened = await cli(
        socket_path,
        "change",
        "notes",
        "add_deny",
        "Deleting",
        "--workspace",
        relative,
        "--by",
        "al",
    )
    assert tightened.returncode == 0 and ("Deleting", "al") in rules_of(workspace, "deny")
    missing = await cli(
        socket_path, "change", "notes", "remove_allow", "Nope", "--workspace", relative
    )
    assert missing.returncode == 1
    assert err(missing).startswith("gatewayd apps rules: invalid_args: app 'notes' has no allow")
    ghost = await cli(socket_path, "change", "ghost", "add_deny", "x", "--workspace", relative)
    assert ghost.returncode == 1 and "there is no app 'ghost'" in err(ghost)
    bad = await cli(socket_path, "change", "notes", "drop", "x", "--workspace", relative)
    assert bad.returncode == 2 and "invalid choice: 'drop'" in err(bad)


async def test_the_control_routes_refuse_what_they_do_not_take(
    served: tuple[Daemon, Path], workspace: Path
) -> None:
    from gatewayd.cli.control_client import control_request

    _, socket_path = served
    plant(workspace)

    def ask(method: str, target: str, body: object | None = None) -> tuple[int, dict[str, Any]]:
        return control_request(socket_path, method, target, body)

    status, answer = await trio.to_thread.run_sync(
        ask,
        "POST",
        "/v1/apps/rules",
        {"workspace": "relative/ws", "app": "notes", "action": "add_deny", "rule": "x"},
    )
    assert status == 400 and "absolute host path" in answer["message"]
    status, answer = await trio.to_thread.run_sync(
        ask,
        "POST",
        "/v1/apps/rules",
        {
            "workspace": str(workspace),
            "app": "notes",
            "action": "add_deny",
            "rule": "x",
            "extra": 1,
        },
    )
    assert status == 400 and answer["errorCode"] == "bad_request"
    status, answer = await trio.to_thread.run_sync(ask, "GET", "/v1/apps/rules/pending/" + "0" * 32)
    assert status == 404 and "POST /v1/apps/rules/pending/{id}/confirm" in answer["message"]
    status, answer = await trio.to_thread.run_sync(
        ask, "POST", f"/v1/apps/rules/pending/{'0' * 32}/confirm", {"by": "ops", "x": 1}
    )
    assert status == 400
    status, answer = await trio.to_thread.run_sync(
        ask, "DELETE", f"/v1/apps/rules/pending/{'0' * 32}"
    )
    assert status == 400 and answer["errorCode"] == "bad_request"
    assert "no pending app rule change" in answer["message"]


def test_the_cli_help_names_the_commands() -> None:
    done = subprocess.run(
        [GATEWAYD, "apps", "rules", "--help"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0
    for command in ("pending", "confirm", "cancel", "change"):
        assert command in done.stdout
