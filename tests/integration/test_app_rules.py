"""Changing an app's rules, on real files with a real audit log: the desk (tightening at
once, loosening only when the operator confirms, the operator's own changes), APP.md
rewritten atomically and still valid with its addedBy, a change racing an install, every
error with its code and a message that helps, and the app_rules tool called over a real
run's socket through the real dispatcher."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from gatewayd.apps import ruledesk as ruledesk_module
from gatewayd.apps.admintools import admin_tools
from gatewayd.apps.discovery import DiscoveredApp, find_app
from gatewayd.apps.install import install_app
from gatewayd.apps.manifest import parse_manifest
from gatewayd.apps.rulechange import AppRuleChangeError
from gatewayd.apps.ruledesk import (
    MAX_PENDING_PER_RUN,
    AppliedAppRule,
    AppRuleDesk,
    AppRuleFailed,
    PendingAppRule,
    UnknownConfirmation,
)
from gatewayd.audit import verify_file
from gatewayd.errors import RateLimited
from gatewayd.policy.rule_action import RuleAction
from gatewayd.protocol import ErrorCode
from gatewayd.runs import Run
from gatewayd.tools.registry import ToolRegistry
from tests.conftest import Gateway, frame, make_gateway, read_frame, request

APP = """---
name: notes
title: Notes
description: Keeps notes.
# a YAML comment: the file is rewritten from its parsed form
---

## System Prompt

Keep notes in data/.

## Rules

### Allow
- Reading files in data/
- Writing files in data/ <!-- addedBy: alice -->

### Deny
- Running commands
"""

POLICY = """
version: 1
name: apps-admin
tools:
  allow: [app_rules, "fs.*"]
filesystem:
  paths:
    workspace: {root: ., mode: rw}
limits: {calls_per_second: 1000, burst: 1000, call_timeout_s: 30}
require_os_sandbox: false
"""
RUN = "0" * 32


def plant(ws: Path, app_id: str = "notes", text: str = APP) -> Path:
    folder = ws / "apps" / app_id
    (folder / "data").mkdir(parents=True, exist_ok=True)
    (folder / "APP.md").write_text(text.replace("name: notes", f"name: {app_id}"))
    (folder / "APP.md").chmod(0o640)
    return folder


def manifest_of(ws: Path, app_id: str = "notes") -> Any:
    found = find_app(ws, app_id)
    assert isinstance(found, DiscoveredApp), found
    return found.manifest


def rules_of(ws: Path, side: str, app_id: str = "notes") -> list[tuple[str, str | None]]:
    manifest = manifest_of(ws, app_id)
    rules = manifest.rules.allow if side == "allow" else manifest.rules.deny
    return [(rule.text, rule.added_by) for rule in rules]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
async def gw(short_tmp: Path) -> AsyncIterator[Gateway]:
    async with make_gateway(short_tmp) as gateway:
        yield gateway


@pytest.fixture
def ws(workspace: Path) -> Path:
    plant(workspace)
    return workspace


@pytest.fixture
def desk(gw: Gateway) -> AppRuleDesk:
    return gw.daemon.app_rule_desk


async def events(gw: Gateway, prefix: str = "app_rule") -> list[dict[str, Any]]:
    return [e for e in await gw.audit_entries() if str(e.get("event", "")).startswith(prefix)]


# --- the desk: tightening, loosening, confirming ----------------------------------------


async def test_tightening_applies_at_once_and_app_md_is_rewritten_atomically(
    gw: Gateway, ws: Path, desk: AppRuleDesk
) -> None:
    app_md = ws / "apps" / "notes" / "APP.md"
    before, inode = sha(app_md), app_md.stat().st_ino
    applied = await desk.change(ws, "notes", RuleAction.ADD_DENY, "Deleting files", "bob", RUN)
    assert isinstance(applied, AppliedAppRule)
    assert rules_of(ws, "deny") == [("Running commands", None), ("Deleting files", "bob")]
    assert "- Deleting files <!-- addedBy: bob -->" in app_md.read_text()
    # A new file renamed over the old one, with the old one's mode; nothing left beside it.
    assert app_md.stat().st_ino != inode and app_md.stat().st_mode & 0o777 == 0o640
    assert sorted(p.name for p in app_md.parent.iterdir()) == ["APP.md", "data"]
    assert (applied.before, applied.after) == (before, sha(app_md))

    removed = await desk.change(
        ws, "notes", RuleAction.REMOVE_ALLOW, "Reading files in data/", "c", RUN
    )
    assert isinstance(removed, AppliedAppRule)
    assert rules_of(ws, "allow") == [("Writing files in data/", "alice")]

    (first, second) = await events(gw)
    assert first["event"] == "app_rule_changed" and first["runId"] == RUN
    assert first["detail"] == {
        "app": "notes",
        "workspace": os.path.realpath(ws),
        "action": "add_deny",
        "rule": "Deleting files",
        "addedBy": "bob",
        "runId": RUN,
        "manifestBefore": before,
        "manifestAfter": applied.after,
    }
    assert second["detail"]["action"] == "remove_allow"
    assert second["detail"]["manifestBefore"] == applied.after  # the chain of the file
    assert verify_file(gw.audit_path).ok


@pytest.mark.parametrize("action", [RuleAction.ADD_ALLOW, RuleAction.REMOVE_DENY])
async def test_loosening_from_a_run_waits_and_only_the_confirmation_applies_it(
    gw: Gateway, ws: Path, desk: AppRuleDesk, action: RuleAction
) -> None:
    app_md = ws / "apps" / "notes" / "APP.md"
    rule = "Listing the workspace" if action is RuleAction.ADD_ALLOW else "Running commands"
    before = app_md.read_bytes()
    pending = await desk.change(ws, "notes", action, rule, "eve", RUN)
    assert isinstance(pending, PendingAppRule)
    assert len(pending.confirmation_id) == 32
    assert app_md.read_bytes() == before  # nothing changed
    assert list(desk.pending()) == [pending.confirmation_id]

    applied = await desk.confirm(pending.confirmation_id, "ops")
    assert desk.pending() == {}
    side = rules_of(ws, action.side)
    assert ((rule, "eve") in side) is action.adds and any(t == rule for t, _ in side) is action.adds

    parked, changed = await events(gw)
    assert parked["event"] == "app_rule_pending" and parked["runId"] == RUN
    assert parked["detail"]["confirmationId"] == pending.confirmation_id
    assert parked["detail"]["action"] == str(action) and parked["detail"]["addedBy"] == "eve"
    assert changed["event"] == "app_rule_changed"
    assert changed["detail"]["confirmationId"] == pending.confirmation_id
    assert changed["detail"]["confirmedBy"] == "ops"
    assert changed["detail"]["manifestAfter"] == applied.after == sha(app_md)
    assert verify_file(gw.audit_path).ok


async def test_the_operator_s_own_change_applies_at_once_both_ways(
    gw: Gateway, ws: Path, desk: AppRuleDesk
) -> None:
    applied = await desk.change(
        ws, "notes", RuleAction.ADD_ALLOW, "Listing the workspace", "ops", None, by_operator=True
    )
    assert isinstance(applied, AppliedAppRule) and desk.pending() == {}
    assert ("Listing the workspace", "ops") in rules_of(ws, "allow")
    (entry,) = await events(gw)
    assert entry["event"] == "app_rule_changed" and entry.get("runId") is None
    assert entry["detail"]["runId"] is None


async def test_a_run_s_request_never_takes_the_operator_s_path(ws: Path, desk: AppRuleDesk) -> None:
    with pytest.raises(ValueError, match="belongs to no run"):
        await desk.change(ws, "notes", RuleAction.ADD_ALLOW, "x", None, RUN, by_operator=True)


async def test_cancel_drops_a_pending_change_and_it_cannot_be_confirmed_after(
    gw: Gateway, ws: Path, desk: AppRuleDesk
) -> None:
    pending = await desk.change(ws, "notes", RuleAction.ADD_ALLOW, "Anything", "eve", RUN)
    assert isinstance(pending, PendingAppRule)
    cancelled = await desk.cancel(pending.confirmation_id, "ops")
    assert cancelled.rule == "Anything"
    with pytest.raises(UnknownConfirmation) as caught:
        await desk.confirm(pending.confirmation_id, "ops")
    assert caught.value.code is ErrorCode.BAD_REQUEST
    assert "no pending app rule change" in str(caught.value)
    assert "`gatewayd apps rules pending` lists those waiting" in str(caught.value)
    assert ("Anything", "eve") not in rules_of(ws, "allow")
    _, gone = await events(gw)
    assert gone["event"] == "app_rule_cancelled" and gone["detail"]["cancelledBy"] == "ops"


@pytest.mark.parametrize("verb", ["confirm", "cancel"])
async def test_an_unknown_confirmation_id_is_refused_and_nothing_is_audited(
    gw: Gateway, desk: AppRuleDesk, verb: str
) -> None:
    answer = desk.confirm("0" * 32, "ops") if verb == "confirm" else desk.cancel("0" * 32)
    with pytest.raises(UnknownConfirmation, match=r"no pending app rule change '0{32}'"):
        await answer
    assert await events(gw) == []


async def test_a_confirmation_that_can_no_longer_apply_fails_audited(
    gw: Gateway, ws: Path, desk: AppRuleDesk
) -> None:
    pending = await desk.change(ws, "notes", RuleAction.REMOVE_DENY, "Running commands", "e", RUN)
    assert isinstance(pending, PendingAppRule)
    # Meanwhile the operator removed it (their own change): the confirmation finds nothing.
    await desk.change(
        ws, "notes", RuleAction.REMOVE_DENY, "Running commands", "ops", None, by_operator=True
    )
    with pytest.raises(AppRuleChangeError, match="has no deny rule 'Running commands'"):
        await desk.confirm(pending.confirmation_id, "ops")
    assert desk.pending() == {}
    failed = (await events(gw))[-1]
    assert failed["event"] == "app_rule_change_failed"
    assert failed["errorCode"] == "invalid_args"
    assert failed["detail"]["confirmationId"] == pending.confirmation_id
    assert "has no deny rule" in failed["safeMessage"]


# --- refusals, each with its code -------------------------------------------------------


async def test_changes_that_cannot_be_made_say_why_and_write_nothing(
    gw: Gateway, ws: Path, desk: AppRuleDesk
) -> None:
    plant(ws, "other")
    app_md = ws / "apps" / "notes" / "APP.md"
    before = app_md.read_bytes()
    cases: list[tuple[str, RuleAction, str, str]] = [
        (
            "nope",
            RuleAction.ADD_DENY,
            "x",
            "there is no app 'nope' in this workspace; its apps: notes, other",
        ),
        ("../etc", RuleAction.ADD_DENY, "x", "is not an app id"),
        (
            "notes",
            RuleAction.REMOVE_ALLOW,
            "Nothing like it",
            "has no allow rule 'Nothing like it'",
        ),
        ("notes", RuleAction.ADD_DENY, "Running commands", "already has the deny rule"),
        ("notes", RuleAction.ADD_ALLOW, "Reading files in data/", "already has the allow rule"),
        ("notes", RuleAction.REMOVE_DENY, "Not a rule", "has no deny rule 'Not a rule'"),
    ]
    for app_id, action, rule, message in cases:
        with pytest.raises(AppRuleChangeError) as caught:
            await desk.change(ws, app_id, action, rule, "bob", RUN)
        assert caught.value.code is ErrorCode.INVALID_ARGS
        assert message in str(caught.value), str(caught.value)
    assert app_md.read_bytes() == before
    assert desk.pending() == {} and await events(gw) == []


async def test_an_app_that_is_not_valid_now_is_not_changed(
    gw: Gateway, ws: Path, desk: AppRuleDesk
) -> None:
    (ws / "apps" / "notes" / "APP.md").write_text(APP.replace("title: Notes\n", ""))
    with pytest.raises(AppRuleFailed) as caught:
        await desk.change(ws, "notes", RuleAction.ADD_DENY, "x", None, RUN)
    assert caught.value.code is ErrorCode.TOOL_FAILED
    assert "title: required field is missing" in str(caught.value)
    assert "fix its APP.md first" in str(caught.value)


@pytest.mark.parametrize("what", ["apps", "app"])
async def test_a_symlinked_apps_folder_or_app_folder_is_never_followed(
    gw: Gateway, workspace: Path, short_tmp: Path, desk: AppRuleDesk, what: str
) -> None:
    elsewhere = short_tmp / "elsewhere"
    plant(elsewhere)
    victim = elsewhere / "apps" / "notes" / "APP.md"
    before = victim.read_bytes()
    if what == "apps":
        (workspace / "apps").symlink_to(elsewhere / "apps")
        with pytest.raises(AppRuleFailed, match="it must be a real folder, never a link"):
            await desk.change(workspace, "notes", RuleAction.ADD_DENY, "x", None, RUN)
    else:
        (workspace / "apps").mkdir()
        (workspace / "apps" / "notes").symlink_to(elsewhere / "apps" / "notes")
        with pytest.raises(AppRuleChangeError, match=r"there is no app 'notes' .*apps: none"):
            await desk.change(workspace, "notes", RuleAction.ADD_DENY, "x", None, RUN)
    assert victim.read_bytes() == before


async def test_one_run_cannot_fill_every_pending_slot(ws: Path, desk: AppRuleDesk) -> None:
    for number in range(MAX_PENDING_PER_RUN):
        await desk.change(ws, "notes", RuleAction.ADD_ALLOW, f"Rule {number}", None, RUN)
    with pytest.raises(RateLimited) as caught:
        await desk.change(ws, "notes", RuleAction.ADD_ALLOW, "One more", None, RUN)
    assert caught.value.code is ErrorCode.RATE_LIMITED
    assert f"at most {MAX_PENDING_PER_RUN}" in str(caught.value)
    # Another run still may.
    other = await desk.change(ws, "notes", RuleAction.ADD_ALLOW, "One more", None, "1" * 32)
    assert isinstance(other, PendingAppRule)


async def test_a_failed_write_is_audited_and_leaves_app_md_as_it_was(
    gw: Gateway, ws: Path, desk: AppRuleDesk, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A full disk cannot be made on demand; the write is the only part replaced.
    def full(*_args: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ruledesk_module, "write_atomically_at", full)
    before = (ws / "apps" / "notes" / "APP.md").read_bytes()
    with pytest.raises(AppRuleFailed, match="No space left on device; the change did not happen"):
        await desk.change(ws, "notes", RuleAction.ADD_DENY, "x", None, RUN)
    assert (ws / "apps" / "notes" / "APP.md").read_bytes() == before
    changed, failed = await events(gw)
    assert changed["event"] == "app_rule_changed"  # durable before the write ...
    assert failed["event"] == "app_rule_change_failed"  # ... and undone by this one
    assert failed["errorCode"] == "tool_failed" and failed["detail"]["rule"] == "x"


# --- racing an install --------------------------------------------------------------------


async def test_a_change_waits_for_an_install_and_applies_to_the_app_it_left(
    gw: Gateway, ws: Path, desk: AppRuleDesk
) -> None:
    apps_fd = os.open(ws / "apps", os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(apps_fd, fcntl.LOCK_EX)  # an install under way holds this lock
    try:
        async with trio.open_nursery() as nursery:
            done = trio.Event()

            async def change() -> None:
                await desk.change(ws, "notes", RuleAction.ADD_DENY, "Deleting files", "b", RUN)
                done.set()

            nursery.start_soon(change)
            await trio.sleep(0.3)
            assert not done.is_set()  # it waits for the lock
            # The "install" replaces the app's manifest, then releases the lock.
            replaced = APP.replace("- Running commands", "- Running commands\n- Fetching URLs")
            (ws / "apps" / "notes" / "APP.md").write_text(replaced)
            fcntl.flock(apps_fd, fcntl.LOCK_UN)
            with trio.fail_after(10):
                await done.wait()
    finally:
        os.close(apps_fd)
    # Applied to the replacement, not over it with the old manifest.
    assert [t for t, _ in rules_of(ws, "deny")] == [
        "Running commands",
        "Fetching URLs",
        "Deleting files",
    ]


async def test_a_cancelled_caller_leaves_no_lock_held_and_no_change_half_done(
    gw: Gateway, ws: Path, desk: AppRuleDesk
) -> None:
    apps_fd = os.open(ws / "apps", os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(apps_fd, fcntl.LOCK_EX)
    try:
        async with trio.open_nursery() as nursery:

            async def release_later() -> None:
                await trio.sleep(0.6)
                fcntl.flock(apps_fd, fcntl.LOCK_UN)

            nursery.start_soon(release_later)
            with trio.move_on_after(0.3) as waited:  # the call's timeout, while it waits
                await desk.change(ws, "notes", RuleAction.ADD_DENY, "Deleting", "b", RUN)
    finally:
        os.close(apps_fd)
    assert waited.cancel_called  # cancelled while it waited for the lock
    # Begun, so finished: written and on the record, and the lock released.
    assert ("Deleting", "b") in rules_of(ws, "deny")
    assert [e["event"] for e in await events(gw)] == ["app_rule_changed"]
    with trio.fail_after(5):
        await desk.change(ws, "notes", RuleAction.ADD_DENY, "Another", "b", RUN)


async def test_an_install_that_holds_the_lock_too_long_is_said_so(
    ws: Path, desk: AppRuleDesk, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ruledesk_module, "INSTALL_LOCK_WAIT_S", 0.2)
    apps_fd = os.open(ws / "apps", os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(apps_fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(AppRuleFailed, match=r"has run for more than 0\.2 s; ask again"):
            await desk.change(ws, "notes", RuleAction.ADD_DENY, "x", None, RUN)
    finally:
        os.close(apps_fd)


async def test_changes_racing_replacements_leave_a_valid_app_md_and_its_data(
    gw: Gateway, ws: Path, desk: AppRuleDesk, short_tmp: Path
) -> None:
    source = short_tmp / "src"
    source.mkdir()
    (source / "APP.md").write_text(APP)
    (ws / "apps" / "notes" / "data" / "kept.md").write_text("kept\n")
    errors: list[BaseException] = []

    def replace_often() -> None:
        try:
            for _ in range(8):
                install_app(source, ws, replace=True)
        except BaseException as exc:  # reported below
            errors.append(exc)

    thread = threading.Thread(target=replace_often)
    thread.start()
    applied = 0
    for number in range(8):
        try:
            await desk.change(ws, "notes", RuleAction.ADD_DENY, f"Rule {number}", None, RUN)
            applied += 1
        except AppRuleChangeError:  # the app was between swaps: "no such app"
            pass
    await trio.to_thread.run_sync(thread.join)
    assert errors == []
    assert applied > 0
    parse_manifest((ws / "apps" / "notes" / "APP.md").read_text(), "APP.md")
    assert (ws / "apps" / "notes" / "data" / "kept.md").read_text() == "kept\n"
    assert not [p for p in (ws / "apps" / "notes").iterdir() if p.name.endswith(".tmp")]


# --- the app_rules tool, through the dispatcher on a real run ---------------------------


async def call(run: Run, tool: str, args: dict[str, Any], tcid: str = "c1") -> dict[str, Any]:
    stream = await trio.open_unix_socket(str(run.socket_path))
    async with stream:
        await stream.send_all(frame(request(run, tool, args, tcid)))
        with trio.fail_after(30):
            answer = await read_frame(stream, bytearray())
    assert answer is not None
    return answer


async def admin_run(gw: Gateway, ws: Path, policy: str = POLICY) -> Run:
    run = await gw.create_run(ws, policy)

    async def rediscover() -> None:
        pass

    tools = admin_tools(
        workspace=ws,
        actor=run.spec.request.actorId,
        desk=gw.daemon.app_rule_desk,
        audit=gw.daemon.audit,
        rediscover=rediscover,
        state_dir=gw.daemon.config.state_dir,
    )
    gw.daemon.dispatcher.set_run_tools(run.run_id, ToolRegistry(tools))
    return run


async def test_app_rules_tightens_at_once_with_the_run_s_actor_as_added_by(
    gw: Gateway, ws: Path
) -> None:
    run = await admin_run(gw, ws)
    answer = await call(
        run, "app_rules", {"app_id": "notes", "action": "add_deny", "rule": "Deleting files"}
    )
    assert answer["ok"], answer
    assert answer["value"] == {
        "applied": True,
        "app": "notes",
        "action": "add_deny",
        "rule": "Deleting files",
        "addedBy": "tester",
    }
    assert ("Deleting files", "tester") in rules_of(ws, "deny")
    (entry,) = await events(gw)
    assert entry["runId"] == run.run_id and entry["detail"]["runId"] == run.run_id


@pytest.mark.parametrize(
    ("action", "rule"),
    [("add_allow", "Listing the workspace"), ("remove_deny", "Running commands")],
)
async def test_app_rules_never_loosens_from_a_run_it_answers_confirmation_required(
    gw: Gateway, ws: Path, action: str, rule: str
) -> None:
    run = await admin_run(gw, ws)
    before = (ws / "apps" / "notes" / "APP.md").read_bytes()
    answer = await call(run, "app_rules", {"app_id": "notes", "action": action, "rule": rule})
    assert not answer["ok"]
    assert answer["errorCode"] == "confirmation_required"
    (cid,) = gw.daemon.app_rule_desk.pending()
    message = answer["safeMessage"]
    assert f"id {cid}" in message and f"`gatewayd apps rules confirm {cid}`" in message
    assert "until then the app's rules are unchanged" in message
    # Asking again does not apply it either: a second pending request.
    again = await call(run, "app_rules", {"app_id": "notes", "action": action, "rule": rule}, "c2")
    assert again["errorCode"] == "confirmation_required"
    assert (ws / "apps" / "notes" / "APP.md").read_bytes() == before
    result = [e for e in await gw.audit_entries() if e.get("toolCallId") == "c1"][-1]
    assert result["kind"] == "result" and result["errorCode"] == "confirmation_required"
    await gw.daemon.app_rule_desk.confirm(cid, "ops")
    assert (rule in [t for t, _ in rules_of(ws, RuleAction(action).side)]) is (
        action == "add_allow"
    )


async def test_app_rules_errors_reach_the_caller_with_their_code(gw: Gateway, ws: Path) -> None:
    run = await admin_run(gw, ws)
    missing = await call(
        run, "app_rules", {"app_id": "notes", "action": "remove_allow", "rule": "Nope"}
    )
    assert missing["errorCode"] == "invalid_args"
    assert "its allow rules are: 1. 'Reading files in data/'" in missing["safeMessage"]
    bad = await call(run, "app_rules", {"app_id": "notes", "action": "drop", "rule": "x"}, "c2")
    assert bad["errorCode"] == "invalid_args" and "action" in bad["safeMessage"]
    unknown = await call(
        run, "app_rules", {"app_id": "ghost", "action": "add_deny", "rule": "x"}, "c3"
    )
    assert unknown["errorCode"] == "invalid_args"
    assert "there is no app 'ghost' in this workspace; its apps: notes" in unknown["safeMessage"]


async def test_app_star_does_not_grant_app_rules(gw: Gateway, ws: Path) -> None:
    run = await admin_run(gw, ws, POLICY.replace("[app_rules, ", '["app_*", '))
    answer = await call(run, "app_rules", {"app_id": "notes", "action": "add_deny", "rule": "x"})
    assert answer["errorCode"] == "policy_denied"
    assert rules_of(ws, "deny") == [("Running commands", None)]
