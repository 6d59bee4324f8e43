"""Invariant RESULT_BEFORE_REPLY: no answer leaves gatewayd before its call's result
entry is durable (unless the operator opts out with audit_reply_after_result: false).

Real runs, real unix sockets, real audit logs with real fdatasync. Over the socket, a
watch on the server's send checks, for every kind of answer, that the answer's result
entry is durable (the writer's durable seq, and the line in the file) at the moment the
answer is written to the socket. Straight through the dispatcher, an audit log whose
timer never fires (only waiters make it write) counts the flushes each kind of call
costs, exactly. The crash test under load is tests/integration/test_audit_crash.py.

Answers that are not a call's wait the same way: a refused connection's error frame for
its ``connection_refused`` entry, the control socket's answer to an exec (the command's
exit code) for its ``exec_ended`` entry, and `gatewayd run`'s exit status; an entry the
log cannot take is never answered as if it were there. The egress proxy's error answers:
tests/integration/test_egress.py.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from gatewayd import server
from gatewayd.audit import AuditLog, Peer, open_audit_log, read_entries, verify_file
from gatewayd.cli import run as cli_run
from gatewayd.cli.command import EXIT_FAILED
from gatewayd.config import GatewaydConfig, SandboxUids
from gatewayd.control import ControlServer
from gatewayd.daemon import Daemon, open_daemon
from gatewayd.dispatch import CANCELLED_MESSAGE, Dispatcher
from gatewayd.protocol import ErrorCode, FrameError, Request, Response
from gatewayd.runs import Grant, Run, RunRequest
from gatewayd.tools import builtin_tools
from gatewayd.tools.builtin import builtin_tool
from gatewayd.tools.registry import Tool, ToolContext, ToolRegistry
from tests.conftest import (
    OPEN_POLICY,
    Gateway,
    frame,
    make_gateway,
    raw_exchange,
    request,
    write_policy,
)
from tests.livedaemon import BIN

PEER = Peer(pid=4242, uid=1000, gid=1000)
# Long enough that the audit log's own timer never writes during a test: only a waiter
# (or close) makes the flusher write, so flush counts are exact.
NEVER_DUE_S = 3600.0

POLICY = """
version: 1
name: reply-after-result
tools: {allow: [time.now, "fs.*"]}
filesystem:
  paths:
    workspace: {root: ., mode: rw, suffixes: [.txt, .md], max_file_bytes: 100000}
    docs: {root: docs, mode: ro}
limits: {call_timeout_s: 5, calls_per_second: 100000, burst: 100000, max_concurrent_calls: 64}
"""
# Two calls a run's life: the third is rate_limited.
TIGHT_POLICY = """
version: 1
name: reply-after-result-tight
tools: {allow: [time.now]}
limits: {call_timeout_s: 5, calls_per_second: 0.001, burst: 2}
"""


class Watch:
    """Records, when the server writes an answer to a socket, whether the result entry
    of the answered call (by toolCallId) is durable: the writer's durable seq and the
    line in the file."""

    def __init__(self, audit: AuditLog, monkeypatch: pytest.MonkeyPatch) -> None:
        self.audit = audit
        self.result_seq: dict[str | None, int] = {}
        # toolCallId -> (its result entry's seq, durable seq at send, seq is in the file)
        self.at_send: dict[str | None, tuple[int | None, int, bool]] = {}
        record = audit.record

        def recording(kind: str, **fields: Any) -> int:
            seq = record(kind, **fields)
            if kind == "result":
                self.result_seq[fields.get("toolCallId")] = seq
            return seq

        send = server.Connection._send
        answer_parked = server.Connection.answer_parked

        async def watched_send(conn: server.Connection, response: Response) -> None:
            self._sending(response)
            await send(conn, response)

        # The run's multiplexer sends the answers it released itself.
        def watched_answer_parked(
            conn: server.Connection, responses: list[Response], taken: list[Any]
        ) -> None:
            for response in responses:
                self._sending(response)
            answer_parked(conn, responses, taken)

        monkeypatch.setattr(audit, "record", recording)
        monkeypatch.setattr(server.Connection, "_send", watched_send)
        monkeypatch.setattr(server.Connection, "answer_parked", watched_answer_parked)

    def _sending(self, response: Response) -> None:
        seq = self.result_seq.get(response.toolCallId)
        on_disk = seq is not None and seq in self._seqs_in_file()
        self.at_send[response.toolCallId] = (seq, self.audit.durable_seq, on_disk)

    def _seqs_in_file(self) -> set[int]:
        return seqs_in_file(self.audit.path)


def seqs_in_file(path: Path) -> set[int]:
    """The seqs of the entries the audit file holds now."""
    seqs = set()
    for line in path.read_bytes().split(b"\n"):
        try:
            seqs.add(json.loads(line)["seq"])
        except ValueError:
            continue  # a batch being written: its last line may be cut
    return seqs


def every_kind_of_answer(run: Run, tight: Run) -> list[tuple[Path, bytes, dict[str, str]]]:
    """(socket, pipelined frames, toolCallId -> the answer's errorCode or "ok")."""
    main = [
        (request(run, "fs.write", {"path": "out.txt", "content": "x"}, "write"), "ok"),
        (request(run, "time.now", tcid="now"), "ok"),
        (request(run, "fs.read", {"path": "notes.md"}, "read"), "ok"),
        (request(run, "fs.list", {}, "list"), "ok"),
        (request(run, "fs.stat", {"path": "notes.md"}, "stat"), "ok"),
        (request(run, "tools.list", tcid="tools"), "ok"),
        (request(run, "fs.read", {"path": "absent.md"}, "failed"), "tool_failed"),
        (request(run, "fs.write", {"path": "docs/x.md", "content": "x"}, "ro"), "policy_denied"),
        (request(run, "http.fetch", {"url": "http://x"}, "notallowed"), "policy_denied"),
        (request(run, "time.now", {"zone": "x"}, "badargs"), "invalid_args"),
        (request(run, "no.such", tcid="unknown"), "unknown_tool"),
        ({**request(run, "time.now", tcid="mismatch"), "runId": "run-other"}, "run_mismatch"),
        ({"v": 1, "runId": run.run_id, "toolCallId": "malformed"}, "bad_request"),
    ]
    limited = [(request(tight, "time.now", tcid=f"t{i}"), "ok") for i in range(2)]
    limited.append((request(tight, "time.now", tcid="limited"), "rate_limited"))
    return [
        (
            sock,
            b"".join(frame(body) for body, _ in calls),
            {body["toolCallId"]: code for body, code in calls},
        )
        for sock, calls in ((run.socket_path, main), (tight.socket_path, limited))
    ]


@pytest.mark.parametrize("reply_after_result", [True, False])
async def test_every_kind_of_answer_is_sent_only_once_its_result_entry_is_durable(
    short_tmp: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch, reply_after_result: bool
) -> None:
    """Pipelined on one connection per run: allowed calls with and without side effects,
    a tool failing after it ran, tools.list, policy denials, invalid arguments, an
    unknown tool, a wrong runId, a malformed frame and a rate-limited call. With the
    opt-out, every answer leaves before its result entry is durable (the old way)."""
    async with make_gateway(short_tmp, audit_reply_after_result=reply_after_result) as gw:
        run = await gw.create_run(workspace, POLICY)
        tight = await gw.create_run(workspace, TIGHT_POLICY)
        watch = Watch(gw.daemon.audit, monkeypatch)
        expected: dict[str, str] = {}
        for sock, payload, codes in every_kind_of_answer(run, tight):
            answers = await raw_exchange(sock, payload, expect=len(codes))
            got = {a["toolCallId"]: a.get("errorCode", "ok") for a in answers}
            # Pipelined calls run concurrently: which of the tight run's three takes the
            # last token is not fixed, only that one of them is refused.
            assert set(got) == set(codes), answers
            assert sorted(got.values()) == sorted(codes.values()), answers
            expected.update(codes)
        assert set(watch.at_send) == set(expected)
        for tcid, (seq, durable, on_disk) in watch.at_send.items():
            assert seq is not None, f"{tcid}: no result entry before its answer"
            if reply_after_result:
                assert durable >= seq and on_disk, f"{tcid}: answered before seq {seq} was durable"
            else:
                assert durable < seq, f"{tcid}: the opt-out waited for its result entry"
        entries = await gw.audit_entries()
    for tcid in expected:
        kinds = sorted(e["kind"] for e in entries if e.get("toolCallId") == tcid)
        assert kinds == ["call", "result"], tcid


# --- straight through the dispatcher: flushes per call --------------------------------


@asynccontextmanager
async def dispatcher_on_own_log(
    base: Path, *, reply_after_result: bool, tools: ToolRegistry | None = None
) -> AsyncIterator[Dispatcher]:
    """A dispatcher on a fresh, fdatasync'd audit log whose timer never fires."""
    async with open_audit_log(base / "own-audit.jsonl", sync_delay_s=NEVER_DUE_S) as audit:
        yield Dispatcher(audit, tools or builtin_tools(), reply_after_result=reply_after_result)


def call(run: Run, tool: str, args: dict[str, Any] | None = None, tcid: str = "c1") -> Request:
    return Request(v=1, runId=run.run_id, toolCallId=tcid, tool=tool, args=args or {})


# (what, tool, args, answer, fdatasyncs by default, fdatasyncs with the opt-out)
CALLS = [
    ("side-effect-free", "time.now", {}, "ok", 1, 1),
    ("side-effect-free", "fs.read", {"path": "notes.md"}, "ok", 1, 1),
    ("side-effect-free", "fs.list", {}, "ok", 1, 1),
    ("side-effect-free", "fs.stat", {"path": "notes.md"}, "ok", 1, 1),
    ("side-effect-free", "tools.list", {}, "ok", 1, 1),
    ("failed after it ran", "fs.read", {"path": "absent.md"}, "tool_failed", 1, 1),
    ("side effect", "fs.write", {"path": "out.txt", "content": "x"}, "ok", 2, 1),
    ("side effect", "fs.edit", {"path": "notes.md", "old": "one", "new": "1"}, "ok", 2, 1),
    ("denied", "fs.write", {"path": "docs/x.md", "content": "x"}, "policy_denied", 1, 0),
    ("denied", "http.fetch", {"url": "http://x"}, "policy_denied", 1, 0),
    ("denied", "time.now", {"zone": "x"}, "invalid_args", 1, 0),
    ("denied", "no.such", {}, "unknown_tool", 1, 0),
]


@pytest.mark.parametrize(("what", "tool", "args", "answer", "syncs", "opted_out_syncs"), CALLS)
@pytest.mark.parametrize("reply_after_result", [True, False])
async def test_flushes_per_call_side_effect_free_and_denied_share_one_side_effects_pay_two(
    gateway: Gateway,
    workspace: Path,
    short_tmp: Path,
    reply_after_result: bool,
    what: str,
    tool: str,
    args: dict[str, Any],
    answer: str,
    syncs: int,
    opted_out_syncs: int,
) -> None:
    """By default every answer finds all of its call's entries durable; a side-effect
    tool pays its write-ahead flush and the result's, anything else one flush for both.
    The opt-out restores the old costs: one write-ahead flush per allowed call, nothing
    awaited for denials, and the result entry still queued when the answer leaves."""
    run = await gateway.create_run(workspace, POLICY)
    async with dispatcher_on_own_log(short_tmp, reply_after_result=reply_after_result) as d:
        before = d.audit.fsync_count
        response = await d.handle(run, call(run, tool, args), PEER)
        assert (response.errorCode or "ok") == answer, response
        if reply_after_result:
            assert d.audit.fsync_count - before == syncs
            assert d.audit.durable_seq == d.audit.last_seq  # call and result entries
        else:
            assert d.audit.fsync_count - before == opted_out_syncs
            assert d.audit.durable_seq < d.audit.last_seq  # the result is still queued
    assert run.calls == 1


@pytest.mark.parametrize("reply_after_result", [True, False])
async def test_a_malformed_frame_is_answered_after_one_flush_of_both_its_entries(
    gateway: Gateway, workspace: Path, short_tmp: Path, reply_after_result: bool
) -> None:
    run = await gateway.create_run(workspace, POLICY)
    err = FrameError(
        code=ErrorCode.BAD_REQUEST, message="malformed", tool_call_id="bad", fatal=False
    )
    async with dispatcher_on_own_log(short_tmp, reply_after_result=reply_after_result) as d:
        before = d.audit.fsync_count
        response = await d.refuse_frame(run, err, PEER)
        assert (response.errorCode, response.toolCallId) == (ErrorCode.BAD_REQUEST, "bad")
        assert d.audit.fsync_count - before == (1 if reply_after_result else 0)
        assert (d.audit.durable_seq == d.audit.last_seq) is reply_after_result


async def test_a_rate_limited_call_is_answered_after_one_flush_of_both_its_entries(
    gateway: Gateway, workspace: Path, short_tmp: Path
) -> None:
    run = await gateway.create_run(workspace, TIGHT_POLICY)
    async with dispatcher_on_own_log(short_tmp, reply_after_result=True) as d:
        for i in range(2):
            assert (await d.handle(run, call(run, "time.now", tcid=f"c{i}"), PEER)).ok
        before = d.audit.fsync_count
        response = await d.handle(run, call(run, "time.now", tcid="limited"), PEER)
        assert response.errorCode is ErrorCode.RATE_LIMITED
        assert d.audit.fsync_count - before == 1
        assert d.audit.durable_seq == d.audit.last_seq


# --- cancelled calls ----------------------------------------------------------------


def entries_of(path: Path, tcid: str) -> list[dict[str, Any]]:
    return [e for e in read_entries(path) if e.get("toolCallId") == tcid]


@pytest.mark.parametrize(
    ("tool", "args", "result_code"),
    [
        # Ran before the cancellation reached its wait for the result entry: the result
        # says what happened, not that it was stopped.
        ("time.now", {}, None),
        ("no.such", {}, "unknown_tool"),
        # Cancelled in its write-ahead wait: it never ran, and its result says so.
        ("fs.write", {"path": "out.txt", "content": "x"}, "internal"),
    ],
)
async def test_a_call_cancelled_while_it_waits_for_the_audit_keeps_both_entries(
    gateway: Gateway,
    workspace: Path,
    short_tmp: Path,
    tool: str,
    args: dict[str, Any],
    result_code: str | None,
) -> None:
    """The run or gatewayd ends while the call waits for its entries to be durable: the
    wait is cancelled, nothing is answered, and the entries are still written once
    (the flusher owns what is queued; here, at close)."""
    run = await gateway.create_run(workspace, POLICY)
    async with dispatcher_on_own_log(short_tmp, reply_after_result=True) as d:
        with trio.CancelScope() as scope:
            scope.cancel()  # the run's cancel scope, already cancelled
            await d.handle(run, call(run, tool, args, tcid="stopped"), PEER)
        assert scope.cancelled_caught, "answered despite the cancellation"
        assert d.audit.durable_seq < d.audit.last_seq  # the wait was cancelled
    written = entries_of(d.audit.path, "stopped")
    assert [e["kind"] for e in written] == ["call", "result"]
    assert written[1].get("errorCode") == result_code
    assert not (workspace / "out.txt").exists()
    assert run.calls == 1  # counted once
    assert verify_file(d.audit.path).ok


class _Hang(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


async def _hang(_a: _Hang, _c: ToolContext) -> Any:
    await trio.sleep_forever()


async def test_a_call_cancelled_while_its_tool_runs_still_gets_its_result_entry(
    gateway: Gateway, workspace: Path, short_tmp: Path
) -> None:
    tools = builtin_tools()
    tools.register(
        builtin_tool(name="test.hang", summary="never returns", args_type=_Hang, run=_hang)
    )
    run = await gateway.create_run(workspace, POLICY.replace("time.now,", "time.now, test.hang,"))
    async with (
        dispatcher_on_own_log(short_tmp, reply_after_result=True, tools=tools) as d,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(d.handle, run, call(run, "test.hang", tcid="hung"), PEER)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    written = entries_of(d.audit.path, "hung")
    assert [e["kind"] for e in written] == ["call", "result"]
    assert (written[1]["errorCode"], written[1]["safeMessage"]) == ("internal", CANCELLED_MESSAGE)


# --- fail closed --------------------------------------------------------------------


class _Fill(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


def filling_tool(audit_fd: list[int], *, side_effects: bool) -> Tool[_Fill]:
    """A tool during whose run the audit disk fills up: the log's descriptor is pointed
    at /dev/full, so the next write fails with a real ENOSPC."""

    async def run(_a: _Fill, _c: ToolContext) -> Any:
        full = os.open("/dev/full", os.O_WRONLY | os.O_CLOEXEC)
        os.dup2(full, audit_fd[0])
        os.close(full)
        return {"secret": "the-tools-value"}

    return builtin_tool(
        name="test.fill",
        summary="fills the disk",
        args_type=_Fill,
        run=run,
        side_effects=side_effects,
    )


@pytest.mark.parametrize("side_effects", [True, False])
async def test_a_result_that_cannot_be_made_durable_is_answered_internal_never_with_the_value(
    gateway: Gateway, workspace: Path, short_tmp: Path, side_effects: bool
) -> None:
    audit_fd: list[int] = []
    tools = builtin_tools()
    tools.register(filling_tool(audit_fd, side_effects=side_effects))
    run = await gateway.create_run(workspace, POLICY.replace("time.now,", "time.now, test.fill,"))
    async with dispatcher_on_own_log(short_tmp, reply_after_result=True, tools=tools) as d:
        audit_fd.append(d.audit.fileno())
        response = await d.handle(run, call(run, "test.fill"), PEER)
        assert d.audit.failed
    assert response.errorCode is ErrorCode.INTERNAL
    assert response.value is None
    assert "the-tools-value" not in msgspec.json.encode(response).decode()
    assert response.safeMessage == (
        "the audit log cannot be written, so no call can run; tell the operator"
    )
    assert (run.calls, run.denied_by_code) == (1, {"internal": 1})  # counted once


async def test_a_malformed_frame_on_a_failed_log_is_answered_internal(
    gateway: Gateway, workspace: Path, short_tmp: Path
) -> None:
    run = await gateway.create_run(workspace, POLICY)
    err = FrameError(code=ErrorCode.BAD_REQUEST, message="bad", tool_call_id="bad", fatal=False)
    async with dispatcher_on_own_log(short_tmp, reply_after_result=True) as d:
        full = os.open("/dev/full", os.O_WRONLY | os.O_CLOEXEC)
        os.dup2(full, d.audit.fileno())
        os.close(full)
        response = await d.refuse_frame(run, err, PEER)
    assert (response.errorCode, response.toolCallId) == (ErrorCode.INTERNAL, "bad")
    assert response.safeMessage is not None and "tell the operator" in response.safeMessage
    assert (run.calls, run.denied_by_code) == (1, {"internal": 1})


# --- answers that are not a call's: refused connections, commands, `gatewayd run` ------


class EventWatch:
    """The seqs of ``events`` entries as they are recorded, and, each time :meth:`sent`
    is called (as an answer leaves), the last of them, the durable seq and whether that
    entry's line was in the file."""

    def __init__(self, audit: AuditLog, events: set[str], monkeypatch: pytest.MonkeyPatch) -> None:
        self.audit = audit
        self.seqs: list[int] = []
        self.at_send: list[tuple[int | None, int, bool]] = []
        record = audit.record

        def recording(kind: str, **fields: Any) -> int:
            seq = record(kind, **fields)
            if kind == "event" and fields.get("event") in events:
                self.seqs.append(seq)
            return seq

        monkeypatch.setattr(audit, "record", recording)

    def sent(self) -> None:
        seq = self.seqs[-1] if self.seqs else None
        on_disk = seq is not None and seq in seqs_in_file(self.audit.path)
        self.at_send.append((seq, self.audit.durable_seq, on_disk))

    def assert_each_answer_waited(self, reply_after_result: bool) -> None:
        for seq, durable, on_disk in self.at_send:
            assert seq is not None, "answered before its entry was recorded"
            if reply_after_result:
                assert durable >= seq and on_disk, f"answered before seq {seq} was durable"
            else:
                assert durable < seq, "the opt-out waited for the entry"


def point_at_full_disk(audit: AuditLog) -> None:
    """Make the log's next write fail with a real ENOSPC."""
    full = os.open("/dev/full", os.O_WRONLY | os.O_CLOEXEC)
    os.dup2(full, audit.fileno())
    os.close(full)


@pytest.mark.parametrize("reply_after_result", [True, False])
async def test_a_refused_connection_is_answered_only_once_its_entry_is_durable(
    short_tmp: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch, reply_after_result: bool
) -> None:
    monkeypatch.setattr(server, "MAX_CONNECTIONS_PER_RUN", 1)
    async with make_gateway(short_tmp, audit_reply_after_result=reply_after_result) as gw:
        run = await gw.create_run(workspace, POLICY)
        watch = EventWatch(gw.daemon.audit, {"connection_refused"}, monkeypatch)
        send = server.Connection._send

        async def watched_send(conn: server.Connection, response: Response) -> None:
            watch.sent()
            await send(conn, response)

        monkeypatch.setattr(server.Connection, "_send", watched_send)
        async with await trio.open_unix_socket(str(run.socket_path)):
            await trio.testing.wait_all_tasks_blocked()  # the one connection is served
            [answer] = await raw_exchange(run.socket_path, frame(request(run, "time.now")))
    assert (answer["errorCode"], answer["toolCallId"]) == ("rate_limited", None)
    assert len(watch.at_send) == 1
    watch.assert_each_answer_waited(reply_after_result)


async def test_a_refused_connection_whose_entry_cannot_be_written_is_answered_internal(
    short_tmp: Path, workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server, "MAX_CONNECTIONS_PER_RUN", 1)
    async with make_gateway(short_tmp) as gw:
        run = await gw.create_run(workspace, POLICY)
        async with await trio.open_unix_socket(str(run.socket_path)):
            await trio.testing.wait_all_tasks_blocked()
            point_at_full_disk(gw.daemon.audit)
            [answer] = await raw_exchange(run.socket_path, frame(request(run, "time.now")))
    assert answer["errorCode"] == "internal"
    assert answer["safeMessage"].startswith("the audit log cannot be written")


# Sandboxed runs (the control socket's exec needs one): real bwrap, namespaces, uids.
SYSTEM_PY = "/usr/bin/python3"
needs_sandbox = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/usr/bin/bwrap") or not os.path.exists(SYSTEM_PY),
    reason="a sandboxed run needs root, bubblewrap at /usr/bin/bwrap and /usr/bin/python3",
)
SANDBOX_POLICY = """
version: 1
name: exec-after-result
tools: {allow: [time.now]}
filesystem:
  paths:
    workspace: {root: ., mode: rw}
sandbox: {timeout_s: 30, cpu_s: 20, max_processes: 48}
"""


@asynccontextmanager
async def control_socket_daemon(
    base: Path, *, reply_after_result: bool
) -> AsyncIterator[tuple[Daemon, Path, Run]]:
    """A daemon with the OS sandbox serving its control socket, and one sandboxed run."""
    base.chmod(0o711)  # the sandbox's uid passes through to its workspace and socket
    config = GatewaydConfig(
        state_dir=base / "state",
        policy_dirs=(base,),
        netns_prefix=f"cgr{secrets.token_hex(4)}-",
        sandbox_uids=SandboxUids(base=1_700_000_000 + secrets.randbelow(50_000) * 1024, count=8),
        audit_reply_after_result=reply_after_result,
    )
    ws = base / "ws"
    ws.mkdir()
    policy = write_policy(base, SANDBOX_POLICY, "exec.yaml")
    control = base / "control.sock"
    async with open_daemon(config, preload=True, control_socket=control) as daemon:
        assert daemon.runs.support.available, daemon.runs.support.reason
        run = await daemon.runs.start(
            RunRequest(
                workspacePath=str(ws),
                policy=str(policy),
                actorId="tester",
                tenantId="t1",
                grant=Grant(allowSandbox=True),
            ),
            policy_paths=True,
        )
        yield daemon, control, run


async def control_post(socket_path: Path, target: str, body: dict[str, Any]) -> tuple[int, Any]:
    """One HTTP request on the control socket; (status, decoded JSON body)."""
    data = json.dumps(body).encode()
    head = (
        f"POST {target} HTTP/1.1\r\nHost: gatewayd\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    )
    received = bytearray()
    async with await trio.open_unix_socket(str(socket_path)) as stream:
        await stream.send_all(head.encode() + data)
        with trio.fail_after(60):
            while chunk := await stream.receive_some(65536):
                received += chunk
    status_line, _, rest = bytes(received).partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


@needs_sandbox
@pytest.mark.parametrize("reply_after_result", [True, False])
async def test_a_control_exec_is_answered_only_once_its_exec_ended_entry_is_durable(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch, reply_after_result: bool
) -> None:
    """The answer carries the command's exit code: after a crash the log must hold it
    (``gatewayd exec`` exits with that code)."""
    async with control_socket_daemon(short_tmp, reply_after_result=reply_after_result) as (
        daemon,
        control,
        run,
    ):
        watch = EventWatch(daemon.audit, {"exec_ended"}, monkeypatch)
        send = ControlServer._send

        async def watched_send(
            server_: ControlServer, stream: Any, conn: Any, status: int, payload: Any
        ) -> None:
            watch.sent()
            await send(server_, stream, conn, status, payload)

        monkeypatch.setattr(ControlServer, "_send", watched_send)
        codes = []
        for command in (["true"], ["sh", "-c", "exit 3"], ["sh", "-c", "kill -9 $$"]):
            status, answer = await control_post(
                control, f"/v1/runs/{run.run_id}/exec", {"command": command}
            )
            assert status == 200, answer
            codes.append((answer["result"]["exitCode"], answer["result"]["signal"]))
    assert codes == [(0, None), (3, None), (None, 9)]
    assert len(watch.at_send) == 3
    watch.assert_each_answer_waited(reply_after_result)


# A command that waits for the test's word (a file in the workspace), then prints.
WAITING_COMMAND = [
    "sh",
    "-c",
    "while [ ! -e /workspace/go ]; do sleep 0.01; done; echo the-commands-output",
]


async def with_the_disk_full_when_it_ends(
    daemon: Daemon, ws: Path, ask: Callable[[], Awaitable[None]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run ``ask`` (which runs WAITING_COMMAND); once the command's ``exec_started`` is
    durable (before bwrap starts), fill the audit log's disk, then let it end."""
    started = EventWatch(daemon.audit, {"exec_started"}, monkeypatch)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ask)
        with trio.fail_after(30):
            while not (started.seqs and daemon.audit.durable_seq >= started.seqs[0]):
                await trio.sleep(0.01)
        point_at_full_disk(daemon.audit)
        (ws / "go").touch()


@needs_sandbox
async def test_a_commands_result_is_withheld_when_its_end_cannot_be_audited(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills while the command runs: the answer is a 500 saying so, never the
    exit code or the output the log does not have."""
    answers: list[tuple[int, Any]] = []
    async with control_socket_daemon(short_tmp, reply_after_result=True) as (
        daemon,
        control,
        run,
    ):

        async def ask() -> None:
            target = f"/v1/runs/{run.run_id}/exec"
            answers.append(await control_post(control, target, {"command": WAITING_COMMAND}))

        await with_the_disk_full_when_it_ends(daemon, short_tmp / "ws", ask, monkeypatch)
    [(status, answer)] = answers
    assert status == 500, answer
    assert answer["errorCode"] == "internal"
    assert (
        "the audit log cannot be written, so the command's result is withheld"
        in (answer["message"])
    )
    assert "the-commands-output" not in json.dumps(answer)


@needs_sandbox
async def test_a_sandboxed_gatewayd_run_exits_1_when_its_commands_end_cannot_be_audited(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """`gatewayd run`'s sandboxed path (cli.run._run_in_sandbox, on an in-process daemon):
    exit 1 and why, not the command's 0."""
    statuses: list[int] = []
    async with control_socket_daemon(short_tmp, reply_after_result=True) as (daemon, _, run):

        async def one_shot() -> None:
            statuses.append(await cli_run._run_in_sandbox(daemon, run, WAITING_COMMAND, 60))

        await with_the_disk_full_when_it_ends(daemon, short_tmp / "ws", one_shot, monkeypatch)
    assert statuses == [EXIT_FAILED]
    err = capfd.readouterr().err
    assert "gatewayd: the audit log cannot be written (" in err
    assert "so the command's exit status is not passed on (exit 1)" in err
    assert "ended: its end not audited" in err


def test_gatewayd_run_does_not_pass_on_an_exit_status_its_log_does_not_hold(
    short_tmp: Path, workspace: Path
) -> None:
    """The command (a degraded run's: it runs on the host, as gatewayd's child) caps
    gatewayd's file size at its audit log's size, so the next write to the log fails
    (EFBIG), and exits 0: `gatewayd run` exits 1, saying why, instead of 0."""
    policy = write_policy(short_tmp, OPEN_POLICY, "degraded.yaml")
    audit = short_tmp / "audit" / "audit.jsonl"
    cap = (
        "import os, resource\n"
        f"size = os.path.getsize({str(audit)!r})\n"
        "resource.prlimit(os.getppid(), resource.RLIMIT_FSIZE, (size, size))\n"
    )
    done = subprocess.run(
        [
            str(BIN / "gatewayd"),
            "run",
            "--no-os-sandbox",
            "--state-dir",
            str(short_tmp / "state"),
            "--audit",
            str(audit),
            "--workspace",
            str(workspace),
            "--policy",
            str(policy),
            "--",
            sys.executable,
            "-c",
            cap,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
    )
    assert done.returncode == 1, done.stderr
    assert "gatewayd: the audit log cannot be written (" in done.stderr
    assert "so the command's exit status is not passed on (exit 1)" in done.stderr
    assert "Traceback" not in done.stderr
