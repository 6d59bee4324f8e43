"""Approvals on a real daemon with a real control socket: calls over real run sockets
wait for the operator, who answers on the control socket or with `gatewayd approvals`;
approve, deny, timeout, withdrawal, the limits, and what approval never does (widen a
call's rights). Sandboxed calls through cogni-tool and a restart while a call waits are
in tests/integration/test_approvals_live.py."""

from __future__ import annotations

import json
import os
import textwrap
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from gatewayd import approvals as approvals_module
from gatewayd.approvals import MAX_PENDING_PER_RUN, MAX_SHOWN_ARGS_BYTES, Approvals
from gatewayd.cli.control_client import control_request
from gatewayd.config import GatewaydConfig
from gatewayd.daemon import open_daemon
from gatewayd.runs import Run
from gatewayd.runs.reload import reload_policies
from tests.conftest import Gateway, frame, make_gateway, raw_exchange, read_frame, request
from tests.livedaemon import BIN

# fs.write waits for the operator; the rest of the run's tools do not. One call slot and
# a one-second call limit: a waiting call must hold neither.
POLICY = """
version: 1
name: approvals
tools:
  allow: [time.now, "fs.*"]
filesystem:
  paths:
    workspace: {root: ., mode: rw}
    docs: {root: docs, mode: ro}
limits:
  call_timeout_s: 1
  calls_per_second: 100000
  burst: 100000
  max_concurrent_calls: 1
approvals:
  required:
    - {tool: fs.write, reason: writes change the workspace}
  timeout_s: 30
require_os_sandbox: false
"""
SHORT_TIMEOUT = POLICY.replace("timeout_s: 30", "timeout_s: 0.5")
PATIENCE_S = 10.0


@dataclass
class Harness:
    gw: Gateway
    control: Path

    @property
    def approvals(self) -> Approvals:
        assert self.gw.daemon.approvals is not None
        return self.gw.daemon.approvals

    async def pending(self, count: int = 1) -> list[dict[str, Any]]:
        """The waiting calls, once there are ``count`` of them."""
        with trio.fail_after(PATIENCE_S):
            while len(waiting := self.approvals.pending()) < count:
                await trio.sleep(0.01)
        return waiting

    async def http(self, method: str, target: str, body: Any = None) -> tuple[int, Any]:
        return await trio.to_thread.run_sync(control_request, self.control, method, target, body)

    async def decide(self, waiting: dict[str, Any], *, approve: bool) -> None:
        """Answer ``waiting`` as root would, in this process (not the control socket)."""
        await self.approvals.decide(
            waiting["approvalId"], approve=approve, by=approvals_module.Operator(uid=0, pid=1)
        )

    async def events(self, name: str) -> list[dict[str, Any]]:
        return [e for e in await self.gw.audit_entries() if e.get("event") == name]


@pytest.fixture
async def harness(short_tmp: Path) -> AsyncIterator[Harness]:
    policies = short_tmp / "policies"
    policies.mkdir()
    # Host mode: these tests read a call's effect (or its absence) in the workspace itself.
    config = GatewaydConfig(
        state_dir=short_tmp / "state",
        policy_dirs=(policies,),
        os_sandbox=False,
        workspace_mode="host",
    )
    control = short_tmp / "control.sock"
    async with open_daemon(config, preload=True, control_socket=control) as daemon:
        yield Harness(Gateway(daemon, policies), control)


class Caller:
    """One call on its own connection, answered in the background."""

    def __init__(self, run: Run, tool: str, args: dict[str, Any], tcid: str) -> None:
        self.payload = frame(request(run, tool, args, tcid=tcid))
        self.socket = run.socket_path
        self.answer: dict[str, Any] | None = None
        self.done = trio.Event()

    async def go(self) -> None:
        try:
            answers = await raw_exchange(self.socket, self.payload)
            self.answer = answers[0] if answers else None  # None: closed unanswered
        finally:
            self.done.set()

    async def result(self) -> dict[str, Any]:
        with trio.fail_after(PATIENCE_S):
            await self.done.wait()
        assert self.answer is not None
        return self.answer


def start(nursery: trio.Nursery, run: Run, tool: str, args: dict[str, Any], tcid: str) -> Caller:
    caller = Caller(run, tool, args, tcid)
    nursery.start_soon(caller.go)
    return caller


async def test_an_approved_call_runs_only_after_the_operator_approves_it(
    harness: Harness, workspace: Path
) -> None:
    run = await harness.gw.create_run(workspace, POLICY)
    async with trio.open_nursery() as nursery:
        call = start(nursery, run, "fs.write", {"path": "out.txt", "content": "hi"}, "w1")
        (waiting,) = await harness.pending()
        assert not (workspace / "out.txt").exists()  # nothing runs before the answer
        status, listed = await harness.http("GET", "/v1/approvals")
        assert status == 200 and listed["approvals"] == [waiting]
        # The operator sees the whole call as the tool will run it, defaults filled in
        # and content included (the audit log keeps only a digest of that).
        assert waiting["args"] == {"path": "out.txt", "content": "hi", "append": False}
        assert waiting["rule"]["reason"] == "writes change the workspace"
        assert (waiting["runId"], waiting["toolCallId"], waiting["tool"]) == (
            run.run_id,
            "w1",
            "fs.write",
        )
        approval_id = waiting["approvalId"]
        status, answer = await harness.http(
            "POST", f"/v1/approvals/{approval_id}/approve", {"by": "alice"}
        )
        assert status == 200 and answer["decided"]["verdict"] == "approved", answer
        result = await call.result()
    assert result["ok"] is True, result
    assert (workspace / "out.txt").read_text() == "hi"
    entries = await harness.gw.audit_entries()
    mine = [e for e in entries if e.get("toolCallId") == "w1"]
    assert [e.get("event") or e["kind"] for e in mine] == [
        "approval_pending",
        "approval_decided",
        "call",
        "result",
    ]
    pending, decided, called, _ = mine
    assert pending["detail"]["approvalId"] == approval_id and pending["argsDigest"]
    assert "hi" not in json.dumps(pending["argsSummary"])  # content is never in the log
    assert decided["detail"]["verdict"] == "approved"
    assert decided["detail"]["decidedBy"] == {
        "kind": "operator",
        "uid": os.getuid(),
        "pid": decided["detail"]["decidedBy"]["pid"],
        "name": "alice",
    }
    assert called["decision"] == "allow" and called["detail"]["approvalId"] == approval_id
    assert harness.approvals.pending() == []
    assert list((harness.gw.daemon.config.state_dir / "approvals").iterdir()) == []


async def test_a_denied_call_never_runs_and_carries_the_operators_reason(
    harness: Harness, workspace: Path
) -> None:
    run = await harness.gw.create_run(workspace, POLICY)
    async with trio.open_nursery() as nursery:
        call = start(nursery, run, "fs.write", {"path": "out.txt", "content": "hi"}, "w1")
        (waiting,) = await harness.pending()
        status, answer = await harness.http(
            "POST", f"/v1/approvals/{waiting['approvalId']}/deny", {"reason": "not on Fridays"}
        )
        assert status == 200 and answer["decided"]["verdict"] == "denied"
        result = await call.result()
    assert result["errorCode"] == "approval_denied"
    assert result["safeMessage"].startswith("the operator denied this call of fs.write")
    assert "not on Fridays" in result["safeMessage"] and "never ran" in result["safeMessage"]
    assert not (workspace / "out.txt").exists()
    entries = [e for e in await harness.gw.audit_entries() if e.get("toolCallId") == "w1"]
    decided = next(e for e in entries if e.get("event") == "approval_decided")
    assert decided["detail"]["reason"] == "not on Fridays"
    assert [(e["kind"], e.get("decision"), e.get("errorCode")) for e in entries[-2:]] == [
        ("call", "deny", "approval_denied"),
        ("result", None, "approval_denied"),
    ]


async def test_nobody_answering_denies_the_call_at_the_policys_timeout(
    harness: Harness, workspace: Path
) -> None:
    run = await harness.gw.create_run(workspace, SHORT_TIMEOUT)
    started = trio.current_time()
    [result] = await raw_exchange(
        run.socket_path, frame(request(run, "fs.write", {"path": "o.txt", "content": "x"}))
    )
    assert 0.5 <= trio.current_time() - started < PATIENCE_S
    assert result["errorCode"] == "approval_denied"
    assert "nobody answered within 0.5 s (approvals.timeout_s)" in result["safeMessage"]
    assert not (workspace / "o.txt").exists()
    (decided,) = await harness.events("approval_decided")
    assert decided["detail"]["verdict"] == "denied"
    assert decided["detail"]["decidedBy"] == {"kind": "timeout"}
    # An operator who answers late is told what happened, not "no such approval".
    status, late = await harness.http(
        "POST", f"/v1/approvals/{decided['detail']['approvalId']}/approve", {}
    )
    assert status == 409 and late["errorCode"] == "bad_request"
    assert "already decided: denied (nobody answered within 0.5 s)" in late["message"]


async def test_the_wait_holds_no_call_slot_and_not_the_calls_own_time_limit(
    harness: Harness, workspace: Path
) -> None:
    # One call slot and a one-second call limit: the waiting write holds neither.
    run = await harness.gw.create_run(workspace, POLICY)
    async with trio.open_nursery() as nursery:
        call = start(nursery, run, "fs.write", {"path": "late.txt", "content": "x"}, "w1")
        (waiting,) = await harness.pending()
        for i in range(5):
            [now] = await raw_exchange(
                run.socket_path, frame(request(run, "time.now", tcid=f"n{i}"))
            )
            assert now["ok"] is True, now
        await trio.sleep(1.5)  # past limits.call_timeout_s
        await harness.decide(waiting, approve=True)
        result = await call.result()
    assert result["ok"] is True, result
    assert (workspace / "late.txt").read_text() == "x"


async def test_calls_past_the_per_run_limit_are_refused_at_once_not_queued(
    harness: Harness, workspace: Path
) -> None:
    run = await harness.gw.create_run(workspace, POLICY)
    async with trio.open_nursery() as nursery:
        waiting = [
            start(nursery, run, "fs.write", {"path": f"w{i}.txt", "content": "x"}, f"w{i}")
            for i in range(MAX_PENDING_PER_RUN)
        ]
        await harness.pending(MAX_PENDING_PER_RUN)
        [extra] = await raw_exchange(
            run.socket_path,
            frame(request(run, "fs.write", {"path": "x.txt", "content": "x"}, tcid="extra")),
        )
        assert extra["errorCode"] == "rate_limited"
        assert f"at most {MAX_PENDING_PER_RUN} per run" in extra["safeMessage"]
        assert "was not asked about" in extra["safeMessage"]
        # The refused one was never pending; the others still are.
        assert len(harness.approvals.pending()) == MAX_PENDING_PER_RUN
        for item in harness.approvals.pending():
            await harness.decide(item, approve=False)
        for call in waiting:
            assert (await call.result())["errorCode"] == "approval_denied"
    pendings = await harness.events("approval_pending")
    assert len(pendings) == MAX_PENDING_PER_RUN
    assert "extra" not in {e["toolCallId"] for e in pendings}


async def test_calls_past_the_daemons_limit_are_refused_whatever_run_asks(
    harness: Harness, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(approvals_module, "MAX_PENDING_APPROVALS", 2)
    first = await harness.gw.create_run(workspace, POLICY)
    second = await harness.gw.create_run(workspace, POLICY)
    async with trio.open_nursery() as nursery:
        start(nursery, first, "fs.write", {"path": "a.txt", "content": "x"}, "a")
        start(nursery, second, "fs.write", {"path": "b.txt", "content": "x"}, "b")
        await harness.pending(2)
        [extra] = await raw_exchange(
            second.socket_path,
            frame(request(second, "fs.write", {"path": "c.txt", "content": "x"}, tcid="c")),
        )
        assert extra["errorCode"] == "rate_limited"
        assert "on this gatewayd (at most 2)" in extra["safeMessage"]
        nursery.cancel_scope.cancel()


async def test_a_caller_that_hangs_up_withdraws_its_call(harness: Harness, workspace: Path) -> None:
    run = await harness.gw.create_run(workspace, POLICY)
    stream = await trio.open_unix_socket(str(run.socket_path))
    payload = request(run, "fs.write", {"path": "gone.txt", "content": "x"}, tcid="g1")
    await stream.send_all(frame(payload))
    await harness.pending()
    await stream.aclose()
    with trio.fail_after(PATIENCE_S):  # withdrawn, then answered to nobody
        while not [e for e in await harness.gw.audit_entries() if e["kind"] == "result"]:
            await trio.sleep(0.05)
    assert harness.approvals.pending() == []
    (decided,) = await harness.events("approval_decided")
    assert decided["detail"]["verdict"] == "withdrawn"
    assert "caller disconnected" in decided["detail"]["reason"]
    assert not (workspace / "gone.txt").exists()
    entries = [e for e in await harness.gw.audit_entries() if e.get("toolCallId") == "g1"]
    assert entries[-1]["kind"] == "result" and entries[-1]["errorCode"] == "approval_denied"


async def test_a_caller_that_only_half_closes_still_gets_its_answer(
    harness: Harness, workspace: Path
) -> None:
    run = await harness.gw.create_run(workspace, POLICY)
    stream = await trio.open_unix_socket(str(run.socket_path))
    async with stream:
        payload = request(run, "fs.write", {"path": "half.txt", "content": "x"}, tcid="h1")
        await stream.send_all(frame(payload))
        await stream.send_eof()  # done sending, still reading
        (waiting,) = await harness.pending()
        await trio.sleep(2 * approvals_module.CALLER_POLL_S)
        assert harness.approvals.pending() == [waiting]
        await harness.decide(waiting, approve=True)
        with trio.fail_after(PATIENCE_S):
            answer = await read_frame(stream, bytearray())
    assert answer is not None and answer["ok"] is True
    assert (workspace / "half.txt").exists()


async def test_a_run_that_ends_withdraws_its_waiting_calls(
    harness: Harness, workspace: Path
) -> None:
    run = await harness.gw.create_run(workspace, POLICY)
    async with trio.open_nursery() as nursery:
        start(nursery, run, "fs.write", {"path": "x.txt", "content": "x"}, "e1")
        await harness.pending()
        await harness.gw.daemon.runs.end(run.run_id, reason="ended_by_operator")
    assert harness.approvals.pending() == []
    (decided,) = await harness.events("approval_decided")
    assert decided["detail"]["verdict"] == "withdrawn"
    assert not (workspace / "x.txt").exists()
    assert list((harness.gw.daemon.config.state_dir / "approvals").iterdir()) == []
    entries = [e for e in await harness.gw.audit_entries() if e.get("toolCallId") == "e1"]
    assert [(e["kind"], e.get("errorCode")) for e in entries if e["kind"] != "event"] == [
        ("call", "approval_denied"),
        ("result", "approval_denied"),
    ]


async def test_approval_never_widens_a_call_the_policy_refuses_is_never_asked(
    harness: Harness, workspace: Path
) -> None:
    run = await harness.gw.create_run(workspace, POLICY)
    [answer] = await raw_exchange(
        run.socket_path,
        frame(request(run, "fs.write", {"path": "docs/x.md", "content": "x"}, tcid="ro")),
    )
    assert answer["errorCode"] == "policy_denied"  # read-only, whatever anyone approves
    assert "read-only" in answer["safeMessage"]
    assert await harness.events("approval_pending") == []


async def test_a_policy_tightened_while_a_call_waits_applies_after_the_approval(
    harness: Harness, workspace: Path
) -> None:
    run = await harness.gw.create_run(workspace, POLICY)
    async with trio.open_nursery() as nursery:
        call = start(nursery, run, "fs.write", {"path": "t.txt", "content": "x"}, "t1")
        (waiting,) = await harness.pending()
        Path(run.spec.policy_source).write_text(
            textwrap.dedent(POLICY).replace('allow: [time.now, "fs.*"]', "allow: [time.now]")
        )
        outcomes = await reload_policies(harness.gw.daemon.registry, harness.gw.daemon.audit)
        assert outcomes[run.run_id] == "reloaded"
        await harness.decide(waiting, approve=True)
        result = await call.result()
    assert result["errorCode"] == "policy_denied"
    assert "was approved, and this run's policy no longer allows it" in result["safeMessage"]
    assert not (workspace / "t.txt").exists()


async def test_calls_the_section_does_not_mark_run_without_asking(
    harness: Harness, workspace: Path
) -> None:
    marked = POLICY.replace(
        "- {tool: fs.write, reason: writes change the workspace}",
        "- {tool: fs.write, args: {path: '\\.env$'}}",
    )
    run = await harness.gw.create_run(workspace, marked)
    [answer] = await raw_exchange(
        run.socket_path, frame(request(run, "fs.write", {"path": "plain.txt", "content": "x"}))
    )
    assert answer["ok"] is True
    assert await harness.events("approval_pending") == []


async def test_arguments_too_large_to_show_are_denied_at_once(
    harness: Harness, workspace: Path
) -> None:
    run = await harness.gw.create_run(workspace, POLICY)
    big = "x" * (MAX_SHOWN_ARGS_BYTES + 10)
    [answer] = await raw_exchange(
        run.socket_path, frame(request(run, "fs.write", {"path": "big.txt", "content": big}))
    )
    assert answer["errorCode"] == "approval_denied"
    assert f"over the {MAX_SHOWN_ARGS_BYTES} bytes an operator is shown" in answer["safeMessage"]
    assert await harness.events("approval_pending") == []


async def test_a_daemon_without_a_control_socket_denies_at_once_saying_why(
    short_tmp: Path, workspace: Path
) -> None:
    async with make_gateway(short_tmp) as gw:
        run = await gw.create_run(workspace, POLICY)
        [answer] = await raw_exchange(
            run.socket_path, frame(request(run, "fs.write", {"path": "o.txt", "content": "x"}))
        )
    assert answer["errorCode"] == "approval_denied"
    assert "has no control socket to ask on" in answer["safeMessage"]
    assert "gatewayd serve" in answer["safeMessage"]


@pytest.mark.parametrize(
    ("target", "body", "status", "words"),
    [
        ("/v1/approvals/" + "a" * 32 + "/approve", {}, 404, "no call waits for approval"),
        ("/v1/approvals/" + "A" * 32 + "/approve", {}, 404, "no route"),
        ("/v1/approvals/" + "a" * 32 + "/maybe", {}, 404, "no route"),
        ("/v1/approvals/" + "a" * 32 + "/deny", {"reason": "a\nb"}, 400, "control characters"),
        ("/v1/approvals/" + "a" * 32 + "/deny", {"reason": "\x1b[2J"}, 400, "control char"),
        ("/v1/approvals/" + "a" * 32 + "/deny", {"why": "x"}, 400, "why"),
        ("/v1/approvals/" + "a" * 32 + "/deny", {"reason": "r" * 501}, 400, "reason"),
    ],
)
async def test_a_bad_answer_is_refused_with_a_message_that_helps(
    harness: Harness, target: str, body: Any, status: int, words: str
) -> None:
    got, answer = await harness.http("POST", target, body)
    assert got == status, answer
    assert answer["ok"] is False and answer["errorCode"] == "bad_request"
    assert words in answer["message"]


async def test_the_cli_lists_and_answers_and_escapes_what_the_sandbox_wrote(
    harness: Harness, workspace: Path
) -> None:
    run = await harness.gw.create_run(workspace, POLICY)
    tricky = "ok\x1b[2J\u202eevil"
    gatewayd = [str(BIN / "gatewayd"), "approvals"]
    where = ["--control-socket", str(harness.control)]
    async with trio.open_nursery() as nursery:
        call = start(nursery, run, "fs.write", {"path": "cli.txt", "content": tricky}, "c1")
        (waiting,) = await harness.pending()
        listed = await trio.run_process([*gatewayd, "list", *where], capture_stdout=True)
        shown = listed.stdout.decode()
        assert waiting["approvalId"] in shown and "fs.write" in shown
        assert "\x1b" not in shown and "\u202e" not in shown
        assert "ok\\u001b[2J\\u202eevil" in shown
        assert f"gatewayd approvals approve|deny {waiting['approvalId']}" in shown
        as_json = await trio.run_process([*gatewayd, "list", "--json", *where], capture_stdout=True)
        assert json.loads(as_json.stdout)["approvals"][0]["args"]["content"] == tricky
        denied = await trio.run_process(
            [*gatewayd, "deny", waiting["approvalId"], "--reason", "no escapes", *where],
            capture_stdout=True,
        )
        assert denied.stdout.decode().startswith(f"DENIED {waiting['approvalId']}: fs.write")
        result = await call.result()
    assert result["errorCode"] == "approval_denied" and "no escapes" in result["safeMessage"]
    (decided,) = await harness.events("approval_decided")
    assert decided["detail"]["decidedBy"]["name"].endswith(f"(uid {os.getuid()})")
    again = await trio.run_process(
        [*gatewayd, "approve", waiting["approvalId"], *where], capture_stderr=True, check=False
    )
    assert again.returncode == 1
    assert "already decided: denied (no escapes)" in again.stderr.decode()


async def test_the_cli_says_when_no_daemon_serves_the_control_socket(short_tmp: Path) -> None:
    absent = short_tmp / "nobody.sock"
    done = await trio.run_process(
        [str(BIN / "gatewayd"), "approvals", "list", "--control-socket", str(absent)],
        capture_stderr=True,
        check=False,
    )
    assert done.returncode == 1
    message = done.stderr.decode()
    assert f"no gatewayd serves the control socket {absent}" in message
    assert "denied its waiting calls when it started again" in message


async def test_records_a_crash_left_are_denied_at_start_even_when_unreadable(
    short_tmp: Path,
) -> None:
    state = short_tmp / "state"
    records = state / "approvals"
    records.mkdir(parents=True)
    good = {
        "approvalId": "a" * 32,
        "runId": "r" * 32,
        "toolCallId": "c1",
        "tool": "fs.write",
        "argsDigest": "sha256:" + "0" * 64,
        "argsSummary": {"path": "x.txt"},
        "peer": {"pid": 7, "uid": 1000, "gid": 1000},
    }
    (records / f"{'a' * 32}.json").write_text(json.dumps(good))
    (records / f"{'b' * 32}.json").write_text('{"approvalId": "bbb')  # torn by the crash
    (records / f"{'c' * 32}.json").write_text(json.dumps({"runId": 5, "peer": "x"}))
    (records / f".{'d' * 32}.json.123.tmp").write_text("half")  # a write never renamed
    config = GatewaydConfig(state_dir=state, policy_dirs=(short_tmp,), os_sandbox=False)
    async with open_daemon(config, preload=True) as daemon:
        entries = [
            json.loads(line)
            for line in daemon.config.resolved_audit_path.read_text().splitlines()
            if line
        ]
    decided = {
        e["detail"]["approvalId"]: e for e in entries if e.get("event") == "approval_decided"
    }
    assert set(decided) == {"a" * 32, "b" * 32, "c" * 32}
    assert all(e["detail"]["verdict"] == "denied" for e in decided.values())
    assert decided["a" * 32]["detail"]["recordReadable"] is True
    assert decided["b" * 32]["detail"]["recordReadable"] is False
    calls = {e.get("toolCallId"): e for e in entries if e["kind"] == "call"}
    assert calls["c1"]["peer"] == {"pid": 7, "uid": 1000, "gid": 1000}
    assert calls["c1"]["errorCode"] == "approval_denied" and calls["c1"]["runId"] == "r" * 32
    assert list(records.iterdir()) == []


async def test_a_link_in_place_of_the_approvals_folder_stops_the_start(short_tmp: Path) -> None:
    state = short_tmp / "state"
    state.mkdir()
    (state / "approvals").symlink_to(short_tmp)
    config = GatewaydConfig(state_dir=state, policy_dirs=(short_tmp,), os_sandbox=False)
    with pytest.raises(BaseException) as info:  # raised inside the daemon's nursery
        async with open_daemon(config, preload=True):
            pass
    refused = info.value
    while isinstance(refused, BaseExceptionGroup):
        refused = refused.exceptions[0]
    assert isinstance(refused, approvals_module.ApprovalStoreError)
    assert "not a directory (a link or a file)" in str(refused)
    assert (state / "approvals").is_symlink()  # nothing followed or removed


# Run as an unprivileged user: ask the control socket to approve, print what happened.
AS_ANOTHER_USER = """
import http.client, json, socket, sys
class Unix(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(sys.argv[1])
conn = Unix("gatewayd")
try:
    conn.request("POST", sys.argv[2], body=b"{}", headers={"content-type": "application/json"})
    answer = conn.getresponse()
    print(json.dumps({"status": answer.status, "body": json.loads(answer.read())}))
except OSError as exc:
    print(json.dumps({"oserror": exc.errno}))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a client as another uid")
async def test_only_the_operator_may_answer_another_user_is_refused(
    harness: Harness, workspace: Path
) -> None:
    run = await harness.gw.create_run(workspace, POLICY)
    async with trio.open_nursery() as nursery:
        start(nursery, run, "fs.write", {"path": "x.txt", "content": "x"}, "u1")
        (waiting,) = await harness.pending()
        target = f"/v1/approvals/{waiting['approvalId']}/approve"

        async def as_nobody() -> dict[str, Any]:
            done = await trio.run_process(
                ["/usr/bin/python3", "-I", "-c", AS_ANOTHER_USER, str(harness.control), target],
                capture_stdout=True,
                user=65534,
            )
            answer: dict[str, Any] = json.loads(done.stdout)
            return answer

        # The socket's own mode keeps other users out first...
        assert (await as_nobody()) == {"oserror": 13}  # EACCES
        # ...and past it (a socket made reachable by mistake), the peer check refuses.
        harness.control.parent.chmod(0o711)
        harness.control.chmod(0o666)
        refused = await as_nobody()
        assert refused["status"] == 403 and refused["body"]["errorCode"] == "authz_denied"
        assert "root only" in refused["body"]["message"]
        assert harness.approvals.pending() == [waiting]  # still waiting, unanswered
        nursery.cancel_scope.cancel()
    assert not (workspace / "x.txt").exists()
